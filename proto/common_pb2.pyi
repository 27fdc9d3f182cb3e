from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
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
