"""Cold ranges for clients on this host: fetch them into the page store, then hand out the pages.

A same-host client that finds a range not cached could read it through gRPC, which copies every
byte into a message, through the worker's and the client's Python, over a socket. Instead it
asks the short-circuit socket to *fill* the range: the worker fetches what is missing (the same
single-flight, coalesced fetches as any read; one GET brings a cold object's metadata and first
pages), waits until those pages are in the page store, and answers with their descriptors like
any cached range. The bytes go store -> worker -> page file -> client's buffer, and the pages
are cached for every later reader (the same process's next epoch holds them already).

Bounded so that cold fills never starve warm reads: at most ``max_requests`` requests fill at
once (a request over that gets NOT_CACHED for its cold ranges at once, and the client reads them
through gRPC), each range's fetches run on a small pool of their own, and every wait ends at the
fill deadline (what is not in the page store by then is answered NOT_CACHED). A range that
cannot be filled at all (no such object, no permission, a directory) is answered FAILED with its
errno: a client that keeps to this socket (a DataLoader worker) raises it at once instead of
asking again.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from cachefs.errors import InvalidPathError
from cachefs.paths import parse_path
from cachefs.server.worker.reader import READ_AHEAD_BYTES, PageReader
from cachefs.store.meta import ObjectMeta

log = logging.getLogger(__name__)


#: How long one fill request may take on the worker: well under the client's socket timeout (5 s,
#: client/transport/bulkpaths.py). What is not cached by then is answered NOT_CACHED; the client's gRPC read
#: of it joins the fetches still in flight (single-flight), so no work is lost.
FILL_SECONDS = 3.0

#: A range up to this size is fetched and written on the fill pool's thread that fills it
#: (PageReader.fetch_here), not handed to the reader's fetch pool and a writer, a hand-off and a
#: wake-up each, which cost a small object's fill more CPU than its bytes. Larger ranges keep the
#: reader's pools (extents side by side).
INLINE_BYTES = 1 << 20
#: Small ranges of known objects per task on the fill pool: a request of 64 cold samples is one task
#: (on 2 cores, 4 tasks of 16 cost the worker more CPU than one: their page-file creates and the
#: store's lock contend).
GROUP_RANGES = 64

#: Errors that asking again cannot mend, with the errno a FAILED reply carries for each.
FOR_GOOD: tuple[tuple[type[BaseException], int], ...] = (
    (InvalidPathError, errno.EINVAL), (FileNotFoundError, errno.ENOENT), (PermissionError, errno.EACCES),
    (IsADirectoryError, errno.EISDIR), (NotADirectoryError, errno.ENOTDIR),
)


def failed_for_good(exc: BaseException) -> OSError | None:
    """``exc`` as an OSError with its errno, if it is one that asking again cannot mend."""
    for kind, code in FOR_GOOD:
        if isinstance(exc, kind):
            return OSError(code, str(exc))
    return None


class RangeFiller:
    """Makes ranges cached (``fill``), for the short-circuit server to open them afterwards."""

    def __init__(self, reader: PageReader, resolve: Callable[..., ObjectMeta],
                 head_bytes: Callable[[Any], int], threads: int = 16, max_requests: int = 8,
                 deadline_seconds: float = FILL_SECONDS,
                 on_outcome: Callable[[str, int], None] | None = None) -> None:
        """``resolve(path, version, head_bytes, fetched=set)``: the object's metadata for a read
        (one GET brings it with the first pages when nothing is cached, the reader adopting them
        and their ids added to ``fetched``), as the gRPC read path resolves it; ``head_bytes(range)``: how much of the object to take with it;
        ``on_outcome(outcome, ranges)``: filled, busy, failed or late (the worker's metric)."""
        if threads < 1 or max_requests < 1 or deadline_seconds <= 0:
            raise ValueError("threads and max_requests must be >= 1 and deadline_seconds > 0")
        self.reader, self._resolve, self._head_bytes = reader, resolve, head_bytes
        self.deadline_seconds = deadline_seconds
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cachefs-fill")
        self._slots = threading.BoundedSemaphore(max_requests)
        self._stats_lock = threading.Lock()
        self.stats = {"requests": 0, "ranges": 0, "filled": 0, "busy": 0, "failed": 0, "late": 0}
        self._on_outcome = on_outcome

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n
        if self._on_outcome is not None and name not in ("requests", "ranges") and n:
            self._on_outcome(name, n)

    def fill(self, ranges: Sequence[Any], fetched: list[set[Any]] | None = None,
             failures: list[OSError | None] | None = None) -> bool:
        """Bring every page of ``ranges`` (RangeRequests) into the page store, or as many as can be
        by the deadline; False (nothing done) when too many fills are running already.
        ``fetched``: one set per range, given the ids of the pages that were not cached (fetched
        for this request, or joined a fetch in flight): the misses its reply tells the client.
        ``failures``: one entry per range, set to the error of a range that cannot be filled at
        all (``failed_for_good``)."""
        if not ranges:
            return True
        if not self._slots.acquire(blocking=False):
            self._count("busy", len(ranges))
            return False
        try:
            self._count("requests")
            self._count("ranges", len(ranges))
            deadline = time.monotonic() + self.deadline_seconds

            def misses(i: int) -> set[Any] | None:
                return None if fetched is None else fetched[i]

            # Ranges whose object is not known resolve it (a GET each) on the pool, side by side,
            # and fetch and write a small range's pages on that same thread. Small ranges of known
            # objects go to the pool in groups, each fetched and written there one after another:
            # one hand-off per group, not a fetch and a write handed off per object (#47). Never
            # on this thread, whose waits end at the deadline (a stuck disk would hold it). A
            # large range of a known object (pages in extents side by side on the reader's pool)
            # is only waited for here.
            metas = [self._known(r) for r in ranges]
            futures = [self._pool.submit(self._fill_one, r, deadline, misses(i), failures, i, True)
                       for i, r in enumerate(ranges) if metas[i] is None]
            small = [i for i, r in enumerate(ranges) if metas[i] is not None and self._small(r, metas[i])]
            for k in range(0, len(small), GROUP_RANGES):
                group = [(ranges[i], misses(i), i) for i in small[k:k + GROUP_RANGES]]
                futures.append(self._pool.submit(self._fill_group, group, deadline, failures))
            inline = set(small)
            for i, r in enumerate(ranges):
                if metas[i] is not None and i not in inline:
                    self._fill_one(r, deadline, misses(i), failures, i)
            wait(futures, timeout=max(0.0, deadline - time.monotonic()))  # each range counts its own outcome
            return True
        finally:
            self._slots.release()

    def _known(self, wanted: Any) -> ObjectMeta | None:
        """The range's object metadata if it is at hand (fresh, of the version asked for)."""
        try:
            meta = self.reader.objects.cached_info(parse_path(wanted.path))
        except InvalidPathError:
            return None
        if meta is None or meta.is_dir or (wanted.version and wanted.version != meta.version):
            return None
        return meta

    def _small(self, wanted: Any, meta: ObjectMeta) -> bool:
        """The range's pages come to at most INLINE_BYTES (fetched and written on one thread)."""
        end = meta.size if wanted.length < 0 else min(meta.size, wanted.offset + wanted.length)
        return end - max(0, wanted.offset) // self.reader.page_size * self.reader.page_size <= INLINE_BYTES

    def _fill_group(self, group: list[tuple[Any, set[Any] | None, int]], deadline: float,
                    failures: list[OSError | None] | None) -> None:
        for wanted, fetched, index in group:
            self._fill_one(wanted, deadline, fetched, failures, index, True)

    def _fill_one(self, wanted: Any, deadline: float, fetched: set[Any] | None = None,
                  failures: list[OSError | None] | None = None, index: int = 0, inline: bool = False) -> None:
        """``inline``: on a pool thread, where a small range's pages are fetched and written."""
        if time.monotonic() >= deadline:  # queued behind other fills until too late: no store call
            self._count("late")
            return
        try:
            path = parse_path(wanted.path)
            if wanted.offset < 0 or wanted.length < -1:
                return  # the server refuses it when it opens the range
            meta = self._resolve(path, wanted.version, self._head_bytes(wanted), fetched=fetched)
            end = meta.size if wanted.length == -1 else min(meta.size, wanted.offset + wanted.length)
            if end <= wanted.offset:
                return
            page_size = self.reader.page_size
            last = (end - 1) // page_size
            # The range as one store request (streamed, page by page): parallel 8 MiB runs cost a
            # store that reads the whole object for each ranged GET (moto) several times the work.
            first = wanted.offset // page_size
            # Small, and one store request as the reader would group it (a worker told to fetch
            # page by page in parallel, fetch_group_pages with read-ahead off, keeps doing so).
            one_request = last - first < max(1, self.reader.extent_pages or self.reader.options.fetch_group_pages)
            if inline and one_request and end - first * page_size <= INLINE_BYTES:  # fetched and written here
                claimed = self.reader.fetch_here(meta, first, last)[0]
            else:
                claimed = self.reader.claim(meta, first, last, group=self.reader.extent_pages)
            if fetched is not None:
                fetched.update(pid for pid, _ in claimed)
            self._read_ahead(meta, wanted.offset, end, last)
            for pid, future in claimed:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
                if not self.reader.wait_settled(pid, deadline):
                    raise TimeoutError
            self._count("filled")
        except TimeoutError:  # (futures' TimeoutError too): not in the page store by the deadline
            self._count("late")
        except Exception as exc:  # noqa: BLE001 - answered NOT_CACHED (gRPC tells why), or FAILED
            self._count("failed")
            log.debug("filling %s failed: %s: %s", wanted.path, type(exc).__name__, exc)
            if failures is not None:
                failures[index] = failed_for_good(exc)

    def _read_ahead(self, meta: ObjectMeta, offset: int, end: int, last: int) -> None:
        """For a sequential reader, claim what follows the range, READ_AHEAD_BYTES of it in extents
        fetched side by side (not waited for)."""
        if end >= meta.size or not self.reader.sequential(meta, offset, end):
            return
        page_size, extent = self.reader.page_size, self.reader.extent_run
        ahead = max(extent, READ_AHEAD_BYTES // page_size)
        self.reader.claim(meta, last + 1, min((meta.size - 1) // page_size, last + ahead), group=extent)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
