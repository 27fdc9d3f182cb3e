"""Eviction by next use end to end (#16): datasets register their read order with real workers.

A cache smaller than the data set, read epoch after epoch in a shuffled order: a worker evicting
by the registered plans fetches less from the store than one evicting by recency, in the same
test; two jobs with different seeds share one worker from two processes; a restarted worker is
sent the plan again.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.plans import PlanPublisher
from cachefs.pagefile import TRAILER_SIZE
from cachefs.proto import worker_pb2, worker_pb2_grpc
from helpers import client, payload, wait_for

PAGE = 4096
N = 48
QUOTA_PAGES = 16  # a third of the data set


def _ids(batch: list[torch.Tensor]) -> list[int]:
    return [int(bytes(t[:6].numpy())) for t in batch]


@pytest.fixture
def samples(local_store):
    for i in range(N):
        local_store.add(f"train/{i:05d}.bin", f"{i:06d}".encode() + payload(PAGE - 6, i))
    return local_store, [f"cachefs://data/train/{i:05d}.bin" for i in range(N)]


def _read_epochs(ds: CacheDataset, worker, epochs: int) -> list[int]:
    """Store bytes the worker fetched in each epoch; every sample read exactly once per epoch."""
    fetched = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        before = worker.metrics.totals()["bytes_from_store"]
        loader = DataLoader(ds, batch_size=4, sampler=ds.sampler(), collate_fn=_ids)
        got = sorted(i for batch in loader for i in batch)
        assert got == list(range(N))
        fetched.append(worker.metrics.totals()["bytes_from_store"] - before)
    return fetched


def test_eviction_by_registered_plan_fetches_less_than_lru(samples, make_worker):
    store, paths = samples
    quota = QUOTA_PAGES * (PAGE + TRAILER_SIZE)
    future = make_worker(store.mount, page_size=PAGE, quota=quota)
    lru = make_worker(store.mount, page_size=PAGE, quota=quota, eviction="lru")
    ds_future = CacheDataset(paths, storage_options={"workers": future.address}, seed=3, hint_samples=0)
    ds_lru = CacheDataset(paths, storage_options={"workers": lru.address}, seed=3, hint_samples=0,
                          plan_ahead=False)
    report = ds_future.plan_report
    assert report is not None and report.workers == 1 and report.policy == {"future"}
    assert report.capacity_bytes == quota and len(future.plans) == 1 and len(lru.plans) == 0
    by_plan = _read_epochs(ds_future, future, 4)
    by_recency = _read_epochs(ds_lru, lru, 4)
    # Each epoch after the first: the plan keeps pages that are read again soon; LRU, in a
    # shuffled scan three times its size, keeps about what chance keeps.
    assert sum(by_plan[1:]) < sum(by_recency[1:])
    assert future.pages.stats().bypassed > 0
    assert future.pages.stats().pages <= QUOTA_PAGES


def _job(address: str, paths: list[str], seed: int, out: "multiprocessing.Queue") -> None:
    ds = CacheDataset(paths, storage_options={"workers": address}, seed=seed, hint_samples=0)
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=4, sampler=ds.sampler(), collate_fn=_ids)
        seen.append(sorted(i for batch in loader for i in batch))
    out.put((seed, ds.plan_report.workers if ds.plan_report else 0, seen))


def test_two_jobs_with_different_seeds_share_a_worker(samples, make_worker):
    store, paths = samples
    worker = make_worker(store.mount, page_size=PAGE, quota=QUOTA_PAGES * (PAGE + TRAILER_SIZE))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_job, args=(worker.address, paths, seed, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    try:
        assert wait_for(lambda: len(worker.plans) == 2, timeout=120), worker.plans.describe()
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert sorted(seed for seed, _, _ in results) == [1, 2]
    for _, workers, seen in results:
        assert workers == 1
        assert seen == [list(range(N))] * 2
    assert all(p.exitcode == 0 for p in procs)
    assert worker.pages.stats().pages <= QUOTA_PAGES


def test_restarted_worker_is_sent_the_plan_again(samples, make_worker, tmp_path: Path):
    store, paths = samples
    cache = tmp_path / "restart-cache"
    first = make_worker(store.mount, page_size=PAGE, cache_dir=cache)
    port = first.port
    ds = CacheDataset(paths, storage_options={"workers": first.address}, seed=5, hint_samples=0)
    assert len(first.plans) == 1
    first.stop(grace=0.5)
    second = make_worker(store.mount, page_size=PAGE, cache_dir=cache, port=port)
    assert len(second.plans) == 0
    # The renewer (once a second) finds the plan unknown there and sends it whole again.
    assert wait_for(lambda: len(second.plans) == 1 and ds.plan_report.resent >= 1, timeout=60)
    assert second.plans.describe()[0]["complete"]


def test_the_plan_drives_prefetch_instead_of_hints(samples, make_worker):
    """With a plan registered, the worker fetches what the job reads next itself (from the
    position its reads report), and the dataset sends no hints."""
    store, paths = samples
    worker = make_worker(store.mount, page_size=PAGE)  # room for everything: every page is admitted
    ds = CacheDataset(paths, storage_options={"workers": worker.address}, seed=9, prefetch_depth=1)
    assert ds.plan_report.complete
    ds[0]  # reads position 0; the worker loads what follows it in the plan
    following = {ds.paths[ds.plan.sample(p)] for p in range(2, 33)}
    assert wait_for(lambda: all(worker.pages.holds_object("data", p.removeprefix("cachefs://data/"))
                                for p in following), timeout=30)
    assert ds.hinter.stats["sent"] == 0


def test_iterated_again_without_set_epoch_the_plan_fetches_ahead_again(samples, make_worker):
    """A second pass over the same epoch (no set_epoch: the same order, as PyTorch's samplers
    give) starts the worker's read-ahead over, here after the cache was freed: the pass reads
    its first sample and the worker fetches what follows it in the plan, unasked."""
    store, paths = samples
    worker = make_worker(store.mount, page_size=PAGE)
    ds = CacheDataset(paths, storage_options={"workers": worker.address}, seed=9, prefetch_depth=1)
    assert ds.plan_report.complete
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler(), collate_fn=_ids)
    assert sorted(i for batch in loader for i in batch) == list(range(N))
    with grpc.insecure_channel(worker.address) as ch:
        worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix="data/train"), timeout=30)
    assert not any(worker.pages.holds_object("data", p.removeprefix("cachefs://data/")) for p in paths)
    fetched = worker.metrics.totals()["bytes_from_store"]
    ds[0]  # the second pass's first read, at position 0 again
    following = {ds.paths[ds.plan.sample(p)] for p in range(2, 33)}
    assert wait_for(lambda: all(worker.pages.holds_object("data", p.removeprefix("cachefs://data/"))
                                for p in following), timeout=30)
    assert worker.plans.stats["rewound"] >= 1
    assert worker.metrics.totals()["bytes_from_store"] - fetched >= len(following) * PAGE


class _NoWorkers:
    def candidates(self, *args, **kwargs):
        return []

    def placed(self, *args, **kwargs):
        return None


def test_requests_carry_the_furthest_position_read_since_the_last_one():
    """A pass read by name sends no message: the next request tells where that pass got to,
    once, so the worker sees a new pass begin rather than a reader that stood still."""
    from cachefs.client.transport.bulkpaths import PlanProgress

    progress = PlanProgress()
    assert progress.take() is None  # no plan read yet: nothing to send
    for position in range(0, 48, 4):
        progress.note("job", position)
    progress.note("job", 0)  # the next pass begins
    assert progress.take() == ("job", 0, 44)
    assert progress.take() == ("job", 0, 0)  # said once
    progress.note("job", 8)
    progress.note("other", 3)  # another plan (a set_epoch): its own furthest
    assert progress.take() == ("other", 3, 3)


def test_plan_positions_count_from_the_start_again_on_a_replay():
    """The job's sample count keeps growing across passes (one process, or persistent DataLoader
    workers); past the plan's own epoch with no new plan, positions are those of the pass again."""
    count = [0]
    publisher = PlanPublisher(_NoWorkers(), lambda: count[0], renew_seconds=60, lease_seconds=120)
    try:
        publisher.publish([("m/k", 0, 1)], np.zeros(20, dtype=np.int64), replay_after=10)
        for read, position in ((0, 0), (7, 7), (10, 10), (11, 1), (19, 9), (20, 10), (23, 3)):
            count[0] = read
            assert publisher._progress()[0] == position
        with pytest.raises(ValueError):
            publisher.publish([], np.zeros(0, dtype=np.int64), replay_after=-1)
    finally:
        publisher.close()


def test_the_plans_read_ahead_loads_what_is_missing_and_skips_what_is_cached(local_store, make_worker):
    """Plan-driven prefetch: an object whose planned pages are all cached costs no load (a warm
    pass read again); one partly cached (a large shard partly evicted) is loaded, its missing
    pages only."""
    big, whole = payload(4 * PAGE, 61), payload(PAGE, 62)
    local_store.add("ra/big.bin", big)
    local_store.add("ra/whole.bin", whole)
    worker = make_worker(local_store.mount, page_size=PAGE, readahead_pages=0)
    fs = client(worker.address)
    assert fs.cat_file("data/ra/big.bin", start=0, end=PAGE) == big[:PAGE]
    assert fs.cat_file("data/ra/whole.bin") == whole
    assert wait_for(lambda: worker.pages.held_pages("data", "ra/big.bin") == 1
                    and worker.pages.held_pages("data", "ra/whole.bin") == 1)

    def load_bytes(outcome: str) -> float:
        return worker.metrics.registry.get_sample_value("cachefs_worker_load_bytes_total", {"outcome": outcome}) or 0.0

    fetched, skipped = load_bytes("fetched"), load_bytes("skipped")
    runs = [worker_pb2.PlanRun(path="data/ra/whole.bin", offset=0, length=PAGE, positions=[0]),
            worker_pb2.PlanRun(path="data/ra/big.bin", offset=0, length=4 * PAGE, positions=[1])]
    with grpc.insecure_channel(worker.address) as ch:
        worker_pb2_grpc.WorkerServiceStub(ch).Plan(worker_pb2.PlanRequest(
            job="ra", replace=True, runs=runs, done=True, rate=100, lease_seconds=60), timeout=30)
    assert wait_for(lambda: load_bytes("fetched") - fetched == 3 * PAGE, timeout=30)
    assert worker.pages.held_pages("data", "ra/big.bin") == 4
    assert load_bytes("skipped") - skipped == PAGE  # big's first page; whole.bin was never loaded
