"""Cluster jobs and stat at unit level: JobManager, planning, progress, cancel, resume, CacheStat.

Workers are fakes here (a stub factory); tests/test_cluster_jobs.py runs the real processes.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest

from cachefs.errors import InvalidPathError, UnknownMountError
from cachefs.mounts import MountSpec
from cachefs.paths import parse_path
from cachefs.proto import master_pb2, worker_pb2
from cachefs.ring import RingConfig
from cachefs.server.master.catalog import Catalog
from cachefs.server.master.jobs import JobManager, JobSettings
from cachefs.server.master.loadplan import make_batches
from cachefs.server.master.loadrun import LoadSettings
from cachefs.server.master.membership import Member
from cachefs.server.master.placement import owners, ring_of
from cachefs.server.master.stat import CacheStat
from cachefs.server.master.state import MasterState
from helpers import wait_for

RING = RingConfig(vnodes=200, stripe_size=1 << 16)
ADDRESSES = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
MEMBERS = [Member(f"w{i}", a) for i, a in enumerate(ADDRESSES)]


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeWorker:
    """Records what it was sent; ``error`` fails every call; ``gate`` holds Load until set."""

    def __init__(self, address: str, sizes: dict[str, int]) -> None:
        self.address = address
        self.sizes = sizes
        self.loads: list[list[str]] = []
        self.cached: dict[str, int] = {}
        self.freed: list[str] = []
        self.error: grpc.StatusCode | None = None
        self.fail_paths: set[str] = set()
        self.gate: threading.Event | None = None
        self.returned = 0  # Load calls that have returned (or raised)
        self.lock = threading.Lock()

    def Load(self, request: worker_pb2.LoadRequest, timeout: float | None = None) -> worker_pb2.LoadResponse:
        assert timeout is not None and timeout > 0
        with self.lock:
            self.loads.append(list(request.paths))
        try:
            return self._load(request)
        finally:
            with self.lock:
                self.returned += 1

    def _load(self, request: worker_pb2.LoadRequest) -> worker_pb2.LoadResponse:
        if self.gate is not None:
            self.gate.wait(10)
        if self.error is not None:
            raise FakeRpcError(self.error, f"{self.address} says no")
        resp = worker_pb2.LoadResponse()
        with self.lock:
            for path in request.paths:
                if path in self.fail_paths:
                    resp.failed.append(f"{path}: store error: boom")
                    continue
                size = self.sizes[path]
                if self.cached.get(path) == size:
                    resp.bytes_skipped += size
                else:
                    resp.bytes_loaded += size
                self.cached[path] = size
                resp.objects_loaded += 1
        return resp

    def Free(self, request: worker_pb2.FreeRequest, timeout: float | None = None) -> worker_pb2.FreeResponse:
        if self.error is not None:
            raise FakeRpcError(self.error, "down")
        with self.lock:
            self.freed.append(request.prefix)
            gone = [p for p in self.cached if p == request.prefix or p.startswith(request.prefix + "/")]
            for p in gone:
                del self.cached[p]
        return worker_pb2.FreeResponse(pages_freed=len(gone))

    def GetCached(self, request: worker_pb2.GetCachedRequest, timeout: float | None = None):
        if self.error is not None:
            raise FakeRpcError(self.error, "down")
        with self.lock:
            return worker_pb2.GetCachedResponse(cached_bytes=[self.cached.get(p, 0) for p in request.paths])

    def loaded_paths(self) -> list[str]:
        with self.lock:
            return [p for batch in self.loads for p in batch]


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    for i in range(40):
        path = root / "d" / f"o{i:02d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (1000 + 37 * i))
    (root / "big.bin").write_bytes(b"x" * (5 * RING.stripe_size + 10))
    return root


class Harness:
    def __init__(self, tmp_path: Path, store_dir: Path, **settings) -> None:
        self.state = MasterState(tmp_path / "state")
        if not self.state.mounts()[1]:
            self.state.add_mount(MountSpec("data", str(store_dir)))
        self.catalog = Catalog(self.state, metadata_ttl=30, list_ttl=30)
        self.sizes = {str(m.path): m.size for m in self.catalog.list(parse_path("data"), recursive=True)}
        self.workers = {a: FakeWorker(a, self.sizes) for a in ADDRESSES}
        self.members = list(MEMBERS)
        load = settings.pop("load", LoadSettings(batch_objects=8, poll_seconds=0.02, base_timeout=5))
        self.jobs = JobManager(self.state, self.catalog, lambda: self.members, self.workers.__getitem__,
                               lambda: RING, JobSettings(load=load, persist_seconds=0.05, **settings))
        self.ring = ring_of(self.members, RING)

    def wait_done(self, job_id: str, timeout: float = 10.0) -> master_pb2.Job:
        assert wait_for(lambda: self.jobs.get(job_id).state not in (master_pb2.PENDING, master_pb2.RUNNING),
                        timeout=timeout)
        return self.jobs.get(job_id)

    def close(self) -> None:
        self.jobs.stop(timeout=5)
        self.state.close()


@pytest.fixture
def harness(tmp_path, store_dir):
    made: list[Harness] = []

    def make(**settings) -> Harness:
        h = Harness(tmp_path, store_dir, **settings)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_load_puts_each_object_on_its_placement_worker_in_bounded_batches(harness):
    h = harness()
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "cachefs://data/d").job_id)
    assert job.state == master_pb2.SUCCEEDED, job.error
    d = {p: s for p, s in h.sizes.items() if p.startswith("data/d/")}
    assert (job.objects_total, job.objects_done, job.objects_failed) == (40, 40, 0)
    assert job.bytes_total == job.bytes_done == sum(d.values()) and job.bytes_skipped == 0
    for address, worker in h.workers.items():
        assert sorted(worker.loaded_paths()) == sorted(p for p in d if h.ring.node(p) == address)
        assert all(0 < len(batch) <= 8 for batch in worker.loads)
    assert job.finished_at >= job.created_at > 0

    # Again: everything is cached now, so the workers report it all as skipped.
    again = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id)
    assert again.state == master_pb2.SUCCEEDED and again.bytes_skipped == again.bytes_done == job.bytes_total


def test_replicas_and_large_objects_go_to_every_owner(harness):
    h = harness()
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data", replicas=2).job_id)
    assert job.state == master_pb2.SUCCEEDED, job.error
    expected = defaultdict(list)
    for path, size in h.sizes.items():
        targets = owners(h.ring, path, size, 2)
        assert len(targets) >= 2
        for address in targets:
            expected[address].append(path)
    for address, worker in h.workers.items():
        assert sorted(worker.loaded_paths()) == sorted(expected[address])
    big = h.sizes["data/big.bin"]
    assert len(owners(h.ring, "data/big.bin", big, 1)) > 1  # its stripes really are spread
    assert job.bytes_total == sum(size * len(owners(h.ring, p, size, 2)) for p, size in h.sizes.items())


def test_batches_respect_bytes_and_count():
    batches = make_batches("w", [(f"p{i}", 100) for i in range(10)], max_objects=4, max_bytes=250)
    assert [len(b.paths) for b in batches] == [2, 2, 2, 2, 2] and all(b.nbytes <= 250 for b in batches)
    one = make_batches("w", [("huge", 10_000), ("small", 1)], max_objects=4, max_bytes=250)
    assert [b.paths for b in one] == [("huge",), ("small",)]


def test_a_dead_worker_s_objects_go_to_the_next_ring_worker(harness):
    h = harness()
    dead = ADDRESSES[0]
    h.workers[dead].error = grpc.StatusCode.UNAVAILABLE
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id)
    assert job.state == master_pb2.SUCCEEDED, job.error
    assert job.objects_done == 40
    for path in (p for p in h.sizes if p.startswith("data/d/")):
        home = h.ring.nodes(path, 3)
        want = home[1] if home[0] == dead else home[0]
        assert path in h.workers[want].cached


def test_a_second_failure_counts_objects_failed(harness):
    h = harness()
    for address in ADDRESSES[:2]:
        h.workers[address].error = grpc.StatusCode.UNAVAILABLE
    h.workers[ADDRESSES[2]].fail_paths = {"data/d/o05.bin"}
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id)
    assert job.state == master_pb2.FAILED
    d = [p for p in h.sizes if p.startswith("data/d/")]
    # Lost at most: objects whose first two ring workers are the failed two (the retry goes to
    # the next worker not known to have failed, so some of those may still reach the third),
    # and o05, which the third worker could not load.
    lost = {p for p in d if set(h.ring.nodes(p, 2)) == set(ADDRESSES[:2])} | {"data/d/o05.bin"}
    assert 1 <= job.objects_failed <= len(lost) and job.objects_done + job.objects_failed == 40
    third = h.workers[ADDRESSES[2]].cached
    assert all(p in third for p in d if h.ring.node(p) == ADDRESSES[2] and p != "data/d/o05.bin")
    assert "objects failed" in job.error and ("UNAVAILABLE" in job.error or "boom" in job.error)


def test_a_worker_that_answers_with_an_error_is_not_retried(harness):
    h = harness()
    h.workers[ADDRESSES[1]].error = grpc.StatusCode.UNIMPLEMENTED
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id)
    mine = [p for p in h.sizes if p.startswith("data/d/") and h.ring.node(p) == ADDRESSES[1]]
    assert job.state == master_pb2.FAILED and job.objects_failed == len(mine) > 0
    assert "UNIMPLEMENTED" in job.error
    assert all(not set(w.loaded_paths()) & set(mine) for a, w in h.workers.items() if a != ADDRESSES[1])


def test_cancel_stops_dispatching_and_ends_cancelled(harness):
    h = harness(load=LoadSettings(batch_objects=1, per_worker=1, poll_seconds=0.02, base_timeout=5))
    gate = threading.Event()
    for worker in h.workers.values():
        worker.gate = gate
    job_id = h.jobs.submit(master_pb2.LOAD, "data/d").job_id
    assert wait_for(lambda: sum(len(w.loads) for w in h.workers.values()) == 3)
    assert h.jobs.get(job_id).state == master_pb2.RUNNING
    t0 = time.monotonic()
    h.jobs.cancel(job_id)
    job = h.wait_done(job_id, timeout=5)
    assert time.monotonic() - t0 < 1.0  # does not wait for the calls in flight
    gate.set()
    # The job ended CANCELLED when its loop had returned, so nothing can be dispatched later;
    # the calls in flight returning (their slots free: per_worker=1) must not change that.
    assert wait_for(lambda: sum(w.returned for w in h.workers.values()) == 3)
    assert job.state == master_pb2.CANCELLED and job.objects_done < job.objects_total == 40
    assert sum(len(w.loads) for w in h.workers.values()) == 3  # nothing dispatched after the cancel
    assert h.jobs.cancel(job_id).state == master_pb2.CANCELLED  # cancelling again changes nothing


def test_pending_job_cancelled_before_it_runs(harness):
    h = harness(threads=1)
    gate = threading.Event()
    for worker in h.workers.values():
        worker.gate = gate
    first = h.jobs.submit(master_pb2.LOAD, "data/d").job_id
    second = h.jobs.submit(master_pb2.LOAD, "data/d").job_id
    assert h.jobs.get(second).state == master_pb2.PENDING
    assert h.jobs.cancel(second).state == master_pb2.CANCELLED
    gate.set()
    assert h.wait_done(first).state == master_pb2.SUCCEEDED
    assert h.jobs.get(second).state == master_pb2.CANCELLED
    assert [j.job_id for j in h.jobs.list(active_only=True)] == []
    assert [j.job_id for j in h.jobs.list()] == [second, first]  # newest first


def _job_stopped_mid_load(tmp_path: Path, store_dir: Path) -> tuple[str, dict[str, Any]]:
    """A load that a master stopped mid-job (its record stays RUNNING); (job id, stored record)."""
    h1 = Harness(tmp_path, store_dir)
    gate = threading.Event()
    for worker in h1.workers.values():
        worker.gate = gate
    job_id = h1.jobs.submit(master_pb2.LOAD, "data/d").job_id
    assert wait_for(lambda: any(w.loads for w in h1.workers.values()))
    h1.jobs.stop(timeout=0.5)
    gate.set()
    h1.state.close()
    stored = {r["job_id"]: r for r in MasterState(tmp_path / "state").jobs()}
    return job_id, stored[job_id]


def test_running_job_is_resumed_after_a_restart(tmp_path, store_dir):
    job_id, stored = _job_stopped_mid_load(tmp_path, store_dir)
    assert stored["state"] == "RUNNING"

    h2 = Harness(tmp_path, store_dir, settle_seconds=0.1, settle_max_seconds=2)
    try:
        assert h2.jobs.start() == [job_id]
        job = h2.wait_done(job_id)
        assert job.state == master_pb2.SUCCEEDED and job.objects_done == 40
        assert sum(len(w.loaded_paths()) for w in h2.workers.values()) == 40
    finally:
        h2.close()
    h3 = Harness(tmp_path, store_dir)
    try:
        assert h3.jobs.start() == []  # finished jobs are kept but not run again
        assert h3.jobs.get(job_id).state == master_pb2.SUCCEEDED
    finally:
        h3.close()


def test_a_resumed_job_waits_for_the_workers_it_planned_on(tmp_path, store_dir):
    """A worker that re-registers after the live set looked settled still gets its share."""
    job_id, stored = _job_stopped_mid_load(tmp_path, store_dir)
    assert stored["state"] == "RUNNING" and stored["planned_workers"] == len(ADDRESSES)

    # After the restart only two of the three have re-registered; the third comes back late.
    h2 = Harness(tmp_path, store_dir, settle_seconds=0.05, settle_max_seconds=30)
    h2.members = MEMBERS[:2]
    try:
        assert h2.jobs.start() == [job_id]
        late = h2.workers[ADDRESSES[2]]
        # Well past settle_seconds, the job has not planned without the missing worker.
        assert not wait_for(lambda: any(w.loads for w in h2.workers.values()), timeout=1.0)
        h2.members = list(MEMBERS)
        job = h2.wait_done(job_id)
        assert job.state == master_pb2.SUCCEEDED and job.objects_done == 40
        assert late.loaded_paths(), "the late worker got no share of the resumed load"
    finally:
        h2.close()


def test_a_resumed_job_gives_up_on_a_planned_worker_after_settle_max(tmp_path, store_dir):
    job_id, _ = _job_stopped_mid_load(tmp_path, store_dir)
    h2 = Harness(tmp_path, store_dir, settle_seconds=0.05, settle_max_seconds=0.5)
    h2.members = MEMBERS[:2]  # the third never returns
    try:
        assert h2.jobs.start() == [job_id]
        job = h2.wait_done(job_id, timeout=20)
        assert job.state == master_pb2.SUCCEEDED and job.objects_done == 40
        assert not h2.workers[ADDRESSES[2]].loaded_paths()
    finally:
        h2.close()


def test_progress_is_persisted_while_running(harness):
    h = harness(load=LoadSettings(batch_objects=1, per_worker=1, max_inflight=1, poll_seconds=0.01))
    sem = threading.Semaphore(0)

    class Slow(FakeWorker):
        def Load(self, request, timeout=None):
            sem.acquire(timeout=5)
            return super().Load(request, timeout)

    for a in ADDRESSES:
        h.workers[a] = Slow(a, h.sizes)
    job_id = h.jobs.submit(master_pb2.LOAD, "data/d").job_id
    for _ in range(10):
        sem.release()
    assert wait_for(lambda: {r["job_id"]: r for r in h.state.jobs()}[job_id]["objects_done"] >= 5, timeout=5)
    for _ in range(40):
        sem.release()
    assert h.wait_done(job_id).state == master_pb2.SUCCEEDED
    assert {r["job_id"]: r for r in h.state.jobs()}[job_id]["objects_done"] == 40


def test_free_asks_every_live_worker(harness):
    h = harness()
    assert h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id).state == master_pb2.SUCCEEDED
    job = h.wait_done(h.jobs.submit(master_pb2.FREE, "data/d").job_id)
    assert job.state == master_pb2.SUCCEEDED, job.error
    assert all(w.freed == ["data/d"] and not w.cached for w in h.workers.values())
    h.workers[ADDRESSES[2]].error = grpc.StatusCode.UNAVAILABLE
    failed = h.wait_done(h.jobs.submit(master_pb2.FREE, "data").job_id)
    assert failed.state == master_pb2.FAILED and ADDRESSES[2] in failed.error


def test_no_live_workers_fails_the_job(harness):
    h = harness()
    h.members = []
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id)
    assert job.state == master_pb2.FAILED and "no live workers" in job.error


def test_missing_prefix_fails_the_job_with_the_path(harness):
    h = harness()
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/nope").job_id)
    assert job.state == master_pb2.FAILED and "data/nope" in job.error


@pytest.mark.parametrize("kind, path, replicas, error", [
    (master_pb2.LOAD, "data/d", 17, InvalidPathError),
    (master_pb2.LOAD, "data/d", -1, InvalidPathError),
    (master_pb2.LOAD, "data/../x", 1, InvalidPathError),
    (master_pb2.LOAD, "other/d", 1, UnknownMountError),
    (master_pb2.JOB_KIND_UNSPECIFIED, "data/d", 1, InvalidPathError),
])
def test_submit_validates(harness, kind, path, replicas, error):
    with pytest.raises(error):
        harness().jobs.submit(kind, path, replicas)


def test_stat_counts_what_placement_workers_hold_and_survives_a_dead_worker(harness):
    h = harness()
    assert h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d/o01.bin").job_id).state == master_pb2.SUCCEEDED
    stat = CacheStat(h.catalog, h.workers.__getitem__, batch=7)
    one = stat.stat(parse_path("data/d/o01.bin"), h.members, RING)
    assert one.objects == 1 and one.cached_bytes == one.total_bytes == h.sizes["data/d/o01.bin"]
    assert one.shares == {h.ring.node("data/d/o01.bin"): one.total_bytes}
    assert h.wait_done(h.jobs.submit(master_pb2.LOAD, "data").job_id).state == master_pb2.SUCCEEDED
    whole = stat.stat(parse_path("data"), h.members, RING)
    assert whole.objects == 41 and whole.cached_bytes == whole.total_bytes == sum(h.sizes.values())
    assert sum(whole.shares.values()) >= whole.cached_bytes  # big.bin is whole on each stripe owner
    h.workers[ADDRESSES[0]].error = grpc.StatusCode.UNAVAILABLE
    partial = stat.stat(parse_path("data/d"), h.members, RING)
    assert partial.unreachable == (ADDRESSES[0],)
    assert partial.cached_bytes == sum(s for p, s in h.sizes.items()
                                       if p.startswith("data/d/") and h.ring.node(p) != ADDRESSES[0])
    capped = CacheStat(h.catalog, h.workers.__getitem__, max_objects=10).stat(parse_path("data"), h.members, RING)
    assert capped.truncated and capped.objects == 10


def test_catalog_follows_the_mount_table(tmp_path, store_dir):
    state = MasterState(tmp_path / "state")
    try:
        catalog = Catalog(state, metadata_ttl=30, list_ttl=30)
        with pytest.raises(UnknownMountError):
            catalog.check_mount(parse_path("data/x"))
        state.add_mount(MountSpec("data", str(store_dir)))
        assert len(catalog.list(parse_path("data/d"))) == 40
        other = tmp_path / "other"
        other.mkdir()
        (other / "only.txt").write_bytes(b"1")
        state.add_mount(MountSpec("data", str(other)), replace=True)
        assert [str(m.path) for m in catalog.list(parse_path("data"))] == ["data/only.txt"]
        state.remove_mount("data")
        with pytest.raises(UnknownMountError):
            catalog.info(parse_path("data/only.txt"))
    finally:
        state.close()


def test_progress_line_shows_bytes_objects_rate_and_eta():
    import io

    from cachefs.progress import JobProgress

    now = [100.0]
    job = master_pb2.Job(job_id="j1", kind=master_pb2.LOAD, objects_total=40, bytes_total=40 << 20)
    plain = io.StringIO()
    show = JobProgress(plain, tty=False, interval=2.0, clock=lambda: now[0])
    show.update(job)
    now[0] += 4
    job.objects_done, job.objects_failed, job.bytes_done = 18, 2, 20 << 20
    show.update(job)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("job j1:   0.0%")
    assert lines[1] == "job j1:  50.0%, 20.0 MiB / 40.0 MiB, 20/40 objects (2 failed), 5.0 MiB/s, ETA 0:04"
    now[0] += 0.5
    show.update(job)  # within the interval: nothing written
    assert len(plain.getvalue().splitlines()) == 2
    tty = io.StringIO()
    bar = JobProgress(tty, tty=True, clock=lambda: now[0])
    bar.update(job)
    bar.close()
    assert tty.getvalue().startswith("\r\x1b[K[############............]  50.0%") and tty.getvalue().endswith("\n")


# -- #47: loads that stream (a page of the listing at a time, a cursor, resume after it) --

PAGED = LoadSettings(batch_objects=4, poll_seconds=0.02, base_timeout=5, page_objects=8, pages_ahead=2)


def _record_listings(h: Harness) -> list[str]:
    """The ``after`` of every listing page the harness's catalog is asked for (its store requests)."""
    asked: list[str] = []
    real = h.catalog.list_page

    def list_page(path, after, limit):
        asked.append(after)
        return real(path, after, limit)

    h.catalog.list_page = list_page
    return asked


def test_a_load_streams_its_listing_a_page_at_a_time(harness):
    h = harness(load=PAGED)
    listed_at_load: list[int] = []
    asked = _record_listings(h)
    real_load = FakeWorker.Load

    def load(worker, request, timeout=None):
        listed_at_load.append(len(asked))  # pages listed when this batch went out
        return real_load(worker, request, timeout)

    for w in h.workers.values():
        w.Load = load.__get__(w)
    job = h.wait_done(h.jobs.submit(master_pb2.LOAD, "data/d").job_id)
    assert job.state == master_pb2.SUCCEEDED, job.error
    assert (job.objects_total, job.objects_done, job.listing) == (40, 40, False)
    d = sorted(p for p in h.sizes if p.startswith("data/d/"))
    assert sorted(p for w in h.workers.values() for p in w.loaded_paths()) == d  # each once
    # Five pages of 8 (and the last one says it is the last), each asked after the one before.
    assert asked == ["", d[7], d[15], d[23], d[31]]
    # A page is asked for only while fewer than pages_ahead (2) have objects not done: when the
    # first batch went out, 2 pages of the 5 had been listed.
    assert listed_at_load[0] == 2
    record = {r["job_id"]: r for r in h.state.jobs()}[job.job_id]
    assert record["cursor"] == "" and record["committed"] == {}  # finished: nothing to resume from
    assert "planned_on" not in record and len(json_size(record)) < 600


def json_size(record: dict[str, Any]) -> str:
    import json

    return json.dumps(record)


def test_a_resumed_load_lists_and_loads_only_after_its_cursor(tmp_path, store_dir):
    """A master stopped mid-load (its record RUNNING with a cursor); the next one goes on after it."""
    h1 = Harness(tmp_path, store_dir, load=PAGED)
    sem = threading.Semaphore(0)
    real_load = FakeWorker.Load

    def load(worker, request, timeout=None):
        sem.acquire(timeout=10)
        return real_load(worker, request, timeout)

    for w in h1.workers.values():
        w.Load = load.__get__(w)
    job_id = h1.jobs.submit(master_pb2.LOAD, "data/d").job_id
    for _ in range(8):
        sem.release()

    def stored() -> dict[str, Any]:
        return {r["job_id"]: r for r in h1.state.jobs()}[job_id]

    assert wait_for(lambda: stored()["cursor"] != "", timeout=10)
    h1.jobs.stop(timeout=0.5)
    for _ in range(100):
        sem.release()
    before = stored()
    h1.state.close()
    cursor, committed = before["cursor"], before["committed"]
    assert before["state"] == "RUNNING" and committed["objects_done"] >= 8
    done_before = sorted(p for w in h1.workers.values() for p in w.loaded_paths() if p <= cursor)
    assert len(done_before) == committed["objects_done"]

    h2 = Harness(tmp_path, store_dir, load=PAGED, settle_seconds=0.05, settle_max_seconds=2)
    asked = _record_listings(h2)
    try:
        assert h2.jobs.start() == [job_id]
        resumed = h2.jobs.get(job_id)
        assert resumed.objects_done == committed["objects_done"]  # from the committed figures
        job = h2.wait_done(job_id)
        assert job.state == master_pb2.SUCCEEDED, job.error
        assert (job.objects_done, job.objects_total) == (40, 40)  # nothing counted twice
        assert asked and asked[0] == cursor and all(a >= cursor for a in asked)
        again = [p for w in h2.workers.values() for p in w.loaded_paths()]
        assert again and all(p > cursor for p in again)  # what was done is not asked again
        d = sorted(p for p in h2.sizes if p.startswith("data/d/"))
        assert sorted(again) == [p for p in d if p > cursor]
    finally:
        h2.close()


def test_progress_line_while_listing_has_no_fraction_or_eta():
    import io

    from cachefs.progress import JobProgress

    now = [100.0]
    job = master_pb2.Job(job_id="j1", kind=master_pb2.LOAD, objects_total=4000, bytes_total=40 << 20, listing=True)
    plain = io.StringIO()
    show = JobProgress(plain, tty=False, interval=2.0, clock=lambda: now[0])
    show.update(job)
    now[0] += 4
    job.objects_done, job.bytes_done = 2000, 20 << 20
    show.update(job)
    assert plain.getvalue().splitlines()[1] == (
        "job j1: listing, 20.0 MiB / 40.0 MiB+, 2000/4000+ objects, 5.0 MiB/s, ETA -")
    job.listing, job.objects_total, job.bytes_total = False, 5000, 50 << 20
    now[0] += 4
    show.update(job)
    assert plain.getvalue().splitlines()[2].startswith("job j1:  40.0%, 20.0 MiB / 50.0 MiB, 2000/5000 objects")
