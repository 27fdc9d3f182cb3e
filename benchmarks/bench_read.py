#!/usr/bin/env python
"""Read benchmark: cachefs against its peers and the transports' limits, in one run, on the same data.

    .venv/bin/python benchmarks/bench_read.py --quick      # < 3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_read.py              # 1024 x 256 KiB + 4 x 64 MiB
    .venv/bin/python benchmarks/bench_read.py --delay-ms 2 # the store behind 2 ms of network delay

One S3 store (moto, its own process; behind tc netem with --delay-ms, see netem.py) holds N small
and M large objects; a local copy of the same bytes (page cache warm) is what the limits serve.
Workloads: small objects with 1 reader and with --threads readers (each object once per pass),
large objects with 1 reader (each once) and with --threads readers at once (reader i reads large
object i mod M). Cases (read_systems.py):

    s3fs            s3fs cat_file, no cache (direct)
    simplecache     fsspec simplecache::s3, fresh cache dir (first, second)
    blockcache      fsspec blockcache::s3, fresh cache dir (first, second)
    cachefs_local   a `cachefs worker` process, fresh cache, same host: short-circuit (cold, warm)
    cachefs_remote  the same worker, client short_circuit=False: the network path (cold, warm)
    cachefs_cat     the same host through cat_file for every size (the plain fsspec API)
    cachefs_open    the same host through open(path).read()
    local           readv of the local copy into an aligned buffer: the limit
    grpc_raw        a bare gRPC stream of the same bytes, 1 MiB messages: gRPC's limit
    tcp_raw         a bare loopback TCP stream, sendfile -> recv_into: the network path's limit

The limits and cachefs_local/cachefs_remote read into reused, preallocated, 4096-aligned slots
(cachefs: ``fs.read_into``); the peers, cachefs_cat and cachefs_open return new bytes from their
natural API (on this VM fresh memory costs page faults the slots do not: compare like with like). Every read is compared with the source; a wrong byte or
a failed cachefs case makes the run exit 1 (results are still written). Output:
benchmarks/results/read-<timestamp>.json/.png and latest.json/.png (read_report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the sibling modules (read_*.py, netem.py), also when imported by a test
    sys.path.insert(0, HERE)

from read_common import (WORKLOADS, Dataset, Measurement, Slots, human, machine_info,  # noqa: E402
                         make_dataset, parse_size, plan, run_pass, store_endpoint)
from read_report import compute_ratios, fmt_line, plot, print_table  # noqa: E402
from read_systems import (LIMITS, SYSTEMS, Cachefs, FsspecCache, LocalDisk, RawLimit, S3fsDirect,  # noqa: E402
                          System)

PRESETS = {  # n_small, small_size, n_large, large_size, repeat
    "full": (1024, 256 << 10, 4, 64 << 20, 5),
    "quick": (256, 256 << 10, 2, 64 << 20, 3),
    "smoke": (8, 64 << 10, 2, 2 << 20, 2),
}


REPEATED = ("warm", "second", "limit")  # passes that need no fresh cache: run --repeat times


def pick(tries: list[Measurement]) -> Measurement:
    """The pass of median wall time (a failed or wrong one if any: never hidden); all walls kept."""
    bad = [t for t in tries if t.error or t.wrong]
    m = bad[0] if bad else sorted(tries, key=lambda t: t.wall_s)[len(tries) // 2]
    if len(tries) > 1:
        m.extra["walls_s"] = [round(t.wall_s, 6) for t in tries]
    return m


def run_system(system: System, ds: Dataset, workloads: list[str], threads: int, slots: Slots,
               out: list[Measurement], repeat: int = 1) -> None:
    """Append each measurement to ``out`` as soon as it is taken (kept if the run is interrupted).

    A cold/first/direct pass runs once (it needs an empty cache); the others run ``repeat``
    times on the same cache and the median one is kept.
    """
    for workload in workloads:
        kind = WORKLOADS[workload][0]
        keys, readers = plan(ds, workload, threads)
        bufs = slots.get(len(keys), ds.size(kind))
        ms: list[Measurement] = []
        try:
            with system.fresh(workload, kind) as read:
                for phase in system.passes:
                    tries = []
                    for _ in range(repeat if phase in REPEATED else 1):
                        t = run_pass(Measurement(system.name, workload, phase, readers, api=system.api(kind)),
                                     read, keys, bufs, ds.data, readers)
                        t.extra.update(system.pass_extra())
                        tries.append(t)
                        if t.error or t.wrong:
                            break
                    m = pick(tries)
                    ms.append(m)
                    out.append(m)
                    print(f"  {system.name:<14} {workload:<10} {phase:<6} {fmt_line(m.summary())}", flush=True)
                    if m.error:
                        break
        except Exception as exc:  # noqa: BLE001 - a system that cannot start: recorded
            traceback.print_exc(file=sys.stderr)
            ms.append(Measurement(system.name, workload, system.passes[0], readers, api=system.api(kind),
                                  error=f"{type(exc).__name__}: {exc}"))
            out.append(ms[-1])
        extra = system.after_passes(workload)
        if extra and ms:
            ms[-1].extra.update(extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="256 x 256 KiB + 2 x 64 MiB, < 3 min on 2 cores")
    mode.add_argument("--smoke", action="store_true", help="8 x 64 KiB + 2 x 2 MiB: checks the machinery only")
    p.add_argument("--objects", type=int, help="number of small objects (full 1024, quick 256)")
    p.add_argument("--small-size", help="size of each small object (default 256KiB)")
    p.add_argument("--large-objects", type=int, help="number of large objects (full 4, quick 2)")
    p.add_argument("--large-size", help="size of each large object (default 64MiB; 0 = none)")
    p.add_argument("--repeat", type=int, help="runs of each warm/second/limit pass, median kept (full 5, quick 3)")
    p.add_argument("--threads", type=int, default=8, help="readers of the concurrent workloads (default 8)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    p.add_argument("--blockcache-small", choices=("yes", "no"), default="yes",
                   help="run blockcache on the small objects too (default yes)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="network delay in front of the S3 store (benchmarks/netem.py; default 0)")
    p.add_argument("--quota", default="4GiB", help="worker cache quota")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra `cachefs worker` flag, e.g. --worker-arg=--page-size=1MiB (repeatable)")
    p.add_argument("--worker-log-level", default="INFO", help="the worker's --log-level (default INFO, as deployed)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--keep-logs", metavar="DIR", help="keep the worker logs in DIR")
    p.add_argument("--no-plot", action="store_true")
    return p


def parameters(args: argparse.Namespace) -> dict[str, Any]:
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    n_small, small_size, n_large, large_size, repeat = PRESETS[mode]
    n_small = args.objects if args.objects is not None else n_small
    small_size = parse_size(args.small_size) if args.small_size else small_size
    n_large = args.large_objects if args.large_objects is not None else n_large
    large_size = parse_size(args.large_size) if args.large_size is not None else large_size
    repeat = args.repeat if args.repeat is not None else repeat
    wanted = {x.strip() for x in args.workloads.split(",")}
    workloads = [w for w in WORKLOADS if w in wanted
                 and (n_large > 0 and large_size > 0 if WORKLOADS[w][0] == "large" else n_small > 0)]
    return {"mode": mode,
            "n_small": n_small, "small_size": small_size, "n_large": n_large, "large_size": large_size,
            "threads": args.threads, "systems": [s.strip() for s in args.systems.split(",") if s.strip()],
            "workloads": workloads, "repeat": repeat, "seed": args.seed, "delay_ms_asked": args.delay_ms,
            "blockcache_small": args.blockcache_small == "yes", "worker_quota": args.quota,
            "worker_args": args.worker_arg, "worker_log_level": args.worker_log_level,
            "notes": ["each cached system gets a fresh cache per workload; first/cold = empty cache",
                      "latency: per object, wall clock in the calling thread (includes queueing when threaded)",
                      "large_conc: all readers start at once; reader i reads large object i mod n_large",
                      "limits (local, grpc_raw, tcp_raw) serve a local copy of the same bytes, page cache warm",
                      "cachefs_remote: same-host worker, client short_circuit=False (bytes over the network path)",
                      "slots: one preallocated 4096-aligned buffer per read of a pass, reused by every pass"]}


def is_peer(system: str) -> bool:
    return system in ("s3fs", "simplecache", "blockcache")


def make_system(name: str, ds: Dataset, so: dict[str, Any], tmp: str, args: argparse.Namespace) -> System:
    if name == "s3fs":
        return S3fsDirect(ds, so)
    if name in ("simplecache", "blockcache"):
        return FsspecCache(name, ds, so, tmp)
    if name in ("cachefs_local", "cachefs_remote", "cachefs_cat", "cachefs_open"):
        return Cachefs(ds, so, tmp, args.quota, args.worker_arg, args.keep_logs, args.worker_log_level,
                       short_circuit=name != "cachefs_remote",
                       plain={"cachefs_cat": "cat", "cachefs_open": "open"}.get(name, ""))
    if name == "local":
        return LocalDisk(ds)
    return RawLimit(name, ds)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    params = parameters(args)
    unknown = set(params["systems"]) - set(SYSTEMS)
    if unknown:
        print(f"unknown systems: {sorted(unknown)}", file=sys.stderr)
        return 2
    # Limits first (nothing else running yet), then the peers, then cachefs.
    order = [s for s in (*LIMITS, *SYSTEMS) if s in params["systems"]]
    order = list(dict.fromkeys(order))

    # Ctrl-C and SIGTERM both unwind through the ExitStack below (workers, servers, moto, temp dirs).
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored (nohup, &)
    started = time.time()
    measurements: list[Measurement] = []
    interrupted = False
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cachefs-bench-"))
        try:
            print(f"starting the store; {params['n_small']} x {human(params['small_size'])} + "
                  f"{params['n_large']} x {human(params['large_size'])} objects", flush=True)
            store = stack.enter_context(store_endpoint(args.delay_ms))
            params.update(store_note=store.note, delay_ms=store.delay_ms, store_rtt_ms=store.rtt_ms,
                          store_mode=store.mode)
            print(f"store: {store.url}: {store.note}", flush=True)
            ds = make_dataset(store, os.path.join(tmp, "local"), params["n_small"], params["small_size"],
                              params["n_large"], params["large_size"], args.seed)
            print(f"data in s3://{ds.bucket} ({time.time() - started:.1f} s)", flush=True)
            if args.keep_logs:
                os.makedirs(args.keep_logs, exist_ok=True)
            slots = Slots()
            for name in order:
                try:
                    system = make_system(name, ds, store.storage_options(), tmp, args)
                except Exception as exc:  # noqa: BLE001 - a limit server that cannot start: recorded
                    traceback.print_exc(file=sys.stderr)
                    measurements.append(Measurement(name, (params["workloads"] or ["-"])[0], "limit", 1,
                                                    error=f"{type(exc).__name__}: {exc}"))
                    continue
                stack.callback(system.close)
                wls = params["workloads"]
                if name == "blockcache" and not params["blockcache_small"]:
                    wls = [w for w in wls if WORKLOADS[w][0] == "large"]
                run_system(system, ds, wls, args.threads, slots, measurements, params["repeat"])
                system.close()
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping workers, servers and the store, writing partial results",
                  file=sys.stderr)

    results = [m.summary() for m in measurements]
    ratios = compute_ratios(results)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    # A peer's error or wrong bytes is its own (fsspec's caches are not thread-safe on a first
    # read): recorded, not counted against the run. Wrong bytes from cachefs or a limit are.
    wrong = sum(r["wrong_objects"] for r in results if not is_peer(r["system"]))
    cachefs_failed = [f"{r['system']}/{r['workload']}/{r['phase']}" for r in results
                      if r["error"] and not is_peer(r["system"])]
    peer_failed = [f"{r['system']}/{r['workload']}/{r['phase']}"
                   + (f" ({r['wrong_objects']} wrong)" if r["wrong_objects"] else f" ({r['error']})")
                   for r in results if is_peer(r["system"]) and (r["error"] or r["wrong_objects"])]
    doc = {
        "benchmark": "read", "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "interrupted": interrupted,
        "machine": machine_info(), "parameters": params, "results": results, "ratios": ratios,
        "ok": not (wrong or cachefs_failed or interrupted), "wrong_objects": wrong,
        "failed_cases": cachefs_failed, "failed_peers": peer_failed,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"read-{stamp}.json")
    if not args.no_plot and results:
        png = os.path.join(args.out_dir, f"read-{stamp}.png")
        try:
            note = plot(results, ratios, params, png)
        except Exception as exc:  # noqa: BLE001 - a plot bug must not lose the figures
            traceback.print_exc(file=sys.stderr)
            note = f"plot failed: {type(exc).__name__}: {exc}"
        doc["plot"] = None if note else os.path.basename(png)
        if note:
            doc["plot_note"] = note
            print(note)
        else:
            shutil.copyfile(png, os.path.join(args.out_dir, "latest.png"))
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    shutil.copyfile(out, os.path.join(args.out_dir, "latest.json"))
    print_table(results, ratios, params)
    print(f"\n{len(results)} measurements in {doc['duration_s']} s -> {os.path.relpath(out)}")
    if peer_failed:
        print(f"peer cases that failed or read wrong bytes (not counted against the run): "
              f"{', '.join(peer_failed)}")
    if wrong:
        print(f"FAILED: {wrong} objects read with wrong bytes", file=sys.stderr)
    if cachefs_failed:
        print(f"FAILED: cases raised: {', '.join(cachefs_failed)}", file=sys.stderr)
    return 0 if doc["ok"] else (130 if interrupted and not wrong and not cachefs_failed else 1)


if __name__ == "__main__":
    sys.exit(main())
