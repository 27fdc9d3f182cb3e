"""The cluster view from the master's client port: no gRPC in a training process.

A training process must not load gRPC (client/forksafe.py), so it follows the master's view on
the master's client port (server/master/clientport.py): plain TCP at the gRPC port + 1, in the
data port's framing (client/transport/dataport.py ``DataPortReader`` speaks it). The first exchange on a
connection is a HELLO, so a port that is not a master's (another service on the neighbouring
port, an older master without one) is never taken for one: the session then follows the view
through gRPC as before. ``ViewPoller`` asks every ``VIEW_POLL_SECONDS`` with the version it has;
an unchanged view is a reply of a few bytes. Between polls the workers' replies carry their view
version (client/transport/bulkpaths.py), so a process that reads learns of a new view sooner.

Several masters: any of them answers (a standby serves the view it follows from etcd); the
poller stays with the one that answers and moves on when it fails.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from cachefs.addresses import CLIENT_PORT_OFFSET, split_address, split_addresses
from cachefs.client import forksafe
from cachefs.client.transport.dataport import DataPortReader
from cachefs.tls import PLAINTEXT, TLSConfig
from cachefs.errors import OverloadedError, UnauthenticatedError
from cachefs.proto import common_pb2, master_pb2
from cachefs.client.timeouts import VIEW_POLL_SECONDS, CONNECT_SECONDS

log = logging.getLogger(__name__)

def supersedes(view: Any, version: int, master_id: str) -> bool:
    """Whether ``view`` replaces the view (``version``, ``master_id``) a process has. Newer views
    only; but a different master (its state lost and rebuilt) starts its own numbering, so a new
    master_id is always taken. Masters on etcd (leader_epoch set) number views alike (etcd
    revisions): there only a newer version is taken."""
    return view.version > version or (view.master_id != master_id and not view.leader_epoch)


class NotAMasterError(ConnectionError):
    """The port answered, but not as a master's client port."""


class MasterPort:
    """The client ports of one master list (``m1:19998,m2:19998``), for one process."""

    def __init__(self, master: str, token: str = "", timeout: float = 5.0, tls: TLSConfig = PLAINTEXT) -> None:
        self.master, self._tls = master, tls
        self._targets: list[tuple[str, int]] = []
        for address in split_addresses(master, "master"):
            host, port = split_address(address, "master")
            self._targets.append((host.strip("[]"), port + CLIENT_PORT_OFFSET))
        self._token, self._timeout = token, timeout
        self._readers: dict[int, DataPortReader] = {}  # target index -> reader that said HELLO as a master
        self._index = 0
        self._lock = threading.Lock()

    def _reader(self, index: int, timeout: float) -> DataPortReader:
        with self._lock:
            reader = self._readers.get(index)
        if reader is not None:
            return reader
        host, port = self._targets[index]
        reader = DataPortReader(host, port, token=self._token, timeout=min(timeout, CONNECT_SECONDS), max_idle=1,
                                tls=self._tls)
        try:
            hello = reader.hello()
        except Exception:
            reader.close()
            raise
        if hello.role != "master":
            reader.close()
            raise NotAMasterError(f"{host}:{port} is not a master's client port (it answered as {hello.role!r})")
        reader.timeout = self._timeout
        with self._lock:
            self._readers[index] = reader
        return reader

    def view(self, known_version: int, timeout: float) -> tuple[master_pb2.ClusterView | None, int]:
        """(the view, or None when it is still ``known_version``; the master's view version),
        from the first master of the list that answers within ``timeout``; raises OSError
        when none did (NotAMasterError when none is a master's client port)."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while True:
            busy = 0.0  # a master over its connection limit asked for this pause
            for step in range(len(self._targets)):
                index = (self._index + step) % len(self._targets)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    reply = self._reader(index, left).meta(
                        common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW, known_version=known_version),
                        timeout=max(0.05, deadline - time.monotonic()))
                except UnauthenticatedError:
                    raise  # every master has the same tokens, and gRPC would refuse it too
                except OverloadedError as exc:  # busy, not down: asked again after its retry-after
                    self._forget(index)
                    busy, last = max(busy, getattr(exc, "retry_after", 0.2)), exc
                    continue
                except (OSError, ValueError) as exc:  # down, refused, not a master: the next one
                    self._forget(index)
                    last = exc
                    continue
                self._index = index
                if reply.view:
                    return master_pb2.ClusterView.FromString(reply.view), reply.view_version
                return None, reply.view_version
            left = deadline - time.monotonic()
            if not busy or left <= busy:
                break
            time.sleep(busy)
        if isinstance(last, OSError):
            raise last
        raise TimeoutError(f"master {self.master}: no client port answered within {timeout:.1f}s"
                           + (f" (last: {last})" if last else ""))

    def _forget(self, index: int) -> None:
        with self._lock:
            reader = self._readers.pop(index, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.close()

    def release_inherited(self) -> None:
        """In a forked child: drop the parent's connections without touching them."""
        with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.release_inherited()
        self._lock = threading.Lock()


class ViewPoller:
    """Follows the master's view through its client port on a thread of this process."""

    def __init__(self, port: MasterPort, on_view: Callable[[master_pb2.ClusterView], None],
                 supersedes: Callable[[Any, int, str], bool], known: master_pb2.ClusterView | None = None,
                 poll_seconds: float = VIEW_POLL_SECONDS) -> None:
        self.port, self.poll_seconds = port, poll_seconds
        self._supersedes = supersedes
        # A weak reference: a session that is dropped lets its poller end.
        self._on_view = weakref.WeakMethod(on_view) if hasattr(on_view, "__self__") else (lambda: on_view)
        self.version = known.version if known is not None else 0
        self.master_id = known.master_id if known is not None else ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner = forksafe.pid()

    def fetch(self, timeout: float) -> bool:
        """One view now (raises OSError when no master's client port answered)."""
        view, _ = self.port.view(self.version, timeout)
        return view is None or self._deliver(view)

    def _deliver(self, view: master_pb2.ClusterView) -> bool:
        callback = self._on_view()
        if callback is None:
            return False
        if self._supersedes(view, self.version, self.master_id):
            self.version, self.master_id = view.version, view.master_id
            callback(view)
        return True

    def start(self) -> "ViewPoller":
        self._thread = threading.Thread(target=self._run, name="cachefs-view-poll", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_seconds if not failures else min(5.0, 0.2 * 2 ** min(failures, 5))):
            if forksafe.pid() != self._owner:
                return  # a copy in a forked child (threads do not survive a fork; this is belt and braces)
            try:
                view, _ = self.port.view(self.version, self.poll_seconds + 3.0)
            except OSError as exc:
                failures += 1
                if failures == 1:
                    log.warning("master %s: %s; keeping view %d", self.port.master, exc, self.version)
                continue
            if failures:
                log.info("master %s answers again", self.port.master)
            failures = 0
            if view is not None and not self._deliver(view):
                return

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.port.close()
