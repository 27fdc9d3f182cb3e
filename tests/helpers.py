"""Small helpers for tests (not fixtures)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from cachefs.client.fs.filesystem import CacheFileSystem


def client(*addresses: str, **options) -> CacheFileSystem:
    return fsspec.filesystem("cachefs", workers=",".join(addresses), skip_instance_cache=True, **options)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def page_files(cache_dir: Path) -> list[Path]:
    return [p for p in (cache_dir / "pages").rglob("*") if p.is_file()]


def flip_page_bytes(cache_dir: Path, offset: int = 100) -> int:
    """Corrupt every page file in place (one payload byte flipped); returns how many."""
    files = page_files(cache_dir)
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([b[0] ^ 0xFF]))
    return len(files)


def disk_usage(cache_dir: Path) -> int:
    total = 0
    for path in page_files(cache_dir):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # evicted while we looked
            pass
    return total


def coexisting_usage(cache_dir: Path) -> int:
    """Bytes of page files that all existed at one instant (between two directory passes).

    One pass is not a snapshot: it can see a file that was evicted and, later in the same
    pass, the file written after it. Files seen (same inode) in two passes existed together
    at the moment between the passes, so their sum never over-counts.
    """
    def snapshot() -> dict[Path, tuple[int, int]]:
        out = {}
        for path in page_files(cache_dir):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out[path] = (st.st_ino, st.st_size)
        return out

    first, second = snapshot(), snapshot()
    return sum(size for path, (ino, size) in first.items() if second.get(path) == (ino, size))


def scrape(metrics_port: int) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def store_requests(worker) -> Counter:
    """An in-process worker's requests to its store so far, by kind (info, open, read, list)."""
    return Counter({sample.labels["kind"]: sample.value for family in worker.metrics.store_requests.collect()
                    for sample in family.samples if sample.name.endswith("_total")})


class SlowMemoryFileSystem(MemoryFileSystem):
    """A real fsspec store (in memory) whose reads take time and are counted.

    Lets tests see single-flight and page-parallel fetches deterministically.
    """

    protocol = "slowmem"
    delay = 0.05
    lock = threading.Lock()
    reads: list[tuple[str, int, int]] = []
    active = 0
    max_active = 0

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("slowmem://"):
            path = path[len("slowmem://"):]
        return super()._strip_protocol(path)

    @classmethod
    def reset_counters(cls) -> None:
        with cls.lock:
            cls.reads = []
            cls.active = 0
            cls.max_active = 0

    def cat_file(self, path, start=None, end=None, **kwargs):
        with SlowMemoryFileSystem.lock:
            SlowMemoryFileSystem.active += 1
            SlowMemoryFileSystem.max_active = max(SlowMemoryFileSystem.max_active, SlowMemoryFileSystem.active)
            SlowMemoryFileSystem.reads.append((path, start or 0, end or -1))
        try:
            time.sleep(self.delay)
            return super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            with SlowMemoryFileSystem.lock:
                SlowMemoryFileSystem.active -= 1


fsspec.register_implementation("slowmem", SlowMemoryFileSystem, clobber=True)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1"):
    """A port on ``host`` that refuses connections for as long as the block runs.

    A socket bound and never listening: a connect to it is refused at once, and while it stays
    bound nothing else can take the port. (A port found free by binding and closing a socket
    can be taken by another process before the test uses it: then it is not dead at all.)
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]


def rename_away(path: Path) -> Path:
    away = path.with_name(path.name + ".away")
    os.rename(path, away)
    return away


class FakeClock:
    """A clock a test moves by hand (``clock.advance(s)``): waits and leases without real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ReadLoop:
    """Readers that check every byte, in threads, until stopped; errors are collected."""

    def __init__(self, fs, objects: dict[str, bytes], threads: int = 4) -> None:
        self.fs, self.objects, self.keys = fs, objects, sorted(objects)
        self.errors: list[BaseException] = []
        self.reads = 0
        self._lock = threading.Lock()  # += from several threads could lose a count
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,)) for s in range(threads)]

    def _run(self, seed: int) -> None:
        i = seed
        while not self._stop.is_set():
            key = self.keys[i % len(self.keys)]
            i += 7
            try:
                if self.fs.cat_file(f"data/{key}", 3, 15_000) != self.objects[key][3:15_000]:
                    self.errors.append(AssertionError(f"wrong bytes for {key}"))
                with self._lock:
                    self.reads += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

    def wait_reads(self, more: int = 8, timeout: float = 30) -> bool:
        """Wait for ``more`` reads than now (more than the threads can have in flight: so at
        least some started after this call); False at the timeout or at the first error."""
        target = self.reads + more
        wait_for(lambda: self.errors or self.reads >= target, timeout=timeout)
        return not self.errors and self.reads >= target

    def __enter__(self) -> "ReadLoop":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def stop_local(proc, timeout: float = 30.0) -> None:
    """Stop a ``cachefs local`` (or any daemon) process as Ctrl-C would; killed if it lingers."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def local_master(proc, timeout: float = 60.0) -> str:
    """The master address a ``cachefs local`` process prints (``export CACHEFS_MASTER=...``),
    read from its stdout (text); fails the test with what it printed if none came in ``timeout``."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if "CACHEFS_MASTER=" in line:
            return line.strip().split("=", 1)[1]
    raise AssertionError("cachefs local did not print its master:\n" + "".join(seen))
