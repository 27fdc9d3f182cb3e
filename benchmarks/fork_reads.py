"""Forks while the parent reads: how many forked children read correctly, hang or crash.

DataLoader workers are forked from a training process whose client may be busy (a prefetcher,
a validation loop). This forks a child ``--forks`` times while ``--threads`` parent threads read
through gRPC; each child reads every object through the inherited filesystem within
``--deadline`` seconds. The worker runs in its own process (``--in-process`` puts it in the
parent, as the unit tests do). Prints and writes (``--json``) the counts.

    .venv/bin/python benchmarks/fork_reads.py --forks 150
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import fsspec

from cachefs.config import CacheDirSpec, WorkerConfig
from cachefs.mounts import MountSpec
from cachefs.server.worker.daemon import Worker


def _start_worker(root: Path, store: Path) -> Worker:
    config = WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(str(root / "cache"), 1 << 30),),
                          mounts=(MountSpec("data", str(store)),), page_size=64 << 10)
    return Worker(config).start()


def _serve(root: str, store: str) -> None:
    worker = _start_worker(Path(root), Path(store))
    print(worker.address, flush=True)
    sys.stdin.read()  # until the parent goes
    worker.stop(grace=1.0)


def _child(conn, fs, paths: list[str], want: list[bytes]) -> None:
    try:
        conn.send([fs.cat_file(p) for p in paths] == want)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(repr(exc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forks", type=int, default=100)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=15.0)
    ap.add_argument("--in-process", action="store_true", help="the worker in this process")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve(*args.serve)
        return 0

    root = Path(tempfile.mkdtemp(prefix="cachefs-fork-reads-"))
    store = root / "store"
    store.mkdir()
    objects = {f"o{i}": random.Random(i).randbytes(200_000 + i) for i in range(6)}
    for key, data in objects.items():
        (store / key).write_bytes(data)
    server = None
    if args.in_process:
        worker = _start_worker(root, store)
        address = worker.address
    else:
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(root), str(store)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        address = server.stdout.readline().strip()
    fs = fsspec.filesystem("cachefs", workers=address, skip_instance_cache=True,
                           short_circuit=False, data_port=False)
    paths = [f"cachefs://data/{k}" for k in objects]
    want = list(objects.values())
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            for p in paths:
                fs.cat_file(p)

    readers = [threading.Thread(target=busy, daemon=True) for _ in range(args.threads)]
    for t in readers:
        t.start()
    counts = {"ok": 0, "hung": 0, "crashed": 0, "failed": 0}
    errors: list[str] = []
    ctx = multiprocessing.get_context("fork")
    for _ in range(args.forks):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(child_end, fs, paths, want))
        proc.start()
        child_end.close()
        if not parent_end.poll(args.deadline):
            proc.kill()
            proc.join()
            counts["hung"] += 1
            continue
        try:
            got = parent_end.recv()
        except EOFError:
            got = None
        proc.join(args.deadline)
        if proc.exitcode != 0:
            counts["crashed"] += 1
        elif got is True:
            counts["ok"] += 1
        else:
            counts["failed"] += 1
            errors.append(str(got))
    stop.set()
    for t in readers:
        t.join(30)
    if server is not None:
        server.stdin.close()
        server.wait(30)
    result = {"forks": args.forks, "threads": args.threads, "worker": "in-process" if args.in_process else "process",
              **counts, "errors": errors[:5]}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if counts["ok"] == args.forks else 1


if __name__ == "__main__":
    sys.exit(main())
