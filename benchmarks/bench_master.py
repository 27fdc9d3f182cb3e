"""Master and placement figures: ring movement and balance, lookups per second, memory per object.

    .venv/bin/python benchmarks/bench_master.py [--objects 1000000] [--quick]

What it measures (DESIGN.md section 5 targets in brackets):
- ring: keys moved when a 9th worker joins 8 [<= 1.1/9], max/mean load at 3/8/16 workers [<= 1.10],
  build time, placement lookups per second on one core (what every client does per read);
- metadata lookups per second [>= 20k per core]: in the master's process (its cache, one core),
  over gRPC one object per call (`GetInfo` against a real master process, 1 and 8 client
  threads), batched (`GetInfos`, 1,000 paths per call), and in bulk (`List` of a cached
  10k-object prefix, 1,000 entries per message);
- memory per tracked object [10 M in < 2 GiB]: the master's metadata cache filled with N
  objects in a fresh process, RSS measured at N/4, N/2 and N; the slope gives bytes per object.
Writes benchmarks/results/master-<timestamp>.json (and master-latest.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def ring_figures(keys: int) -> dict:
    from cachefs.ring import HashRing

    names = [f"worker-{i}" for i in range(16)]
    sample = [f"data/train/shard-{i:07d}.tar" for i in range(keys)]
    t0 = time.perf_counter()
    eight = HashRing(names[:8])
    build_ms = (time.perf_counter() - t0) * 1e3
    nine = HashRing(names[:9])
    before = [eight.node(k) for k in sample]
    after = [nine.node(k) for k in sample]
    moved = sum(1 for a, b in zip(before, after) if a != b)
    moved_to_new = sum(1 for a, b in zip(before, after) if a != b and b == "worker-8")
    balance = {}
    for n in (3, 8, 16):
        ring = HashRing(names[:n])
        counts: dict[str, int] = {}
        for k in sample:
            node = ring.node(k)
            counts[node] = counts.get(node, 0) + 1
        balance[str(n)] = round(max(counts.values()) / (len(sample) / n), 4)
    t0 = time.perf_counter()
    for k in sample:
        eight.nodes(k, 3)
    lookups = len(sample) / (time.perf_counter() - t0)
    return {"keys": keys, "moved_fraction_8_to_9": round(moved / keys, 4), "moved_only_to_new": moved == moved_to_new,
            "target_moved": round(1.1 / 9, 4), "max_over_mean": balance, "target_max_over_mean": 1.10,
            "build_ms_8_workers": round(build_ms, 2), "placement_lookups_per_s": round(lookups)}


_FILL = r"""
import gc, json, os, sys, time
from cachefs.mounts import MountTable, MountSpec
from cachefs.paths import CachePath
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

n = int(sys.argv[1])
store = ObjectStore(MountTable([MountSpec("data", sys.argv[2])]), metadata_ttl=3600, max_objects=n + 1)
gc.collect()
base = rss()
points = []
marks = {n // 4, n // 2, n}
for i in range(1, n + 1):
    path = CachePath("data", f"train/shard-{i // 1000:05d}/sample-{i:09d}.jpg")
    store._meta.put(path, ObjectMeta(path, 100_000 + i, f"{i:032x}", 1.7e9 + i))  # what info() caches
    if i in marks:
        gc.collect()
        points.append((i, rss() - base))
paths = [CachePath("data", f"train/shard-{i // 1000:05d}/sample-{i:09d}.jpg") for i in range(1, min(n, 200_000) + 1)]
t0 = time.perf_counter()
for p in paths:
    store.info(p)
rate = len(paths) / (time.perf_counter() - t0)
print(json.dumps({"points": points, "in_process_lookups_per_s": rate}))
"""


def memory_figures(objects: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", _FILL, str(objects), tmp], capture_output=True, text=True,
                             timeout=1800, check=True)
    data = json.loads(out.stdout)
    (n1, r1), (n2, r2), (n3, r3) = data["points"]
    slope = (r3 - r1) / (n3 - n1)
    return {"objects": objects, "rss_bytes_at": {str(n): r for n, r in data["points"]},
            "bytes_per_object": round(slope, 1), "projected_10m_gib": round(slope * 10_000_000 / 2**30, 2),
            "target_10m_gib": 2.0, "in_process_lookups_per_s": round(data["in_process_lookups_per_s"])}


def grpc_figures(seconds: float) -> dict:
    import grpc

    from cachefs.local import master_process
    from cachefs.proto import master_pb2_grpc, worker_pb2

    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        for i in range(100):
            (store / f"o{i}.bin").write_bytes(b"x" * 100)
        listed = store / "many"
        listed.mkdir()
        for i in range(10_000):
            (listed / f"s{i:05d}.bin").write_bytes(b"")
        master = master_process(str(Path(tmp) / "m"), ["--mount", f"data={store}"]).start()
        try:
            channel = grpc.insecure_channel(master.address)
            stub = master_pb2_grpc.MasterServiceStub(channel)
            paths = [f"data/o{i}.bin" for i in range(100)]
            for p in paths:  # fill the master's metadata cache
                stub.GetInfo(worker_pb2.InfoRequest(path=p), timeout=10)
            result = {}
            for threads in (1, 8):
                count = [0]
                deadline = time.perf_counter() + seconds

                def loop(seed: int) -> int:
                    n, i = 0, seed
                    while time.perf_counter() < deadline:
                        stub.GetInfo(worker_pb2.InfoRequest(path=paths[i % 100]), timeout=10)
                        n, i = n + 1, i + 1
                    return n

                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    count[0] = sum(pool.map(loop, range(threads)))
                result[f"grpc_getinfo_per_s_{threads}_threads"] = round(count[0] / (time.perf_counter() - t0))
            # Batched lookups: 1,000 paths per GetInfos call.
            from cachefs.proto import master_pb2

            batch = master_pb2.GetInfosRequest(paths=[paths[i % 100] for i in range(1000)])
            stub.GetInfos(batch, timeout=30)
            t0 = time.perf_counter()
            calls = 0
            while time.perf_counter() - t0 < seconds:
                stub.GetInfos(batch, timeout=30)
                calls += 1
            result["grpc_getinfos_lookups_per_s_batch_1000"] = round(calls * 1000 / (time.perf_counter() - t0))
            # Bulk metadata: a cached listing streams 1,000 entries per message.
            request = worker_pb2.ListRequest(path="data/many", recursive=True)
            entries = sum(len(b.entries) for b in stub.List(request, timeout=60))  # fills the cache
            t0 = time.perf_counter()
            rounds = 0
            while time.perf_counter() - t0 < seconds:
                entries = sum(len(b.entries) for b in stub.List(request, timeout=60))
                rounds += 1
            result["grpc_list_entries_per_s"] = round(rounds * entries / (time.perf_counter() - t0))
            channel.close()
            return result
        finally:
            master.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=1_000_000, help="objects in the memory measurement")
    parser.add_argument("--keys", type=int, default=100_000, help="keys in the ring measurements")
    parser.add_argument("--quick", action="store_true", help="100k objects, 20k keys, 2 s of gRPC")
    args = parser.parse_args()
    if args.quick:
        args.objects, args.keys = 100_000, 20_000
    report = {"benchmark": "master", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "nproc": os.cpu_count(),
              "ring": ring_figures(args.keys), "memory": memory_figures(args.objects)}
    try:
        report["grpc"] = grpc_figures(2.0 if args.quick else 5.0)
    except Exception as exc:  # noqa: BLE001 - reported, the other figures still count
        report["grpc"] = {"error": f"{type(exc).__name__}: {exc}"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (f"master-{stamp}.json", "master-latest.json"):
        (RESULTS / name).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
