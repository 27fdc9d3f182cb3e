"""Tar shards without an index: how long until the first batch, and the first epoch with its set-up.

    .venv/bin/python benchmarks/bench_first_batch.py            # 2,000 x 256 KiB in 64 MiB shards, 2 rounds
    .venv/bin/python benchmarks/bench_first_batch.py --quick    # 400 samples in 16 MiB shards

Moto holds the shards (no ``index.json``); one ``cachefs worker`` process serves them. For each
case the worker's cache is emptied (``Free``), then ``CacheIterableDataset.from_prefix`` makes the
dataset and a DataLoader reads one epoch:

* ``scan_first``: ``index_cache=""``: every shard is indexed before the dataset is made (the way it
  was before client/datasets/shardscan.py, and still the way without a kept-index directory);
* ``on_the_way``: the default: shards are indexed in file order while the first epoch reads them.

Reported per case and DataLoader workers (0, 2): seconds to make the dataset, to the first batch
and to the end of the epoch (all from the ``from_prefix`` call), and items/s over the whole.
Rounds alternate the cases; JSON in benchmarks/results/first-batch-<timestamp>.json.

``--map ROOT``: the map dataset over one object per sample instead (client/datasets/liststream.py):

    .venv/bin/python benchmarks/bench_first_batch.py --map /tmp/cachefs-tree200k --objects 200000
    .venv/bin/python benchmarks/bench_first_batch.py --map /tmp/cachefs-tree1m --objects 1000000

``--objects`` files of 4 KiB under ROOT (benchmarks/bench_listing.py's tree: made once, then
reused), mounted as a local directory by one ``cachefs worker`` process, started afresh (cold
listing, cold cache) for each case. ``CacheDataset.from_prefix`` of the whole tree, then a
DataLoader (batch 32, workers 0) to its first batch, then ``len(ds)``; per case seconds from the
``from_prefix`` call to its return (``made_s``), to the first batch and to ``len`` (exact once the
listing ended). Cases: ``order_streamed`` (shuffle=False, the default ``stream=True``; keeps the
index), ``order_waited`` (shuffle=False, ``stream=False``: the way before), ``shuffled``
(shuffle=True: waits for the listing), ``order_kept`` and ``shuffled_kept`` (``kept_index="auto"``
with the index the first case kept). The read plan's registration with the worker (a thread) and
the kept cases' background recheck are waited for after each case, outside its times.
JSON in benchmarks/results/first-batch-map-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

import grpc  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from cachefs.client.datasets.iterable import CacheIterableDataset  # noqa: E402
from cachefs.client.datasets.shards import write_tar_shards  # noqa: E402
from cachefs.local import toml_value, worker_process  # noqa: E402
from cachefs.proto import worker_pb2, worker_pb2_grpc  # noqa: E402
from cachefs.testing import MotoServer, fake_s3_client  # noqa: E402

BUCKET, MOUNT = "bench-bucket", "data"


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def one_epoch(address: str, index_cache: str, workers: int, batch: int) -> dict[str, float]:
    with grpc.insecure_channel(address) as ch:  # cold: nothing of the shards cached
        worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix=f"{MOUNT}/tars/"), timeout=60)
    t0 = time.perf_counter()
    ds = CacheIterableDataset.from_prefix(f"cachefs://{MOUNT}/tars", storage_options={"workers": address},
                                          rank=0, world_size=1, batch_size=batch, index_cache=index_cache)
    made = time.perf_counter() - t0
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_as_list,
                        timeout=300 if workers else 0)
    first, n = None, 0
    for b in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(b)
    total = time.perf_counter() - t0
    return {"made_s": round(made, 3), "first_batch_s": round(first or total, 3), "epoch_s": round(total, 3),
            "items": n, "items_per_s": round(n / total, 1)}


def map_case(root: str, tmp: str, case: str, kept: str, batch: int, port: int) -> dict[str, Any]:
    """One case of ``--map`` against a worker process started for it (cold listing and cache) on
    ``port`` (the same each time: a kept index is named by the cluster's address)."""
    from cachefs.client.datasets.dataset import CacheDataset

    cache = tempfile.mkdtemp(dir=tmp, prefix="cache-")
    worker = worker_process({MOUNT: root}, cache, quota="4GiB", log_path=os.path.join(cache, "w.log"),
                            extra=["--port", str(port)]).start(timeout=60)
    try:
        options = {"shuffle": case.startswith("shuffled"), "stream": case != "order_waited",
                   "kept_index": "auto" if case in ("order_streamed", "order_kept", "shuffled_kept") else None}
        t0 = time.perf_counter()
        ds = CacheDataset.from_prefix(f"cachefs://{MOUNT}/train", storage_options={"workers": worker.address},
                                      rank=0, world_size=1, index_cache=kept, **options)
        made = time.perf_counter() - t0
        for _ in DataLoader(ds, batch_size=batch, sampler=ds.sampler(), collate_fn=_as_list):
            break
        first = time.perf_counter() - t0
        n = len(ds)
        exact = time.perf_counter() - t0
        ds.plan_report  # noqa: B018 - the read plan's registration (a thread): not into the next case
        if ds.index_check is not None:  # nor the kept cases' recheck
            ds.index_check.result(timeout=600)
        row = {"case": case, "made_s": round(made, 3), "first_batch_s": round(first, 3), "len_s": round(exact, 3),
               "len": n}
        # Its plan's renewer stops before the next case: it would send the whole index again to
        # the next worker (the same port, not knowing the plan), seconds of this process's CPU at
        # 1 M. (The dataset itself outlives the case: its prefetch threads hold it.)
        if ds._publisher is not None:
            ds._publisher.close()
        return row
    finally:
        worker.stop()


def map_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, HERE)
    from bench_listing import make_tree

    made = make_tree(args.map, args.objects)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-first-batch-map-") as tmp:
        for r in range(args.rounds):
            kept = os.path.join(tmp, f"kept-{r}")  # the first case keeps, the kept cases read it
            for case in args.cases.split(","):
                row = {"round": r, **map_case(args.map, tmp, case, kept, args.batch_size, port)}
                assert row["len"] == args.objects, row
                runs.append(row)
                print(json.dumps(row), flush=True)
    cases = dict.fromkeys(r["case"] for r in runs)
    summary = {c: {k: [r[k] for r in runs if r["case"] == c] for k in ("made_s", "first_batch_s", "len_s")}
               for c in cases}
    doc = {"benchmark": "first_batch_map", "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "objects": args.objects, "size": 4096, "tree_made_s": round(made, 1),
           "runs": runs, "summary": summary, "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"first-batch-map-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--samples", type=int)
    p.add_argument("--size", type=int, default=256 << 10)
    p.add_argument("--shard-bytes", type=int)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--map", metavar="ROOT", help="the map dataset over a tree of 4 KiB files made under ROOT")
    p.add_argument("--objects", type=int, default=200_000, help="--map: files in the tree")
    p.add_argument("--cases", default="order_streamed,order_kept,shuffled_kept,shuffled,order_waited",
                   help="--map: the cases to run, in this order (the kept ones need order_streamed first)")
    args = p.parse_args(argv)
    if args.map:
        return map_main(args)
    n = args.samples or (400 if args.quick else 2000)
    shard_bytes = args.shard_bytes or ((16 if args.quick else 64) << 20)
    runs: list[dict[str, Any]] = []
    with MotoServer() as moto, tempfile.TemporaryDirectory(prefix="bench-first-batch-") as tmp:
        client = fake_s3_client(moto.endpoint_url)
        client.create_bucket(Bucket=BUCKET)
        so = {"endpoint_url": moto.endpoint_url, "key": "testing", "secret": "testing",
              "client_kwargs": {"region_name": "us-east-1"}}
        payload = os.urandom(args.size)
        shards = write_tar_shards(((f"s{i:06d}", {"bin": payload}) for i in range(n)), f"s3://{BUCKET}/tars",
                                  shard_bytes=shard_bytes, storage_options=so)
        client.delete_object(Bucket=BUCKET, Key="tars/index.json")
        config = os.path.join(tmp, "worker.toml")
        with open(config, "w") as f:
            f.write(f"[worker]\n\n[mounts.{MOUNT}]\nurl = {toml_value(f's3://{BUCKET}')}\n"
                    f"options = {toml_value(so)}\n")
        worker = worker_process({}, os.path.join(tmp, "cache"), quota="8GiB", log_path=os.path.join(tmp, "w.log"),
                                extra=["--config", config]).start(timeout=60)
        try:
            for r in range(args.rounds):
                for case in ("scan_first", "on_the_way"):
                    for workers in (0, 2):
                        kept = "" if case == "scan_first" else os.path.join(tmp, f"kept-{r}-{workers}")
                        row = {"case": case, "num_workers": workers, "round": r,
                               **one_epoch(worker.address, kept, workers, args.batch_size)}
                        runs.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            worker.stop()
    summary: dict[str, Any] = {}
    for case in ("scan_first", "on_the_way"):
        for workers in (0, 2):
            rows = [r for r in runs if r["case"] == case and r["num_workers"] == workers]
            summary[f"{case} workers={workers}"] = {k: [r[k] for r in rows] for k in
                                                    ("first_batch_s", "epoch_s", "items_per_s")}
    doc = {"benchmark": "first_batch", "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "samples": n, "size": args.size, "shards": len(shards),
           "shard_bytes": shard_bytes, "runs": runs, "summary": summary, "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"first-batch-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    for target in (path, os.path.join(args.out, "latest-first-batch.json")):
        with open(target, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
