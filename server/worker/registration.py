"""A worker's membership: register with the master, heartbeat, and follow its mount table.

The master is not on the data path: when it is away the worker keeps serving with the
mounts it last had, keeps retrying, and registers again as soon as the master answers
(a restarted master knows no workers until they come back: soft state).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import grpc

from cachefs import __version__
from cachefs.auth import token_metadata
from cachefs.masters import MasterList
from cachefs.mounts import MountSpec, MountTable, public_url
from cachefs.proto import master_pb2
from cachefs.server.pagestore import PageStoreStats
from cachefs.tls import PLAINTEXT, TLSConfig

log = logging.getLogger(__name__)


class ViewRelay:
    """The cluster view this worker last had from the master, relayed on its own sockets to
    clients that cannot watch the master (server/worker/metaops.py): (version, serialized view)."""

    def __init__(self) -> None:
        self._known: tuple[int, bytes] = (0, b"")  # replaced whole: readers never see half of it

    def get(self) -> tuple[int, bytes]:
        return self._known

    def set(self, version: int, data: bytes) -> None:
        self._known = (version, data)


class Registrar:
    """Runs the heartbeat loop on a thread of its own; ``stop()`` ends it."""

    def __init__(
        self,
        master: str,
        worker_id: str,
        address: str,
        mounts: MountTable,
        stats: Callable[[], master_pb2.WorkerStats],
        token: str = "",
        on_mounts_changed: Callable[[set[str]], None] | None = None,
        rpc_timeout: float = 5.0,
        tls: TLSConfig = PLAINTEXT,
        on_epoch: Callable[[int], None] | None = None,
        lean: master_pb2.LeanPaths | None = None,
        view: ViewRelay | None = None,
    ) -> None:
        """``lean``: this worker's sockets besides gRPC, published in the view; ``view``: where
        the view the master has is kept for clients (fetched when a heartbeat says it moved)."""
        self.master = master
        self.worker_id = worker_id
        self.address = address
        self.mounts = mounts
        self._stats = stats
        self._metadata = token_metadata(token)
        self._on_mounts_changed = on_mounts_changed
        self._rpc_timeout = rpc_timeout
        # Several masters (etcd): any answers (a standby forwards to the leader); a dead one is passed over.
        self._masters = MasterList(master, tls)
        self._on_epoch = on_epoch
        self._lean = lean
        self.view = view if view is not None else ViewRelay()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = threading.Event()
        self.heartbeat_seconds = 2.0
        self._mounts_version = -1
        self._master_mounts: set[str] = set()  # names this worker took from the master

    def start(self) -> "Registrar":
        self._thread = threading.Thread(target=self._run, name="cachefs-registrar", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._masters.close()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                else:
                    self._heartbeat()
                failures = 0
                delay = self.heartbeat_seconds
            except grpc.RpcError as err:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("master %s: %s (%s); serving with the last known mounts",
                                self.master, err.code().name, err.details())
                if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("master %s refused this worker's token", self.master)
                self.registered.clear()
                # At most 2 s between tries: a restarted master resumes its load jobs once the
                # live workers have not changed for settle_seconds (4 s, server/master/jobs.py),
                # so every worker must be back well within that, or a job plans without it.
                delay = min(2.0, 0.2 * 2 ** min(failures, 5))
            self._stop.wait(delay)

    def _register(self) -> None:
        # Mounts first: once this worker is in the view, clients send it reads for them.
        self._mounts_version = -1  # maybe a master that lost its state: re-read whatever the number
        self._sync_mounts(None)
        info = master_pb2.WorkerInfo(worker_id=self.worker_id, address=self.address, stats=self._stats(),
                                     version=__version__, lean=self._lean)
        resp = self._masters.call("RegisterWorker", master_pb2.RegisterWorkerRequest(worker=info),
                                  timeout=self._rpc_timeout, metadata=self._metadata)
        self._epoch(resp.leader_epoch)
        self.heartbeat_seconds = max(0.05, resp.heartbeat_seconds or self.heartbeat_seconds)
        self._sync_mounts(resp.mounts_version)  # a mount may have changed in between
        self.registered.set()
        self._follow_view(resp.view_version)
        log.info("registered with master %s as %s (%s)", self.master, self.worker_id, self.address)

    def _heartbeat(self) -> None:
        resp = self._masters.call("Heartbeat", master_pb2.HeartbeatRequest(worker_id=self.worker_id,
                                                                          stats=self._stats()),
                                  timeout=self._rpc_timeout, metadata=self._metadata)
        self._epoch(resp.leader_epoch)
        if not resp.registered:
            self.registered.clear()
            self._register()
            return
        self._sync_mounts(resp.mounts_version)
        self._follow_view(resp.view_version)

    def _follow_view(self, version: int) -> None:
        """Fetch the master's view when its version moved (for ViewRelay); a failure waits for
        the next heartbeat, never fails this one."""
        if not version or version == self.view.get()[0]:
            return
        try:
            view = self._masters.call("GetView", master_pb2.GetViewRequest(), timeout=self._rpc_timeout,
                                      metadata=self._metadata)
        except grpc.RpcError as err:
            log.debug("master %s: GetView failed (%s); the relayed view stays at %d", self.master,
                      err.code().name, self.view.get()[0])
            return
        self.view.set(view.version, view.SerializeToString())

    def _epoch(self, epoch: int) -> None:
        if epoch and self._on_epoch is not None:
            self._on_epoch(epoch)

    def _sync_mounts(self, version: int | None) -> None:
        """Apply the master's mount table when its version moved (None: fetch it regardless).

        Mounts from the worker's own config stay unless the master has one of the same name.
        """
        if version is not None and version == self._mounts_version:
            return
        resp = self._masters.call("GetMounts", master_pb2.GetMountsRequest(with_credentials=True),
                                  timeout=self._rpc_timeout, metadata=self._metadata)
        wanted = {m.name: MountSpec(m.name, m.url, json.loads(m.options_json or "{}"), m.read_only)
                  for m in resp.mounts}
        current = {spec.name: spec for spec in self.mounts.specs()}
        changed: set[str] = set()
        for name, spec in wanted.items():
            old = current.get(name)
            if old is None or (old.url, dict(old.options), old.read_only) != (spec.url, dict(spec.options), spec.read_only):
                try:
                    self.mounts.add(spec, exact_root=True)  # the master hands out realpaths it checked
                    changed.add(name)
                except (ValueError, OSError, ImportError) as exc:
                    # The type only: a store constructor's message may quote its options (#48).
                    log.error("cannot open mount %s (%s): %s", name, public_url(spec.url), type(exc).__name__)
        for name in self._master_mounts - set(wanted):
            if self.mounts.remove(name):
                changed.add(name)
        self._master_mounts = set(wanted)
        self._mounts_version = resp.mounts_version
        self.mounts.awaiting = ""  # the master's table is here: a mount missing now is missing
        if changed and self._on_mounts_changed is not None:
            self._on_mounts_changed(changed)


def worker_stats(stats: PageStoreStats, totals: dict[str, int], plans: int = 0) -> master_pb2.WorkerStats:
    return master_pb2.WorkerStats(capacity_bytes=stats.capacity_bytes, used_bytes=stats.used_bytes,
                                  pages=stats.pages, eviction_policy=stats.policy, plans=plans,
                                  bypassed_admissions=stats.bypassed, **totals)
