"""Eviction by next use (#16): the policy against a brute-force Belady, the plan table, bypass.

Unit level: a real PageStore on a temp dir with a real PlanTable as its oracle, driven by a fake
clock; the Plan RPC and the datasets' registration are exercised end to end in
tests/test_eviction_plans.py.
"""

from __future__ import annotations

import math
import os
import random

import pytest

from cachefs.pagefile import TRAILER_SIZE
from cachefs.proto import worker_pb2
from cachefs.server.pagestore import CacheDir, PageId, PageStore
from cachefs.server.pagestore.passing import PassingPages
from cachefs.server.pagestore.policy import LruOrder, NextUseOrder
from cachefs.server.worker.plans import PlanError, PlanTable

PS = 4096


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def brute_force_belady(trace: list[int], capacity: int) -> int:
    """Optimal misses with bypass, by scanning the cache on every miss (no clever structure)."""
    cached: set[int] = set()
    misses = 0
    for i, page in enumerate(trace):
        if page in cached:
            continue
        misses += 1

        def next_use(p: int) -> float:
            for j in range(i + 1, len(trace)):
                if trace[j] == p:
                    return j
            return math.inf

        if len(cached) < capacity:
            cached.add(page)
            continue
        victim = max(cached, key=next_use)
        if next_use(page) >= next_use(victim):
            continue  # served, not admitted
        cached.remove(victim)
        cached.add(page)
    return misses


def _register(table: PlanTable, job: str, order: list[int], rate: float = 100.0, position: int = 0) -> None:
    where: dict[int, list[int]] = {}
    for p, page in enumerate(order):
        where.setdefault(page, []).append(p)
    runs = [worker_pb2.PlanRun(path=f"m/k{page}", offset=0, length=PS, positions=ps) for page, ps in where.items()]
    assert table.update(worker_pb2.PlanRequest(job=job, replace=True, runs=runs, done=True, position=position,
                                               rate=rate, lease_seconds=60))


def _replay(store: PageStore, table: PlanTable, clock: FakeClock, trace: list[int], job: str = "j") -> int:
    """Read ``trace`` as a job would: report the position, then read (miss: fetch, put, read)."""
    misses = 0
    for i, page in enumerate(trace):
        clock.t += 0.01
        table.update(worker_pb2.PlanRequest(job=job, position=i, rate=100.0, lease_seconds=60))
        pid = PageId("m", f"k{page}", "v1", 0)
        if not store.contains(pid):
            misses += 1
            store.put(pid, b"x" * PS)
        store.get(pid)  # the read itself
    return misses


@pytest.mark.parametrize("lazy", [False, True, "batched"],
                         ids=["placed-per-read", "placed-when-deciding", "placed-in-runs"])
@pytest.mark.parametrize("rest", [False, True], ids=["never-resting", "resting-while-roomy"])
@pytest.mark.parametrize("seed", range(6))
def test_next_use_eviction_matches_brute_force_belady(tmp_path, seed, lazy, rest, monkeypatch):
    """Reads placed as they happen, or (the worker's way) when the order next decides, as of
    the read's moment, one by one or a run of reads of one moment per call (``next_uses``, as
    replans are): the same misses as the optimum either way; also when the order rests while
    the dir has room (no floor in bytes here) and replans as it wakes."""
    if rest:
        import cachefs.server.pagestore.policy as policy

        monkeypatch.setattr(policy, "REST_ROOM_MIN_BYTES", 0)
        monkeypatch.setattr(policy, "WAKE_ROOM_MIN_BYTES", 0)
    rng = random.Random(seed)
    pages = rng.randint(8, 40)
    capacity = rng.randint(2, max(3, pages - 2))
    # A mix of what training does: shuffled epochs, plus random re-reads.
    trace = [p for _ in range(3) for p in rng.sample(range(pages), pages)]
    trace += [rng.randrange(pages) for _ in range(60)]
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    store = PageStore([CacheDir(str(tmp_path), capacity * (PS + TRAILER_SIZE))], PS, next_use=table.next_use,
                      plan_moment=table.moment if lazy else None,
                      next_uses=table.next_uses if lazy == "batched" else None)
    table._on_change = store.replan
    try:
        _register(table, "j", trace)
        misses = _replay(store, table, clock, trace)
        assert misses == brute_force_belady(trace, capacity)
        assert store.stats().policy == "future"
        assert store.stats().pages <= capacity
    finally:
        store.close()


def test_lru_stays_selectable_and_thrashes_a_cyclic_scan(tmp_path):
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    trace = list(range(10)) * 4  # a scan larger than the cache, in the same order each epoch
    lru = PageStore([CacheDir(str(tmp_path / "lru"), 5 * (PS + TRAILER_SIZE))], PS)
    future = PageStore([CacheDir(str(tmp_path / "fut"), 5 * (PS + TRAILER_SIZE))], PS, next_use=table.next_use)
    table._on_change = future.replan
    try:
        assert lru.stats().policy == "lru"
        _register(table, "j", trace)
        lru_misses = sum(1 for _ in _misses_lru(lru, trace))
        future_misses = _replay(future, table, clock, trace)
        assert lru_misses == len(trace)  # LRU keeps exactly what is needed last
        assert future_misses == brute_force_belady(trace, 5) < lru_misses
        assert future.stats().bypassed > 0
    finally:
        lru.close()
        future.close()


def _misses_lru(store: PageStore, trace: list[int]):
    for page in trace:
        pid = PageId("m", f"k{page}", "v1", 0)
        if store.get(pid) is None:
            store.put(pid, b"x" * PS)
            yield page


def test_unplanned_pages_leave_first_lru_among_them(tmp_path):
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    store = PageStore([CacheDir(str(tmp_path), 4 * (PS + TRAILER_SIZE))], PS, next_use=table.next_use)
    table._on_change = store.replan
    try:
        _register(table, "j", [0, 1])  # pages 0 and 1 are read next; 7, 8 by nobody
        for page in (0, 7, 1, 8):
            store.put(PageId("m", f"k{page}", "v1", 0), b"x" * PS)
        store.get(PageId("m", "k7", "v1", 0))  # 8 is now the least recently used unplanned page
        store.put(PageId("m", "k9", "v1", 0), b"x" * PS)  # unplanned, but room is made from unplanned
        assert not store.contains(PageId("m", "k8", "v1", 0))
        assert all(store.contains(PageId("m", f"k{p}", "v1", 0)) for p in (0, 1, 7, 9))
    finally:
        store.close()


def test_a_page_read_later_than_everything_cached_is_served_not_admitted(tmp_path):
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    store = PageStore([CacheDir(str(tmp_path), 2 * (PS + TRAILER_SIZE))], PS, next_use=table.next_use)
    table._on_change = store.replan
    try:
        _register(table, "j", [5, 0, 1, 2, 0, 1, 2])  # page 2 is read after 0 and 1, at both turns
        table.update(worker_pb2.PlanRequest(job="j", position=1, rate=100.0, lease_seconds=60))
        store.put(PageId("m", "k0", "v1", 0), b"a" * PS)
        store.put(PageId("m", "k1", "v1", 0), b"b" * PS)
        late = PageId("m", "k2", "v1", 0)
        assert not store.worth_admitting(late)
        assert store.put(late, b"c" * PS) is False  # not admitted: 0 and 1 stay
        assert store.contains(PageId("m", "k0", "v1", 0)) and store.contains(PageId("m", "k1", "v1", 0))
        assert store.stats().bypassed == 1
        fd = store.open_page(late)  # its waiting reader still gets it, once, as a page file copy
        assert fd is not None and store.passing(late.digest())
        try:
            data = os.pread(fd, PS + TRAILER_SIZE, 0)
        finally:
            os.close(fd)
        assert data[:PS] == b"c" * PS and len(data) == PS + TRAILER_SIZE
        assert store.open_page(late) is None  # handed out once: a later read is a miss
    finally:
        store.close()


def test_plan_expiry_unpins_pages(tmp_path):
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    store = PageStore([CacheDir(str(tmp_path), 2 * (PS + TRAILER_SIZE))], PS, next_use=table.next_use)
    table._on_change = store.replan
    try:
        where = {0: [10], 1: [20]}
        runs = [worker_pb2.PlanRun(path=f"m/k{p}", offset=0, length=PS, positions=ps) for p, ps in where.items()]
        table.update(worker_pb2.PlanRequest(job="j", replace=True, runs=runs, done=True, rate=100, lease_seconds=5))
        store.put(PageId("m", "k0", "v1", 0), b"x" * PS)
        store.put(PageId("m", "k1", "v1", 0), b"x" * PS)
        assert not store.worth_admitting(PageId("m", "k2", "v1", 0))  # planned pages are sooner
        clock.t += 6  # the job stopped renewing
        assert table.expire() == 1 and len(table) == 0
        assert store.worth_admitting(PageId("m", "k2", "v1", 0))  # nothing pinned any more: LRU order
        assert store.put(PageId("m", "k2", "v1", 0), b"x" * PS)
    finally:
        store.close()


def test_two_jobs_merge_their_futures_earliest_wins():
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    # Job a reads page 0 at position 100 (1 s at 100/s); job b reads it at position 10 (0.1 s).
    for job, pos in (("a", 100), ("b", 10)):
        runs = [worker_pb2.PlanRun(path="m/k0", offset=0, length=PS, positions=[pos])]
        table.update(worker_pb2.PlanRequest(job=job, replace=True, runs=runs, done=True, rate=100, lease_seconds=60))
    when, _ = table.next_use(PageId("m", "k0", "v", 0), False)
    assert when == pytest.approx(clock.t + 0.1)
    assert table.next_use(PageId("m", "k9", "v", 0), False)[0] == math.inf


def test_plan_table_maps_byte_ranges_to_pages():
    table = PlanTable(PS, clock=FakeClock())
    runs = [worker_pb2.PlanRun(path="m/shard", offset=PS - 10, length=20, positions=[3]),  # pages 0 and 1
            worker_pb2.PlanRun(path="m/shard", offset=PS + 100, length=10, positions=[4])]  # page 1 again
    table.update(worker_pb2.PlanRequest(job="j", replace=True, runs=runs, done=True, rate=100, lease_seconds=60))
    job = table._jobs["j"]
    assert job.pages[("m", "shard", 0)] == ([3], [3])
    assert job.pages[("m", "shard", 1)] == ([3, 4], [3, 4])  # read at positions 3 and 4


@pytest.mark.parametrize("bad", [
    dict(job="", lease_seconds=10),
    dict(job="j", lease_seconds=0),
    dict(job="j", lease_seconds=10, rate=-1),
    dict(job="j", lease_seconds=10, runs=[worker_pb2.PlanRun(path="m/k", offset=0, length=0, positions=[1])]),
    dict(job="j", lease_seconds=10, runs=[worker_pb2.PlanRun(path="m/k", offset=0, length=1, positions=[])]),
    dict(job="j", lease_seconds=10, runs=[worker_pb2.PlanRun(path="../x", offset=0, length=1, positions=[1])]),
    dict(job="j", lease_seconds=10, runs=[worker_pb2.PlanRun(path="m/k", offset=0, length=1 << 40, positions=[1])]),
])
def test_bad_plans_are_refused_with_a_clear_error(bad):
    table = PlanTable(PS, clock=FakeClock())
    with pytest.raises(PlanError):
        table.update(worker_pb2.PlanRequest(replace=True, **bad))
    assert len(table) == 0


def test_renewing_an_unknown_plan_says_so():
    table = PlanTable(PS, clock=FakeClock())
    assert table.update(worker_pb2.PlanRequest(job="gone", position=5, lease_seconds=10)) is False
    assert table.stats["unknown"] == 1


def test_passing_pages_are_bounded_and_expire(monkeypatch):
    passing = PassingPages(max_bytes=3 * PS, ttl=5.0)
    for i in range(5):
        passing.add(f"d{i}", b"x" * PS)
    assert passing.nbytes <= 3 * PS
    assert passing.get("d0") is None and passing.get("d4") == b"x" * PS
    assert passing.get("d4") is None  # taken


class _OrderEntry:
    """What an eviction order needs of a page entry (unit tests of the order alone)."""

    __slots__ = ("pid", "digest", "next_use", "size", "held_until")

    def __init__(self, i: int) -> None:
        self.pid, self.digest, self.next_use, self.size, self.held_until = i, str(i), 0.0, 1, 0.0


def test_next_use_order_compacts_and_picks_furthest_first():
    """Per access a heap push and a dict update; stale heap items are compacted away (the cost at
    10 M pages is measured by benchmarks/bench_policy.py, not here)."""
    order = NextUseOrder(lambda pid, used: (float(hash(pid) % 1000), math.inf))

    entries = [_OrderEntry(i) for i in range(20_000)]
    for e in entries:
        order.add(e)
    for e in entries[:5_000]:
        order.touch(e)
    # Stale heap items are compacted away: memory stays within 2x the live pages.
    assert len(order._furthest) <= 2 * len(order) + 64
    victims = order.pick(10, 0.0)
    assert victims is not None and len(victims) == 10
    keys = [v.next_use for v in victims]
    assert keys == sorted(keys, reverse=True) and keys[0] == max(e.next_use for e in entries)
    assert isinstance(LruOrder().pick(1, 0.0), type(None))


def _plan_of_objects(table: PlanTable, n: int, rate: float = 100.0) -> None:
    """Job "j" reads object k{i} at position i (one page each), complete."""
    runs = [worker_pb2.PlanRun(path=f"m/k{i}", offset=0, length=PS, positions=[i]) for i in range(n)]
    assert table.update(worker_pb2.PlanRequest(job="j", replace=True, runs=runs, done=True, rate=rate,
                                               lease_seconds=60))


def test_a_job_reading_its_plan_again_gets_its_read_ahead_again():
    """A dataset iterated again without set_epoch reads the same order from position 0: the
    worker notices the reader going back (or new readers far behind) and fetches ahead again."""
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    _plan_of_objects(table, 2000, rate=5000.0)  # a fast job: its rate's slack is longer than half a pass
    assert table.due("j", 1 << 40, 1.0, at_least=32)[:2] == [("m/k0", 1), ("m/k1", 1)]
    for position in range(0, 2000, 32):  # pass 1, DataLoader workers 1 and 2 taking turns
        clock.t += 0.005
        table.progress("j", position, reader=1 + (position // 32) % 2)
        table.due("j", 1 << 40, 1.0, at_least=32)
    assert table._jobs["j"].position >= 1960
    assert table.due("j", 1 << 40, 1.0) == []  # everything handed out once
    # Pass 2: new DataLoader workers (new readers), the first at the start again.
    clock.t += 0.5
    table.progress("j", 32, reader=3)
    assert table.stats["rewound"] == 1
    table.progress("j", 0, reader=4)  # a few batches apart: the same pass, no second rewind
    assert table.stats["rewound"] == 1
    ahead = [path for path, _pages in table.due("j", 1 << 40, 1.0, at_least=32)]
    assert ahead[0] == "m/k32" and "m/k40" in ahead  # what the readers are not reading yet
    # The old pass's readers no longer hold the position: the new one's is the estimate.
    assert table._jobs["j"].estimate(clock.t) <= 32
    # The same reader going back also starts over (persistent workers, or no workers at all).
    for position in range(32, 2000, 32):
        clock.t += 0.005
        table.progress("j", position, reader=3)
    table.due("j", 1 << 40, 1.0)
    table.progress("j", 0, reader=3)
    assert table.stats["rewound"] == 2 and table.due("j", 1 << 40, 1.0, at_least=32)[0] == ("m/k0", 1)


def test_a_reader_a_little_behind_is_no_new_pass():
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    _plan_of_objects(table, 2000)
    table.progress("j", 1500, reader=1)
    table.progress("j", 1200, reader=2)  # new, behind, but past half of where the job is
    table.progress("j", 1400, reader=1)  # the same reader a little back: a prefetch thread's order
    assert table.stats["rewound"] == 0 and table._jobs["j"].position == 1500


def test_renewals_follow_the_reads_and_start_over_without_them():
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    _plan_of_objects(table, 2000)
    table.progress("j", 100, reader=1)
    # A renewal's count can run ahead of the reads or lag them (per-process counters): while a
    # reader speaks, the reads' exact position wins.
    table.update(worker_pb2.PlanRequest(job="j", position=900, rate=100, lease_seconds=60))
    assert table._jobs["j"].position == 100
    clock.t += 10  # no reader spoke lately (a client on another host: renewals alone)
    table.update(worker_pb2.PlanRequest(job="j", position=1900, rate=100, lease_seconds=60))
    assert table._jobs["j"].position == 1900
    table.update(worker_pb2.PlanRequest(job="j", position=10, rate=100, lease_seconds=60))  # its count restarted
    assert table.stats["rewound"] == 1 and table._jobs["j"].position == 10
    assert table.due("j", 1 << 40, 1.0, at_least=32)[0] == ("m/k10", 1)


def test_reads_are_placed_when_the_order_decides_as_of_their_moment():
    """A warm epoch's reads cost the worker a dict entry each: the plan is asked for a read page's
    next use only when the order next decides (pick, furthest, first, an add), with the moment
    of the read; a replan or a removal drops the pending read, the stale sweep skips it."""
    calls: list[tuple[int, bool, object]] = []
    now = {"t": 0}

    def next_use(pid, used, moment=None):
        calls.append((pid, used, moment))
        return (float(100 - pid), 1e9) if pid < 50 else (math.inf, math.inf)

    order = NextUseOrder(next_use, moment=lambda: ("moment", now["t"]))

    entries = [_OrderEntry(i) for i in range(60)]
    for e in entries:
        order.add(e)
    calls.clear()
    for t, e in enumerate(entries[:10]):
        now["t"] = t
        order.touch(e)
    order.touch(entries[10], moment=("batch", 99))
    assert calls == []  # nothing asked yet
    assert sorted(e.pid for e in order.stale(math.inf)) == list(range(11, 50))  # read ones are not stale
    order.replan(entries[0])  # the plans changed: asked now, as a use not over (the read is dropped)
    order.remove(entries[1])
    assert calls == [(0, False, None)]
    calls.clear()
    victims = order.pick(1, 0.0)  # a decision: the pending reads are placed first, in read order
    assert [c[0] for c in calls] == list(range(2, 11))
    assert all(used for _, used, _ in calls)
    assert [m for _, _, m in calls] == [("moment", t) for t in range(2, 10)] + [("batch", 99)]
    assert victims is not None and victims[0].pid >= 50  # no known next use: first to leave
    calls.clear()
    assert order.pick(1, 0.0) is not None and calls == []  # nothing pending: nothing asked


def test_plan_table_answers_as_of_a_moment():
    """A read placed later is placed as of its moment: the job's position then, not now."""
    clock = FakeClock()
    table = PlanTable(PS, clock=clock)
    _register(table, "j", [0, 1, 2, 3, 0, 1, 2, 3], rate=1.0)
    pid = PageId("m", "k0", "v1", 0)
    table.update(worker_pb2.PlanRequest(job="j", position=0, rate=1.0, lease_seconds=60))
    at_read = table.moment()
    eager = table.next_use(pid, True)
    clock.t += 3.0
    table.update(worker_pb2.PlanRequest(job="j", position=3, rate=1.0, lease_seconds=60))
    assert table.next_use(pid, True, at_read) == eager
    assert table.next_use(pid, True) != eager  # asked as of now, the job is elsewhere


def test_unplaced_reads_are_bounded(monkeypatch):
    """A pass over more pages than the backlog holds places its oldest reads as new ones come,
    so the first decision after it never places more than the bound at once."""
    import cachefs.server.pagestore.policy as policy

    monkeypatch.setattr(policy, "MAX_READ_BACKLOG", 100)
    monkeypatch.setattr(policy, "SETTLE_CHUNK", 10)
    asked: list[int] = []

    def next_use(pid, used, moment=None):
        asked.append(pid)
        return float(pid), 1e9

    order = NextUseOrder(next_use, moment=lambda: None)

    entries = [_OrderEntry(i) for i in range(500)]
    for e in entries:
        order.add(e)
    asked.clear()
    for e in entries:
        order.touch(e)
        assert len(order._read) <= 100
    assert asked == list(range(len(asked))) and len(asked) >= 400  # the oldest first, in read order
    asked.clear()
    assert order.furthest() == 499.0 and len(asked) <= 100


def test_an_order_rests_while_its_dir_has_room_and_replans_when_it_wakes():
    """Nothing leaves a dir with room to spare, so its order asks no next use then (reads, new
    pages and replans cost a dict operation or nothing); once the dir nears its quota it wakes
    owing a replan of every page, and then evicts by next use as an order never at rest would."""
    import cachefs.server.pagestore.policy as policy

    quota, page = 1 << 30, 1 << 20
    free = [quota]
    asked: list[int] = []

    def next_use(pid, used, moment=None):
        asked.append(pid)
        return float(pid), math.inf

    def next_uses(pids, used, moment=None):
        return [next_use(pid, used) for pid in pids]

    order = NextUseOrder(next_use, next_uses=next_uses, room=lambda: free[0], quota=quota)
    assert order.rests() and not order.replan_due
    entries = [_OrderEntry(i) for i in range(700)]
    for e in entries:  # 700 MiB of 1 GiB: 324 MiB of room, more than a quarter
        e.size = page
        free[0] -= page
        order.add(e)
    for e in reversed(entries):
        order.touch(e)
    order.replan_many(entries)
    assert asked == [] and order.stale(math.inf) == [] and order.rests()
    assert order.first() is entries[-1]  # the least recently read first, as LRU

    free[0] = quota // 8 - 1  # under the wake mark: the first call after it wakes the order
    assert not order.rests() and order.replan_due
    order.replan_all()
    assert sorted(asked) == list(range(700)) and not order.replan_due
    victims = order.pick(3 * page, 0.0)
    assert [v.pid for v in victims] == [699, 698, 697]  # furthest next use first

    free[0] = quota // 4  # room again: it rests, and a dir too small to rest never does
    assert order.rests()
    assert not NextUseOrder(next_use, room=lambda: 10 ** 12, quota=policy.REST_ROOM_MIN_BYTES).rests()


def test_a_resting_store_asks_no_next_use_until_it_nears_its_quota(tmp_path, monkeypatch):
    """The same in the page store: puts and reads of a dir with room ask the plans nothing and a
    plan change replans nothing; filling it past the wake mark makes the worker's replan ask for
    every page (wants_replan), and eviction is by next use again."""
    import cachefs.server.pagestore.policy as policy

    monkeypatch.setattr(policy, "REST_ROOM_MIN_BYTES", 0)
    monkeypatch.setattr(policy, "WAKE_ROOM_MIN_BYTES", 0)
    asked: list[int] = []
    uses = {}

    def next_use(pid, used, moment=None):
        asked.append(pid.index)
        return uses.get(pid.index, math.inf), math.inf

    def next_uses(pids, used, moment=None):
        return [next_use(pid, used) for pid in pids]

    capacity = 40
    store = PageStore([CacheDir(str(tmp_path), capacity * (PS + TRAILER_SIZE))], PS, next_use=next_use,
                      next_uses=next_uses)
    try:
        uses.update({i: float(1000 - i) for i in range(capacity + 2)})  # page 0 is used last
        for i in range(25):  # 15 pages of room left: more than a quarter
            pid = PageId("m", "k", "v1", i)
            assert store.put(pid, b"x" * PS) and store.get(pid) is not None
        assert store.replan() == 0 and store.refresh_stale() == 0
        assert asked == [] and not store.wants_replan()
        for i in range(25, 36):  # 4 pages of room left: under an eighth
            assert store.put(PageId("m", "k", "v1", i), b"x" * PS)
        assert store.wants_replan()
        assert store.replan() == 36 and not store.wants_replan()
        assert set(asked) >= set(range(36))
        for i in range(36, capacity + 2):
            assert store.put(PageId("m", "k", "v1", i), b"x" * PS)
        # the furthest next uses left (pages 0 and 1), the rest stayed
        assert [i for i in range(capacity + 2) if not store.contains(PageId("m", "k", "v1", i))] == [0, 1]
    finally:
        store.close()
