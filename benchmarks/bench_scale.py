"""Read plans at scale (#46): ``set_epoch`` time and the worker's plan memory at 100 k and 1 M samples.

    .venv/bin/python benchmarks/bench_scale.py                    # 100k and 1M samples, 4 ranks
    .venv/bin/python benchmarks/bench_scale.py --explicit         # and the plan sent sample by sample at 100k

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
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

from cachefs.client.dataset import CacheDataset  # noqa: E402
from cachefs.client.plans import PlanPublisher  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--explicit", action="store_true",
                        help="also time the sample-by-sample plan (1 rank), at sizes up to --explicit-max")
    parser.add_argument("--explicit-max", type=int, default=100_000)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    result: dict[str, object] = {"benchmark": "scale", "machine": machine_info(),
                                 "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            row = measure(n, args.ranks, Path(tmp))
            row.pop("worker_plans", None)
            result["rows"].append(row)  # type: ignore[union-attr]
            print(json.dumps(row), flush=True)
            if args.explicit and n <= args.explicit_max:
                row = {"explicit": True, **measure_explicit(n, Path(tmp))}
                result["rows"].append(row)  # type: ignore[union-attr]
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"scale-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
