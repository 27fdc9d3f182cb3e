"""Client counters: what they cost, and the data-stall share the step report shows (issue 20).

    .venv/bin/python benchmarks/bench_stats.py            # 1,000 samples of 256 KiB, 4,000 of 4 KiB
    .venv/bin/python benchmarks/bench_stats.py --quick

One worker process on this host (so warm reads take the short-circuit socket and held page
handles, as on a training node) over a local-directory store: only warm epochs are measured, and
they never reach the store.

1. **Overhead.** Two datasets over the same warm samples, one with ``stats=True`` (the default:
   counters published into the shared block after every call) and one with ``stats=False``.
   Warm epochs alternate on/off (pairs, the order flipped every pair), DataLoader workers 0 and
   2, small samples (4 KiB, batch 64: the most calls per byte; 3x the pairs) and 256 KiB ones
   (batch 32). Per
   setting: the median of the pairs' on/off items/s ratios. Beside it, the cost of one publish
   (``values`` + ``publish``) timed alone, as a share of a warm batch's time: a figure the shared
   machine's noise cannot blur.
2. **Data stall.** ``CacheDataset`` and ``CacheIterableDataset`` (tar shards), warm, DataLoader
   workers 2, batch 32: a warm epoch without a step gives a batch's read time at that rate, then
   epochs with a simulated step of 2x that (``time.sleep``, as a GPU step leaves the CPU free)
   are timed by ``StepTimer``: its data-wait share after each pass's first batch and its report.

Writes benchmarks/results/stats-<timestamp>.json (and latest-stats.json) and a PNG beside it
(``--plot RUN.json`` draws an earlier run's).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.multiprocessing
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from read_common import machine_info  # noqa: E402

from cachefs import StepTimer  # noqa: E402
from cachefs.client.datasets.dataset import CacheDataset  # noqa: E402
from cachefs.client.transport.handles import Page  # noqa: E402
from cachefs.client.datasets.iterable import CacheIterableDataset  # noqa: E402
from cachefs.client.stats.jobstats import ProcessCounts  # noqa: E402
from cachefs.client.datasets.shards import write_tar_shards  # noqa: E402
from cachefs.client.transport.shortcircuit import ShortCircuitReader  # noqa: E402
from cachefs.local import worker_process  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MOUNT = "bench"


def _tar_sample(sample: dict[str, Any]) -> Any:
    return sample["bin"]


@contextlib.contextmanager
def worker(tmp: str, store: str) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    proc = worker_process({MOUNT: store}, os.path.join(tmp, "cache"), quota="8GiB", env=env,
                          log_path=os.path.join(tmp, "worker.log"))
    proc.start(timeout=60)
    try:
        yield proc.address
    finally:
        proc.stop()
        proc.kill()


def write_samples(store: str, prefix: str, n: int, size: int) -> None:
    rng = np.random.default_rng(size)
    noise = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    os.makedirs(os.path.join(store, prefix), exist_ok=True)
    for i in range(n):
        with open(os.path.join(store, prefix, f"{i:06d}.bin"), "wb") as f:
            f.write(f"{i:08d}".encode() + noise[8:])


def run_epoch(loader: DataLoader, step: float = 0.0, timer: StepTimer | None = None, track: Any = None) -> float:
    """Items per second of one pass (every sample counted), with ``step`` seconds of 'compute' a batch."""
    t0 = time.perf_counter()
    n = 0
    batches = track(loader) if track is not None else loader
    for batch in (timer(batches, loader=loader) if timer is not None else batches):
        n += len(batch)
        if step:
            time.sleep(step)
    return n / (time.perf_counter() - t0)


def loader_for(ds: Any, workers: int, batch: int) -> DataLoader:
    # The default collate: a batch of equal-sized samples is stacked into one tensor (in shared
    # memory when made in a DataLoader worker), as a training job's loader does.
    kw: dict[str, Any] = dict(batch_size=batch, num_workers=workers, timeout=300 if workers else 0)
    if isinstance(ds, CacheDataset):
        kw["sampler"] = ds.sampler()
    return DataLoader(ds, **kw)


def publish_cost_us(ds: CacheDataset, loader: DataLoader, rounds: int = 20_000) -> float:
    """One publish (values + publish), timed alone in this process, in microseconds."""
    run_epoch(loader_for(ds, 0, loader.batch_size))  # builds this process's parts
    parts = ds._local.get()
    counts: ProcessCounts = parts.counts
    t0 = time.perf_counter()
    for _ in range(rounds):
        ds._counters.publish(counts.row, counts.values(parts.fs.session, parts.prefetcher, parts.hinter))
    return (time.perf_counter() - t0) / rounds * 1e6


def tally_cost_us(rounds: int = 200_000) -> float:
    """The hit/miss count of one short-circuit read of one page (always on, stats or not), timed
    alone: an upper bound of what a held batch read adds per sample (it counts inline, per batch)."""
    reader = ShortCircuitReader("/nonexistent", handles=0)  # no I/O until a request
    pages = [Page(-1, 0, 4096)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        reader._tally(pages)
    return (time.perf_counter() - t0) / rounds * 1e6


def overhead(address: str, prefix: str, size: int, batch: int, workers: list[int], pairs: int) -> list[dict[str, Any]]:
    so = {"workers": address}
    on = CacheDataset.from_prefix(f"cachefs://{MOUNT}/{prefix}", storage_options=so, rank=0, world_size=1)
    off = CacheDataset.from_prefix(f"cachefs://{MOUNT}/{prefix}", storage_options=so, rank=0, world_size=1,
                                   stats=False)
    rows = []
    for w in workers:
        loaders = {"on": loader_for(on, w, batch), "off": loader_for(off, w, batch)}
        for name in ("on", "off", "on", "off"):  # cold, then warm once each (handles held in-process at w=0)
            run_epoch(loaders[name])
        rates: dict[str, list[float]] = {"on": [], "off": []}
        ratios = []
        for k in range(pairs):
            order = ("on", "off") if k % 2 == 0 else ("off", "on")
            got = {name: run_epoch(loaders[name]) for name in order}
            for name, v in got.items():
                rates[name].append(v)
            ratios.append(got["on"] / got["off"])
        row = {"samples": len(on), "size": size, "batch": batch, "num_workers": w, "pairs": pairs,
               "items_per_s_on": [round(v, 1) for v in rates["on"]],
               "items_per_s_off": [round(v, 1) for v in rates["off"]],
               "median_on": round(statistics.median(rates["on"]), 1),
               "median_off": round(statistics.median(rates["off"]), 1),
               "median_pair_ratio_on_off": round(statistics.median(ratios), 4)}
        if w == 0:
            cost, tally = publish_cost_us(on, loaders["on"]), tally_cost_us()
            batch_us = 1e6 * batch / row["median_off"]
            row.update(publish_us=round(cost, 2), tally_us_per_sample=round(tally, 3), warm_batch_us=round(batch_us, 1),
                       publish_share_of_batch=round(cost / batch_us, 5),
                       counting_share_of_batch=round((cost + batch * tally) / batch_us, 5))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def stall(address: str, store: str, n: int, size: int, batch: int, epochs: int,
          fresh: bool = True) -> list[dict[str, Any]]:
    so = {"workers": address}
    if fresh:
        write_tar_shards(((f"s/{i:06d}", {"bin": open(os.path.join(store, "stall", f"{i:06d}.bin"), "rb").read()})
                          for i in range(n)), os.path.join(store, "tars"), shard_bytes=64 << 20)
    sets = {"map": CacheDataset.from_prefix(f"cachefs://{MOUNT}/stall", storage_options=so, rank=0, world_size=1),
            "tar": CacheIterableDataset.from_prefix(f"cachefs://{MOUNT}/tars", storage_options=so, batch_size=batch,
                                                    rank=0, world_size=1, transform=_tar_sample, index_cache="")}
    rows = []
    for name, ds in sets.items():
        loader = loader_for(ds, 2, batch)
        run_epoch(loader)  # cold: fills the cache
        rate = max(run_epoch(loader) for _ in range(2))  # warm, no step: the read rate at workers 2
        step = 2 * batch / rate  # 2x a batch's read time
        timer = StepTimer(threshold=0.05, window=100_000)  # every step kept: the waits' median and p90
        shares = []
        for e in range(epochs):
            before = (timer.wait_s, timer.compute_s)
            ds.set_epoch(e + 1)
            run_epoch(loader, step=step, timer=timer, track=ds.track)
            wait, compute = timer.wait_s - before[0], timer.compute_s - before[1]
            shares.append(round(wait / (wait + compute), 4))
        s = timer.summary()
        waits = sorted(w for w, _ in timer.recent)
        row = {"dataset": name, "samples": n, "size": size, "batch": batch, "num_workers": 2,
               "warm_items_per_s": round(rate, 1), "step_s": round(step, 5), "epochs": epochs,
               "wait_share_after_first_batch": round(s.wait_share, 4), "per_epoch_wait_share": shares,
               "startup_s": round(s.startup_s, 3),
               "median_wait_ms": round(1000 * statistics.median(waits), 2) if waits else None,
               "p90_wait_ms": round(1000 * waits[int(0.9 * (len(waits) - 1))], 2) if waits else None,
               "max_wait_ms": round(1000 * waits[-1], 2) if waits else None,
               "report": timer.report(), "stats": ds.stats()}
        print(json.dumps({k: v for k, v in row.items() if k != "stats"}), flush=True)
        print(row["report"], flush=True)
        rows.append(row)
    return rows


def plot(doc: dict[str, Any], path: str) -> str | None:
    """Overhead pairs (items/s on vs off) and the stall runs' per-epoch data-wait shares."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot"
    over, stall_rows = doc.get("overhead", []), doc.get("stall", [])
    panels = [p for p in (over and "overhead", stall_rows and "stall") if p]
    if not panels:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "overhead":
            labels = [f"{r['size'] >> 10} KiB, w={r['num_workers']}" for r in over]
            ratios = [r["median_pair_ratio_on_off"] for r in over]
            ax.bar(range(len(over)), ratios, color="#4c72b0")
            for i, r in enumerate(over):
                pairs = [a / b for a, b in zip(r["items_per_s_on"], r["items_per_s_off"])]
                ax.scatter([i] * len(pairs), pairs, s=8, color="black", zorder=3)
            ax.axhline(0.98, color="red", linewidth=0.8, linestyle="--", label="0.98 (2% slower)")
            ax.set_xticks(range(len(over)), labels, fontsize=8)
            ax.set_ylabel("items/s, counters on / off (bar: median pair; dots: pairs)")
            ax.set_title("Counter overhead, warm epochs")
            ax.legend(fontsize=8)
        else:
            for r in stall_rows:
                label = f"{r['dataset']} ({r.get('sharing_strategy', '')}): {100 * r['wait_share_after_first_batch']:.1f}%"
                ax.plot(range(1, len(r["per_epoch_wait_share"]) + 1), [100 * v for v in r["per_epoch_wait_share"]],
                        marker="o", label=label)
            ax.axhline(5, color="red", linewidth=0.8, linestyle="--", label="target 5%")
            ax.set_xlabel("epoch (warm, step = 2x a batch's read time, DataLoader workers 2)")
            ax.set_ylabel("data-wait share after the first batch, %")
            ax.set_title("Data stall by StepTimer")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer samples and pairs")
    p.add_argument("--pairs", type=int, help="on/off epoch pairs per setting (default 9; 5 with --quick)")
    p.add_argument("--parts", default="overhead,stall")
    p.add_argument("--stall-epochs", type=int, default=3)
    p.add_argument("--sharing-strategies", default="file_descriptor,file_system",
                   help="torch.multiprocessing sharing strategies to run the stall part with (one run each)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON (beside it)")
    args = p.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            note = plot(json.load(f), args.plot[:-5] + ".png")
        print(note or f"wrote {args.plot[:-5]}.png")
        return 0
    pairs = args.pairs or (5 if args.quick else 9)
    small_n, big_n = (2000, 400) if args.quick else (4000, 1000)
    parts = args.parts.split(",")
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-stats-")
    started = dt.datetime.now(dt.timezone.utc)
    doc: dict[str, Any] = {"benchmark": "stats", "started": started.isoformat(), "args": vars(args),
                           "machine": machine_info(), "store": "local directory (warm epochs only)"}
    try:
        store = os.path.join(tmp, "store")
        write_samples(store, "small", small_n, 4 << 10)
        write_samples(store, "stall", big_n, 256 << 10)
        with worker(tmp, store) as address:
            if "overhead" in parts:
                # small samples: short epochs, the most calls per byte: 3x the pairs
                doc["overhead"] = (overhead(address, "small", 4 << 10, 64, [0, 2], 3 * pairs)
                                   + overhead(address, "stall", 256 << 10, 32, [0, 2], pairs))
            if "stall" in parts:
                doc["stall"] = []
                for strategy in args.sharing_strategies.split(","):
                    torch.multiprocessing.set_sharing_strategy(strategy)
                    print(f"sharing strategy: {strategy}", flush=True)
                    rows = stall(address, store, big_n, 256 << 10, 32, args.stall_epochs, fresh=not doc["stall"])
                    doc["stall"] += [{"sharing_strategy": strategy, **r} for r in rows]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(args.out, f"stats-{stamp}.json")
    for target in (path, os.path.join(args.out, "latest-stats.json")):
        with open(target, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    note = plot(doc, path[:-5] + ".png")
    print(f"wrote {path}" + (f" ({note})" if note else f" and {path[:-5]}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
