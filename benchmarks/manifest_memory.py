"""Peak memory of reading a manifest of N paths into a CacheDataset's index (#46).

    .venv/bin/python benchmarks/manifest_memory.py [N]

Each case runs in fresh processes (``spawn``: a fork would share the parent's heap): one
reports tracemalloc's peak over the read (Python's allocations), one the growth of the peak RSS
over it (everything: pyarrow's buffers, the allocator's arenas). ``list`` is what ``from_manifest`` did before
#46 (the text read whole, a list of every path, then the index built from the list);
``stream`` is client/datasets/manifests.py. Sizes are given where the format has them and
are otherwise a constant from a stub resolver: no cluster is involved, only the parsing.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import tracemalloc

from cachefs.client.datasets.manifests import manifest_index
from cachefs.client.datasets.sampleindex import IndexBuilder


def _write(kind: str, path: str, n: int) -> None:
    names = (f"cachefs://data/imagenet/train/n{i // 1300:08d}/img_{i:08d}.JPEG" for i in range(n))
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        paths = list(names)
        pq.write_table(pa.table({"path": paths, "size": [100_000 + i % 977 for i in range(n)]}), path)
        return
    with open(path, "w") as f:
        for i, name in enumerate(names):
            f.write(json.dumps({"path": name, "size": 100_000 + i % 977}) + "\n" if kind == "jsonl" else name + "\n")


def _old_text(path: str) -> object:
    """from_manifest before #46, for a text manifest (sizes then resolved, here a stub)."""
    with open(path, "rb") as f:
        text = f.read().decode()
    paths = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    sizes = [100_000] * len(paths)
    builder = IndexBuilder()
    for p, s in zip(paths, sizes):
        builder.add(p, s)
    return builder.finish()


def _new(path: str) -> object:
    with open(path, "rb") as f:
        return manifest_index(path, f, lambda paths: [100_000] * len(paths))


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _measure(fn, path: str, traced: bool, out) -> None:
    """tracemalloc's peak (``traced``), else the peak RSS over the read: the high-water mark is
    reset first (``clear_refs`` 5), so imports before it do not count."""
    importlib.import_module("pyarrow.parquet")  # its import is not the read's
    if traced:
        tracemalloc.start()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    rss0 = _hwm()
    index = fn(path)
    if traced:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    else:
        peak = _hwm() - rss0
    out.send((len(index), peak, index.nbytes))


def _run(ctx, fn, path: str, traced: bool) -> tuple[int, int, int]:
    recv, send = ctx.Pipe(False)
    p = ctx.Process(target=_measure, args=(fn, path, traced, send))
    p.start()
    got = recv.recv()
    p.join()
    return got


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("text", "list", _old_text), ("text", "stream", _new), ("jsonl", "stream", _new),
                 ("parquet", "stream", _new)]
        for kind in {k for k, _, _ in cases}:
            _write(kind, os.path.join(tmp, f"m.{kind}"), n)
        for kind, how, fn in cases:
            path = os.path.join(tmp, f"m.{kind}")
            count, peak, nbytes = _run(ctx, fn, path, True)
            _, rss, _ = _run(ctx, fn, path, False)
            print(json.dumps({"manifest": kind, "read": how, "entries": count,
                              "file_mib": round(os.path.getsize(path) / 2**20, 1),
                              "tracemalloc_peak_mib": round(peak / 2**20, 1), "rss_peak_growth_mib": round(rss / 2**20, 1),
                              "index_mib": round(nbytes / 2**20, 1)}))


if __name__ == "__main__":
    main()
