"""Telling the cache what comes next: fire-and-forget ``Load`` requests for upcoming objects.

A dataset knows its epoch order long before it reads each sample. The in-memory prefetch
window is bounded in bytes (it holds data in the training process), so it reaches only a few
samples ahead; a hint reaches much further at no memory cost here: the worker that will serve
an object fetches it from the store into its page store now, so on a cold epoch the reader
finds it cached instead of waiting on the store.

Hints are advisory. A hint that cannot be sent at once (too many in flight, no worker) is
dropped, a failed one is only counted, and once the cache keeps answering "all of that was
already cached" (a warm epoch) hinting backs off, so it costs the workers almost nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc

from cachefs.paths import parse_path
from cachefs.proto import worker_pb2

if TYPE_CHECKING:
    from cachefs.client.filesystem import CacheFileSystem

log = logging.getLogger(__name__)

#: Hinters of this process, for the fork handler below (weak: a hinter dies with its dataset).
_LIVE: "weakref.WeakSet[Hinter]" = weakref.WeakSet()


def _before_fork() -> None:
    """A process must not fork while gRPC is completing an async call on its behalf: the child
    would inherit gRPC's threads' state mid-call (DataLoader workers then abort or hang). So
    outstanding hints are cancelled and given a moment to finish before any fork."""
    for hinter in list(_LIVE):
        hinter.drain(timeout=2.0)


os.register_at_fork(before=_before_fork)


class Hinter:
    """Sends hints for one filesystem in one process (a forked child starts afresh)."""

    def __init__(self, fs: "CacheFileSystem", *, max_in_flight: int = 2, batch: int = 32,
                 timeout: float = 30.0, warm_streak: int = 3) -> None:
        if max_in_flight < 1 or batch < 1:
            raise ValueError("max_in_flight and batch must be >= 1")
        self.fs, self.max_in_flight, self.batch, self.timeout = fs, max_in_flight, batch, timeout
        self.warm_streak = warm_streak
        self._lock = threading.Lock()
        self._idle_cv = threading.Condition(self._lock)
        self._futures: set[grpc.Future] = set()
        self._pid = os.getpid()
        self._in_flight = 0
        self._sent: set[str] = set()
        self._idle = 0        # consecutive replies that loaded nothing
        self._skip = 0        # hint calls to skip while backing off
        self._backoff = 1
        self.stats = {"sent": 0, "paths": 0, "dropped": 0, "failed": 0, "bytes_loaded": 0, "skipped_warm": 0}
        _LIVE.add(self)

    def drain(self, timeout: float) -> bool:
        """Cancel outstanding hints and wait (up to ``timeout``) until none is in flight."""
        if self._pid != os.getpid():
            return True
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        with self._idle_cv:
            return self._idle_cv.wait_for(lambda: self._in_flight == 0, timeout=timeout)

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's in-flight calls are not ours
            self._in_flight, self._sent, self._futures, self._pid = 0, set(), set(), os.getpid()

    def reset(self) -> None:
        """A new epoch: objects hinted before may have been evicted since; hint them again."""
        with self._lock:
            self._sent.clear()

    def hint(self, paths: Iterable[str]) -> int:
        """Ask the workers placed for ``paths`` to cache them; returns how many paths were sent."""
        self._check_process()
        with self._lock:
            if self._skip > 0:
                self._skip -= 1
                self.stats["skipped_warm"] += 1
                return 0
        keys = [str(parse_path(self.fs._strip_protocol(raw))) for raw in paths]
        with self._lock:
            fresh = [k for k in dict.fromkeys(keys) if k not in self._sent]
        if not fresh:
            return 0
        workers = self.fs._process_state()
        groups: dict[str, tuple[Any, list[str]]] = {}
        for key in fresh:
            candidates = workers.candidates(key, 0, include_broken=False)
            if candidates:
                groups.setdefault(candidates[0].address, (candidates[0], []))[1].append(key)
        sent = 0
        for handle, keys in groups.values():
            for i in range(0, len(keys), self.batch):
                chunk = keys[i:i + self.batch]
                with self._lock:
                    if self._in_flight >= self.max_in_flight:
                        self.stats["dropped"] += len(chunk)
                        continue
                    self._in_flight += 1
                    self._sent.update(chunk)
                try:
                    future = handle.stub().Load.future(worker_pb2.LoadRequest(paths=chunk, hint=True),
                                                          timeout=self.timeout)
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

    def _done(self, future: grpc.Future | None) -> None:
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
            self.stats["bytes_loaded"] += loaded
            if loaded:
                self._idle, self._backoff = 0, 1
                return
            self._idle += 1
            if self._idle >= self.warm_streak:  # the cache already had it all: hint less often
                self._skip, self._backoff, self._idle = self._backoff, min(64, self._backoff * 2), 0
