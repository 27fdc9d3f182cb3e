"""DataLoader epochs through `cachefs fuse` (bench_fuse.py's second part), side by side.

One map-style Dataset class (bench_dataset.py's ``LocalFiles``: open, one aligned ``readinto``,
close) reads the same samples from local files and from the mount's paths (every mount given:
e.g. the default one and one with ``revalidate_open`` off), against cachefs's own
``CacheDataset`` over the same objects through the same worker. Workers 0 and 2, batch 32,
each loader a cold epoch and then three warm ones (the median kept); every epoch checks each
sample came exactly once.
Cold: the worker's cache emptied (``Free``) and, for paths, the kernel's copies dropped
(``posix_fadvise(DONTNEED)``: local files then come from the disk). Warm: the epoch after.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from bench_dataset import LocalFiles, epoch, sample_bytes

PREFIX = "epochs"
BATCH = 32
WARM_EPOCHS = 3


def put_samples(s3: Any, bucket: str, local_root: str, n: int, size: int, seed: int = 11) -> list[str]:
    """``n`` objects of ``size`` bytes (each starting with its index) in the bucket and as local files."""
    noise = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    keys = [f"{PREFIX}/sample-{i:06d}.bin" for i in range(n)]
    for i, key in enumerate(keys):
        data = sample_bytes(i, size, noise)
        s3.put_object(Bucket=bucket, Key=key, Body=data)
        path = os.path.join(local_root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return keys


def drop_kernel_copies(paths: list[str]) -> None:
    os.sync()  # dirty pages (files just written) are not dropped
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_epochs(keys: list[str], size: int, local_root: str, mounts: dict[str, str], worker: str, mount: str,
               free: Callable[[str], None], workers: tuple[int, ...] = (0, 2)) -> list[dict[str, Any]]:
    """Rows of {loader, num_workers, cold/warm epoch}; ``mounts``: loader name -> the mount's folder."""
    from cachefs.client.dataset import CacheDataset

    def paths(root: str) -> list[str]:
        return [os.path.join(root, key) for key in keys]

    ds = CacheDataset([f"cachefs://{mount}/{key}" for key in keys], storage_options={"workers": worker},
                      sizes=[size] * len(keys), rank=0, world_size=1)
    kw = lambda w: dict(batch_size=BATCH, num_workers=w, timeout=300 if w else 0)  # noqa: E731
    loaders: dict[str, tuple[Callable[[int], DataLoader], Callable[[], None]]] = {
        "local files": (lambda w: DataLoader(LocalFiles(paths(local_root), size), shuffle=True, **kw(w)),
                        lambda: drop_kernel_copies(paths(local_root)))}
    for name, root in mounts.items():
        loaders[name] = (lambda w, root=root: DataLoader(LocalFiles(paths(root), size), shuffle=True, **kw(w)),
                         # the kernel's copies first: dropping them opens every file, and an open
                         # through the mount fetches its first MiB (the read that follows an open)
                         lambda root=root: (drop_kernel_copies(paths(root)), free(PREFIX)))
    loaders["CacheDataset"] = (lambda w: DataLoader(ds, sampler=ds.sampler(), **kw(w)), lambda: free(PREFIX))
    rows = []
    epoch(loaders["local files"][0](0), len(keys))  # not measured: the first DataLoader's start-up
    for w in workers:
        for name, (make, make_cold) in loaders.items():
            make_cold()
            cold = epoch(make(w), len(keys))
            warm = sorted((epoch(make(w), len(keys)) for _ in range(WARM_EPOCHS)), key=lambda e: e["items_per_s"])
            warm = warm[len(warm) // 2]  # the median warm epoch (the machine is shared)
            rows.append({"loader": name, "num_workers": w, "cold": cold, "warm": warm})
            print(f"  epoch {name:34} workers={w}: cold {cold['items_per_s']:8.0f} items/s, "
                  f"warm {warm['items_per_s']:8.0f} items/s", flush=True)
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
