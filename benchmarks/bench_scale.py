"""Read plans at scale (#46): ``set_epoch`` time and the worker's plan memory at 100 k and 1 M samples.

    .venv/bin/python benchmarks/bench_scale.py                    # 100k and 1M samples, 4 ranks
    .venv/bin/python benchmarks/bench_scale.py --explicit         # and the plan sent sample by sample at 100k
    .venv/bin/python benchmarks/bench_scale.py --index --sizes 1000000   # the data set's index (below)
    .venv/bin/python benchmarks/bench_scale.py --shard-index --sizes 1000000,100000000   # #46, the tar-shard index
    .venv/bin/python benchmarks/bench_scale.py --metadata --sizes 1000000,10000000   # #47, the worker's metadata
    .venv/bin/python benchmarks/bench_scale.py --cold-small --objects 100000   # #47, cold 4 KiB objects (cold_small.py)
    .venv/bin/python benchmarks/bench_scale.py --warm-epoch --objects 1000000 --dir /tmp/cachefs-tree1m   # #46 (warm_scale.py)

A real worker (in this process, an empty local mount: no object is read) and ``--ranks``
CacheDatasets over a synthetic index (``cachefs://data/train/<i>.jpg``, sizes given, 110 KB each:
nothing is listed or created), each rank registering its read plan with the worker as a training
job does. Measured, per size:

* ``construct_s``: each rank's construction (the first sends the index, once; the others find it);
* ``set_epoch_s``: ``ds.set_epoch(1)`` per rank (the plan for this epoch and the next, registered);
* ``plan_bytes``: the worker's memory for the plans of all ranks (epoch 1's, after epoch 0's), by
  tracemalloc (allocations made under server/worker/plans.py or planindex.py, after a gc): the
  ranks' requests, made by the real publisher, are recorded and then taken by a fresh plan table
  under tracing (``plan_peak_mb``: the peak while it takes them); ``plan_array_bytes``:
  the arrays and paths the worker keeps (``PlanTable.derived_bytes``).

``--explicit`` also times the plan sent sample by sample (the fallback: what set_epoch cost
before) for one rank, at sizes up to ``--explicit-max`` (100 k: 1 M takes minutes). Writes benchmarks/results/scale-<timestamp>.json and prints it.

``--index`` measures the data set's index instead (client/datasets/sampleindex.py), each size in a fresh
process (``--index-one``), a worker in another (an empty mount: nothing is read), keys
``cachefs://data/train/<dir of 1,000>/<7 digits>.jpg`` (27-byte names, as the issue's):

* ``main_bytes_per_sample``: (RSS after making the dataset and touching every path and size,
  minus RSS before) / samples, from ``/proc/self/smaps_rollup`` (the memfd's pages are in RSS);
  ``main_plan_bytes_per_sample``: the same for a second dataset that also publishes its read plan
  (the publisher's per-worker index parts: plans.py);
* ``worker_uss_bytes_per_sample``: each DataLoader worker's USS (Private_Clean + Private_Dirty)
  after it touched the path and size of every sample of its share, minus the USS of a worker of
  a 1,000-sample dataset doing the same, / samples; with ``fork`` and ``spawn`` workers
  (``--loader-workers``, default 4); ``_parsed``: the same where each worker also parses each path
  as a read does (``_cache_path``);
* ``kept_load_s``: mapping a kept index file (``KeptIndexes.load``), and ``kept_scan_s`` reading
  every path of it once; ``kept_start_s``: ``from_prefix(kept_index="auto")``, the dataset made
  from it (no listing; plan_ahead off).

``--metadata`` (#47) measures the worker's object-metadata table instead, each size in a fresh
process (``--metadata-one``): an ObjectStore over cachefs.testing's synthetic store (``size``
objects of 4 KiB, 1,000 a directory, ``d<5 digits>/<8 digits>.bin``: 12-byte names, versions the
store's size and mtime, as a local mount's), every directory listed from the store and each
entry remembered as a listing does (``ObjectStore._listed``; the listing cache is left out):

* ``rss_bytes_per_object``: (RSS after, minus before) / objects, ``/proc/self/smaps_rollup``;
  ``table_bytes_per_object``: what the table allocated (``MetadataTable.memory_bytes``);
* ``store_requests_for_cached``: store requests made by ``info()`` of 10,000 of the objects after
  (0: every one answered from the table);
* ``free_ms``: ``forget_prefix`` of one directory (1,000 objects: what a ``Free`` or ``Remove``
  does to the metadata) while a thread reads another object's metadata in a loop;
  ``read_max_wait_ms``: that reader's longest ``get`` among those overlapping the free
  (``reads_meanwhile`` of them); ``free_many_ms``, ``many_read_max_wait_ms``: the same for a
  prefix of 100 directories (100,000 objects), long enough for the reader to get in between.

``--shard-index`` (#46) measures the tar-shard index instead (client/datasets/shardtable.py): a
synthetic kept index of each size made in one fresh process and loaded in another, its load time
and RSS, one rank's epoch order, and DataLoader workers' USS (benchmarks/shard_index_scale.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from collections.abc import Iterator
from types import SimpleNamespace

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

from cachefs.client.datasets.dataset import CacheDataset  # noqa: E402
from cachefs.client.datasets.plans import PlanPublisher  # noqa: E402
from cachefs.client.datasets.prefixindex import KeptIndexes  # noqa: E402
from cachefs.client.datasets.sampleindex import build  # noqa: E402
from cachefs.config import CacheDirSpec, WorkerConfig  # noqa: E402
from cachefs.mounts import MountSpec  # noqa: E402
from cachefs.proto import worker_pb2  # noqa: E402
from cachefs.server.worker import Worker  # noqa: E402
from cachefs.server.worker.plans import PlanTable  # noqa: E402

SIZE = 110_000
PAGE = 1 << 20


def _worker(tmp: Path) -> Worker:
    (tmp / "store").mkdir(exist_ok=True)
    cache = Path(tempfile.mkdtemp(dir=tmp, prefix="cache-"))
    config = WorkerConfig(host="127.0.0.1", port=0, page_size=PAGE, cache_dirs=(CacheDirSpec(str(cache), 1 << 30),),
                          mounts=(MountSpec("data", str(tmp / "store")),))
    return Worker(config).start()


def _datasets(worker: Worker, n: int, ranks: int) -> tuple[list[CacheDataset], list[float]]:
    paths = [f"cachefs://data/train/{i:09d}.jpg" for i in range(n)]
    sizes = [SIZE] * n
    out, times = [], []
    for rank in range(ranks):
        t0 = time.perf_counter()
        ds = CacheDataset(paths, sizes=sizes, storage_options={"workers": worker.address}, seed=7, rank=rank,
                          world_size=ranks, hint_samples=0, stats=False)
        times.append(time.perf_counter() - t0)
        out.append(ds)
    return out, times


def measure(n: int, ranks: int, tmp: Path) -> dict[str, object]:
    row: dict[str, object] = {"samples": n, "ranks": ranks}
    # Pass 1: times (no tracing).
    worker = _worker(tmp)
    try:
        sets, construct = _datasets(worker, n, ranks)
        epoch = []
        for ds in sets:
            t0 = time.perf_counter()
            ds.set_epoch(1)
            epoch.append(time.perf_counter() - t0)
        reports = [ds.plan_report for ds in sets]
        row.update(construct_s=[round(t, 3) for t in construct], set_epoch_s=[round(t, 4) for t in epoch],
                   set_epoch_max_s=round(max(epoch), 4),
                   derived=all(r is not None and r.derived == 1 and r.failed == 0 for r in reports),
                   worker_plans=worker.plans.describe())
        for ds in sets:
            ds._publisher.close()  # type: ignore[union-attr]
        del sets
    finally:
        worker.stop(grace=0.5)
    # Pass 2: the worker's memory for the plans. The same ranks' requests (the real publisher's,
    # answered by a plan table in this process, no gRPC) are recorded, then taken by a fresh table
    # under tracemalloc (every frame: what plans.py and planindex.py allocate, numpy included).
    recorded: list[bytes] = []
    answering = PlanTable(PAGE)

    class Stub:
        def Plan(self, request, timeout=None):  # noqa: N802 - the RPC's name
            recorded.append(request.SerializeToString())
            known, index_known, derived = answering.take(request)
            return worker_pb2.PlanReply(known=known, index_known=index_known, derived=derived, policy="future")

    handle = SimpleNamespace(address="bench", stub=Stub)
    session = SimpleNamespace(candidates=lambda key, offset=0, include_broken=True: [handle])
    worker = _worker(tmp)
    try:
        paths = [f"cachefs://data/train/{i:09d}.jpg" for i in range(n)]
        for rank in range(ranks):
            ds = CacheDataset(paths, sizes=[SIZE] * n, storage_options={"workers": worker.address}, seed=7,
                              rank=rank, world_size=ranks, hint_samples=0, stats=False, plan_ahead=False)
            publisher = PlanPublisher(session, lambda: 0, prefetch=False)
            for epoch in (0, 1):
                ds.set_epoch(epoch)
                publisher.publish_derived(ds._plan_units, ds._plan_order_spec(), ds._plan_order)
            publisher.close()
    finally:
        worker.stop(grace=0.5)
    del answering
    gc.collect()
    tracemalloc.start(32)
    try:
        table = PlanTable(PAGE)
        before = tracemalloc.take_snapshot()
        for raw in recorded:
            table.take(worker_pb2.PlanRequest.FromString(raw))
        gc.collect()
        after = tracemalloc.take_snapshot()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    keep = [tracemalloc.Filter(True, "*server/worker/plan*.py", all_frames=True)]
    plan_bytes = sum(d.size_diff for d in after.filter_traces(keep).compare_to(before.filter_traces(keep), "filename"))
    row.update(plan_bytes=plan_bytes, plan_mb=round(plan_bytes / 1e6, 1), plan_array_bytes=table.derived_bytes(),
               plan_bytes_per_sample=round(plan_bytes / n, 1), plan_peak_mb=round(peak / 1e6, 1),
               plans=len(table), derived_plans=sum(p["derived"] for p in table.describe()))
    return row


def measure_explicit(n: int, tmp: Path) -> dict[str, object]:
    """One rank whose plan is sent sample by sample (a worker that cannot derive it)."""
    worker = _worker(tmp)
    try:
        original = CacheDataset._plan_order_spec
        CacheDataset._plan_order_spec = lambda self: None  # type: ignore[method-assign]
        try:
            (ds,), construct = _datasets(worker, n, 1)
            t0 = time.perf_counter()
            ds.set_epoch(1)
            took = time.perf_counter() - t0
        finally:
            CacheDataset._plan_order_spec = original  # type: ignore[method-assign]
        ds._publisher.close()  # type: ignore[union-attr]
        return {"samples": n, "ranks": 1, "construct_s": round(construct[0], 3), "set_epoch_s": round(took, 3)}
    finally:
        worker.stop(grace=0.5)


def _smaps(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _uss(pid: int | str = "self") -> int:
    m = _smaps(pid)
    return m["Private_Clean"] + m["Private_Dirty"]


def _synthetic(n: int) -> Iterator[str]:
    return (f"cachefs://data/train/{i // 1000:04d}/{i:07d}.jpg" for i in range(n))


def _serve_worker(tmp: str, conn) -> None:  # a spawned process: the worker's memory is not ours
    worker = _worker(Path(tmp))
    conn.send(worker.address)
    conn.recv()
    worker.stop(grace=0.5)


class _Touch(IterableDataset):
    """A DataLoader worker's share of the epoch, each sample's path and size touched (and parsed,
    if asked) as a read would; then the worker's USS."""

    def __init__(self, ds: CacheDataset, parse: bool) -> None:
        self.ds, self.parse = ds, parse

    def __iter__(self):
        info = get_worker_info()
        ds, touched = self.ds, 0
        parts = ds._local.get() if self.parse else None
        for pos in range(info.id, len(ds), info.num_workers):
            s = ds.plan.sample(pos)
            touched += len(ds.paths[s]) + int(ds.sizes[s])
            if parts is not None:
                ds._cache_path(parts, s)
        gc.collect()
        yield {"id": info.id, "uss": _uss(), "touched": touched}


def _worker_uss(ds: CacheDataset, workers: int, context: str, parse: bool) -> list[int]:
    loader = DataLoader(_Touch(ds, parse), batch_size=None, num_workers=workers, timeout=600,
                        multiprocessing_context=multiprocessing.get_context(context))
    return sorted(r["uss"] for r in loader)


def measure_index_one(n: int, loader_workers: int) -> dict[str, object]:
    """One size, in this (fresh) process: see the module doc (``--index``)."""
    import numpy as np

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        here, there = ctx.Pipe()
        server = ctx.Process(target=_serve_worker, args=(tmp, there), daemon=True)
        server.start()
        try:
            if not here.poll(120):
                raise RuntimeError("the worker did not start in 120 s")
            opts = {"workers": here.recv()}
            row: dict[str, object] = {"index": True, "samples": n, "loader_workers": loader_workers}
            common = dict(storage_options=opts, seed=7, hint_samples=0, stats=False)
            gc.collect()
            rss0 = _smaps()["Rss"]
            t0 = time.perf_counter()
            ds = CacheDataset(_synthetic(n), sizes=np.full(n, SIZE, dtype=np.int64), plan_ahead=False, **common)
            row["construct_s"] = round(time.perf_counter() - t0, 2)
            touched = sum(len(p) for p in ds.paths) + int(ds.sizes.sum())
            gc.collect()
            rss1 = _smaps()["Rss"]
            row.update(index_bytes=ds.paths.nbytes, index_bytes_per_sample=round(ds.paths.nbytes / n, 1),
                       main_rss_mb=round((rss1 - rss0) / 1e6, 1), main_bytes_per_sample=round((rss1 - rss0) / n, 1))
            small = CacheDataset(_synthetic(1000), sizes=np.full(1000, SIZE, dtype=np.int64), plan_ahead=False,
                                 **common)
            for context in ("fork", "spawn"):
                for parse in (False, True):
                    base = _worker_uss(small, loader_workers, context, parse)
                    full = _worker_uss(ds, loader_workers, context, parse)
                    key = f"worker_uss_{context}" + ("_parsed" if parse else "")
                    row[key + "_mb"] = [round(u / 1e6, 1) for u in full]
                    row[key + "_base_mb"] = [round(u / 1e6, 1) for u in base]
                    row[key + "_bytes_per_sample"] = round((max(full) - min(base)) / n, 1)
                    print(json.dumps({key: row[key + "_bytes_per_sample"]}), file=sys.stderr, flush=True)
            # The kept index: written once, then mapped as a restart would.
            kept = KeptIndexes(os.path.join(tmp, "kept"))
            url = "cachefs://data/train"
            key = kept.key(url, opts)
            index = build(ds.paths.head, ds.paths.starts[1:], ds.paths.sizes, ds.paths._blob,
                          {"url": url, "listing": {}})
            kept.save(key, index)
            del index
            t0 = time.perf_counter()
            loaded = kept.load(key, url)
            row["kept_load_s"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            assert loaded is not None and sum(len(p) for p in loaded) + int(loaded.sizes.sum()) == touched
            row["kept_scan_s"] = round(time.perf_counter() - t0, 2)
            del loaded
            logging.getLogger("cachefs.client.datasets.prefixindex").setLevel(logging.ERROR)  # its recheck finds nothing
            t0 = time.perf_counter()
            again = CacheDataset.from_prefix(url, kept_index="auto", index_cache=kept.directory, plan_ahead=False,
                                             **common)
            row["kept_start_s"] = round(time.perf_counter() - t0, 3)
            assert len(again) == len(ds)
            del again
            # What a training job holds besides: the read plan's publisher (its index per worker).
            gc.collect()
            rss2 = _smaps()["Rss"]
            t0 = time.perf_counter()
            planned = CacheDataset(ds.paths, plan_ahead=True, **common)
            row["plan_construct_s"] = round(time.perf_counter() - t0, 2)
            gc.collect()
            rss3 = _smaps()["Rss"]
            row.update(main_plan_rss_mb=round((rss3 - rss2) / 1e6, 1),
                       main_plan_bytes_per_sample=round((rss3 - rss2) / n, 1))
            planned._publisher.close()  # type: ignore[union-attr]
            return row
        finally:
            here.send("stop")
            server.join(timeout=30)


def measure_metadata_one(n: int) -> dict[str, object]:
    """#47: the worker's metadata table at ``n`` objects of a synthetic store (see the doc)."""
    import random
    import threading

    import cachefs.testing  # noqa: F401 - registers synthetic://
    from cachefs.mounts import MountTable
    from cachefs.paths import CachePath
    from cachefs.store.objects import ObjectStore

    objects = ObjectStore(MountTable([MountSpec("syn", "synthetic://data", {"count": n, "size": 4096})]),
                          metadata_ttl=3600, list_ttl=0)
    fs = objects.mounts.resolve(CachePath("syn", "")).fs
    gc.collect()
    rss0 = _smaps()["Rss"]
    t0 = time.perf_counter()
    for j in range(-(-n // fs.per_dir)):
        directory = CachePath("syn", f"d{j:05d}")
        objects._listed(directory, fs.ls(f"data/d{j:05d}"), "data/" + directory.key)
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss1 = _smaps()["Rss"]
    table = objects._meta
    table_bytes, charged = table.memory_bytes(), table.charged_bytes()
    asked = sum(fs.requests.values())
    for i in random.Random(1).sample(range(n), 10_000):
        assert objects.info(CachePath("syn", fs.key(i))).size == 4096
    cached_requests = sum(fs.requests.values()) - asked
    probe = CachePath("syn", fs.key(n - 1))
    waits: list[tuple[float, float]] = []  # (start, took)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            s = time.perf_counter()
            table.get(probe)
            waits.append((s, time.perf_counter() - s))

    def free(prefix: str) -> tuple[int, float, list[float]]:
        """(objects freed, seconds, the waits of reads that overlapped it)."""
        before = len(table)
        t0 = time.perf_counter()
        objects.forget_prefix("syn", prefix)
        end = time.perf_counter()
        time.sleep(0.05)
        return before - len(table), end - t0, [took for start, took in list(waits) if start < end and start + took > t0]

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    mid = (n // fs.per_dir) // 2
    freed, free_s, during = free(f"d{mid:05d}/")
    # 100 directories (d<mid+100..mid+199>/, 100,000 objects): long enough for the reader to get in.
    many = f"d{mid + 100:05d}"[:-2] if mid >= 100 else ""
    freed_many, many_s, during_many = free(many) if many else (0, 0.0, [])
    stop.set()
    reader.join(timeout=30)
    return {"metadata": True, "objects": n, "fill_s": round(fill_s, 1),
            "rss_bytes_per_object": round((rss1 - rss0) / n, 1),
            "table_bytes_per_object": round(table_bytes / n, 1), "charged_bytes_per_object": round(charged / n, 1),
            "store_requests_for_cached": cached_requests, "freed": freed,
            "free_ms": round(free_s * 1000, 2), "read_max_wait_ms": round(max(during, default=0) * 1000, 2),
            "reads_meanwhile": len(during), "freed_many": freed_many, "free_many_ms": round(many_s * 1000, 1),
            "many_read_max_wait_ms": round(max(during_many, default=0) * 1000, 2),
            "many_reads_meanwhile": len(during_many)}


def write_result(out: str, prefix: str, result: dict) -> str:
    """``result`` as ``out``/``prefix``-<UTC time>.json; its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{prefix}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def write_row(out: str, benchmark: str, prefix: str, row: dict) -> str:
    """One mode's row with the machine and the time, as ``write_result``; its path."""
    return write_result(out, prefix, {"benchmark": benchmark, "machine": machine_info(), "rows": [row],
                                      "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--explicit", action="store_true",
                        help="also time the sample-by-sample plan (1 rank), at sizes up to --explicit-max")
    parser.add_argument("--explicit-max", type=int, default=100_000)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--index", action="store_true", help="measure the data set's index instead (see the doc)")
    parser.add_argument("--index-one", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shard-index", action="store_true", help="measure the tar-shard index (#46; the doc)")
    parser.add_argument("--loader-workers", type=int, default=4)
    parser.add_argument("--metadata", action="store_true", help="measure the worker's metadata table (#47; the doc)")
    parser.add_argument("--metadata-one", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cold-small", action="store_true",
                        help="a cold epoch of small objects from a local mount against a copy loop (#47; cold_small.py)")
    parser.add_argument("--objects", type=int, default=100_000, help="--cold-small, --warm-epoch, --refresh: how many objects")
    parser.add_argument("--object-bytes", type=int, default=4096, help="--cold-small: each object's size")
    parser.add_argument("--dir", default=None, help="--cold-small: where data, copies and the cache go; "
                        "--warm-epoch: the tree (bench_listing.make_tree's; default /tmp/cachefs-tree-<objects>)")
    parser.add_argument("--warm-epoch", action="store_true",
                        help="warm epochs of 4 KiB objects against the same loop over the local files (#46; warm_scale.py)")
    parser.add_argument("--fill", choices=("load", "epoch"), default="load",
                        help="--warm-epoch: fill the cache by a load job or by a cold epoch")
    parser.add_argument("--rounds", type=int, default=3, help="--warm-epoch: cachefs and local epochs, each")
    parser.add_argument("--persistent-workers", action="store_true",
                        help="--warm-epoch: both loaders with persistent_workers=True (made once)")
    parser.add_argument("--metadata-ttl", type=float, default=None,
                        help="--warm-epoch: the worker's metadata_ttl (shorter than an epoch: every epoch refreshes)")
    parser.add_argument("--refresh", action="store_true",
                        help="the worker's refresh of an unchanged directory by listing, in-process (#46; refresh_scale.py)")
    args = parser.parse_args()
    if args.refresh:
        from refresh_scale import measure as measure_refresh
        row = measure_refresh(args.objects, args.object_bytes)
        path = write_row(args.out, "scale --refresh", "refresh", row)
        print(json.dumps(row))
        print(f"wrote {path}")
        return
    if args.warm_epoch:
        from warm_scale import measure as measure_warm, plot as plot_warm
        row = measure_warm(args.objects, args.dir or f"/tmp/cachefs-tree-{args.objects}", fill=args.fill,
                           rounds=args.rounds, persistent=args.persistent_workers,
                           metadata_ttl=args.metadata_ttl)
        path = write_row(args.out, "scale --warm-epoch", "warm-epoch", row)
        note = plot_warm(row, path[:-5] + ".png")
        print(json.dumps({k: v for k, v in row.items() if k not in ("runs", "before", "after")}))
        print(f"wrote {path}" + (f" ({note})" if note else f" and {path[:-5]}.png"))
        return
    if args.shard_index:
        from shard_index_scale import run as run_shard_index
        result = {"benchmark": "scale-shard-index", "machine": machine_info(),
                  "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "rows": run_shard_index([int(x) for x in args.sizes.split(",")])}
        path = write_result(args.out, "scale-shard-index", result)
        print(f"wrote {path}")
        return
    if args.cold_small:
        from cold_small import measure as measure_cold_small
        row = measure_cold_small(args.objects, args.object_bytes, args.dir)
        path = write_row(args.out, "scale", "scale-cold-small", row)
        print(json.dumps(row))
        print(f"wrote {path}")
        return
    if args.metadata_one:
        print(json.dumps(measure_metadata_one(args.metadata_one)))
        return
    if args.index_one:
        print(json.dumps(measure_index_one(args.index_one, args.loader_workers)))
        return
    result: dict[str, object] = {"benchmark": "scale", "machine": machine_info(),
                                 "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            if args.index or args.metadata:  # each size in a fresh process: its RSS is the index's alone
                one = ["--metadata-one", str(n)] if args.metadata else ["--index-one", str(n)]
                out = subprocess.run([sys.executable, __file__, *one, "--loader-workers",
                                      str(args.loader_workers)], check=True, stdout=subprocess.PIPE, text=True,
                                     timeout=3600).stdout
                row = json.loads(out.strip().splitlines()[-1])
                result["rows"].append(row)  # type: ignore[union-attr]
                print(json.dumps(row), flush=True)
                continue
            row = measure(n, args.ranks, Path(tmp))
            row.pop("worker_plans", None)
            result["rows"].append(row)  # type: ignore[union-attr]
            print(json.dumps(row), flush=True)
            if args.explicit and n <= args.explicit_max:
                row = {"explicit": True, **measure_explicit(n, Path(tmp))}
                result["rows"].append(row)  # type: ignore[union-attr]
                print(json.dumps(row), flush=True)
    path = write_result(args.out, "scale", result)
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
