from cachefs.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataRequest(_message.Message):
    __slots__ = ("path", "offset", "length", "version", "token", "fill", "meta", "write")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    version: str
    token: str
    fill: bool
    meta: _common_pb2.MetaRequest
    write: WritePart
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., version: _Optional[str] = ..., token: _Optional[str] = ..., fill: _Optional[bool] = ..., meta: _Optional[_Union[_common_pb2.MetaRequest, _Mapping]] = ..., write: _Optional[_Union[WritePart, _Mapping]] = ...) -> None: ...

class WritePart(_message.Message):
    __slots__ = ("path", "size_hint", "length", "commit", "abort")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_HINT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_hint: int
    length: int
    commit: bool
    abort: bool
    def __init__(self, path: _Optional[str] = ..., size_hint: _Optional[int] = ..., length: _Optional[int] = ..., commit: _Optional[bool] = ..., abort: _Optional[bool] = ...) -> None: ...

class DataSegment(_message.Message):
    __slots__ = ("offset", "length", "checksum", "verified", "fetched")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    checksum: int
    verified: bool
    fetched: bool
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., verified: _Optional[bool] = ..., fetched: _Optional[bool] = ...) -> None: ...

class DataReply(_message.Message):
    __slots__ = ("code", "message", "info", "segments", "errno", "meta", "view_version", "filled", "retry_after_ms")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[DataReply.Code]
        NOT_CACHED: _ClassVar[DataReply.Code]
        REFUSED: _ClassVar[DataReply.Code]
        FAILED: _ClassVar[DataReply.Code]
    OK: DataReply.Code
    NOT_CACHED: DataReply.Code
    REFUSED: DataReply.Code
    FAILED: DataReply.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ERRNO_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    FILLED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: DataReply.Code
    message: str
    info: _common_pb2.ObjectInfo
    segments: _containers.RepeatedCompositeFieldContainer[DataSegment]
    errno: int
    meta: _common_pb2.MetaReply
    view_version: int
    filled: bool
    retry_after_ms: int
    def __init__(self, code: _Optional[_Union[DataReply.Code, str]] = ..., message: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.ObjectInfo, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[DataSegment, _Mapping]]] = ..., errno: _Optional[int] = ..., meta: _Optional[_Union[_common_pb2.MetaReply, _Mapping]] = ..., view_version: _Optional[int] = ..., filled: _Optional[bool] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...
