"""Running a load as its listing streams: pages planned as there is room, batches to workers'
``Load``, progress, a cursor, cancellation, one retry.

One loop in the job's thread owns all the bookkeeping. It takes listing pages from ``pages``
(each one store request: ``loadpages.py``) while fewer than ``pages_ahead`` pages have objects
not done, plans each (``loadplan.py``) and dispatches its batches; the RPCs run on a small pool
(at most ``per_worker`` batches in flight per worker, ``max_inflight`` in all), each with a
deadline that grows with the batch's bytes. So the leader holds a few pages of a load, not the
prefix: an object's bookkeeping is dropped once it is done on every worker it was meant for.

The cursor: pages finish in any order, but once a page and every page before it are finished
(each object done or failed), the run commits them: ``cursor`` becomes that page's last name and
``committed`` adds their figures. A job saves both; a resumed one lists after the cursor and
starts from the committed figures, so nothing done is listed or counted again.

A worker that cannot be reached (UNAVAILABLE, deadline...) is taken as gone for this job: its
failed batch and everything still queued for it go once to each object's next ring worker;
what fails again counts as failed. Other errors (the worker answered, e.g. UNIMPLEMENTED or a
store error) fail the batch's objects at once. Cancellation stops dispatching at once; calls in
flight end by their deadline, unwaited.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import grpc

from cachefs.errors import RETRYABLE_CODES
from cachefs.proto import worker_pb2
from cachefs.ring import HashRing
from cachefs.server.master.loadplan import Batch, Page, make_batches, plan_page
from cachefs.server.master.placement import next_node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSettings:
    batch_objects: int = 64
    batch_bytes: int = 256 << 20
    per_worker: int = 2  # batches in flight per worker
    max_inflight: int = 16  # batches in flight in all (per job)
    base_timeout: float = 30.0  # seconds per Load call, plus its bytes at min_throughput
    min_throughput: float = 16 << 20
    poll_seconds: float = 0.2  # how often the loop looks at cancellation while calls run
    max_reasons: int = 5  # failures quoted in the job's error
    page_objects: int = 1000  # keys per listing request (S3's most): the cursor moves by pages
    pages_ahead: int = 8  # pages with objects not done at once: what the leader holds of a load


@dataclass
class LoadProgress:
    objects_total: int = 0  # listed so far
    bytes_total: int = 0  # listed so far: each object's size once per worker it goes to
    objects_done: int = 0  # on every worker it was meant for
    objects_failed: int = 0
    bytes_done: int = 0  # per successful copy: the object's size
    bytes_skipped: int = 0  # of bytes_done, already cached (as the workers report)
    bytes_loaded: int = 0  # fetched from the store (as the workers report)
    reasons: list[str] = field(default_factory=list)

    COUNTS = ("objects_total", "bytes_total", "objects_done", "objects_failed", "bytes_done", "bytes_skipped",
              "bytes_loaded")

    def add(self, other: "LoadProgress", max_reasons: int) -> None:
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reasons.extend(other.reasons[:max(0, max_reasons - len(self.reasons))])

    def copy(self) -> "LoadProgress":
        return dataclasses.replace(self, reasons=list(self.reasons))


@dataclass
class _PageState:
    last: str
    unfinished: int  # objects not yet done or failed
    figures: LoadProgress = field(default_factory=LoadProgress)  # this page's share of the progress


class LoadRun:
    """Streams one load; ``run()`` returns the final progress (``stopped`` says why it ended early)."""

    def __init__(
        self,
        pages: Iterator[Page],
        ring: HashRing,
        replicas: int,
        stubs: Callable[[str], Any],
        settings: LoadSettings,
        stop: Callable[[], bool],
        on_progress: Callable[["LoadRun"], None],
        epoch: int = 0,
        start: LoadProgress | None = None,
        cursor: str = "",
    ) -> None:
        self.epoch = epoch  # the leader's epoch on every batch (0: a single master)
        self.ring = ring
        # Pages listed after a worker was found gone are planned without it: its objects go
        # where a retry would send them (the ring without it), as a first attempt.
        self._plan_ring = ring
        self.replicas = replicas
        self.stubs = stubs
        self.settings = settings
        self.stop = stop
        self.on_progress = on_progress
        # ``start``: what a resumed job had committed before (objects up to ``cursor``).
        self.progress = start.copy() if start is not None else LoadProgress()
        self.committed = self.progress.copy()
        self.cursor = cursor
        self.listing = True  # False once the listing has given its last page
        self.stopped = False
        self._pages = pages
        self._open: dict[int, _PageState] = {}  # pages not committed yet, in listing order
        self._unfinished_pages = 0
        self._next_page = 0
        # Per object of the open pages, dropped once it is done or failed everywhere:
        self._sizes: dict[str, int] = {}
        self._targets: dict[str, list[str]] = {}
        self._remaining: dict[str, int] = {}
        self._page_of: dict[str, int] = {}
        self._failed: set[str] = set()
        self._gone: set[str] = set()
        self._queues: dict[str, deque[Batch]] = {}

    @property
    def held_objects(self) -> int:
        """Objects the run keeps bookkeeping for now (bounded by about ``pages_ahead`` pages)."""
        return len(self._remaining)

    def run(self) -> LoadProgress:
        s = self.settings
        pool = ThreadPoolExecutor(max(1, s.max_inflight), thread_name_prefix="cachefs-load")
        inflight: dict[Future, Batch] = {}
        busy: Counter[str] = Counter()
        try:
            while True:
                if self.stop():
                    self.stopped = True
                    break
                self._take_pages()
                for worker, queue in self._queues.items():
                    while queue and busy[worker] < s.per_worker and len(inflight) < s.max_inflight:
                        batch = queue.popleft()
                        inflight[pool.submit(self._call, batch)] = batch
                        busy[worker] += 1
                if not inflight:
                    if not self.listing and not any(self._queues.values()):
                        break
                    continue
                done, _ = wait(list(inflight), timeout=s.poll_seconds, return_when=FIRST_COMPLETED)
                for future in done:
                    batch = inflight.pop(future)
                    busy[batch.worker] -= 1
                    self._settle(batch, future)
                self.on_progress(self)  # also while nothing completes: lets the caller save on time
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return self.progress

    def _take_pages(self) -> None:
        """List and plan pages while fewer than ``pages_ahead`` have objects not done."""
        while self.listing and self._unfinished_pages < self.settings.pages_ahead and not self.stop():
            page = next(self._pages, None)
            if page is None:
                self.listing = False
                return
            self._add(page)

    def _call(self, batch: Batch) -> worker_pb2.LoadResponse:
        timeout = self.settings.base_timeout + batch.nbytes / self.settings.min_throughput
        if self.stop():  # checked again on the sending thread: a term may have ended since dispatch
            raise ConnectionError("the load stopped before this batch was sent")
        return self.stubs(batch.worker).Load(worker_pb2.LoadRequest(paths=list(batch.paths), leader_epoch=self.epoch),
                                             timeout=timeout)

    # -- bookkeeping (the loop's thread only) --

    def _add(self, page: Page) -> None:
        s = self.settings
        number = self._next_page
        self._next_page += 1
        fresh = [(path, size) for path, size in page.objects if path not in self._remaining]
        targets, batches = plan_page(self._plan_ring, fresh, self.replicas, s.batch_objects, s.batch_bytes, number)
        state = self._open[number] = _PageState(page.last, len(fresh))
        self._unfinished_pages += 1
        listed = sum(size * len(targets[path]) for path, size in fresh)
        for p in (self.progress, state.figures):
            p.objects_total += len(fresh)
            p.bytes_total += listed
        for path, size in fresh:
            self._sizes[path], self._targets[path] = size, targets[path]
            self._remaining[path], self._page_of[path] = len(targets[path]), number
        for worker, queued in batches.items():
            self._queues.setdefault(worker, deque()).extend(queued)
        for path, _ in fresh:
            if not targets[path]:  # no worker at all (an empty ring)
                self._remaining[path] = 1
                self._fail(path, "no worker to load it on")
        if not fresh:
            self._page_finished(number)

    def _figures(self, path: str) -> tuple[LoadProgress, LoadProgress]:
        return self.progress, self._open[self._page_of[path]].figures

    def _settle(self, batch: Batch, future: Future) -> None:
        exc = future.exception()
        if exc is None:
            self._loaded(batch, future.result())
            return
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        details = (exc.details() if isinstance(exc, grpc.RpcError) else str(exc)) or type(exc).__name__
        reason = f"{batch.worker}: {code.name if code else type(exc).__name__}: {details}"
        unreachable = code in RETRYABLE_CODES or isinstance(exc, (ConnectionError, TimeoutError))
        if unreachable and batch.attempt == 0:
            log.warning("load: worker %s failed (%s); its objects go to their next ring worker", batch.worker, reason)
            self._gone.add(batch.worker)
            live = [w for w in self.ring.workers if w not in self._gone]
            self._plan_ring = self.ring.with_workers(live, {w: self.ring.weights[w] for w in live if w in self.ring.weights})
            retry = [batch, *self._queues.pop(batch.worker, ())]
            self._queues[batch.worker] = deque()
            self._reroute(retry, reason)
            return
        for path in batch.paths:
            self._fail(path, reason)

    def _loaded(self, batch: Batch, resp: worker_pb2.LoadResponse) -> None:
        failed: dict[str, str] = {}
        for entry in resp.failed:
            # "<path>: <reason>"; match against the batch (a key may itself contain ": ").
            for path in batch.paths:
                if entry.startswith(path + ": ") or entry == path:
                    failed[path] = entry
                    break
            else:
                log.warning("load: %s reported a failure for a path it was not sent: %.200s", batch.worker, entry)
        page = self._open[batch.page].figures  # open: its batch's objects are not all finished
        for p in (self.progress, page):
            p.bytes_loaded += resp.bytes_loaded
        for path in batch.paths:
            if path in failed:
                self._fail(path, f"{batch.worker}: {failed[path]}")
            else:
                size = self._sizes[path]
                for p in (self.progress, page):
                    p.bytes_done += size
                self._finish_copy(path)
        for p in (self.progress, page):
            p.bytes_skipped = min(p.bytes_done, p.bytes_skipped + resp.bytes_skipped)

    def _reroute(self, batches: list[Batch], reason: str) -> None:
        """Each object of ``batches`` to its next ring worker not yet tried (once)."""
        moved: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for batch in batches:
            if batch.attempt > 0:  # already the retry: no third chance
                for path in batch.paths:
                    self._fail(path, reason)
                continue
            for path in batch.paths:
                targets = self._targets[path]
                alternative = next_node(self.ring, path, [*targets, *self._gone])
                if alternative is None:
                    self._fail(path, f"{reason} (and no other worker to try)")
                    continue
                targets[targets.index(batch.worker)] = alternative
                moved.setdefault((alternative, batch.page), []).append((path, self._sizes[path]))
        s = self.settings
        for (worker, page), items in moved.items():
            self._queues.setdefault(worker, deque()).extend(
                make_batches(worker, items, s.batch_objects, s.batch_bytes, attempt=1, page=page))

    def _fail(self, path: str, reason: str) -> None:
        if path not in self._failed:
            self._failed.add(path)
            for p in self._figures(path):
                p.objects_failed += 1
                if len(p.reasons) < self.settings.max_reasons:
                    p.reasons.append(reason if reason.startswith(path) else f"{path}: {reason}")
        self._copy_settled(path)

    def _finish_copy(self, path: str) -> None:
        if self._remaining[path] == 1 and path not in self._failed:
            for p in self._figures(path):
                p.objects_done += 1
        self._copy_settled(path)

    def _copy_settled(self, path: str) -> None:
        """One copy of ``path`` is done or failed; after its last, forget the object."""
        self._remaining[path] -= 1
        if self._remaining[path] > 0:
            return
        number = self._page_of.pop(path)
        del self._remaining[path], self._sizes[path], self._targets[path]
        self._failed.discard(path)
        self._open[number].unfinished -= 1
        if self._open[number].unfinished == 0:
            self._page_finished(number)

    def _page_finished(self, number: int) -> None:
        """Commit every finished page at the head of the listing order: the cursor moves past them."""
        self._unfinished_pages -= 1
        while self._open:
            first = next(iter(self._open))
            state = self._open[first]
            if state.unfinished:
                break
            del self._open[first]
            self.committed.add(state.figures, self.settings.max_reasons)
            self.cursor = state.last
