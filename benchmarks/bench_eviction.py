"""A cache smaller than the data set: store traffic per epoch, eviction by next use vs LRU vs optimum.

    .venv/bin/python benchmarks/bench_eviction.py            # the issue's grid (several minutes)
    .venv/bin/python benchmarks/bench_eviction.py --quick    # shuffled, 1 rank, DataLoader workers 0

One moto S3 server holds ``--objects`` samples of ``--size`` bytes (one object each); two cachefs
worker processes (pages of ``--page-size``) share a quota of ``--quota`` x the data set. A
``CacheDataset`` reads ``--epochs`` epochs in a shuffled or sequential order, with 1 or 2 ranks
(processes reading their halves at once) and 0 or 2 DataLoader workers, once with the workers
evicting by next use (``--eviction future``, the datasets registering their read order:
client/datasets/plans.py) and once by recency (``--eviction lru``, no plan). For each run it records, per
epoch, the bytes each worker fetched from the store (its metrics: the honest figure) and its page
hits and misses; and it computes the offline optimum from the same access trace: Belady's rule
(evict the page whose next use is furthest, and do not admit a page used later than all cached
ones) on each worker's own pages after the ring's partition, with that worker's capacity in pages.

Targets (#16): store bytes of epochs 2..N within 5% of the optimum, and <= 0.5x LRU's; it also reports
the demand hit ratio (page reads that did not wait on the store) beside the optimum's.
Writes benchmarks/results/eviction-<timestamp>.json (and latest-eviction.json) and a PNG.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

from cachefs.client.datasets.sampling import EpochPlan  # noqa: E402
from cachefs.local import toml_value, worker_process  # noqa: E402
from cachefs.pagefile import TRAILER_SIZE  # noqa: E402
from cachefs.testing import MotoServer  # noqa: E402

MOUNT = "bench"


# -- the offline optimum ----------------------------------------------------------------------------
def belady_misses(trace: list[int], capacity: int) -> int:
    """Misses of the optimal policy with bypass (a page used later than every cached one is not
    admitted) on ``trace`` (page ids) with room for ``capacity`` pages."""
    if capacity <= 0:
        return len(trace)
    nxt = [0] * len(trace)
    last: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = last.get(trace[i], 1 << 60)
        last[trace[i]] = i
    import heapq

    cached: dict[int, int] = {}  # page -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, page), lazy
    misses = 0
    for i, page in enumerate(trace):
        if page in cached:
            cached[page] = nxt[i]
            heapq.heappush(heap, (-nxt[i], page))
            continue
        misses += 1
        if len(cached) < capacity:
            cached[page] = nxt[i]
            heapq.heappush(heap, (-nxt[i], page))
            continue
        while heap and cached.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        furthest = -heap[0][0]
        if nxt[i] >= furthest:
            continue  # bypass
        _, victim = heapq.heappop(heap)
        del cached[victim]
        cached[page] = nxt[i]
        heapq.heappush(heap, (-nxt[i], page))
    return misses


def rank_orders(n: int, ranks: int, seed: int, epoch: int, shuffle: bool) -> list[np.ndarray]:
    return [EpochPlan(n, r, ranks, seed, epoch, shuffle).order for r in range(ranks)]


def access_trace(n: int, ranks: int, seed: int, epochs: int, shuffle: bool) -> list[tuple[int, int]]:
    """(epoch, sample) in the order the ranks read them together (lock-step, interleaved)."""
    out: list[tuple[int, int]] = []
    for e in range(epochs):
        orders = rank_orders(n, ranks, seed, e, shuffle)
        for i in range(len(orders[0])):
            out.extend((e, int(o[i])) for o in orders)
    return out


# -- one rank (a child process) ---------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader

    from cachefs.client.datasets.dataset import CacheDataset

    paths = json.loads(args.paths_json)
    lockstep = args.ranks > 1
    if lockstep:  # ranks advance batch by batch together, as DDP's gradient all-reduce makes them
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{os.path.join(args.sync_dir, 'pg')}",
                                rank=args.rank, world_size=args.ranks)
    ds = CacheDataset(paths, sizes=[args.size] * len(paths), storage_options={"workers": args.workers},
                      seed=args.seed, shuffle=args.shuffle == "yes", rank=args.rank, world_size=args.ranks,
                      plan_ahead=args.policy == "future", hint_samples=args.hint_samples)
    sync = args.sync_dir
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        _barrier(sync, f"start-{epoch}", args.rank, args.ranks)
        loader = DataLoader(ds, batch_size=16, sampler=ds.sampler(), num_workers=args.num_workers,
                            collate_fn=lambda items: len(items))
        got = 0
        for n in loader:
            got += n
            if lockstep:
                dist.barrier()
        assert got == len(ds), (got, len(ds))
        _barrier(sync, f"end-{epoch}", args.rank, args.ranks)
    del torch


def _barrier(sync: str, name: str, rank: int, ranks: int, timeout: float = 600.0) -> None:
    """The parent reads the workers' counters between epochs: every rank waits for its go."""
    open(os.path.join(sync, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    go = os.path.join(sync, f"{name}.go")
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go for {name}")
        time.sleep(0.01)


def _wait_all(sync: str, name: str, ranks: int, procs: list[subprocess.Popen], timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(sync, f"{name}.{r}")) for r in range(ranks)):
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a rank failed before {name}")
        if time.monotonic() > deadline:
            raise TimeoutError(name)
        time.sleep(0.02)


# -- the parent ---------------------------------------------------------------------------------------
def worker_status(address: str) -> dict[str, int]:
    import grpc

    from cachefs.proto import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        s = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=30)
    return {"bytes_from_store": s.bytes_from_store, "hits": s.hits, "misses": s.misses, "evictions": s.evictions,
            "pages": s.pages}


def one_run(moto: MotoServer, bucket: str, paths: list[str], keys: list[str], args: argparse.Namespace, *,
            policy: str, quota_fraction: float, shuffle: bool, ranks: int, num_workers: int) -> dict[str, Any]:
    data_bytes = args.objects * args.size
    page_file = args.page_size + TRAILER_SIZE
    pages_per_object = -(-args.size // args.page_size)
    quota = int(data_bytes * quota_fraction / 2)  # two workers share the quota
    with tempfile.TemporaryDirectory(prefix="cachefs-evict-") as tmp:
        config = os.path.join(tmp, "worker.toml")
        with open(config, "w") as f:
            f.write(f"[worker]\n\n[mounts.{MOUNT}]\nurl = {toml_value(f's3://{bucket}/data')}\n"
                    f"options = {toml_value(moto.storage_options())}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        env.update(dict(kv.split("=", 1) for kv in args.worker_env))
        workers = [worker_process({}, os.path.join(tmp, f"w{i}"), quota=str(quota), env=env,
                                  extra=["--config", config, "--eviction", policy, "--page-size", str(args.page_size),
                                         "--metadata-ttl", "600"],
                                  log_path=os.path.join(tmp, f"w{i}.log")).start()
                   for i in range(2)]
        try:
            addresses = ",".join(w.address for w in workers)
            owner = _owners(addresses, keys)
            sync = os.path.join(tmp, "sync")
            os.makedirs(sync)
            cmd = [sys.executable, os.path.abspath(__file__), "--rank-child", "--paths-json", json.dumps(paths),
                   "--workers", addresses, "--size", str(args.size), "--seed", str(args.seed), "--ranks", str(ranks),
                   "--epochs", str(args.epochs), "--num-workers", str(num_workers), "--policy", policy,
                   "--shuffle", "yes" if shuffle else "no", "--sync-dir", sync, "--hint-samples", str(args.hint_samples)]
            procs = [subprocess.Popen(cmd + ["--rank", str(r)]) for r in range(ranks)]
            epochs = []
            # Each epoch counts from the end of the one before (the first from the workers' start):
            # what the plan's prefetch fetches between epochs belongs to the next one.
            before = {w.address: dict.fromkeys(("bytes_from_store", "hits", "misses", "evictions"), 0)
                      for w in workers}
            scraped: dict[str, dict[str, float]] = {w.address: {} for w in workers}
            try:
                for e in range(args.epochs):
                    _wait_all(sync, f"start-{e}", ranks, procs)
                    t0 = time.perf_counter()
                    open(os.path.join(sync, f"start-{e}.go"), "w").close()
                    _wait_all(sync, f"end-{e}", ranks, procs)
                    seconds = time.perf_counter() - t0
                    after = {w.address: worker_status(w.address) for w in workers}
                    rescraped = {w.address: _scrape(w.ready["metrics_port"]) for w in workers}
                    open(os.path.join(sync, f"end-{e}.go"), "w").close()
                    per = {a: {k: after[a][k] - before[a][k] for k in ("bytes_from_store", "hits", "misses",
                                                                        "evictions")} for a in after}
                    for a in per:  # where this epoch's store traffic came from, on each worker
                        per[a]["counters"] = {k: v - scraped[a].get(k, 0) for k, v in rescraped[a].items()
                                              if v - scraped[a].get(k, 0)}
                    waited = _demand_misses([p["counters"] for p in per.values()], pages_per_object)
                    epochs.append({"epoch": e, "seconds": round(seconds, 2),
                                   "store_bytes": sum(p["bytes_from_store"] for p in per.values()),
                                   "demand_misses": waited,
                                   "demand_hit_ratio": round(max(0.0, 1 - waited / (args.objects * pages_per_object)), 3),
                                   "per_worker": per})
                    before, scraped = after, rescraped
                for p in procs:
                    if p.wait(timeout=300) != 0:
                        raise RuntimeError("a rank failed")
                counters = {w.address: _scrape(w.ready["metrics_port"]) for w in workers}
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
        finally:
            for w in workers:
                w.stop()
    # The optimum on the same trace, per worker.
    trace = access_trace(args.objects, ranks, args.seed, args.epochs, shuffle)
    capacity = quota // page_file
    optimum_per_worker: dict[str, list[int]] = {}
    for address in sorted(set(owner.values())):
        pages: list[int] = []
        epoch_of: list[int] = []
        for e, s in trace:
            if owner[keys[s]] == address:
                for p in range(pages_per_object):
                    pages.append(s * pages_per_object + p)
                    epoch_of.append(e)
        per_epoch = []
        for e in range(args.epochs):  # misses of epoch e: optimum over the trace up to its end
            cut = sum(1 for x in epoch_of if x <= e)
            per_epoch.append(belady_misses(pages[:cut], capacity))
        optimum_per_worker[address] = [b - a for a, b in zip([0] + per_epoch[:-1], per_epoch)]
    optimum_epochs = [sum(optimum_per_worker[a][e] for a in optimum_per_worker) * args.size // pages_per_object
                      for e in range(args.epochs)]
    measured_after_first = sum(ep["store_bytes"] for ep in epochs[1:])
    optimum_after_first = sum(optimum_epochs[1:])
    reads_after_first = args.objects * pages_per_object * (args.epochs - 1)
    optimum_misses = sum(sum(m[1:]) for m in optimum_per_worker.values())
    return {"policy": policy, "quota_fraction": quota_fraction, "shuffle": shuffle, "ranks": ranks,
            "num_workers": num_workers, "quota_bytes_per_worker": quota, "capacity_pages_per_worker": capacity,
            "data_bytes": data_bytes, "epochs": epochs, "optimum_store_bytes": optimum_epochs,
            "store_bytes_after_first": measured_after_first, "optimum_after_first": optimum_after_first,
            "vs_optimum": round(measured_after_first / optimum_after_first, 3) if optimum_after_first else None,
            "demand_hit_ratio_after_first": round(max(0.0, 1 - sum(ep["demand_misses"] for ep in epochs[1:])
                                                      / reads_after_first), 3) if reads_after_first else None,
            "optimum_hit_ratio_after_first": round(1 - optimum_misses / reads_after_first, 3)
            if reads_after_first else None,
            "worker_counters": counters}


def _demand_misses(counters: list[dict[str, float]], pages_per_object: int) -> int:
    """Page reads that waited on the store, from the workers' counters of one epoch (at most:
    a read whose fill gave up and that gRPC then read counts twice): ranges a same-host read had
    filled (a sample's pages each) and gRPC reads that missed or joined a fetch in flight. A page
    prefetched in time is a hit; its bytes count in the store traffic, the honest figure."""
    n = 0.0
    for c in counters:
        n += c.get("cachefs_worker_fill_ranges_total{outcome=filled}", 0) * pages_per_object
        n += c.get("cachefs_worker_page_reads_total{outcome=miss}", 0)
        n += c.get("cachefs_worker_page_reads_total{outcome=joined}", 0)
    return int(n)


#: Worker counters kept per run (where the store traffic came from, what was not admitted).
COUNTERS = ("cachefs_worker_store_requests_total", "cachefs_worker_page_reads_total",
            "cachefs_worker_fill_ranges_total", "cachefs_worker_load_bytes_total",
            "cachefs_worker_load_not_admitted_total", "cachefs_worker_cache_bypassed_admissions_total",
            "cachefs_worker_cache_passing_dropped_total", "cachefs_worker_cache_evictions_total",
            "cachefs_worker_held_unlinked_bytes", "cachefs_worker_page_writes_dropped_total")


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def _owners(addresses: str, keys: list[str]) -> dict[str, str]:
    from cachefs.client.fs.filesystem import CacheFileSystem

    fs = CacheFileSystem(workers=addresses, skip_instance_cache=True)
    try:
        return {k: fs.session.candidates(k, 0)[0].address for k in keys}
    finally:
        fs.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--objects", type=int, default=320)
    ap.add_argument("--size", type=int, default=256 << 10)
    ap.add_argument("--page-size", type=int, default=256 << 10)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--only", action="append", metavar="QUOTA:shuffled|sequential:RANKS:DL_WORKERS",
                    help="run these configurations only (repeatable), e.g. 0.5:shuffled:1:2")
    ap.add_argument("--hint-samples", type=int, default=256, help="CacheDataset's hint_samples (its default)")
    ap.add_argument("--worker-env", action="append", default=[], metavar="CACHEFS_WORKER_X=V",
                    help="worker settings through the environment (repeatable)")
    # child mode
    ap.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--paths-json", help=argparse.SUPPRESS)
    ap.add_argument("--workers", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--num-workers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="future", help=argparse.SUPPRESS)
    ap.add_argument("--shuffle", default="yes", help=argparse.SUPPRESS)
    ap.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_child:
        rank_main(args)
        return
    grid = [(q, s, r, w) for q in (0.5, 0.25) for s in (True, False) for r in (1, 2) for w in (0, 2)]
    if args.quick:
        grid = [(0.5, True, 1, 0), (0.25, True, 1, 0)]
    if args.only:
        grid = []
        for spec in args.only:
            q, order, r, w = spec.split(":")
            grid.append((float(q), order == "shuffled", int(r), int(w)))
    with MotoServer() as moto:
        bucket = moto.new_bucket("evict")
        client = moto.client()
        noise = os.urandom(args.size)
        keys, paths = [], []
        for i in range(args.objects):
            key = f"{MOUNT}/s{i:06d}.bin"
            client.put_object(Bucket=bucket, Key=f"data/s{i:06d}.bin", Body=noise[:args.size])
            keys.append(key)
            paths.append(f"cachefs://{key}")
        runs = []
        for q, s, r, w in grid:
            for policy in ("future", "lru"):
                t0 = time.perf_counter()
                run = one_run(moto, bucket, paths, keys, args, policy=policy, quota_fraction=q, shuffle=s, ranks=r,
                              num_workers=w)
                run["wall_s"] = round(time.perf_counter() - t0, 1)
                runs.append(run)
                print(f"quota {q:.2f} shuffle {s!s:5} ranks {r} dl-workers {w} {policy:6}: store MB/epoch "
                      f"{[round(e['store_bytes'] / 1e6, 1) for e in run['epochs']]} optimum "
                      f"{[round(b / 1e6, 1) for b in run['optimum_store_bytes']]} (epochs 2+: "
                      f"{run['vs_optimum']}x optimum; demand hit ratio {run['demand_hit_ratio_after_first']}, "
                      f"optimum's {run['optimum_hit_ratio_after_first']})", flush=True)
    summary = []
    for i in range(0, len(runs), 2):
        fut, lru = runs[i], runs[i + 1]
        summary.append({k: fut[k] for k in ("quota_fraction", "shuffle", "ranks", "num_workers")} | {
            "future_vs_optimum": fut["vs_optimum"],
            "future_vs_lru": round(fut["store_bytes_after_first"] / lru["store_bytes_after_first"], 3)
            if lru["store_bytes_after_first"] else None,
            "lru_vs_optimum": lru["vs_optimum"],
            "future_demand_hit_ratio": fut["demand_hit_ratio_after_first"],
            "lru_demand_hit_ratio": lru["demand_hit_ratio_after_first"],
            "optimum_hit_ratio": fut["optimum_hit_ratio_after_first"]})
    result = {"benchmark": "eviction", "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "objects": args.objects, "size": args.size, "page_size": args.page_size,
              "epochs": args.epochs, "workers": 2, "runs": runs, "summary": summary,
              "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"eviction-{stamp}.json")
    for target in (path, os.path.join(args.out, "latest-eviction.json")):
        with open(target, "w") as f:
            json.dump(result, f, indent=1)
    _plot(result, path[:-5] + ".png")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def _plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["summary"]
    labels = [f"q{r['quota_fraction']:.2f} {'shuf' if r['shuffle'] else 'seq'}\nr{r['ranks']} w{r['num_workers']}"
              for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar(x - 0.2, [r["future_vs_optimum"] or 0 for r in rows], 0.4, label="next use (future)")
    ax.bar(x + 0.2, [r["lru_vs_optimum"] or 0 for r in rows], 0.4, label="LRU")
    ax.axhline(1.05, color="gray", linestyle="--", linewidth=1, label="optimum + 5%")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("store bytes, epochs 2+ / offline optimum")
    ax.set_title("Cache smaller than the data set: store traffic vs Belady's optimum")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
