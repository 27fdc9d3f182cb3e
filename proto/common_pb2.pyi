from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FileType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_TYPE_UNSPECIFIED: _ClassVar[FileType]
    FILE: _ClassVar[FileType]
    DIRECTORY: _ClassVar[FileType]
FILE_TYPE_UNSPECIFIED: FileType
FILE: FileType
DIRECTORY: FileType

class ObjectInfo(_message.Message):
    __slots__ = ("path", "size", "version", "mtime", "type")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    version: str
    mtime: float
    type: FileType
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., version: _Optional[str] = ..., mtime: _Optional[float] = ..., type: _Optional[_Union[FileType, str]] = ...) -> None: ...

class MountInfo(_message.Message):
    __slots__ = ("name", "url", "options_json", "read_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    options_json: str
    read_only: bool
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., options_json: _Optional[str] = ..., read_only: _Optional[bool] = ...) -> None: ...

class MetaRequest(_message.Message):
    __slots__ = ("op", "path", "refresh", "recursive", "start_after", "max_entries", "known_version", "plan", "paths", "protocol", "destination", "create_parents", "exist_ok", "client_id", "client_role")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[MetaRequest.Op]
        INFO: _ClassVar[MetaRequest.Op]
        LIST: _ClassVar[MetaRequest.Op]
        VIEW: _ClassVar[MetaRequest.Op]
        STATUS: _ClassVar[MetaRequest.Op]
        PLAN: _ClassVar[MetaRequest.Op]
        LOAD: _ClassVar[MetaRequest.Op]
        HELLO: _ClassVar[MetaRequest.Op]
        REMOVE: _ClassVar[MetaRequest.Op]
        MKDIR: _ClassVar[MetaRequest.Op]
        COPY: _ClassVar[MetaRequest.Op]
        FREE: _ClassVar[MetaRequest.Op]
    NONE: MetaRequest.Op
    INFO: MetaRequest.Op
    LIST: MetaRequest.Op
    VIEW: MetaRequest.Op
    STATUS: MetaRequest.Op
    PLAN: MetaRequest.Op
    LOAD: MetaRequest.Op
    HELLO: MetaRequest.Op
    REMOVE: MetaRequest.Op
    MKDIR: MetaRequest.Op
    COPY: MetaRequest.Op
    FREE: MetaRequest.Op
    OP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    CREATE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ROLE_FIELD_NUMBER: _ClassVar[int]
    op: MetaRequest.Op
    path: str
    refresh: bool
    recursive: bool
    start_after: str
    max_entries: int
    known_version: int
    plan: bytes
    paths: _containers.RepeatedScalarFieldContainer[str]
    protocol: int
    destination: str
    create_parents: bool
    exist_ok: bool
    client_id: str
    client_role: str
    def __init__(self, op: _Optional[_Union[MetaRequest.Op, str]] = ..., path: _Optional[str] = ..., refresh: _Optional[bool] = ..., recursive: _Optional[bool] = ..., start_after: _Optional[str] = ..., max_entries: _Optional[int] = ..., known_version: _Optional[int] = ..., plan: _Optional[bytes] = ..., paths: _Optional[_Iterable[str]] = ..., protocol: _Optional[int] = ..., destination: _Optional[str] = ..., create_parents: _Optional[bool] = ..., exist_ok: _Optional[bool] = ..., client_id: _Optional[str] = ..., client_role: _Optional[str] = ...) -> None: ...

class MetaReply(_message.Message):
    __slots__ = ("error_code", "error_detail", "error_message", "info", "entries", "next_after", "view", "status", "plan", "loading", "role", "protocol", "view_version", "pages_freed")
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_DETAIL_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    error_code: str
    error_detail: str
    error_message: str
    info: ObjectInfo
    entries: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    next_after: str
    view: bytes
    status: bytes
    plan: bytes
    loading: int
    role: str
    protocol: int
    view_version: int
    pages_freed: int
    def __init__(self, error_code: _Optional[str] = ..., error_detail: _Optional[str] = ..., error_message: _Optional[str] = ..., info: _Optional[_Union[ObjectInfo, _Mapping]] = ..., entries: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., next_after: _Optional[str] = ..., view: _Optional[bytes] = ..., status: _Optional[bytes] = ..., plan: _Optional[bytes] = ..., loading: _Optional[int] = ..., role: _Optional[str] = ..., protocol: _Optional[int] = ..., view_version: _Optional[int] = ..., pages_freed: _Optional[int] = ...) -> None: ...
