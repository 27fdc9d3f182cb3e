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
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--samples", type=int)
    p.add_argument("--size", type=int, default=256 << 10)
    p.add_argument("--shard-bytes", type=int)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
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
