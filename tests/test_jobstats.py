"""ds.stats(): client counters of DataLoader worker processes summed in the main process, over
real workers and real DataLoader processes (fork; spawn for one), accumulating over epochs."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from torch.utils.data import DataLoader

from cachefs import StepTimer
from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.stats.jobstats import COLUMNS, CounterBlock, describe
from cachefs.client.datasets.shards import write_tar_shards
from helpers import payload

PAGE = 64 << 10
TIMEOUT = 60


def _as_list(batch):
    return batch


@pytest.fixture
def served(local_store, make_worker):
    def make(n: int):
        sizes = [1000 + 37 * i for i in range(n)]
        for i, size in enumerate(sizes):
            local_store.add(f"train/{i:05d}.bin", payload(size, i))
        worker = make_worker(local_store.mount, page_size=PAGE)
        return sizes, {"workers": worker.address}
    return make


def _rows(ds) -> np.ndarray:
    return ds._counters._local.get().array


def test_counter_block_sums_rows_accumulates_per_row_and_pickles_as_its_path():
    block = CounterBlock(rows=3)
    values = [0] * len(COLUMNS)
    values[COLUMNS.index("samples")], values[COLUMNS.index("max_prefetch_in_flight_bytes")] = 5, 100
    block.publish(1, values)
    copy = pickle.loads(pickle.dumps(block))
    assert copy.path == block.path and copy.totals()["samples"] == 5
    # another process's (here: another mapping's) first write to row 1 adds to what is there
    values[COLUMNS.index("samples")], values[COLUMNS.index("max_prefetch_in_flight_bytes")] = 2, 40
    copy.publish(1, values)
    copy.publish(1, values)  # running totals: published again, not added again
    copy.publish(2, values)
    totals = block.totals()
    assert totals["samples"] == 5 + 2 + 2 and totals["max_prefetch_in_flight_bytes"] == 100
    block.publish(7, values)  # beyond the rows: ignored, no error
    assert describe(block.totals())["samples"] == 9


def test_no_place_for_the_block_turns_counters_off_not_the_dataset(monkeypatch, tmp_path):
    monkeypatch.setattr("cachefs.client.stats.jobstats._shm_dir", lambda: str(tmp_path / "missing"))
    block = CounterBlock(rows=2)
    block.publish(1, [1] * len(COLUMNS))
    assert block.path == "" and set(block.totals().values()) == {0}


def test_map_dataset_stats_sum_two_fork_workers_over_two_epochs(served):
    sizes, opts = served(24)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, rank=0, world_size=1, seed=3)
    loader = DataLoader(ds, batch_size=3, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                        timeout=TIMEOUT, multiprocessing_context="fork")
    timer = StepTimer()
    before = 0
    for epoch in range(2):  # non-persistent workers: new processes for the second epoch
        ds.set_epoch(epoch)
        got = [len(t) for batch in timer(ds.track(loader)) for t in batch]
        assert sorted(got) == sorted(sizes)
        stats = ds.stats()
        assert stats["samples"] == 24 * (epoch + 1)
        if epoch == 0:  # cold: a prefetched read that is dropped may be read again
            assert stats["bytes"] >= sum(sizes)
        else:  # warm: every sample once, through page handles held in the DataLoader workers
            assert stats["bytes"] - before == stats["held_bytes"] - held_before == sum(sizes)
        before, held_before = stats["bytes"], stats["held_bytes"]
        rows = _rows(ds)
        assert rows[1, 0] > 0 and rows[2, 0] > 0 and rows[0, 0] == 0  # both workers read; main did not
    stats = ds.stats()
    print(stats)
    print(timer.report())
    # the worker is on this host: everything comes through the short-circuit socket, none via gRPC
    assert stats["short_circuit_bytes"] == stats["bytes"] and stats["grpc_reads"] == stats["store_reads"] == 0
    assert stats["wait_s"] > 0 and timer.summary().steps > 0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_reads_are_counted_by_the_path_they_took_and_exactly(served, context):
    """Forked DataLoader workers never use gRPC (client/forksafe.py): with the short-circuit socket
    off their reads go over the data port; spawned ones may, and with both sockets off they do."""
    sizes, opts = served(10)
    lean = {"short_circuit": False} if context == "fork" else {"short_circuit": False, "data_port": False}
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options={**opts, **lean},
                                  rank=0, world_size=1, prefetch_depth=0, hint_samples=0)
    loader = DataLoader(ds, batch_size=2, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                        timeout=TIMEOUT, multiprocessing_context=context)
    assert sum(len(t) for batch in loader for t in batch) == sum(sizes)
    stats = ds.stats()
    path = "data_port" if context == "fork" else "grpc"
    assert stats["samples"] == 10 and stats[f"{path}_reads"] == 10 and stats[f"{path}_bytes"] == sum(sizes), stats
    other = "grpc" if context == "fork" else "data_port"
    assert stats[f"{other}_reads"] == stats["short_circuit_reads"] == stats["held_reads"] == stats["store_reads"] == 0


def test_iterable_dataset_stats_sum_spawned_workers(local_store, make_worker):
    samples = [(f"train/{i:05d}", {"cls": str(i).encode(), "bin": payload(3000 + 101 * i, i)}) for i in range(24)]
    write_tar_shards(iter(samples), f"{local_store.mount.url}/shards", shard_bytes=40_000)
    opts = {"workers": make_worker(local_store.mount, page_size=PAGE).address}
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, index_cache="")
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_as_list, timeout=TIMEOUT,
                        multiprocessing_context="spawn")
    got = [s for batch in ds.track(loader) for s in batch]
    assert len(got) == 24
    stats = ds.stats()
    fields = sum(len(f["bin"]) + len(f["cls"]) for _, f in samples)
    assert stats["samples"] == 24 and stats["bytes"] >= fields and stats["reads"] > 0
    rows = _rows(ds)
    assert rows[1, 0] > 0 and rows[2, 0] > 0


def test_a_profiler_trace_shows_cachefs_ranges(served):
    import torch

    sizes, opts = served(8)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=4, sampler=ds.sampler(), num_workers=0, collate_fn=_as_list)
    list(loader)  # warm: the next pass reads through held page handles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert sum(len(t) for batch in loader for t in batch) == sum(sizes)
    names = {e.key: e.count for e in prof.key_averages()}
    assert names.get("cachefs.read_batch") == 2 and names.get("cachefs.held_reads", 0) >= 2, sorted(names)
