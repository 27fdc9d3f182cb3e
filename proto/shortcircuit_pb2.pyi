from cachefs.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RangeRequest(_message.Message):
    __slots__ = ("path", "offset", "length", "version", "ahead", "fill")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    version: str
    ahead: bool
    fill: bool
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., version: _Optional[str] = ..., ahead: _Optional[bool] = ..., fill: _Optional[bool] = ...) -> None: ...

class ShortCircuitRequest(_message.Message):
    __slots__ = ("ranges", "token", "hello", "touched", "touched_bytes", "load", "plan_job", "plan_position", "plan_reader", "plan_furthest", "touched_pages", "touched_pages_bytes", "by_name", "stale_paths", "meta")
    RANGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PLAN_JOB_FIELD_NUMBER: _ClassVar[int]
    PLAN_POSITION_FIELD_NUMBER: _ClassVar[int]
    PLAN_READER_FIELD_NUMBER: _ClassVar[int]
    PLAN_FURTHEST_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_PAGES_BYTES_FIELD_NUMBER: _ClassVar[int]
    BY_NAME_FIELD_NUMBER: _ClassVar[int]
    STALE_PATHS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[RangeRequest]
    token: str
    hello: bool
    touched: _containers.RepeatedScalarFieldContainer[int]
    touched_bytes: int
    load: _containers.RepeatedScalarFieldContainer[str]
    plan_job: str
    plan_position: int
    plan_reader: int
    plan_furthest: int
    touched_pages: _containers.RepeatedScalarFieldContainer[bytes]
    touched_pages_bytes: int
    by_name: bool
    stale_paths: _containers.RepeatedScalarFieldContainer[str]
    meta: _common_pb2.MetaRequest
    def __init__(self, ranges: _Optional[_Iterable[_Union[RangeRequest, _Mapping]]] = ..., token: _Optional[str] = ..., hello: _Optional[bool] = ..., touched: _Optional[_Iterable[int]] = ..., touched_bytes: _Optional[int] = ..., load: _Optional[_Iterable[str]] = ..., plan_job: _Optional[str] = ..., plan_position: _Optional[int] = ..., plan_reader: _Optional[int] = ..., plan_furthest: _Optional[int] = ..., touched_pages: _Optional[_Iterable[bytes]] = ..., touched_pages_bytes: _Optional[int] = ..., by_name: _Optional[bool] = ..., stale_paths: _Optional[_Iterable[str]] = ..., meta: _Optional[_Union[_common_pb2.MetaRequest, _Mapping]] = ...) -> None: ...

class RangeReply(_message.Message):
    __slots__ = ("code", "message", "errno", "info", "page_offsets", "page_lengths", "slots", "generations", "valid_ms", "filled", "fetched", "once")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[RangeReply.Code]
        NOT_CACHED: _ClassVar[RangeReply.Code]
        REFUSED: _ClassVar[RangeReply.Code]
        FAILED: _ClassVar[RangeReply.Code]
    OK: RangeReply.Code
    NOT_CACHED: RangeReply.Code
    REFUSED: RangeReply.Code
    FAILED: RangeReply.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERRNO_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PAGE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    VALID_MS_FIELD_NUMBER: _ClassVar[int]
    FILLED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    ONCE_FIELD_NUMBER: _ClassVar[int]
    code: RangeReply.Code
    message: str
    errno: int
    info: _common_pb2.ObjectInfo
    page_offsets: _containers.RepeatedScalarFieldContainer[int]
    page_lengths: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    valid_ms: int
    filled: bool
    fetched: _containers.RepeatedScalarFieldContainer[bool]
    once: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, code: _Optional[_Union[RangeReply.Code, str]] = ..., message: _Optional[str] = ..., errno: _Optional[int] = ..., info: _Optional[_Union[_common_pb2.ObjectInfo, _Mapping]] = ..., page_offsets: _Optional[_Iterable[int]] = ..., page_lengths: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., valid_ms: _Optional[int] = ..., filled: _Optional[bool] = ..., fetched: _Optional[_Iterable[bool]] = ..., once: _Optional[_Iterable[bool]] = ...) -> None: ...

class ShortCircuitReply(_message.Message):
    __slots__ = ("ranges", "message", "refused", "instance", "table_slots", "page_size", "answered", "loading", "names_slots", "page_dirs", "page_dir_quotas", "page_dir_ids", "meta", "view_version")
    RANGES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TABLE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    NAMES_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIRS_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIR_QUOTAS_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIR_IDS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[RangeReply]
    message: str
    refused: bool
    instance: str
    table_slots: int
    page_size: int
    answered: bool
    loading: int
    names_slots: int
    page_dirs: _containers.RepeatedScalarFieldContainer[str]
    page_dir_quotas: _containers.RepeatedScalarFieldContainer[int]
    page_dir_ids: _containers.RepeatedScalarFieldContainer[str]
    meta: _common_pb2.MetaReply
    view_version: int
    def __init__(self, ranges: _Optional[_Iterable[_Union[RangeReply, _Mapping]]] = ..., message: _Optional[str] = ..., refused: _Optional[bool] = ..., instance: _Optional[str] = ..., table_slots: _Optional[int] = ..., page_size: _Optional[int] = ..., answered: _Optional[bool] = ..., loading: _Optional[int] = ..., names_slots: _Optional[int] = ..., page_dirs: _Optional[_Iterable[str]] = ..., page_dir_quotas: _Optional[_Iterable[int]] = ..., page_dir_ids: _Optional[_Iterable[str]] = ..., meta: _Optional[_Union[_common_pb2.MetaReply, _Mapping]] = ..., view_version: _Optional[int] = ...) -> None: ...
