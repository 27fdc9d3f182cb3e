"""Faults injected into real processes; every byte read is checked against the source.

Complements tests/test_cluster.py (kill -9 of a worker / the master with thread readers) and
tests/test_worker_process.py (restart keeps the cache): here the load is concurrent threads
*and* processes, the hit ratio after a restart is stated, and the cache disk, the page files,
the object store and the network fail. docs/reliability.md lists what each test shows.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import fsspec
import grpc
import pytest

from cachefs.errors import DeadlineExceededError, StaleObjectError, StoreUnavailableError
from cachefs.local import LocalCluster, worker_process
from cachefs.mounts import MountSpec
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.testing import MotoServer
from helpers import SlowMemoryFileSystem, client, page_files, payload, scrape, wait_for

PAGE = 64 << 10
FAST = ["--lease-seconds", "3", "--heartbeat-seconds", "0.5"]


# ----------------------------------------------------------------------------- helpers
def _status(address: str) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(str(value))


def _worker_config(path: Path, mount: MountSpec, metadata_ttl: float = 3600) -> str:
    """A worker TOML with one mount (S3 options carry the credentials, so not on a command line)."""
    path.write_text(f"page_size = {PAGE}\nmetadata_ttl = {metadata_ttl}\n\n[mounts.data]\n"
                    f'url = "{mount.url}"\noptions = {_toml(dict(mount.options))}\n')
    return str(path)


class _Readers:
    """Threads reading objects and checking every byte until stopped; errors are collected."""

    def __init__(self, fs, objects: dict[str, bytes], threads: int = 4, allowed: tuple = ()) -> None:
        self.fs, self.objects, self.keys = fs, objects, sorted(objects)
        self.allowed = allowed
        self.errors: list[BaseException] = []
        self.reads = self.bytes_verified = self.allowed_errors = 0
        self.by_key: dict[str, int] = dict.fromkeys(self.keys, 0)  # good reads of each key
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in range(threads)]

    def _run(self, seed: int) -> None:
        i = seed
        while not self._stop.is_set():
            key = self.keys[i % len(self.keys)]
            i += 3
            try:
                data = self.fs.cat_file(f"data/{key}")
            except self.allowed:
                with self._lock:
                    self.allowed_errors += 1
                continue
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                with self._lock:
                    self.errors.append(exc)
                continue
            with self._lock:
                if data != self.objects[key]:
                    self.errors.append(AssertionError(f"wrong bytes for {key}"))
                else:
                    self.by_key[key] += 1
                self.reads += 1
                self.bytes_verified += len(data)

    def wait_reads(self, more: int = 8, timeout: float = 30) -> bool:
        """Wait for ``more`` reads than now (more than the threads can have in flight: so some
        started after this call); False at the timeout or at the first error."""
        target = self.reads + more
        wait_for(lambda: self.errors or self.reads >= target, timeout=timeout)
        return not self.errors and self.reads >= target

    def __enter__(self) -> "_Readers":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a reader thread hung"


def _process_reader(master: str, objects: dict[str, bytes], ready, stop, out) -> None:
    """In a child process: its own client (channels are per process), reading until told to stop."""
    fs = fsspec.filesystem("cachefs", master=master, timeout=5, skip_instance_cache=True)
    keys, i, reads, verified, errors = sorted(objects), os.getpid(), 0, 0, []
    first = keys[0]
    if fs.cat_file(f"data/{first}") == objects[first]:  # it has its view: the faults may start
        ready.release()
    while not stop.is_set():
        key = keys[i % len(keys)]
        i += 5
        try:
            data = fs.cat_file(f"data/{key}")
            if data != objects[key]:
                errors.append(f"wrong bytes for {key}")
            reads += 1
            verified += len(data)
        except Exception as exc:  # noqa: BLE001 - sent back to the test
            errors.append(repr(exc))
    out.put((reads, verified, errors[:5], len(errors)))


# ------------------------------------------------------------------ crashes under load
def test_worker_and_master_killed_under_thread_and_process_load(local_store, tmp_path):
    """kill -9 of a worker, then of the master (restarted), while 4 threads and 2 processes read."""
    for i in range(24):
        local_store.add(f"o{i:02d}.bin", payload(30_000 + 101 * i, i))
    objects = {k: v for k, v in local_store.objects.items()}
    # The master binds port 0; start_master() restarts it on the port it reported.
    cluster = LocalCluster(str(tmp_path / "c"), workers=3, mounts={"data": local_store.mount.url},
                           master_args=FAST)
    cluster.start()
    # Spawned, not forked: this process has gRPC calls in flight (the view watch stream), and a
    # fork in the middle of one can leave the child's gRPC wedged (that hazard is not the test's).
    ctx = multiprocessing.get_context("spawn")
    stop, out, ready = ctx.Event(), ctx.Queue(), ctx.Semaphore(0)
    procs = []
    try:
        assert cluster.wait_for_workers()
        fs = client(master=cluster.master_address, timeout=5)
        for key, data in objects.items():
            assert fs.cat_file(f"data/{key}") == data
        procs = [ctx.Process(target=_process_reader, args=(cluster.master_address, objects, ready, stop, out))
                 for _ in range(2)]
        for p in procs:
            p.start()
        for _ in procs:  # a client started while the master is down has no view to route with
            assert ready.acquire(timeout=60), "a reader process did not get going"
        with _Readers(fs, objects, threads=4) as readers:
            assert readers.wait_reads(), (readers.reads, readers.errors[:3])
            cluster.workers[0].kill()  # kill -9 a worker under load
            assert wait_for(lambda: cluster.workers[0].address not in fs.session.workers.addresses, timeout=20)
            reads_before_master = readers.reads
            cluster.master.kill()  # kill -9 the master under load
            assert readers.wait_reads(), (readers.reads, readers.errors[:3])  # reads go on without it
            cluster.master = cluster.start_master()
            assert cluster.wait_for_workers(count=2)
            assert readers.wait_reads(), (readers.reads, readers.errors[:3])  # and with it back
        stop.set()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert not readers.errors, readers.errors[:3]
        assert readers.reads > reads_before_master > 0
        for reads, verified, errors, n_errors in results:
            assert n_errors == 0, errors
            assert reads > 0 and verified > 0
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
        cluster.stop()


def test_worker_restarted_under_load_keeps_hit_ratio_above_99_percent(local_store, tmp_path):
    """A worker killed (-9) and restarted on its cache dir serves >= 99% of page lookups from it."""
    for i in range(16):
        local_store.add(f"o{i:02d}.bin", payload(3 * PAGE + 13 * i, 50 + i))
    config = _worker_config(tmp_path / "w.toml", local_store.mount)
    cache = str(tmp_path / "cache")
    extra = ["--config", config]  # port 0: the first binds a free one and reports it
    first = worker_process({}, cache, extra=extra, log_path=str(tmp_path / "w1.log")).start()
    try:
        # fallback: while the only worker is down, reads go to the store, so no reader sees an error
        # short_circuit=False: every read goes through the worker, which counts its page lookups
        # (a same-host client would otherwise read the page files itself, uncounted).
        fs = client(first.address, timeout=5, fallback=True, short_circuit=False,
                    fallback_mounts={"data": local_store.mount.url})
        for key, data in local_store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        assert wait_for(lambda: _status(first.address).pages == sum(-(-len(d) // PAGE)
                                                                    for d in local_store.objects.values()))
        # and their index rows, written behind, are committed: a kill now loses no page
        assert wait_for(lambda: scrape(first.ready["metrics_port"])["cachefs_worker_cache_index_pending"] == 0)
        with _Readers(fs, local_store.objects, threads=6) as readers:
            assert readers.wait_reads(12), (readers.reads, readers.errors[:3])
            first.kill()
            assert readers.wait_reads(12), (readers.reads, readers.errors[:3])  # from the store, meanwhile
            second = worker_process({}, cache, extra=[*extra, "--port", str(first.ready["port"])],
                                    log_path=str(tmp_path / "w2.log")).start()
            assert second.address == first.address  # the client knows the worker by this address
            # Its breaker in the client closes again after a back-off: then it serves again.
            assert wait_for(lambda: _status(second.address).hits > 20, timeout=40)
        assert not readers.errors, readers.errors[:3]
        with _Readers(fs, local_store.objects, threads=6) as more:
            assert more.wait_reads(40), (more.reads, more.errors[:3])  # 3-4 page lookups each
        assert not more.errors, more.errors[:3]
        status = _status(second.address)
        lookups = status.hits + status.misses
        assert lookups > 50, lookups
        assert status.hits / lookups >= 0.99, (status.hits, status.misses)
        assert status.bytes_from_store == 0
        second.stop()
    finally:
        first.kill()
        if "second" in locals():
            second.kill()


# -------------------------------------------------------------------- the cache disk
@contextmanager
def _tmpfs(path: Path, size: str):
    """A tiny real file system that runs out of space (needs root / CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}): "
                    "ENOSPC is covered in-process by test_pagestore.py::test_put_enospc_fails_and_store_keeps_serving")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _indexed_pages(cache: Path) -> int:
    """Rows committed to a cache dir's page index (diskcache's SQLite file, opened read-only)."""
    import sqlite3

    db = cache / "index" / "cache.db"
    if not db.exists():
        return 0
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT count(*) FROM Cache").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


def test_full_cache_disk_worker_keeps_serving_and_reports_degraded(local_store, tmp_path):
    """The cache dir's file system (tmpfs of 1 MiB) is far smaller than its quota: ENOSPC for real."""
    for i in range(12):
        local_store.add(f"o{i:02d}.bin", payload(4 * PAGE + i, 200 + i))  # ~3 MiB in all
    with _tmpfs(tmp_path / "disk", "1m") as disk:
        config = _worker_config(tmp_path / "w.toml", local_store.mount)
        with worker_process({}, str(disk / "cache"), quota="1GiB", extra=["--config", config],
                            log_path=str(tmp_path / "w.log")) as worker:
            fs = client(worker.address, timeout=10)
            first = sorted(local_store.objects)[0]
            assert fs.cat_file(f"data/{first}") == local_store.objects[first]
            # Its pages are written and their index rows committed (rows are written behind;
            # a row batch that hits ENOSPC drops its pages) before the rest fills the disk.
            assert wait_for(lambda: _indexed_pages(disk / "cache") >= 4, timeout=30)
            for _ in range(2):
                for key, data in local_store.objects.items():
                    assert fs.cat_file(f"data/{key}") == data
            status = _status(worker.address)
            assert status.degraded, "a worker whose cache disk is full must say so"
            assert status.disk_errors > 0
            assert status.bytes_from_store > sum(map(len, local_store.objects.values())), "reads pass through"
            assert worker.proc.poll() is None, "the worker crashed"
            assert page_files(disk / "cache"), "some pages were cached before the disk filled"


def test_failing_cache_disk_eio_passes_reads_through_then_recovers(local_store, make_worker, monkeypatch):
    """EIO on every page write and page read (injected at the OS boundary of the page files)."""
    import errno

    from cachefs import pagefile

    for i in range(6):
        local_store.add(f"o{i}.bin", payload(3 * PAGE + i, 300 + i))
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=3600, degraded_settle_s=0.5)
    fs = client(worker.address)
    keys = sorted(local_store.objects)
    assert fs.cat_file(f"data/{keys[0]}") == local_store.objects[keys[0]]  # cached while healthy

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(pagefile, "_write_all", eio)
    monkeypatch.setattr(pagefile.os, "pread", eio)  # trailer reads: every page read fails
    for _ in range(2):
        for key in keys:
            assert fs.cat_file(f"data/{key}") == local_store.objects[key]
    status = _status(worker.address)
    assert status.degraded and status.disk_errors >= len(keys)
    monkeypatch.undo()
    assert wait_for(lambda: fs.cat_file(f"data/{keys[1]}") == local_store.objects[keys[1]]
                    and not _status(worker.address).degraded, timeout=30)


def test_corrupted_and_truncated_page_files_under_a_worker_process(local_store, tmp_path):
    for i in range(8):
        local_store.add(f"o{i}.bin", payload(4 * PAGE + 3 * i, 400 + i))
    config = _worker_config(tmp_path / "w.toml", local_store.mount)
    cache = tmp_path / "cache"
    with worker_process({}, str(cache), extra=["--config", config], log_path=str(tmp_path / "w.log")) as worker:
        fs = client(worker.address)
        for key, data in local_store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        n_pages = sum(-(-len(d) // PAGE) for d in local_store.objects.values())
        assert wait_for(lambda: len(page_files(cache)) == n_pages)
        damaged = sorted(page_files(cache))[::2]
        damaged_bytes = sum(path.stat().st_size - 32 for path in damaged)  # payload, less the trailer
        for n, path in enumerate(damaged):
            raw = bytearray(path.read_bytes())
            if n % 2:
                path.write_bytes(raw[: len(raw) // 2])  # truncated
            else:
                raw[len(raw) // 3] ^= 0xFF  # one bit pattern flipped in the payload
                path.write_bytes(bytes(raw))
        # A reader that has not read these pages yet (a held descriptor's page is checked once,
        # when first read: docs/architecture.md, "Held handles"); the damage is found and repaired.
        fs = client(worker.address)
        for _ in range(2):
            for key, data in local_store.objects.items():
                assert fs.cat_file(f"data/{key}") == data
        status = _status(worker.address)
        assert status.corrupt_pages == len(damaged)
        assert status.bytes_from_store == sum(map(len, local_store.objects.values())) + damaged_bytes
        assert not status.degraded  # bad pages are the page's problem, not the disk's


# ------------------------------------------------------------------- the object store
def test_store_down_serves_cached_data_and_fails_uncached_reads_fast(tmp_path):
    with MotoServer() as moto:
        bucket = moto.new_bucket()
        s3 = moto.client()
        objects = {f"o{i}.bin": payload(2 * PAGE + i, 500 + i) for i in range(8)}
        for key, data in objects.items():
            s3.put_object(Bucket=bucket, Key=key, Body=data)
        mount = MountSpec("data", f"s3://{bucket}", moto.storage_options())
        config = _worker_config(tmp_path / "w.toml", mount)
        with worker_process({}, str(tmp_path / "cache"), extra=["--config", config],
                            log_path=str(tmp_path / "w.log")) as worker:
            fs = client(worker.address, timeout=10)
            cached = sorted(objects)[:4]
            for key in cached:
                assert fs.cat_file(f"data/{key}") == objects[key]
            moto.stop()  # the store refuses connections from now on
            for key in cached:
                assert fs.cat_file(f"data/{key}") == objects[key]
            timings = []
            for key in sorted(objects)[4:]:
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailableError, match="object store unavailable"):
                    fs.cat_file(f"data/{key}")
                timings.append(time.monotonic() - t0)
            assert max(timings) < 3.0, timings  # was ~10-15 s of botocore/s3fs retries
            assert timings[-1] < 0.5, timings  # the breaker is open: no store call at all
            status = _status(worker.address)
            assert list(status.stores_unavailable) == ["data"]
            for key in cached:  # still served
                assert fs.cat_file(f"data/{key}") == objects[key]


def test_object_rewritten_under_concurrent_reads_never_mixes_versions(store, make_worker):
    """Readers see exactly one whole version per read; the newest once metadata expires."""
    versions = [payload(3 * PAGE + 11, 600 + v) for v in range(4)]  # same size: only content changes
    store.add("obj.bin", versions[0])
    worker = make_worker(store.mount, page_size=PAGE, metadata_ttl=0.2)
    fs = client(worker.address, timeout=10)
    seen: set[int] = set()
    errors: list[BaseException] = []
    stale = [0]
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                data = fs.cat_file("data/obj.bin")
            except StaleObjectError:  # it changed between pages: refused, never mixed
                stale[0] += 1
                continue
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                continue
            if data not in versions:
                errors.append(AssertionError("a read mixed versions or returned wrong bytes"))
            else:
                seen.add(versions.index(data))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    # Each version is written once the readers have seen the one before (its metadata expired:
    # 0.2 s), so every change lands under reads in progress and every version is seen.
    for v, data in enumerate(versions):
        if v:
            store.add("obj.bin", data)
        wait_for(lambda: errors or v in seen, timeout=30)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[:3]
    assert seen == set(range(len(versions))), seen
    assert wait_for(lambda: fs.cat_file("data/obj.bin") == versions[-1], timeout=5)


def test_slow_store_deadlines_fire_without_thread_leaks(make_worker):
    """A store slower than the caller's deadline: the call fails at its deadline, and repeated
    timed-out calls leave no thread behind (store calls run on the worker's bounded pool)."""
    SlowMemoryFileSystem.reset_counters()
    store = SlowMemoryFileSystem()
    for i in range(16):
        store.pipe_file(f"/slowfault/o{i}", payload(PAGE, 700 + i))
    SlowMemoryFileSystem.delay = 4.0  # far past the ~1.5 s deadline, so a late wake-up under load is no miss
    try:
        worker = make_worker(MountSpec("data", "slowmem://slowfault"), page_size=PAGE, metadata_ttl=3600)
        fs = client(worker.address, timeout=0.5)

        def burst(first: int) -> list[float]:
            timings: list[float] = []

            def one(i: int) -> None:
                t0 = time.monotonic()
                try:
                    fs.cat_file(f"data/o{i}", 0, PAGE)  # a read's deadline: timeout + length / min_throughput
                except DeadlineExceededError:
                    timings.append(time.monotonic() - t0)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(first, first + 8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            return timings

        def settled(pages: int) -> bool:
            """The slow fetches are over and what they returned is cached: pool threads are idle."""
            return SlowMemoryFileSystem.active == 0 and worker.pages.stats().pages >= pages

        timings = burst(0)
        assert len(timings) == 8 and max(timings) < 3.5, timings  # the deadline, not the store's 4 s
        assert wait_for(lambda: settled(8), timeout=30)
        before = {t.ident for t in threading.enumerate()}
        timings = burst(8)
        assert len(timings) == 8 and max(timings) < 3.5, timings
        assert wait_for(lambda: settled(16), timeout=30)

        def new_threads() -> list[str]:
            """Threads started since the first burst, but for the worker's bounded pools, which
            start threads lazily up to their size (a busy machine overlaps more writes in the
            second burst) and so cannot leak one per call."""
            return [t.name for t in threading.enumerate() if t.ident not in before
                    and not t.name.startswith(("cachefs-fetch_", "cachefs-write_", "cachefs-rpc_"))]
        # A leak would be a thread per timed-out call (+8) that never ends; allow a lazily
        # started helper or two, and a thread that is just ending its call.
        assert wait_for(lambda: len(new_threads()) <= 2, timeout=10), new_threads()
        assert SlowMemoryFileSystem.max_active <= 16  # the worker's fetch pool bounds store calls
        for i in range(16):  # what the slow store eventually returned was cached, and is right
            assert fs.cat_file(f"data/o{i}") == payload(PAGE, 700 + i)  # (the slow store takes 4 s a read)
    finally:
        SlowMemoryFileSystem.delay = 0.05


# ------------------------------------------------------------------ network partition
def _netns_available() -> str:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "network namespaces need root on Linux"
    probe = subprocess.run(["ip", "netns", "add", "cfs-probe"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`ip netns add` is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "cfs-probe"], capture_output=True, timeout=30)
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def _namespace(name: str, host_ip: str, ns_ip: str):
    """A network namespace joined to this one by a veth pair (/30), removed afterwards."""
    veth = f"v{name[-6:]}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", name, "addr", "add", f"{ns_ip}/30", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield veth
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _worker_in_namespace(ns: str, host: str, mount_url: str, cache: str, log: str) -> tuple[subprocess.Popen, str]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "cachefs.cli", "worker", "--host", host,
           "--port", "0", "--cache-dir", f"{cache}:1GiB", "--mount", f"data={mount_url}",
           "--page-size", str(PAGE), "--insecure"]  # a namespace's address, no token: routing is tested here
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "ready":
            return proc, event["address"]
    proc.kill()
    raise TimeoutError(f"worker in {ns} did not start; see {log}")


def test_partitioned_worker_is_routed_around_and_rejoins(local_store, tmp_path):
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    for i in range(12):
        local_store.add(f"o{i:02d}.bin", payload(PAGE + 17 * i, 900 + i))
    name = f"cfs{os.getpid() % 100000}"
    subnet = 16 + os.getpid() % 200
    host_ip, ns_ip = f"10.251.{subnet}.1", f"10.251.{subnet}.2"
    with _namespace(name, host_ip, ns_ip) as veth:
        proc, far = _worker_in_namespace(name, ns_ip, local_store.mount.url, str(tmp_path / "far"),
                                         str(tmp_path / "far.log"))
        try:
            with worker_process({"data": local_store.mount.url}, str(tmp_path / "near"),
                                log_path=str(tmp_path / "near.log")) as near:
                # The far worker stands for another host: no short-circuit through the file system.
                fs = client(far, near.address, timeout=1.5, short_circuit=False)
                far_keys = [k for k in local_store.objects if fs.session.workers.ring.node(f"data/{k}") == far]
                assert far_keys, "no object placed on the partitioned worker"
                for key, data in local_store.objects.items():
                    assert fs.cat_file(f"data/{key}") == data
                assert _status(far).bytes_from_store > 0
                with _Readers(fs, local_store.objects, threads=3) as readers:
                    assert readers.wait_reads(), (readers.reads, readers.errors[:3])
                    _ip("link", "set", veth, "down")  # the partition: packets to it vanish
                    cut = readers.reads
                    before = dict(readers.by_key)
                    # Every key placed on the far worker is read again during the partition: routed
                    # around it (each reader waits out its 1.5 s timeout once, then its breaker opens).
                    assert wait_for(lambda: readers.errors or all(readers.by_key[k] > before[k] + 1
                                                                  for k in far_keys), timeout=60), \
                        (readers.errors[:3], before, readers.by_key)
                    during = readers.reads - cut
                    _ip("link", "set", veth, "up")  # healed
                    assert readers.wait_reads(), (readers.reads, readers.errors[:3])
                assert not readers.errors, readers.errors[:3]
                assert during > 10
                # Healed: the far worker is used again for its keys (its breaker closes).
                assert wait_for(lambda: all(fs.cat_file(f"data/{k}") == local_store.objects[k]
                                            for k in far_keys) and _status(far).hits > 0, timeout=30)
        finally:
            proc.kill()
            proc.wait(timeout=10)
