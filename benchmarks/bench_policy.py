"""Cost of the eviction order per access, at 100 k, 1 M and 10 M pages (#16's bound: O(log n)).

    .venv/bin/python benchmarks/bench_policy.py            # 1e5, 1e6, 1e7 pages (~4 GB of memory at 1e7)
    .venv/bin/python benchmarks/bench_policy.py --max 1000000

Measures the two structures server/pagestore/policy.py keeps per cache dir, with the page store's
own per-page objects stood in by slotted records (not part of the bound): ``touch`` (a read: the
page's next use moves on, one push on each heap) and ``pick`` (room for one page: pop the furthest),
with a constant-time next-use oracle, so what is timed is the structure alone. LRU alongside.
Writes benchmarks/results/policy-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from read_common import machine_info  # noqa: E402

from cachefs.server.pagestore.policy import LruOrder, NextUseOrder  # noqa: E402


class Page:
    __slots__ = ("pid", "digest", "next_use", "size", "held_until")

    def __init__(self, i: int) -> None:
        self.pid, self.digest, self.next_use, self.size, self.held_until = i, f"{i:032x}", math.inf, 1, 0.0


def measure(n: int, ops: int, seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    clock = [0.0]

    def next_use(pid: int, used: bool) -> tuple[float, float]:
        return clock[0] + rng.random() * 1000.0, math.inf

    out: dict[str, float] = {"pages": n}
    for name, order in (("future", NextUseOrder(next_use)), ("lru", LruOrder())):
        pages = [Page(i) for i in range(n)]
        t0 = time.perf_counter()
        for p in pages:
            order.add(p)
        out[f"{name}_add_us"] = (time.perf_counter() - t0) / n * 1e6
        sample = [pages[rng.randrange(n)] for _ in range(ops)]
        gc.disable()
        t0 = time.perf_counter()
        for p in sample:
            order.touch(p)
        out[f"{name}_touch_us"] = (time.perf_counter() - t0) / ops * 1e6
        t0 = time.perf_counter()
        for _ in range(ops // 10):
            victims = order.pick(1, 0.0)
            assert victims
            for v in victims:  # the store removes what it evicts, then adds the new page
                order.remove(v)
                order.add(v)
        out[f"{name}_evict_us"] = (time.perf_counter() - t0) / (ops // 10) * 1e6
        gc.enable()
        del pages, sample, order
        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, default=10_000_000)
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    rows = []
    n = 100_000
    while n <= args.max:
        row = measure(n, args.ops)
        rows.append(row)
        print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
        n *= 10
    result = {"benchmark": "policy", "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "rows": rows, "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"policy-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
