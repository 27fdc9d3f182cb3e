"""The client session: the one thing every client interface reads and writes through.

``CacheFileSystem`` (fsspec), both datasets, the writer and the hints use only the public
methods here; they never reach into each other. A session owns, per process (forksafe.py):
the worker set and its channels (transport.py), the view watcher (view.py), the lean bulk
paths (bulkpaths.py: short-circuit, data port) and the fallback store. Constructing one does
no network I/O; the first call in a process connects (as s3fs does).

The read path of one range: split into placement stripes; each stripe from the lean path of
the worker the ring places it on (page files or the data port, into the caller's buffer), else
through gRPC from that worker and then the ring's next ones, else (``fallback=True``) from the
object store directly.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cachefs import rawbytes
from cachefs.client.transport.bulkpaths import MIN_TRY_SECONDS, BulkPaths, read_budget, try_share
from cachefs.client.transport.dataport import DataPortWrite
from cachefs.client.transport.shortcircuit import Prepared
from cachefs.client import forksafe
from cachefs.client.forksafe import ProcessLocal, RpcGate
from cachefs.client.transport.workers import WorkerHandle, WorkerSet
from cachefs.client.transport import viewfetch
from cachefs.client.transport.masterport import MasterPort, ViewPoller, supersedes
from cachefs.config import ClientConfig
from cachefs.errors import (
    DeadlineExceededError,
    StaleObjectError,
    UnauthenticatedError,
    UnknownMountError,
    WorkerUnavailableError,
    from_rpc_error,
    is_worker_fault,
)
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import CachePath
from cachefs.proto import common_pb2, master_pb2, worker_pb2
from cachefs.ring import RingConfig
from cachefs.tls import explain, open_channel

log = logging.getLogger(__name__)

T = TypeVar("T")


def info_dict(msg: common_pb2.ObjectInfo) -> dict[str, Any]:
    """An fsspec info dict from a worker's ObjectInfo."""
    is_dir = msg.type == common_pb2.DIRECTORY
    return {"name": msg.path, "size": msg.size, "type": "directory" if is_dir else "file",
            "version": msg.version, "mtime": msg.mtime}


def meta_dict(meta: Any) -> dict[str, Any]:
    """An fsspec info dict from the store adapter's ObjectMeta (fallback reads)."""
    return {"name": str(meta.path), "size": meta.size, "type": "directory" if meta.is_dir else "file",
            "version": meta.version, "mtime": meta.mtime}


@dataclass(frozen=True)
class SessionBootstrap:
    """What a main process learnt of the cluster (the view, and each worker's ``GetStatus``: its
    host and lean paths), handed to the processes it starts, DataLoader workers above all.

    A forked child's first gRPC channel can hang: it inherits whatever gRPC's threads held at the
    fork (client/forksafe.py), holding the GIL. With this a DataLoader worker on a worker's host
    starts reading through the short-circuit socket at once: no ``GetView`` and no probe; a
    forked one also sends its hints through that socket and keeps the view unwatched. Plain
    bytes: it pickles, so spawned workers get it too.
    """

    view: bytes = b""  # a serialized ClusterView ("" when there is no master)
    statuses: tuple[tuple[str, bytes], ...] = ()  # (worker address, serialized GetStatusResponse)

    def cluster_view(self) -> master_pb2.ClusterView | None:
        if not self.view:
            return None
        view = master_pb2.ClusterView()
        view.ParseFromString(self.view)
        return view

    def worker_statuses(self) -> dict[str, worker_pb2.WorkerStatus]:
        out = {}
        for address, data in self.statuses:
            status = worker_pb2.WorkerStatus()
            status.ParseFromString(data)
            out[address] = status
        return out


class _ProcessState:
    """Everything of a session that belongs to one process (built on first use there)."""

    def __init__(self, config: ClientConfig, bootstrap: SessionBootstrap | None = None) -> None:
        self.config = config
        self.rpc_gate = RpcGate()  # a fork waits for this process's calls to leave gRPC
        self.workers = WorkerSet(list(config.workers), RingConfig(stripe_size=config.stripe_size),
                                 connect=self._connect)
        self.bulk = BulkPaths(config, self.workers, known=bootstrap.worker_statuses() if bootstrap else None)
        self.view: master_pb2.ClusterView | None = None
        self.fallback_store: Any = None
        self.mounts_learned = False
        self.fallback_slots = threading.BoundedSemaphore(config.fallback_concurrency)
        # Reads not taken by a lean path (bulk.stats has those), pages of gRPC reads by hit or miss
        # as the worker's reply says, worker failovers, and reads that failed, in this process.
        self.counts = {"grpc_reads": 0, "grpc_bytes": 0, "grpc_hits": 0, "grpc_misses": 0,
                       "store_reads": 0, "store_bytes": 0, "failovers": 0, "errors": 0}
        self.lock = threading.Lock()
        self.watcher: Any = None  # ViewWatcher (client/transport/view.py): the view through gRPC
        self.poller: ViewPoller | None = None  # the view through the master's client port
        self.bulk.on_view = self.view_from_worker
        known_view = bootstrap.cluster_view() if bootstrap is not None else None
        if known_view is not None:
            self.apply_view(known_view)
        if not config.master:
            return
        if forksafe.grpc_inherited() or (known_view is not None and self.bulk.enabled):
            # A process started with a view (a DataLoader worker, forked or spawned) follows it
            # through the workers' replies: no thread, no master connection per process; one
            # forked from a gRPC process never calls gRPC (forksafe.py).
            if known_view is None and not self.workers:
                # No view handed down with this session: the parent's last one for this master,
                # else the master's client port, else one asked for from a fresh interpreter
                # (client/transport/viewfetch.py).
                data = viewfetch.last_known(config.master) or self._view_from_port(config) \
                    or viewfetch.from_helper_process(config.master, config.timeout, config.tls, config.token)
                if not data:
                    forksafe.forbid_grpc(f"the cluster view from master {config.master} (none was handed to "
                                         "this process, and neither the master's client port nor a helper "
                                         "process gave one)")
                self.apply_view(master_pb2.ClusterView.FromString(data))
            log.debug("following the cluster view through the workers in this process")
        elif not self._poll_master(config, known_view):
            from cachefs.client.transport.view import ViewWatcher  # gRPC: a master without a client port, or TLS

            self.watcher = ViewWatcher(config.master, self.apply_view, timeout=config.timeout,
                                       tls=config.tls, token=config.token, known=known_view)
            if known_view is None:
                self.watcher.fetch()  # the first use in this process: one GetView, then a watch thread
            self.watcher.start()

    @staticmethod
    def _view_from_port(config: ClientConfig, timeout: float | None = None) -> bytes:
        """The view from the master's client port, serialized (b"": none answered within
        ``timeout``, by default the config's)."""
        timeout = config.timeout if timeout is None else timeout
        port = MasterPort(config.master, config.token, timeout, tls=config.tls)
        try:
            view, _ = port.view(0, timeout)
        except OSError as exc:
            log.debug("master %s: no view from its client port: %s", config.master, exc)
            return b""
        finally:
            port.close()
        return view.SerializeToString() if view is not None else b""

    def _poll_master(self, config: ClientConfig, known_view: master_pb2.ClusterView | None) -> bool:
        """Follow the view through the master's client port (client/transport/masterport.py): False when
        no master of the list has one (an older master, all down: then gRPC)."""
        poller = ViewPoller(MasterPort(config.master, config.token, config.timeout, tls=config.tls), self.apply_view,
                            supersedes, known=known_view)
        if known_view is None:
            try:
                poller.fetch(config.timeout)
            except UnauthenticatedError:
                poller.stop()
                raise  # gRPC would refuse the same token
            except OSError as exc:
                poller.stop()
                log.info("master %s: no client port answered (%s); following the view through gRPC",
                         config.master, exc)
                return False
        self.poller = poller.start()
        return True

    def _connect(self, address: str) -> Any:
        """A gRPC channel to one worker with this session's TLS and token (cachefs/tls.py)."""
        from cachefs.client.transport.grpcchannels import CHANNEL_OPTIONS, GatedChannel  # gRPC only where it is used

        channel = open_channel(address, self.config.tls, options=CHANNEL_OPTIONS, token=self.config.token)
        return GatedChannel(channel, self.rpc_gate)

    def apply_view(self, view: master_pb2.ClusterView) -> None:
        """A newer cluster view: route by its live workers and ring settings from now on."""
        ring = RingConfig(vnodes=view.ring.vnodes or RingConfig().vnodes,
                          stripe_size=view.ring.stripe_size or self.config.stripe_size)
        if not view.workers and self.workers:
            # No live workers: a master that just restarted (workers have not re-registered
            # yet), or a cluster that is really down. Either way the last workers are the best
            # bet: dead ones fail fast behind their breakers, and fallback still applies. The
            # last view with workers stays this process's view: it is what a forked child starts
            # from (snapshot), and a child handed a view of no workers could reach no one.
            log.warning("cluster view %d has no workers; keeping the last %d", view.version,
                        len(self.workers.addresses))
            return
        self.workers.update([w.address for w in view.workers], ring)
        self.bulk.note_view(view)
        if self.config.master:
            viewfetch.remember(self.config.master, view.SerializeToString())  # for sessions of forked children
        self.view = view
        log.debug("cluster view %d: %d workers", view.version, len(view.workers))

    def view_from_worker(self, data: bytes) -> None:
        """A serialized view a worker relayed (a process that does not watch the master)."""
        view = master_pb2.ClusterView()
        view.ParseFromString(data)
        if self.view is None or supersedes(view, self.view.version, self.view.master_id):
            self.apply_view(view)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.poller is not None:
            self.poller.stop()
        self.workers.close()
        self.bulk.close()

    def snapshot(self) -> SessionBootstrap:
        """What this process knows of the cluster now (asking no one)."""
        view = self.view.SerializeToString() if self.view is not None else b""
        statuses = self.bulk.known_statuses()
        return SessionBootstrap(view, tuple((a, s.SerializeToString()) for a, s in sorted(statuses.items())))

    @staticmethod
    def release_inherited(state: "_ProcessState") -> None:
        """In a forked child: the parent's sockets may be closed here (the parent keeps its own
        descriptors); its gRPC channels and watcher are left untouched."""
        state.bulk.release_inherited()
        if state.poller is not None:
            state.poller.port.release_inherited()


class _ViewForChildren(forksafe.ForkHook):
    """A session not used yet in this process has no view to hand the children it forks, and
    they cannot ask the master (forksafe.py): one GetView just before the fork, for them."""

    def __init__(self, session: "ClientSession") -> None:
        self._session = weakref.ref(session)
        forksafe.register(self)

    def before_fork(self, deadline: float) -> None:
        session = self._session()
        if session is not None:
            session.view_for_children(forksafe.time_left(deadline))


class ClientSession:
    """One cluster as seen by one client: placement, reads, metadata, writes and hints."""

    def __init__(self, config: ClientConfig, bootstrap: SessionBootstrap | None = None) -> None:
        self.config = config
        self._bootstrap = bootstrap
        self._state: ProcessLocal[_ProcessState] = ProcessLocal(
            lambda: _ProcessState(config, self._bootstrap), inherited=self._inherit, name="client session")
        self._fork_hook = _ViewForChildren(self) if config.master else None

    def _inherit(self, state: _ProcessState) -> None:
        """In a forked child: release the parent's sockets, and start from what the parent knew
        (its view and the workers it probed) rather than asking through gRPC (forksafe.py)."""
        _ProcessState.release_inherited(state)
        known = state.snapshot()
        if known.view or known.statuses:
            self._bootstrap = known

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned or unpickled copy starts unconnected (with what its creator learnt, if anything).
        return (ClientSession, (self.config, self._bootstrap))

    def view_for_children(self, timeout: float) -> None:
        """Before a fork: if this process has not used the session (so it has no view) and may call
        gRPC, fetch the view once (within ``timeout``) for the children to start from."""
        if self._state.peek() is not None or (self._bootstrap is not None and self._bootstrap.view) \
                or forksafe.grpc_inherited() or timeout <= 0:
            return
        data = _ProcessState._view_from_port(self.config, timeout)
        if data:
            view: Any = master_pb2.ClusterView.FromString(data)
        else:  # a master without a client port: through gRPC
            from cachefs.client.transport.view import fetch_view_once

            try:
                view = fetch_view_once(self.config.master, timeout, self.config.tls, self.config.token)
            except Exception as exc:  # noqa: BLE001 - a fork must go on; the child then says what it lacks
                log.debug("no view for the children of this fork: %s", exc)
                return
        if view is not None:
            known = self._bootstrap.statuses if self._bootstrap is not None else ()
            self._bootstrap = SessionBootstrap(view.SerializeToString(), known)

    def bootstrap(self) -> SessionBootstrap:
        """What this process knows of the cluster, for processes it will start (``SessionBootstrap``):
        the view, and the lean paths of every worker in it (asked now where not known yet)."""
        state = self._state.get()
        state.bulk.learn(state.workers.candidates_all())
        return state.snapshot()

    # -- placement ---------------------------------------------------------------------------------
    @property
    def rpc_gate(self) -> RpcGate:
        """What this process's worker calls pass through, so that a fork finds none inside gRPC."""
        return self._state.get().rpc_gate

    @property
    def workers(self) -> WorkerSet:
        """This process's worker set (ring and channels), connected on first use."""
        return self._state.get().workers

    @property
    def view(self) -> master_pb2.ClusterView | None:
        """The last cluster view this process received from the master (None: none yet)."""
        return self._state.get().view

    @property
    def stripe_size(self) -> int:
        """Bytes per placement stripe, as the cluster's ring has it."""
        return self.workers.ring.config.stripe_size

    def candidates(self, key: str, offset: int = 0, include_broken: bool = True) -> list[WorkerHandle]:
        """The workers placed for the stripe of ``key`` at ``offset``, in the order to try them."""
        return self.workers.candidates(key, offset, include_broken=include_broken)

    def placed(self, key: str, offset: int = 0) -> WorkerHandle | None:
        """The worker the ring places the stripe of ``key`` at ``offset`` on, whatever its breaker
        says now (None: no worker)."""
        return self.workers.placed(key, offset)

    def owners(self, keys: Iterable[str]) -> list[tuple[WorkerHandle, list[str]]]:
        """``keys`` grouped by the healthy worker placed first for each (keys with none are left out)."""
        groups: dict[str, tuple[WorkerHandle, list[str]]] = {}
        for key in keys:
            candidates = self.candidates(key, 0, include_broken=False)
            if candidates:
                groups.setdefault(candidates[0].address, (candidates[0], []))[1].append(key)
        return list(groups.values())

    def call(self, key: str, call: Callable[[Any, float], T], what: str,
             offset: int = 0, deadline: float | None = None) -> T | None:
        """Run ``call(stub, timeout)`` on the workers placed for ``key`` (its stripe at ``offset``),
        in order, all within one budget: ``deadline`` (monotonic; default the metadata timeout
        from now), each try's ``timeout`` what is left of it.

        A worker fault (down, overloaded, too slow) opens that worker's breaker and the next one
        is tried; an error about the request or about the object store behind the worker (which
        every worker would meet the same way) reaches the caller at once and opens no breaker.
        Returns None when no worker answered and fallback is on; raises otherwise (past the
        deadline: DeadlineExceededError, a TimeoutError).
        """
        state = self._state.get()
        if forksafe.grpc_inherited():
            if self.config.fallback:
                return None
            forksafe.forbid_grpc(what)
        import grpc  # only a process that calls gRPC loads it

        if deadline is None:
            deadline = time.monotonic() + self.config.timeout
        last_error: grpc.RpcError | None = None
        handles = state.workers.candidates(key, offset, include_broken=not self.config.fallback)
        for i, handle in enumerate(handles):
            left = deadline - time.monotonic()
            if left <= MIN_TRY_SECONDS:
                break
            try:
                result = call(handle.stub(), try_share(left, any(h.breaker.available() for h in handles[i + 1:])))
            except grpc.RpcError as err:
                if not is_worker_fault(err):
                    handle.breaker.record_success()  # it answered: the error is about the request or the store
                    raise from_rpc_error(err, what) from None
                log.warning("worker %s failed %s: %s", handle.address, what, err.code().name)
                handle.breaker.record_failure()
                state.counts["failovers"] += 1
                last_error = err
                continue
            handle.breaker.record_success()
            self._learn_mounts(state)
            return result
        if self.config.fallback:
            return None
        if deadline - time.monotonic() <= MIN_TRY_SECONDS:
            raise DeadlineExceededError(f"{what}: no worker served it within its budget"
                                        + (f" (last: {last_error.code().name})" if last_error is not None else ""))
        if last_error is not None:
            hint = explain(last_error.details(), self.config.tls)  # e.g. a TLS cluster dialled in plaintext
            raise from_rpc_error(last_error, f"{what}: no worker could serve it"
                                 + (f" ({hint})" if hint else "")) from None
        raise WorkerUnavailableError(f"{what}: no worker is available")

    def call_owner(self, key: str, call: Callable[[Any, float], T], what: str,
                   deadline: float | None = None) -> T:
        """``call`` for an operation that only a worker can do (writes, frees): never None."""
        result = self.call(key, call, what, deadline=deadline)
        if result is None:
            raise WorkerUnavailableError(f"{what}: no worker answered")
        return result

    def owner_stub(self, key: str, what: str) -> Any:
        """The stub of the worker placed first for ``key`` (a write stream goes there)."""
        candidates = self.candidates(key, 0)
        if not candidates:
            raise WorkerUnavailableError(f"{what}: no worker is available")
        return candidates[0].stub()

    def write_by_socket(self, cp: CachePath, size_hint: int) -> DataPortWrite | None:
        """A streamed write of ``cp`` to the data port of the worker placed first for it; None when
        it offers none to this process (then through gRPC, in a process that may use it)."""
        state = self._state.get()
        candidates = self.candidates(str(cp), 0)
        if not candidates:
            raise WorkerUnavailableError(f"write {cp}: no worker is available")
        port = state.bulk.data_port(candidates[0]) if state.bulk.enabled else None
        if port is not None:
            return DataPortWrite(port, str(cp), size_hint, self.config.timeout, self.config.min_throughput)
        if forksafe.grpc_inherited():
            forksafe.forbid_grpc(f"write {cp} (worker {candidates[0].address} offers no data port)")
        return None

    def mutate(self, cp: CachePath, request: Any, what: str, call: Callable[[Any, float], T]) -> Any:
        """A mutation (common_pb2.MetaRequest REMOVE, MKDIR, COPY or FREE) done by the workers
        placed for ``cp``: over their sockets, else through gRPC (``call(stub, timeout)``), all in
        one budget; the socket's MetaReply, or what ``call`` returned."""
        state = self._state.get()
        deadline = time.monotonic() + self.config.timeout
        if state.bulk.enabled:
            try:
                return state.bulk.meta(str(cp), request, what, deadline)
            except WorkerUnavailableError:
                if forksafe.grpc_inherited() or deadline - time.monotonic() <= MIN_TRY_SECONDS:
                    raise
        return self.call_owner(str(cp), call, what, deadline=deadline)

    def free_everywhere(self, prefix: str, what: str) -> None:
        """Every worker forgets ``prefix`` ("<mount>/<key>/": what a recursive removal took away),
        whatever worker did the removal: the objects under it are placed on all of them, and each
        would answer from its metadata until that expires. Best effort, each within the timeout."""
        state = self._state.get()
        request = common_pb2.MetaRequest(op=common_pb2.MetaRequest.FREE, path=prefix)
        for handle in state.workers.candidates_all():
            try:
                reply = state.bulk.meta_on(handle, request, self.config.timeout) if state.bulk.enabled else None
                if reply is None and not forksafe.grpc_inherited():
                    handle.stub().Free(worker_pb2.FreeRequest(prefix=prefix), timeout=self.config.timeout)
            except Exception as exc:  # noqa: BLE001 - its metadata then expires at its TTL
                log.warning("%s: worker %s could not forget %s: %s", what, handle.address, prefix, exc)

    # -- metadata ------------------------------------------------------------------------------------
    def info(self, cp: CachePath, refresh: bool = False, read_ahead: int = 0) -> dict[str, Any]:
        """The object's info. A file whose pages a worker on this host handed out is answered from
        what came with them (never staler than the worker's own metadata); with ``read_ahead``
        (a read follows: open()), its first bytes' handles are asked for in the same message."""
        state = self._state.get()
        deadline = time.monotonic() + self.config.timeout  # the call's one budget, every path inside it
        if not refresh:
            known = state.bulk.info(str(cp), read_ahead) if state.bulk.enabled else None
            if known is not None:
                size, version, mtime = known
                return {"name": str(cp), "size": size, "type": "file", "version": version, "mtime": mtime}
        if state.bulk.enabled:  # over the workers' sockets (bulkpaths.py)
            reply = self._meta_by_socket(state, str(cp), common_pb2.MetaRequest(
                op=common_pb2.MetaRequest.INFO, path=str(cp), refresh=refresh), f"info {cp}", deadline)
            if reply is not None:
                return info_dict(reply.info)
            if self._sockets_only(state, str(cp)):
                return meta_dict(self.fallback_store().info(cp, refresh))
        request = worker_pb2.InfoRequest(path=str(cp), refresh=refresh)
        msg = self.call(str(cp), lambda stub, left: stub.GetInfo(request, timeout=left), f"info {cp}",
                        deadline=deadline)
        if msg is not None:
            return info_dict(msg)
        return meta_dict(self.fallback_store().info(cp, refresh))

    def list(self, cp: CachePath, recursive: bool, refresh: bool = False) -> list[dict[str, Any]]:
        """Every entry below ``cp`` (``list_pages``, gathered)."""
        return [entry for page in self.list_pages(cp, recursive, refresh) for entry in page]

    def list_pages(self, cp: CachePath, recursive: bool, refresh: bool = False) -> Iterator[list[dict[str, Any]]]:
        """The entries below ``cp``, a page at a time as the worker hands them out (no call
        carries a whole prefix, and a caller holds one page at a time): over the workers'
        sockets, else (none answered, in a process with gRPC) through gRPC (a worker that
        knows no pages answers the whole listing with no next page)."""
        state = self._state.get()
        after = ""
        while True:
            deadline = time.monotonic() + self.config.timeout  # a page's budget (no call carries a whole prefix)
            page = self._list_page_by_socket(state, cp, recursive, refresh and not after, after, deadline) \
                if state.bulk.enabled else None
            if page is None and not self._sockets_only(state, str(cp)):
                page = self._list_page(cp, recursive, refresh and not after, after, deadline)
            if page is None:  # no worker answered, fallback on: the store's listing, past what was yielded
                rest = [meta_dict(m) for m in self.fallback_store().list(cp, recursive, refresh and not after)]
                yield sorted((e for e in rest if e["name"] > after), key=lambda e: e["name"]) if after else rest
                return
            entries, after = page
            yield entries
            if not after:
                return

    def _list_page(self, cp: CachePath, recursive: bool, refresh: bool, after: str,
                   deadline: float) -> tuple[list[dict[str, Any]], str] | None:
        """One page of a listing through gRPC: (entries, the name to ask the next page after)."""
        request = worker_pb2.ListRequest(path=str(cp), recursive=recursive, refresh=refresh, paged=True,
                                         start_after=after)

        def call(stub: Any, left: float) -> tuple[list[dict[str, Any]], str]:
            entries, next_after = [], ""
            for batch in stub.List(request, timeout=left):
                entries.extend(info_dict(e) for e in batch.entries)
                next_after = batch.next_after or next_after
            return entries, next_after

        return self.call(str(cp), call, f"list {cp}", deadline=deadline)

    def _list_page_by_socket(self, state: _ProcessState, cp: CachePath, recursive: bool, refresh: bool,
                             after: str, deadline: float) -> tuple[list[dict[str, Any]], str] | None:
        """One page of a listing over the workers' sockets (as ``_list_page``)."""
        reply = self._meta_by_socket(state, str(cp), common_pb2.MetaRequest(
            op=common_pb2.MetaRequest.LIST, path=str(cp), recursive=recursive, refresh=refresh, start_after=after),
            f"list {cp}", deadline)
        return None if reply is None else ([info_dict(e) for e in reply.entries], reply.next_after)

    def _meta_by_socket(self, state: _ProcessState, key: str, request: Any, what: str, deadline: float) -> Any:
        """A metadata operation over the workers' sockets, the way every process asks first;
        raises the worker's error. None when no socket answered: a process with gRPC asks
        through it next; one without reads the store (fallback on) or raises
        WorkerUnavailableError (fallback off)."""
        try:
            return state.bulk.meta(key, request, what, deadline)
        except WorkerUnavailableError:
            if self.config.fallback or not self._sockets_only(state, key):
                return None
            raise

    @staticmethod
    def _sockets_only(state: _ProcessState, key: str, offset: int = 0) -> bool:
        """Whether an operation on ``key`` that no worker's socket served must not go to gRPC:
        in a process that must not use it, or one that keeps off it while a placed worker offers
        a socket (forksafe.grpc_avoided: gRPC there would only be loaded to ask the same workers;
        the fallback store, when on, reads instead)."""
        return forksafe.grpc_inherited() or (forksafe.grpc_avoided() and state.bulk.offers_socket(key, offset))

    def public_mounts(self) -> list[MountSpec]:
        """The mount table without secrets: from the cluster view, else from a worker."""
        view = self.view
        if view is not None and view.mounts:
            return [MountSpec(m.name, m.url, json.loads(m.options_json or "{}"), m.read_only) for m in view.mounts]
        resp = self.call("", lambda stub, left: stub.ListMounts(worker_pb2.ListMountsRequest(), timeout=left),
                         "list mounts")
        if resp is None:
            raise WorkerUnavailableError(
                "no worker answered and no fallback_mounts are configured: cannot read the store directly")
        return [MountSpec(m.name, m.url, json.loads(m.options_json or "{}"), m.read_only) for m in resp.mounts]

    # -- reads -----------------------------------------------------------------------------------------
    def read(self, cp: CachePath, offset: int, length: int, version: str = "") -> tuple[bytes, int]:
        """Bytes [offset, offset+length) (length -1: to the end) of the given version, if any, and
        the object's size.

        A range is read stripe by stripe, each from the workers the ring places that stripe
        on; every stripe after the first is pinned to the version the first one saw.
        """
        stripe = self.stripe_size
        end = None if length < 0 else offset + length
        parts: list[bytes] = []
        pos = offset
        while True:
            boundary = (pos // stripe + 1) * stripe
            want = (boundary if end is None else min(end, boundary)) - pos
            data, size, version = self._read_stripe(cp, pos, want, version)
            parts.append(data)
            pos += len(data)
            end = size if end is None else min(end, size)
            if len(data) < want or pos >= end:
                break
        return rawbytes.join(parts, self.config.huge_pages), size

    def read_into(self, cp: CachePath, out: Any, offset: int = 0, version: str = "") -> tuple[int, int]:
        """Fill ``out`` (a writable buffer) with the object's bytes from ``offset`` (of ``version``,
        if given); returns (bytes read: fewer at the object's end, the object's size).

        Cached bytes land in ``out`` directly (page files on this host, another host's data
        port); otherwise they come through gRPC and are copied in once.
        """
        view = memoryview(out).cast("B")
        state = self._state.get()
        stripe, pos, end = self.stripe_size, offset, offset + len(view)
        size = -1
        while pos < end or size < 0:
            want = min(end, (pos // stripe + 1) * stripe) - pos
            deadline = time.monotonic() + self.read_timeout(want)
            got = state.bulk.read(str(cp), pos, want, version, view[pos - offset:pos - offset + want],
                                  deadline) if state.bulk.enabled and want else None
            if got is None:
                data, size, version = self._read_stripe(cp, pos, want, version, bulk=False, deadline=deadline)
                view[pos - offset:pos - offset + len(data)] = data
                n = len(data)
            else:
                n, size, version = len(got[0]), got[1], got[2]
                self._learn_mounts(state)  # (a worker answered: as in call)
            pos += n
            if n < want or pos >= min(end, size):
                break
        return pos - offset, size

    def read_many(self, ranges: Iterable[tuple[CachePath, int, int]]) -> list[bytes]:
        """Several ranges ``(path, start, end)`` (end -1: to the object's end), in order."""
        return [self.read(cp, start, -1 if end < 0 else max(0, end - start))[0] for cp, start, end in ranges]

    def _read_stripe(self, cp: CachePath, offset: int, length: int, version: str,
                     bulk: bool = True, deadline: float | None = None) -> tuple[bytes, int, str]:
        """Up to ``length`` bytes at ``offset`` (within one stripe), the object's size and version,
        within one budget (``deadline``; default the read timeout for ``length`` from now)."""
        state = self._state.get()
        if deadline is None:
            deadline = time.monotonic() + self.read_timeout(length)
        # Cached bytes: page files or the data port, not gRPC messages (a caller that tried them
        # already says bulk=False; an empty range it skipped: its size from there too).
        if state.bulk.enabled and (bulk or length == 0):
            got = state.bulk.read(str(cp), offset, length, version, deadline=deadline)
            if got is not None:
                self._learn_mounts(state)  # (a worker answered: as in call)
                return got
        sockets_only = self._sockets_only(state, str(cp), offset)
        if sockets_only and not self.config.fallback:
            state.counts["errors"] += 1
            raise WorkerUnavailableError(
                f"read {cp}: no worker's socket served it within {self.read_timeout(length):.0f} s (this process "
                "reads over the workers' sockets only: client/forksafe.py grpc_avoided)"
                if state.bulk.enabled else f"read {cp}: short_circuit and data_port are both off, and this "
                "process was forked from one that had loaded gRPC, so it has no way to a worker")
        request = worker_pb2.ReadRequest(path=str(cp), offset=offset, length=length, version=version)

        def call(stub: Any, timeout: float) -> tuple[bytes, int, str, int, int]:
            # The first block in one unary call (a streaming call costs a thread and ~1 ms more
            # here, which is most of a small object's read); only what is left streams.
            reply = stub.ReadBlock(request, timeout=timeout)
            info = reply.info
            want = max(0, min(length, info.size - offset))
            if len(reply.data) >= want:
                return reply.data, info.size, info.version, reply.pages_hit, reply.pages_missed
            rest = worker_pb2.ReadRequest(path=str(cp), offset=offset + len(reply.data),
                                          length=want - len(reply.data), version=info.version)
            parts, hits, misses = [reply.data], reply.pages_hit, reply.pages_missed
            for chunk in stub.Read(rest, timeout=timeout):
                parts.append(chunk.data)
                hits, misses = hits + chunk.pages_hit, misses + chunk.pages_missed
            huge = self.config.huge_pages and misses == 0  # as for short-circuit results: cached pages only
            return rawbytes.join(parts, huge), info.size, info.version, hits, misses

        counts = state.counts
        try:
            result = None if sockets_only else self.call(str(cp), call, f"read {cp}", offset=offset,
                                                         deadline=deadline)
            if result is not None:
                data, size, version, hits, misses = result
                counts["grpc_reads"] += 1
                counts["grpc_bytes"] += len(data)
                counts["grpc_hits"] += hits
                counts["grpc_misses"] += misses
                return data, size, version
            got = self._read_from_store(cp, offset, length, version)
        except Exception:
            counts["errors"] += 1  # the read failed for its caller
            raise
        counts["store_reads"] += 1
        counts["store_bytes"] += len(got[0])
        return got

    def _read_from_store(self, cp: CachePath, offset: int, length: int, version: str) -> tuple[bytes, int, str]:
        store = self.fallback_store()
        if cp.mount not in store.mounts:
            raise UnknownMountError(f"no mount named {cp.mount!r} in the fallback mount table")
        meta = store.info(cp)
        if version and meta.version != version:
            meta = store.info(cp, refresh=True)
            if meta.version != version:
                raise StaleObjectError(f"{cp} changed since it was opened (version {version} -> {meta.version})")
        if meta.is_dir:
            raise IsADirectoryError(f"{cp} is a directory")
        end = min(meta.size, offset + (meta.size if length < 0 else length))
        if offset >= end:
            return b"", meta.size, meta.version
        slots = self._state.get().fallback_slots
        if not slots.acquire(timeout=self.read_timeout(end - offset)):
            raise WorkerUnavailableError(f"read {cp}: no worker answered and the store is busy with this "
                                         f"process's other fallback reads (fallback_concurrency)")
        try:
            return store.read(meta, offset, end), meta.size, meta.version
        finally:
            slots.release()

    def read_timeout(self, length: int) -> float:
        """The deadline of a read of ``length`` bytes (bulkpaths.read_budget)."""
        return read_budget(self.config, length)

    def prepare(self, ranges: Iterable[tuple[CachePath, int, int]], fill: bool = True) -> Prepared:
        """Ask the workers on this host, once each, for the page handles of ranges
        ``(path, offset, length)`` about to be read; returns how many are now held, so that
        their reads go to no worker at all (client/transport/handles.py), and how many of those the worker
        fetched from the store first (``fill``: cold ranges are cached, then handed out, so
        their bytes never cross gRPC). (0, 0) without such a worker."""
        state = self._state.get()
        if not state.bulk.enabled:
            return Prepared(0, 0)
        return state.bulk.prepare([(str(cp), offset, length, "") for cp, offset, length in ranges], fill)

    def read_held(self, reads: list[tuple[CachePath, Any]],
                  offsets: Sequence[int] | None = None) -> list[tuple[int, int] | None]:
        """Objects read whole (or from ``offsets``) into buffers ``(path, out)`` through page
        handles this process holds (``prepare``) or page files opened by name, no message to any
        worker: per read (bytes read, object size), or None where its pages are not all there
        (read that one with ``read_into``)."""
        state = self._state.get()
        if not state.bulk.enabled or not reads:
            return [None] * len(reads)
        if offsets is None:
            return state.bulk.read_held([(str(cp), 0, memoryview(out).cast("B")) for cp, out in reads])
        return state.bulk.read_held([(str(cp), offset, memoryview(out).cast("B"))
                                     for (cp, out), offset in zip(reads, offsets)])

    def report_reads(self) -> None:
        """Send the workers on this host the reads made through held page handles now, instead
        of with the next request (their metrics and eviction see them then)."""
        self._state.get().bulk.report()

    @property
    def bulk_stats(self) -> dict[str, dict[str, int]]:
        """Reads, bytes and fallbacks to gRPC per lean path, in this process."""
        return self._state.get().bulk.stats

    def counters(self) -> dict[str, int]:
        """This process's read counters by path taken, flat: ``short_circuit_reads``/``_bytes``
        (of which ``held_reads``/``_bytes`` through held page handles), ``data_port_*``,
        ``grpc_*``, ``store_*`` (fallback), and per worker path the pages read by hit or miss
        as the worker knew them (``short_circuit_hits``/``_misses``, of which ``held_*`` through
        held descriptors and ``named_hits`` through page files opened by name;
        ``data_port_hits``/``_misses``: a miss is a page it filled for the request; ``grpc_hits``/``_misses`` from the
        replies); ``lean_fallbacks``, ``lean_errors``, ``failovers`` (a worker fault that moved
        a call to the next worker or the store), ``errors`` (reads that failed for their caller)."""
        state = self._state.get()
        bulk = state.bulk
        out = dict(state.counts)
        for kind, stats in bulk.stats.items():
            out[f"{kind}_reads"], out[f"{kind}_bytes"] = stats["reads"], stats["bytes"]
        out["held_reads"], out["held_bytes"] = bulk.held["reads"], bulk.held["bytes"]
        for kind, stats in bulk.stats.items():
            out[f"{kind}_hits"], out[f"{kind}_misses"] = stats["hits"], stats["misses"]
        short = bulk.stats["short_circuit"]
        out["held_hits"], out["held_misses"] = short["held_hits"], short["held_misses"]
        out["named_hits"] = short.get("named_hits", 0)
        out["lean_fallbacks"] = sum(s["fallbacks"] for s in bulk.stats.values())
        out["lean_errors"] = sum(s["errors"] for s in bulk.stats.values())
        out["lean_busy"] = sum(s["busy"] for s in bulk.stats.values())  # refused over a connection limit
        out["failovers"] += bulk.failovers  # moved to the next worker's socket
        return out

    @property
    def bulk_enabled(self) -> bool:
        """Whether this session tries a lean path (short-circuit or data port) at all."""
        return self._state.get().bulk.enabled

    # -- fallback to the object store -------------------------------------------------------------
    def fallback_store(self) -> Any:  # -> cachefs.store ObjectStore
        """The store adapter this process reads with when no worker answers (built once)."""
        state = self._state.get()
        if state.fallback_store is None:
            specs = [MountSpec.parse(v, name=k) for k, v in self.config.fallback_mounts.items()]
            if not specs:
                specs = self.public_mounts()
            store = _object_store(MountTable(specs))
            with state.lock:
                if state.fallback_store is None:
                    state.fallback_store = store
        return state.fallback_store

    def _learn_mounts(self, state: _ProcessState) -> None:
        """While workers answer, remember their public mount table for a later fallback (once)."""
        if self.config.fallback and not state.mounts_learned:
            state.mounts_learned = True
            try:
                self.fallback_store()
            except (OSError, ValueError) as exc:
                state.mounts_learned = False
                log.debug("could not learn mounts for fallback: %s", exc)

    # -- hints -------------------------------------------------------------------------------------------
    def hint_by_socket(self, handle: WorkerHandle, keys: list[str]) -> int | None:
        """``load_future``'s hint over ``handle``'s socket (short-circuit or data port); how many
        keys it took (0: busy, or the socket failed); None when this process has no socket to it."""
        return self._state.get().bulk.hint(handle, keys)

    def plan(self, handle: WorkerHandle, request: Any, timeout: float) -> Any:
        """A read plan's request (worker_pb2.PlanRequest) to ``handle``'s worker: over its socket,
        else (no socket to it) through gRPC; the PlanReply. Raises what failed."""
        reply = self._state.get().bulk.meta_on(handle, common_pb2.MetaRequest(
            op=common_pb2.MetaRequest.PLAN, plan=request.SerializeToString()), timeout)
        if reply is not None:
            return worker_pb2.PlanReply.FromString(reply.plan)
        return handle.stub().Plan(request, timeout=timeout)

    def load_future(self, handle: WorkerHandle, keys: list[str], timeout: float) -> Any:
        """Ask ``handle``'s worker to cache ``keys`` (a hint: metadata and first page in one GET)."""
        return handle.stub().Load.future(worker_pb2.LoadRequest(paths=keys, hint=True), timeout=timeout)

    def vouched(self, key: str) -> bool:
        """Whether a worker on this host vouches for object ``key`` here and now (pages of it
        handed to this process, or its name index), with no message: cached, as far as is known."""
        state = self._state.get()
        return state.bulk.enabled and state.bulk.info(key, 0) is not None

    def note_progress(self, job: str, position: int) -> None:
        """This process reads sample ``position`` of read plan ``job`` now (client/datasets/plans.py): local
        workers learn it with the next short-circuit request, to tell read pages from coming ones."""
        self._state.get().bulk.plan_progress.note(job, int(position))

    def close(self) -> None:
        """Close this process's channels and sockets and stop following the master."""
        self._state.clear(close=_ProcessState.close)


def _object_store(mounts: MountTable) -> Any:
    from cachefs.store.objects import ObjectStore  # the same adapter the worker uses

    return ObjectStore(mounts, metadata_ttl=5.0, list_ttl=5.0)
