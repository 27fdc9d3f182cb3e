"""Loading whole objects into the page store (the worker's side of a cluster load job).

A load reuses the read path's machinery rather than a fetch path of its own: pages are claimed
through :meth:`PageReader.page` with ``prefetch=True`` (single-flight, runs of missing pages
coalesced into one store request, cached pages skipped) and written by the reader's writers.
What a load adds is pacing and accounting:

* **Bounded memory.** At most ``window_bytes`` of claimed pages are outstanding (fetched or
  being fetched, not yet written); the oldest page is settled before more are claimed. The
  window spans objects, so many small objects still keep several fetches busy.
* **No dropped writes.** The reader drops pages past ``max_pending_write_bytes``; a load waits
  for room there before it claims, so it never fetches what it cannot cache.
* **No thrashing.** Objects are budgeted against the cache's capacity in request order; those
  that would not fit with the ones before them fail at once, unfetched, instead of evicting the
  objects this same load just brought in.
* **Honest results.** An object counts as loaded only if every page of its version is in the
  page store when the load ends. A page that did not stay (dropped or failed write, evicted by
  other traffic) gets one more pass; then the object is reported as failed.
* **Bounded time.** Every wait ends at the deadline; what is unfinished then is reported failed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from cachefs.errors import WorkerUnavailableError
from cachefs.paths import CachePath
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore
from cachefs.server.pagestore import PageId, PageStore
from cachefs.pagefile import TRAILER_SIZE
from cachefs.server.worker.metrics import WorkerMetrics
from cachefs.server.worker.reader import PageReader

log = logging.getLogger(__name__)

MAX_PASSES = 2  # a second pass re-fetches pages that did not stay; more would only thrash
DEFAULT_WINDOW_BYTES = 64 << 20


@dataclass
class LoadResult:
    objects_loaded: int = 0
    bytes_loaded: int = 0
    bytes_skipped: int = 0
    failed: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Object:
    """One object being loaded: its version, progress and what went wrong."""

    meta: ObjectMeta
    last_page: int  # -1 for an empty object
    passes: int = 0
    outstanding: int = 0  # claimed pages not yet settled
    claiming: bool = False
    fetched: int = 0
    skipped: int = 0
    error: str = ""
    done: bool = False  # fully cached when its last page settled


@dataclass(frozen=True, slots=True)
class _Claim:
    obj: _Object
    pid: PageId
    future: Future[bytes]
    nbytes: int
    joined: bool = False  # a fetch someone else started (a read): waited for, not counted as ours


class NotAdmittedError(OSError):
    """A hinted object the registered plans read later than everything cached: not fetched."""


class _OutOfTime(Exception):
    """The load's deadline passed; what is unfinished is reported, not waited for."""


class Loader:
    """Runs one Load request; not shared between requests."""

    def __init__(self, reader: PageReader, pages: PageStore, metrics: WorkerMetrics,
                 deadline: float, window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        self.reader = reader
        self.pages = pages
        self.metrics = metrics
        self.page_size = pages.page_size
        self.deadline = deadline
        limit = reader.options.max_pending_write_bytes
        # Our own pages count twice against the writers' bound (claimed, then queued): half of it.
        self.window = max(self.page_size, min(window_bytes, limit // 2))
        self._queue: deque[_Object] = deque()
        self._claims: deque[_Claim] = deque()
        self._claimed_bytes = 0
        self._heads: dict[CachePath, int] = {}

    # -- entry point ----------------------------------------------------------------------
    def run(self, metas: list[ObjectMeta], heads: dict[CachePath, int] | None = None) -> LoadResult:
        """Load every object; each one ends loaded or in ``failed``, never both.

        ``heads``: bytes of first pages already fetched for this load (resolve_for_load), which
        the claims below find in flight or cached: fetched by this load, not skipped.
        """
        objects = [_Object(meta, (meta.size - 1) // self.page_size) for meta in metas]
        self._heads = heads or {}
        self._queue.extend(self._within_capacity(objects))
        try:
            while self._queue or self._claims:
                while self._queue:
                    self._claim_object(self._queue.popleft())
                while self._claims and not self._queue:
                    self._settle_oldest()
        except _OutOfTime:
            for obj in objects:
                if not obj.done and not obj.error:
                    obj.error = "not loaded within the deadline"
        return self._result(objects)

    def _result(self, objects: list[_Object]) -> LoadResult:
        result = LoadResult()
        for obj in objects:
            head = min(self._heads.get(obj.meta.path, 0), obj.skipped)
            result.bytes_loaded += obj.fetched + head
            result.bytes_skipped += obj.skipped - head
            if obj.done and not self._complete(obj):
                obj.error = "evicted again before the load ended (cache quota smaller than the load)"
            if obj.done and not obj.error:
                result.objects_loaded += 1
            else:
                result.failed.append(f"{obj.meta.path}: {obj.error or 'not cached'}")
                self.metrics.load_bytes.labels("failed").inc(obj.meta.size)
        self.metrics.load_bytes.labels("fetched").inc(result.bytes_loaded)
        self.metrics.load_bytes.labels("skipped").inc(result.bytes_skipped)
        return result

    def _within_capacity(self, objects: list[_Object]) -> list[_Object]:
        """The objects that fit in the cache together, in order; the others fail unfetched."""
        capacity = self.pages.stats().capacity_bytes
        left = capacity
        fitting = []
        for obj in objects:
            need = self._file_bytes(obj.meta)
            if need > left:
                obj.error = (f"needs {need} bytes of cache, {left} of {capacity} left for this load "
                             "(cache quota smaller than the load)")
            else:
                left -= need
                fitting.append(obj)
        return fitting

    # -- claiming -------------------------------------------------------------------------
    def _claim_object(self, obj: _Object) -> None:
        """Claim every missing page of the object, a window at a time."""
        obj.passes += 1
        if obj.passes == 1 and self._not_admitted(obj):
            # Registered plans read every cached page sooner than this one (plans.py): fetching
            # it now would only push out pages needed first, and it would leave again at once.
            return
        obj.claiming = True
        index, last = 0, obj.last_page
        while index <= last and not obj.error:
            # Whole objects in extents of up to extent_size, claimed one after another without
            # waiting: a shard's extents are fetched side by side (within the window).
            count = min(max(self.reader.options.fetch_group_pages, self.reader.extent_run),
                        last - index + 1, max(1, self.window // self.page_size))
            claim_bytes = self._bytes(obj.meta, index, index + count)
            self._make_room(claim_bytes)
            if not self.reader.wait_write_room(self._claimed_bytes + claim_bytes, self.deadline):
                self._no_write_room(obj, claim_bytes)
                continue
            index += self._claim_run(obj, index, index + count - 1)
        obj.claiming = False
        self._check_done(obj)

    def _claim_run(self, obj: _Object, index: int, last: int) -> int:
        """Claim pages from ``index`` (a run up to ``last``); returns how many pages it covered."""
        first = PageId(obj.meta.path.mount, obj.meta.path.key, obj.meta.version, index)
        joined = self.reader.in_flight(first)  # then page() gives that one fetch's future
        try:
            entries = self.reader.page(obj.meta, index, last=last, prefetch=True, group=last - index + 1)
        except RuntimeError as exc:  # the reader is closed
            raise WorkerUnavailableError("worker is shutting down") from exc
        if not entries:  # already cached
            if obj.passes == 1:
                obj.skipped += self._bytes(obj.meta, index, index + 1)
            return 1
        for offset, (future, _) in enumerate(entries):
            i = index + offset
            claim = _Claim(obj, PageId(obj.meta.path.mount, obj.meta.path.key, obj.meta.version, i),
                           future, self._bytes(obj.meta, i, i + 1), joined and len(entries) == 1)
            self._claims.append(claim)
            self._claimed_bytes += claim.nbytes
            obj.outstanding += 1
        return len(entries)

    def _make_room(self, claim_bytes: int) -> None:
        """Settle our oldest pages until ``claim_bytes`` more fit in the window."""
        while self._claims and self._claimed_bytes + claim_bytes > self.window:
            self._settle_oldest()

    def _no_write_room(self, obj: _Object, claim_bytes: int) -> None:
        """The writers' queue stayed full: settle our own pages, or give up on the object."""
        limit = self.reader.options.max_pending_write_bytes
        if self._claims:
            self._settle_oldest()
        elif claim_bytes > limit:
            obj.error = f"pages of {claim_bytes} bytes can never queue for the disk (max_pending_write_bytes {limit})"
        else:
            raise _OutOfTime()

    # -- settling -------------------------------------------------------------------------
    def _settle_oldest(self) -> None:
        """Wait for the oldest claimed page to be fetched and written (or dropped)."""
        claim = self._claims.popleft()
        self._claimed_bytes -= claim.nbytes
        obj = claim.obj
        obj.outstanding -= 1
        try:
            claim.future.result(timeout=self._remaining())
        except FutureTimeout as exc:
            raise _OutOfTime() from exc
        except Exception as exc:  # noqa: BLE001 - reported per object
            obj.error = obj.error or reason(str(obj.meta.path), exc)
        else:
            if claim.joined:  # being fetched by a read (or this load's resolve) already
                obj.skipped += claim.nbytes
            else:
                obj.fetched += claim.nbytes
        if not self.reader.wait_settled(claim.pid, self.deadline):
            raise _OutOfTime()
        self._check_done(obj)

    def _check_done(self, obj: _Object) -> None:
        """Once every claimed page settled: loaded, another pass, or failed."""
        if obj.claiming or obj.outstanding or obj.error:
            return
        if self._complete(obj) or self._staged(obj):
            obj.done = True
        elif obj.passes < MAX_PASSES and not self._not_admitted(obj):
            self._queue.append(obj)  # a page did not stay (dropped or evicted): once more
        else:
            cached = self._cached(obj)
            obj.error = (f"only {cached} of {obj.meta.size} bytes stayed cached "
                         "(evicted by other traffic, or page writes failed)")

    # -- helpers --------------------------------------------------------------------------
    def _staged(self, obj: _Object) -> bool:
        """Every page not cached waits in memory for its reader (not admitted: pagestore/passing.py)."""
        meta = obj.meta
        return all(self.pages.available(PageId(meta.path.mount, meta.path.key, meta.version, i))
                   for i in range(obj.last_page + 1))

    def _not_admitted(self, obj: _Object) -> bool:
        """Registered plans read the object later than everything cached (plans.py): its pages
        were served but not admitted, and fetching them again would end the same way."""
        meta = obj.meta
        if self.pages.worth_admitting(PageId(meta.path.mount, meta.path.key, meta.version, 0)):
            return False
        obj.error = "not cached: the registered training plans read it later than everything the cache holds"
        self.metrics.load_not_admitted.inc()
        return True

    def _cached(self, obj: _Object) -> int:
        path = obj.meta.path
        return self.pages.cached_bytes(path.mount, path.key, obj.meta.version)

    def _complete(self, obj: _Object) -> bool:
        return self._cached(obj) == obj.meta.size

    def _file_bytes(self, meta: ObjectMeta) -> int:
        """Page-file bytes the whole object takes in the page store (what quotas count)."""
        return meta.size + (meta.size + self.page_size - 1) // self.page_size * TRAILER_SIZE

    def _bytes(self, meta: ObjectMeta, first: int, end: int) -> int:
        """Payload bytes of pages [first, end) of the object."""
        return max(0, min(meta.size, end * self.page_size) - first * self.page_size)

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _OutOfTime()
        return remaining


def resolve_for_load(objects: ObjectStore, path: CachePath,
                     reader: PageReader | None = None) -> tuple[ObjectMeta, int]:
    """The metadata a load works from (the version reads see), and bytes fetched doing so.

    For an object nothing is known of, one GET brings the metadata and the first page (as a
    cold read does), not a HEAD and then a GET: a small object costs the store one request.
    """
    fetched = 0
    known = objects.cached_info(path)
    if reader is not None and not reader.pages.holds_object(path.mount, path.key):
        if known is None:
            meta, head = reader.open_writing_head(path, reader.page_size)  # the load waits for them anyway
            if head is not None:  # this load's GET, and the reader took its pages
                fetched = len(head)
        else:
            meta = known
            if not meta.is_dir and 0 < meta.size <= reader.page_size:
                # A small object whose metadata a listing brought: fetched and written here, on
                # the resolving thread (the resolve pool bounds how many at once), not handed to
                # the fetch pool and a writer for the load to wait on (hand-offs cost more CPU
                # than its bytes).
                fetched = reader.fetch_here(meta, 0, 0)[1]
    else:
        meta = known if known is not None else objects.info(path)
    if meta.is_dir:
        raise IsADirectoryError("is a directory")
    return meta, fetched


def reason(path: str, exc: BaseException) -> str:
    """What went wrong, without the path (the failed entry names it) or an errno prefix."""
    text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(exc).__name__
    for lead in (f"{path}: ", f"{path} "):
        if text.startswith(lead):
            return text[len(lead):]
    return text


def failure(path: str, exc: BaseException) -> str:
    """``"<path>: <reason>"`` for a response's ``failed`` list."""
    return f"{path}: {reason(path, exc)}"
