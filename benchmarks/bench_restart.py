"""A worker's restart at a million cached pages (#47): time from process start to the first cached
read served, and resident memory over an empty worker's.

    .venv/bin/python benchmarks/bench_restart.py --dir /tmp/restart47 --prepare            # once (minutes)
    .venv/bin/python benchmarks/bench_restart.py --dir /tmp/restart47                      # this tree
    .venv/bin/python benchmarks/bench_restart.py --dir /tmp/restart47 --code /tmp/base47   # another tree

``--prepare`` makes ``DIR/mount`` (a local-directory mount of ``--probes`` objects of 4 KiB) and
``DIR/cache``: a real worker process reads the probes once (cold: their pages and index rows
written by the worker itself), then this process opens the same cache dir as a ``PageStore`` (the
worker's own class and page size, 1 MiB) and puts ``--pages`` minus the probes more pages of 4 KiB
(mount ``data``, keys ``fill/<n>.bin``: no object behind them, nothing reads them), then closes it
cleanly. One page file of 4,128 bytes each, one index row each.

Each measurement starts a worker process (``python -m cachefs.cli worker``; ``--code TREE`` puts
that source tree first on PYTHONPATH, e.g. a ``git worktree`` of an older commit, with symlinks
``cachefs/{server,client,proto}`` to its folders as the editable install maps them) and reads one
probe through it as soon as it reports ready, measuring:

* ``ready_s``: process start to the worker's ready line (its page store loaded: it serves);
* ``first_read_s``: process start to the probe's bytes back (a page-store hit: checked by the
  worker's ``bytes_from_store`` staying 0 with the metadata fetched from the mount);
* ``pages_at_first_read``: the pages the worker knew then (it serves while its index loads: a
  read asks the index for its page's row); ``loaded_s``: process start to every page known;
* ``rss_mb``: the worker's VmRSS after that read, and ``rss_settled_mb`` 10 s after the load (the
  background sweep, if any, done); ``empty``: the same for a worker on an empty cache dir, and
  ``over_empty_mb`` the difference of the settled figures;
* after a clean stop (the ``clean`` mark in the cache dir) and, with ``--unclean``, after the mark
  is removed as a kill -9 leaves it (the new code then sweeps the page files in the background).

Run ``--code`` from another folder than this repository's root (``cd /tmp``): ``python -m`` puts
the working directory first on sys.path, before PYTHONPATH.

Writes benchmarks/results/restart-<timestamp>.json and prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from cachefs.local import worker_process  # noqa: E402
from cachefs.server.pagestore import CacheDir, PageId, PageStore  # noqa: E402

PAGE_SIZE = 1 << 20  # the worker's default
OBJECT = 4096
QUOTA = "16GiB"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _scrape(port: int) -> dict[str, float]:
    from helpers import scrape
    return scrape(port)


def _client(address: str):
    from helpers import client
    return client(address)


def _probe_bytes(i: int) -> bytes:
    return (i.to_bytes(4, "big") * (OBJECT // 4))


def _env(code: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def prepare(d: Path, pages: int, probes: int) -> dict[str, float]:
    if d.exists():
        shutil.rmtree(d)
    mount, cache = d / "mount", d / "cache"
    mount.mkdir(parents=True)
    for i in range(probes):
        (mount / f"p{i}.bin").write_bytes(_probe_bytes(i))
    with worker_process({"data": str(mount)}, str(cache), QUOTA, log_path=str(d / "prepare.log")) as w:
        fs = _client(w.address)
        for i in range(probes):
            assert fs.cat_file(f"data/p{i}.bin") == _probe_bytes(i)
    began = time.monotonic()
    data = os.urandom(OBJECT)
    with PageStore([CacheDir(str(cache), 16 << 30)], PAGE_SIZE, row_delay=1.0, batch_rows=4096,
                   max_rows=65536) as s:
        for n in range(pages - probes):
            if not s.put(PageId("data", f"fill/{n:07d}.bin", f"{OBJECT}-0", 0), data):
                raise RuntimeError(f"put {n} failed: {s.stats()}")
        filled = s.stats().pages
    return {"fill_s": time.monotonic() - began, "pages": filled}


def measure(d: Path, cache: Path, code: str | None, label: str, pages: int) -> dict[str, float]:
    env = _env(code)
    t0 = time.monotonic()
    w = worker_process({"data": str(d / "mount")}, str(cache), QUOTA, env=env, log_path=str(d / f"{label}.log"))
    w.start(timeout=600)
    try:
        ready = time.monotonic() - t0
        fs = _client(w.address)
        assert fs.cat_file("data/p0.bin") == _probe_bytes(0)
        first = time.monotonic() - t0
        rss = _rss_mb(w.pid)
        m = _scrape(w.ready["metrics_port"])
        deadline = time.monotonic() + 300
        while _scrape(w.ready["metrics_port"]).get("cachefs_worker_cache_pages", 0) < pages and time.monotonic() < deadline:
            time.sleep(0.1)
        loaded = time.monotonic() - t0
        time.sleep(10)  # the debris sweep, if any, and the collector's first rounds
        settled = _rss_mb(w.pid)
        return {"ready_s": round(ready, 2), "first_read_s": round(first, 2), "rss_mb": round(rss, 1),
                "loaded_s": round(loaded, 2), "rss_settled_mb": round(settled, 1),
                "pages_at_first_read": m.get("cachefs_worker_cache_pages", -1),
                "bytes_from_store": m.get("cachefs_worker_bytes_from_store_total", -1)}
    finally:
        w.stop(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the mount and the cache dir live")
    ap.add_argument("--prepare", action="store_true", help="make the mount and fill the cache dir first")
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--code", help="a source tree to run the worker from (default: this one)")
    ap.add_argument("--unclean", action="store_true", help="also restart after removing the clean-stop mark")
    args = ap.parse_args()
    d = Path(args.dir)
    out: dict[str, object] = {"pages": args.pages, "code": args.code or str(ROOT), "object_bytes": OBJECT}
    if args.prepare:
        out["prepare"] = prepare(d, args.pages, args.probes)
        print(json.dumps(out["prepare"]), flush=True)
    empty = d / "empty-cache"
    shutil.rmtree(empty, ignore_errors=True)
    out["empty"] = measure(d, empty, args.code, "empty", 1)
    runs = {"clean": measure(d, d / "cache", args.code, "clean", args.pages)}
    if args.unclean:
        (d / "cache" / "clean").unlink(missing_ok=True)
        runs["unclean"] = measure(d, d / "cache", args.code, "unclean", args.pages)
    for run in runs.values():
        run["over_empty_mb"] = round(run["rss_settled_mb"] - out["empty"]["rss_settled_mb"], 1)  # type: ignore[index]
    out.update(runs)
    text = json.dumps(out, indent=2)
    print(text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"restart-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
