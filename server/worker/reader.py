"""Serving byte ranges of objects out of pages.

For each page of a requested range: the page store if it has the page (verified), else a
fetch from the object store. Fetches are single-flight (one GET per page however many
readers wait), run page-parallel on a pool, and the fetched bytes go to the reader at once
while a second pool writes them into the page store (the reader never waits for the disk
write). Readers that continue where they stopped get an adaptive read-ahead window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
import dataclasses
from dataclasses import dataclass

from cachefs.config import WorkerConfig
from cachefs.errors import DeadlineExceededError, StaleObjectError, StoreUnavailableError, WorkerUnavailableError
from cachefs.server.worker.metrics import WorkerMetrics
from cachefs.paths import CachePath
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore
from cachefs.server.pagestore import PageId, PageStore

log = logging.getLogger(__name__)


_WORKER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
#: How long one store fetch may wait, in all, for room in the disk-write queue (back-pressure)
#: before its remaining pages are served without being cached.
WRITE_WAIT_SECONDS = 10.0


#: How far ahead a sequential reader's pages are claimed, in extents (``extent_size``) fetched side
#: by side: a tar or MDS shard of up to 64 MiB (MosaicML's default) is in flight at once.
READ_AHEAD_BYTES = 64 << 20


@dataclass(frozen=True)
class ReaderOptions:
    """The reader's share of WorkerConfig: same names, defaults taken from it (defined once there)."""

    fetch_threads: int = _WORKER_DEFAULTS["fetch_threads"]
    write_threads: int = _WORKER_DEFAULTS["write_threads"]
    parallel_pages: int = _WORKER_DEFAULTS["parallel_pages"]
    fetch_group_pages: int = _WORKER_DEFAULTS["fetch_group_pages"]
    extent_size: int = _WORKER_DEFAULTS["extent_size"]
    readahead_pages: int = _WORKER_DEFAULTS["readahead_pages"]
    store_timeout: float = _WORKER_DEFAULTS["store_timeout"]
    max_pending_write_bytes: int = _WORKER_DEFAULTS["max_pending_write_bytes"]

    @classmethod
    def from_config(cls, config: WorkerConfig) -> "ReaderOptions":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


class _SequentialTracker:
    """Remembers where recent reads of each object ended, to spot sequential readers."""

    def __init__(self, max_streams: int = 4096) -> None:
        self._lock = threading.Lock()
        self._ends: OrderedDict[tuple[str, str, str], tuple[int, int]] = OrderedDict()
        self._max = max_streams

    def window(self, meta: ObjectMeta, offset: int, end: int, page_size: int, max_window: int) -> int:
        """Read-ahead pages for a read [offset, end): doubles while reads continue, resets otherwise."""
        key = (meta.path.mount, meta.path.key, meta.version)
        with self._lock:
            last_end, window = self._ends.pop(key, (-1, 0))
            # A read from the start of an object, or one that continues the last, looks sequential.
            sequential = offset == 0 or (last_end >= 0 and abs(offset - last_end) <= page_size)
            window = min(max_window, max(1, window * 2)) if sequential else 0
            self._ends[key] = (end, window)
            while len(self._ends) > self._max:
                self._ends.popitem(last=False)
        return window


class PageReader:
    def __init__(self, pages: PageStore, objects: ObjectStore, metrics: WorkerMetrics, options: ReaderOptions):
        self.pages = pages
        self.objects = objects
        self.metrics = metrics
        self.options = options
        # The missing pages of a range (and of its read-ahead) as one store request, streamed, up
        # to an extent; fetch_group_pages when read-ahead is off.
        self.page_size = pages.page_size
        self.extent_run = max(1, options.extent_size // self.page_size)  # pages in one extent's request
        self.extent_pages = self.extent_run if options.readahead_pages > 0 else 0
        # Labelled children looked up once: labels() costs a lock and a dict walk per page otherwise.
        self._page_reads = {outcome: metrics.page_reads.labels(outcome)
                            for outcome in ("hit", "miss", "joined", "prefetch")}
        self._fetch_pool = ThreadPoolExecutor(options.fetch_threads, thread_name_prefix="cachefs-fetch")
        self._write_pool = ThreadPoolExecutor(options.write_threads, thread_name_prefix="cachefs-write")
        self._lock = threading.Lock()
        # Signalled when a page leaves _inflight or pending write bytes drop, while threads wait
        # on it for write room or a prefix (``_room_waiters`` of them; a page's own settling is
        # told by its event in ``_settle_events``: a notify_all per page woke every waiter).
        self._settled = threading.Condition(self._lock)
        self._room_waiters = 0
        # Page -> future of its bytes, from the moment a fetch starts until the page store
        # holds it: readers arriving in between share the fetch instead of starting another.
        self._inflight: dict[PageId, Future[bytes]] = {}
        self._settle_events: dict[PageId, threading.Event] = {}  # pages someone waits to settle
        self._sequential = _SequentialTracker()
        self._pending_write_bytes = 0
        self._closed = False

    # -- one page -------------------------------------------------------------------------
    def _page_id(self, meta: ObjectMeta, index: int) -> PageId:
        return PageId(meta.path.mount, meta.path.key, meta.version, index)

    def _page_bounds(self, meta: ObjectMeta, index: int) -> tuple[int, int]:
        start = index * self.page_size
        return start, min(meta.size, start + self.page_size)

    def page(self, meta: ObjectMeta, index: int, last: int | None = None, prefetch: bool = False,
             group: int = 0, here: list[list[tuple[PageId, Future[bytes]]]] | None = None,
             ) -> list[tuple[Future[bytes], bool]]:
        """Futures for page ``index`` and, if it must be fetched, the missing pages after it.

        A page comes from the page store (a done future, flagged cached), from a fetch already
        in flight (shared: single-flight), or from a new fetch. A new fetch takes the run of
        consecutive missing pages up to ``last`` (at most ``fetch_group_pages``) in one store
        request: one GET of 8 MiB costs the store far less than eight of 1 MiB (``group``: a
        larger run, for read-ahead extents and loads). With ``prefetch``, cached pages are skipped
        (empty list) and nothing counts as a read. ``here``: a new fetch's run is appended to it
        for the caller to fetch on its own thread (``fetch_here``) instead of the pool.
        """
        pid = self._page_id(meta, index)
        with self._lock:
            fut = self._inflight.get(pid)
        if fut is not None:
            if not prefetch:
                self._page_reads["joined"].inc()
            return [(fut, False)]
        if prefetch:
            if self.pages.available(pid):
                return []
        else:
            data = self.pages.get(pid)
            if data is not None:
                self._page_reads["hit"].inc()
                done: Future[bytes] = Future()
                done.set_result(data)
                return [(done, True)]
        last = index if last is None else min(last, index + max(group, self.options.fetch_group_pages) - 1)
        claimed: list[tuple[PageId, Future[bytes]]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("reader is closed")
            fut = self._inflight.get(pid)
            if fut is not None:  # another reader claimed it meanwhile
                return [(fut, False)]
            for i in range(index, last + 1):
                next_pid = pid if i == index else self._page_id(meta, i)
                if i > index and (next_pid in self._inflight or self.pages.available(next_pid)):
                    break
                fut = Future()
                self._inflight[next_pid] = fut
                claimed.append((next_pid, fut))
        self._page_reads["prefetch" if prefetch else "miss"].inc(len(claimed))
        if here is not None:
            here.append(claimed)
        else:
            self._fetch_pool.submit(self._fetch, meta, claimed)
        return [(f, False) for _, f in claimed]

    def in_flight(self, pid: PageId) -> bool:
        """A fetch of the page is under way (someone else's, to a caller about to claim it)."""
        with self._lock:
            return pid in self._inflight

    def _fetch(self, meta: ObjectMeta, claimed: list[tuple[PageId, Future[bytes]]], here: bool = False) -> None:
        """One store request for a run of consecutive pages, streamed: each page's future gets its
        bytes (and its disk write is queued) as soon as they arrived, not when the whole run has.
        ``here``: the pages are written on this thread instead (``fetch_here``), once the run's
        last page came: a reader joining a later page never waits for an earlier one's write."""
        start = self._page_bounds(meta, claimed[0][0].index)[0]
        sizes = [hi - lo for lo, hi in (self._page_bounds(meta, pid.index) for pid, _ in claimed)]
        delivered = 0
        written_here: list[tuple[PageId, bytes]] = []
        t0 = time.perf_counter()
        wait_until = time.monotonic() + WRITE_WAIT_SECONDS  # this fetch's back-pressure budget

        def deliver(i: int, page: bytes) -> None:
            nonlocal delivered
            delivered = i + 1
            pid, fut = claimed[i]
            self.metrics.bytes_from_store.inc(len(page))
            try:
                fut.set_result(page)
            except InvalidStateError:  # failed by close() meanwhile
                self._forget(pid)
                return
            if here:
                written_here.append((pid, page))
            else:
                self._queue_write(pid, page, wait_until)

        try:
            try:
                self.objects.read_pieces(meta, start, sizes, deliver)
            finally:
                self.write_adopted(written_here)  # those delivered, whatever came after them
            if delivered != len(claimed):
                raise StaleObjectError(f"{meta.path}: store gave {delivered} of {len(claimed)} pages")
        except BaseException as exc:  # noqa: BLE001 - handed to every reader still waiting
            self.metrics.store_errors.inc()
            if isinstance(exc, StoreUnavailableError):
                self.metrics.store_unavailable.inc()
            for pid, fut in claimed[delivered:]:
                self._forget(pid)
                if not fut.done():
                    try:
                        fut.set_exception(exc)
                    except InvalidStateError:
                        pass
            return
        self.metrics.store_fetch_seconds.observe(time.perf_counter() - t0)

    def _queue_write(self, pid: PageId, data: bytes, wait_until: float | None = None) -> None:
        """Hand a fetched page to the writers, waiting for room while too many bytes wait for the disk.

        A store faster than the cache disk must not grow the queue without bound: past
        ``max_pending_write_bytes`` a fetch waits (its stream is read no further: back-pressure on
        the store) until ``wait_until`` (its budget: WRITE_WAIT_SECONDS from its start), so every
        fetched page lands; only a disk stuck that long makes pages served but not cached
        (counted). Without ``wait_until`` (a head adopted by a request thread) nothing waits.
        """
        limit = self.options.max_pending_write_bytes
        event: threading.Event | None = None
        with self._settled:
            if wait_until is not None and len(data) <= limit:
                self._wait_locked(lambda: self._closed or self._pending_write_bytes + len(data) <= limit,
                                  wait_until)
            dropped = self._pending_write_bytes + len(data) > limit
            if dropped:
                event = self._settle_locked(pid)
                self.metrics.writes_dropped.inc()
            else:
                self._pending_write_bytes += len(data)
        if dropped:
            if event is not None:  # readers waiting for it to settle: it never will be cached
                event.set()
            return
        try:
            self._write_pool.submit(self._store, pid, data)
        except RuntimeError:  # pool shut down: the page is simply not cached
            with self._lock:
                self._pending_write_bytes -= len(data)
            self._forget(pid)

    def _store(self, pid: PageId, data: bytes) -> None:
        try:
            self.pages.put(pid, data)
        finally:
            with self._lock:  # one acquisition for both (a page's hand-offs are what cold fills cost)
                self._pending_write_bytes -= len(data)
                event = self._settle_locked(pid)
            if event is not None:
                event.set()

    def _forget(self, pid: PageId) -> None:
        with self._lock:
            event = self._settle_locked(pid)
        if event is not None:
            event.set()

    def _settle_locked(self, pid: PageId) -> threading.Event | None:
        """The page leaves ``_inflight`` (the lock held); its waiters' event, for the caller to set."""
        self._inflight.pop(pid, None)
        if self._room_waiters:
            self._settled.notify_all()
        return self._settle_events.pop(pid, None) if self._settle_events else None

    def _wait_locked(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """``_settled.wait_for`` (the lock held), counted so that settling pages notify only while
        someone waits this way."""
        self._room_waiters += 1
        try:
            return self._settled.wait_for(predicate, timeout=max(0.0, deadline - time.monotonic()))
        finally:
            self._room_waiters -= 1

    # -- waits for loads ----------------------------------------------------------------------
    def wait_write_room(self, nbytes: int, deadline: float) -> bool:
        """Wait until ``nbytes`` more could queue for the disk without being dropped.

        A load fetches only what can be cached: past ``max_pending_write_bytes`` the writers
        drop pages, so the load waits for room instead. False at the deadline, or at once if
        ``nbytes`` can never fit.
        """
        limit = self.options.max_pending_write_bytes
        if nbytes > limit:
            return False
        with self._settled:
            return self._wait_locked(lambda: self._pending_write_bytes + nbytes <= limit, deadline)

    def wait_settled(self, pid: PageId, deadline: float) -> bool:
        """Wait until the page's fetch and page-store write are over (cached, dropped or failed)."""
        with self._lock:
            if pid not in self._inflight:
                return True
            event = self._settle_events.get(pid)
            if event is None:
                event = self._settle_events[pid] = threading.Event()
        return event.wait(timeout=max(0.0, deadline - time.monotonic()))

    def wait_prefix_settled(self, mount: str, prefix: str, deadline: float) -> bool:
        """Wait until no page of a key under ``prefix`` is being fetched or written.

        Free runs this first: a page fetched before it (a read served from the store, its write
        still queued) would otherwise land in the page store after the prefix was dropped.
        """
        def settled() -> bool:
            return not any(pid.mount == mount and pid.key.startswith(prefix) for pid in self._inflight)
        with self._settled:
            return self._wait_locked(settled, deadline)

    # -- a range ------------------------------------------------------------------------------
    def adopt(self, meta: ObjectMeta, data: bytes, later: list[tuple[PageId, bytes]] | None = None) -> bool:
        """Take the first pages of an object that arrived with its metadata (see ObjectStore.open).

        Every whole page in ``data`` (and a short last page at the object's end) is served and
        written like a fetched one. False if the first page was not taken (not a whole page, or
        already in flight); later pages already in flight are left to their fetch.
        ``later``: the caller will write the pages itself (``write_adopted``, always, once the
        open is over): a load or a fill that waits for them to be cached anyway, rather than
        hand them to a writer (a wake-up, a future and a queue per small object). Not inside the
        open: readers joining it would wait for the disk.
        """
        first_end = self._page_bounds(meta, 0)[1]
        if not data or len(data) < first_end:
            return False
        view = memoryview(data)
        offered: list[tuple[PageId, bytes]] = []  # cut outside the lock: copies take a while
        for index in range(0, (len(data) + self.page_size - 1) // self.page_size):
            lo, hi = self._page_bounds(meta, index)
            if hi > len(data):
                break  # a partial page: not a page of the store
            offered.append((self._page_id(meta, index), data if (lo, hi) == (0, len(data)) else bytes(view[lo:hi])))
        taken: list[tuple[PageId, bytes]] = []
        with self._lock:
            if self._closed or offered[0][0] in self._inflight:
                return False
            for pid, page in offered:
                if pid not in self._inflight:
                    fut: Future[bytes] = Future()
                    fut.set_result(page)
                    self._inflight[pid] = fut
                    taken.append((pid, page))
        for pid, page in taken:
            self.metrics.bytes_from_store.inc(len(page))
            if later is not None:
                later.append((pid, page))
            else:
                self._queue_write(pid, page)
        return True

    def open_writing_head(self, path: CachePath, head_bytes: int,
                          fetched: set[PageId] | None = None) -> tuple[ObjectMeta, bytes | None]:
        """``ObjectStore.open`` for a caller that waits for the pages to be cached anyway (a load,
        a fill): the head's pages are adopted and written on this thread once the open is over.
        ``fetched``: given the ids of the pages the open's request brought (a fill's misses)."""
        adopted: list[tuple[PageId, bytes]] = []
        try:
            return self.objects.open(path, head_bytes, adopt=lambda meta, data: self.adopt(meta, data, adopted))
        finally:
            if fetched is not None:
                fetched.update(pid for pid, _ in adopted)
            self.write_adopted(adopted)

    def write_adopted(self, pages: list[tuple[PageId, bytes]]) -> None:
        """Write the pages ``adopt`` left to the caller (in a ``finally``: a page adopted and never
        written would stay in flight)."""
        for pid, page in pages:
            self._write_now(pid, page)
        pages.clear()

    def _write_now(self, pid: PageId, data: bytes) -> None:
        """A page written on this thread, counted as pending while it is (as a queued one)."""
        with self._lock:
            self._pending_write_bytes += len(data)
        try:
            self._store(pid, data)
        except Exception as exc:  # noqa: BLE001 - as in a writer: the page is served, just not cached
            log.warning("writing page %s failed: %s", pid, exc)

    def read(self, meta: ObjectMeta, offset: int, length: int, deadline: float | None = None,
             then: int = 0, tally: list[int] | None = None) -> Iterator[bytes | memoryview]:
        """Yield the bytes of [offset, offset+length) in order, at most one page per chunk.

        ``deadline`` is a ``time.monotonic()`` instant; waits past it raise DeadlineExceededError.
        ``then``: bytes the caller will ask for right after this range (the rest of a read whose
        first block this is); up to an extent of them (``parallel_pages`` with read-ahead off) are
        fetched now, in one store request, so the store
        works while this range travels to the caller and the next call arrives.
        ``tally``: ``[hits, misses]`` this read adds its pages to (a page is counted before its
        chunk is yielded): the hit or miss the reply tells the client.
        """
        end = min(meta.size, offset + length)
        if offset >= end:
            return
        first, last = offset // self.page_size, (end - 1) // self.page_size
        ahead = self._sequential.window(meta, offset, end, self.page_size, self.options.readahead_pages)
        if then > 0 and end < meta.size:
            # The rest of the caller's read, up to an extent, as one more store request now.
            rest = -(-min(then, meta.size - end) // self.page_size)
            ahead = max(ahead, min(max(self.options.parallel_pages, self.extent_pages), rest))
        pending: deque[tuple[Future[bytes], bool]] = deque()
        next_index = first
        # A reader that goes away mid-range leaves its fetches to finish and be cached.
        for index in range(first, last + 1):
            while next_index <= last and len(pending) < self.options.parallel_pages:
                entries = self.page(meta, next_index, last=last, group=self.extent_pages)
                pending.extend(entries)
                next_index += len(entries)
            if ahead and next_index > last:  # the whole range is claimed: what follows it next
                self._readahead(meta, last + 1, ahead)
                ahead = 0
            fut, cached = pending.popleft()
            if tally is not None:
                tally[0 if cached else 1] += 1
            data = self._wait(fut, meta, index, deadline)
            page_start = index * self.page_size
            lo = max(offset, page_start) - page_start
            hi = min(end, page_start + len(data)) - page_start
            chunk = data if lo == 0 and hi == len(data) else memoryview(data)[lo:hi]
            if len(chunk) != min(end, page_start + self.page_size) - max(offset, page_start):
                raise StaleObjectError(f"{meta.path}: page {index} is shorter than the object's size says")
            if cached:
                self.metrics.bytes_from_cache.inc(len(chunk))
            yield chunk

    def _wait(self, fut: Future[bytes], meta: ObjectMeta, index: int, deadline: float | None) -> bytes:
        timeout = self.options.store_timeout
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout as exc:
            raise DeadlineExceededError(f"{meta.path}: page {index} not fetched within {timeout:.1f}s") from exc

    def sequential(self, meta: ObjectMeta, offset: int, end: int) -> bool:
        """Whether a read of [offset, end) starts the object or continues the last read of it (and
        remember it), by the tracker that sizes read-ahead; always False with read-ahead off."""
        max_window = self.options.readahead_pages
        return max_window > 0 and self._sequential.window(meta, offset, end, self.page_size, max_window) > 0

    def claim(self, meta: ObjectMeta, first: int, last: int, group: int = 0) -> list[tuple[PageId, Future[bytes]]]:
        """Start fetching every page of [first, last] that is neither cached nor in flight (runs of
        up to ``group`` or ``fetch_group_pages`` pages per store request; nothing counts as a read);
        returns the pages not cached, each with the future of its bytes (joined or new)."""
        claimed: list[tuple[PageId, Future[bytes]]] = []
        index = first
        while index <= last:
            entries = self.page(meta, index, last=last, prefetch=True, group=group)
            claimed.extend((self._page_id(meta, index + i), future) for i, (future, _) in enumerate(entries))
            index += max(1, len(entries))
        return claimed

    def fetch_here(self, meta: ObjectMeta, first: int, last: int,
                   ) -> tuple[list[tuple[PageId, Future[bytes]]], int]:
        """``claim``, but the new fetches run on this thread, each page written into the page store
        on it too, before this returns: for a caller that would only wait for them (a fill or a
        load of a small object) this saves two hand-offs between threads (fetch pool, writer) and
        their wake-ups a page. Pages in flight elsewhere are joined (their futures returned, not
        waited for), with the bytes this call fetched. The store requests are made one after
        another: for small ranges only."""
        runs: list[list[tuple[PageId, Future[bytes]]]] = []
        claimed: list[tuple[PageId, Future[bytes]]] = []
        index = first
        while index <= last:
            entries = self.page(meta, index, last=last, prefetch=True, group=last - index + 1, here=runs)
            claimed.extend((self._page_id(meta, index + i), future) for i, (future, _) in enumerate(entries))
            index += max(1, len(entries))
        fetched = 0
        for run in runs:
            self._fetch(meta, run, here=True)
            fetched += sum(len(f.result()) for _, f in run if f.done() and f.exception() is None)
        return claimed, fetched

    def _readahead(self, meta: ObjectMeta, first: int, window: int) -> None:
        self.claim(meta, first, min((meta.size - 1) // self.page_size, first + window - 1), group=self.extent_pages)

    def close(self, timeout: float = 5.0) -> None:
        """Stop fetching; let writes of already fetched pages finish (bounded by ``timeout``)."""
        with self._lock:
            self._closed = True
            self._settled.notify_all()  # fetches waiting for write room give up
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            waiting = list(self._inflight.values())
        for fut in waiting:  # fetches that were queued, never started: nobody would finish them
            if not fut.done():
                try:
                    fut.set_exception(WorkerUnavailableError("worker is shutting down"))
                except InvalidStateError:
                    pass
        deadline = time.monotonic() + timeout
        # Executor.shutdown(wait=True) has no timeout: wait for the writers by polling.
        self._write_pool.shutdown(wait=False)
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    break
            time.sleep(0.01)
