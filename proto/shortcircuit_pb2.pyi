from cachefs.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShortCircuitRequest(_message.Message):
    __slots__ = ("path", "offset", "length", "version", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    version: str
    token: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., version: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class ShortCircuitReply(_message.Message):
    __slots__ = ("code", "message", "info", "page_offsets", "page_lengths")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[ShortCircuitReply.Code]
        NOT_CACHED: _ClassVar[ShortCircuitReply.Code]
        REFUSED: _ClassVar[ShortCircuitReply.Code]
    OK: ShortCircuitReply.Code
    NOT_CACHED: ShortCircuitReply.Code
    REFUSED: ShortCircuitReply.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PAGE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    code: ShortCircuitReply.Code
    message: str
    info: _common_pb2.ObjectInfo
    page_offsets: _containers.RepeatedScalarFieldContainer[int]
    page_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, code: _Optional[_Union[ShortCircuitReply.Code, str]] = ..., message: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.ObjectInfo, _Mapping]] = ..., page_offsets: _Optional[_Iterable[int]] = ..., page_lengths: _Optional[_Iterable[int]] = ...) -> None: ...
