"""Following the master's cluster view from a client.

The client asks for the view once, then a thread watches for newer ones (a server stream,
re-opened every ``watch_seconds`` and after errors). While the master is away the client
keeps routing by the last view it had: the master is never on the data path.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import grpc

from cachefs.client import forksafe
from cachefs.client.transport.grpcchannels import OWN_CONNECTIONS, SINGLE_THREADED_STREAMS
from cachefs.client.transport.masterport import supersedes
from cachefs.proto import master_pb2, master_pb2_grpc
from cachefs.addresses import split_addresses
from cachefs.tls import PLAINTEXT, TLSConfig, explain, open_channel

log = logging.getLogger(__name__)

class ViewWatcher(forksafe.ForkHook):
    def __init__(self, master: str, on_view: Callable[[master_pb2.ClusterView], None], timeout: float = 5.0,
                 watch_seconds: float = 30.0, tls: TLSConfig = PLAINTEXT, token: str = "",
                 known: master_pb2.ClusterView | None = None) -> None:
        """``known``: a view this process already has (handed down by the process that started
        it): the watch goes on from there with no first ``GetView``. The channel is opened on
        first use, not here: making a watcher costs no gRPC."""
        self.master = master
        # One master or several (m1:19998,m2:19998): watch one, move on to the next when it fails.
        self._addresses = split_addresses(master, "master")
        self._index = 0
        # A weak reference: a filesystem that is dropped lets its watcher end.
        self._on_view = weakref.WeakMethod(on_view) if hasattr(on_view, "__self__") else (lambda: on_view)
        self._timeout = timeout
        self._watch_seconds = watch_seconds
        self._tls = tls
        self._token = token
        self._channel: grpc.Channel | None = None
        self._stub_value: master_pb2_grpc.MasterServiceStub | None = None
        self._channel_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: grpc.Future | None = None
        self.version = known.version if known is not None else 0
        self.master_id = known.master_id if known is not None else ""
        # Fork handling: _running is cleared while a fork is pending; _outside is set whenever
        # the thread is not inside a gRPC call; _gate orders the two.
        self._running = threading.Event()
        self._running.set()
        self._outside = threading.Event()
        self._outside.set()
        self._gate = threading.Lock()
        self._pid = forksafe.pid()
        forksafe.register(self)

    # -- fork hooks (client/forksafe.py) ---------------------------------------------------------------
    # A fork while the watch stream is inside gRPC can leave the child's gRPC wedged (the child
    # inherits gRPC's threads' state mid-call), and DataLoader workers fork: so the stream is
    # closed for the fork, and reopened in the parent right after.
    def before_fork(self, deadline: float) -> None:
        self._pause(deadline)

    def after_fork_in_parent(self) -> None:
        self._resume()
    # In a child the session drops this watcher with the rest of the parent's state.

    def _pause(self, deadline: float) -> None:
        if self._pid != forksafe.pid() or self._thread is None:
            return
        with self._gate:
            self._running.clear()
        end = time.monotonic() + forksafe.time_left(deadline)
        while time.monotonic() < end:
            call = self._call  # the thread may be just opening it: cancel until it is out
            if call is not None:
                call.cancel()
            if self._outside.wait(0.02):
                break
        self._close_channel(max(0.0, end - time.monotonic()))

    def _close_channel(self, timeout: float) -> None:
        """Close the channel (the next call opens a new one); bounded: a thread stuck opening it
        holds the lock."""
        if not self._channel_lock.acquire(timeout=timeout):
            return
        try:
            channel, self._channel, self._stub_value = self._channel, None, None
        finally:
            self._channel_lock.release()
        if channel is not None:
            channel.close()

    def _resume(self) -> None:
        if self._pid == forksafe.pid():
            self._running.set()

    def _deliver(self, view: master_pb2.ClusterView) -> bool:
        callback = self._on_view()
        if callback is None:
            return False
        if supersedes(view, self.version, self.master_id):
            self.version, self.master_id = view.version, view.master_id
            callback(view)
        return True

    @property
    def _stub(self) -> master_pb2_grpc.MasterServiceStub:
        """The master's stub, its channel opened on first use (by whichever thread needs it)."""
        forksafe.forbid_grpc(f"the cluster view from master {self.master}")
        with self._channel_lock:
            if self._stub_value is None:
                self._channel = open_channel(self._addresses[self._index], self._tls, options=[OWN_CONNECTIONS, SINGLE_THREADED_STREAMS],
                                             token=self._token)
                self._stub_value = master_pb2_grpc.MasterServiceStub(self._channel)
            return self._stub_value

    def _move_on(self) -> None:
        """Watch the next master of the list (nothing to do with one master)."""
        if len(self._addresses) < 2:
            return
        with self._channel_lock:
            channel, self._channel, self._stub_value = self._channel, None, None
            self._index = (self._index + 1) % len(self._addresses)
        if channel is not None:
            channel.close()

    def fetch(self) -> bool:
        """One synchronous GetView (each master of the list once); False if none answered."""
        for attempt in range(len(self._addresses)):
            try:
                view = self._stub.GetView(master_pb2.GetViewRequest(), timeout=self._timeout)
            except grpc.RpcError as err:
                if attempt + 1 < len(self._addresses):
                    self._move_on()
                    continue
                hint = explain(err.details(), self._tls)
                log.warning("master %s: %s (%s)%s; routing with the workers known so far", self.master,
                            err.code().name, err.details(), f"; {hint}" if hint else "")
                return False
            self._deliver(view)
            return True
        return False

    def start(self) -> "ViewWatcher":
        forksafe.forbid_grpc(f"watching the cluster view of master {self.master}")
        self._thread = threading.Thread(target=self._run, name="cachefs-view", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            if not self._running.wait(timeout=1.0):
                continue  # a fork is pending
            with self._gate:
                if not self._running.is_set():
                    continue
                self._outside.clear()
            try:
                try:
                    call = self._stub.WatchView(master_pb2.GetViewRequest(known_version=self.version),
                                                timeout=self._watch_seconds)
                    self._call = call
                    for view in call:
                        failures = 0
                        if not self._deliver(view):
                            return
                finally:  # out of gRPC: a fork may go ahead (also during the back-off below)
                    self._call = None
                    self._outside.set()
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if not self._running.is_set():
                    continue  # cancelled for a fork: reopened after it
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # the stream's normal end
                    failures += 1
                    self._move_on()
                    if failures == 1:
                        log.warning("master %s: %s; keeping view %d", self.master, err.code().name, self.version)
                    self._stop.wait(min(5.0, 0.2 * 2 ** min(failures, 5)))
            except Exception as exc:  # noqa: BLE001 - e.g. a channel that cannot be opened: keep the view
                failures += 1
                if failures == 1:
                    log.warning("master %s: cannot watch the view (%s: %s); keeping view %d", self.master,
                                type(exc).__name__, exc, self.version)
                self._stop.wait(min(5.0, 0.2 * 2 ** min(failures, 5)))

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._close_channel(timeout)


def fetch_view_once(master: str, timeout: float, tls: TLSConfig = PLAINTEXT,
                    token: str = "") -> master_pb2.ClusterView | None:
    """One GetView from the first of ``master``'s addresses that answers within ``timeout`` in
    all, on a channel of its own closed at once; None if none did (never raises for a master
    that is down)."""
    forksafe.forbid_grpc(f"the cluster view from master {master}")
    deadline = time.monotonic() + timeout
    for address in split_addresses(master, "master"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with open_channel(address, tls, options=[OWN_CONNECTIONS], token=token) as channel:
            try:
                return master_pb2_grpc.MasterServiceStub(channel).GetView(master_pb2.GetViewRequest(), timeout=left)
            except grpc.RpcError as err:
                log.debug("master %s: GetView failed: %s", address, err.code().name)
    return None
