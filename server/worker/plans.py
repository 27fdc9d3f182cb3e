"""The jobs' read orders, as this worker's pages will be used: the future that eviction follows.

A training job knows the order it reads its samples in (seed + epoch: client/datasets/sampling.py), for
this epoch and the next. It tells each worker which of that worker's pages it reads at which
positions (the ``Plan`` RPC, client/datasets/plans.py), and renews the plan with its position while it reads.
From that the worker knows, for any page, when it is used next: the page store evicts the page
used furthest ahead (server/pagestore/policy.py), which on a scan larger than the cache keeps
what LRU throws away.

Positions become times so that several jobs over one mount merge in one unit: each plan has a
clock fixed when it is registered (its start time and its rate in samples per second), and a page
used by several jobs is ranked by the earliest. Within one job the order is exact whatever the
rate. Where a job is *now* is estimated from its last renewal (position + rate x elapsed), to
tell a page's use that is going on from its next one.

A dataset iterated again without a new plan (no ``set_epoch``: the same order again, as PyTorch's
samplers give) reads its plan from the start again: a reader new to the job, or one gone back,
far behind where the job was, rewinds it (``progress``), and what comes next is fetched ahead
again. Positions that come with reads are exact; renewals (a count of samples, per process) only
move a job no reader has spoken for lately.

A plan lives under a lease that the job renews; a job that stops renewing pins nothing once its
lease ends (the pages it planned fall back to LRU order). A worker restarted forgets every plan
and says so to the next renewal (``known`` false), and the job sends its plan again.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachefs.paths import parse_path
from cachefs.server.worker.planindex import NO_USE, DerivedOrder, IndexError_, PlanIndex, derive

__all__ = ["PlanError", "PlanTable"]

#: Uses of a page this many positions apart or closer are one use. 0: every position its own, as
#: Belady's rule needs (a page shared by a run of samples, a tar shard's, read once for the run:
#: its later positions go by unread and the stale check below moves it on).
MERGE_GAP = 0
#: How far a job's reads may run ahead of its reported position (samples whose reads finished),
#: in samples (client prefetch, DataLoader workers' batches in flight) at least, and in seconds of
#: reading: a read that far ahead of the position is the use there, not an early one.
SLACK_SAMPLES = 128
SLACK_SECONDS = 1.0
#: A reader (a process) of a job that has not read for this long no longer holds the job's position
#: back (it finished, or its DataLoader worker exited).
READER_SECONDS = 2.0
#: A planned use that went by this long ago without a read is looked at again.
STALE_GRACE_SECONDS = 2.0
#: How long an estimate of a job's position is reused (a batch of page touches asks it per page).
ESTIMATE_SECONDS = 0.05
MAX_LEASE_SECONDS = 3600.0
MAX_RUNS_PER_REQUEST = 1_000_000
MAX_PAGES_PER_RUN = 4096
DEFAULT_RATE = 100.0  # samples/s, until the job measures its own


class PlanError(ValueError):
    """A plan request that cannot be taken (bad values): INVALID_ARGUMENT."""


PageKey = tuple[str, str, int]  # mount, key, page index (any version: a page's next use is its slot's)


@dataclass
class _Job:
    job: str
    expires: float
    start_time: float  # the plan's clock: position p is used at start_time + (p - start_pos) / clock_rate
    start_pos: int
    clock_rate: float  # fixed with the plan, so one job's pages keep their order
    rate: float  # the latest measured: where the job is now
    position: int = 0
    complete: bool = False
    pages: dict[PageKey, tuple[list[int], list[int]]] = field(default_factory=dict)  # starts, ends
    reads: list[tuple[int, str]] = field(default_factory=list)  # (position, path), sorted when complete
    read_bytes: int = 0  # summed over reads: bytes a position reads on this worker, on average
    object_pages: dict[tuple[str, str], int] = field(default_factory=dict)  # (mount, key) -> pages planned
    ahead_to: int = 0  # positions before this were handed to prefetch already
    prefetch: bool = True  # the job wants what it reads next fetched ahead (not: no_prefetch)
    readers: dict[int, tuple[int, float]] = field(default_factory=dict)  # reader -> (position, when)
    # A plan derived here from what defines it (planindex.py): arrays in place of pages and reads.
    derived: DerivedOrder | None = None
    # estimate() of the last few milliseconds: a report of a thousand reads asks it once per page
    _estimated: tuple[float, float] = (-math.inf, 0.0)  # (when, position)

    def estimate(self, now: float) -> float:
        """Where the job reads now: its slowest reader that spoke lately (several processes read
        for one job: DataLoader workers), else its last reported position. Never a guess ahead of
        that: it would count unread pages as read (they would leave before their use), while a
        position a second behind only keeps a read page a little longer."""
        at, position = self._estimated
        if 0 <= now - at < ESTIMATE_SECONDS:
            return position
        live = [p for p, t in self.readers.values() if now - t <= READER_SECONDS]
        position = min(live) if live else self.position
        self._estimated = (now, position)
        return position

    def moved(self) -> None:
        """A reader or the position changed: the next estimate() looks again."""
        self._estimated = (-math.inf, 0.0)

    def clock(self, position: int) -> float:
        return self.start_time + (position - self.start_pos) / self.clock_rate

    def slack(self) -> float:
        return max(SLACK_SAMPLES, self.rate * SLACK_SECONDS)

    def live_readers(self, now: float) -> bool:
        return any(now - t <= READER_SECONDS for _, t in self.readers.values())

    def last_position(self) -> int:
        """The plan's last position that reads here (-1: none)."""
        if self.derived is not None:
            return self.derived.last
        return self.reads[-1][0] if self.reads else -1

    def rewinds_to(self, position: int) -> bool:
        """Whether ``position`` is the start of another pass rather than a reader a little behind
        (DataLoader workers start a pass a few batches apart): the job was well into its plan
        (past a quarter of it: the plan holds this epoch and the next), and this is in the first
        half of where it was, by a margin. Not the rate's slack: a fast job's can exceed a pass."""
        last = self.last_position()
        if not self.complete or last < 0 or 4 * self.position < last:
            return False
        return position + min(SLACK_SAMPLES, self.position // 4) < self.position // 2


@dataclass(frozen=True)
class PlanMoment:
    """The plans' clock and each job's (job, position estimate, slack, rate) at one time."""

    now: float
    jobs: dict[str, tuple[_Job, float, float, float]]


def _merge(positions: list[int]) -> tuple[list[int], list[int]]:
    starts: list[int] = []
    ends: list[int] = []
    for p in sorted(positions):
        if ends and p - ends[-1] <= MERGE_GAP:
            ends[-1] = max(ends[-1], p)
        else:
            starts.append(p)
            ends.append(p)
    return starts, ends


def _mount_key(path: str) -> tuple[str, str]:
    """("mount", "key") of a plan's "mount/key"."""
    mount, _, key = path.partition("/")
    return mount, key


class PlanTable:
    """Every registered plan of this worker; ``next_use`` is the page store's oracle."""

    def __init__(self, page_size: int, on_change: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``on_change()`` runs (outside the table's lock) when a plan completes, is replaced or
        expires: the page store then asks its pages' next uses again."""
        self.page_size = page_size
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._by_page: dict[PageKey, list[_Job]] = {}
        # Derived plans (planindex.py): the data sets' indexes, by id (shared by their jobs), those
        # being received (by index and job), the jobs whose plan is derived, their distinct pages.
        self._indexes: dict[str, PlanIndex] = {}
        self._building: dict[tuple[str, str], PlanIndex] = {}
        self._derived: list[_Job] = []
        self._derived_pages = 0
        self._on_change = on_change
        self._clock = clock
        self.stats = {"registered": 0, "renewed": 0, "expired": 0, "unknown": 0, "rewound": 0}

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def planned_pages(self) -> int:
        """Distinct pages of this worker that registered plans read (what the jobs need cached)."""
        with self._lock:
            return len(self._by_page) + self._derived_pages

    def derived_bytes(self) -> int:
        """Bytes held for derived plans: the indexes' arrays and paths, the derived orders' arrays."""
        with self._lock:
            return sum(i.nbytes() for i in self._indexes.values() if i.complete) + \
                sum(j.derived.nbytes() for j in self._derived)  # type: ignore[union-attr]

    # -- requests ------------------------------------------------------------------------------------
    def update(self, request: Any) -> bool:
        """Take one Plan request; False when it renews a plan this worker does not have."""
        return self.take(request)[0]

    def take(self, request: Any) -> tuple[bool, bool, bool]:
        """Take one Plan request: (known: the job's plan is here, index_known: the index the request
        names is here, derived: the request's order was derived here and matched).

        An index chunk is kept until its last; an order (with ``replace``) over a known index is
        derived outside every lock, and registered only if its digest is the client's: otherwise
        the job's plan stays as it was and the client sends the order itself."""
        self._check(request)
        derived: DerivedOrder | None = None
        index = self._take_index(request) if request.index_id else None
        if (len(request.index_samples) or request.index_done) and not request.replace:
            with self._lock:  # an index chunk only: the job's plan is as it was
                return request.job in self._jobs, index is not None, False
        has_order = request.HasField("order") if hasattr(request, "HasField") else False
        if has_order and request.replace:
            if index is not None:
                try:
                    derived = derive(index, request.order)
                except IndexError_ as exc:
                    raise PlanError(str(exc)) from None
            if derived is None:  # no index here, or an order this worker cannot reproduce
                with self._lock:
                    return request.job in self._jobs, index is not None, False
        return self._update(request, derived), index is not None, derived is not None

    def _take_index(self, request: Any) -> PlanIndex | None:
        """Keep an index chunk; the complete index the request names (None: not here)."""
        key = (request.index_id, request.job)
        now = self._clock()
        chunk = len(request.index_samples) > 0 or request.index_done
        if chunk:
            with self._lock:
                building = self._building.get(key)
                if building is None:
                    if request.index_size < 0:
                        raise PlanError("index_size must be >= 0")
                    building = self._building[key] = PlanIndex(request.index_id, request.index_size, self.page_size)
                building.expires = now + request.lease_seconds
            try:
                building.add(request)
                if request.index_done:
                    building.finish()  # O(units): outside the lock
            except IndexError_ as exc:
                with self._lock:
                    self._building.pop(key, None)
                raise PlanError(str(exc)) from None
            if request.index_done:
                with self._lock:
                    self._building.pop(key, None)
                    had = self._indexes.get(request.index_id)
                    if had is None or not had.complete:
                        self._indexes[request.index_id] = building
        with self._lock:
            index = self._indexes.get(request.index_id)
            if index is not None:
                index.expires = max(index.expires, now + request.lease_seconds)
            return index

    def _check(self, request: Any) -> None:
        job_id = request.job
        if not job_id or len(job_id) > 256:
            raise PlanError("a plan needs a job id of 1-256 characters")
        lease = request.lease_seconds
        if not 0 < lease <= MAX_LEASE_SECONDS:
            raise PlanError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS:g}], got {lease!r}")
        if request.rate < 0 or not math.isfinite(request.rate) or request.position < 0:
            raise PlanError("rate and position must be >= 0")
        if len(request.runs) > MAX_RUNS_PER_REQUEST or len(request.index_samples) > MAX_RUNS_PER_REQUEST:
            raise PlanError(f"more than {MAX_RUNS_PER_REQUEST} runs in one request: send chunks")

    def _update(self, request: Any, derived: DerivedOrder | None) -> bool:
        job_id = request.job
        lease = request.lease_seconds
        runs = [self._run(run) for run in request.runs]
        now = self._clock()
        changed = self._expire(now)
        with self._lock:
            job = self._jobs.get(job_id)
            if request.replace:
                if job is not None:
                    self._drop(job)
                    changed = changed or job.complete
                rate = request.rate or DEFAULT_RATE
                job = _Job(job_id, now + lease, now, request.position, rate, rate, prefetch=not request.no_prefetch,
                           derived=derived)
                self._jobs[job_id] = job
                if derived is not None:
                    self._derived.append(job)
                    self._count_derived_pages()
                self.stats["registered"] += 1
            elif job is None:
                self.stats["unknown"] += 1
                known = False
            if job is not None:
                known = True
                job.expires = now + lease
                if request.replace:
                    job.position = request.position
                    job.moved()
                elif not job.live_readers(now):  # else the reads tell the position, exactly
                    if job.rewinds_to(request.position):
                        self._rewind(job, request.position)
                    elif request.position >= job.position:
                        job.position = request.position
                        job.moved()
                if request.rate > 0:
                    job.rate = request.rate
                if runs:
                    self._add_runs(job, runs)
                    for run in request.runs:
                        job.reads.extend((int(p), run.path) for p in run.positions)
                        job.read_bytes += int(run.length) * len(run.positions)
                if request.done and not job.complete:
                    job.reads.sort()
                    job.ahead_to = job.position
                    job.complete = True
                    changed = True
                if not request.replace and not runs:
                    self.stats["renewed"] += 1
        if changed:
            self._changed()
        return known

    def _run(self, run: Any) -> tuple[PageKey, list[int], list[int]]:
        try:
            path = parse_path(run.path)
        except ValueError as exc:
            raise PlanError(f"bad path in plan: {exc}") from None
        if run.offset < 0 or not 0 < run.length <= 1 << 40:
            raise PlanError(f"bad byte range {run.offset}+{run.length} for {run.path}")
        positions = list(run.positions)
        if not positions or min(positions) < 0:
            raise PlanError(f"a plan run for {run.path} needs positions >= 0")
        first = run.offset // self.page_size
        last = (run.offset + run.length - 1) // self.page_size
        if last - first >= MAX_PAGES_PER_RUN:
            raise PlanError(f"a plan run of {run.length} bytes for {run.path}: split it (at most "
                            f"{MAX_PAGES_PER_RUN} pages a run)")
        return (path.mount, path.key, first), [last - first + 1], positions

    def _add_runs(self, job: _Job, runs: list[tuple[PageKey, list[int], list[int]]]) -> None:  # lock held
        for (mount, key, first), (count,), positions in runs:
            for index in range(first, first + count):
                page = (mount, key, index)
                had = job.pages.get(page)
                if had is not None:  # the same page in several runs (neighbouring samples): merge
                    positions = positions + [p for s, e in zip(*had) for p in (s, e)]
                job.pages[page] = _merge(positions)
                if had is None:
                    self._by_page.setdefault(page, []).append(job)
                    job.object_pages[(mount, key)] = job.object_pages.get((mount, key), 0) + 1

    def _count_derived_pages(self) -> None:  # lock held
        """Distinct pages the derived plans read (per index: the union of its jobs' units)."""
        by_index: dict[str, list[DerivedOrder]] = {}
        for job in self._derived:
            by_index.setdefault(job.derived.index.id, []).append(job.derived)  # type: ignore[union-attr]
        total = 0
        for plans in by_index.values():
            if len(plans) == 1:
                total += plans[0].pages
            else:
                planned = np.logical_or.reduce([p.planned for p in plans])
                total += int(plans[0].index.pages[planned].sum())
        self._derived_pages = total

    def _drop(self, job: _Job) -> None:  # lock held
        self._jobs.pop(job.job, None)
        if job.derived is not None:
            self._derived = [j for j in self._derived if j is not job]
            self._count_derived_pages()
        for page in job.pages:
            jobs = self._by_page.get(page)
            if jobs is not None:
                jobs[:] = [j for j in jobs if j is not job]
                if not jobs:
                    del self._by_page[page]

    def _expire(self, now: float) -> bool:
        with self._lock:
            gone = [job for job in self._jobs.values() if job.expires <= now]
            for job in gone:
                self._drop(job)
            self.stats["expired"] += len(gone)
            used = {job.derived.index.id for job in self._derived}  # type: ignore[union-attr]
            for index_id in [i for i, x in self._indexes.items() if i not in used and x.expires <= now]:
                del self._indexes[index_id]
            for key in [k for k, x in self._building.items() if x.expires <= now]:
                del self._building[key]
        return any(job.complete for job in gone)

    def expire(self) -> int:
        """Drop plans whose lease ended (the worker calls this now and then); returns how many."""
        before = self.stats["expired"]
        if self._expire(self._clock()):
            self._changed()
        return self.stats["expired"] - before

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    # -- the page store's oracle ---------------------------------------------------------------------
    def moment(self) -> PlanMoment:
        """Where every job reads now: the page store asks a read's next use when it next decides
        what to evict (policy.NextUseOrder), as of the read."""
        now = self._clock()
        return PlanMoment(now, {job.job: (job, job.estimate(now), job.slack(), job.rate)
                                for job in list(self._jobs.values())})

    def next_use(self, pid: Any, used: bool, moment: PlanMoment | None = None) -> tuple[float, float]:
        """(when the page is used next, when to look again if it is not read by then); math.inf
        when no complete plan uses it again. ``used``: it is being read now (that use is over).
        ``moment``: answer as of then (a job registered since is asked as of now)."""
        jobs = self._by_page.get((pid.mount, pid.key, pid.index))
        derived = self._derived
        if not jobs and not derived:
            return math.inf, math.inf
        now = self._clock() if moment is None else moment.now
        best, recheck = math.inf, math.inf
        memo: dict = {}  # derived jobs of one data set share its index and epochs' orders
        for job in [*(jobs or ()), *derived]:
            if not job.complete or job.expires <= now:
                continue
            if job.derived is not None:
                at = job.derived.uses(pid.mount, pid.key, pid.index, memo)
                if not at:
                    continue
                starts = ends = at
            else:
                uses = job.pages.get((pid.mount, pid.key, pid.index))
                if uses is None:
                    continue
                starts, ends = uses
            seen = None if moment is None else moment.jobs.get(job.job)
            if seen is not None and seen[0] is job:
                here, slack, rate = seen[1], seen[2], seen[3]
            else:
                here, slack, rate = job.estimate(now), job.slack(), job.rate
            i = bisect.bisect_left(ends, here)  # the first use not over yet (reads before `here` are done)
            if used and i < len(starts) and starts[i] <= here + slack:
                i += 1  # this read is that use
            if i >= len(starts):
                continue
            when = job.clock(starts[i])
            if when < best:
                best = when
                recheck = now + max(0.0, ends[i] + slack - here) / rate + STALE_GRACE_SECONDS
        return best, recheck

    def next_uses(self, pids: list[Any], used: bool, moment: PlanMoment | None = None) -> list[tuple[float, float]]:
        """``next_use`` of many pages at once (every cached page after a plan changed: millions):
        the derived plans answer in one vectorised pass per job (DerivedOrder.uses_many); a page
        a plan sent sample by sample reads, or one that pass leaves open, is asked one by one."""
        n = len(pids)
        now = self._clock() if moment is None else moment.now
        derived = [job for job in self._derived if job.complete and job.expires > now]
        if not derived or n == 0:
            return [self.next_use(pid, used, moment) for pid in pids]
        by_page = self._by_page
        alone = np.fromiter(((pid.mount, pid.key, pid.index) in by_page for pid in pids), dtype=bool, count=n)
        paths = [f"{pid.mount}/{pid.key}" for pid in pids]
        indices = np.fromiter((pid.index for pid in pids), dtype=np.int64, count=n)
        best = np.full(n, math.inf)
        recheck = np.full(n, math.inf)
        for job in derived:  # in next_use's order: on a tie the first job's recheck stays
            at, answered = job.derived.uses_many(paths, indices)  # type: ignore[union-attr]
            alone |= ~answered
            seen = None if moment is None else moment.jobs.get(job.job)
            if seen is not None and seen[0] is job:
                here, slack, rate = seen[1], seen[2], seen[3]
            else:
                here, slack, rate = job.estimate(now), job.slack(), job.rate
            ahead = np.sort(np.where((at != NO_USE) & (at >= here), at, NO_USE), axis=1)  # uses not over yet
            first = ahead[:, 0]
            if used:  # this read is the first of them if it is due now
                second = ahead[:, 1] if ahead.shape[1] > 1 else np.full(n, NO_USE, dtype=np.int64)
                first = np.where((first != NO_USE) & (first <= here + slack), second, first)
            some = first != NO_USE
            pos = np.where(some, first, 0)
            when = np.where(some, job.start_time + (pos - job.start_pos) / job.clock_rate, math.inf)
            better = when < best
            best = np.where(better, when, best)
            recheck = np.where(better, now + np.maximum(0.0, pos + slack - here) / rate + STALE_GRACE_SECONDS,
                               recheck)
        out = list(zip(best.tolist(), recheck.tolist()))
        for i in np.flatnonzero(alone).tolist():
            out[i] = self.next_use(pids[i], used, moment)
        return out

    def progress(self, job_id: str, position: int, reader: int = 0) -> None:
        """Reader ``reader`` of the job reads at ``position`` now (it comes with reads: fresher than
        renewals). A reader new to the job, or one gone back, far behind where the job was, means
        the job reads its plan again from there (iterated again with no new plan)."""
        now = self._clock()
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            before = job.readers.get(reader) if reader else None
            if reader:
                job.readers[reader] = (position, now)
                if len(job.readers) > 64:  # new DataLoader workers every epoch: keep the live ones
                    job.readers = {r: v for r, v in job.readers.items() if now - v[1] <= READER_SECONDS}
            if job.rewinds_to(position) and (before is None or before[0] > position):
                self._rewind(job, position)
            elif position > job.position:
                job.position = position
            job.moved()

    def _rewind(self, job: _Job, position: int) -> None:  # lock held
        """The job reads its plan again from ``position``: what comes next is fetched ahead again,
        and readers still placed in the pass before are forgotten. Its clock stays: next uses are
        asked from where the readers are (``estimate``), so one job's pages keep their order, and
        no replan of every cached page is paid each pass (a set_epoch's new plan pays it)."""
        job.position = job.ahead_to = position
        job.readers = {r: v for r, v in job.readers.items() if v[0] <= position + job.slack()}
        job.moved()
        self.stats["rewound"] += 1

    def due(self, job_id: str, window_bytes: int, window_seconds: float,
            at_least: int = 32) -> list[tuple[str, int]]:
        """Objects the job reads next that were not handed to prefetch yet, each with the pages
        its plan reads of it (``pages_planned``): from its position up to ``window_seconds`` of
        reading at its rate (at least ``at_least`` positions), never more than ``window_bytes``
        ahead (what the cache can hold for it). Marks them handed out."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or not job.complete or job.last_position() < 0 or not job.prefetch:
                return []
            d = job.derived
            reads = len(job.reads) if d is None else d.reads
            per_position = max(1, (job.read_bytes if d is None else d.read_bytes) // max(1, reads))
            span = min(max(at_least, int(job.rate * window_seconds)), max(1, window_bytes // per_position))
            start, end = max(job.ahead_to, job.position), job.position + span
            if start >= end:
                return []
            job.ahead_to = end
            if d is not None:
                return d.planned_between(start, end)
            lo = bisect.bisect_left(job.reads, (start, ""))
            hi = bisect.bisect_left(job.reads, (end, ""))
            pages = job.object_pages
            return [(path, pages.get(_mount_key(path), 0)) for path in dict.fromkeys(p for _, p in job.reads[lo:hi])]

    def pages_planned(self, job_id: str, path: str) -> int:
        """Pages of the object at ``path`` ("mount/key") that the job's plan reads (0: none, or
        no such job)."""
        mount, key = _mount_key(path)
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and job.derived is not None:
                return job.derived.pages_of(mount, key)
            return 0 if job is None else job.object_pages.get((mount, key), 0)

    def describe(self) -> list[dict[str, Any]]:
        """The plans for status pages and `cachefs stat`."""
        now = self._clock()
        with self._lock:
            return [{"job": j.job, "pages": len(j.pages) if j.derived is None else j.derived.pages,
                     "position": j.position, "rate": round(j.rate, 1), "complete": j.complete,
                     "expires_in": round(j.expires - now, 1), "derived": j.derived is not None}
                    for j in self._jobs.values()]
