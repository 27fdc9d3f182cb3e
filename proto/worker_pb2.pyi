from cachefs.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadRequest(_message.Message):
    __slots__ = ("path", "offset", "length", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    version: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class ReadChunk(_message.Message):
    __slots__ = ("offset", "data", "info", "pages_hit", "pages_missed")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    PAGES_HIT_FIELD_NUMBER: _ClassVar[int]
    PAGES_MISSED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    info: _common_pb2.ObjectInfo
    pages_hit: int
    pages_missed: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., info: _Optional[_Union[_common_pb2.ObjectInfo, _Mapping]] = ..., pages_hit: _Optional[int] = ..., pages_missed: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("path", "refresh")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    path: str
    refresh: bool
    def __init__(self, path: _Optional[str] = ..., refresh: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("path", "recursive", "refresh", "paged", "start_after", "max_entries")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    PAGED_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    path: str
    recursive: bool
    refresh: bool
    paged: bool
    start_after: str
    max_entries: int
    def __init__(self, path: _Optional[str] = ..., recursive: _Optional[bool] = ..., refresh: _Optional[bool] = ..., paged: _Optional[bool] = ..., start_after: _Optional[str] = ..., max_entries: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "next_after")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectInfo]
    next_after: str
    def __init__(self, entries: _Optional[_Iterable[_Union[_common_pb2.ObjectInfo, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class ListMountsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMountsResponse(_message.Message):
    __slots__ = ("mounts",)
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    mounts: _containers.RepeatedCompositeFieldContainer[_common_pb2.MountInfo]
    def __init__(self, mounts: _Optional[_Iterable[_Union[_common_pb2.MountInfo, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "version", "page_size", "pages", "used_bytes", "capacity_bytes", "hits", "misses", "evictions", "bytes_from_cache", "bytes_from_store", "degraded", "disk_errors", "corrupt_pages", "stores_unavailable", "short_circuit_socket", "host_id", "data_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DISK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORES_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SHORT_CIRCUIT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: str
    page_size: int
    pages: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    bytes_from_cache: int
    bytes_from_store: int
    degraded: bool
    disk_errors: int
    corrupt_pages: int
    stores_unavailable: _containers.RepeatedScalarFieldContainer[str]
    short_circuit_socket: str
    host_id: str
    data_port: int
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[str] = ..., page_size: _Optional[int] = ..., pages: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_from_cache: _Optional[int] = ..., bytes_from_store: _Optional[int] = ..., degraded: _Optional[bool] = ..., disk_errors: _Optional[int] = ..., corrupt_pages: _Optional[int] = ..., stores_unavailable: _Optional[_Iterable[str]] = ..., short_circuit_socket: _Optional[str] = ..., host_id: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("paths", "hint", "leader_epoch")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    hint: bool
    leader_epoch: int
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., hint: _Optional[bool] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("objects_loaded", "bytes_loaded", "bytes_skipped", "failed")
    OBJECTS_LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    objects_loaded: int
    bytes_loaded: int
    bytes_skipped: int
    failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, objects_loaded: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., bytes_skipped: _Optional[int] = ..., failed: _Optional[_Iterable[str]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("prefix", "leader_epoch")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    leader_epoch: int
    def __init__(self, prefix: _Optional[str] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("pages_freed",)
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    def __init__(self, pages_freed: _Optional[int] = ...) -> None: ...

class GetCachedRequest(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class GetCachedResponse(_message.Message):
    __slots__ = ("cached_bytes",)
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    cached_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cached_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class WriteChunk(_message.Message):
    __slots__ = ("path", "data", "size_hint", "commit")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_HINT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    size_hint: int
    commit: bool
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ..., size_hint: _Optional[int] = ..., commit: _Optional[bool] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("path", "recursive")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    path: str
    recursive: bool
    def __init__(self, path: _Optional[str] = ..., recursive: _Optional[bool] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("pages_freed",)
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    def __init__(self, pages_freed: _Optional[int] = ...) -> None: ...

class MakeDirRequest(_message.Message):
    __slots__ = ("path", "create_parents", "exist_ok")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CREATE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    path: str
    create_parents: bool
    exist_ok: bool
    def __init__(self, path: _Optional[str] = ..., create_parents: _Optional[bool] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class MakeDirResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CopyRequest(_message.Message):
    __slots__ = ("source", "destination")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    source: str
    destination: str
    def __init__(self, source: _Optional[str] = ..., destination: _Optional[str] = ...) -> None: ...

class PlanRun(_message.Message):
    __slots__ = ("path", "offset", "length", "positions")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("job", "replace", "runs", "done", "position", "rate", "lease_seconds", "no_prefetch", "index_id", "index_samples", "index_paths", "index_path_lengths", "index_offsets", "index_lengths", "index_size", "index_done", "order")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INDEX_PATHS_FIELD_NUMBER: _ClassVar[int]
    INDEX_PATH_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    INDEX_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    INDEX_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    INDEX_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_DONE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    job: str
    replace: bool
    runs: _containers.RepeatedCompositeFieldContainer[PlanRun]
    done: bool
    position: int
    rate: float
    lease_seconds: float
    no_prefetch: bool
    index_id: str
    index_samples: _containers.RepeatedScalarFieldContainer[int]
    index_paths: bytes
    index_path_lengths: _containers.RepeatedScalarFieldContainer[int]
    index_offsets: _containers.RepeatedScalarFieldContainer[int]
    index_lengths: _containers.RepeatedScalarFieldContainer[int]
    index_size: int
    index_done: bool
    order: PlanOrder
    def __init__(self, job: _Optional[str] = ..., replace: _Optional[bool] = ..., runs: _Optional[_Iterable[_Union[PlanRun, _Mapping]]] = ..., done: _Optional[bool] = ..., position: _Optional[int] = ..., rate: _Optional[float] = ..., lease_seconds: _Optional[float] = ..., no_prefetch: _Optional[bool] = ..., index_id: _Optional[str] = ..., index_samples: _Optional[_Iterable[int]] = ..., index_paths: _Optional[bytes] = ..., index_path_lengths: _Optional[_Iterable[int]] = ..., index_offsets: _Optional[_Iterable[int]] = ..., index_lengths: _Optional[_Iterable[int]] = ..., index_size: _Optional[int] = ..., index_done: _Optional[bool] = ..., order: _Optional[_Union[PlanOrder, _Mapping]] = ...) -> None: ...

class PlanOrder(_message.Message):
    __slots__ = ("kind", "n_samples", "seed", "epoch", "rank", "world_size", "shuffle", "drop_last", "offset", "start", "digest")
    KIND_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    kind: str
    n_samples: int
    seed: int
    epoch: int
    rank: int
    world_size: int
    shuffle: bool
    drop_last: bool
    offset: int
    start: int
    digest: str
    def __init__(self, kind: _Optional[str] = ..., n_samples: _Optional[int] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., shuffle: _Optional[bool] = ..., drop_last: _Optional[bool] = ..., offset: _Optional[int] = ..., start: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("known", "capacity_bytes", "jobs", "policy", "prefetches", "index_known", "derived")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    INDEX_KNOWN_FIELD_NUMBER: _ClassVar[int]
    DERIVED_FIELD_NUMBER: _ClassVar[int]
    known: bool
    capacity_bytes: int
    jobs: int
    policy: str
    prefetches: bool
    index_known: bool
    derived: bool
    def __init__(self, known: _Optional[bool] = ..., capacity_bytes: _Optional[int] = ..., jobs: _Optional[int] = ..., policy: _Optional[str] = ..., prefetches: _Optional[bool] = ..., index_known: _Optional[bool] = ..., derived: _Optional[bool] = ...) -> None: ...
