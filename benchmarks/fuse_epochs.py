"""DataLoader epochs through `cachefs fuse` (bench_fuse.py's second part), side by side.

One map-style Dataset class (bench_dataset.py's ``LocalFiles``: open, one aligned ``readinto``,
close) reads the samples from local files and from the mounts' paths (every mount given: e.g.
the default one and one with ``revalidate_open`` off), against cachefs's own ``CacheDataset``
through the same worker. Each loader reads its own copy of the samples (its own prefix), so one
loader's cold epoch (the worker's ``Free`` of that prefix) leaves the others warm. Workers 0 and 2,
batch 32: per worker count, each loader's cold epoch, then ``WARM_ROUNDS`` rounds of one warm
epoch of every loader in turn (the machine's other load falls on all alike), the median kept.
Cold: the worker's cache emptied and, for paths, the kernel's copies dropped
(``posix_fadvise(DONTNEED)`` after a sync: local files then come from the disk). Every epoch
checks that each sample came exactly once.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from bench_dataset import LocalFiles, epoch, sample_bytes

PREFIX = "epochs"
BATCH = 32
WARM_ROUNDS = 5


def copies_for(mounts: dict[str, str]) -> dict[str, str]:
    """Loader name -> the folder name of its own copy of the samples."""
    return {"local files": "local", **{name: f"mount{i}" for i, name in enumerate(mounts)}, "CacheDataset": "dataset"}


def put_samples(s3: Any, bucket: str, local_root: str, n: int, size: int, copies: list[str],
                seed: int = 11) -> dict[str, list[str]]:
    """``n`` objects of ``size`` bytes (each starting with its index) under ``epochs/<copy>/`` in the
    bucket for each copy, and once as local files; the keys of each copy."""
    noise = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    keys = {copy: [f"{PREFIX}/{copy}/sample-{i:06d}.bin" for i in range(n)] for copy in copies}
    for i in range(n):
        data = sample_bytes(i, size, noise)
        for copy in copies:
            s3.put_object(Bucket=bucket, Key=keys[copy][i], Body=data)
        path = os.path.join(local_root, PREFIX, "local", f"sample-{i:06d}.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    keys["local"] = [f"{PREFIX}/local/sample-{i:06d}.bin" for i in range(n)]
    return keys


def drop_kernel_copies(paths: list[str]) -> None:
    os.sync()  # dirty pages (files just written) are not dropped
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_epochs(keys: dict[str, list[str]], size: int, local_root: str, mounts: dict[str, str], worker: str,
               mount: str, free: Callable[[str], None], workers: tuple[int, ...] = (0, 2)) -> list[dict[str, Any]]:
    """Rows of {loader, num_workers, cold, warm (median), warm_items_per_s (every round)}.
    ``mounts``: loader name -> the mount's folder; ``keys``: copy name (a loader's) -> its keys."""
    from cachefs.client.datasets.dataset import CacheDataset

    n = len(keys["local"])

    def paths(root: str, copy: str) -> list[str]:
        return [os.path.join(root, key) for key in keys[copy]]

    copy = copies_for(mounts)
    ds = CacheDataset([f"cachefs://{mount}/{key}" for key in keys[copy["CacheDataset"]]],
                      storage_options={"workers": worker}, sizes=[size] * n, rank=0, world_size=1)
    kw = lambda w: dict(batch_size=BATCH, num_workers=w, timeout=300 if w else 0)  # noqa: E731
    local = paths(local_root, "local")
    loaders: dict[str, tuple[Callable[[int], DataLoader], Callable[[], None]]] = {
        "local files": (lambda w: DataLoader(LocalFiles(local, size), shuffle=True, **kw(w)),
                        lambda: drop_kernel_copies(local))}
    for name, root in mounts.items():
        mine = paths(root, copy[name])
        # The kernel's copies first: dropping them opens every file, and an open through the
        # mount fetches the file's first MiB (for the read that follows an open).
        loaders[name] = (lambda w, mine=mine: DataLoader(LocalFiles(mine, size), shuffle=True, **kw(w)),
                         lambda mine=mine, name=name: (drop_kernel_copies(mine), free(f"{PREFIX}/{copy[name]}")))
    loaders["CacheDataset"] = (lambda w: DataLoader(ds, sampler=ds.sampler(), **kw(w)),
                               lambda: free(f"{PREFIX}/{copy['CacheDataset']}"))
    epoch(loaders["local files"][0](0), n)  # not measured: the first DataLoader's start-up
    rows = []
    for w in workers:
        cold = {}
        for name, (make, make_cold) in loaders.items():
            make_cold()
            cold[name] = epoch(make(w), n)
        warm: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
        for _ in range(WARM_ROUNDS):
            for name, (make, _cold) in loaders.items():
                warm[name].append(epoch(make(w), n))
        for name in loaders:
            speeds = [e["items_per_s"] for e in warm[name]]
            median = sorted(warm[name], key=lambda e: e["items_per_s"])[len(speeds) // 2]
            rows.append({"loader": name, "num_workers": w, "cold": cold[name], "warm": median,
                         "warm_items_per_s": speeds})
            print(f"  epoch {name:34} workers={w}: cold {cold[name]['items_per_s']:8.0f} items/s, warm "
                  f"{statistics.median(speeds):8.0f} items/s (median of {len(speeds)})", flush=True)
    return rows
def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """items/s of each mount (and CacheDataset) over local files' and over CacheDataset's, per case."""
    out = {}
    by = {(r["loader"], r["num_workers"]): r for r in rows}
    for (name, w), row in by.items():
        if name == "local files":
            continue
        for kind in ("cold", "warm"):
            mine = row[kind]["items_per_s"]
            out[f"{name} / local files, workers={w}, {kind}"] = round(mine / by[("local files", w)][kind]["items_per_s"], 3)
            if name != "CacheDataset":
                out[f"{name} / CacheDataset, workers={w}, {kind}"] = round(
                    mine / by[("CacheDataset", w)][kind]["items_per_s"], 3)
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["num_workers"] for r in rows})
    fig, axes = plt.subplots(1, len(workers), figsize=(6 * len(workers), 3.8), squeeze=False)
    for ax, w in zip(axes[0], workers):
        mine = [r for r in rows if r["num_workers"] == w]
        names = [r["loader"] for r in mine]
        y = np.arange(len(names))
        ax.barh(y - 0.2, [r["cold"]["items_per_s"] for r in mine], 0.4, label="cold", color="#a8c4e0")
        ax.barh(y + 0.2, [r["warm"]["items_per_s"] for r in mine], 0.4, label="warm", color="#4878a8")
        ax.set_yticks(y, names)
        ax.set_xlabel("items/s (256 KiB samples, batch 32)")
        ax.set_title(f"DataLoader num_workers={w}")
        ax.legend()
    fig.suptitle("DataLoader epochs through cachefs fuse (benchmarks/bench_fuse.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
