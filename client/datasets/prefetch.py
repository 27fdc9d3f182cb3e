"""Prefetch driven by a known order, bounded in bytes and in count, one per process.

Each DataLoader worker (or the main process with ``num_workers=0``) owns one
:class:`Prefetcher`. On every request the caller says which keys (positions of the epoch
order) this process will be asked for next; the prefetcher keeps the first of them in flight
on a few daemon threads, as long as their known sizes fit ``max_bytes`` and their count fits
``max_depth``. A key whose size alone exceeds ``max_bytes`` is never prefetched: it is read on
demand by the caller. Results are dropped once handed out, and entries that fall out of the
expected window (a misprediction) are dropped too. Prefetching is only a hint: a key not in
flight is read on demand, so a wrong prediction costs speed, never correctness.

Accounting: a key's size is reserved when it is submitted and released when its result is
handed out (or when a dropped entry finishes), so ``in_flight_bytes`` (payload bytes queued,
being fetched, or fetched and waiting) never exceeds ``max_bytes``; ``max_in_flight_bytes``
records the highest value it reached. (A fetch may briefly hold a second copy of the one sample
it is converting; the bound counts payloads.)

Threads are daemon threads, not a ThreadPoolExecutor: a DataLoader worker that exits must not
wait for prefetches nobody will read. Every wait has a timeout.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from cachefs.client import forksafe


class _Pool:
    """A few daemon threads running submitted calls into Futures."""

    def __init__(self, threads: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"cachefs-prefetch-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=60.0)  # idle threads just look again
            except queue.Empty:
                continue
            if item is None:
                return
            future, call = item
            item = None  # an idle thread keeps nothing of its last call (it holds the prefetcher)
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:  # noqa: BLE001 - handed to the reader
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            future = call = result = None

    def submit(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._queue.put((future, call))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


class Prefetcher(forksafe.ForkHook):
    def __init__(self, fetch: Callable[[Hashable], Any], size_of: Callable[[Hashable], int | None], *,
                 max_bytes: int, max_depth: int, threads: int = 4, timeout: float = 300.0) -> None:
        if max_bytes < 0 or max_depth < 0 or threads < 1:
            raise ValueError("max_bytes and max_depth must be >= 0 and threads >= 1")
        self._fetch, self._size_of = fetch, size_of
        self.max_bytes, self.max_depth, self.timeout = max_bytes, max_depth, timeout
        self._threads = threads
        self._pool: _Pool | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._entries: dict[Hashable, tuple[Future, int]] = {}
        self._side: Future | None = None  # the last side job (run()), waited for by drain()
        self.in_flight_bytes = 0
        self.stats = {"max_in_flight_bytes": 0, "max_in_flight": 0, "hits": 0, "on_demand": 0,
                      "too_large": 0, "dropped": 0, "submitted": 0}
        forksafe.register(self)

    # -- fork hooks (client/forksafe.py) -------------------------------------------------------------
    # Never fork while a prefetch thread is inside a read (a gRPC call): the child would inherit
    # gRPC's state mid-call. What is queued is dropped; what runs gets a moment to finish.
    def before_fork(self, deadline: float) -> None:
        self.drain(timeout=forksafe.time_left(deadline))

    def after_fork_in_child(self) -> None:
        # The parent's threads do not exist here, and one of them may have held the lock.
        self._lock = threading.Lock()
        self._entries, self.in_flight_bytes, self._pool, self._pid = {}, 0, None, -1
        self._side = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a Prefetcher belongs to one process; the dataset builds one per process")

    @property
    def in_flight(self) -> int:
        """Entries queued, being fetched, or fetched and waiting to be asked for (a live gauge)."""
        return len(self._entries)

    def _ensure_pool(self) -> _Pool:
        if self._pid != forksafe.pid():  # a forked child: the parent's threads do not exist here
            self._entries, self.in_flight_bytes, self._pool = {}, 0, None
            self._pid = forksafe.pid()
        if self._pool is None:
            self._pool = _Pool(self._threads)
            # The threads hold the pool, never this prefetcher: a dropped dataset's prefetcher is
            # collected, and its threads end with it.
            weakref.finalize(self, self._pool.close)
        return self._pool

    # -- accounting --------------------------------------------------------------------------------
    def _release(self, size: int) -> None:
        with self._lock:
            self.in_flight_bytes -= size

    def _drop(self, key: Hashable) -> None:
        # A fork's drain (another thread) may drop what the reading thread is dropping too.
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        future, size = entry
        self.stats["dropped"] += 1
        if future.cancel():
            self._release(size)
        else:  # running or done: its bytes count until it is done
            future.add_done_callback(lambda _f, s=size: self._release(s))

    def _submit(self, key: Hashable, size: int) -> None:
        with self._lock:
            self.in_flight_bytes += size
            self.stats["max_in_flight_bytes"] = max(self.stats["max_in_flight_bytes"], self.in_flight_bytes)
        future = self._ensure_pool().submit(lambda k=key: self._fetch(k))
        self._entries[key] = (future, size)
        self.stats["submitted"] += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self._entries))

    def _top_up(self, upcoming: list[Hashable]) -> None:
        for key in upcoming:
            if len(self._entries) >= self.max_depth:
                return
            if key in self._entries:
                continue
            size = self._size_of(key)
            if size is None:  # unknown size: cannot be bounded, read on demand
                continue
            if size > self.max_bytes:
                continue  # alone larger than the bound: read on demand when asked for
            with self._lock:
                fits = self.in_flight_bytes + size <= self.max_bytes
            if not fits:
                return  # keep the order: the nearest samples first, never skip ahead
            self._submit(key, size)

    def run(self, call: Callable[[], Any]) -> Future:
        """Run a side job on the prefetch threads (e.g. getting the next batch's page handles);
        ``drain`` (before a fork) waits for the last one too."""
        self._side = self._ensure_pool().submit(call)
        return self._side

    def has(self, key: Hashable) -> bool:
        """Whether ``key`` is in flight or done (a ``get`` of it would not read it now)."""
        return key in self._entries

    # -- the one call --------------------------------------------------------------------------------
    def get(self, key: Hashable, upcoming: Iterable[Hashable]) -> Any:
        """The result for ``key`` (prefetched or read now); then keep ``upcoming`` in flight.

        ``upcoming`` is consumed lazily, at most ``max_depth`` items of it.
        """
        self._ensure_pool()
        window: list[Hashable] = []
        for k in upcoming:
            window.append(k)
            if len(window) >= self.max_depth:
                break
        keep = set(window)
        for stale in [k for k in list(self._entries) if k != key and k not in keep]:
            self._drop(stale)
        entry = self._entries.pop(key, None)
        self._top_up(window)
        if entry is None:
            size = self._size_of(key)
            self.stats["on_demand"] += 1
            if size is not None and size > self.max_bytes:
                self.stats["too_large"] += 1
            return self._fetch(key)
        future, size = entry
        self.stats["hits"] += 1
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"prefetch of {key!r} did not finish in {self.timeout:.0f} s") from None
        except CancelledError:  # never expected; read it now
            return self._fetch(key)
        finally:
            if future.done():
                self._release(size)
            else:
                future.add_done_callback(lambda _f, s=size: self._release(s))
            self._top_up(window)

    def drain(self, timeout: float) -> bool:
        """Drop everything in flight and wait (up to ``timeout``) until no fetch is running."""
        if self._pid != forksafe.pid() or self._pool is None:
            return True
        self.reset()
        end = time.monotonic() + timeout
        side = self._side
        while (self.in_flight_bytes > 0 or (side is not None and not side.done())) and time.monotonic() < end:
            time.sleep(0.005)
        return self.in_flight_bytes <= 0 and (side is None or side.done())

    def reset(self) -> None:
        """Forget everything in flight (a new epoch or plan: positions mean other samples)."""
        for key in list(self._entries):
            self._drop(key)

    def close(self) -> None:
        self.reset()
        if self._pool is not None and self._pid == forksafe.pid():
            self._pool.close()
        self._pool = None
