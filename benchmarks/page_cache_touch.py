"""What writing a file into the page cache costs when the memory is new to the machine.

A cold cachefs epoch writes every page file into the page cache. On a VM whose host takes freed
memory back (virtio balloon free-page reporting), a first touch of that memory costs far more than
the copy itself, and a cold epoch after a free writes into such memory. This writes ``--files``
new files of ``--size`` bytes, then as many again (memory the kernel has just used: the first
set stays), then removes the first set and writes a third (memory just freed), and reports the
CPU microseconds per file of each pass. On bare metal the three are about equal.

    python benchmarks/page_cache_touch.py --dir /mnt/ext4j
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def write_files(directory: str, tag: str, n: int, payload: bytes) -> dict[str, float]:
    wall0, cpu0 = time.perf_counter(), os.times()
    for i in range(n):
        fd = os.open(os.path.join(directory, f"{tag}{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
    cpu1, wall = os.times(), time.perf_counter() - wall0
    return {"wall_us_per_file": round(wall / n * 1e6, 1),
            "cpu_us_per_file": round((cpu1.user + cpu1.system - cpu0.user - cpu0.system) / n * 1e6, 1),
            "sys_us_per_file": round((cpu1.system - cpu0.system) / n * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--size", type=int, default=256 << 10)
    args = p.parse_args(argv)
    if args.files < 1 or args.size < 1:
        p.error("--files and --size must be >= 1")
    directory = tempfile.mkdtemp(prefix="page-cache-touch-", dir=args.dir)
    payload = os.urandom(args.size)
    try:
        out = {"files": args.files, "size": args.size, "dir": directory}
        out["first"] = write_files(directory, "a", args.files, payload)
        out["second"] = write_files(directory, "b", args.files, payload)
        for i in range(args.files):
            os.unlink(os.path.join(directory, f"a{i}"))
        out["after_unlink"] = write_files(directory, "c", args.files, payload)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
