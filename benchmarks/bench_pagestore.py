#!/usr/bin/env python
"""Page store write benchmark: CPU and time per ``PageStore.put``, index rows written behind or not.

    .venv/bin/python benchmarks/bench_pagestore.py               # 1,000 x 256 KiB pages, 5 rounds
    .venv/bin/python benchmarks/bench_pagestore.py --pages 400 --repeat 3 --threads 1

Why: a cold epoch on the worker is bound by CPU, and every page it caches is one put. Three
ways, in turn within each round (same pages, a fresh cache dir each), 1 and 4 putting threads:

    file-only     the page file alone (``pagefile.write_page_file``: tmp, checksum, rename),
                  no store, no index: the limit
    sync-row      PageStore with ``max_rows=1``: every put writes its own index row, one SQLite
                  transaction on the putting thread (the store before rows.py)
    write-behind  PageStore as the worker runs it: rows queued, written in batches (rows.py)

and the same two store ways with a quota of 256 pages (``--evict``: every put evicts one page,
so its row's deletion is written too). The timed window is the puts plus ``close()``, which
writes whatever rows are still queued: write-behind pays for all its rows inside it. CPU is the
process's (``time.process_time``: the flush thread included). Reported: medians over the rounds
of pages/s and CPU us per page, with min-max, and the ratios to sync-row.
Results: benchmarks/results/pagestore-<timestamp>.json (and a PNG with matplotlib).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from read_common import machine_info  # noqa: E402

from cachefs.pagefile import TRAILER_SIZE, write_page_file  # noqa: E402
from cachefs.server.pagestore import CacheDir, PageId, PageStore  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WAYS = ("file-only", "sync-row", "write-behind")


def _split(n: int, threads: int) -> list[range]:
    step = -(-n // threads)
    return [range(i, min(n, i + step)) for i in range(0, n, step)]


def _run_threads(threads: int, n: int, put) -> None:
    errors: list[BaseException] = []

    def work(ids: range) -> None:
        try:
            for i in ids:
                put(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(r,)) for r in _split(n, threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def one_pass(way: str, root: str, pages: int, page: bytes, threads: int, evict: bool) -> dict[str, float]:
    """Time and CPU of ``pages`` puts (plus close) in a fresh dir under ``root``."""
    path = tempfile.mkdtemp(dir=root)
    try:
        if way == "file-only":
            os.makedirs(os.path.join(path, "pages"))
            os.makedirs(os.path.join(path, "tmp"))
            for i in range(256):
                os.makedirs(os.path.join(path, "pages", f"{i:02x}"))
            view = memoryview(page)

            def put(i: int) -> None:
                d = PageId("bench", f"k{i}", "v", 0).digest()
                write_page_file(f"{path}/tmp/{d}.tmp", f"{path}/pages/{d[:2]}/{d}", view)

            close = lambda: None  # noqa: E731
        else:
            size = len(page) + TRAILER_SIZE
            quota = (256 if evict else pages + 8) * size
            kw = {"max_rows": 1, "batch_rows": 1} if way == "sync-row" else {}
            store = PageStore([CacheDir(path, quota)], page_size=len(page), **kw)
            if evict:  # start full, so every timed put evicts one page
                for i in range(256):
                    store.put(PageId("bench", f"pre{i}", "v", 0), page)
                store._flush_rows()

            def put(i: int) -> None:
                if not store.put(PageId("bench", f"k{i}", "v", 0), page):
                    raise RuntimeError(f"put {i} failed")

            close = store.close
        c0, t0 = time.process_time(), time.perf_counter()
        _run_threads(threads, pages, put)
        close()
        c1, t1 = time.process_time(), time.perf_counter()
        return {"pages_per_s": pages / (t1 - t0), "cpu_us_per_page": 1e6 * (c1 - c0) / pages}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=1000)
    p.add_argument("--page-size", type=int, default=256 << 10)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", default="1,4")
    p.add_argument("--no-evict", action="store_true", help="skip the evicting cases")
    p.add_argument("--dir", default=None, help="where the cache dirs go (default: a tmp dir)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    page = os.urandom(args.page_size)
    root = tempfile.mkdtemp(prefix="bench-pagestore-", dir=args.dir)
    cases = [(way, int(t), False) for t in args.threads.split(",") for way in WAYS]
    if not args.no_evict:
        cases += [(way, int(t), True) for t in args.threads.split(",") for way in WAYS[1:]]
    raw: dict[str, list[dict[str, float]]] = {}
    try:
        for r in range(args.repeat):  # interleaved: a noisy minute hits every way alike
            for way, threads, evict in cases:
                name = f"{way} t{threads}{' evict' if evict else ''}"
                raw.setdefault(name, []).append(one_pass(way, root, args.pages, page, threads, evict))
            print(f"round {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (way, threads, evict) in cases:
        name = f"{way} t{threads}{' evict' if evict else ''}"
        runs = raw[name]
        base = raw[f"sync-row t{threads}{' evict' if evict else ''}"]
        row: dict[str, Any] = {
            "case": name, "way": way, "threads": threads, "evict": evict,
            "pages_per_s": _summary([x["pages_per_s"] for x in runs]),
            "cpu_us_per_page": _summary([x["cpu_us_per_page"] for x in runs]),
            "runs": runs,
        }
        row["cpu_ratio_to_sync_row"] = (row["cpu_us_per_page"]["median"]
                                        / statistics.median(x["cpu_us_per_page"] for x in base))
        row["speed_ratio_to_sync_row"] = (row["pages_per_s"]["median"]
                                          / statistics.median(x["pages_per_s"] for x in base))
        rows.append(row)
    print(f"{'case':<24}{'pages/s (min-max)':>26}{'CPU us/page (min-max)':>28}{'CPU vs sync-row':>17}")
    for row in rows:
        ps, cpu = row["pages_per_s"], row["cpu_us_per_page"]
        print(f"{row['case']:<24}{ps['median']:>9.0f} ({ps['min']:.0f}-{ps['max']:.0f}){'':>3}"
              f"{cpu['median']:>10.0f} ({cpu['min']:.0f}-{cpu['max']:.0f}){'':>4}"
              f"{row['cpu_ratio_to_sync_row']:>10.2f}x")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    result = {"benchmark": "pagestore", "when": dt.datetime.now(dt.timezone.utc).isoformat(),
              "pages": args.pages, "page_size": args.page_size, "repeat": args.repeat,
              "load_average_after": load, "machine": machine_info(), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = os.path.join(args.out, f"pagestore-{stamp}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    _plot(rows, out[:-5] + ".png")
    print(out)
    return 0


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["case"] for r in rows]
    med = [r["cpu_us_per_page"]["median"] for r in rows]
    err = [[m - r["cpu_us_per_page"]["min"] for m, r in zip(med, rows)],
           [r["cpu_us_per_page"]["max"] - m for m, r in zip(med, rows)]]
    ax.barh(names, med, xerr=err, color=["#999" if "file" in n else "#c55" if "sync" in n else "#5a5"
                                         for n in names])
    ax.set_xlabel("CPU us per 256 KiB page put (median, min-max), puts + close")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
