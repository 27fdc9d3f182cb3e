"""The data path end to end: client -> worker (gRPC) -> page store -> object store.

Each test runs against a local directory and against moto S3 (the ``store`` fixture).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from cachefs.errors import InvalidPathError
from cachefs.mounts import MountSpec
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.testing import MotoServer
from helpers import client, coexisting_usage, disk_usage, page_files, payload, rename_away, wait_for

PAGE = 64 << 10


def _fill(store, sizes: list[int]) -> None:
    for i, size in enumerate(sizes):
        store.add(f"dir{i % 3}/obj-{i:03d}.bin", payload(size, seed=i))


def _stats(worker):
    return worker.pages.stats()


def _from_store(worker) -> float:
    return worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") or 0.0


def test_random_ranges_equal_source(store, make_worker):
    sizes = [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, 10 * PAGE, 200_000]
    _fill(store, sizes)
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    rng = random.Random(7)
    for _ in range(150):
        key, data = rng.choice(list(store.objects.items()))
        start = rng.randrange(0, len(data) + 2)
        end = rng.randrange(start, len(data) + PAGE)
        assert fs.cat_file(f"cachefs://data/{key}", start, end) == data[start:end], (key, start, end)
    # Whole objects, ranges from the end, and file-like random access.
    for key, data in store.objects.items():
        path = f"cachefs://data/{key}"
        assert fs.cat_file(path) == data
        assert fs.cat_file(path, start=-10) == data[-10:]
        assert fs.info(path)["size"] == len(data)
        with fs.open(path, block_size=PAGE // 2) as f:
            for _ in range(5):
                pos = rng.randrange(0, len(data) + 1)
                f.seek(pos)
                assert f.read(rng.randrange(0, 3 * PAGE)) == data[pos:pos + f.tell() - pos]
            if data:
                buf = bytearray(len(data))
                f.seek(0)
                assert f.readinto(buf) == len(data)
                assert bytes(buf) == data
    paths = [f"data/{k}" for k in store.objects]
    assert fs.cat_ranges(paths, [0] * len(paths), [100] * len(paths)) == [d[:100] for d in store.objects.values()]


def test_second_read_is_served_from_cache_with_the_store_gone(store, make_worker, tmp_path):
    _fill(store, [3 * PAGE + 5, PAGE, 1000])
    if store.kind == "s3":
        # A private S3 endpoint that this test can stop.
        moto = MotoServer().start()
        bucket = moto.new_bucket()
        for key, data in store.objects.items():
            moto.client().put_object(Bucket=bucket, Key=f"root/{key}", Body=data)
        mount = MountSpec("data", f"s3://{bucket}/root", moto.storage_options())
    else:
        mount = store.mount
    worker = make_worker(mount, page_size=PAGE, metadata_ttl=3600)
    fs = client(worker.address)
    for key, data in store.objects.items():
        assert fs.cat_file(f"data/{key}") == data
    fetched = _from_store(worker)
    assert fetched == sum(len(d) for d in store.objects.values())

    if store.kind == "s3":
        moto.stop()
    else:
        rename_away(Path(mount.url))
    for key, data in store.objects.items():
        assert fs.cat_file(f"data/{key}") == data
        assert fs.cat_file(f"data/{key}", 7, 2 * PAGE) == data[7:2 * PAGE]
    assert _from_store(worker) == fetched, "the second read touched the object store"


def test_changed_object_is_served_anew_once_metadata_expires(store, make_worker):
    old, new = payload(2 * PAGE + 3, 1), payload(PAGE + 9, 2)
    store.add("obj.bin", old)
    worker = make_worker(store.mount, page_size=PAGE, metadata_ttl=0.5, metadata_stale_grace=0)
    fs = client(worker.address)
    assert fs.cat_file("data/obj.bin") == old
    v1 = fs.info("data/obj.bin")["version"]
    store.add("obj.bin", new)  # (a local rewrite gets a new mtime: conftest's Store.add)
    time.sleep(0.6)  # past the TTL: time only has to pass, a loaded machine only adds to it
    assert fs.cat_file("data/obj.bin") == new
    assert fs.info("data/obj.bin")["version"] != v1


def test_expired_metadata_is_used_while_it_is_revalidated(store, make_worker):
    """Stale-while-revalidate: past the TTL a read is served at once from the last version (no
    store round trip on the read path), and the change is seen as soon as the refresh is in."""
    old, new = payload(2 * PAGE + 3, 5), payload(PAGE + 9, 6)
    store.add("obj.bin", old)
    worker = make_worker(store.mount, page_size=PAGE, metadata_ttl=0.3, metadata_stale_grace=60)
    fs = client(worker.address)
    assert fs.cat_file("data/obj.bin") == old
    store.add("obj.bin", new)
    time.sleep(0.4)
    got = fs.cat_file("data/obj.bin")
    assert got in (old, new)  # the old one, unless the refresh already landed: never a mix
    assert wait_for(lambda: fs.cat_file("data/obj.bin") == new, timeout=10)
    store.delete("obj.bin")
    time.sleep(0.4)
    fs.cat_file("data/obj.bin")  # served from the last version; the refresh finds it gone
    assert wait_for(lambda: _gone(fs, "data/obj.bin"), timeout=10)


def _gone(fs, path: str) -> bool:
    try:
        fs.cat_file(path)
    except FileNotFoundError:
        return True
    return False


def test_open_file_never_mixes_versions(store, make_worker):
    from cachefs.errors import StaleObjectError

    old, new = payload(4 * PAGE, 3), payload(4 * PAGE, 4)
    store.add("obj.bin", old)
    worker = make_worker(store.mount, page_size=PAGE, metadata_ttl=0.2, readahead_pages=0)
    fs = client(worker.address)
    with fs.open("data/obj.bin", block_size=PAGE, cache_type="none") as f:
        assert f.read(PAGE) == old[:PAGE]
        store.add("obj.bin", new)
        time.sleep(0.3)
        with pytest.raises(StaleObjectError):
            f.read(PAGE)


def test_corrupted_page_is_detected_and_refetched(store, make_worker, tmp_path):
    data = payload(3 * PAGE + 100, 5)
    store.add("obj.bin", data)
    cache = tmp_path / "cache-corrupt"
    worker = make_worker(store.mount, cache_dir=cache, page_size=PAGE, metadata_ttl=3600)
    fs = client(worker.address)
    assert fs.cat_file("data/obj.bin") == data
    fs = client(worker.address)  # a process that has not read these pages yet (held ones are
    # checked once per descriptor: docs/architecture.md, "Held handles")
    # Page files appear at their rename, a moment before the page store serves them.
    assert wait_for(lambda: _stats(worker).pages == 4)
    files = page_files(cache)
    assert len(files) == 4
    for path in files:  # flip one byte inside each page's payload
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 3] ^= 0xFF
        path.write_bytes(bytes(raw))
    files[0].write_bytes(files[0].read_bytes()[:100])  # and truncate one
    before = _from_store(worker)
    assert fs.cat_file("data/obj.bin") == data
    assert _stats(worker).corrupt_pages == 4
    assert _from_store(worker) - before == len(data)
    assert fs.cat_file("data/obj.bin") == data  # and the refetched pages are good


def test_dataset_three_times_the_quota_cycles_within_it(store, make_worker, tmp_path):
    quota = 16 * (PAGE + 4096)
    sizes = [2 * PAGE + 1000] * 16  # ~3x the quota
    _fill(store, sizes)
    cache = tmp_path / "cache-quota"
    worker = make_worker(store.mount, cache_dir=cache, quota=quota, page_size=PAGE)
    fs = client(worker.address)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], coexisting_usage(cache))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(2):
            for key, data in store.objects.items():
                assert fs.cat_file(f"data/{key}") == data
                assert _stats(worker).used_bytes <= quota
    finally:
        stop.set()
        watcher.join(timeout=10)
    stats = _stats(worker)
    assert stats.evictions > 0
    assert stats.used_bytes <= quota
    assert peak[0] <= quota, f"disk usage peaked at {peak[0]} > quota {quota}"
    # Background page writes settle; then the index and the disk agree (what is used includes the
    # unlinked pages this client may still read through held descriptors).
    assert wait_for(lambda: disk_usage(cache) == _stats(worker).used_bytes - _stats(worker).held_unlinked_bytes), \
        (disk_usage(cache), _stats(worker))


def test_bad_paths_and_ranges_give_clear_errors(local_store, make_worker, tmp_path):
    local_store.add("ok.bin", payload(1000, 1))
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"secret")
    (tmp_path / "store" / "link").symlink_to(outside)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = client(worker.address)
    for bad in ["data/../outside.txt", "data/a/../../x", "data//etc/passwd", "data/%2e%2e/x", "data/a%2Fb",
                "data/a\x00b", "data/a\\..\\b", "../data/ok.bin", "data/./ok.bin"]:
        with pytest.raises(InvalidPathError):
            fs.cat_file(bad)
    with pytest.raises(InvalidPathError, match="outside its mount"):
        fs.cat_file("data/link")
    with pytest.raises(FileNotFoundError, match="no mount named"):
        fs.cat_file("nomount/ok.bin")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("data/missing.bin")
    with pytest.raises(FileNotFoundError):
        fs.open("data/missing.bin")
    assert not fs.exists("data/missing.bin")
    local_store.add("sub/x.bin", b"x")
    with pytest.raises(IsADirectoryError):
        fs.cat_file("data/sub")
    # Ranges follow fsspec: past the end is empty, negative counts from the end.
    assert fs.cat_file("data/ok.bin", start=10**18) == b""
    assert fs.cat_file("data/ok.bin", start=500, end=100) == b""
    assert fs.cat_file("data/ok.bin", start=-10**12) == local_store.objects["ok.bin"]
    # The worker refuses what a hand-made request would slip past a client.
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        cases = [
            (worker_pb2.ReadRequest(path="data/../outside.txt"), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.ReadRequest(path="data/ok.bin", offset=-1, length=10), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.ReadRequest(path="data/ok.bin", offset=0, length=-7), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.ReadRequest(path="data/ok.bin", offset=2**63 - 1, length=1), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.ReadRequest(path="", length=1), grpc.StatusCode.INVALID_ARGUMENT),
            (worker_pb2.ReadRequest(path="data/missing", length=1), grpc.StatusCode.NOT_FOUND),
            (worker_pb2.ReadRequest(path="nomount/x", length=1), grpc.StatusCode.NOT_FOUND),
            (worker_pb2.ReadRequest(path="data/ok.bin", length=1, version="not-the-version"), grpc.StatusCode.ABORTED),
            (worker_pb2.ReadRequest(path="data/sub", length=1), grpc.StatusCode.FAILED_PRECONDITION),
        ]
        for request, code in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Read(request, timeout=10))
            assert err.value.code() == code, (request, err.value.details())
            assert err.value.details()
        # A huge length is clamped to the object, not an error.
        chunks = list(stub.Read(worker_pb2.ReadRequest(path="data/ok.bin", offset=0, length=2**62), timeout=10))
        assert b"".join(c.data for c in chunks) == local_store.objects["ok.bin"]
        assert chunks[0].info.size == 1000


def test_one_store_fetch_per_page_however_many_readers(make_worker):
    from helpers import SlowMemoryFileSystem

    data = payload(8 * PAGE, 9)
    mem = SlowMemoryFileSystem()
    mem.pipe_file("/sf/obj.bin", data)
    SlowMemoryFileSystem.reset_counters()
    worker = make_worker(MountSpec("mem", "slowmem:///sf"), page_size=PAGE, readahead_pages=0, parallel_pages=8,
                         fetch_group_pages=1)
    results: list[bytes] = []
    lock = threading.Lock()

    def read() -> None:
        out = client(worker.address).cat_file("mem/obj.bin")
        with lock:
            results.append(out)

    threads = [threading.Thread(target=read) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [data] * 12
    fetched = [r for r in SlowMemoryFileSystem.reads if r[0].endswith("obj.bin")]
    assert len(fetched) == 8, fetched  # one per page, not one per reader
    assert sorted(start for _, start, _ in fetched) == [i * PAGE for i in range(8)]
    assert SlowMemoryFileSystem.max_active > 1, "pages of one range were not fetched in parallel"


def test_sequential_reader_gets_read_ahead(make_worker):
    from helpers import SlowMemoryFileSystem, wait_for

    data = payload(16 * PAGE, 11)
    SlowMemoryFileSystem().pipe_file("/ra/obj.bin", data)
    SlowMemoryFileSystem.reset_counters()
    worker = make_worker(MountSpec("mem", "slowmem:///ra"), page_size=PAGE, readahead_pages=8)
    # gRPC only: a page already fetched ahead would otherwise be read over the short-circuit
    # socket, which the worker's sequential tracker never sees, so whether the window grows
    # would depend on whether the client or the prefetch was faster (it lost on a loaded machine).
    fs = client(worker.address, short_circuit=False, data_port=False)
    with fs.open("mem/obj.bin", block_size=PAGE, cache_type="none") as f:
        for i in range(3):
            assert f.read(PAGE) == data[i * PAGE:(i + 1) * PAGE]
    registry = worker.metrics.registry
    # The window doubles with each read that continues the last: 1 page, 2, then 4 (3-6, of
    # which 3 was already claimed), so 6 pages fetched ahead and pages 0-6 cached.
    assert wait_for(lambda: (registry.get_sample_value("cachefs_worker_page_reads_total", {"outcome": "prefetch"}) or 0) >= 6)
    # The pages fetched ahead are served from the cache afterwards: once written and no
    # longer in flight (a read of a page still in flight joins its fetch, it is not a hit).
    assert wait_for(lambda: worker.pages.stats().pages >= 7 and not worker.reader._inflight)
    hits_before = registry.get_sample_value("cachefs_worker_page_reads_total", {"outcome": "hit"}) or 0
    assert fs.cat_file("mem/obj.bin", 3 * PAGE, 5 * PAGE) == data[3 * PAGE:5 * PAGE]
    assert (registry.get_sample_value("cachefs_worker_page_reads_total", {"outcome": "hit"}) or 0) >= hits_before + 2


def test_consecutive_missing_pages_are_fetched_in_one_request(make_worker):
    from helpers import SlowMemoryFileSystem

    data = payload(20 * PAGE + 5, 12)
    SlowMemoryFileSystem().pipe_file("/grp/obj.bin", data)
    worker = make_worker(MountSpec("mem", "slowmem:///grp"), page_size=PAGE, readahead_pages=0,
                         parallel_pages=32, fetch_group_pages=8)
    fs = client(worker.address)
    assert fs.cat_file("mem/obj.bin", 3 * PAGE, 4 * PAGE) == data[3 * PAGE:4 * PAGE]  # page 3 cached alone
    SlowMemoryFileSystem.reset_counters()
    assert fs.cat_file("mem/obj.bin") == data
    fetched = sorted((start, end) for path, start, end in SlowMemoryFileSystem.reads if path.endswith("obj.bin"))
    # Pages 0-2 (stopped by cached page 3), then 4-11, 12-19, and the short last page 20.
    assert fetched == [(0, 3 * PAGE), (4 * PAGE, 12 * PAGE), (12 * PAGE, 20 * PAGE), (20 * PAGE, len(data))]
    assert SlowMemoryFileSystem.max_active > 1
    assert fs.cat_file("mem/obj.bin") == data


def test_reader_does_not_wait_for_the_page_store_write(local_store, make_worker):
    data = payload(4 * PAGE, 21)
    local_store.add("obj.bin", data)
    worker = make_worker(local_store.mount, page_size=PAGE, readahead_pages=0)
    release = threading.Event()
    real_put = worker.pages.put

    def blocked_put(pid, page):  # the disk write cannot finish until the test says so
        release.wait(timeout=30)
        return real_put(pid, page)

    worker.pages.put = blocked_put
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(client(worker.address).cat_file("data/obj.bin")))
    reader.start()
    reader.join(timeout=15)
    try:
        assert not reader.is_alive(), "the read waited for the page store write"
        assert out == [data]
        # Meanwhile another reader shares the fetched pages instead of fetching again.
        assert client(worker.address).cat_file("data/obj.bin") == data
        assert _from_store(worker) == len(data)
    finally:
        release.set()
    assert wait_for(lambda: worker.pages.stats().pages == 4)


def test_pages_waiting_for_the_disk_are_bounded(local_store, make_worker, monkeypatch):
    from cachefs.server.worker import reader as reader_module

    # A fetch waits this long in all for room in the write queue (back-pressure), then serves the
    # rest of its pages uncached: a disk stuck this long must not stall reads for good.
    monkeypatch.setattr(reader_module, "WRITE_WAIT_SECONDS", 0.5)
    data = payload(8 * PAGE, 22)
    local_store.add("obj.bin", data)
    worker = make_worker(local_store.mount, page_size=PAGE, readahead_pages=0)
    worker.reader.options = dataclasses.replace(worker.reader.options, max_pending_write_bytes=3 * PAGE)
    release = threading.Event()
    real_put = worker.pages.put
    worker.pages.put = lambda pid, page: (release.wait(timeout=30), real_put(pid, page))[1]
    try:
        # Through gRPC (a client with a socket to the worker would ask it to fill the range
        # first, which waits for the disk, at most FILL_SECONDS: fill.py), served in full regardless
        assert client(worker.address, short_circuit=False, data_port=False).cat_file("data/obj.bin") == data
        dropped = worker.metrics.registry.get_sample_value("cachefs_worker_page_writes_dropped_total")
        assert dropped == 5  # 3 pages queued for the (stuck) disk, the rest not cached
    finally:
        release.set()
    assert wait_for(lambda: worker.pages.stats().pages == 3)
