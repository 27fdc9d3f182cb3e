"""Listings that stream (#46): time to a prefix's first page and to its whole listing.

    .venv/bin/python benchmarks/bench_listing.py                       # 1,000,000 files of 4 KiB
    .venv/bin/python benchmarks/bench_listing.py --objects 200000      # a smaller tree
    .venv/bin/python benchmarks/bench_listing.py --root /tmp/tree1m    # kept between runs

A local-directory mount of ``--objects`` files of 4 KiB, 1,000 per directory
(``train/<4 digits>/<7 digits>.jpg``; made once under ``--root`` and reused while its count is
right), a real worker in this process and a client with its defaults (pages over the worker's
short-circuit socket, 48 KiB each; ``--grpc``: the gRPC ``List``, 1,000 entries a page). Measured:

* ``first_page_s``: ``Session.list_pages(recursive=True)``'s first page (a cold worker);
* ``all_pages_s``: every page after it, counted and dropped (as the client's index takes them);
* ``whole_walk_s``: ``ObjectStore.list(recursive=True, refresh=True)`` in the worker: the store
  listed whole, which the worker did before its first page until #46;
* ``two_listers_s`` / ``two_listers_chunks``: two listers of the prefix at once on a cold worker
  cache (its listings dropped): their wall time, and the chunks the store was asked for (one
  lister alone needs ``objects / 1000``).

Writes benchmarks/results/listing-<timestamp>.json and prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

import fsspec  # noqa: E402

from cachefs.config import CacheDirSpec, WorkerConfig  # noqa: E402
from cachefs.mounts import MountSpec  # noqa: E402
from cachefs.paths import CachePath  # noqa: E402
from cachefs.server.worker import Worker  # noqa: E402

PER_DIR = 1000
SIZE = 4096


def make_tree(root: str, objects: int) -> float:
    """``objects`` files of 4 KiB under ``root``/train (skipped when it holds that many); seconds taken."""
    marker = os.path.join(root, f".made-{objects}")
    if os.path.exists(marker):
        return 0.0
    started = time.perf_counter()
    data = b"x" * SIZE
    for i in range(objects):
        directory = os.path.join(root, "train", f"{i // PER_DIR:04d}")
        if i % PER_DIR == 0:
            os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, f"{i:07d}.jpg"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    open(marker, "w").close()
    return time.perf_counter() - started


def time_pages(fs, path: CachePath) -> tuple[float, float, int]:
    """(seconds to the first page, seconds to the last, entries)."""
    started = time.perf_counter()
    first = 0.0
    count = 0
    for page in fs.session.list_pages(path, recursive=True):
        if not first:
            first = time.perf_counter() - started
        count += len(page)
    return first, time.perf_counter() - started, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--root", default="", help="where the tree is made (and kept); default a temp dir")
    parser.add_argument("--grpc", action="store_true", help="list through gRPC, not the worker's sockets")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="cachefs-listing-")
    os.makedirs(root, exist_ok=True)
    made_s = make_tree(root, args.objects)
    cache = tempfile.mkdtemp(prefix="cachefs-listing-cache-")
    worker = Worker(WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(cache, 1 << 30),),
                                 mounts=(MountSpec("data", root),))).start()
    result: dict[str, object] = {"objects": args.objects, "made_s": round(made_s, 1), "grpc": args.grpc,
                                 "machine": machine_info()}
    try:
        options = {"short_circuit": False, "data_port": False} if args.grpc else {}
        fs = fsspec.filesystem("cachefs", workers=worker.address, skip_instance_cache=True, **options)
        path = CachePath("data", "train")
        first, whole, count = time_pages(fs, path)
        assert count == args.objects, count
        result.update(first_page_s=round(first, 3), all_pages_s=round(whole, 2),
                      chunks=worker.objects._lists.fetched, cache_bytes=worker.objects._lists.bytes)
        started = time.perf_counter()
        walked = len(worker.objects.list(path, recursive=True, refresh=True))
        result.update(whole_walk_s=round(time.perf_counter() - started, 2))
        assert walked == args.objects
        worker.objects.forget_mount("data")
        before = worker.objects._lists.fetched
        counts: list[int] = []
        threads = [threading.Thread(target=lambda: counts.append(time_pages(fs, path)[2])) for _ in range(2)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        result.update(two_listers_s=round(time.perf_counter() - started, 2),
                      two_listers_chunks=worker.objects._lists.fetched - before,
                      two_listers_joined=worker.objects._lists.joined)
        assert counts == [args.objects, args.objects], counts
    finally:
        worker.stop(grace=1.0)
    os.makedirs(args.out, exist_ok=True)
    name = os.path.join(args.out, f"listing-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}.json")
    with open(name, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print("wrote", name)


if __name__ == "__main__":
    main()
