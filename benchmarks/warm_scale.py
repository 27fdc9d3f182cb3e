"""#46: a warm epoch of small objects against the same loop over the local files (``bench_scale.py --warm-epoch``).

A tree of ``objects`` files of 4 KiB, 1,000 a directory (bench_listing.py's ``make_tree``: an
existing tree with its ``.made-<N>`` marker is reused, e.g. /tmp/cachefs-tree1m); a real cluster
as ``cachefs local`` starts it (cold_small.py: a master and one worker, processes; the tree a
local-directory mount; the worker's cache on the same disk, its quota N x 8 KiB + 1 GiB).

1. The fill: ``--fill load`` (a ``cachefs load`` job of the prefix, then ``from_prefix``) or
   ``--fill epoch`` (``from_prefix``, then a cold epoch 0 under the DataLoader below). Reported:
   ``fill_s``, ``fill_objects_per_s`` and ``list_s`` (``from_prefix``'s listing).
2. ``--rounds`` rounds, each one warm cachefs epoch and one local epoch, in the same order (the
   order of the dataset's plan for that epoch, ``ds.plan.order``), which one goes first
   alternating by round. cachefs: ``DataLoader(ds, batch_size=64, num_workers=2,
   sampler=ds.sampler(), collate_fn=to_bytes)``. local: a plain torch Dataset over the same files
   by sample id (``open(path, "rb").read()``), ``DataLoader(batch_size=64, num_workers=2,
   sampler=<the epoch's order>, collate_fn=to_bytes)``. ``--persistent-workers``: both loaders
   made once with ``persistent_workers=True`` (else a loader, and its workers, an epoch). ``to_bytes`` turns each sample into ``bytes`` (the cachefs sample is a
   uint8 tensor) in the DataLoader worker; the main process takes each sample's crc32 (both).

Reported per epoch: samples/s (the whole ``for batch in loader`` including the DataLoader workers'
start), the cachefs worker's CPU (user, system: ``/proc/PID/stat``) per sample, the training
process's CPU (its own and its reaped DataLoader workers') per sample, and RSS (VmRSS) half way
through of the cachefs worker, the training process and each DataLoader worker. ``ratio``:
median cachefs samples/s / median local samples/s (the target is >= 0.9). ``wrong``: positions
whose crc32 differs from that of the file read by the local epoch of the same round (must be 0).
Note: make_tree writes the same 4 KiB to every file, so ``wrong`` catches corrupted or missing
bytes but not a sample read in the wrong place.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from statistics import median
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_listing import make_tree  # noqa: E402
from cold_small import _cpu  # noqa: E402

MOUNT = "data"
OBJECT_BYTES = 4096  # make_tree's


def to_bytes(batch: list[Any]) -> list[bytes]:
    """The collate function of both loaders: the samples as a list of ``bytes`` (no stacking)."""
    return [x if isinstance(x, bytes) else x.numpy().tobytes() for x in batch]


class LocalFiles(Dataset):
    """Sample ``i``: the bytes of the file ``paths[i]`` (a numpy ``S`` array: no per-path object a fork copies)."""

    def __init__(self, paths: np.ndarray) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, position: int) -> bytes:
        with open(self.paths[position], "rb") as f:
            return f.read()


class OrderSampler:
    """The local loop's sampler: the epoch's order, set per round (in the main process, so a
    persistent DataLoader's workers need not know it)."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mem(pid: int) -> dict[str, int]:
    """Rss, Pss, Anonymous and private bytes of the process (``/proc/PID/smaps_rollup``): VmRSS
    counts shared file pages (mapped page files, the index's memfd) in every process that maps them."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss", "Anonymous", "Private_Clean", "Private_Dirty", "Shared_Clean"):
                    out[key.lower()] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    if out:
        out["private"] = out.pop("private_clean", 0) + out.pop("private_dirty", 0)
    return out


def _ps() -> list[str]:
    """The busiest processes on the machine (what else was running)."""
    out = subprocess.run(["ps", "-eo", "pid,pcpu,rss,etime,args", "--sort=-pcpu", "--cols", "160"],
                         capture_output=True, text=True).stdout.splitlines()
    return [line.rstrip() for line in out[:12]]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _epoch(loader: DataLoader, crcs: np.ndarray, worker_pid: int) -> dict[str, Any]:
    """One pass over ``loader``: crc32 of each sample into ``crcs`` (by position), times, CPU, RSS."""
    n = len(crcs)
    user0, sys0, _ = _cpu(worker_pid)
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = getattr(loader, "_iterator", None)  # a persistent loader's workers, started by an earlier epoch
    live_pids = [w.pid for w in getattr(live, "_workers", [])] if loader.persistent_workers else []
    live0 = sum(sum(_cpu(p)[:2]) for p in live_pids)
    t0 = time.perf_counter()
    it = iter(loader)
    pos, rss = 0, {}
    for batch in it:
        for blob in batch:
            crcs[pos] = zlib.crc32(blob) if len(blob) == OBJECT_BYTES else 0xFFFFFFFF
            pos += 1
        if not rss and pos >= n // 2:
            pids = [w.pid for w in getattr(it, "_workers", [])]
            rss = {"cachefs_worker_rss": _rss(worker_pid), "train_rss": _rss(os.getpid()),
                   "loader_worker_rss": [_rss(p) for p in pids],
                   "cachefs_worker_mem": _mem(worker_pid), "train_mem": _mem(os.getpid()),
                   "loader_worker_mem": [_mem(p) for p in pids]}
    took = time.perf_counter() - t0
    if loader.persistent_workers:  # its workers live on: their CPU from /proc (started now, or before)
        pids = [w.pid for w in getattr(it, "_workers", [])]
        live_s = sum(sum(_cpu(p)[:2]) for p in pids) - (live0 if pids == live_pids else 0)
    else:
        live_s = 0.0
    del it
    user1, sys1, _ = _cpu(worker_pid)
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the DataLoader workers, reaped at the epoch's end
    train_s = (me1.ru_utime + me1.ru_stime - me0.ru_utime - me0.ru_stime
               + kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime + live_s)
    return {"samples": pos, "epoch_s": round(took, 3), "samples_per_s": round(pos / took, 1),
            "worker_cpu_us_per_sample": round(((user1 - user0) + (sys1 - sys0)) / max(pos, 1) * 1e6, 1),
            "worker_user_us_per_sample": round((user1 - user0) / max(pos, 1) * 1e6, 1),
            "worker_sys_us_per_sample": round((sys1 - sys0) / max(pos, 1) * 1e6, 1),
            "train_cpu_us_per_sample": round(train_s / max(pos, 1) * 1e6, 1),
            "loadavg": round(os.getloadavg()[0], 2), **rss}


def _load_job(master: str) -> dict[str, Any]:
    import json
    out = subprocess.run([sys.executable, "-m", "cachefs.cli", "load", "--master", master, f"{MOUNT}/train",
                          "-q", "--json"], capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        raise RuntimeError(f"cachefs load failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def check_space(base: str, objects: int) -> tuple[int, int]:
    """(quota bytes, needed bytes); raises when ``base``'s disk has not the room for the cache."""
    quota = objects * 8192 + (1 << 30)  # a 4 KiB page and its bookkeeping per object, and room
    free = shutil.disk_usage(base).free
    need = quota + (2 << 30)
    if free < need:
        raise SystemExit(f"{objects} objects need about {need / 2**30:.1f} GiB free on {base}'s disk; "
                         f"{free / 2**30:.1f} GiB is")
    return quota, need


def measure(objects: int, tree: str, base: str | None = None, fill: str = "load", rounds: int = 3,
            loader_workers: int = 2, batch: int = 64, seed: int = 46, persistent: bool = False,
            metadata_ttl: float | None = None) -> dict[str, Any]:
    """``persistent``: both loaders made once with ``persistent_workers=True`` (their workers
    outlive the epoch) instead of a loader, and its workers, per epoch. ``metadata_ttl``: the
    worker's (default: its own default); one shorter than a warm epoch makes every epoch refresh
    every object, as a million objects do at the default."""
    import cachefs
    from cachefs.local import LocalCluster

    base = base or tempfile.gettempdir()
    quota, _ = check_space(base, objects)
    others = [m for m in os.listdir(tree) if m.startswith(".made-") and m != f".made-{objects}"] \
        if os.path.isdir(tree) else []
    if others:  # make_tree would add files to another size's tree (and the prefix would list them all)
        raise SystemExit(f"{tree} holds a tree of another size ({others[0]}): name the matching --dir")
    made_s = make_tree(tree, objects)
    marker = os.path.join(tree, f".made-{objects}")
    assert os.path.exists(marker), f"{tree} has no {marker}"
    before = {"uptime": _uptime(), "ps": _ps()}
    tmp = tempfile.mkdtemp(prefix="cachefs-warmepoch-", dir=base)
    row: dict[str, Any] = {"mode": "warm-epoch", "objects": objects, "object_bytes": OBJECT_BYTES, "tree": tree,
                           "tree_made_s": round(made_s, 1), "fill": fill, "loader_workers": loader_workers,
                           "batch": batch, "seed": seed, "quota_bytes": quota, "persistent_workers": persistent,
                           "metadata_ttl": metadata_ttl}
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_"))}
        if metadata_ttl is not None:
            env["CACHEFS_WORKER_METADATA_TTL"] = str(metadata_ttl)
        with LocalCluster(os.path.join(tmp, "cluster"), workers=1, mounts={MOUNT: tree}, env=env,
                          quota=f"{-(-quota // 2**30)}GiB") as cluster:
            cluster.wait_for_workers(1, timeout=60)
            pid = cluster.workers[0].pid
            opts = {"master": cluster.master_address}

            def listing() -> Any:
                t0 = time.perf_counter()
                ds = cachefs.CacheDataset.from_prefix(f"cachefs://{MOUNT}/train", storage_options=opts,
                                                      shuffle=True, seed=seed)
                assert len(ds) == objects, (len(ds), objects)
                row["list_s"] = round(time.perf_counter() - t0, 2)
                return ds

            made: dict[str, DataLoader] = {}

            def cachefs_loader(ds: Any) -> DataLoader:
                if persistent and "cachefs" in made:
                    return made["cachefs"]
                loader = made["cachefs"] = DataLoader(ds, batch_size=batch, sampler=ds.sampler(),
                                                      num_workers=loader_workers, collate_fn=to_bytes,
                                                      persistent_workers=persistent)
                return loader

            cpu0 = sum(_cpu(pid)[:2])
            if fill == "load":
                t0 = time.perf_counter()
                job = _load_job(cluster.master_address)
                fill_s = time.perf_counter() - t0
                row["fill_job"] = {k: job.get(k) for k in ("state", "objects_total", "objects_done",
                                                           "objects_failed", "bytes_done", "bytes_skipped")}
                ds = listing()
            else:
                ds = listing()
                time.sleep(0.5)
                t0 = time.perf_counter()
                cold = _epoch(cachefs_loader(ds), np.zeros(objects, np.uint32), pid)
                fill_s = time.perf_counter() - t0
                row["fill_epoch"] = cold
            row.update(fill_s=round(fill_s, 2), fill_objects_per_s=round(objects / fill_s, 1),
                       fill_worker_cpu_s=round(sum(_cpu(pid)[:2]) - cpu0, 2),
                       worker_rss_after_fill=_rss(pid), dataset_stats_after_fill=ds.stats())
            prefix = f"cachefs://{MOUNT}/"
            paths = ds.paths
            first = str(paths[0])
            assert first.startswith(prefix), first
            root = tree.rstrip("/") + "/"
            local_paths = np.array([root + str(p)[len(prefix):] for p in paths], dtype=bytes)  # by sample id
            local_order = OrderSampler()
            local = DataLoader(LocalFiles(local_paths), batch_size=batch, sampler=local_order,
                               num_workers=loader_workers, collate_fn=to_bytes, persistent_workers=persistent)
            runs: list[dict[str, Any]] = []
            wrong = 0
            for r in range(1, rounds + 1):
                ds.set_epoch(r)
                local_order.order = np.asarray(ds.plan.order).tolist()
                got = {"cachefs": np.zeros(objects, np.uint32), "local": np.zeros(objects, np.uint32)}
                sides = ("cachefs", "local") if r % 2 else ("local", "cachefs")
                for side in sides:
                    loader = cachefs_loader(ds) if side == "cachefs" else local
                    one = {"round": r, "epoch": r, "side": side, **_epoch(loader, got[side], pid)}
                    del loader
                    runs.append(one)
                    print(one, flush=True)
                bad = int(np.count_nonzero(got["cachefs"] != got["local"]))
                short = sum(objects - run["samples"] for run in runs[-2:])
                wrong += bad + short
            made.clear()
            del local
            row["worker_rss_end"] = _rss(pid)
            row["worker_mem_end"] = _mem(pid)
            row["dataset_stats"] = ds.stats()
            row["train_rss_end"] = _rss(os.getpid())
            del ds
        rates = {s: [run["samples_per_s"] for run in runs if run["side"] == s] for s in ("cachefs", "local")}
        row.update(runs=runs, cachefs_samples_per_s=rates["cachefs"], local_samples_per_s=rates["local"],
                   cachefs_median=median(rates["cachefs"]), local_median=median(rates["local"]),
                   ratio=round(median(rates["cachefs"]) / median(rates["local"]), 3), wrong=wrong,
                   worker_rss_max=max(run.get("cachefs_worker_rss", 0) for run in runs),
                   train_rss_max=max(run.get("train_rss", 0) for run in runs),
                   worker_cpu_us_per_sample_cachefs=median(run["worker_cpu_us_per_sample"] for run in runs
                                                          if run["side"] == "cachefs"),
                   train_cpu_us_per_sample_cachefs=median(run["train_cpu_us_per_sample"] for run in runs
                                                         if run["side"] == "cachefs"),
                   train_cpu_us_per_sample_local=median(run["train_cpu_us_per_sample"] for run in runs
                                                       if run["side"] == "local"),
                   before=before, after={"uptime": _uptime(), "ps": _ps()})
        return row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plot(row: dict[str, Any], path: str) -> str:
    """samples/s per epoch, both sides; '' or why there is no PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no matplotlib: no PNG"
    fig, ax = plt.subplots(figsize=(7, 4))
    for side, marker in (("cachefs", "o"), ("local", "s")):
        runs = [r for r in row["runs"] if r["side"] == side]
        ax.plot([r["round"] for r in runs], [r["samples_per_s"] for r in runs], marker=marker, label=side)
    ax.set_xlabel("round (epoch)")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"warm epoch, {row['objects']:,} x 4 KiB, DataLoader workers {row['loader_workers']}, "
                 f"batch {row['batch']}: ratio {row['ratio']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ""


