"""The worker daemon: wires config -> mounts, object store, page store, reader, gRPC, metrics."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cachefs.auth import outgoing_token
from cachefs.config import WorkerConfig
from cachefs.mounts import MountTable
from cachefs.pagefile import TRAILER_SIZE
from cachefs.paths import CachePath, parse_path
from cachefs.peercred import PeerPolicy
from cachefs.runtimedir import check_socket_dir, runtime_dir, share_socket_with_group
from cachefs.proto import master_pb2, worker_pb2, worker_pb2_grpc
from cachefs.server.httpd import HttpEndpoints, HttpServer
from cachefs.server.worker.heap import keep_freed_memory
from cachefs.server.worker.metrics import WorkerMetrics
from cachefs.server.lifecycle import liveness, serve_until_signalled
from cachefs.server.rpc import server_interceptors
from cachefs.store.listed import ListedEntries, Relisted
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore
from cachefs.server.pagestore import CacheDir, PageStore
from cachefs.server.worker.reader import PageReader, ReaderOptions
from cachefs.server.worker.metaops import MetaOps
from cachefs.server.worker.registration import Registrar, ViewRelay, worker_stats
from cachefs.server.worker.plans import PlanTable
from cachefs.server.worker.service import HOST_ID, WorkerServicer
from cachefs.server.connections import token_checker
from cachefs.server.worker.bulkpath import CachedPages
from cachefs.server.worker.dataport import DataPortServer
from cachefs.server.worker.handles import HandleTable
from cachefs.server.worker.names import NameIndex
from cachefs.server.worker.touches import TouchQueue
from cachefs.server.worker.fill import RangeFiller
from cachefs.server.worker.hintloads import HintLoads
from cachefs.server.worker.shortcircuit import ShortCircuitServer
from cachefs.tls import MESSAGE_OPTIONS, bind_port, server_context

log = logging.getLogger(__name__)

#: Registered plans that read more than this share of the cache make it evict by their order.
HOLD_PRESSURE = 0.9
MAX_STALE_REPORT = 4096  # objects read by name past their entries' time, taken from one report

# The worker's server options: message limits shared with its clients (cachefs/tls.py).
GRPC_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)]


# Calls that answer without the access token when ``open_status`` is set (liveness probes).
WORKER_OPEN_METHODS = ("GetStatus",)
#: Short-circuit requests filling cold ranges at once: half the raw server's serving threads, so
#: warm reads always find one free.
FILL_REQUESTS = 16


def _worker_id(first_cache_dir: str) -> str:
    """Stable across restarts: kept next to the pages it describes."""
    path = Path(first_cache_dir) / "worker-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        wid = uuid.uuid4().hex[:16]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:  # like every cache file
            f.write(wid)
        os.replace(tmp, path)
        return wid


class Worker:
    """One worker. ``start()`` binds its ports (port 0 = pick one) and reports them as attributes."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.Server | None = None
        self._metrics_http: HttpServer | None = None
        self.short_circuit: ShortCircuitServer | None = None
        self.filler: RangeFiller | None = None
        self.hint_loads: HintLoads | None = None
        self.touches: TouchQueue | None = None  # reads local clients report (touches.py)
        self.handle_table: HandleTable | None = None
        self.name_index: NameIndex | None = None
        self.data_port_server: DataPortServer | None = None
        self.data_port: int | None = None  # bound data port (None: off)
        self.servicer: WorkerServicer | None = None
        self._stopped = threading.Event()
        self._had_mounts = False  # readiness: the master's mounts arrived once (kept while it is away)
        self.metrics = WorkerMetrics()
        self.mounts = MountTable(config.mounts)
        if config.master:  # until the first mount sync (registration.py): a missing mount is ours, not the request's
            self.mounts.awaiting = f"this worker has not had the mount table from master {config.master} yet"
        self.objects = ObjectStore(self.mounts, config.metadata_ttl, config.list_ttl,
                                   stale_grace=config.metadata_stale_grace, s3_client=config.s3_client,
                                   list_cache_bytes=config.list_cache_bytes,
                                   metadata_cache_bytes=config.metadata_cache_bytes)
        # Training jobs' read plans (plans.py): with eviction "future" the page store evicts by them.
        # A plan changed (completed, replaced, expired): the sweeper thread asks every cached page's
        # next use again, off the RPC thread (at millions of pages that takes seconds).
        self._replan = threading.Event()
        self.plans = PlanTable(config.page_size, on_change=self._replan.set)
        self.pages = PageStore([CacheDir(d.path, d.quota_bytes) for d in config.cache_dirs], config.page_size,
                               next_use=self.plans.next_use if config.eviction == "future" else None,
                               plan_moment=self.plans.moment if config.eviction == "future" else None,
                               next_uses=self.plans.next_uses if config.eviction == "future" else None,
                               degraded_settle_s=config.degraded_settle_s)
        self.objects.on_fetched = self._on_fetched
        self.objects.on_listed = self._on_listed
        self.objects.on_forgotten = self._on_forgotten
        self.objects.on_request = lambda kind: self.metrics.store_requests.labels(kind).inc()
        self.metrics.watch_page_store(self.pages.stats)
        self.metrics.plans.set_function(lambda: len(self.plans))
        self.metrics.watch_raw_servers(lambda: {"short_circuit": self.short_circuit,
                                                "data_port": self.data_port_server})
        self.reader = PageReader(
            self.pages,
            self.objects,
            self.metrics,
            ReaderOptions.from_config(config),
        )
        self.worker_id = _worker_id(config.cache_dirs[0].path)
        self.registrar: Registrar | None = None

    @property
    def address(self) -> str:
        """What clients dial: the advertised address, else the bound host and port."""
        if self.port is None:
            raise RuntimeError("worker is not started")
        if self.config.advertise_address:
            return self.config.advertise_address
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _on_fetched(self, meta: ObjectMeta) -> None:
        """Fresh metadata from the store: handles local clients hold on pages of any other
        version must go. (The pages themselves stay until evicted: a read that began on the
        last version within the stale grace is still served from them.)"""
        if self.pages.holds_object(meta.path.mount, meta.path.key):
            self._refreshed(meta.path.mount, [(meta.path.key, meta.size, meta.version, meta.mtime)])

    def _on_listed(self, entries: ListedEntries, keys: list[str], relisted: Relisted | None = None) -> None:
        """``_on_fetched`` of a listing's objects (``keys``): only those with pages here need
        anything (a listing of a million objects asks the page store once a chunk, not once an
        object, and makes metadata objects only for those). A whole listing the same as the last
        one of its path (``relisted``) changed nothing: the entries that one left valid are
        extended at once, where none was written since."""
        names = self.name_index
        if relisted is not None and relisted.unchanged and (
                names is None or names.extend_listed(relisted.listing, relisted.digest,
                                                     time.monotonic() + self.config.metadata_ttl)):
            return
        held = set(self.pages.holding(entries.mount, keys))
        if not held:
            return
        fresh = []
        for i in range(len(entries)):
            if not entries.is_dir(i):
                key, size, version, mtime, _ = entries.fields(i)
                if key in held:
                    fresh.append((key, size, version, mtime))
        self._refreshed(entries.mount, fresh, relisted)

    def _refreshed(self, mount: str, objects: list[tuple[str, int, str, float]],
                   relisted: Relisted | None = None) -> None:
        """Fresh metadata of objects of ``mount`` with pages here, (key, size, version, mtime)
        each. (With none: no handle to drop, and a name entry left vouching for another version
        leads a client to page files that do not exist, so it asks the worker.) ``relisted``:
        the whole listing they come from, whose entries are kept to be extended next time."""
        if self.name_index is not None:
            self.name_index.refreshed_many([(f"{mount}/{key}", version, size, mtime)
                                            for key, size, version, mtime in objects],
                                           time.monotonic() + self.config.metadata_ttl,
                                           *((relisted.listing, relisted.digest) if relisted is not None else ()))
        table = self.handle_table
        if table is not None:
            older = self.pages.other_versions_many(mount, [(key, version) for key, _, version, _ in objects])
            if older:
                table.invalidate(older)

    def _on_forgotten(self, path: CachePath | None) -> None:
        """Metadata dropped before it ran out (the object changed or went, a path or a whole
        mount invalidated): local clients must not read those objects by name, not even within
        the stale window. (A free or a remove deletes the pages themselves: opens by name fail.)"""
        names = self.name_index
        if names is not None:
            if path is None:
                names.clear_all()
            else:
                names.forget(str(path))

    def _read_stale(self, paths: list[str]) -> None:
        """Objects local clients read by name past their entries' time (within the stale
        window): refreshed in the background as a read of stale metadata is (a listing for many
        of one directory), which extends their entries (_on_fetched); one the worker already
        knows afresh gets its entry extended now."""
        names = self.name_index
        parsed: list[tuple[str, CachePath]] = []
        for raw in paths[:MAX_STALE_REPORT]:
            try:
                parsed.append((raw, parse_path(raw)))
            except Exception:  # noqa: BLE001 - a client's report: a bad path is ignored
                continue
        # those past their TTL: their refreshes queued, a task a directory
        known = self.objects.cached_infos_until([path for _, path in parsed])
        if names is None:
            return
        for (raw, _), found in zip(parsed, known):
            if found is not None and not found[2]:
                meta, until, _ = found
                names.refreshed(raw, meta.version, meta.size, meta.mtime, until)

    def _on_mounts_changed(self, names: set[str]) -> None:
        for name in names:
            self.objects.forget_mount(name)
        self._prepare_backends(names)

    def _prepare_backends(self, names: Iterable[str]) -> None:
        """Make the mounts' store clients in the background (an S3 one builds a botocore client:
        tenths of a second a cold read would otherwise wait for)."""
        threading.Thread(target=self.objects.prepare, args=(list(names),), name="cachefs-backends",
                         daemon=True).start()

    def start(self) -> "Worker":
        server = grpc.server(
            ThreadPoolExecutor(self.config.rpc_threads, thread_name_prefix="cachefs-rpc"),
            options=GRPC_OPTIONS,
            maximum_concurrent_rpcs=self.config.rpc_threads * 4,
            interceptors=server_interceptors(self.config.access_token, self.config.cluster_token,
                                             WORKER_OPEN_METHODS if self.config.open_status else ()),
        )
        servicer = WorkerServicer(
            self.worker_id, self.mounts, self.objects, self.pages, self.reader, self.metrics,
            max_rpc_seconds=max(self.config.store_timeout * 4, 60.0), plans=self.plans,
        )
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        self.servicer = servicer
        token = token_checker([self.config.access_token, self.config.cluster_token]) if self.config.access_token else None
        cached = CachedPages(self.objects.cached_info_until, self.reader._page_id, self.pages.open_page,
                             self.pages.page_size, token)
        # Cold ranges asked for over the short-circuit socket are fetched into the page store and
        # handed out as pages (fill.py): resolved exactly as a gRPC read resolves them.
        self.filler = RangeFiller(self.reader, functools.partial(servicer._file_meta, write_here=True),
                                  servicer._head_bytes,
                                  threads=self.config.fetch_threads, max_requests=FILL_REQUESTS,
                                  on_outcome=lambda outcome, n: self.metrics.fill_ranges.labels(outcome).inc(n))
        self.hint_loads = HintLoads(servicer.load_objects)
        servicer.prefetch = self.hint_loads.submit
        # Metadata on the same sockets, for clients that must not use gRPC (metaops.py).
        self.view_relay = ViewRelay()
        self.meta_ops = MetaOps(self.objects, lambda: WorkerServicer.GetStatus.__wrapped__(
            servicer, worker_pb2.GetStatusRequest(), None).SerializeToString(), self.view_relay.get,
            plan=servicer.take_plan, load=self.hint_loads.submit, mutations=servicer,
            on_answered=self.metrics.socket_operation)
        servicer.short_circuit_socket = self._start_short_circuit(cached)
        servicer.data_port = self._start_data_port(cached)
        port = bind_port(server, f"{self.config.host}:{self.config.port}", self.config.tls)
        server.start()
        self._server, self.port = server, port
        if self.config.metrics_port >= 0:
            self._metrics_http = HttpServer(self.config.host, self.config.metrics_port, HttpEndpoints(
                self.metrics.registry, live=self._live, ready=self._ready)).start()
            self.metrics_port = self._metrics_http.port
        if self.config.master:
            self.registrar = Registrar(
                self.config.master, self.worker_id, self.address, self.mounts,
                stats=lambda: worker_stats(self.pages.stats(), self.metrics.totals(), len(self.plans)),
                token=outgoing_token(self.config.access_token, self.config.cluster_token),
                on_mounts_changed=self._on_mounts_changed, tls=self.config.tls,
                on_epoch=servicer.epochs.observe,
                lean=master_pb2.LeanPaths(host_id=HOST_ID, short_circuit_socket=servicer.short_circuit_socket,
                                          data_port=servicer.data_port, page_size=self.pages.page_size),
                view=self.view_relay,
            ).start()
        threading.Thread(target=self._expire_plans, name="cachefs-plans", daemon=True).start()
        self._prepare_backends(spec.name for spec in self.mounts.specs())
        log.info("worker %s serving on %s (metrics port %s)", self.worker_id, self.address, self.metrics_port)
        return self

    def _plan_progress(self, job: str, position: int, reader: int = 0, furthest: int = 0) -> None:
        """A local reader's position in its plan (with its short-circuit requests): what it reads
        next is fetched ahead by the plan. ``furthest``: where it got to since its last request
        (reads by name send none), applied first, so that a new pass shows as one."""
        if furthest > position:
            self.plans.progress(job, furthest, reader)
        self.plans.progress(job, position, reader)
        servicer = self.servicer
        if servicer is not None:
            servicer.plan_ahead(job)

    def _expire_plans(self) -> None:
        """A job that stopped renewing its plan pins nothing once its lease ends; after any change
        of the plans, or when a page store's order wakes from rest, every cached page's next use
        is asked again."""
        while not self._stopped.is_set():
            self._replan.wait(1.0)
            try:
                self.plans.expire()
                if self._replan.is_set() or self.pages.wants_replan():
                    self._replan.clear()
                    self.pages.replan()
            except Exception:  # noqa: BLE001 - never let the sweeper die; the next round retries
                log.exception("expiring plans failed")

    def stop(self, grace: float | None = None) -> None:
        """Graceful: refuse new RPCs, let running ones finish within ``grace``, flush the page index."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.shutdown_grace if grace is None else grace
        if self.registrar is not None:
            self.registrar.stop()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1)
        if self._metrics_http is not None:
            self._metrics_http.stop()
        if self.short_circuit is not None:
            self.short_circuit.stop()
        self._close_handle_table()
        if self.touches is not None:
            self.touches.close()
        if self.data_port_server is not None:
            self.data_port_server.stop()
        if self.filler is not None:
            self.filler.close()
        if self.hint_loads is not None:
            self.hint_loads.close()
        if self.servicer is not None:
            self.servicer.close()
        self.reader.close(timeout=grace)
        self.pages.close()
        log.info("worker %s stopped", self.worker_id)

    def _short_circuit_path(self) -> str:
        path = self.config.short_circuit_socket
        if path != "auto":
            return path
        path = os.path.join(self.config.cache_dirs[0].path, "worker.sock")
        if len(os.fsencode(path)) < 100:
            return path
        digest = hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:16]
        return os.path.join(runtime_dir(), f"worker-{digest}.sock")  # private: never a name in /tmp

    def _start_short_circuit(self, cached: CachedPages) -> str:
        """The short-circuit socket (server/worker/shortcircuit.py); "" when off or unavailable."""
        path = self._short_circuit_path()
        if not path:
            return ""
        self.touches = TouchQueue(self.pages.touch_digests)  # what its clients report reading
        try:
            check_socket_dir(path)  # not in a directory another user owns (cachefs/runtimedir.py)
            table = self._handle_table()
            names = self._name_index() if table is not None else None
            self.short_circuit = ShortCircuitServer(
                path, cached, on_served=self.metrics.served_short_circuit, table=table, hold=self._hold,
                still_cached=self.pages.contains_digest, on_touched=self.metrics.read_through_held,
                filler=self.filler, on_handed_out=self.metrics.handed_out_bytes.inc,
                on_load=self.hint_loads.submit, passing=self.pages.passing, on_progress=self._plan_progress,
                names=names, page_dirs=self.pages.dirs(), on_named=self._read_by_name,
                on_stale=self._read_stale, meta=self.meta_ops).start()
            # Who may connect at all (cachefs/peercred.py): until this line, this uid and root only.
            self.short_circuit.peers = PeerPolicy(self.config.allowed_uids, self.config.allowed_gid)
            if self.config.allowed_gid >= 0:  # the group can reach the socket, not list the dir
                share_socket_with_group(path, self.config.allowed_gid)
        except (OSError, ValueError) as exc:  # no Unix sockets here, a read-only dir...: gRPC only
            log.warning("short-circuit reads are off: cannot listen on %s: %s", path, exc)
            self._close_handle_table()
            return ""
        return path

    def _handle_table(self) -> HandleTable | None:
        """The table of held page handles (server/worker/handles.py), or None when off."""
        if self.config.short_circuit_handles == 0:
            return None
        try:
            table = HandleTable(self.config.short_circuit_handles, on_touched=self._touched)
        except OSError as exc:  # no memfd here: clients read each descriptor once
            log.warning("held short-circuit handles are off: %s", exc)
            return None
        self.handle_table = table
        self.pages.set_unlink_listener(table.invalidate)
        self.metrics.watch_handles(table.in_use)
        return table

    def _name_index(self) -> NameIndex | None:
        """Which object versions this worker vouches for, for local clients to open page files by
        name (server/worker/names.py), or None when off."""
        if not self.config.short_circuit_by_name:
            return None
        try:
            self.name_index = NameIndex(self.config.short_circuit_handles, self.config.name_index_max_slots,
                                        stale_window=self.objects.stale_grace)
        except OSError as exc:
            log.warning("reads by name are off: %s", exc)
            return None
        return self.name_index

    def _read_by_name(self, digests: list[str], nbytes: int) -> None:
        """Pages local clients read by name: the store's recency and hits, and the metrics."""
        self._touched(digests)
        self.metrics.read_by_name(len(digests), nbytes)

    def _touched(self, digests: list[str]) -> None:
        """Reads local clients made themselves, for the page store's recency and hits: applied
        behind the reply, on a thread of lower priority (touches.py)."""
        if self.touches is not None:
            self.touches.submit(digests)
        else:
            self.pages.touch_digests(digests)

    def _close_handle_table(self) -> None:
        if self.name_index is not None:
            self.name_index.close()
        if self.handle_table is not None:
            self.pages.set_unlink_listener(None)
            self.handle_table.close()

    def _hold(self, digests: list[str], until: float, by_name: bool = False) -> bool:
        """Let local clients hold these pages open until ``until`` (False: hand them out for one
        read). Pages held (cached or unlinked) stay within ``max_held_fraction`` of the quota, so
        the rest of the cache can always be evicted for new pages. A client that opens pages by
        name holds none that the plans order when they read more than the cache holds
        (PageStore.worth_holding): it opens them by name later, and an evicted page is not
        charged to the quota for its sake."""
        capacity = sum(d.quota_bytes for d in self.config.cache_dirs)
        if by_name and self.plans.planned_pages() * self.pages.page_size > HOLD_PRESSURE * capacity \
                and not self.pages.worth_holding(digests):
            return False
        asked = len(digests) * (self.pages.page_size + TRAILER_SIZE)  # at most
        if self.pages.held_bytes() + asked > capacity * self.config.max_held_fraction:
            return False
        self.pages.hold(digests, until)
        return True

    def _start_data_port(self, cached: CachedPages) -> int:
        """The data port (server/worker/dataport.py); 0 when off. A worker serving TLS serves it
        with the same certificates (server/tlsstream.py)."""
        if self.config.data_port < 0:
            return 0
        tls = self.config.tls
        try:
            self.data_port_server = DataPortServer(self.config.host, self.config.data_port, cached,
                                                   on_served=self.metrics.served_data_port, filler=self.filler,
                                                   meta=self.meta_ops, check_page=self.pages.get,
                                                   writes=self.servicer.writes,
                                                   on_write=lambda ok: self.metrics.socket_operation("write", ok),
                                                   tls_context=server_context(tls) if tls.cert_file else None).start()
        except OSError as exc:  # port taken: bulk bytes go through gRPC
            log.warning("data port off: cannot listen on %s:%s: %s", self.config.host, self.config.data_port, exc)
            return 0
        self.data_port = self.data_port_server.port
        return self.data_port

    def _live(self) -> tuple[bool, str]:
        """/healthz: serving and not stopping."""
        return liveness(self._stopped, self._server)

    def _ready(self) -> tuple[bool, str]:
        """/readyz: the page store is open with its dirs in place, and the mounts are known."""
        live, why = self._live()
        if not live:
            return False, why
        missing = [d.path for d in self.config.cache_dirs if not os.path.isdir(d.path)]
        if missing:
            return False, f"cache dir missing: {', '.join(missing)}"
        self.pages.stats()  # takes the store's lock: a wedged store times the probe out
        if self.registrar is not None and not self._had_mounts:
            if not self.registrar.registered.is_set():
                return False, f"not yet registered with master {self.config.master}"
            self._had_mounts = True
        return True, "ok"

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(config: WorkerConfig) -> int:
    """Run a worker until SIGTERM/SIGINT; prints one JSON line with its ports when ready."""
    keep_freed_memory(config.heap_keep_bytes)  # this process is the worker's own: heap.py
    worker = Worker(config).start()
    return serve_until_signalled(
        worker.stop,
        ready={"worker_id": worker.worker_id, "address": worker.address, "port": worker.port,
               "metrics_port": worker.metrics_port},
        stopped={"worker_id": worker.worker_id},
    )
