"""Running a planned load: batches to workers' ``Load``, progress, cancellation, one retry.

One loop in the job's thread owns all the bookkeeping; the RPCs run on a small pool (at most
``per_worker`` batches in flight per worker, ``max_inflight`` in all), each with a deadline
that grows with the batch's bytes. A worker that cannot be reached (UNAVAILABLE, deadline...)
is taken as gone for this job: its failed batch and everything still queued for it go once
to each object's next ring worker; what fails again counts as failed. Other errors (the
worker answered, e.g. UNIMPLEMENTED or a store error) fail the batch's objects at once.
Cancellation stops dispatching at once; calls in flight end by their deadline, unwaited.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import grpc

from cachefs.errors import RETRYABLE_CODES
from cachefs.proto import worker_pb2
from cachefs.ring import HashRing
from cachefs.server.master.loadplan import Batch, LoadPlan, make_batches
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


@dataclass
class LoadProgress:
    objects_done: int = 0  # on every worker it was meant for
    objects_failed: int = 0
    bytes_done: int = 0  # per successful copy: the object's size
    bytes_skipped: int = 0  # of bytes_done, already cached (as the workers report)
    bytes_loaded: int = 0  # fetched from the store (as the workers report)
    reasons: list[str] = field(default_factory=list)


class LoadRun:
    """Executes one :class:`LoadPlan`; ``run()`` returns the final progress (``stopped`` says why it ended early)."""

    def __init__(
        self,
        plan: LoadPlan,
        ring: HashRing,
        stubs: Callable[[str], Any],
        settings: LoadSettings,
        stop: Callable[[], bool],
        on_progress: Callable[[LoadProgress], None],
        epoch: int = 0,
    ) -> None:
        self.plan = plan
        self.epoch = epoch  # the leader's epoch on every batch (0: a single master)
        self.ring = ring
        self.stubs = stubs
        self.settings = settings
        self.stop = stop
        self.on_progress = on_progress
        self.progress = LoadProgress()
        self.stopped = False
        self._remaining = {path: len(ws) for path, ws in plan.targets.items()}
        self._failed: set[str] = set()
        self._gone: set[str] = set()
        self._queues: dict[str, deque[Batch]] = {w: deque(q) for w, q in plan.queues.items()}
        for path, count in self._remaining.items():
            if count == 0:  # no worker at all (an empty ring)
                self._fail(path, "no worker to load it on")

    def run(self) -> LoadProgress:
        s = self.settings
        pool = ThreadPoolExecutor(max(1, s.max_inflight), thread_name_prefix="cachefs-load")
        inflight: dict[Future, Batch] = {}
        busy: Counter[str] = Counter()
        try:
            while any(self._queues.values()) or inflight:
                if self.stop():
                    self.stopped = True
                    break
                for worker, queue in self._queues.items():
                    while queue and busy[worker] < s.per_worker and len(inflight) < s.max_inflight:
                        batch = queue.popleft()
                        inflight[pool.submit(self._call, batch)] = batch
                        busy[worker] += 1
                if not inflight:
                    continue
                done, _ = wait(list(inflight), timeout=s.poll_seconds, return_when=FIRST_COMPLETED)
                for future in done:
                    batch = inflight.pop(future)
                    busy[batch.worker] -= 1
                    self._settle(batch, future)
                self.on_progress(self.progress)  # also while nothing completes: lets the caller save on time
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return self.progress

    def _call(self, batch: Batch) -> worker_pb2.LoadResponse:
        timeout = self.settings.base_timeout + batch.nbytes / self.settings.min_throughput
        if self.stop():  # checked again on the sending thread: a term may have ended since dispatch
            raise ConnectionError("the load stopped before this batch was sent")
        return self.stubs(batch.worker).Load(worker_pb2.LoadRequest(paths=list(batch.paths), leader_epoch=self.epoch),
                                             timeout=timeout)

    # -- bookkeeping (the loop's thread only) --

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
        p = self.progress
        for path in batch.paths:
            if path in failed:
                self._fail(path, f"{batch.worker}: {failed[path]}")
            else:
                p.bytes_done += self.plan.sizes[path]
                self._finish_copy(path)
        p.bytes_loaded += resp.bytes_loaded
        p.bytes_skipped = min(p.bytes_done, p.bytes_skipped + resp.bytes_skipped)

    def _reroute(self, batches: list[Batch], reason: str) -> None:
        """Each object of ``batches`` to its next ring worker not yet tried (once)."""
        moved: dict[str, list[tuple[str, int]]] = {}
        for batch in batches:
            if batch.attempt > 0:  # already the retry: no third chance
                for path in batch.paths:
                    self._fail(path, reason)
                continue
            for path in batch.paths:
                targets = self.plan.targets[path]
                alternative = next_node(self.ring, path, [*targets, *self._gone])
                if alternative is None:
                    self._fail(path, f"{reason} (and no other worker to try)")
                    continue
                targets[targets.index(batch.worker)] = alternative
                moved.setdefault(alternative, []).append((path, self.plan.sizes[path]))
        s = self.settings
        for worker, items in moved.items():
            self._queues.setdefault(worker, deque()).extend(
                make_batches(worker, items, s.batch_objects, s.batch_bytes, attempt=1))

    def _fail(self, path: str, reason: str) -> None:
        if path not in self._failed:
            self._failed.add(path)
            self.progress.objects_failed += 1
            if len(self.progress.reasons) < self.settings.max_reasons:
                self.progress.reasons.append(reason if reason.startswith(path) else f"{path}: {reason}")
        self._remaining[path] -= 1

    def _finish_copy(self, path: str) -> None:
        self._remaining[path] -= 1
        if self._remaining[path] == 0 and path not in self._failed:
            self.progress.objects_done += 1

