"""Warm epochs that last longer than the metadata TTL, and longer than TTL + stale grace.

    .venv/bin/python benchmarks/bench_long_epochs.py            # 2,000 x 256 KiB, 3 epochs a case
    .venv/bin/python benchmarks/bench_long_epochs.py --quick    # 400 samples, 2 epochs a case

A real training epoch takes minutes to hours, so every sample is read again long after its
metadata was last checked: past ``metadata_ttl`` (30 s) it is used while the worker revalidates it
(stale-while-revalidate), past ``metadata_ttl + metadata_stale_grace`` (10.5 min) nothing is left
to serve from. bench_dataset.py runs its warm epochs back to back (tens of ms each) and never
sees either. Here one ``cachefs worker`` over moto runs with a short TTL and grace (1 s and 3 s
by default) standing in for the real ones, and a ``CacheDataset`` epoch through a DataLoader
(workers 0 and 2) is timed after pauses of three kinds:

* ``back_to_back``: no pause (what bench_dataset.py measures);
* ``within_grace``: past the TTL, within the grace (an epoch of 30 s to 10.5 min);
* ``past_grace``: past both (a longer epoch: most real ones).

Per epoch: items/s, the first batch's wait, the worker's CPU seconds (the epoch's own; a
refresh still running after it is not counted) and the store requests it sent, by kind (from its
metrics): a warm epoch should cost a listing or two, not a request per object.
Medians over the epochs of each case. Writes benchmarks/results/long-epochs-<timestamp>.json (and
latest-long-epochs.json) and a PNG.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info, process_cpu  # noqa: E402

MOUNT = "bench"
CASES = ("back_to_back", "within_grace", "past_grace")


def store_requests(metrics_url: str) -> dict[str, float]:
    """The worker's store requests so far, by kind (its Prometheus counter)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("cachefs_worker_store_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                kind = labels.split('kind="', 1)[1].split('"', 1)[0]
                out[kind] = out.get(kind, 0.0) + float(value)
    return out


def pause_for(case: str, ttl: float, grace: float) -> float:
    if case == "back_to_back":
        return 0.0
    if case == "within_grace":
        return ttl + grace / 2
    return ttl + grace + 1.5


def one_epoch(loader: Any, batch: int, n: int, metrics_url: str, worker_pid: int) -> dict[str, Any]:
    before = store_requests(metrics_url)
    cpu_before = process_cpu(worker_pid)
    seen: list[int] = []
    t0 = time.perf_counter()
    first = None
    for ids in loader:
        if first is None:
            first = time.perf_counter() - t0
        seen.extend(ids)
    wall = time.perf_counter() - t0
    worker_cpu = process_cpu(worker_pid) - cpu_before
    after = store_requests(metrics_url)
    if sorted(seen) != list(range(n)):
        raise RuntimeError(f"an epoch read {len(seen)} samples, {len(set(seen))} distinct, of {n}")
    sent = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    return {"items_per_s": round(n / wall, 1), "seconds": round(wall, 4),
            "first_batch_s": round(first or 0.0, 4), "worker_cpu_s": round(worker_cpu, 3), "store_requests": sent,
            "store_requests_per_sample": round(sum(sent.values()) / n, 4)}


def sample_ids(batch: Any) -> list[int]:
    """The collate function: each sample starts with its index as 8 ASCII digits."""
    return [int(bytes(t[:8].numpy())) for t in batch]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="400 samples, 2 epochs a case")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--size", type=int, default=256 << 10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", default="0,2", help="DataLoader num_workers settings")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs per case (3; 2 with --quick)")
    p.add_argument("--ttl", type=float, default=1.0, help="the worker's metadata_ttl, seconds (stands in for 30)")
    p.add_argument("--grace", type=float, default=3.0, help="its metadata_stale_grace (stands in for 600)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tmp-dir", default=None)
    args = p.parse_args(argv)
    n = args.samples or (400 if args.quick else 2000)
    epochs = args.epochs or (2 if args.quick else 3)
    cases = [c for c in args.cases.split(",") if c]
    if any(c not in CASES for c in cases) or not cases:
        p.error(f"--cases: some of {', '.join(CASES)}")
    workers = [int(w) for w in args.workers.split(",") if w]
    if args.ttl <= 0 or args.grace <= 0:
        p.error("--ttl and --grace must be positive")

    import torch

    from cachefs.client.datasets.dataset import CacheDataset
    from cachefs.local import toml_value, worker_process
    from cachefs.testing import MotoServer

    tmp = tempfile.mkdtemp(prefix="cachefs-long-", dir=args.tmp_dir)
    s3 = MotoServer().start()
    worker = None
    results: list[dict[str, Any]] = []
    started = time.time()
    try:
        bucket = s3.new_bucket("cachefs-long")
        client = s3.client()
        noise = os.urandom(args.size)
        for i in range(n):
            client.put_object(Bucket=bucket, Key=f"samples/{i:06d}.bin", Body=f"{i:08d}".encode() + noise[8:])
        config = os.path.join(tmp, "worker.toml")
        with open(config, "w") as f:
            f.write("[worker]\n\n")
            f.write(f"[mounts.{MOUNT}]\nurl = {toml_value('s3://' + bucket)}\n"
                    f"options = {toml_value(s3.storage_options())}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        env["CACHEFS_WORKER_METADATA_STALE_GRACE"] = str(args.grace)
        worker = worker_process({}, os.path.join(tmp, "cache"), quota="8GiB", log_path=os.path.join(tmp, "worker.log"),
                                env=env, extra=["--config", config, "--metadata-ttl", str(args.ttl)])
        worker.start(timeout=60)
        metrics_url = f"http://127.0.0.1:{worker.ready['metrics_port']}/metrics"
        dataset = CacheDataset.from_prefix(f"cachefs://{MOUNT}/samples", storage_options={"workers": worker.address},
                                           rank=0, world_size=1)
        for w in workers:
            loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=w,
                                                 collate_fn=sample_ids)
            cold = one_epoch(loader, args.batch_size, n, metrics_url, worker.proc.pid) if w == workers[0] else None
            if cold is not None:
                results.append({"num_workers": w, "case": "cold", **cold})
                print(json.dumps(results[-1]), flush=True)
            for case in cases:
                pause = pause_for(case, args.ttl, args.grace)
                for e in range(epochs):
                    time.sleep(pause)
                    got = one_epoch(loader, args.batch_size, n, metrics_url, worker.proc.pid)
                    results.append({"num_workers": w, "case": case, "epoch": e, "pause_s": pause, **got})
                    print(json.dumps(results[-1]), flush=True)
    finally:
        if worker is not None:
            worker.stop()
            worker.kill()
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    summary: dict[str, dict[str, Any]] = {}
    for w in workers:
        for case in cases:
            rows = [r for r in results if r["num_workers"] == w and r["case"] == case]
            kinds = sorted({k for r in rows for k in r["store_requests"]})
            summary[f"workers={w} {case}"] = {
                "items_per_s": statistics.median(r["items_per_s"] for r in rows),
                "first_batch_s": statistics.median(r["first_batch_s"] for r in rows),
                "worker_cpu_s": statistics.median(r["worker_cpu_s"] for r in rows),
                "store_requests_per_epoch": {k: statistics.median(r["store_requests"].get(k, 0.0) for r in rows)
                                             for k in kinds}}
    ratios = {}
    for w in workers:
        base = summary.get(f"workers={w} back_to_back")
        for case in ("within_grace", "past_grace"):
            got = summary.get(f"workers={w} {case}")
            if base and got:
                ratios[f"workers={w} {case} / back_to_back"] = round(got["items_per_s"] / base["items_per_s"], 3)
    report = {"benchmark": "long_epochs", "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
              "duration_s": round(time.time() - started, 1), "machine": machine_info(),
              "parameters": {"samples": n, "size": args.size, "batch_size": args.batch_size, "workers": workers,
                             "epochs": epochs, "metadata_ttl": args.ttl, "metadata_stale_grace": args.grace,
                             "pauses_s": {c: pause_for(c, args.ttl, args.grace) for c in cases}},
              "summary": summary, "ratios": ratios, "results": results}
    os.makedirs(args.out, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    path = os.path.join(args.out, f"long-epochs-{stamp}.json")
    for target in (path, os.path.join(args.out, "latest-long-epochs.json")):
        with open(target, "w") as f:
            json.dump(report, f, indent=1)
    _plot(summary, workers, cases, path[:-5] + ".png")
    print(json.dumps({"summary": summary, "ratios": ratios, "json": path}, indent=1))
    return 0


def _plot(summary: dict[str, dict[str, Any]], workers: list[int], cases: list[str], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(workers))
    for k, w in enumerate(workers):
        xs = [i + k * width for i in range(len(cases))]
        a.bar(xs, [summary[f"workers={w} {c}"]["items_per_s"] for c in cases], width, label=f"workers {w}")
        b.bar(xs, [sum(summary[f"workers={w} {c}"]["store_requests_per_epoch"].values()) for c in cases], width,
              label=f"workers {w}")
    for ax, title in ((a, "warm epoch, items/s (median)"), (b, "store requests per warm epoch")):
        ax.set_xticks([i + width * (len(workers) - 1) / 2 for i in range(len(cases))], cases)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
