"""The worker's gRPC service: parses and checks requests, maps errors to precise statuses."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from cachefs import __version__
from cachefs.errors import DeadlineExceededError, InvalidPathError, StaleObjectError
from cachefs.mounts import MountTable
from cachefs.localhost import host_id
from cachefs.paths import CachePath, parse_path
from cachefs.server.rpc import info_message, listed_infos, rpc
from cachefs.proto import common_pb2, worker_pb2, worker_pb2_grpc
from cachefs.server.worker.epoch import EpochGuard
from cachefs.server.worker.metrics import WorkerMetrics
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore
from cachefs.server.pagestore import PageId, PageStore
from cachefs.server.worker.loader import Loader, NotAdmittedError, failure, resolve_for_load
from cachefs.server.worker.metaops import ListingPages
from cachefs.server.worker.plans import PlanTable
from cachefs.server.worker.reader import PageReader
from cachefs.server.worker.writer import WriteHandler

log = logging.getLogger(__name__)
HOST_ID = host_id()

MAX_CHUNK = 1 << 20  # bytes per streamed ReadChunk
MAX_BLOCK = 4 << 20  # bytes per ReadBlock reply
LIST_BATCH = 1000
#: A paged List's reply: entries and their encoded bytes at most (well under the message limit).
LIST_PAGE_BYTES = 4 << 20
MAX_OFFSET = (1 << 62)  # far beyond any object, far from int64 overflow
MAX_JOB_PATHS = 10_000  # paths per Load/GetCached request: the master sends batches
RESOLVE_THREADS = 16  # cold objects of Loads resolved at once, worker-wide (each one store round trip)
PLAN_AHEAD_SECONDS = 4.0  # how far ahead (in the job's reading time) a plan's objects are loaded
PLAN_AHEAD_BATCH = 32  # objects per background load




class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        worker_id: str,
        mounts: MountTable,
        objects: ObjectStore,
        pages: PageStore,
        reader: PageReader,
        metrics: WorkerMetrics,
        max_rpc_seconds: float,
        plans: PlanTable | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.mounts = mounts
        self.objects = objects
        self.listing_pages = ListingPages(objects)
        self.pages = pages
        self.reader = reader
        self.metrics = metrics
        self.max_rpc_seconds = max_rpc_seconds
        self.plans = plans if plans is not None else PlanTable(pages.page_size, on_change=pages.replan)
        # Set by the daemon: load objects in the background (hintloads.py); the plans' next reads go there.
        self.prefetch: Callable[[list[str]], int] | None = None
        self.short_circuit_socket = ""  # set by the daemon when it listens for short-circuit reads
        self.data_port = 0  # set by the daemon when its data port listens
        self.writes = WriteHandler(objects, pages, stall_timeout=max_rpc_seconds)
        # The leading master's epoch (several masters on etcd): older Load/Free are refused.
        self.epochs = EpochGuard(metrics.stale_leader_commands.inc)
        # Threads resolving a Load's cold objects side by side, kept for the worker's life: a pool
        # per Load started and joined 8 threads for every hint of 32 samples.
        self._resolve_pool: ThreadPoolExecutor | None = None
        self._resolve_lock = threading.Lock()
        self._closed = False

    def _resolver(self) -> ThreadPoolExecutor | None:
        """The shared resolve pool (None once closed: the caller resolves in its own thread)."""
        with self._resolve_lock:
            if self._resolve_pool is None and not self._closed:
                self._resolve_pool = ThreadPoolExecutor(RESOLVE_THREADS, thread_name_prefix="cachefs-resolve")
            return self._resolve_pool

    def close(self) -> None:
        """Stop the resolve threads (loads still running finish theirs)."""
        with self._resolve_lock:
            self._closed = True
            pool, self._resolve_pool = self._resolve_pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def _deadline(self, context: grpc.ServicerContext) -> float:
        """Every RPC has a deadline: the caller's, capped by the worker's own."""
        remaining = context.time_remaining()
        budget = self.max_rpc_seconds if remaining is None else min(remaining, self.max_rpc_seconds)
        return time.monotonic() + budget

    def _load_deadline(self, context: grpc.ServicerContext) -> float:
        """The RPC deadline less a margin, so a load that runs out of time still gets its answer back."""
        deadline = self._deadline(context)
        remaining = max(0.0, deadline - time.monotonic())
        # Room for the answer to get back on a loaded machine: 0.5-2 s, at most half the budget.
        return deadline - min(2.0, max(0.5, 0.2 * remaining), 0.5 * remaining)

    @staticmethod
    def _check_job_paths(paths: Any) -> None:
        if len(paths) > MAX_JOB_PATHS:
            raise InvalidPathError(f"at most {MAX_JOB_PATHS} paths per request, got {len(paths)}")

    def _file_meta(self, path: CachePath, version: str, head_bytes: int = 0, write_here: bool = False,
                   fetched: set[Any] | None = None) -> ObjectMeta:
        """The object's metadata for a read. ``write_here``: the caller waits for the pages to be
        cached anyway (a fill), so the first pages a GET brings are written on its thread (once
        the open is over) rather than handed to a writer (a queue and two wake-ups a sample);
        ``fetched`` is given their ids (the fill's misses)."""
        if head_bytes > 0 and not version and not self.pages.holds_object(path.mount, path.key):
            # Nothing of it cached: one GET can bring the metadata and the first pages together.
            # (If pages are cached, a metadata-only request is cheaper than refetching a page.)
            if write_here:
                meta, _head = self.reader.open_writing_head(path, head_bytes, fetched)
            else:
                meta, _head = self.objects.open(path, head_bytes, adopt=self.reader.adopt)
        else:
            meta = self.objects.info(path)
        if version and meta.version != version:
            meta = self.objects.info(path, refresh=True)  # our metadata may be the stale one
            if meta.version != version:
                raise StaleObjectError(f"{path} changed since it was opened (version {version} -> {meta.version})")
        if meta.is_dir:
            raise IsADirectoryError(f"{path} is a directory")
        return meta

    def _check_read(self, request: worker_pb2.ReadRequest) -> tuple[ObjectMeta, int]:
        path = parse_path(request.path)
        if request.offset < 0 or request.offset > MAX_OFFSET:
            raise InvalidPathError(f"offset must be in [0, 2**62], got {request.offset}")
        if request.length < -1:
            raise InvalidPathError(f"length must be >= 0 (or -1 for the rest of the object), got {request.length}")
        meta = self._file_meta(path, request.version, head_bytes=self._head_bytes(request))
        return meta, (meta.size if request.length == -1 else min(request.length, MAX_OFFSET))

    def _head_bytes(self, request: worker_pb2.ReadRequest) -> int:
        """What a cold read from the start fetches with the metadata: the pages it asked for, up to
        one fetch run and one block (a 4 MiB first block is one GET, not a 1 MiB GET and then a 3 MiB one)."""
        page = self.pages.page_size
        if request.offset >= page:
            return 0
        run = min(MAX_BLOCK, page * self.reader.options.fetch_group_pages)  # not streamed: keep it short
        want = run if request.length == -1 else request.offset + min(request.length, run)
        return max(page, min(run, -(-want // page) * page))

    @rpc("ReadBlock")
    def ReadBlock(self, request: worker_pb2.ReadRequest, context: grpc.ServicerContext) -> worker_pb2.ReadChunk:
        deadline = self._deadline(context)
        meta, length = self._check_read(request)
        block = min(length, MAX_BLOCK)
        # The caller streams the rest right after this reply: its fetch starts now (then=...).
        tally = [0, 0]  # pages hit, missed: the reply tells the client
        parts = list(self.reader.read(meta, request.offset, block, deadline, then=length - block, tally=tally))
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        data = data if isinstance(data, bytes) else bytes(data)
        self.metrics.bytes_served.inc(len(data))
        return worker_pb2.ReadChunk(offset=request.offset, data=data, info=info_message(meta),
                                    pages_hit=tally[0], pages_missed=tally[1])

    @rpc("Read", streaming=True)
    def Read(self, request: worker_pb2.ReadRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.ReadChunk]:
        deadline = self._deadline(context)
        meta, length = self._check_read(request)
        info = info_message(meta)
        position = request.offset
        sent_first = False
        tally = [0, 0]  # pages hit, missed so far; each chunk carries those of its page
        told = [0, 0]
        for chunk in self.reader.read(meta, request.offset, length, deadline, tally=tally):
            for start in range(0, len(chunk), MAX_CHUNK):
                piece = chunk[start:start + MAX_CHUNK]
                data = piece if isinstance(piece, bytes) else bytes(piece)
                msg = worker_pb2.ReadChunk(offset=position, data=data, pages_hit=tally[0] - told[0],
                                           pages_missed=tally[1] - told[1])
                told = list(tally)
                if not sent_first:
                    msg.info.CopyFrom(info)
                    sent_first = True
                position += len(data)
                self.metrics.bytes_served.inc(len(data))
                yield msg
            if not context.is_active():
                return
        if not sent_first:  # empty range: still tell the caller what it read
            yield worker_pb2.ReadChunk(offset=request.offset, info=info)

    @rpc("GetInfo")
    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.ObjectInfo:
        return info_message(self.objects.info(parse_path(request.path), refresh=request.refresh))

    @rpc("List", streaming=True)
    def List(self, request: worker_pb2.ListRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.ListResponse]:
        if request.paged:  # one page, by name: no call carries a whole prefix
            page, next_after = self.listing_pages.page(request.path, request.recursive, request.refresh,
                                                       request.start_after, request.max_entries, LIST_BATCH,
                                                       LIST_PAGE_BYTES)
            yield worker_pb2.ListResponse(entries=page, next_after=next_after)
            return
        path = parse_path(request.path)
        entries = self.objects.list(path, recursive=request.recursive, refresh=request.refresh)
        for start in range(0, len(entries), LIST_BATCH):
            yield worker_pb2.ListResponse(entries=listed_infos(entries, start, start + LIST_BATCH))
        if not entries:
            yield worker_pb2.ListResponse()

    @rpc("ListMounts")
    def ListMounts(self, request: worker_pb2.ListMountsRequest, context: grpc.ServicerContext) -> worker_pb2.ListMountsResponse:
        mounts = []
        for spec in self.mounts.specs():
            public = spec.public()
            mounts.append(common_pb2.MountInfo(
                name=public["name"], url=public["url"], options_json=json.dumps(public["options"], default=str),
                read_only=public["read_only"],
            ))
        return worker_pb2.ListMountsResponse(mounts=mounts)

    @rpc("Load")
    def Load(self, request: worker_pb2.LoadRequest, context: grpc.ServicerContext) -> worker_pb2.LoadResponse:
        """Bring whole objects into this worker's page store; one bad object fails only itself."""
        self.epochs.check(request.leader_epoch, "Load")
        self._check_job_paths(request.paths)
        return self.load_objects(list(request.paths), self._load_deadline(context), request.hint)

    def load_objects(self, paths: list[str], deadline: float, hint: bool) -> worker_pb2.LoadResponse:
        """Load's work, also for hints that come another way (the short-circuit socket)."""
        metas: dict[CachePath, ObjectMeta] = {}
        failed: list[str] = []
        heads: dict[CachePath, int] = {}  # first pages that came with their metadata

        def resolve(raw: str) -> tuple[str, CachePath | None, ObjectMeta | None, int, OSError | None]:
            try:
                path = parse_path(raw)
                if hint and not self.pages.worth_admitting(PageId(path.mount, path.key, "", 0)):
                    # Not even resolved: a cold resolve is a GET that brings the first page, which
                    # would then wait in memory for a reader that may come too late for it.
                    self.metrics.load_not_admitted.inc()
                    raise NotAdmittedError("not cached: the registered training plans read it later "
                                           "than everything the cache holds")
                meta, head = resolve_for_load(self.objects, path, self.reader if hint else None)
                return raw, path, meta, head, None
            except OSError as exc:  # a bad path, unknown mount, missing object, directory, store error
                return raw, None, None, 0, exc

        # Each cold object costs one store round trip to resolve (its GET brings the metadata and
        # first page: all of a small object), so a hint of 32 samples resolves them side by side,
        # not one store latency after another.
        unique = list(dict.fromkeys(paths))
        pool = self._resolver() if len(unique) > 1 else None
        try:
            results = pool.map(resolve, unique) if pool is not None else map(resolve, unique)
        except RuntimeError:  # the pool closed meanwhile (the worker stopping)
            results = map(resolve, unique)
        resolved = list(results)
        for raw, path, meta, head, error in resolved:
            if error is not None:
                failed.append(failure(raw, error))
            elif path is not None and meta is not None and path not in metas:
                metas[path], heads[path] = meta, head
        result = Loader(self.reader, self.pages, self.metrics, deadline).run(list(metas.values()), heads)
        return worker_pb2.LoadResponse(
            objects_loaded=result.objects_loaded, bytes_loaded=result.bytes_loaded,
            bytes_skipped=result.bytes_skipped, failed=failed + result.failed,
        )

    @rpc("Free")
    def Free(self, request: worker_pb2.FreeRequest, context: grpc.ServicerContext) -> worker_pb2.FreeResponse:
        """Drop every version's pages under a prefix, and what we know of those objects."""
        self.epochs.check(request.leader_epoch, "Free")
        return worker_pb2.FreeResponse(pages_freed=self.free(request.prefix, self._load_deadline(context)))

    def free(self, raw_prefix: str, deadline: float | None = None) -> int:
        """Free's work (also asked over the sockets: metaops.py); the pages dropped. ``deadline``
        (monotonic): by when pending page writes under it must have settled (default: the
        worker's own longest call)."""
        if deadline is None:
            deadline = time.monotonic() + self.max_rpc_seconds
        path = parse_path(raw_prefix)
        # parse_path drops a trailing '/': keep it, so "data/dir/" does not also free "data/dir2/...".
        prefix = path.key + "/" if path.key and raw_prefix.endswith("/") else path.key
        self.objects.forget_prefix(path.mount, prefix)
        # Pages fetched before the Free (their disk writes queued) land first, then go with the rest.
        if not self.reader.wait_prefix_settled(path.mount, prefix, deadline):
            raise DeadlineExceededError(f"Free {raw_prefix!r}: page writes under it did not settle in time")
        freed = self.pages.delete_prefix(path.mount, prefix)
        self.metrics.pages_freed.inc(freed)
        return freed

    @rpc("GetCached")
    def GetCached(self, request: worker_pb2.GetCachedRequest,
                  context: grpc.ServicerContext) -> worker_pb2.GetCachedResponse:
        """Per path, bytes of the object's current version in this worker's page store."""
        self._check_job_paths(request.paths)
        deadline = self._deadline(context)
        paths = [parse_path(raw) for raw in request.paths]  # all checked before any store call
        sizes = []
        for path in paths:
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"GetCached: {len(sizes)} of {len(paths)} paths answered in time")
            sizes.append(self._cached_bytes(path))
        return worker_pb2.GetCachedResponse(cached_bytes=sizes)

    def _cached_bytes(self, path: CachePath) -> int:
        if not self.pages.holds_object(path.mount, path.key):
            return 0  # nothing of any version: no need to ask the store for the current one
        try:
            meta = self.objects.info(path)
        except FileNotFoundError:  # gone from the store, or its mount is
            return 0
        return 0 if meta.is_dir else self.pages.cached_bytes(path.mount, path.key, meta.version)

    @rpc("GetStatus")
    def GetStatus(self, request: worker_pb2.GetStatusRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerStatus:
        s = self.pages.stats()
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id, version=__version__, page_size=self.pages.page_size,
            pages=s.pages, used_bytes=s.used_bytes, capacity_bytes=s.capacity_bytes, evictions=s.evictions,
            degraded=s.degraded, disk_errors=s.disk_errors, corrupt_pages=s.corrupt_pages,
            stores_unavailable=self.objects.breaker.open_mounts(),
            short_circuit_socket=self.short_circuit_socket, host_id=HOST_ID, data_port=self.data_port,
            **self.metrics.totals(),
        )

    @rpc("Plan")
    def Plan(self, request: worker_pb2.PlanRequest, context: grpc.ServicerContext) -> worker_pb2.PlanReply:
        """A job's read order for this worker's pages (plans.py): eviction follows it."""
        return self.take_plan(request)

    def take_plan(self, request: worker_pb2.PlanRequest) -> worker_pb2.PlanReply:
        """Plan's work, also for plans that come over the worker's sockets (metaops.py)."""
        known, index_known, derived = self.plans.take(request)
        if known:
            self.plan_ahead(request.job)
        return worker_pb2.PlanReply(known=known, capacity_bytes=self.pages.stats().capacity_bytes,
                                    jobs=len(self.plans), policy=self.pages.policy,
                                    prefetches=self.prefetch is not None, index_known=index_known,
                                    derived=derived)

    def plan_ahead(self, job: str) -> None:
        """The plan drives prefetch (no client hints): the next few seconds of the job's reads,
        within half of its share of the cache (the rest keeps what is read after) and of the memory
        where pages not worth admitting wait for their reader (pagestore/passing.py)."""
        prefetch = self.prefetch
        if prefetch is None:
            return
        jobs = max(1, len(self.plans))
        window = min(self.pages.stats().capacity_bytes // jobs // 2, self.pages.passing_bytes // jobs)
        # Objects whose planned pages are all here need no load (a warm pass read again would
        # load every object); those partly here (a large shard partly evicted) are loaded.
        paths = [raw for raw, planned in self.plans.due(job, window, PLAN_AHEAD_SECONDS)
                 if not self._held(raw, planned)]
        for i in range(0, len(paths), PLAN_AHEAD_BATCH):
            if not prefetch(paths[i:i + PLAN_AHEAD_BATCH]):
                break  # busy: the reads fetch it themselves

    def _held(self, raw: str, planned: int) -> bool:
        """As many pages of the object are stored or being written as the plan reads (a plan's
        path: validated when the plan came). From memory, ~1 us, not ~4 through its metadata; a
        stale version's pages count too, and then the reads fetch the new one."""
        mount, _, key = raw.partition("/")
        return self.pages.held_pages(mount, key) >= max(1, planned)

    # -- write-through (server/worker/writer.py) -----------------------------------------------
    @rpc("Write")
    def Write(self, request_iterator: Iterator[worker_pb2.WriteChunk],
              context: grpc.ServicerContext) -> common_pb2.ObjectInfo:
        meta = self.writes.write(request_iterator)
        return info_message(meta)

    @rpc("Remove")
    def Remove(self, request: worker_pb2.RemoveRequest, context: grpc.ServicerContext) -> worker_pb2.RemoveResponse:
        return worker_pb2.RemoveResponse(pages_freed=self.remove(request.path, request.recursive))

    @rpc("MakeDir")
    def MakeDir(self, request: worker_pb2.MakeDirRequest, context: grpc.ServicerContext) -> worker_pb2.MakeDirResponse:
        self.make_dir(request.path, request.create_parents, request.exist_ok)
        return worker_pb2.MakeDirResponse()

    @rpc("Copy")
    def Copy(self, request: worker_pb2.CopyRequest, context: grpc.ServicerContext) -> common_pb2.ObjectInfo:
        return info_message(self.copy(request.source, request.destination))

    # The mutations' work, the same whether asked through gRPC or over the sockets (metaops.py).
    def remove(self, raw_path: str, recursive: bool) -> int:
        freed = self.writes.remove(parse_path(raw_path), recursive)
        self.metrics.pages_freed.inc(freed)
        return freed

    def make_dir(self, raw_path: str, create_parents: bool, exist_ok: bool) -> None:
        self.objects.make_dir(parse_path(raw_path), create_parents, exist_ok)

    def copy(self, raw_source: str, raw_destination: str) -> ObjectMeta:
        source, destination = parse_path(raw_source), parse_path(raw_destination)
        meta = self.objects.copy(source, destination)
        self.pages.delete_object(destination.mount, destination.key)  # older versions' pages
        return meta
