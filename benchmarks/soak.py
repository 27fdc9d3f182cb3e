#!/usr/bin/env python
"""Bounded soak: many concurrent readers (threads and processes) over a local cluster.

    .venv/bin/python benchmarks/soak.py --short                  # ~35 s: what CI runs (tests/test_soak.py)
    .venv/bin/python benchmarks/soak.py --duration 600           # ten minutes
    .venv/bin/python benchmarks/soak.py --store s3 --procs 4     # over a moto bucket instead of a local dir

A master and N workers run as processes (cachefs.local.LocalCluster) on loopback, over a
local directory (default) or a moto S3 bucket. Readers pick objects and ranges at random
(seeded), read them through ``cachefs://`` and compare every byte with the source (each
reader regenerates the objects from their seeds, so nothing big is shared). Reported, as
JSON: reads, bytes read and verified, errors, throughput, latency p50/p99/max, the workers'
hit ratio, and each worker's RSS and open file descriptors (/proc/PID/status, /proc/PID/fd)
after the warm-up and at the end, with a timeline in between: flat, not growing.
Exit status 0 when errors == 0 and every byte read was verified, else 1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from cachefs.local import LocalCluster
from cachefs.proto import worker_pb2, worker_pb2_grpc

FAST_MASTER = ["--lease-seconds", "6", "--heartbeat-seconds", "1"]


def object_data(i: int, size: int) -> bytes:
    """Object ``i``: its bytes follow from its number, so every reader can check them."""
    return random.Random(1_000_003 * i + 17).randbytes(size + (i * 4099) % (size // 2 + 1))


def proc_usage(pid: int) -> dict[str, int]:
    """Resident memory (kB) and open file descriptors of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kb": rss, "fds": _steady_fds(pid)}


def _steady_fds(pid: int, looks: int = 5, apart: float = 0.02) -> int:
    """Open descriptors other than sockets, the fewest of a few looks: a reply in flight holds up
    to 128 page files for a moment (a leaked descriptor stays in every look; those come and go),
    and sockets follow the clients' connection pools (bounded by the raw servers' limits and closed
    when idle), not a leak."""
    counts = []
    for i in range(looks):
        if i:
            time.sleep(apart)
        counts.append(sum(1 for fd in _listdir(f"/proc/{pid}/fd") if not _is_socket(pid, fd)))
    return min(counts)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _is_socket(pid: int, fd: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    except OSError:  # closed meanwhile
        return True


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def read_loop(master: str, n_objects: int, size: int, seconds: float, seed: int, threads: int) -> dict[str, Any]:
    """Read random objects and ranges for ``seconds`` on ``threads`` threads; check every byte."""
    import fsspec

    fs = fsspec.filesystem("cachefs", master=master, timeout=10, skip_instance_cache=True)
    objects = [object_data(i, size) for i in range(n_objects)]
    lock = threading.Lock()
    out: dict[str, Any] = {"reads": 0, "bytes": 0, "verified": 0, "errors": 0, "first_errors": [], "latencies": []}
    deadline = time.monotonic() + seconds

    def run(tseed: int) -> None:
        rng = random.Random(tseed)
        lat: list[float] = []
        reads = nbytes = verified = errors = 0
        first: list[str] = []
        while time.monotonic() < deadline:
            i = rng.randrange(n_objects)
            data = objects[i]
            if rng.random() < 0.5:
                start, end = 0, len(data)
            else:
                start = rng.randrange(len(data))
                end = min(len(data), start + rng.randrange(1, 256 << 10))
            t0 = time.perf_counter()
            try:
                got = fs.cat_file(f"data/o{i:05d}", start, end)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors += 1
                if len(first) < 5:
                    first.append(f"o{i:05d}[{start}:{end}]: {exc!r}")
                continue
            lat.append(time.perf_counter() - t0)
            reads += 1
            nbytes += len(got)
            if got == data[start:end]:
                verified += len(got)
            else:
                errors += 1
                if len(first) < 5:
                    first.append(f"o{i:05d}[{start}:{end}]: wrong bytes")
        with lock:
            out["reads"] += reads
            out["bytes"] += nbytes
            out["verified"] += verified
            out["errors"] += errors
            out["first_errors"] += first
            out["latencies"] += lat

    workers = [threading.Thread(target=run, args=(seed * 1000 + t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=seconds + 120)
    return out


def _proc_main(master: str, n_objects: int, size: int, seconds: float, seed: int, threads: int, queue) -> None:
    try:
        queue.put(read_loop(master, n_objects, size, seconds, seed, threads))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        queue.put({"reads": 0, "bytes": 0, "verified": 0, "errors": 1, "first_errors": [repr(exc)], "latencies": []})


def _worker_status(address: str) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def _store(kind: str, root: Path, n_objects: int, size: int, stack: list) -> dict[str, Any]:
    """Write the objects; return the mount spec for the cluster."""
    if kind == "local":
        store = root / "store"
        store.mkdir(parents=True, exist_ok=True)
        for i in range(n_objects):
            (store / f"o{i:05d}").write_bytes(object_data(i, size))
        return {"url": str(store)}
    from cachefs.testing import MotoServer

    moto = MotoServer().start()
    stack.append(moto)
    bucket = moto.new_bucket("cachefs-soak")
    s3 = moto.client()
    for i in range(n_objects):
        s3.put_object(Bucket=bucket, Key=f"o{i:05d}", Body=object_data(i, size))
    return {"url": f"s3://{bucket}", "options": moto.storage_options()}


def soak(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.dir or tempfile.mkdtemp(prefix="cachefs-soak-"))
    stack: list = []
    try:
        mount = _store(args.store, root, args.objects, args.object_size, stack)
        cluster = LocalCluster(str(root / "cluster"), workers=args.workers, mounts={"data": mount},
                               master_args=FAST_MASTER, quota=args.quota)
        stack.append(cluster)
        cluster.start()
        if not cluster.wait_for_workers(timeout=60):
            raise RuntimeError("workers did not join the master")
        pids = {w.address: w.pid for w in cluster.workers}
        initial = {a: proc_usage(p) for a, p in pids.items()}
        t0 = time.monotonic()
        warm = read_loop(cluster.master_address, args.objects, args.object_size, args.warmup, 7, args.threads)
        warmup_s = time.monotonic() - t0
        start_usage = {a: proc_usage(p) for a, p in pids.items()}
        timeline: list[dict[str, Any]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(args.sample_every):
                timeline.append({"t": round(time.monotonic() - t0, 1),
                                 **{a: proc_usage(p) for a, p in pids.items()}})

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_proc_main, args=(cluster.master_address, args.objects, args.object_size,
                                                      args.duration, 100 + n, args.proc_threads, queue))
                 for n in range(args.procs)]
        t1 = time.monotonic()
        for p in procs:
            p.start()
        main = read_loop(cluster.master_address, args.objects, args.object_size, args.duration, 1, args.threads)
        parts = [main] + [queue.get(timeout=args.duration + 180) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        elapsed = time.monotonic() - t1
        stop.set()
        sampler.join(timeout=10)
        end_usage = {a: proc_usage(p) for a, p in pids.items()}
        statuses = {a: _worker_status(a) for a in pids}
    finally:
        for item in reversed(stack):
            item.stop()
    lat = sorted(x for part in parts for x in part["latencies"])
    reads = sum(p["reads"] for p in parts)
    nbytes = sum(p["bytes"] for p in parts)
    hits = sum(s.hits for s in statuses.values())
    lookups = hits + sum(s.misses for s in statuses.values())
    load_from = t1 - t0 + 1.0  # readers in the child processes are connected by then
    under_load = [t for t in timeline if load_from <= t["t"] <= t1 - t0 + args.duration] or [
        {"t": 0, **start_usage}, {"t": 0, **end_usage}]
    first, last = under_load[0], under_load[-1]
    return {
        "params": {k: v for k, v in vars(args).items()},
        "readers": {"threads": args.threads, "processes": args.procs, "threads_per_process": args.proc_threads,
                    "total": args.threads + args.procs * args.proc_threads},
        "warmup": {"seconds": round(warmup_s, 1), "reads": warm["reads"], "errors": warm["errors"]},
        "seconds": round(elapsed, 1),
        "reads": reads,
        "bytes_read": nbytes,
        "bytes_verified": sum(p["verified"] for p in parts),
        "errors": sum(p["errors"] for p in parts) + warm["errors"],
        "first_errors": [e for p in parts + [warm] for e in p["first_errors"]][:10],
        "throughput_mb_s": round(nbytes / elapsed / 1e6, 1) if elapsed else 0.0,
        "reads_per_s": round(reads / elapsed, 1) if elapsed else 0.0,
        "latency_ms": {"p50": round(_percentile(lat, 0.50) * 1e3, 2), "p99": round(_percentile(lat, 0.99) * 1e3, 2),
                       "max": round((lat[-1] if lat else 0.0) * 1e3, 2)},
        # Page lookups on the workers (reads that a short-circuit client serves from the page
        # files itself are not counted here), and what the workers fetched from the store.
        "hit_ratio": round(hits / lookups, 4) if lookups else 0.0,
        "bytes_from_store": sum(s.bytes_from_store for s in statuses.values()),
        "source_bytes": sum(len(object_data(i, args.object_size)) for i in range(args.objects)),
        # Growth is measured between the first and the last sample taken under full load (same
        # readers connected); "after_warmup" and "end" (readers gone) are kept for reference.
        "workers": {a: {"pid": pids[a], "initial": initial[a], "after_warmup": start_usage[a],
                        "first_under_load": first[a], "last_under_load": last[a], "end": end_usage[a],
                        "rss_growth_kb": last[a]["rss_kb"] - first[a]["rss_kb"],
                        "fd_growth": last[a]["fds"] - first[a]["fds"],
                        "degraded": statuses[a].degraded}
                    for a in pids},
        "timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of measured load")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the start figures")
    parser.add_argument("--short", action="store_true", help="CI mode: 30 s, small data (overrides sizes)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4, help="reader threads in this process")
    parser.add_argument("--procs", type=int, default=2, help="reader processes")
    parser.add_argument("--proc-threads", type=int, default=2, help="reader threads per process")
    parser.add_argument("--objects", type=int, default=200)
    parser.add_argument("--object-size", type=int, default=256 << 10, help="bytes (objects vary up to 1.5x)")
    parser.add_argument("--quota", default="2GiB", help="cache quota per worker")
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/fd samples")
    parser.add_argument("--dir", help="work directory (default: a new temporary one)")
    parser.add_argument("--out", help="JSON output (default: benchmarks/results/soak-<time>.json)")
    args = parser.parse_args(argv)
    if args.short:
        args.duration, args.warmup, args.objects, args.object_size = 30.0, 4.0, 60, 128 << 10
        args.sample_every = 3.0
    result = soak(args)
    out = Path(args.out or Path(__file__).parent / "results" / f"soak-{time.strftime('%Y%m%dT%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    summary = {k: result[k] for k in ("seconds", "reads", "bytes_read", "bytes_verified", "errors",
                                      "throughput_mb_s", "reads_per_s", "latency_ms", "hit_ratio",
                                      "bytes_from_store", "source_bytes")}
    summary["workers"] = {a: {k: w[k] for k in ("rss_growth_kb", "fd_growth")} for a, w in result["workers"].items()}
    print(json.dumps(summary, indent=2))
    print(f"written: {out}", file=sys.stderr)
    ok = result["errors"] == 0 and result["bytes_verified"] == result["bytes_read"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
