"""Tar shards without an index: the first epoch reads them as they are indexed (client/datasets/shardscan.py).

The first batch must not wait for every shard's fetch; exactly-once, equal per-rank counts and
resume must hold as with an index: the first epoch is BlockPlan's with the shards in file order
(``ordered``), of which every full round is known from the shards before it.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from torch.utils.data import DataLoader

import cachefs.client.datasets.iterable as iterable_module
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.datasets.sampling import BlockPlan, known_block
from cachefs.client.datasets.shards import write_tar_shards
from helpers import payload, wait_for

PAGE = 64 << 10


def _samples(n: int):
    for i in range(n):
        yield f"train/{i:05d}", {"cls": str(i).encode(), "bin": payload(2000 + 37 * (i % 13), i)}


def _id(sample) -> int:
    return int(bytes(sample["cls"].numpy()))


# -- the plan: what a prefix of the shards tells -------------------------------------------------------
@pytest.mark.parametrize("world,drop_last,shuffle", [(1, False, True), (2, False, True), (3, True, True),
                                                     (2, True, False), (3, False, False)])
def test_every_full_round_is_known_from_the_shards_before_it(world, drop_last, shuffle):
    rng = np.random.default_rng(7)
    for trial in range(20):
        counts = tuple(int(c) for c in rng.integers(0, 40, size=int(rng.integers(1, 9))))
        block = int(rng.integers(1, 9))
        for rank in range(world):
            plan = BlockPlan(counts, block, rank, world, seed=trial, epoch=0, shuffle=shuffle,
                             drop_last=drop_last, ordered=True)
            known = [j for j in range(plan.n_blocks) if (j + 1) * world * block <= sum(counts)]
            for j in known:
                assert list(known_block(j, block, rank, world, trial, 0, shuffle)) == list(plan.block_samples(j))
    # ordered: the shards in file order; the state says so and resume keeps it
    plan = BlockPlan((5, 3, 4), 2, 0, 1, seed=3, epoch=0, shuffle=True, ordered=True)
    assert [int(x) for x in plan.order] == list(range(12))
    state = plan.state(4)
    assert state["ordered"] is True
    again, seen = BlockPlan.resume(state, counts=(5, 3, 4), block=2, rank=0, world_size=1, shuffle=True,
                                   drop_last=False)
    assert again.ordered and seen == 4 and list(again.rank_order()) == list(plan.rank_order())


# -- a real worker -----------------------------------------------------------------------------------------
@pytest.fixture
def unindexed(local_store, make_worker, tmp_path):
    """Tar shards without index.json, one worker, and a kept-index directory of this test's own."""
    def make(n: int, shard_bytes: int = 20_000):
        shards = write_tar_shards(_samples(n), f"{local_store.mount.url}/shards", shard_bytes=shard_bytes)
        os.remove(os.path.join(local_store.mount.url, "shards", "index.json"))
        worker = make_worker(local_store.mount, page_size=PAGE)
        return shards, {"workers": worker.address}
    return make


@pytest.fixture
def gate(monkeypatch):
    """Indexing every shard but the first waits for ``gate.set()``: what is read meanwhile is read
    with only the first shard known."""
    opened = threading.Event()
    real = iterable_module._ShardIndexer.__call__

    def gated(self, path, size):
        if not path.endswith("shard-000000.tar"):
            assert opened.wait(120), "the test never opened the gate"
        return real(self, path, size)

    monkeypatch.setattr(iterable_module._ShardIndexer, "__call__", gated)
    yield opened
    opened.set()


def test_the_first_batch_comes_before_the_other_shards_are_indexed(unindexed, gate, tmp_path):
    shards, opts = unindexed(60)
    assert len(shards) >= 4 and len(shards[0].samples) >= 4
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, index_cache=str(tmp_path / "kept"))
    it = iter(ds)
    first = [next(it) for _ in range(4)]  # one block, while only shard 0 is indexed
    assert ds._scan is not None and ds._scan.known()[0] == 1
    gate.set()
    rest = list(it)
    got = [_id(s) for s in first + rest]
    assert sorted(got) == list(range(60))  # each sample once
    # the order is the ordered first epoch's, as a dataset from the whole index would deal it
    assert [s["__index__"] for s in first + rest] == [int(x) for x in ds.plan.rank_order()]
    assert ds.plan.ordered and len(ds) == 60
    ds.set_epoch(1)  # later epochs shuffle the shards again
    assert not ds.plan.ordered and sorted(_id(s) for s in ds) == list(range(60))


def test_dataloader_workers_and_ranks_read_each_sample_once_while_indexing(unindexed, gate, tmp_path):
    shards, opts = unindexed(77, shard_bytes=40_000)  # a rank's first block (8 samples) within shard 0
    assert len(shards[0].samples) >= 8 and len(shards) >= 3
    kept = str(tmp_path / "kept")
    per_rank = []
    for rank in range(2):
        ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                              rank=rank, world_size=2, index_cache=kept)
        loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b, timeout=120,
                            multiprocessing_context="fork")
        batches = iter(ds.track(loader))
        first = next(batches)  # from a DataLoader worker, with one shard indexed
        if rank == 0:
            assert ds._scan is not None and not ds._scan.done
            gate.set()
        ids = [_id(s) for s in first] + [_id(s) for batch in batches for s in batch]
        per_rank.append(ids)
        assert ds.samples_seen == len(ids) == len(ds.plan)
    assert len(per_rank[0]) == len(per_rank[1]) == 39  # 77 padded to 78: equal counts
    together = per_rank[0] + per_rank[1]
    assert set(together) == set(range(77)) and len(together) == 78  # once each, one repeated to pad


def test_a_state_saved_in_the_first_epoch_resumes_exactly(unindexed, gate, tmp_path):
    shards, opts = unindexed(50, shard_bytes=80_000)  # two blocks (10 samples) within shard 0
    kept = str(tmp_path / "kept")
    assert len(shards[0].samples) >= 10
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=5,
                                          rank=0, world_size=1, index_cache=kept)
    loader = DataLoader(ds, batch_size=5, num_workers=0, collate_fn=lambda b: b)
    seen: list[int] = []
    for batch in ds.track(loader):
        seen += [_id(s) for s in batch]
        if len(seen) == 10:
            assert ds._scan is not None  # still indexing: counted without waiting
            state = ds.state_dict()  # nor does the state wait for every shard
            assert ds._scan is not None and state["n_samples"] == -1
            gate.set()
            break
    assert state["ordered"] and state["samples_seen"] == 10 and state["n_shards"] == len(shards)
    assert wait_for(lambda: any(f.endswith(".shards") for f in os.listdir(kept)), timeout=30)
    again = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=5,
                                             rank=0, world_size=1, index_cache=kept)
    assert again._scan is None  # the kept index this time
    again.load_state_dict(state)
    rest = [_id(s) for s in again]
    assert sorted(seen + rest) == list(range(50))


def test_a_stateful_dataloader_snapshots_workers_while_indexing(unindexed, gate, tmp_path):
    """torchdata's StatefulDataLoader asks every worker for its state each step: that must not
    wait for every shard, and what it saved resumes exactly."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    shards, opts = unindexed(60, shard_bytes=40_000)
    assert len(shards[0].samples) >= 8
    kept = str(tmp_path / "kept")
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, index_cache=kept)
    loader = stateful.StatefulDataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b, timeout=120,
                                         multiprocessing_context="fork")
    first, state = [], None
    for k, batch in enumerate(loader):
        first += [_id(s) for s in batch]
        if k == 0:
            assert ds._scan is not None and not ds._scan.done  # the first batch while indexing
            gate.set()
        if k == 3:
            state = loader.state_dict()
            break
    del loader
    assert wait_for(lambda: any(f.endswith(".shards") for f in os.listdir(kept)), timeout=30)
    again = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                             rank=0, world_size=1, index_cache=kept)
    loader = stateful.StatefulDataLoader(again, batch_size=4, num_workers=2, collate_fn=lambda b: b, timeout=120,
                                         multiprocessing_context="fork")
    loader.load_state_dict(state)
    rest = [_id(s) for batch in loader for s in batch]
    assert len(first) == 16 and sorted(first + rest) == list(range(60))


def test_a_shard_that_cannot_be_indexed_is_an_error_in_every_process(unindexed, tmp_path, monkeypatch):
    shards, opts = unindexed(40)
    real = iterable_module._ShardIndexer.__call__

    def broken(self, path, size):
        if path.endswith("shard-000001.tar"):
            raise ValueError("not a tar file")
        return real(self, path, size)

    monkeypatch.setattr(iterable_module._ShardIndexer, "__call__", broken)
    kept = str(tmp_path / "kept")
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, index_cache=kept)
    with pytest.raises(OSError, match="shard-000001.tar.*not a tar file"):
        list(ds)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b, timeout=120,
                        multiprocessing_context="fork")
    with pytest.raises(Exception, match="not a tar file"):
        list(loader)
    # The next start scans again and does not take the earlier failure for its own.
    monkeypatch.setattr(iterable_module._ShardIndexer, "__call__", real)
    again = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                             rank=0, world_size=1, index_cache=kept)
    loader = DataLoader(again, batch_size=4, num_workers=2, collate_fn=lambda b: b, timeout=120,
                        multiprocessing_context="fork")
    assert sorted(_id(s) for batch in loader for s in batch) == list(range(40))
