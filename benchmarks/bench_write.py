#!/usr/bin/env python
"""Checkpoint-write benchmark: ``torch.save`` through cachefs against s3fs direct, same moto store.

    .venv/bin/python benchmarks/bench_write.py                 # 64 MiB checkpoint, 5 rounds
    .venv/bin/python benchmarks/bench_write.py --size 16MiB --rounds 3

One moto S3 server (its own process) and one ``cachefs worker`` process over a bucket of it.
Each round writes the same checkpoint (a dict of float32 tensors) with ``torch.save`` into
``fsspec.open(URL, "wb")`` three ways, in turn, each to a fresh key:

    s3fs          s3://bucket/key, s3fs's own multipart upload (its default block size)
    cachefs       cachefs://bench/key: streamed to the worker's data port, which uploads it with s3fs
    cachefs-grpc  the same over the worker's gRPC Write stream (data_port=False: what a client
                  without the data port, e.g. on TLS, does)
    cachefs-client  the same with write_via="client": the client uploads with s3fs itself and
                  then tells the owning worker to forget the path

``--store local``: the store is a local directory instead (the ``s3fs`` way writes the file
itself, ``cachefs-client`` is left out), so the transport's own cost shows, not moto's.

Every written object is read back with s3fs and compared byte for byte with the serialized
checkpoint; a mismatch makes the run exit 1. Reported: median/min seconds and MB/s per way and
the ratio cachefs / s3fs (lower is better; <= 1.0 meets the "no slower than s3fs" target).
Results: benchmarks/results/write-<timestamp>.json and write-latest.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
MOUNT = "bench"


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def checkpoint(size: int) -> dict[str, Any]:
    import torch

    n_tensors = 8
    per = size // n_tensors // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(per, generator=gen) for i in range(n_tensors)} | {"step": 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64MiB", help="checkpoint size (default 64MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--store", choices=("s3", "local"), default="s3")
    args = parser.parse_args()

    import fsspec
    import torch

    from cachefs.config import parse_size
    from cachefs.local import worker_process
    from cachefs.testing import MotoServer

    size = parse_size(args.size)
    state = checkpoint(size)
    buf = io.BytesIO()
    torch.save(state, buf)
    expected = buf.getvalue()
    results: dict[str, list[float]] = {"s3fs": [], "cachefs": [], "cachefs-grpc": [], "cachefs-client": []}
    failures: list[str] = []
    local = args.store == "local"

    with MotoServer() as moto, tempfile.TemporaryDirectory(prefix="bench-write-") as tmp:
        bucket = moto.new_bucket("bench-write")
        so = moto.storage_options()
        config = os.path.join(tmp, "worker.toml")
        if local:
            bucket = os.path.join(tmp, "store")
            os.makedirs(bucket)
            results.pop("cachefs-client")
        with open(config, "w") as f:
            if local:
                f.write(f"[worker]\n\n[mounts.{MOUNT}]\nurl = {_toml(bucket)}\n")
            else:
                f.write(f"[worker]\n\n[mounts.{MOUNT}]\nurl = {_toml('s3://' + bucket)}\noptions = {_toml(so)}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        worker = worker_process({}, os.path.join(tmp, "cache"), quota="2GiB", env=env,
                                log_path=os.path.join(tmp, "worker.log"), extra=["--config", config])
        with worker:
            s3 = fsspec.filesystem("file") if local else fsspec.filesystem("s3", skip_instance_cache=True, **so)
            ways = {
                "s3fs": (lambda key: fsspec.open(f"{bucket}/{key}", "wb", auto_mkdir=True) if local
                         else fsspec.open(f"s3://{bucket}/{key}", "wb", **so)),
                "cachefs": (lambda key: fsspec.open(f"cachefs://{MOUNT}/{key}", "wb", workers=worker.address)),
                "cachefs-grpc": (lambda key: fsspec.open(f"cachefs://{MOUNT}/{key}", "wb", workers=worker.address,
                                                         data_port=False)),
                "cachefs-client": (lambda key: fsspec.open(
                    f"cachefs://{MOUNT}/{key}", "wb", workers=worker.address, write_via="client",
                    fallback_mounts={MOUNT: {"url": f"s3://{bucket}", "options": so}})),
            }
            # One untimed write each: connections, imports and the worker's s3fs session warm up.
            if local:
                ways.pop("cachefs-client")
            for name, opener in ways.items():
                with opener(f"warmup/{name}.pt") as f:
                    torch.save(state, f)
            for r in range(args.rounds):
                for name, opener in ways.items():
                    key = f"round{r}/{name}.pt"
                    t0 = time.perf_counter()
                    with opener(key) as f:
                        torch.save(state, f)
                    results[name].append(time.perf_counter() - t0)
                    s3.invalidate_cache()
                    if s3.cat_file(f"{bucket}/{key}") != expected:
                        failures.append(f"{name} round {r}: the object in the store differs from the checkpoint")

    def summary(times: list[float]) -> dict[str, float]:
        med = statistics.median(times)
        return {"median_s": round(med, 4), "min_s": round(min(times), 4), "mb_per_s": round(len(expected) / med / 1e6, 1)}

    report = {
        "benchmark": "checkpoint write (torch.save into fsspec.open(..., 'wb')) against "
                     + ("a local directory" if local else "moto S3"),
        "store": args.store,
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint_bytes": len(expected),
        "rounds": args.rounds,
        "results": {name: summary(times) | {"runs_s": [round(t, 4) for t in times]} for name, times in results.items()},
        "failures": failures,
    }
    s3fs_med = report["results"]["s3fs"]["median_s"]
    report["ratio_vs_s3fs"] = {name: round(r["median_s"] / s3fs_med, 3)
                               for name, r in report["results"].items() if name != "s3fs"}
    os.makedirs(args.out, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    for name in (f"write-{args.store}-{stamp}.json", f"write-{args.store}-latest.json"):
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
