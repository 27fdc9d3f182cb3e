"""CacheDataset: epoch plans, sharding, resume and prefetch, through real DataLoaders and workers.

Ranks are simulated in one test process (one dataset per rank, rank=r, world_size=2, read one
after the other); each rank's DataLoader workers are real processes (fork).
"""

from __future__ import annotations

import gc
import json
import pickle
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from cachefs.client.datasets.dataset import CacheDataset, SampleReadError, to_tensor
from cachefs.client.datasets.sampling import EpochPlan
import grpc

from cachefs.proto import worker_pb2, worker_pb2_grpc
from helpers import payload, wait_for

PAGE = 64 << 10
TIMEOUT = 60  # DataLoader timeout: a hang fails the test instead of stalling it


def _sample(i: int, size: int) -> bytes:
    head = f"s{i:05d}|".encode()
    return head + payload(max(0, size - len(head)), i)


def _sample_id(t: torch.Tensor) -> int:
    return int(bytes(t[1:6].numpy()).decode())


def _as_list(batch):
    return batch


def _ids(batches) -> list[int]:
    return [_sample_id(t) for batch in batches for t in batch]


def _loader(ds: CacheDataset, num_workers: int, batch_size: int | None = 3, **kw) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, sampler=ds.sampler(), num_workers=num_workers,
                      collate_fn=_as_list if batch_size else None, timeout=TIMEOUT if num_workers else 0, **kw)


@pytest.fixture
def served(local_store, make_worker):
    def make(n: int, size=lambda i: 1000 + 37 * i):
        for i in range(n):
            local_store.add(f"train/{i:05d}.bin", _sample(i, size(i)))
        worker = make_worker(local_store.mount, page_size=PAGE)
        return local_store, {"workers": worker.address}
    return make


def _dataset(opts, **kw) -> CacheDataset:
    return CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, **kw)


# -- the plan alone ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 12, 13])
@pytest.mark.parametrize("drop_last", [False, True])
def test_plan_deals_equal_counts_and_every_sample(n, drop_last):
    plans = [EpochPlan(n, r, 4, seed=3, epoch=1, drop_last=drop_last) for r in range(4)]
    counts = {len(p) for p in plans}
    assert len(counts) == 1  # every rank the same count: no DDP hang
    got = Counter(int(s) for p in plans for s in p.order)
    if drop_last:
        assert len(plans[0]) == n // 4 and all(c == 1 for c in got.values())
    else:
        assert len(plans[0]) == -(-n // 4) and set(got) == set(range(n))
        assert sum(got.values()) - n == (-n) % 4  # the padding, and nothing else, repeats
    assert [p.order.tolist() for p in plans] == [EpochPlan(n, r, 4, 3, 1, drop_last=drop_last).order.tolist()
                                                 for r in range(4)]


def test_plan_order_depends_on_seed_and_epoch_only():
    a = EpochPlan(100, 0, 1, seed=5, epoch=0).order
    assert a.tolist() == EpochPlan(100, 0, 1, seed=5, epoch=0).order.tolist()
    assert a.tolist() != EpochPlan(100, 0, 1, seed=5, epoch=1).order.tolist()
    assert a.tolist() != EpochPlan(100, 0, 1, seed=6, epoch=0).order.tolist()
    assert EpochPlan(10, 0, 1, shuffle=False).order.tolist() == list(range(10))


class _WhoReads(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i, get_worker_info().id


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")
@pytest.mark.parametrize("batch_size,start", [(1, 0), (3, 0), (4, 7)])
def test_plan_predicts_which_dataloader_worker_reads_each_position(batch_size, start):
    plan = EpochPlan(40, 0, 1)
    loader = DataLoader(_WhoReads(), batch_size=batch_size, sampler=range(start, 40), num_workers=3,
                        collate_fn=_as_list, timeout=TIMEOUT)
    seen: dict[int, list[int]] = {}
    for batch in loader:
        for pos, worker in batch:
            seen.setdefault(worker, []).append(pos)
    for w in range(3):
        assert seen.get(w, []) == plan.worker_positions(w, 3, batch_size, start).tolist()
        first = plan.worker_positions(w, 3, batch_size, start)
        if len(first):  # and upcoming() from a worker's first batch lists the rest of its positions
            assert [int(first[0]), *EpochPlan.upcoming(int(first[0]), batch_size, 3, 40)] == first.tolist()


def test_plan_resume_with_another_world_size_deals_exactly_the_rest():
    n, k = 50, 7
    old = [EpochPlan(n, r, 3, seed=1, epoch=2) for r in range(3)]
    consumed = [int(s) for p in old for s in p.order[:k]]
    state = old[0].state(k)
    new = [EpochPlan.resume(state, n_samples=n, rank=r, world_size=2, shuffle=True, drop_last=False)
           for r in range(2)]
    assert all(seen == 0 for _, seen in new) and len({len(p) for p, _ in new}) == 1
    rest = [int(s) for p, _ in new for s in p.order]
    # Every sample once, plus one pad: the 29 not consumed are dealt to 2 ranks as 15 + 15.
    assert set(consumed + rest) == set(range(n)) and len(consumed + rest) == n + 1
    assert len(set(consumed) & set(rest)) == 0
    same = EpochPlan.resume(state, n_samples=n, rank=1, world_size=3, shuffle=True, drop_last=False)
    assert same[1] == k and same[0].order.tolist() == old[1].order.tolist()
    with pytest.raises(ValueError, match="samples"):
        EpochPlan.resume(state, n_samples=n + 1, rank=0, world_size=3, shuffle=True, drop_last=False)


# -- through DataLoaders and a worker ---------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_once_per_epoch_across_2_ranks_x_2_workers(served, num_workers):
    store, opts = served(12)
    ranks = [_dataset(opts, rank=r, world_size=2, seed=7) for r in range(2)]
    got = [_ids(_loader(ds, num_workers)) for ds in ranks]
    assert [len(g) for g in got] == [6, 6]
    assert sorted(got[0] + got[1]) == list(range(12))
    assert got == [[int(s) for s in ds.plan.order] for ds in ranks]  # in plan order
    for ds in ranks:  # next epoch: again once each, in another order
        ds.set_epoch(1)
    again = [_ids(_loader(ds, num_workers)) for ds in ranks]
    assert sorted(again[0] + again[1]) == list(range(12)) and again != got


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_count_gives_equal_ranks(served, drop_last):
    store, opts = served(13)
    got = [_ids(_loader(_dataset(opts, rank=r, world_size=2, drop_last=drop_last), 2)) for r in range(2)]
    if drop_last:
        assert [len(g) for g in got] == [6, 6] and len(set(got[0] + got[1])) == 12
    else:
        assert [len(g) for g in got] == [7, 7] and set(got[0] + got[1]) == set(range(13))


def test_same_seed_and_epoch_same_order_next_epoch_another(served):
    store, opts = served(16)
    a = _ids(_loader(_dataset(opts, seed=1), 2))
    assert a == _ids(_loader(_dataset(opts, seed=1), 0))  # worker count does not change the order
    assert sorted(a) == list(range(16)) and a != list(range(16))
    ds = _dataset(opts, seed=1)
    ds.set_epoch(1)
    b = _ids(_loader(ds, 2))
    assert sorted(b) == list(range(16)) and b != a
    assert _ids(_loader(_dataset(opts, shuffle=False), 0)) == list(range(16))


@pytest.mark.parametrize("workers_before,workers_after,stop_after", [(2, 0, 2), (0, 2, 3), (2, 2, 1)])
def test_resume_yields_exactly_the_samples_not_yet_seen(served, workers_before, workers_after, stop_after):
    store, opts = served(20)
    ds = _dataset(opts, seed=4, rank=1, world_size=2)
    ds.set_epoch(3)
    seen: list[int] = []
    for step, batch in enumerate(ds.track(_loader(ds, workers_before))):
        seen += [_sample_id(t) for t in batch]
        if step + 1 == stop_after:
            state = ds.state_dict()
            break
    assert state["samples_seen"] == len(seen) == 3 * stop_after
    state = json.loads(json.dumps(state))  # a checkpoint is plain data
    fresh = _dataset(opts, seed=0, rank=1, world_size=2)  # the seed comes from the state
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # the usual loop calls this at the start of the epoch: keeps the resume point
    rest = []
    for batch in fresh.track(_loader(fresh, workers_after)):
        rest += [_sample_id(t) for t in batch]
    assert seen + rest == [int(s) for s in ds.plan.order]
    assert fresh.state_dict()["samples_seen"] == len(fresh) == 10


def test_resume_with_another_world_size(served):
    store, opts = served(20)
    old = [_dataset(opts, rank=r, world_size=2) for r in range(2)]
    seen = []
    for ds in old:  # both ranks consume 2 batches of 3 (DDP's lock step)
        for step, batch in enumerate(ds.track(_loader(ds, 0))):
            seen += [_sample_id(t) for t in batch]
            if step == 1:
                break
    state = old[0].state_dict()
    solo = _dataset(opts, rank=0, world_size=1)
    solo.load_state_dict(state)
    rest = _ids(_loader(solo, 2))
    assert len(rest) == 20 - 12 and sorted(seen + rest) == list(range(20))


def _with_prefetch_peak(t: torch.Tensor):
    return _sample_id(t), get_worker_info().dataset.prefetcher.stats["max_in_flight_bytes"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prefetch_stays_within_its_byte_bound(served, num_workers):
    sizes = [300_000 if i % 5 == 0 else 2_000 + 9_000 * (i % 7) for i in range(30)]
    sizes[11] = 1_500_000  # alone larger than the bound: read on demand, never prefetched
    store, opts = served(30, size=lambda i: sizes[i])
    bound = 400_000
    kw = dict(prefetch_bytes=bound, prefetch_depth=8, seed=2)
    if num_workers == 0:
        ds = _dataset(opts, **kw)
        got = []
        for pos in ds.sampler():
            t = ds[pos]
            assert bytes(t.numpy()) == store.objects[f"train/{_sample_id(t):05d}.bin"]
            got.append(_sample_id(t))
            assert ds.prefetcher.in_flight_bytes <= bound
        stats = ds.prefetcher.stats
        assert stats["max_in_flight_bytes"] <= bound
        assert stats["hits"] > 0 and stats["max_in_flight"] > 1  # it did prefetch, several at once
        assert stats["too_large"] == 1
        peaks = [stats["max_in_flight_bytes"]]
    else:
        # Batches read through the prefetcher when the worker is on another host (here: the lean
        # path off); on the worker's host a batch is filled by the worker and read from its pages.
        ds = _dataset({**opts, "short_circuit": False}, transform=_with_prefetch_peak, **kw)
        items = [item for batch in _loader(ds, num_workers, batch_size=4) for item in batch]
        got, peaks = [i for i, _ in items], [p for _, p in items]
    assert sorted(got) == list(range(30))
    assert 0 < max(peaks) <= bound


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_broken_sample_fails_clearly_naming_it(served, num_workers, monkeypatch):
    import torch.utils.data._utils as loader_utils

    # torch joins the workers of a DataLoader that raised for MP_STATUS_CHECK_INTERVAL (5 s) each
    # before terminating them (a plain Dataset that raises does the same): keep that short here.
    monkeypatch.setattr(loader_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    store, opts = served(8)
    good = [f"cachefs://data/train/{i:05d}.bin" for i in range(8)]
    paths = good[:5] + ["cachefs://data/train/missing.bin"] + good[5:]
    ds = CacheDataset(paths, sizes=[1000] * 9, storage_options=opts, shuffle=False, prefetch_depth=4)
    it = iter(_loader(ds, num_workers, batch_size=2))
    with pytest.raises(Exception, match=r"sample 5 'cachefs://data/train/missing\.bin'") as err:
        _ids(it)
    if num_workers == 0:
        assert isinstance(err.value, SampleReadError) and isinstance(err.value.__cause__, FileNotFoundError)
    del it, err
    gc.collect()  # shut the loader's workers down now, under the short interval
    # The samples before it were served: the error is on the sample, not the loader.
    assert [_sample_id(ds[p]) for p in range(5)] == [0, 1, 2, 3, 4]


def test_tensors_are_aligned_writable_and_not_made_by_torch_tensor(served, monkeypatch):
    store, opts = served(4, size=lambda i: 100_000 + i)
    ds = _dataset(opts, shuffle=False)

    def refuse(*a, **k):
        raise AssertionError("torch.tensor(bytes) copies element by element")

    monkeypatch.setattr(torch, "tensor", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer over read-only bytes would warn
        for pos in range(4):
            t = ds[pos]
            assert t.dtype == torch.uint8 and t.data_ptr() % 64 == 0
            assert t.untyped_storage().nbytes() == len(t) == 100_000 + pos  # the payload, nothing more
            t[0] = 1  # writable: it owns its buffer
    assert bytes(to_tensor(b"abc").numpy()) == b"abc" and len(to_tensor(b"")) == 0


def test_pickle_round_trip(served):
    store, opts = served(6)
    ds = _dataset(opts, seed=3, rank=0, world_size=2)
    first = ds[0]  # the filesystem and prefetcher now exist in this process
    ds.advance(1)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._local.peek() is None and ds._local.peek() is not None  # nothing of this process came along
    assert clone.state_dict() == ds.state_dict() and len(clone) == 3
    assert torch.equal(clone[0], first)
    assert [_sample_id(clone[p]) for p in range(3)] == [int(s) for s in ds.plan.order]


def test_pin_memory_works_without_cuda(served):
    store, opts = served(6)
    ds = _dataset(opts, transform=lambda t: t[:64])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no accelerator is found": pinning falls back harmlessly
        batches = list(DataLoader(ds, batch_size=3, sampler=ds.sampler(), num_workers=0, pin_memory=True))
    assert [b.shape for b in batches] == [torch.Size([3, 64])] * 2
    if torch.cuda.is_available():
        assert batches[0].is_pinned()


def test_from_manifest_and_path_list(served, tmp_path):
    store, opts = served(5)
    names = [f"cachefs://data/train/{i:05d}.bin" for i in (3, 1, 4)]
    lines = tmp_path / "m.txt"
    lines.write_text("# a manifest\n" + "\n".join(names) + "\n\n")
    listed = tmp_path / "m.json"
    listed.write_text(json.dumps([{"path": p, "size": len(store.objects[p[15:]])} for p in names]))
    for ds in (CacheDataset.from_manifest(str(lines), storage_options=opts, shuffle=False),
               CacheDataset.from_manifest(str(listed), storage_options=opts, shuffle=False),
               CacheDataset(names, storage_options=opts, shuffle=False)):
        assert ds.paths == names and ds.sizes.tolist() == [len(store.objects[p[15:]]) for p in names]
        assert [_sample_id(ds[p]) for p in range(3)] == [3, 1, 4]
    with pytest.raises(FileNotFoundError):
        CacheDataset.from_prefix("cachefs://data/nothing", storage_options=opts)


def test_over_s3_every_sample_once_across_ranks(s3_store, make_worker):
    for i in range(10):
        s3_store.add(f"train/{i:05d}.bin", _sample(i, 3000 + i))
    worker = make_worker(s3_store.mount, page_size=PAGE)
    opts = {"workers": worker.address}
    got = []
    for r in range(2):
        ds = _dataset(opts, rank=r, world_size=2, seed=9)
        for t in [t for batch in _loader(ds, 2, batch_size=2) for t in batch]:
            assert bytes(t.numpy()) == s3_store.objects[f"train/{_sample_id(t):05d}.bin"]
            got.append(_sample_id(t))
    assert sorted(got) == list(range(10))
    assert np.unique(got).size == 10


def test_hints_cache_the_samples_after_the_prefetch_window(served):
    store, opts = served(80)
    ds = _dataset(opts, rank=0, world_size=1, prefetch_depth=2, hint_samples=30, seed=4, plan_ahead=False)
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(opts["workers"]))

    def cached(positions):
        paths = [ds.paths[ds.plan.sample(p)].removeprefix("cachefs://") for p in positions]
        return list(stub.GetCached(worker_pb2.GetCachedRequest(paths=paths), timeout=10).cached_bytes)

    ds[0]  # reads position 0, prefetches 1-2, hints 3-32
    hinted = range(3, 33)
    assert wait_for(lambda: all(cached(hinted)))
    assert not any(cached(range(33, 80)))  # nothing past the hint window
    assert ds.hinter.stats["paths"] == 30 and ds.hinter.stats["failed"] == 0


def test_an_object_that_changed_size_since_listing_is_read_whole(local_store, make_worker):
    for i in range(3):
        local_store.add(f"train/{i:05d}.bin", _sample(i, 1000))
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=0.0, list_ttl=0.0)
    store, opts = local_store, {"workers": worker.address}
    ds = _dataset(opts, shuffle=False, rank=0, world_size=1)
    store.add("train/00001.bin", b"s00001|grown" * 1000)
    got = ds.read(1)
    assert bytes(got.numpy()) == b"s00001|grown" * 1000


def test_nothing_is_in_flight_when_the_process_forks(served):
    """Forking while gRPC completes a call for us can kill the child (DataLoader workers fork):
    outstanding hints and prefetches are drained first (os.register_at_fork)."""
    import os

    store, opts = served(60)
    ds = _dataset(opts, rank=0, world_size=1, prefetch_depth=8, hint_samples=40)
    ds[0]  # leaves prefetches and a hint in flight
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert ds.hinter._in_flight == 0 and ds.prefetcher.in_flight_bytes == 0
    assert len(list(ds.read(i) for i in range(3))) == 3  # and the parent goes on reading


def test_a_dropped_dataset_is_collected_and_its_threads_end(served):
    """Nothing a dataset starts keeps it alive: once the training script drops it (a new one per
    run, a notebook cell run again), its read plan's renewer and its prefetch threads end."""
    import threading
    import weakref

    _, opts = served(40)

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith(("cachefs-plan-renew", "cachefs-prefetch-"))]

    before = set(ours())
    refs = []
    for seed in range(2):
        ds = _dataset(opts, rank=0, world_size=1, seed=seed)
        assert ds.plan_report is not None and ds.plan_report.workers == 1  # a plan registered: a renewer runs
        for i in range(10):
            ds[i]  # prefetch threads started
        assert set(ours()) - before
        refs.append(weakref.ref(ds))
        del ds
    # Prefetches still in flight hold their dataset until they finish (each within its timeout):
    # on a busy machine that takes a while.
    assert wait_for(lambda: gc.collect() is not None and all(r() is None for r in refs), timeout=60, interval=0.2)
    assert wait_for(lambda: not set(ours()) - before, timeout=60), [t.name for t in set(ours()) - before]
