from cachefs.proto import common_pb2 as _common_pb2
from cachefs.proto import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_KIND_UNSPECIFIED: _ClassVar[JobKind]
    LOAD: _ClassVar[JobKind]
    FREE: _ClassVar[JobKind]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PENDING: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
JOB_KIND_UNSPECIFIED: JobKind
LOAD: JobKind
FREE: JobKind
JOB_STATE_UNSPECIFIED: JobState
PENDING: JobState
RUNNING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLED: JobState

class GetInfosRequest(_message.Message):
    __slots__ = ("paths", "refresh")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    refresh: bool
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., refresh: _Optional[bool] = ...) -> None: ...

class GetInfosResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[InfoResult]
    def __init__(self, results: _Optional[_Iterable[_Union[InfoResult, _Mapping]]] = ...) -> None: ...

class InfoResult(_message.Message):
    __slots__ = ("info", "error")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ObjectInfo
    error: str
    def __init__(self, info: _Optional[_Union[_common_pb2.ObjectInfo, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("path", "refresh")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    path: str
    refresh: bool
    def __init__(self, path: _Optional[str] = ..., refresh: _Optional[bool] = ...) -> None: ...

class WorkerShare(_message.Message):
    __slots__ = ("worker_id", "address", "cached_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    cached_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., cached_bytes: _Optional[int] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("info", "objects", "total_bytes", "cached_bytes", "workers", "truncated")
    INFO_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ObjectInfo
    objects: int
    total_bytes: int
    cached_bytes: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerShare]
    truncated: bool
    def __init__(self, info: _Optional[_Union[_common_pb2.ObjectInfo, _Mapping]] = ..., objects: _Optional[int] = ..., total_bytes: _Optional[int] = ..., cached_bytes: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerShare, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "kind", "path", "replicas", "state", "objects_total", "objects_done", "objects_failed", "bytes_total", "bytes_done", "bytes_skipped", "error", "created_at", "updated_at", "finished_at", "listing")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_DONE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    LISTING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: JobKind
    path: str
    replicas: int
    state: JobState
    objects_total: int
    objects_done: int
    objects_failed: int
    bytes_total: int
    bytes_done: int
    bytes_skipped: int
    error: str
    created_at: float
    updated_at: float
    finished_at: float
    listing: bool
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., path: _Optional[str] = ..., replicas: _Optional[int] = ..., state: _Optional[_Union[JobState, str]] = ..., objects_total: _Optional[int] = ..., objects_done: _Optional[int] = ..., objects_failed: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_skipped: _Optional[int] = ..., error: _Optional[str] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., listing: _Optional[bool] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("kind", "path", "replicas")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    kind: JobKind
    path: str
    replicas: int
    def __init__(self, kind: _Optional[_Union[JobKind, str]] = ..., path: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("active_only",)
    ACTIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    active_only: bool
    def __init__(self, active_only: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "pages", "hits", "misses", "bytes_from_cache", "bytes_from_store", "eviction_policy", "plans", "bypassed_admissions")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    BYPASSED_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    bytes_from_cache: int
    bytes_from_store: int
    eviction_policy: str
    plans: int
    bypassed_admissions: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_from_cache: _Optional[int] = ..., bytes_from_store: _Optional[int] = ..., eviction_policy: _Optional[str] = ..., plans: _Optional[int] = ..., bypassed_admissions: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "stats", "registered_at", "last_heartbeat", "version", "lean")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEAN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    stats: WorkerStats
    registered_at: float
    last_heartbeat: float
    version: str
    lean: LeanPaths
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ..., registered_at: _Optional[float] = ..., last_heartbeat: _Optional[float] = ..., version: _Optional[str] = ..., lean: _Optional[_Union[LeanPaths, _Mapping]] = ...) -> None: ...

class LeanPaths(_message.Message):
    __slots__ = ("host_id", "short_circuit_socket", "data_port", "page_size")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHORT_CIRCUIT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    short_circuit_socket: str
    data_port: int
    page_size: int
    def __init__(self, host_id: _Optional[str] = ..., short_circuit_socket: _Optional[str] = ..., data_port: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...

class RingSettings(_message.Message):
    __slots__ = ("vnodes", "stripe_size")
    VNODES_FIELD_NUMBER: _ClassVar[int]
    STRIPE_SIZE_FIELD_NUMBER: _ClassVar[int]
    vnodes: int
    stripe_size: int
    def __init__(self, vnodes: _Optional[int] = ..., stripe_size: _Optional[int] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("version", "workers", "mounts", "ring", "master_id", "leader_id", "leader_epoch", "leader_address", "masters")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    mounts: _containers.RepeatedCompositeFieldContainer[_common_pb2.MountInfo]
    ring: RingSettings
    master_id: str
    leader_id: str
    leader_epoch: int
    leader_address: str
    masters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., mounts: _Optional[_Iterable[_Union[_common_pb2.MountInfo, _Mapping]]] = ..., ring: _Optional[_Union[RingSettings, _Mapping]] = ..., master_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., leader_address: _Optional[str] = ..., masters: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("lease_seconds", "heartbeat_seconds", "view_version", "mounts_version", "leader_epoch")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    heartbeat_seconds: float
    view_version: int
    mounts_version: int
    leader_epoch: int
    def __init__(self, lease_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ..., view_version: _Optional[int] = ..., mounts_version: _Optional[int] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("registered", "view_version", "mounts_version", "leader_epoch")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    registered: bool
    view_version: int
    mounts_version: int
    leader_epoch: int
    def __init__(self, registered: _Optional[bool] = ..., view_version: _Optional[int] = ..., mounts_version: _Optional[int] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class GetViewRequest(_message.Message):
    __slots__ = ("known_version",)
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    known_version: int
    def __init__(self, known_version: _Optional[int] = ...) -> None: ...

class AddMountRequest(_message.Message):
    __slots__ = ("name", "url", "options_json", "read_only", "replace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    options_json: str
    read_only: bool
    replace: bool
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., options_json: _Optional[str] = ..., read_only: _Optional[bool] = ..., replace: _Optional[bool] = ...) -> None: ...

class AddMountResponse(_message.Message):
    __slots__ = ("mounts_version",)
    MOUNTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    mounts_version: int
    def __init__(self, mounts_version: _Optional[int] = ...) -> None: ...

class RemoveMountRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveMountResponse(_message.Message):
    __slots__ = ("mounts_version",)
    MOUNTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    mounts_version: int
    def __init__(self, mounts_version: _Optional[int] = ...) -> None: ...

class GetMountsRequest(_message.Message):
    __slots__ = ("with_credentials",)
    WITH_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    with_credentials: bool
    def __init__(self, with_credentials: _Optional[bool] = ...) -> None: ...

class GetMountsResponse(_message.Message):
    __slots__ = ("mounts_version", "mounts")
    MOUNTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    mounts_version: int
    mounts: _containers.RepeatedCompositeFieldContainer[_common_pb2.MountInfo]
    def __init__(self, mounts_version: _Optional[int] = ..., mounts: _Optional[_Iterable[_Union[_common_pb2.MountInfo, _Mapping]]] = ...) -> None: ...
