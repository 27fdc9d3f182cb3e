"""The master's gRPC service: membership, the watched cluster view, the mount table, the
metadata/listing cache (GetInfo, List), Stat, and cluster jobs.

Every exception becomes a precise status through the table in ``cachefs/errors.py``.
Calls that change who serves data or what is cached, or that hand out credentials
(RegisterWorker, Heartbeat, AddMount, RemoveMount, GetMounts with credentials, SubmitJob,
CancelJob) need the cluster token when one is set; reading (the view, metadata, listings,
stat, jobs) does not. Credentials never appear in a log line or an error.
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import fsspec
import grpc

from cachefs.addresses import split_address
from cachefs.auth import TOKEN_METADATA
from cachefs.config import MasterConfig
from cachefs.errors import InvalidPathError, OverloadedError, UnauthenticatedError
from cachefs.mounts import MountSpec, public_url, redact
from cachefs.paths import parse_path, validate_mount_name
from cachefs.server.rpc import info_message, listed_infos, rpc
from cachefs.store.s3config import pin_mount
from cachefs.proto import common_pb2, master_pb2, master_pb2_grpc, worker_pb2
from cachefs.ring import RingConfig
from cachefs.server.master.catalog import Catalog
from cachefs.server.master.forward import LeaderForwarder
from cachefs.server.master.jobs import JobManager
from cachefs.server.master.metrics import MasterMetrics
from cachefs.server.master.state import MasterState
from cachefs.server.master.membership import Member, Membership
from cachefs.server.master.stat import CacheStat
from cachefs.server.master.viewversion import ViewVersion

log = logging.getLogger(__name__)

MAX_WORKER_ID = 128
LIST_BATCH = 1000  # entries per List message: a huge prefix never needs one huge message
MAX_INFOS = 10_000  # paths per GetInfos call
MAX_JOB_ID = 64




def mount_info(spec: MountSpec, with_credentials: bool = False) -> common_pb2.MountInfo:
    """The wire form of a mount; without ``with_credentials`` its options are redacted."""
    options = dict(spec.options) if with_credentials else redact(spec.options)
    return common_pb2.MountInfo(
        name=spec.name, url=spec.url if with_credentials else public_url(spec.url),
        options_json=json.dumps(options, sort_keys=True, default=str), read_only=spec.read_only,
    )


def worker_info(member: Member) -> master_pb2.WorkerInfo:
    info = master_pb2.WorkerInfo(
        worker_id=member.worker_id, address=member.address, version=member.version,
        registered_at=member.registered_at, last_heartbeat=member.last_heartbeat,
    )
    if member.stats is not None:
        info.stats.CopyFrom(member.stats)
    if member.lean is not None:
        info.lean.CopyFrom(member.lean)
    return info


def check_worker_id(worker_id: str) -> str:
    if not worker_id:
        raise InvalidPathError("worker_id is empty")
    if len(worker_id) > MAX_WORKER_ID or not worker_id.isprintable() or any(c.isspace() for c in worker_id):
        raise InvalidPathError(f"worker_id must be 1-{MAX_WORKER_ID} printable characters without spaces")
    return worker_id


def check_address(address: str) -> str:
    try:
        split_address(address)
    except ValueError as exc:
        raise InvalidPathError(str(exc)) from None
    return address


def parse_mount(request: master_pb2.AddMountRequest) -> MountSpec:
    """Validate an AddMount request. Messages name the field, never echo the options."""
    validate_mount_name(request.name)
    if not request.url:
        raise InvalidPathError(f"mount {request.name!r}: url is empty")
    try:
        options = json.loads(request.options_json) if request.options_json else {}
    except ValueError:
        raise InvalidPathError(f"mount {request.name!r}: options_json is not valid JSON") from None
    if not isinstance(options, dict):
        raise InvalidPathError(f"mount {request.name!r}: options_json must be a JSON object")
    protocol = fsspec.core.split_protocol(request.url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):
        raise InvalidPathError(f"mount {request.name!r}: no filesystem for protocol {protocol!r}") from None
    return MountSpec(request.name, request.url, options, request.read_only)


class MasterServicer(master_pb2_grpc.MasterServiceServicer):
    def __init__(
        self,
        config: MasterConfig,
        master_id: str,
        state: MasterState,
        membership: Membership,
        versions: ViewVersion,
        metrics: MasterMetrics,
        stopping: threading.Event,
        max_watchers: int = 256,
        watch_poll_seconds: float = 1.0,
        catalog: Catalog | None = None,
        jobs: JobManager | None = None,
        cache_stat: CacheStat | None = None,
        control: Any = None,
    ) -> None:
        self.config = config
        # Several masters (etcd): the election; a standby forwards leader-only calls to the leader.
        self.control = control
        self.forwarder = LeaderForwarder(master_id, config.tls) if control is not None else None
        self.master_id = master_id
        self.state = state
        self.membership = membership
        self.versions = versions
        self.metrics = metrics
        self.stopping = stopping
        self.max_watchers = max_watchers
        self.watch_poll_seconds = watch_poll_seconds
        self._watch_lock = threading.Lock()
        self._watchers = 0
        self.catalog = catalog
        self.jobs = jobs
        self.cache_stat = cache_stat

    # -- helpers --

    def _authorize(self, context: grpc.ServicerContext, what: str) -> None:
        token = self.config.cluster_token
        if not token:
            return
        presented = ""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                presented = value if isinstance(value, str) else value.decode("utf-8", "replace")
                break
        if not hmac.compare_digest(presented.encode(), token.encode()):
            raise UnauthenticatedError(f"{what} needs the cluster token (gRPC metadata {TOKEN_METADATA!r})")

    def _elsewhere(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        """None when this master serves ``method`` itself (a single master, or the leader once it has
        taken over); else the leader's answer, the call passed on to it."""
        if self.control is None or self.control.serving_epoch():
            return None
        return self.forwarder.forward(method, request, context, self.control.leader(), self.control.leader_hint(),
                                      soon=self.control.etcd_reachable())

    @property
    def leader_epoch(self) -> int:
        return self.control.epoch if self.control is not None else 0

    def build_view(self) -> master_pb2.ClusterView:
        # The version is read first: the contents are then at least that new, so a watcher
        # may see a change twice but never misses one.
        version = self.versions.value
        workers = [worker_info(m) for m in self.membership.live()]
        _, mounts = self.state.mounts()
        view = master_pb2.ClusterView(
            version=version,
            workers=workers,
            mounts=[mount_info(spec) for spec in mounts],
            ring=master_pb2.RingSettings(vnodes=self.config.vnodes, stripe_size=self.config.stripe_size),
            master_id=self.master_id,
        )
        if self.control is not None:
            leader = self.control.leader()
            view.leader_id = leader.get("master_id", "")
            view.leader_epoch = int(leader.get("epoch", 0))
            view.leader_address = leader.get("address", "")
            view.masters.extend(sorted(self.control.state.masters().values()))
        return view

    @contextlib.contextmanager
    def _watch_slot(self) -> Iterator[None]:
        """Each watch holds a server thread: cap them so heartbeats always find one."""
        with self._watch_lock:
            if self._watchers >= self.max_watchers:
                raise OverloadedError(f"too many open WatchView streams ({self.max_watchers}); retry later")
            self._watchers += 1
        self.metrics.watchers.inc()
        try:
            yield
        finally:
            with self._watch_lock:
                self._watchers -= 1
            self.metrics.watchers.dec()

    # -- membership --

    @rpc("RegisterWorker")
    def RegisterWorker(
        self, request: master_pb2.RegisterWorkerRequest, context: grpc.ServicerContext
    ) -> master_pb2.RegisterWorkerResponse:
        forwarded = self._elsewhere("RegisterWorker", request, context)
        if forwarded is not None:
            return forwarded
        self._authorize(context, "RegisterWorker")
        info = request.worker
        check_worker_id(info.worker_id)
        check_address(info.address)
        stats = master_pb2.WorkerStats()
        stats.CopyFrom(info.stats)
        lean = None
        if info.HasField("lean"):
            lean = master_pb2.LeanPaths()
            lean.CopyFrom(info.lean)
        self.membership.register(info.worker_id, info.address, info.version, stats, lean=lean)
        return master_pb2.RegisterWorkerResponse(
            lease_seconds=self.config.lease_seconds,
            heartbeat_seconds=self.config.heartbeat_seconds,
            view_version=self.versions.value,
            mounts_version=self.state.mounts_version,
            leader_epoch=self.leader_epoch,
        )

    @rpc("Heartbeat")
    def Heartbeat(
        self, request: master_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> master_pb2.HeartbeatResponse:
        forwarded = self._elsewhere("Heartbeat", request, context)
        if forwarded is not None:
            return forwarded
        self._authorize(context, "Heartbeat")
        check_worker_id(request.worker_id)
        stats = None
        if request.HasField("stats"):
            stats = master_pb2.WorkerStats()
            stats.CopyFrom(request.stats)
        registered = self.membership.heartbeat(request.worker_id, stats)
        return master_pb2.HeartbeatResponse(
            registered=registered, view_version=self.versions.value, mounts_version=self.state.mounts_version,
            leader_epoch=self.leader_epoch,
        )

    # -- the view --

    @rpc("GetView")
    def GetView(self, request: master_pb2.GetViewRequest, context: grpc.ServicerContext) -> master_pb2.ClusterView:
        return self.build_view()

    @rpc("WatchView", streaming=True, timed=False)
    def WatchView(
        self, request: master_pb2.GetViewRequest, context: grpc.ServicerContext
    ) -> Iterator[master_pb2.ClusterView]:
        # "Differs from" rather than "newer than": a client that holds a view from a master
        # whose state dir was lost has a higher number than this master will reach soon.
        with self._watch_slot():
            context.add_callback(self.versions.wake_all)  # a cancelled watch leaves at once
            known = request.known_version
            while context.is_active() and not self.stopping.is_set():
                if self.versions.value != known:
                    view = self.build_view()
                    known = view.version
                    self.metrics.views_sent.inc()
                    yield view
                else:
                    self.versions.wait_change(known, self.watch_poll_seconds)

    # -- mounts --

    @rpc("AddMount")
    def AddMount(self, request: master_pb2.AddMountRequest, context: grpc.ServicerContext) -> master_pb2.AddMountResponse:
        forwarded = self._elsewhere("AddMount", request, context)
        if forwarded is not None:
            return forwarded
        self._authorize(context, "AddMount")
        spec = pin_mount(parse_mount(request))  # the endpoint and region it resolves to here (#49)
        policy = getattr(self.state, "policy", None)  # the master's PolicedState (cachefs/mountpolicy.py)
        if policy is not None:
            policy.check(spec)  # PERMISSION_DENIED, naming the setting
        version = self.state.add_mount(spec, replace=request.replace)
        if self.control is None:
            self.versions.bump()  # on etcd the watch moves the version (to the write's revision)
        log.info("mount %s %s (%s)", spec.name, "set" if request.replace else "added",
                 fsspec.core.split_protocol(spec.url)[0] or "file")
        return master_pb2.AddMountResponse(mounts_version=version)

    @rpc("RemoveMount")
    def RemoveMount(
        self, request: master_pb2.RemoveMountRequest, context: grpc.ServicerContext
    ) -> master_pb2.RemoveMountResponse:
        forwarded = self._elsewhere("RemoveMount", request, context)
        if forwarded is not None:
            return forwarded
        self._authorize(context, "RemoveMount")
        validate_mount_name(request.name)
        version = self.state.remove_mount(request.name)
        if self.control is None:
            self.versions.bump()
        log.info("mount %s removed", request.name)
        return master_pb2.RemoveMountResponse(mounts_version=version)

    @rpc("GetMounts")
    def GetMounts(self, request: master_pb2.GetMountsRequest, context: grpc.ServicerContext) -> master_pb2.GetMountsResponse:
        if request.with_credentials:
            self._authorize(context, "GetMounts with credentials")
        version, mounts = self.state.mounts()
        return master_pb2.GetMountsResponse(
            mounts_version=version, mounts=[mount_info(s, request.with_credentials) for s in mounts]
        )

    # -- metadata and listing cache --

    def _catalog(self) -> Catalog:
        if self.catalog is None:
            raise NotImplementedError("this master has no metadata cache")
        return self.catalog

    def _jobs(self) -> JobManager:
        if self.jobs is None:
            raise NotImplementedError("this master runs no jobs")
        return self.jobs

    @rpc("GetInfo")
    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.ObjectInfo:
        return info_message(self._catalog().info(parse_path(request.path), refresh=request.refresh))

    @rpc("GetInfos")
    def GetInfos(self, request: master_pb2.GetInfosRequest, context: grpc.ServicerContext) -> master_pb2.GetInfosResponse:
        if len(request.paths) > MAX_INFOS:
            raise InvalidPathError(f"at most {MAX_INFOS} paths per GetInfos call, got {len(request.paths)}")
        catalog = self._catalog()
        results = []
        for path in request.paths:
            try:
                results.append(master_pb2.InfoResult(info=info_message(catalog.info(parse_path(path), request.refresh))))
            except OSError as exc:  # one bad path does not fail the others
                kind = "not found" if isinstance(exc, FileNotFoundError) else (
                    "invalid" if isinstance(exc, InvalidPathError) else "error")
                results.append(master_pb2.InfoResult(error=f"{kind}: {exc}"))
        return master_pb2.GetInfosResponse(results=results)

    @rpc("List", streaming=True)
    def List(self, request: worker_pb2.ListRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.ListResponse]:
        if request.paged:  # one page, by name, as a worker answers it: no reply holds a whole prefix
            yield self._list_page(request)
            return
        path = parse_path(request.path)
        entries = self._catalog().list(path, recursive=request.recursive, refresh=request.refresh)
        for start in range(0, len(entries), LIST_BATCH):
            if not context.is_active():
                return
            yield worker_pb2.ListResponse(entries=listed_infos(entries, start, start + LIST_BATCH))
        if not entries:
            yield worker_pb2.ListResponse()

    def _list_page(self, request: worker_pb2.ListRequest) -> worker_pb2.ListResponse:
        """The entries after ``start_after``, cut from the listing cache's chunk that holds them
        (a chunk is one store request, shared by listers of the prefix): ``cachefs ls`` of a
        million objects asks page after page, and neither side holds the whole listing."""
        after = request.start_after
        chunk = self._catalog().list_chunk(parse_path(request.path), request.recursive, after,
                                           refresh=request.refresh and not after)
        start = bisect.bisect_right(chunk.names, after) if after else 0
        end = min(len(chunk.entries), start + min(LIST_BATCH, request.max_entries or LIST_BATCH))
        more = end < len(chunk.entries) or not chunk.final
        return worker_pb2.ListResponse(entries=listed_infos(chunk.entries, start, end),
                                       next_after=chunk.names[end - 1] if more and end > start else "")

    @rpc("Stat")
    def Stat(self, request: master_pb2.StatRequest, context: grpc.ServicerContext) -> master_pb2.StatResponse:
        if self.cache_stat is None:
            raise NotImplementedError("this master cannot stat")
        members = self.membership.live()
        ring = RingConfig(vnodes=self.config.vnodes, stripe_size=self.config.stripe_size)
        result = self.cache_stat.stat(parse_path(request.path), members, ring, refresh=request.refresh)
        ids = {m.address: m.worker_id for m in members}
        return master_pb2.StatResponse(
            info=info_message(result.root), objects=result.objects, total_bytes=result.total_bytes,
            cached_bytes=result.cached_bytes, truncated=result.truncated,
            workers=[master_pb2.WorkerShare(worker_id=ids.get(address, ""), address=address, cached_bytes=n)
                     for address, n in sorted(result.shares.items())],
        )

    # -- jobs --

    @rpc("SubmitJob")
    def SubmitJob(self, request: master_pb2.SubmitJobRequest, context: grpc.ServicerContext) -> master_pb2.Job:
        forwarded = self._elsewhere("SubmitJob", request, context)
        if forwarded is not None:
            return forwarded
        self._authorize(context, "SubmitJob")
        return self._jobs().submit(request.kind, request.path, request.replicas)

    @rpc("GetJob")
    def GetJob(self, request: master_pb2.GetJobRequest, context: grpc.ServicerContext) -> master_pb2.Job:
        forwarded = self._elsewhere("GetJob", request, context)
        if forwarded is not None:
            return forwarded
        return self._jobs().get(check_job_id(request.job_id))

    @rpc("ListJobs")
    def ListJobs(self, request: master_pb2.ListJobsRequest, context: grpc.ServicerContext) -> master_pb2.ListJobsResponse:
        forwarded = self._elsewhere("ListJobs", request, context)
        if forwarded is not None:
            return forwarded
        return master_pb2.ListJobsResponse(jobs=self._jobs().list(active_only=request.active_only))

    @rpc("CancelJob")
    def CancelJob(self, request: master_pb2.GetJobRequest, context: grpc.ServicerContext) -> master_pb2.Job:
        forwarded = self._elsewhere("CancelJob", request, context)
        if forwarded is not None:
            return forwarded
        self._authorize(context, "CancelJob")
        return self._jobs().cancel(check_job_id(request.job_id))


def check_job_id(job_id: str) -> str:
    if not job_id or len(job_id) > MAX_JOB_ID or not job_id.isalnum():
        raise InvalidPathError(f"job id must be 1-{MAX_JOB_ID} letters and digits, got {job_id[:80]!r}")
    return job_id
