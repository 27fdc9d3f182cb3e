"""The worker's refresh of cached objects by listing (#46), in-process: its CPU per object when
the directory is unchanged (the warm epoch's case: every directory is listed again once its
metadata runs out), against a bare listing of the same directory (``os.scandir`` with an
``lstat`` of each entry: the floor a local mount's refresh cannot go under) and against the
same refresh with the last listing's records dropped first (every object checked one by one,
as before a digest could tell the listing unchanged).

``bench_scale.py --refresh --objects 10000`` (directories of 1,000 objects of 4 KiB, in a
temporary dir; one worker, one client reading every object once so that it holds pages and
name entries for them).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PER_DIR = 1000
REPEATS = 5


def _cpu_per_object(run: Any, objects: int) -> float:
    """Best of REPEATS: process CPU microseconds per object (all threads)."""
    best = float("inf")
    for _ in range(REPEATS):
        t = time.process_time()
        run()
        best = min(best, time.process_time() - t)
    return round(best / objects * 1e6, 2)


def measure(objects: int = 10_000, object_bytes: int = 4096) -> dict[str, Any]:
    from cachefs.client.fs.filesystem import CacheFileSystem
    from cachefs.config import CacheDirSpec, WorkerConfig
    from cachefs.mounts import MountSpec
    from cachefs.paths import CachePath
    from cachefs.server.worker import Worker

    dirs = max(1, objects // PER_DIR)
    objects = dirs * PER_DIR
    base = Path(tempfile.mkdtemp(prefix="cachefs-refresh-"))
    root, cache = base / "store", base / "cache"
    worker = fs = None
    try:
        for d in range(dirs):
            (root / f"d{d:04d}").mkdir(parents=True)
            for i in range(PER_DIR):
                (root / f"d{d:04d}" / f"o{i:04d}").write_bytes(os.urandom(object_bytes))
        config = WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(str(cache), 4 << 30),),
                              mounts=(MountSpec("data", str(root)),))
        worker = Worker(config).start()
        fs = CacheFileSystem(workers=f"127.0.0.1:{worker.port}", skip_instance_cache=True)
        for d in range(dirs):
            fs.cat([f"cachefs://data/d{d:04d}/o{i:04d}" for i in range(PER_DIR)])
        listed = [CachePath("data", f"d{d:04d}") for d in range(dirs)]
        store, names, table = worker.objects, worker.name_index, worker.objects._meta

        def refresh() -> None:
            for directory in listed:
                store._list_to_refresh(directory)

        def refresh_one_by_one() -> None:
            with table._lock:  # as before 7582567: nothing kept of the last listing
                table._listed.clear()
                table._listed_rows = 0
            if names is not None:
                with names._lock:
                    names._listed.clear()
                    names._listed_entries = 0
            refresh()

        def bare_listing() -> None:
            for d in range(dirs):
                with os.scandir(root / f"d{d:04d}") as entries:
                    [e.stat(follow_symlinks=False) for e in entries]

        refresh()  # the first: kept for the next
        extended_before = names.extended if names is not None else 0
        unchanged = _cpu_per_object(refresh, objects)
        row = {"mode": "refresh", "objects": objects, "directories": dirs, "object_bytes": object_bytes,
               "repeats": REPEATS,
               "unchanged_us_per_object": unchanged,
               "one_by_one_us_per_object": _cpu_per_object(refresh_one_by_one, objects),
               "bare_listing_us_per_object": _cpu_per_object(bare_listing, objects),
               "names_extended": (names.extended - extended_before) if names is not None else None}
        row["unchanged_over_bare_listing"] = round(row["unchanged_us_per_object"]
                                                   / max(row["bare_listing_us_per_object"], 1e-9), 2)
        row["one_by_one_over_unchanged"] = round(row["one_by_one_us_per_object"] / max(unchanged, 1e-9), 2)
        return row
    finally:
        if fs is not None:
            fs.close()
        if worker is not None:
            worker.stop(grace=1.0)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    print(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000))
