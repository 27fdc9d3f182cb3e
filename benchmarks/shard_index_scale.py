"""#46: the tar-shard index at scale (``bench_scale.py --shard-index --sizes 1000000,100000000``).

A synthetic shard index of ``n`` samples (client/datasets/shardtable.py), made column by column
with numpy (no ``ShardIndex`` objects: at 100 M they would not fit) and kept as a kept index is
(indexcache.py, ``<key>.shards``), in one process; then, in a fresh process per size:

* ``load_s``, ``load_rss_bytes``: ``IndexCache.load`` (mapping the kept file) and the RSS it added;
* ``dataset_s``: a ``CacheIterableDataset`` made on it (its shard counts and first epoch's
  BlockPlan; no cluster: nothing is read), and ``main_bytes_per_sample``: (USS after, minus USS
  before the load) / samples: what the index costs this process privately (the table's pages are
  the kept file's, shared);
* ``order_s``: ``set_epoch(1)`` and one rank's whole order for it (``plan.rank_order()``: the
  shard permutation, every block's shuffle), rank 0 of 8, blocks of 256;
* ``worker_private_bytes_per_sample_fork``/``_spawn``: each of 2 DataLoader workers (fork,
  spawn) works out every block of its share of rank 0's epoch as a read does (``_block_runs``:
  the samples' shards and byte spans, the runs to read) and the key and fields of each block's
  first sample; its USS (Private_Clean + Private_Dirty, ``/proc/self/smaps``) after, outside the
  table's own mapping, less a worker's doing the same over a 10,000-sample index, / the samples
  of the whole index. The table's pages (the kept file's page cache, or the memfd) are shared by
  every process that maps them: ``worker_table_rss_bytes`` is what each worker touched of them
  (its share's pages), ``worker_uss_bytes`` its whole USS, which counts a table page private while
  no other process happens to map it.

Shards of 10,000 samples (``shard-<6 digits>.tar``), keys of 9 digits, fields ``jpg`` (110,000
bytes) and ``cls`` (3 bytes) at their tar offsets: ~35 bytes of table a sample.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from cachefs.client.datasets.indexcache import IndexCache
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.datasets.shardtable import build_table

PER_SHARD = 10_000
KEY = "bench"
JPG, CLS = 110_000, 3


def _smaps() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _uss() -> int:
    m = _smaps()
    return m["Private_Clean"] + m["Private_Dirty"]


def _private_outside(marks: tuple[str, ...]) -> tuple[int, int]:
    """(USS outside the mappings named with any of ``marks``, RSS of those mappings). The table's
    pages are page cache or shmem that every process mapping them shares; USS counts them private
    to whichever process alone maps a page at the moment it looks, which says nothing of its cost."""
    uss = table_rss = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = any(m in line for m in marks)
                continue
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                kb = int(parts[1]) * 1024
                if inside and parts[0] == "Rss:":
                    table_rss += kb
                elif not inside and parts[0] in ("Private_Clean:", "Private_Dirty:"):
                    uss += kb
    return uss, table_rss


MARKS = (".shards", "cachefs-shard-table")


def make(n: int, directory: str) -> dict[str, Any]:
    """Write the synthetic kept index of ``n`` samples into ``directory``; its size and time."""
    t0 = time.perf_counter()
    S = -(-n // PER_SHARD)
    counts = np.full(S, PER_SHARD, dtype=np.int64)
    counts[-1] = n - PER_SHARD * (S - 1)
    shard_at = np.concatenate([[0], np.cumsum(counts)])
    paths = b"".join(f"cachefs://data/shards/shard-{s:06d}.tar".encode() for s in range(S))
    path_at = np.arange(S + 1, dtype=np.int64) * len(b"cachefs://data/shards/shard-000000.tar")
    stride = 512 + -(-JPG // 512) * 512 + 512 + 512  # header, jpg, header, cls (padded)
    keys = np.empty(9 * n, dtype=np.uint8)
    off = np.empty(2 * n, dtype=np.uint32)
    for lo in range(0, n, 10_000_000):  # a chunk's digits at a time: 9 int64 a sample otherwise
        ids = np.arange(lo, min(n, lo + 10_000_000), dtype=np.int64)
        digits = (ids[:, None] // 10 ** np.arange(8, -1, -1, dtype=np.int64)) % 10 + 48
        keys[9 * lo:9 * (lo + len(ids))] = digits.astype(np.uint8).ravel()
        local = (ids - shard_at[np.searchsorted(shard_at, ids, "right") - 1]) * stride
        off[2 * lo:2 * (lo + len(ids)):2] = local + 512
        off[2 * lo + 1:2 * (lo + len(ids)):2] = local + 512 + -(-JPG // 512) * 512 + 512
        del ids, digits, local
    key_at = np.arange(n + 1, dtype=np.uint64).astype(np.uint32) * 9 if 9 * n < 1 << 32 else np.arange(n + 1) * 9
    field_at = (np.arange(n + 1, dtype=np.int64) * 2).astype(np.uint32 if 2 * n < 1 << 32 else np.int64)
    name = np.tile(np.array([0, 1], dtype=np.uint8), n)
    size = np.tile(np.array([JPG, CLS], dtype=np.uint32), n)
    shard_size = counts * stride + 1024
    table = build_table(["jpg", "cls"], paths, path_at, shard_size, shard_at, keys, key_at, field_at, name, off,
                        size)
    del keys, off, key_at, field_at, name, size
    built = time.perf_counter() - t0
    IndexCache(directory).save(KEY, table, "tar")
    return {"make_s": round(built, 2), "write_s": round(time.perf_counter() - t0 - built, 2),
            "table_bytes": table.nbytes, "table_bytes_per_sample": round(table.nbytes / n, 1)}


class _Touch(IterableDataset):
    """A DataLoader worker's share of rank 0's epoch worked out as a read does; then its USS."""

    def __init__(self, ds: CacheIterableDataset) -> None:
        self.ds = ds

    def __iter__(self):
        info = get_worker_info()
        ds = self.ds
        blocks = ds.plan.worker_blocks(info.id, info.num_workers)
        samples = 0
        for j in blocks:
            ids, shards, where, lo, runs = ds._block_runs(j)
            shards.key(ids[0]), shards.fields(ids[0])
            samples += len(ids)
        gc.collect()
        private, table_rss = _private_outside(MARKS)
        yield {"uss": _uss(), "private": private, "table_rss": table_rss, "samples": samples}


def _worker_uss(ds: CacheIterableDataset, method: str) -> list[dict[str, int]]:
    loader = DataLoader(_Touch(ds), batch_size=None, num_workers=2, multiprocessing_context=method)
    return list(loader)


def _dataset(table: Any) -> CacheIterableDataset:
    return CacheIterableDataset(table, storage_options={"workers": "127.0.0.1:9", "bootstrap": None},
                                batch_size=256, rank=0, world_size=8, seed=1, plan_ahead=False, stats=False,
                                hint_shards=0)


def measure(n: int, directory: str) -> dict[str, Any]:
    """In a fresh process: load the kept index of ``n`` samples written by ``make``."""
    gc.collect()
    uss0, rss0 = _uss(), _smaps()["Rss"]
    t0 = time.perf_counter()
    table = IndexCache(directory).load(KEY)
    load_s = time.perf_counter() - t0
    rss_load = _smaps()["Rss"] - rss0
    assert table is not None and table.n_samples == n, table
    t0 = time.perf_counter()
    ds = _dataset(table)
    dataset_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ds.set_epoch(1)
    order = ds.plan.rank_order()
    order_s = time.perf_counter() - t0
    del order
    gc.collect()
    main = _uss() - uss0
    row: dict[str, Any] = {"samples": n, "load_s": round(load_s, 3), "load_rss_bytes": rss_load,
                           "dataset_s": round(dataset_s, 2), "order_s": round(order_s, 2),
                           "main_bytes_per_sample": round(main / n, 1), "main_rss_bytes": _smaps()["Rss"] - rss0}
    for method in ("fork", "spawn"):
        got = _worker_uss(ds, method)
        row[f"worker_uss_bytes_{method}"] = [g["uss"] for g in got]
        row[f"worker_private_bytes_{method}"] = [g["private"] for g in got]
        row[f"worker_table_rss_bytes_{method}"] = [g["table_rss"] for g in got]
        row[f"worker_samples_{method}"] = [g["samples"] for g in got]
    return row


def run(sizes: list[int], directory: str | None = None) -> list[dict[str, Any]]:
    """Each size made in one fresh process and measured in another; rows as JSON."""
    rows = []
    here = os.path.abspath(__file__)
    for n in [10_000] + sizes:
        with tempfile.TemporaryDirectory(dir=directory, prefix="shard-index-") as tmp:
            made = json.loads(subprocess.run([sys.executable, here, "make", str(n), tmp], check=True,
                                             capture_output=True, text=True).stdout.splitlines()[-1])
            row = json.loads(subprocess.run([sys.executable, here, "measure", str(n), tmp], check=True,
                                            capture_output=True, text=True).stdout.splitlines()[-1])
        row.update(made)
        if n == 10_000:
            base = row
            continue
        for method in ("fork", "spawn"):
            extra = max(row[f"worker_private_bytes_{method}"]) - max(base[f"worker_private_bytes_{method}"])
            row[f"worker_private_bytes_per_sample_{method}"] = round(extra / n, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    what, n, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(json.dumps(make(n, where) if what == "make" else measure(n, where)))
