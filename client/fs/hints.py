"""Telling the cache what comes next: fire-and-forget loads of upcoming objects.

A dataset knows its epoch order long before it reads each sample. The in-memory prefetch
window is bounded in bytes (it holds data in the training process), so it reaches only a few
samples ahead; a hint reaches much further at no memory cost here: the worker that will serve
an object fetches it from the store into its page store now, so on a cold epoch the reader
finds it cached instead of waiting on the store.

A hint goes over the worker's socket (its LOAD operation, answered at once: server/worker/
metaops.py), else, to a worker this process has no socket to, as a ``Load`` call through gRPC.
Hints are advisory. A hint that cannot be sent at once (too many in flight, no worker) is
dropped, a failed one is only counted, and once the cache keeps answering "all of that was
already cached" (a warm epoch) hinting backs off, so it costs the workers almost nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cachefs.client import forksafe
from cachefs.paths import parse_path, strip_protocol

if TYPE_CHECKING:
    from cachefs.client.transport.session import ClientSession

log = logging.getLogger(__name__)


class Hinter(forksafe.ForkHook):
    """Sends hints for one session in one process (a forked child starts afresh).

    A process must not fork while gRPC is completing an async call on its behalf: the child
    would inherit gRPC's threads' state mid-call (DataLoader workers then abort or hang). So
    before any fork (forksafe.py) outstanding hints are cancelled and given a moment to finish.
    """

    def __init__(self, session: "ClientSession", *, max_in_flight: int = 2, batch: int = 32,
                 timeout: float = 30.0, warm_streak: int = 3) -> None:
        if max_in_flight < 1 or batch < 1:
            raise ValueError("max_in_flight and batch must be >= 1")
        self.session, self.max_in_flight, self.batch, self.timeout = session, max_in_flight, batch, timeout
        self.warm_streak = warm_streak
        self._lock = threading.Lock()
        self._idle_cv = threading.Condition(self._lock)
        self._futures: set[Any] = set()  # grpc.Future
        self._pid = forksafe.pid()
        self._in_flight = 0
        self._sent: set[str] = set()
        self._idle = 0        # consecutive replies that loaded nothing
        self._skip = 0        # hint calls to skip while backing off
        self._backoff = 1
        # sent: Load calls (or socket hints taken); answered: those the worker answered (a socket
        # hint is answered when taken); failed: calls that failed or were cancelled.
        self.stats = {"sent": 0, "paths": 0, "answered": 0, "dropped": 0, "failed": 0, "bytes_loaded": 0,
                      "skipped_warm": 0}
        forksafe.register(self)

    # -- fork hooks (client/forksafe.py) -------------------------------------------------------------
    def before_fork(self, deadline: float) -> None:
        self.drain(timeout=forksafe.time_left(deadline))

    def after_fork_in_child(self) -> None:
        # The parent's calls are not ours, and a parent thread may have held the lock.
        self._lock = threading.Lock()
        self._idle_cv = threading.Condition(self._lock)
        self._in_flight, self._sent, self._futures, self._pid = 0, set(), set(), forksafe.pid()

    def drain(self, timeout: float) -> bool:
        """Cancel outstanding hints and wait (up to ``timeout``) until none is in flight."""
        if self._pid != forksafe.pid():
            return True
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        with self._idle_cv:
            return self._idle_cv.wait_for(lambda: self._in_flight == 0, timeout=timeout)

    def reset(self) -> None:
        """A new epoch: objects hinted before may have been evicted since; hint them again."""
        with self._lock:
            self._sent.clear()

    def hint(self, paths: Iterable[str]) -> int:
        """Ask the workers placed for ``paths`` to cache them; returns how many paths were sent."""
        with self._lock:
            if self._skip > 0:
                self._skip -= 1
                self.stats["skipped_warm"] += 1
                return 0
        keys = [str(parse_path(strip_protocol(raw).rstrip("/"))) for raw in paths]
        with self._lock:
            fresh = [k for k in dict.fromkeys(keys) if k not in self._sent]
        if not fresh:
            return 0
        sent = 0
        for handle, keys in self.session.owners(fresh):
            by_socket = self._hint_by_socket(handle, keys)
            if by_socket is not None or forksafe.grpc_inherited():
                sent += by_socket or 0
                continue
            # No socket to that worker (TLS, an older worker): a Load call through gRPC.
            for i in range(0, len(keys), self.batch):
                chunk = keys[i:i + self.batch]
                with self._lock:
                    if self._in_flight >= self.max_in_flight:
                        self.stats["dropped"] += len(chunk)
                        continue
                    self._in_flight += 1
                    self._sent.update(chunk)
                try:
                    future = self.session.load_future(handle, chunk, self.timeout)
                except Exception:  # a channel that cannot even start a call: only a hint
                    self._done(None)
                    continue
                with self._lock:
                    self._futures.add(future)
                future.add_done_callback(self._done)
                sent += len(chunk)
                self.stats["sent"] += 1
                self.stats["paths"] += len(chunk)
        return sent

    def _hint_by_socket(self, handle: Any, keys: list[str]) -> int | None:
        """Hints over the worker's socket (short-circuit or data port), answered at once: how
        many paths it took; None when this process has no socket to that worker."""
        sent = 0
        for i in range(0, len(keys), self.batch):
            chunk = keys[i:i + self.batch]
            taken = self.session.hint_by_socket(handle, chunk)
            if taken is None:
                return None if i == 0 else sent
            with self._lock:
                if not taken:
                    self.stats["dropped"] += len(chunk)
                    continue
                self._sent.update(chunk)
                self.stats["sent"] += 1
                self.stats["answered"] += 1  # the worker took it in its reply
                self.stats["paths"] += len(chunk)
            sent += len(chunk)
        return sent

    def _done(self, future: Any) -> None:
        loaded = -1
        try:
            if future is not None and future.exception() is None:
                loaded = future.result().bytes_loaded
        except Exception:  # cancelled
            loaded = -1
        with self._lock:
            self._in_flight -= 1
            self._futures.discard(future)  # type: ignore[arg-type]
            self._idle_cv.notify_all()
            if loaded < 0:
                self.stats["failed"] += 1
                return
            self.stats["answered"] += 1
            self.stats["bytes_loaded"] += loaded
            if loaded:
                self._idle, self._backoff = 0, 1
                return
            self._idle += 1
            if self._idle >= self.warm_streak:  # the cache already had it all: hint less often
                self._skip, self._backoff, self._idle = self._backoff, min(64, self._backoff * 2), 0
