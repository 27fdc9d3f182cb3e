"""Warm samples read by a process that has read nothing before: what a DataLoader worker is, every
epoch, with the default ``persistent_workers=False``.

    .venv/bin/python benchmarks/bench_fresh_reads.py            # 2,000 x 256 KiB, 5 rounds
    .venv/bin/python benchmarks/bench_fresh_reads.py --quick    # 500 samples, 3 rounds

One ``cachefs worker`` process caches the samples (a local-directory mount: a warm read never
reaches the store). Each round starts, for every case, a new spawned process that reads all the
samples in batches of 32 into tensors, as ``CacheDataset.__getitems__`` does in a DataLoader
worker (its first batch, which sets the process up, is not timed):

* ``local``: the same files on local disk, open + readinto + close each (the limit);
* ``cachefs_by_name``: ``CacheDataset``, page files opened by name (the default;
  client/transport/namedpages.py);
* ``cachefs_descriptors``: ``CacheDataset`` with ``short_circuit_by_name=false``: each batch's
  page descriptors come over the worker's socket (one message per batch).

Cases run in a rotating order within each round; items/s are medians over rounds, and CPU is
per sample: the reading process's own and the cachefs worker's over the timed part. Runs here
fall into two speeds about 3x apart, the slow ones spending 3x the CPU per sample in every case
(a new process's first touch of memory: this VM's host reclaims the guest's free pages), so the
best run of each case is reported beside the medians. Writes
benchmarks/results/fresh-reads-<timestamp>.json (and a PNG).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

MOUNT = "data"
CASES = ("local", "cachefs_by_name", "cachefs_descriptors")


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_of_task(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child(case: str, address: str, src: str, names: list[str], batch: int, worker_pid: int,
           out: Any) -> None:
    import torch

    if case == "local":
        paths = [os.path.join(src, n) for n in names]

        def read(indices: list[int]) -> list[torch.Tensor]:
            got = []
            for i in indices:
                with open(paths[i], "rb", buffering=0) as f:
                    t = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
                    f.readinto(t.numpy())
                got.append(t)
            return got
    else:
        from cachefs.client.datasets.dataset import CacheDataset

        ds = CacheDataset([f"cachefs://{MOUNT}/{n}" for n in names],
                          storage_options={"workers": address,
                                           "short_circuit_by_name": case == "cachefs_by_name"},
                          shuffle=False, rank=0, world_size=1, plan_ahead=False, hint_samples=0)
        read = ds.__getitems__
    batches = [list(range(i, min(len(names), i + batch))) for i in range(0, len(names), batch)]
    first = read(batches[0])  # sets the process up (connections, the worker's hello): not timed
    nbytes = sum(len(t) for t in first)
    own0, worker0 = resource.getrusage(resource.RUSAGE_SELF), _cpu_of(worker_pid)
    start = time.perf_counter()
    for b in batches[1:]:
        nbytes += sum(len(t) for t in read(b))
    seconds = time.perf_counter() - start
    own1, worker1 = resource.getrusage(resource.RUSAGE_SELF), _cpu_of(worker_pid)
    import threading
    threads = {}
    for t in threading.enumerate():
        try:
            threads[t.name] = round(_cpu_of_task(t.native_id), 3)
        except OSError:
            pass
    items = len(names) - len(batches[0])
    paths = {} if case == "local" else {k: dict(v) for k, v in ds._local.get().fs.session.bulk_stats.items()}
    out.put({"case": case, "items": items, "seconds": seconds, "items_per_s": items / seconds, "bytes": nbytes,
             "paths": paths, "threads_cpu_s": threads,
             "cpu_us_per_item": {"reader": 1e6 * (own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime) / items,
                                 "worker": 1e6 * (worker1 - worker0) / items}})


def run_case(ctx: Any, case: str, address: str, src: str, names: list[str], batch: int, worker_pid: int) -> dict:
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(case, address, src, names, batch, worker_pid, out))
    proc.start()
    try:
        result = out.get(timeout=600)
    finally:
        proc.join(timeout=60)
    if proc.exitcode != 0:
        raise RuntimeError(f"{case} reader exited with {proc.exitcode}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--samples", type=int)
    p.add_argument("--size", type=int, default=256 << 10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    n = args.samples or (500 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 5)

    from cachefs.local import worker_process

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="cachefs-fresh-") as tmp:
        src = os.path.join(tmp, "src")
        os.mkdir(src)
        names = [f"s{i:05d}.bin" for i in range(n)]
        for i, name in enumerate(names):
            with open(os.path.join(src, name), "wb") as f:
                f.write(os.urandom(args.size))
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        worker = worker_process({MOUNT: src}, os.path.join(tmp, "cache"), quota="8GiB", env=env,
                                log_path=os.path.join(tmp, "worker.log"))
        worker.start(timeout=60)
        try:
            # Warm the worker's cache in a child (this process stays free of gRPC for its spawns).
            run_case(ctx, "cachefs_descriptors", worker.address, src, names, args.batch_size, worker.pid)
            results: dict[str, list[dict]] = {c: [] for c in CASES}
            for r in range(rounds):
                order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
                for case in order:
                    got = run_case(ctx, case, worker.address, src, names, args.batch_size, worker.pid)
                    if got["bytes"] != n * args.size:
                        raise RuntimeError(f"{case}: read {got['bytes']} bytes, expected {n * args.size}")
                    results[case].append(got)
                    print(json.dumps({"round": r, **got}), flush=True)
        finally:
            worker.stop()
    summary = {}
    for case, runs in results.items():
        summary[case] = {
            "items_per_s_median": round(statistics.median(x["items_per_s"] for x in runs), 1),
            "items_per_s_all": [round(x["items_per_s"], 1) for x in runs],
            "items_per_s_best": round(max(x["items_per_s"] for x in runs), 1),
            "reader_cpu_us_per_item_median": round(statistics.median(x["cpu_us_per_item"]["reader"] for x in runs), 1),
            "worker_cpu_us_per_item_median": round(statistics.median(x["cpu_us_per_item"]["worker"] for x in runs), 1),
        }
    local = summary["local"]["items_per_s_median"]
    ratios = {f"{c} / local": round(summary[c]["items_per_s_median"] / local, 3) for c in CASES if c != "local"}
    ratios["by_name / descriptors"] = round(summary["cachefs_by_name"]["items_per_s_median"]
                                            / summary["cachefs_descriptors"]["items_per_s_median"], 3)
    best = {c: summary[c]["items_per_s_best"] for c in CASES}
    ratios.update({f"{c} / local, best runs": round(best[c] / best["local"], 3) for c in CASES if c != "local"})
    ratios["by_name / descriptors, best runs"] = round(best["cachefs_by_name"] / best["cachefs_descriptors"], 3)
    report = {"benchmark": "fresh_reads", "started": dt.datetime.now(dt.timezone.utc).isoformat(),
              "args": {"samples": n, "size": args.size, "batch_size": args.batch_size, "rounds": rounds},
              "machine": machine_info(), "summary": summary, "ratios": ratios,
              "runs": results}
    os.makedirs(args.out, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(args.out, f"fresh-reads-{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    _plot(summary, ratios, path[:-5] + ".png")
    print(json.dumps({"summary": summary, "ratios": ratios, "json": path}, indent=1))
    return 0


def _plot(summary: dict, ratios: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    cases = list(summary)
    a.bar(cases, [summary[c]["items_per_s_median"] for c in cases], color=["grey", "tab:green", "tab:blue"])
    a.set_ylabel("items/s (median)")
    a.set_title("warm 256 KiB samples, a new process each round")
    b.bar(cases, [summary[c]["reader_cpu_us_per_item_median"] for c in cases], label="reading process")
    b.bar(cases, [summary[c]["worker_cpu_us_per_item_median"] for c in cases],
          bottom=[summary[c]["reader_cpu_us_per_item_median"] for c in cases], label="cachefs worker")
    b.set_ylabel("CPU us per sample")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(", ".join(f"{k} {v}" for k, v in ratios.items()), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
