"""Plans that do not grow with the epoch (#46): the worker derives a job's read order itself.

The epoch order is cachefs's own permutation (cachefs/order.py), dealt as the sampler deals it;
the worker is sent the data set's index once and per epoch only what defines the order, derives
the same order (checked by a digest; a plan whose digest it cannot reproduce is sent sample by
sample), and answers eviction and prefetch from it exactly as from the plan sent sample by sample.
``set_epoch`` at a million samples costs O(1) on the client.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.sampling import EpochPlan
from cachefs.order import EpochOrder, Permutation
from cachefs.proto import worker_pb2
from cachefs.server.worker import planindex
from cachefs.server.worker.planindex import derive, plan_samples
from cachefs.server.worker.plans import PlanTable
from helpers import payload

PAGE = 4096


def _reference(n: int, rank: int, ws: int, seed: int, epoch: int, shuffle: bool, drop_last: bool,
               offset: int) -> list[int]:
    """The deal as sampling.py has always made it, over the whole permutation."""
    perm = Permutation(n, seed, epoch).array(np.arange(n)) if shuffle else np.arange(n)
    rest = perm[offset:]
    total = (len(rest) // ws if drop_last else -(-len(rest) // ws)) * ws
    rest = np.resize(rest, total) if total > len(rest) else rest[:total]
    return rest[rank::ws].tolist()


CASES = [(n, ws, drop_last, offset_third)
         for n in (0, 1, 7, 10, 101) for ws in (1, 3, 4, 8) for drop_last in (False, True) for offset_third in (0, 1)]


@pytest.mark.parametrize("n,ws,drop_last,offset_third", CASES)
def test_the_epoch_order_is_dealt_as_the_sampler_deals_it(n, ws, drop_last, offset_third):
    offset = n * offset_third // 3
    for rank in range(ws):
        for shuffle in (True, False):
            want = _reference(n, rank, ws, 5, 2, shuffle, drop_last, offset)
            plan = EpochPlan(n, rank, ws, 5, 2, shuffle, drop_last, offset)
            assert [plan.sample(p) for p in range(len(plan))] == want  # O(1) a position
            assert plan.samples(np.arange(len(plan))).tolist() == want
            assert plan.order.tolist() == want
            order = EpochOrder(n, rank, ws, 5, 2, shuffle, drop_last, offset)
            assert all(order.positions_of(s) == [i for i, x in enumerate(want) if x == s] for s in range(n))


def test_the_permutation_is_pinned():
    """The order must not change with numpy or a release without ORDER_VERSION changing: pinned."""
    assert Permutation(10, 0, 0).array(np.arange(10)).tolist() == [8, 3, 7, 5, 9, 4, 0, 2, 6, 1]
    p = Permutation(1000, 12345, 7)
    assert sorted(p.array(np.arange(1000)).tolist()) == list(range(1000))
    assert all(p.inverse(p(i)) == i for i in range(0, 1000, 7))
    inverse = p.inverse_array()  # the whole inverse at once: the same answers
    assert inverse.dtype == np.int32 and inverse[p.array(np.arange(1000))].tolist() == list(range(1000))
    assert Permutation(0, 1).inverse_array().tolist() == []


def _spec(n: int, rank: int, ws: int, seed: int, epoch: int, drop_last: bool, offset: int, start: int,
          shuffle: bool = True) -> dict:
    """The dataset's own PlanOrder fields (CacheDataset._plan_order_spec) for such a plan."""
    fake = SimpleNamespace(plan=EpochPlan(n, rank, ws, seed, epoch, shuffle, drop_last, offset), samples_seen=start,
                           paths=range(n), rank=rank, world_size=ws, seed=seed, shuffle=shuffle, drop_last=drop_last)
    return CacheDataset._plan_order_spec(fake)  # type: ignore[arg-type]


def _sampler_plan(n, rank, ws, seed, epoch, drop_last, offset, start) -> list[int]:
    now = EpochPlan(n, rank, ws, seed, epoch, True, drop_last, offset)
    after = EpochPlan(n, rank, ws, seed, epoch + 1, True, drop_last)
    return now.order[start:].tolist() + after.order.tolist()


class FakeRequest(SimpleNamespace):
    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        return getattr(self, name, None) is not None


def _index_request(job: str, n: int, units: list[tuple[str, int, int]], samples: list[int]) -> worker_pb2.PlanRequest:
    paths = [units[s][0].encode() for s in samples]
    return worker_pb2.PlanRequest(job=job, lease_seconds=60, index_id="idx", index_size=n, index_samples=samples,
                                  index_paths=b"".join(paths), index_path_lengths=[len(p) for p in paths],
                                  index_offsets=[units[s][1] for s in samples],
                                  index_lengths=[units[s][2] for s in samples], index_done=True)


@pytest.mark.parametrize("n,rank,ws,seed,epoch,drop_last,offset,start", [
    (50, 0, 1, 0, 0, False, 0, 0), (50, 2, 4, 3, 1, False, 0, 5), (10, 1, 4, 9, 0, False, 0, 0),
    (10, 3, 4, 9, 0, True, 0, 1), (101, 1, 3, 7, 5, False, 34, 3), (7, 0, 8, 1, 2, False, 0, 0),
])
@pytest.mark.parametrize("inverted", [True, False], ids=["inverse-array", "inverse-per-value"])
def test_the_worker_derives_the_samplers_order(n, rank, ws, seed, epoch, drop_last, offset, start, inverted,
                                                monkeypatch):
    if not inverted:  # an order too large to hold inverted: each sample's place by the Feistel rounds
        monkeypatch.setattr(planindex, "INVERSE_MAX_SAMPLES", 0)
    spec = _spec(n, rank, ws, seed, epoch, drop_last, offset, start)
    order = worker_pb2.PlanOrder(**spec)
    want = _sampler_plan(n, rank, ws, seed, epoch, drop_last, offset, start)
    assert plan_samples(order).tolist() == want
    table = PlanTable(PAGE)
    units = [(f"data/s/{i}", 0, 100) for i in range(n)]
    table.update(_index_request("j", n, units, list(range(n))))
    index = table._indexes["idx"]
    derived = derive(index, order)
    assert derived is not None and derived.length == len(want)
    assert (derived.now_inverse is not None) == (derived.after_inverse is not None) == inverted
    for s in range(n):
        assert derived.positions_of(s) == [i for i, x in enumerate(want) if x == s]
    # another release's order (here: another seed under the same digest) is refused
    assert derive(index, worker_pb2.PlanOrder(**{**spec, "seed": seed + 1})) is None
    assert derive(index, worker_pb2.PlanOrder(**{**spec, "digest": "0" * 32})) is None


def test_a_derived_plan_answers_as_the_plan_sent_sample_by_sample():
    """Eviction's oracle (next_use), prefetch (due), pages_planned and planned_pages are the same
    for a plan derived from its definition as for the same plan sent as runs."""
    n, rank, ws, seed, epoch, start = 30, 1, 4, 11, 3, 2
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    explicit, derived = PlanTable(PAGE, clock=clock), PlanTable(PAGE, clock=clock)
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 3 * PAGE, n).tolist()
    units = [(f"data/s/{i:03d}-é", 0, int(sizes[i])) for i in range(n)]  # not ASCII: cut by bytes
    units[6] = ("data/s/005-é", 3 * PAGE, int(sizes[6]))  # two samples of one object (a shard's)
    held = [s for s in range(n) if s % 3 != 1]  # this worker holds two thirds of the units
    plan = _sampler_plan(n, rank, ws, seed, epoch, False, 0, start)
    runs = []
    for s in held:
        where = [p for p, x in enumerate(plan) if x == s]
        if where:
            runs.append(worker_pb2.PlanRun(path=units[s][0], offset=0, length=units[s][2], positions=where))
    explicit.update(worker_pb2.PlanRequest(job="j", replace=True, done=True, runs=runs, lease_seconds=60, rate=10))
    derived.update(_index_request("j", n, units, held))
    known, index_known, took = derived.take(worker_pb2.PlanRequest(
        job="j", replace=True, done=True, lease_seconds=60, rate=10, index_id="idx",
        order=worker_pb2.PlanOrder(**_spec(n, rank, ws, seed, epoch, False, 0, start))))
    assert (known, index_known, took) == (True, True, True)
    assert derived.describe()[0]["derived"] and not explicit.describe()[0]["derived"]
    assert derived.planned_pages() == explicit.planned_pages() > 0
    pages = [SimpleNamespace(mount="data", key=units[s][0][5:], index=i) for s in range(n) for i in range(7)]
    pages.append(SimpleNamespace(mount="data", key="s/not-in-the-index", index=0))
    _at, answered = derived._derived[0].derived.uses_many([f"{p.mount}/{p.key}" for p in pages],
                                                          np.array([p.index for p in pages]))
    assert answered.sum() == len(pages) - 14  # all but the object of two units (asked one by one)
    for position in (0, 3, 7, 11):
        for table in (explicit, derived):
            table.progress("j", position)
        now[0] += 1.0
        for used in (False, True):
            a = [explicit.next_use(pid, used) for pid in pages]
            b = [derived.next_use(pid, used) for pid in pages]
            assert a == b
            assert used or any(math.isfinite(w) for w, _ in a), position
            # all at once (a replan): the same answers, also as of a moment
            assert derived.next_uses(pages, used) == b and explicit.next_uses(pages, used) == a
            moment = derived.moment()
            assert derived.next_uses(pages, used, moment) == [derived.next_use(pid, used, moment) for pid in pages]
        due = derived.due("j", 1 << 30, 2.0, at_least=6)
        assert due == explicit.due("j", 1 << 30, 2.0, at_least=6)
        assert all(pages == derived.pages_planned("j", path) for path, pages in due)
    for s in range(n):
        path = units[s][0]
        assert derived.pages_planned("j", path) == explicit.pages_planned("j", path)


@pytest.mark.parametrize("shuffle", [True, False])
def test_many_pages_next_uses_answer_in_one_pass_as_one_by_one(shuffle):
    """PlanTable.next_uses (a replan) answers every page of a derived plan in its vectorised pass,
    shuffled or not, as next_use does page by page (with a padded deal: rank 2 of 4 over 30)."""
    n, now = 30, [5.0]
    table = PlanTable(PAGE, clock=lambda: now[0])
    units = [(f"data/s/{i:03d}", 0, 2 * PAGE) for i in range(n)]
    table.update(_index_request("j", n, units, list(range(n))))
    assert table.take(worker_pb2.PlanRequest(
        job="j", replace=True, done=True, lease_seconds=60, rate=10, index_id="idx",
        order=worker_pb2.PlanOrder(**_spec(n, 2, 4, 3, 1, False, 0, 1, shuffle=shuffle))))[2]
    job = table._derived[0].derived
    assert (job.now_inverse is not None) == shuffle
    pages = [SimpleNamespace(mount="data", key=units[s][0][5:], index=i) for s in range(n) for i in range(3)]
    _at, answered = job.uses_many([f"data/{p.key}" for p in pages], np.array([p.index for p in pages]))
    assert answered.all()
    table.progress("j", 3)
    for used in (False, True):
        one_by_one = [table.next_use(p, used) for p in pages]
        assert table.next_uses(pages, used) == one_by_one and any(math.isfinite(w) for w, _ in one_by_one)


N = 24


@pytest.fixture
def samples(local_store):
    for i in range(N):
        local_store.add(f"train/{i:05d}.bin", f"{i:06d}".encode() + payload(PAGE - 6, i))
    return local_store, [f"cachefs://data/train/{i:05d}.bin" for i in range(N)]


def _ids(batch: list[torch.Tensor]) -> list[int]:
    return [int(bytes(t[:6].numpy())) for t in batch]


def test_the_index_goes_once_and_each_epoch_only_its_definition(samples, make_worker, monkeypatch):
    store, paths = samples
    worker = make_worker(store.mount, page_size=PAGE)
    finished = []
    from cachefs.server.worker import planindex
    original = planindex.PlanIndex.finish
    monkeypatch.setattr(planindex.PlanIndex, "finish", lambda self: (finished.append(self.id), original(self))[1])
    ranks = [CacheDataset(paths, storage_options={"workers": worker.address}, seed=4, rank=r, world_size=2,
                          hint_samples=0) for r in range(2)]
    for ds in ranks:
        assert ds.plan_report.derived == 1 and ds.plan_report.fallbacks == 0
    assert len(finished) == 1  # rank 1 found rank 0's index
    for epoch in (1, 2):
        for ds in ranks:
            ds.set_epoch(epoch)
            assert ds.plan_report.derived == 1
        seen = sorted(i for ds in ranks
                      for batch in DataLoader(ds, batch_size=4, sampler=ds.sampler(), collate_fn=_ids) for i in batch)
        assert seen == list(range(N))
    assert len(finished) == 1
    plans = worker.plans.describe()
    assert len(plans) == 2 and all(p["derived"] and p["complete"] for p in plans)


def test_a_plan_the_worker_cannot_reproduce_is_sent_sample_by_sample(samples, make_worker, monkeypatch):
    store, paths = samples
    worker = make_worker(store.mount, page_size=PAGE)
    monkeypatch.setattr("cachefs.client.datasets.dataset.plan_digest", lambda *a: "0" * 32)  # another release's order
    ds = CacheDataset(paths, storage_options={"workers": worker.address}, seed=4)
    report = ds.plan_report
    assert report.workers == 1 and report.derived == 0 and report.fallbacks == 1 and report.complete
    (plan,) = worker.plans.describe()
    assert not plan["derived"] and plan["complete"] and plan["pages"] == N
    ds.set_epoch(1)
    assert ds.plan_report.fallbacks == 1 and not worker.plans.describe()[0]["derived"]
    seen = sorted(i for batch in DataLoader(ds, batch_size=4, sampler=ds.sampler(), collate_fn=_ids) for i in batch)
    assert seen == list(range(N))


def test_set_epoch_at_a_million_samples_is_constant_time(local_store, make_worker):
    """At 1,000,000 samples ``set_epoch`` registers the plan of this epoch and the next with the
    worker in well under a second (it took 40-50 s when the plan went sample by sample)."""
    n = 1_000_000
    worker = make_worker(local_store.mount)
    paths = [f"cachefs://data/train/{i:09d}.jpg" for i in range(n)]
    ds = CacheDataset(paths, sizes=np.full(n, 110_000), storage_options={"workers": worker.address}, seed=1,
                      rank=1, world_size=4, hint_samples=0, stats=False)
    assert ds.plan_report.derived == 1
    took = []
    for epoch in (1, 2, 3):
        t0 = time.perf_counter()
        ds.set_epoch(epoch)
        took.append(time.perf_counter() - t0)
        assert ds.plan_report.derived == 1
    assert sorted(took)[1] < 1.0, took
    assert worker.plans.derived_bytes() < 100e6


def test_a_breaker_open_at_construction_leaves_no_unit_unplanned(samples, make_worker, monkeypatch):
    """The plan follows the ring's placement, not a moment's health: with every worker's breaker
    open while the dataset is made (a loaded machine, a slow call a moment before), its units are
    still planned on the worker that holds them (before: none was, derived 0)."""
    from cachefs.client.transport.workers import Breaker

    store, paths = samples
    worker = make_worker(store.mount, page_size=PAGE)
    monkeypatch.setattr(Breaker, "available", lambda self, now=None: False)
    ds = CacheDataset(paths, storage_options={"workers": worker.address}, seed=4, rank=0, world_size=1,
                      hint_samples=0)
    assert ds.plan_report.derived == 1 and ds.plan_report.failed == 0, ds.plan_report
