"""Hits, misses, errors and failovers in ds.stats() equal what happened, over real workers and 2
DataLoader worker processes: the hit or miss of each page is what the worker's reply said
(gRPC ReadChunk, short-circuit RangeReply), and a worker process killed with SIGKILL costs one
failover per DataLoader worker that reads from it (its breaker then keeps it skipped)."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import DataLoader

from cachefs.client.datasets.dataset import CacheDataset
from cachefs.local import worker_process
from helpers import payload, scrape, wait_for

PAGE = 64 << 10
TIMEOUT = 60
N = 16
BATCH = 4


def _as_list(batch):
    return batch


def _samples(store, n: int) -> list[int]:
    sizes = [1000 + 37 * i for i in range(n)]  # each within one page
    for i, size in enumerate(sizes):
        store.add(f"train/{i:05d}.bin", payload(size, i))
    return sizes


def _epoch(ds, loader, epoch: int) -> list[int]:
    ds.set_epoch(epoch)
    return sorted(len(t) for batch in loader for t in batch)


def test_short_circuit_pages_are_misses_when_filled_then_hits(local_store, make_worker):
    sizes = _samples(local_store, N)
    worker = make_worker(local_store.mount, page_size=PAGE)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options={"workers": worker.address},
                                  rank=0, world_size=1, seed=1, hint_samples=0)  # hints would warm pages early
    loader = DataLoader(ds, batch_size=BATCH, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                        timeout=TIMEOUT, multiprocessing_context="fork")
    assert _epoch(ds, loader, 0) == sorted(sizes)
    cold = ds.stats()
    # Every sample's page was fetched by the worker for this job's request (fill): one miss each,
    # read through the page handles it came with.
    assert cold["misses"] == cold["short_circuit_misses"] == cold["held_misses"] == N
    assert cold["hits"] == 0 and cold["grpc_reads"] == cold["failovers"] == cold["errors"] == 0
    assert _epoch(ds, loader, 1) == sorted(sizes)
    warm = ds.stats()
    assert warm["hits"] == warm["short_circuit_hits"] == N and warm["misses"] == N
    assert warm["hit_ratio"] == 0.5 and warm["samples"] == 2 * N
    assert warm["hints_sent"] == warm["hints_answered"] == 0


def _cached_pages(workers) -> int:
    return sum(int(scrape(w.ready["metrics_port"]).get("cachefs_worker_cache_pages", 0)) for w in workers)


def test_hits_misses_and_failovers_after_a_worker_is_killed(local_store, tmp_path: Path):
    """Two worker processes, no short-circuit (the data port serves pages, filling a miss within
    the request), DataLoader workers started by forkserver (gRPC in them is safe). Cold epoch: N
    data-port misses; warm: N data-port hits; then one worker is killed (-9): each DataLoader
    worker that has a sample placed on it fails over once, to the other worker's data port (it
    has not loaded gRPC and keeps off it: forksafe.grpc_avoided; the dead worker's breaker then
    keeps it skipped for longer than a DataLoader worker's 8 reads take), and those samples are
    misses on the other worker, the rest hits."""
    sizes = _samples(local_store, N)
    extra = ["--page-size", str(PAGE)]
    workers = [worker_process({"data": local_store.mount.url}, str(tmp_path / f"cache{i}"), extra=extra,
                              log_path=str(tmp_path / f"w{i}.log")).start() for i in range(2)]
    try:
        opts = {"workers": ",".join(w.address for w in workers), "short_circuit": False}
        ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, rank=0, world_size=1,
                                      seed=2, hint_samples=0, prefetch_depth=0)  # one read per sample
        loader = DataLoader(ds, batch_size=BATCH, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                            timeout=TIMEOUT, multiprocessing_context="forkserver")
        assert _epoch(ds, loader, 0) == sorted(sizes)
        cold = ds.stats()
        assert cold["data_port_misses"] == cold["misses"] == N and cold["hits"] == 0
        assert cold["data_port_reads"] == N and cold["grpc_reads"] == cold["lean_fallbacks"] == 0
        assert cold["failovers"] == cold["errors"] == cold["lean_errors"] == 0
        # What the workers counted: N lookups that were not in their page store (missed, or joined
        # the fetch that brought the object's metadata).
        worker_misses = sum(scrape(w.ready["metrics_port"]).get(f'cachefs_worker_page_reads_total{{outcome="{o}"}}', 0)
                            for w in workers for o in ("miss", "joined"))
        assert worker_misses == N
        assert wait_for(lambda: _cached_pages(workers) == N, timeout=30)  # pages are written behind

        assert _epoch(ds, loader, 1) == sorted(sizes)
        warm = ds.stats()
        assert warm["data_port_hits"] - cold["data_port_hits"] == N and warm["misses"] == N
        assert warm["grpc_reads"] == 0 and warm["failovers"] == 0

        victim = workers[0]
        fs = ds._filesystem(opts)
        placed = {i for i in range(N) if fs.session.candidates(f"data/train/{i:05d}.bin")[0].address == victim.address}
        assert 0 < len(placed) < N
        victim.kill()  # SIGKILL: the real crash
        ds.set_epoch(2)
        # DataLoader worker w reads batches w, w + 2, ...: which of them read a sample of the victim's
        per_worker = [{ds.plan.sample(p) for b in range(w, N // BATCH, 2) for p in range(b * BATCH, (b + 1) * BATCH)}
                      for w in range(2)]
        readers = sum(1 for samples in per_worker if samples & placed)
        assert sorted(len(t) for batch in loader for t in batch) == sorted(sizes)  # no read failed
        after = ds.stats()
        assert after["failovers"] == readers and after["lean_errors"] == readers
        assert after["errors"] == 0
        # Cold on the survivor, every one filled by its data port: the read that failed over too
        # (a DataLoader worker started by forkserver has not loaded gRPC and keeps off it).
        assert after["grpc_reads"] == after["grpc_misses"] == 0
        assert after["data_port_misses"] - warm["data_port_misses"] == len(placed)
        assert after["data_port_hits"] - warm["data_port_hits"] == N - len(placed)
        assert after["hits"] == 2 * N - len(placed) and after["misses"] == N + len(placed)
        assert after["samples"] == 3 * N
    finally:
        for w in workers:
            w.kill()
