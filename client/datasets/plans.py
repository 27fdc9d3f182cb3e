"""Telling the workers a dataset's read order, so their caches evict by next use, not recency.

A dataset knows the order it reads its samples in, this epoch and the next (client/datasets/sampling.py).
When the data set is larger than the cache, LRU evicts exactly the pages the next epoch needs
first; a worker told the order evicts the page used furthest ahead instead (server/worker/plans.py,
server/pagestore/policy.py). ``PlanPublisher`` sends each worker the part of the order that falls
on its stripes (``Plan`` RPC, in chunks), then renews it once a second with the job's position
(samples read so far, summed over DataLoader workers) and rate, under a lease: a job that dies
pins nothing once the lease ends, and a worker that restarted and forgot the plan is sent it again.

A plan that a worker can derive itself (``publish_derived``: the map dataset's epoch order,
cachefs/order.py) is not sent sample by sample: each worker is sent the data set's index once (the
units it holds, by sample id, in chunks: ``CHUNK_UNITS``), and per epoch only what defines the
order (seed, epoch, rank, world size, ...) with a digest of it. A worker that cannot reproduce the
digest (another release's order), or does not know derived plans, is sent the order as before.

It runs in the dataset's main process only (DataLoader workers never carry it: a forked process
must keep gRPC off its path, forksafe.py), on its own filesystem session, and its calls pass the
session's fork gate like every other call.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import hashlib
from array import array

import numpy as np

from cachefs.client import forksafe
from cachefs.client.datasets.sampleindex import trim_heap
from cachefs.paths import parse_path, strip_protocol
from cachefs.proto import worker_pb2
from cachefs.client.timeouts import DEFAULT_LEASE_SECONDS, DEFAULT_RENEW_SECONDS, CALL_TIMEOUT

log = logging.getLogger(__name__)

__all__ = ["PlanPublisher", "PlanReport"]

#: A plan request's encoded runs at most: it goes over the worker's socket, whose request is one
#: 64 KiB message (cachefs/localhost.py MAX_MESSAGE, the data port's MAX_REQUEST) with its header.
CHUNK_BYTES = 48 << 10
#: Units per index chunk, and path bytes at most: with each unit's numbers (at most ~21 bytes
#: encoded) a chunk stays under that message too.
CHUNK_UNITS = 1_000
CHUNK_PATH_BYTES = 32 << 10


@dataclass
class PlanReport:
    """What the workers said about the plan: how much cache this job may count on."""

    workers: int = 0
    capacity_bytes: int = 0  # summed over the workers that took the plan
    share_bytes: int = 0  # summed capacity / jobs sharing each worker
    policy: set[str] = field(default_factory=set)
    resent: int = 0  # plans sent again to a worker that had forgotten it (restart)
    failed: int = 0  # requests that failed (the plan is advisory: reads go on)
    prefetches: bool = True  # every worker that took the plan fetches its next reads itself
    derived: int = 0  # workers that derived the order themselves (no per-sample plan sent)
    fallbacks: int = 0  # workers sent the order sample by sample (they could not derive it)

    @property
    def complete(self) -> bool:
        """Every worker holding part of the order took the plan and prefetches by it."""
        return self.workers > 0 and self.failed == 0 and self.prefetches


class PlanPublisher:
    """Registers and renews one dataset's read order (one rank) with the workers that hold it."""

    def __init__(self, session: Any, position: Callable[[], int], *, job: str | None = None,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, renew_seconds: float = DEFAULT_RENEW_SECONDS,
                 prefetch: bool = True) -> None:
        """``session``: a ClientSession of this process; ``position()``: samples this job has
        read so far (any monotonic count: the plan's position 0 is its value when published);
        ``prefetch``: the workers may fetch what the plan reads next ahead of the reads."""
        if not 0 < renew_seconds < lease_seconds:
            raise ValueError("renew_seconds must be > 0 and less than lease_seconds")
        self.session, self._position, self.prefetch = session, position, prefetch
        self.job = job or f"{os.uname().nodename}:{forksafe.pid()}:{uuid.uuid4().hex[:12]}"
        self.lease_seconds, self.renew_seconds = float(lease_seconds), float(renew_seconds)
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[Any, list[Any]]] = {}  # address -> (handle, runs)
        # Derived plans: the index (once), this plan's order, and how to make the explicit order.
        self._index: _Index | None = None
        self._order: worker_pb2.PlanOrder | None = None
        self._units: Callable[[], Sequence[tuple[str, int, int]]] | None = None
        self._explicit: Callable[[], np.ndarray] | None = None
        self._fallback_runs: dict[str, tuple[Any, list[Any]]] | None = None
        self._base = 0
        self._replay_after = 0
        self._rate = 0.0
        self._last: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner = forksafe.pid()
        self.report = PlanReport()

    # -- the plan ------------------------------------------------------------------------------------
    def publish(self, units: Sequence[tuple[str, int, int]], order: np.ndarray, *,
                replay_after: int = 0) -> PlanReport:
        """Register ``order`` (unit indices in the order they will be read; a unit is a byte range
        ``(path, offset, length)`` of one object) with every worker holding part of it.

        ``replay_after``: read past this many positions with no new plan, the job is reading its
        first ``replay_after`` again (a dataset iterated again without ``set_epoch``): positions
        then count from the start again, and the workers start their read-ahead over (plans.py)."""
        if replay_after < 0:
            raise ValueError("replay_after must be >= 0")
        runs = self._runs_by_worker(units, order)
        with self._lock:
            self._runs = runs
            self._order = None
            self._base = self._position()
            self._replay_after = int(replay_after)
            self._last = None
        report = PlanReport()
        for handle, worker_runs in runs.values():
            self._send(handle, worker_runs, report)
        self.report = report
        self._start()
        return report

    def publish_derived(self, units: Callable[[], Sequence[tuple[str, int, int]]], order: dict[str, Any],
                        explicit: Callable[[], np.ndarray], *, replay_after: int = 0) -> PlanReport:
        """Register a plan the workers derive themselves: ``order`` holds a ``PlanOrder``'s fields
        (kind, n_samples, seed, epoch, rank, world_size, shuffle, drop_last, offset, start,
        digest). ``units()`` (called once per publisher: the index) and ``explicit()`` (the plan's
        sample ids, only for a worker that cannot derive it) are what ``publish`` takes. O(workers)
        calls, no per-sample work once the index was sent."""
        if replay_after < 0:
            raise ValueError("replay_after must be >= 0")
        if self._index is None:
            self._units = units
            self._index = self._build_index(units())
        with self._lock:
            self._runs = {}
            self._order = worker_pb2.PlanOrder(**order)
            self._explicit, self._fallback_runs = explicit, None
            self._base = self._position()
            self._replay_after = int(replay_after)
            self._last = None
        report = PlanReport()
        for handle, part in self._index.parts.values():
            self._send_derived(handle, part, report)
            part.release()  # sent: a worker that forgets it (a restart) is sent it made again
        if self._index.size >= 100_000:
            trim_heap()  # each unit's key, placement and request came and went: their memory too
        self.report = report
        self._start()
        return report

    def _build_index(self, units: Sequence[tuple[str, int, int]], only: str = "") -> "_Index":
        """The data set's units grouped by the worker holding each one's first page, and the
        whole index's digest (its id on the workers): once per dataset (``only``: that worker's
        part alone, made again for a worker that forgot it)."""
        h = hashlib.blake2b(b"cachefs-index:1:", digest_size=16)
        groups: dict[str, tuple[Any, _Part]] = {}
        for sample, (raw, offset, length) in enumerate(units):
            key = str(parse_path(strip_protocol(raw)))
            h.update(f"{key}\0{offset}\0{length}\n".encode())
            if length <= 0:
                continue
            # Placement, not health: a breaker open for a moment must not leave its units unplanned.
            handle = self.session.placed(key, offset)
            if handle is None:
                continue
            if only and handle.address != only:
                continue
            part = groups.setdefault(handle.address, (handle, _Part()))[1]
            part.add(sample, key, offset, length)
        for _, part in groups.values():
            part.freeze()
        return _Index(h.hexdigest(), len(units), groups)

    def _send_derived(self, handle: Any, part: "_Part", report: PlanReport) -> None:
        """The plan's definition to one worker; its index first where it lacks it; the plan
        sample by sample where it cannot derive the order."""
        assert self._index is not None and self._order is not None
        position, rate = self._progress()
        request = worker_pb2.PlanRequest(
            job=self.job, replace=True, done=True, position=position, rate=rate, lease_seconds=self.lease_seconds,
            no_prefetch=not self.prefetch, index_id=self._index.id, order=self._order)
        try:
            reply = self.session.plan(handle, request, CALL_TIMEOUT)
            if not reply.derived and not reply.index_known:
                if part.released:  # the index's part for this worker, made again from the units
                    assert self._units is not None
                    part = self._build_index(self._units(), only=handle.address).parts.get(
                        handle.address, (handle, _Part().frozen()))[1]
                for chunk in part.chunks(self._index, self.job, self.lease_seconds):
                    self.session.plan(handle, chunk, CALL_TIMEOUT)
                reply = self.session.plan(handle, request, CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - advisory: the cache falls back to LRU order for it
            report.failed += 1
            log.debug("derived plan for %s not taken by %s: %s", self.job, handle.address, exc)
            return
        if reply.derived:
            report.derived += 1
            self._account(reply, report)
            return
        # Another release's order, or a worker that knows no derived plans: the order itself.
        report.fallbacks += 1
        log.info("worker %s could not derive the read plan of %s: sending it sample by sample",
                 handle.address, self.job)
        runs = self._explicit_runs().get(handle.address)
        self._send(handle, [] if runs is None else runs[1], report)

    def _explicit_runs(self) -> dict[str, tuple[Any, list[Any]]]:
        with self._lock:
            runs, units, explicit = self._fallback_runs, self._units, self._explicit
        if runs is None:
            assert units is not None and explicit is not None
            runs = self._runs_by_worker(units(), explicit())
            with self._lock:
                self._fallback_runs = runs
        return runs

    def _runs_by_worker(self, units: Sequence[tuple[str, int, int]], order: np.ndarray) -> dict[str, tuple[Any, list[Any]]]:
        positions: dict[int, list[int]] = {}
        for position, unit in enumerate(np.asarray(order, dtype=np.int64).tolist()):
            positions.setdefault(unit, []).append(position)
        out: dict[str, tuple[Any, list[Any]]] = {}
        for unit, where in positions.items():
            raw, offset, length = units[unit]
            if length <= 0:
                continue
            key = str(parse_path(strip_protocol(raw)))
            handle = self.session.placed(key, offset)
            if handle is None:
                continue
            run = worker_pb2.PlanRun(path=key, offset=offset, length=length, positions=where)
            out.setdefault(handle.address, (handle, []))[1].append(run)
        return out

    def _send(self, handle: Any, runs: list[Any], report: PlanReport) -> None:
        """The whole plan to one worker: replace, chunks, done."""
        position, rate = self._progress()
        try:
            reply = None
            chunks = _byte_chunks(runs, CHUNK_BYTES)
            for i, chunk in enumerate(chunks):
                reply = self.session.plan(handle, worker_pb2.PlanRequest(
                    job=self.job, replace=i == 0, runs=chunk, done=i == len(chunks) - 1, position=position,
                    rate=rate, lease_seconds=self.lease_seconds, no_prefetch=not self.prefetch), CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - advisory: the cache falls back to LRU order for it
            report.failed += 1
            log.debug("plan for %s not taken by %s: %s", self.job, handle.address, exc)
            return
        self._account(reply, report)

    def _account(self, reply: Any, report: PlanReport) -> None:
        report.workers += 1
        report.capacity_bytes += reply.capacity_bytes
        report.share_bytes += reply.capacity_bytes // max(1, reply.jobs)
        report.policy.add(reply.policy)
        report.prefetches = report.prefetches and reply.prefetches and self.prefetch

    # -- renewal -------------------------------------------------------------------------------------
    def _progress(self) -> tuple[int, float]:
        """(position in the plan, samples per second). The count may also fall (new DataLoader
        workers every epoch start their counts over): the rate only takes a rise."""
        now, read = time.monotonic(), self._position()
        position = max(0, read - self._base)
        if self._last is not None:
            t, p = self._last
            if now - t >= 0.2:
                measured = (position - p) / (now - t)
                if measured >= 0:
                    self._rate = measured if self._rate == 0 else 0.5 * self._rate + 0.5 * measured
                self._last = (now, position)
        else:
            self._last = (now, position)
        if self._replay_after and position > self._replay_after:  # read again from the start
            position = (position - 1) % self._replay_after + 1
        return position, max(0.0, self._rate)

    def renew(self) -> PlanReport:
        """Tell every worker the job's position and extend the lease (re-send where forgotten)."""
        with self._lock:
            derived = self._order is not None and self._index is not None
            runs: dict[str, tuple[Any, Any]] = dict(self._index.parts if derived else self._runs)  # type: ignore[union-attr]
            position, rate = self._progress()
        report = PlanReport(resent=self.report.resent)
        for handle, worker_runs in runs.values():
            try:
                reply = self.session.plan(handle, worker_pb2.PlanRequest(
                    job=self.job, position=position, rate=rate, lease_seconds=self.lease_seconds), CALL_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - a worker away: tried again next round
                report.failed += 1
                log.debug("renewing plan %s on %s failed: %s", self.job, handle.address, exc)
                continue
            if reply.known:
                self._account(reply, report)
            else:  # the worker restarted: it has no plan of ours
                report.resent += 1
                if derived:
                    self._send_derived(handle, worker_runs, report)
                else:
                    self._send(handle, worker_runs, report)
        self.report = report
        return report

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="cachefs-plan-renew", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        """Renew when the job moved on, or a third of the lease went by; back off while workers
        fail. An idle dataset costs a call per worker every lease/3 seconds, and every call is one
        more a fork of this process (DataLoader workers starting) must wait for."""
        pause, sent_at, sent_position = self.renew_seconds, time.monotonic(), -1
        while not self._stop.wait(pause):
            if forksafe.pid() != self._owner:
                return
            try:
                position = self._position() - self._base
                if position == sent_position and time.monotonic() - sent_at < self.lease_seconds / 3:
                    continue
                report = self.renew()
                sent_at, sent_position = time.monotonic(), position
                pause = self.renew_seconds if not report.failed else min(self.lease_seconds / 3, pause * 2)
            except Exception:  # noqa: BLE001 - never let the renewer die
                log.exception("renewing the read plan failed")

    def close(self) -> None:
        """Stop renewing: the workers drop the plan when its lease ends."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=CALL_TIMEOUT)


class _Part:
    """The units of an index whose first page one worker holds (sample id, path, range): grown
    in arrays and one bytearray while the index is built (no object per unit), then numpy arrays
    and one bytes object until sent, then released. Kept, they were ~65 bytes a sample in the
    dataset's main process for as long as it lived, to re-send a worker that restarted; that
    rare case now places the units again (``_build_index(only=...)``, seconds at 1 M)."""

    def __init__(self) -> None:
        self.released = False
        self._samples, self._offsets, self._lengths, self._ends = array("q"), array("q"), array("q"), array("q")
        self._paths = bytearray()

    def add(self, sample: int, key: str, offset: int, length: int) -> None:
        self._samples.append(sample)
        self._offsets.append(int(offset))
        self._lengths.append(int(length))
        self._paths += key.encode()
        self._ends.append(len(self._paths))

    def freeze(self) -> None:
        def arr(a: array) -> np.ndarray:
            return np.array(a, dtype=np.int64) if len(a) else np.zeros(0, dtype=np.int64)
        self.samples, self.offsets, self.lengths = arr(self._samples), arr(self._offsets), arr(self._lengths)
        self.path_starts = np.zeros(len(self.samples) + 1, dtype=np.int64)
        self.path_starts[1:] = arr(self._ends)
        self.path_lengths = np.diff(self.path_starts)
        self.paths = bytes(self._paths)
        self._samples, self._offsets, self._lengths, self._ends = array("q"), array("q"), array("q"), array("q")
        self._paths = bytearray()

    def frozen(self) -> "_Part":
        self.freeze()
        return self

    def release(self) -> None:
        for name in ("samples", "offsets", "lengths", "path_starts", "path_lengths", "paths"):
            self.__dict__.pop(name, None)
        self.released = True

    def chunks(self, index: "_Index", job: str, lease_seconds: float) -> Iterator[Any]:
        """Plan requests carrying this part of ``index``, in chunks (the last marked done)."""
        start, n = 0, len(self.samples)
        while True:
            # at most CHUNK_UNITS units and CHUNK_PATH_BYTES of paths (at least one unit)
            limit = self.path_starts[start] + CHUNK_PATH_BYTES
            end = min(n, start + CHUNK_UNITS, max(start + 1, int(np.searchsorted(self.path_starts, limit, "right")) - 1))
            yield worker_pb2.PlanRequest(
                job=job, lease_seconds=lease_seconds, index_id=index.id, index_size=index.size,
                index_samples=self.samples[start:end].tolist(),
                index_paths=self.paths[self.path_starts[start]:self.path_starts[end]],
                index_path_lengths=self.path_lengths[start:end].tolist(),
                index_offsets=self.offsets[start:end].tolist(), index_lengths=self.lengths[start:end].tolist(),
                index_done=end >= n)
            start = end
            if start >= n:
                return


def _byte_chunks(runs: list[Any], limit: int) -> list[list[Any]]:
    """``runs`` cut into lists of at most ``limit`` encoded bytes each (one run at least; one
    empty list when there are none: a plan of nothing still replaces the job's runs)."""
    chunks: list[list[Any]] = [[]]
    size = 0
    for run in runs:
        cost = run.ByteSize() + 4  # the field's tag and length
        if chunks[-1] and size + cost > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(run)
        size += cost
    return chunks


@dataclass
class _Index:
    id: str
    size: int
    parts: dict[str, tuple[Any, _Part]]
