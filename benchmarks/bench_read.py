#!/usr/bin/env python
"""Read benchmark: cachefs against its peers, in one run, on the same data, on this machine.

    .venv/bin/python benchmarks/bench_read.py --quick      # < 2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_read.py              # 200 x 256 KiB + one 64 MiB object

One moto S3 server (its own process) holds N small objects and one large object. Each system
reads every small object once sequentially, every small object once with ``--threads``
concurrent readers, and the large object whole:

    s3fs          s3fs.S3FileSystem.cat_file, no cache (one pass)
    simplecache   fsspec simplecache::s3, fresh cache dir: first read, second read
    blockcache    fsspec blockcache::s3, fresh cache dir: first read, second read
    cachefs       a `cachefs worker` process with a fresh cache dir: cold pass, warm pass
    local         the same bytes as local files (page cache), readinto an aligned numpy buffer

Each cached system gets a fresh cache for each workload (sequential, concurrent, large), so
every "first"/"cold" figure really is cold. Every read's bytes are compared with the source;
a wrong byte, or a failed cachefs read, makes the run exit 1 (results are still written).
Results: benchmarks/results/read-<timestamp>.json and latest.json (+ .png if matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MOUNT = "bench"
ALIGN = 4096
PACKAGES = ("cachefs", "fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "moto", "grpcio", "protobuf",
            "numpy", "diskcache", "xxhash")


# -- helpers -------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    from cachefs.config import parse_size as _parse

    return _parse(text)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return str(n)


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 buffer whose first byte is ``align``-aligned (np.empty is only 64-byte aligned)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift:shift + nbytes]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string for these values
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def machine_info() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cpu = ""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    git: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                       timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.splitlines()
        git["dirty_files"] = len(dirty)
    return {
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu,
        "mem_total_bytes": mem,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": versions,
        "git": git,
    }


# -- data ------------------------------------------------------------------------------------------
@dataclass
class Dataset:
    bucket: str
    small_keys: list[str]
    small: dict[str, bytes]
    large_key: str
    large: bytes

    @property
    def small_bytes(self) -> int:
        return sum(len(v) for v in self.small.values())


def make_dataset(moto: Any, n_small: int, small_size: int, large_size: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    bucket = moto.new_bucket("cachefs-bench")
    s3 = moto.client()
    small_keys = [f"small/sample-{i:06d}.bin" for i in range(n_small)]
    small = {}
    for key in small_keys:
        data = rng.integers(0, 256, small_size, dtype=np.uint8).tobytes()
        s3.put_object(Bucket=bucket, Key=key, Body=data)
        small[key] = data
    large_key = "large/blob.bin"
    large = rng.integers(0, 256, large_size, dtype=np.uint8).tobytes()
    if large_size > 0:
        s3.upload_fileobj(__import__("io").BytesIO(large), bucket, large_key)  # multipart above 8 MiB
    # Warm moto's request paths (imports, first connection) with boto3, so that whichever system
    # runs first is not charged for them.
    for key in small_keys[:16]:
        s3.head_object(Bucket=bucket, Key=key)
        s3.get_object(Bucket=bucket, Key=key, Range="bytes=0-4095", IfMatch=s3.head_object(
            Bucket=bucket, Key=key)["ETag"])["Body"].read()
        s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    if large_size > 0:
        s3.get_object(Bucket=bucket, Key=large_key, Range="bytes=0-1048575")["Body"].read()
    return Dataset(bucket, small_keys, small, large_key, large)


# -- measuring -----------------------------------------------------------------------------------
@dataclass
class Measurement:
    system: str
    workload: str  # small_seq | small_conc | large
    phase: str  # direct | first | second | cold | warm | local
    threads: int
    objects: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    wrong: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def case(self) -> str:
        return f"{self.system}/{self.phase}"

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies_s) if self.latencies_s else None
        ok = self.error is None and self.wall_s > 0
        out: dict[str, Any] = {
            "system": self.system, "workload": self.workload, "phase": self.phase, "threads": self.threads,
            "objects": self.objects, "bytes": self.bytes, "wall_s": round(self.wall_s, 6),
            "mb_per_s": round(self.bytes / self.wall_s / 1e6, 2) if ok else None,
            "objects_per_s": round(self.objects / self.wall_s, 2) if ok else None,
            "latency_ms": None if lat is None else {
                "p50": round(float(np.percentile(lat, 50)) * 1e3, 3),
                "p99": round(float(np.percentile(lat, 99)) * 1e3, 3),
                "mean": round(float(lat.mean()) * 1e3, 3),
                "max": round(float(lat.max()) * 1e3, 3),
            },
            "wrong_objects": self.wrong, "verified": ok and self.wrong == 0, "error": self.error,
        }
        if self.extra:
            out["extra"] = self.extra
        return out


ReadFn = Callable[[str], Any]  # key -> bytes (or anything bytes-comparable)


def run_pass(m: Measurement, read: ReadFn, keys: list[str], expected: Callable[[str], bytes],
             threads: int) -> Measurement:
    """Time reading ``keys`` (wall clock and per object); verify every result afterwards."""

    def one(key: str) -> tuple[float, Any]:
        t0 = time.perf_counter()
        data = read(key)
        return time.perf_counter() - t0, data

    try:
        if threads <= 1:
            t0 = time.perf_counter()
            results = [one(k) for k in keys]
            m.wall_s = time.perf_counter() - t0
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="bench") as pool:
                list(pool.map(lambda _: None, range(threads * 4)))  # start the threads before timing
                t0 = time.perf_counter()
                results = list(pool.map(one, keys))
                m.wall_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on with the next case
        m.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        return m
    m.objects = len(keys)
    m.latencies_s = [lat for lat, _ in results]
    for key, (_, data) in zip(keys, results):
        want = expected(key)
        m.bytes += len(want)
        if len(data) != len(want) or data != want:
            m.wrong += 1
    if m.wrong:
        print(f"  !! {m.system}/{m.workload}/{m.phase}: WRONG BYTES in {m.wrong} of {len(keys)} objects",
              file=sys.stderr)
    return m


# -- systems ---------------------------------------------------------------------------------------
class System:
    """A way to read the dataset; ``fresh()`` yields a reader with an empty cache."""

    name = ""
    passes = ("first", "second")

    @contextlib.contextmanager
    def fresh(self, workload: str) -> Iterator[ReadFn]:
        raise NotImplementedError
        yield

    def after_passes(self, workload: str) -> dict[str, Any]:
        return {}


class S3fsDirect(System):
    name = "s3fs"
    passes = ("direct",)

    def __init__(self, ds: Dataset, storage_options: dict[str, Any]) -> None:
        self.ds, self.so = ds, storage_options

    @contextlib.contextmanager
    def fresh(self, workload: str) -> Iterator[ReadFn]:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.so)
        yield lambda key: fs.cat_file(f"{self.ds.bucket}/{key}")


class FsspecCache(System):
    passes = ("first", "second")

    def __init__(self, kind: str, ds: Dataset, storage_options: dict[str, Any], tmp: str) -> None:
        self.name, self.kind, self.ds, self.so, self.tmp = kind, kind, ds, storage_options, tmp
        self._count = 0

    @contextlib.contextmanager
    def fresh(self, workload: str) -> Iterator[ReadFn]:
        import fsspec

        self._count += 1
        cache_dir = os.path.join(self.tmp, f"{self.kind}-{workload}-{self._count}")
        os.makedirs(cache_dir)
        fs = fsspec.filesystem(self.kind, target_protocol="s3",
                               target_options={**self.so, "skip_instance_cache": True},
                               cache_storage=cache_dir, skip_instance_cache=True)
        try:
            yield lambda key: fs.cat_file(f"{self.ds.bucket}/{key}")
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)


class CachefsWorker(System):
    name = "cachefs"
    passes = ("cold", "warm")

    def __init__(self, ds: Dataset, storage_options: dict[str, Any], tmp: str, quota: str,
                 worker_args: list[str], keep_logs: str | None, log_level: str = "INFO") -> None:
        self.ds, self.so, self.tmp, self.quota = ds, storage_options, tmp, quota
        self.log_level = log_level
        self.worker_args, self.keep_logs = worker_args, keep_logs
        self._count = 0
        self._status: dict[str, Any] = {}
        self.config_path = os.path.join(tmp, "worker.toml")
        # The mount goes in a config file: its options (endpoint, credentials) cannot be flags.
        with open(self.config_path, "w") as f:
            f.write("[worker]\n\n")
            f.write(f"[mounts.{MOUNT}]\nurl = {toml_value('s3://' + ds.bucket)}\n"
                    f"options = {toml_value(storage_options)}\n")
        self.worker: Any = None
        self.log_path = ""

    @contextlib.contextmanager
    def fresh(self, workload: str) -> Iterator[ReadFn]:
        import fsspec

        from cachefs.local import worker_process

        self._count += 1
        cache_dir = os.path.join(self.tmp, f"cachefs-cache-{workload}-{self._count}")
        self.log_path = os.path.join(self.keep_logs or self.tmp, f"worker-{workload}-{self._count}.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        worker = worker_process({}, cache_dir, quota=self.quota, log_path=self.log_path, env=env,
                                extra=["--config", self.config_path, *self.worker_args])
        worker.args = ["--log-level", self.log_level, *worker.args]  # a flag of `cachefs`, before `worker`
        fs = None
        try:
            worker.start(timeout=60)
            self.worker = worker
            fs = fsspec.filesystem("cachefs", workers=worker.address, skip_instance_cache=True)
            yield lambda key: fs.cat_file(f"cachefs://{MOUNT}/{key}")
            self._status[workload] = self._worker_status(worker.address)
        except BaseException:
            self._print_log_tail()
            raise
        finally:
            self.worker = None
            if fs is not None:
                with contextlib.suppress(Exception):
                    fs.close()
            worker.stop()
            worker.kill()
            shutil.rmtree(cache_dir, ignore_errors=True)

    def _print_log_tail(self) -> None:
        with contextlib.suppress(OSError):
            tail = open(self.log_path, errors="replace").read()[-3000:]
            if tail.strip():
                print(f"--- tail of {self.log_path} ---\n{tail}", file=sys.stderr)

    @staticmethod
    def _worker_status(address: str) -> dict[str, Any]:
        import grpc

        from cachefs.proto import worker_pb2, worker_pb2_grpc

        try:
            with grpc.insecure_channel(address) as channel:
                s = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            return {"error": str(exc.code())}
        return {"hits": s.hits, "misses": s.misses, "pages": s.pages, "used_bytes": s.used_bytes,
                "bytes_from_cache": s.bytes_from_cache, "bytes_from_store": s.bytes_from_store,
                "page_size": s.page_size}

    def after_passes(self, workload: str) -> dict[str, Any]:
        return {"worker_status": self._status.pop(workload, None)}


class LocalDisk(System):
    """The limit: the same bytes as local files, read with readinto into one aligned buffer."""

    name = "local"
    passes = ("local",)

    def __init__(self, ds: Dataset, tmp: str) -> None:
        self.ds = ds
        self.root = os.path.join(tmp, "local")
        for key in ds.small_keys:
            self._write(key, ds.small[key])
        if ds.large:
            self._write(ds.large_key, ds.large)
        sizes = [len(ds.small[k]) for k in ds.small_keys] + [len(ds.large)]
        self.slot = max(sizes)
        self.slot += (-self.slot) % ALIGN

    def _write(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    @contextlib.contextmanager
    def fresh(self, workload: str) -> Iterator[ReadFn]:
        # One aligned slot per object (objects never share a buffer, so every result can be
        # verified after the timed pass); all preallocated and touched before timing.
        keys = [self.ds.large_key] if workload == "large" else self.ds.small_keys
        per = self.slot if workload == "large" else max(len(self.ds.small[k]) for k in keys)
        per += (-per) % ALIGN
        buf = aligned_empty(per * len(keys))
        buf[::ALIGN] = 0
        slots = {k: i for i, k in enumerate(keys)}

        def read(key: str) -> memoryview:
            i = slots[key]
            fd = os.open(os.path.join(self.root, key), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                view = memoryview(buf[i * per:i * per + size])
                got = 0
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break
                    got += n
                return view[:got]
            finally:
                os.close(fd)

        yield read


# -- the run ---------------------------------------------------------------------------------------
WORKLOAD_ORDER = ("small_seq", "small_conc", "large")


def run_system(system: System, ds: Dataset, workloads: list[str], threads: int, out: list[Measurement]) -> None:
    """Append each measurement to ``out`` as soon as it is taken (kept if the run is interrupted)."""
    for workload in workloads:
        if workload == "large":
            keys, n_threads = [ds.large_key], 1
            expected: Callable[[str], bytes] = lambda k: ds.large
        else:
            keys, n_threads = ds.small_keys, (1 if workload == "small_seq" else threads)
            expected = ds.small.__getitem__
        ms = []
        try:
            with system.fresh(workload) as read:
                for phase in system.passes:
                    m = run_pass(Measurement(system.name, workload, phase, n_threads), read, keys, expected, n_threads)
                    ms.append(m)
                    out.append(m)
                    print(f"  {system.name:<12} {workload:<10} {phase:<7} {fmt_line(m.summary())}", flush=True)
                    if m.error:
                        break
        except Exception as exc:  # noqa: BLE001 - a system that cannot start: recorded
            traceback.print_exc(file=sys.stderr)
            ms.append(Measurement(system.name, workload, system.passes[0], n_threads,
                                  error=f"{type(exc).__name__}: {exc}"))
            out.append(ms[-1])
        extra = system.after_passes(workload)
        if extra and ms:
            ms[-1].extra.update(extra)


def fmt_line(s: dict[str, Any]) -> str:
    if s["error"]:
        return f"ERROR {s['error']}"
    lat = s["latency_ms"] or {}
    wrong = f"  WRONG {s['wrong_objects']}" if s["wrong_objects"] else ""
    return (f"{s['wall_s']:8.3f} s {s['mb_per_s']:9.1f} MB/s {s['objects_per_s']:9.1f} obj/s"
            f"  p50 {lat.get('p50', 0):8.2f} ms  p99 {lat.get('p99', 0):8.2f} ms{wrong}")


def find(results: list[dict[str, Any]], system: str, workload: str, phase: str) -> dict[str, Any] | None:
    for r in results:
        if r["system"] == system and r["workload"] == workload and r["phase"] == phase and not r["error"]:
            return r
    return None


def compute_ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each ratio with its target (DESIGN.md s5); throughput ratios are objects/s (or MB/s)."""
    ratios: dict[str, Any] = {}

    def add(name: str, num: dict | None, den: dict | None, key: str, target: str, ok: Callable[[float], bool]):
        if num is None or den is None or not den.get(key):
            ratios[name] = {"value": None, "target": target, "met": None}
            return
        value = num[key] / den[key]
        ratios[name] = {"value": round(value, 3), "target": target, "met": bool(ok(value))}

    for wl in ("small_seq", "small_conc"):
        warm = find(results, "cachefs", wl, "warm")
        add(f"cachefs_warm_vs_s3fs_direct.{wl}", warm, find(results, "s3fs", wl, "direct"),
            "objects_per_s", ">= 30", lambda v: v >= 30)
        add(f"cachefs_warm_vs_simplecache_second.{wl}", warm, find(results, "simplecache", wl, "second"),
            "objects_per_s", ">= 1.0", lambda v: v >= 1.0)
        add(f"cachefs_warm_vs_local.{wl}", warm, find(results, "local", wl, "local"),
            "objects_per_s", "(info)", lambda v: True)
    for wl in WORKLOAD_ORDER:
        add(f"cachefs_cold_wall_vs_s3fs_direct_wall.{wl}", find(results, "cachefs", wl, "cold"),
            find(results, "s3fs", wl, "direct"), "wall_s", "<= 1.1", lambda v: v <= 1.1)
    warm_large = find(results, "cachefs", "large", "warm")
    add("cachefs_warm_vs_s3fs_direct.large", warm_large, find(results, "s3fs", "large", "direct"),
        "mb_per_s", "(info)", lambda v: True)
    add("cachefs_warm_vs_simplecache_second.large", warm_large, find(results, "simplecache", "large", "second"),
        "mb_per_s", "(info)", lambda v: True)
    add("cachefs_warm_vs_local_aligned.large", warm_large, find(results, "local", "large", "local"),
        "mb_per_s", ">= 0.8", lambda v: v >= 0.8)
    return ratios


def print_table(results: list[dict[str, Any]], ratios: dict[str, Any], params: dict[str, Any]) -> None:
    titles = {"small_seq": f"{params['n_small']} x {human(params['small_size'])}, sequential",
              "small_conc": f"{params['n_small']} x {human(params['small_size'])}, {params['threads']} threads",
              "large": f"1 x {human(params['large_size'])}, whole object"}
    for wl in WORKLOAD_ORDER:
        rows = [r for r in results if r["workload"] == wl]
        if not rows:
            continue
        print(f"\n{titles[wl]}")
        print(f"  {'case':<20} {'wall s':>9} {'MB/s':>9} {'obj/s':>9} {'p50 ms':>9} {'p99 ms':>9}  ok")
        for r in rows:
            case = f"{r['system']}/{r['phase']}"
            if r["error"]:
                print(f"  {case:<20} ERROR {r['error'][:90]}")
                continue
            lat = r["latency_ms"] or {}
            ok = "yes" if r["verified"] else f"NO ({r['wrong_objects']} wrong)"
            print(f"  {case:<20} {r['wall_s']:9.3f} {r['mb_per_s']:9.1f} {r['objects_per_s']:9.1f} "
                  f"{lat.get('p50', 0):9.2f} {lat.get('p99', 0):9.2f}  {ok}")
    print("\nratios (same run, same data)")
    for name, r in ratios.items():
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        met = {True: "met", False: "NOT met", None: ""}[r["met"]] if r["target"] != "(info)" else ""
        print(f"  {name:<52} {value:>9}   target {r['target']:<7} {met}")


def plot(results: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot (pip install matplotlib into the venv to get one)"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, wl in zip(axes, WORKLOAD_ORDER):
        rows = [r for r in results if r["workload"] == wl and not r["error"]]
        names = [f"{r['system']}\n{r['phase']}" for r in rows]
        values = [r["mb_per_s"] for r in rows]
        colors = ["tab:red" if r["system"] == "cachefs" else "tab:gray" if r["system"] == "local" else "tab:blue"
                  for r in rows]
        ax.bar(names, values, color=colors)
        ax.set_yscale("log")
        ax.set_title(wl)
        ax.set_ylabel("MB/s (log)")
        ax.tick_params(axis="x", labelsize=7, labelrotation=35)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (< 2 min on 2 cores): 128 objects, 32 MiB large")
    p.add_argument("--objects", type=int, help="number of small objects (default 200; quick 128)")
    p.add_argument("--small-size", default="256KiB", help="size of each small object (default 256KiB)")
    p.add_argument("--large-size", help="size of the large object (default 64MiB; quick 32MiB; 0 = none)")
    p.add_argument("--threads", type=int, default=8, help="concurrent readers for small_conc (default 8)")
    p.add_argument("--systems", default="s3fs,simplecache,blockcache,cachefs,local",
                   help="comma-separated subset of s3fs,simplecache,blockcache,cachefs,local")
    p.add_argument("--workloads", default=",".join(WORKLOAD_ORDER), help="subset of small_seq,small_conc,large")
    p.add_argument("--blockcache-small", choices=("yes", "no"), default="yes",
                   help="run blockcache on the small objects too (default yes)")
    p.add_argument("--quota", default="4GiB", help="worker cache quota")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra `cachefs worker` flag, e.g. --worker-arg=--page-size=1MiB (repeatable)")
    p.add_argument("--worker-log-level", default="INFO", help="the worker's --log-level (default INFO, as deployed)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--keep-logs", metavar="DIR", help="keep the worker logs in DIR")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    n_small = args.objects if args.objects is not None else (128 if args.quick else 200)
    large_size = parse_size(args.large_size) if args.large_size is not None else (32 << 20 if args.quick else 64 << 20)
    small_size = parse_size(args.small_size)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workloads = [w for w in WORKLOAD_ORDER if w in {x.strip() for x in args.workloads.split(",")}]
    if large_size == 0:
        workloads = [w for w in workloads if w != "large"]
    unknown = set(systems) - {"s3fs", "simplecache", "blockcache", "cachefs", "local"}
    if unknown:
        print(f"unknown systems: {sorted(unknown)}", file=sys.stderr)
        return 2
    params = {"quick": args.quick, "n_small": n_small, "small_size": small_size, "large_size": large_size,
              "threads": args.threads, "systems": systems, "workloads": workloads, "seed": args.seed,
              "blockcache_small": args.blockcache_small == "yes", "worker_quota": args.quota,
              "worker_args": args.worker_arg, "worker_log_level": args.worker_log_level,
              "notes": ["moto S3 server on 127.0.0.1 in its own process, no injected latency",
                        "each cached system gets a fresh cache per workload; first/cold = empty cache",
                        "latency: per object, wall clock in the calling thread (includes queueing when threaded)",
                        "local: same bytes as local files, already in the page cache (written just before)"]}

    # Ctrl-C and SIGTERM both unwind through the ExitStack below (worker, moto, temp dirs).
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored (nohup, &)
    from cachefs.testing import MotoServer

    started = time.time()
    measurements: list[Measurement] = []
    interrupted = False
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cachefs-bench-"))
        try:
            print(f"starting moto; {n_small} x {human(small_size)} + {human(large_size)} objects", flush=True)
            moto = stack.enter_context(MotoServer())
            ds = make_dataset(moto, n_small, small_size, large_size, args.seed)
            so = moto.storage_options()
            print(f"data in s3://{ds.bucket} at {moto.endpoint_url} ({time.time() - started:.1f} s)", flush=True)
            if args.keep_logs:
                os.makedirs(args.keep_logs, exist_ok=True)
            for name in systems:
                if name == "s3fs":
                    system: System = S3fsDirect(ds, so)
                elif name in ("simplecache", "blockcache"):
                    system = FsspecCache(name, ds, so, tmp)
                elif name == "cachefs":
                    system = CachefsWorker(ds, so, tmp, args.quota, args.worker_arg, args.keep_logs,
                                           args.worker_log_level)
                else:
                    system = LocalDisk(ds, tmp)
                wls = workloads
                if name == "blockcache" and args.blockcache_small == "no":
                    wls = [w for w in workloads if w == "large"]
                run_system(system, ds, wls, args.threads, measurements)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping worker and moto, writing partial results", file=sys.stderr)

    results = [m.summary() for m in measurements]
    ratios = compute_ratios(results)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    wrong = sum(r["wrong_objects"] for r in results)
    cachefs_failed = any(r["error"] for r in results if r["system"] == "cachefs")
    peer_failed = [f"{r['system']}/{r['workload']}/{r['phase']}" for r in results
                   if r["error"] and r["system"] != "cachefs"]
    doc = {
        "benchmark": "read", "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1), "interrupted": interrupted,
        "machine": machine_info(), "parameters": params, "results": results, "ratios": ratios,
        "ok": not (wrong or cachefs_failed or interrupted), "wrong_objects": wrong, "failed_peers": peer_failed,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"read-{stamp}.json")
    if not args.no_plot and results:
        png = os.path.join(args.out_dir, f"read-{stamp}.png")
        note = plot(results, png)
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
        print(f"peer cases that failed (not counted against cachefs): {', '.join(peer_failed)}")
    if wrong:
        print(f"FAILED: {wrong} objects read with wrong bytes", file=sys.stderr)
    if cachefs_failed:
        print("FAILED: a cachefs case raised", file=sys.stderr)
    return 0 if doc["ok"] else (130 if interrupted and not wrong and not cachefs_failed else 1)


if __name__ == "__main__":
    sys.exit(main())
