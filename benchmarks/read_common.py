"""Shared parts of bench_read.py: the data set, the store endpoint, measurements and one timed pass.

Every case of the read benchmark reads the same objects into the same preallocated, 4096-aligned
slots (or returns bytes, for the peers whose natural API does), and every result is compared with
the source bytes after the timed pass.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import platform
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALIGN = 4096
PACKAGES = ("cachefs", "fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "moto", "grpcio", "protobuf",
            "numpy", "diskcache", "xxhash", "matplotlib")
CREDENTIALS = {"key": "testing", "secret": "testing"}

#: name -> (object class, readers is the --threads value?)
WORKLOADS = {"small_seq": ("small", False), "small_conc": ("small", True),
             "large": ("large", False), "large_conc": ("large", True)}


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


def process_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process, all threads; zeros if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick  # utime, stime


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used; 0.0 if it is gone."""
    return sum(process_cpu_split(pid))


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 buffer whose first byte is ``align``-aligned (np.empty is only 64-byte aligned)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    shift = (-raw.ctypes.data) % align
    return raw[shift:shift + nbytes]


def machine_info() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
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
        "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": versions,
        "git": git,
    }


# -- the store -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Store:
    """Where the objects live: an S3 endpoint (moto), maybe behind injected delay."""

    url: str
    delay_ms: float
    note: str
    rtt_ms: float | None = None
    mode: str = "loopback"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint (what the worker's mount holds, credentials included)."""
        return {**CREDENTIALS, "endpoint_url": self.url, "client_kwargs": {"region_name": "us-east-1"}}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["key"], aws_secret_access_key=CREDENTIALS["secret"])


@contextlib.contextmanager
def store_endpoint(delay_ms: float) -> Iterator[Store]:
    """moto via benchmarks/netem.py (network delay when asked and possible), else on 127.0.0.1."""
    try:
        from netem import moto_endpoint  # benchmarks/ is on sys.path (bench_read.py puts it there)
    except ImportError as exc:
        if delay_ms > 0:
            raise RuntimeError(f"--delay-ms needs benchmarks/netem.py, which cannot be imported: {exc}") from exc
        from cachefs.testing import MotoServer

        with MotoServer() as moto:
            yield Store(moto.endpoint_url, 0.0, "moto on 127.0.0.1, no injected delay (benchmarks/netem.py absent)")
        return
    # Objects stay in moto's memory (never spooled to temp files), also the 64 MiB ones.
    with moto_endpoint(delay_ms, env={"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 30)}) as ep:
        yield Store(ep.url, float(ep.delay_ms), ep.note, getattr(ep, "rtt_ms", None), getattr(ep, "mode", ""))


# -- data ------------------------------------------------------------------------------------------
@dataclass
class Dataset:
    bucket: str
    small_keys: list[str]
    large_keys: list[str]
    data: dict[str, bytes]
    root: str  # the same bytes as local files (page cache warm): what the limits serve

    def keys(self, kind: str) -> list[str]:
        return self.small_keys if kind == "small" else self.large_keys

    def size(self, kind: str) -> int:
        keys = self.keys(kind)
        return max(len(self.data[k]) for k in keys) if keys else 0


def make_dataset(store: Store, root: str, n_small: int, small_size: int, n_large: int, large_size: int,
                 seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    s3 = store.client()
    bucket = f"cachefs-bench-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    small_keys = [f"small/sample-{i:06d}.bin" for i in range(n_small)]
    large_keys = [f"large/blob-{i}.bin" for i in range(n_large if large_size > 0 else 0)]
    data: dict[str, bytes] = {}
    for key in small_keys:
        data[key] = rng.integers(0, 256, small_size, dtype=np.uint8).tobytes()
        s3.put_object(Bucket=bucket, Key=key, Body=data[key])
    for key in large_keys:
        data[key] = rng.integers(0, 256, large_size, dtype=np.uint8).tobytes()
        s3.upload_fileobj(io.BytesIO(data[key]), bucket, key)  # multipart above 8 MiB
    for key, value in data.items():
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(value)
    # Warm moto's request paths (imports, first connection) so that whichever system runs first
    # is not charged for them.
    for key in small_keys[:16]:
        etag = s3.head_object(Bucket=bucket, Key=key)["ETag"]
        s3.get_object(Bucket=bucket, Key=key, Range="bytes=0-4095", IfMatch=etag)["Body"].read()
        s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    for key in large_keys:
        s3.get_object(Bucket=bucket, Key=key, Range="bytes=0-1048575")["Body"].read()
    return Dataset(bucket, small_keys, large_keys, data, root)


class Slots:
    """Preallocated aligned buffers, one per read of a pass, reused by every pass and system.

    Touched once before any timing, so no case pays page faults for its destination.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, int], list[np.ndarray]] = {}

    def get(self, count: int, size: int) -> list[np.ndarray]:
        if (count, size) not in self._bufs:
            per = size + (-size) % ALIGN
            buf = aligned_empty(per * count)
            buf[::ALIGN] = 0
            self._bufs[(count, size)] = [buf[i * per:i * per + size] for i in range(count)]
        return self._bufs[(count, size)]


def plan(ds: Dataset, workload: str, threads: int) -> tuple[list[str], int]:
    """The keys one pass reads (one slot each) and its number of concurrent readers.

    Small: every small object once, by 1 or ``threads`` readers. Large, 1 reader: every large
    object in turn. Large, N readers: reader i reads large object i mod n, all at once (several
    readers share an object, as ranks reading the same shard do).
    """
    kind, concurrent = WORKLOADS[workload]
    keys = ds.keys(kind)
    if not concurrent:
        return list(keys), 1
    if kind == "small":
        return list(keys), threads
    return [keys[i % len(keys)] for i in range(threads)], threads


# -- measuring -----------------------------------------------------------------------------------
@dataclass
class Measurement:
    system: str
    workload: str  # small_seq | small_conc | large | large_conc
    phase: str  # direct | first | second | cold | warm | limit
    threads: int
    api: str = ""
    objects: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    wrong: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies_s) if self.latencies_s else None
        ok = self.error is None and self.wall_s > 0
        out: dict[str, Any] = {
            "system": self.system, "workload": self.workload, "phase": self.phase, "readers": self.threads,
            "api": self.api, "objects": self.objects, "bytes": self.bytes, "wall_s": round(self.wall_s, 6),
            "mb_per_s": round(self.bytes / self.wall_s / 1e6, 2) if ok else None,
            "objects_per_s": round(self.objects / self.wall_s, 2) if ok else None,
            "latency_ms": None if lat is None else {
                "p50": round(float(np.percentile(lat, 50)) * 1e3, 3),
                "p99": round(float(np.percentile(lat, 99)) * 1e3, 3),
                "mean": round(float(lat.mean()) * 1e3, 3),
                "max": round(float(lat.max()) * 1e3, 3),
            },
            "wrong_objects": self.wrong, "verified": ok and self.wrong == 0 and self.objects > 0,
            "error": self.error,
        }
        if self.extra:
            out["extra"] = self.extra
        return out


#: (key, its preallocated slot) -> the object's bytes: a bytes-like or a view of the slot
ReadFn = Callable[[str, np.ndarray], Any]


def same(data: Any, want: bytes) -> bool:
    if isinstance(data, bytes):
        return data == want
    got = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    return got.size == len(want) and bool(np.array_equal(got, np.frombuffer(want, dtype=np.uint8)))


def run_pass(m: Measurement, read: ReadFn, keys: list[str], slots: list[np.ndarray], data: dict[str, bytes],
             threads: int) -> Measurement:
    """Time reading ``keys`` (wall clock and per object); verify every result afterwards."""

    def one(i: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        got = read(keys[i], slots[i])
        return time.perf_counter() - t0, got

    try:
        if threads <= 1:
            t0 = time.perf_counter()
            results = [one(i) for i in range(len(keys))]
            m.wall_s = time.perf_counter() - t0
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="bench") as pool:
                list(pool.map(time.sleep, [0.001] * threads * 2))  # start the threads before timing
                t0 = time.perf_counter()
                results = list(pool.map(one, range(len(keys))))
                m.wall_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on with the next case
        m.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        return m
    m.objects = len(keys)
    m.latencies_s = [lat for lat, _ in results]
    for key, (_, got) in zip(keys, results):
        want = data[key]
        m.bytes += len(want)
        if not same(got, want):
            m.wrong += 1
    if m.wrong:
        print(f"  !! {m.system}/{m.workload}/{m.phase}: WRONG BYTES in {m.wrong} of {len(keys)} objects",
              file=sys.stderr)
    return m
