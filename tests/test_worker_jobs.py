"""The worker's job RPCs: Load (whole objects into the page store), Free (a prefix), GetCached.

Real in-process workers over a local directory and moto S3 (the ``store`` fixture), and the
slow in-memory store where fetch counts matter.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from cachefs.mounts import MountSpec
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.pagefile import TRAILER_SIZE
from helpers import SlowMemoryFileSystem, client, coexisting_usage, payload, wait_for

PAGE = 64 << 10
TIMEOUT = 30.0


def _stub(worker) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(worker.address))


def _load(worker, *paths: str) -> worker_pb2.LoadResponse:
    return _stub(worker).Load(worker_pb2.LoadRequest(paths=list(paths)), timeout=TIMEOUT)


def _cached(worker, *paths: str) -> list[int]:
    return list(_stub(worker).GetCached(worker_pb2.GetCachedRequest(paths=list(paths)), timeout=TIMEOUT).cached_bytes)


def _free(worker, prefix: str) -> int:
    return _stub(worker).Free(worker_pb2.FreeRequest(prefix=prefix), timeout=TIMEOUT).pages_freed


def _from_store(worker) -> float:
    return worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") or 0.0


def _load_metric(worker, outcome: str) -> float:
    return worker.metrics.registry.get_sample_value("cachefs_worker_load_bytes_total", {"outcome": outcome}) or 0.0


def _pages(size: int) -> int:
    return (size + PAGE - 1) // PAGE


def test_load_then_read_touches_no_store_and_a_second_load_skips_everything(store, make_worker):
    sizes = {"a/one.bin": 3 * PAGE + 5, "a/two.bin": PAGE, "b/small.bin": 1000, "b/empty.bin": 0}
    for i, (key, size) in enumerate(sizes.items()):
        store.add(key, payload(size, i))
    worker = make_worker(store.mount, page_size=PAGE)
    paths = [f"data/{k}" for k in sizes]
    total = sum(sizes.values())

    first = _load(worker, *paths)
    assert (first.objects_loaded, first.bytes_loaded, first.bytes_skipped, list(first.failed)) == (4, total, 0, [])
    assert worker.pages.stats().pages == sum(_pages(s) for s in sizes.values())
    assert _cached(worker, *paths) == list(sizes.values())

    before = _from_store(worker)
    fs = client(worker.address)
    for key, data in store.objects.items():
        assert fs.cat_file(f"data/{key}") == data
    assert _from_store(worker) == before, "a read after a load went to the store"

    second = _load(worker, *paths, paths[0])  # a path named twice is loaded once
    assert (second.objects_loaded, second.bytes_loaded, second.bytes_skipped, list(second.failed)) == (4, 0, total, [])
    assert _from_store(worker) == before
    assert _load_metric(worker, "fetched") == total
    assert _load_metric(worker, "skipped") == total


def test_partly_cached_object_loads_only_its_missing_pages(store, make_worker):
    data = payload(6 * PAGE + 7, 3)
    store.add("obj.bin", data)
    worker = make_worker(store.mount, page_size=PAGE, readahead_pages=0)
    assert client(worker.address).cat_file("data/obj.bin", 0, 2 * PAGE) == data[:2 * PAGE]
    assert wait_for(lambda: worker.pages.stats().pages == 2)
    before = _from_store(worker)

    result = _load(worker, "data/obj.bin")
    assert (result.objects_loaded, result.bytes_skipped, result.bytes_loaded) == (1, 2 * PAGE, len(data) - 2 * PAGE)
    assert _from_store(worker) - before == len(data) - 2 * PAGE
    assert _cached(worker, "data/obj.bin") == [len(data)]


def test_load_coalesces_missing_pages_into_few_store_requests(make_worker):
    root = f"/load-{uuid.uuid4().hex[:8]}"
    data = payload(20 * PAGE + 5, 4)
    SlowMemoryFileSystem().pipe_file(f"{root}/obj.bin", data)
    worker = make_worker(MountSpec("mem", f"slowmem://{root}"), page_size=PAGE, readahead_pages=0,
                         fetch_group_pages=8)
    assert client(worker.address).cat_file("mem/obj.bin", 3 * PAGE, 4 * PAGE) == data[3 * PAGE:4 * PAGE]
    assert wait_for(lambda: worker.pages.stats().pages == 1)
    SlowMemoryFileSystem.reset_counters()

    result = _load(worker, "mem/obj.bin")
    assert result.objects_loaded == 1 and result.bytes_skipped == PAGE
    fetched = sorted((s, e) for p, s, e in SlowMemoryFileSystem.reads if p.endswith("obj.bin"))
    # Each run of missing pages is one request, however long (up to an extent: extent_size),
    # not one per fetch_group_pages: a load takes whole objects.
    assert fetched == [(0, 3 * PAGE), (4 * PAGE, len(data))]


def test_load_fetches_a_large_object_as_extents_side_by_side(make_worker, monkeypatch):
    # A store serves each connection at a bounded speed: a shard is several extent-sized GETs in
    # flight at once, not one GET held to one stream's speed.
    root = f"/load-{uuid.uuid4().hex[:8]}"
    data = payload(20 * PAGE + 5, 6)
    SlowMemoryFileSystem().pipe_file(f"{root}/obj.bin", data)
    monkeypatch.setattr(SlowMemoryFileSystem, "delay", 0.5)  # every read overlaps those started with it
    worker = make_worker(MountSpec("mem", f"slowmem://{root}"), page_size=PAGE, extent_size=8 * PAGE)
    SlowMemoryFileSystem.reset_counters()
    result = _load(worker, "mem/obj.bin")
    assert (result.objects_loaded, result.bytes_loaded) == (1, len(data))
    fetched = sorted((s, e) for p, s, e in SlowMemoryFileSystem.reads if p.endswith("obj.bin"))
    assert fetched == [(0, 8 * PAGE), (8 * PAGE, 16 * PAGE), (16 * PAGE, len(data))]
    assert SlowMemoryFileSystem.max_active >= 2
    assert client(worker.address).cat_file("mem/obj.bin") == data


def test_load_waits_for_page_writes_instead_of_dropping_them(make_worker):
    root = f"/load-{uuid.uuid4().hex[:8]}"
    data = payload(24 * PAGE, 5)
    SlowMemoryFileSystem().pipe_file(f"{root}/obj.bin", data)
    # Room for two pages waiting for the disk: a load that did not wait would drop most of them.
    worker = make_worker(MountSpec("mem", f"slowmem://{root}"), page_size=PAGE, max_pending_write_bytes=2 * PAGE,
                         write_threads=1)
    result = _load(worker, "mem/obj.bin")
    assert (result.objects_loaded, result.bytes_loaded, list(result.failed)) == (1, len(data), [])
    assert (worker.metrics.registry.get_sample_value("cachefs_worker_page_writes_dropped_total") or 0) == 0
    assert worker.pages.stats().pages == 24


def test_failed_paths_are_listed_while_the_others_load(store, make_worker):
    good = payload(2 * PAGE + 1, 6)
    store.add("good.bin", good)
    store.add("dir/inner.bin", b"x" * 10)
    worker = make_worker(store.mount, page_size=PAGE)
    bad = ["data/missing.bin", "data/../etc/passwd", "nomount/x.bin", "data/dir"]
    result = _load(worker, "data/good.bin", *bad)
    assert result.objects_loaded == 1 and result.bytes_loaded == len(good)
    failed = list(result.failed)
    assert len(failed) == len(bad)
    for path, entry in zip(bad, failed):
        assert entry.startswith(f"{path}: ") and len(entry) > len(path) + 2, entry
    assert "no such object" in failed[0]
    assert "is a directory" in failed[3]
    assert _cached(worker, "data/good.bin") == [len(good)]


def test_too_many_paths_is_invalid_argument(local_store, make_worker):
    worker = make_worker(local_store.mount, page_size=PAGE)
    paths = [f"data/k{i}" for i in range(10_001)]
    for call in (lambda: _load(worker, *paths), lambda: _cached(worker, *paths)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_free_drops_exactly_the_prefix(store, make_worker):
    objects = {"a/1.bin": 2 * PAGE, "a/2.bin": PAGE + 3, "ab/3.bin": PAGE, "b/4.bin": 3 * PAGE}
    for i, (key, size) in enumerate(objects.items()):
        store.add(key, payload(size, 10 + i))
    worker = make_worker(store.mount, page_size=PAGE)
    paths = [f"data/{k}" for k in objects]
    assert _load(worker, *paths).objects_loaded == 4

    first = _free(worker, "data/a/")
    assert first == _pages(2 * PAGE) + _pages(PAGE + 3)  # not ab/
    assert _cached(worker, *paths) == [0, 0, PAGE, 3 * PAGE]
    before = _from_store(worker)
    assert client(worker.address).cat_file("data/a/1.bin") == store.objects["a/1.bin"]
    assert _from_store(worker) - before == 2 * PAGE, "a freed object was not fetched again"
    assert _cached(worker, "data/b/4.bin") == [3 * PAGE]

    assert _free(worker, "data/a") == 2 + 1  # a/1.bin again (read back) and ab/3.bin
    assert _free(worker, "data") == 3
    assert worker.pages.stats().pages == 0
    for bad in ("", "data/../x", "/"):
        with pytest.raises(grpc.RpcError) as err:
            _free(worker, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.metrics.registry.get_sample_value("cachefs_worker_pages_freed_total") == first + 3 + 3


def test_free_waits_for_page_writes_queued_before_it(store, make_worker):
    """A read served from the store queues its pages for the disk; a Free arriving before they land
    must still drop them, not leave them cached after it answered."""
    import threading

    store.add("q/1.bin", payload(2 * PAGE, 30))
    worker = make_worker(store.mount, page_size=PAGE, readahead_pages=0)
    gate, held = threading.Event(), threading.Event()
    real_put = worker.pages.put

    def slow_put(pid, data):
        held.set()
        assert gate.wait(TIMEOUT)
        return real_put(pid, data)

    worker.pages.put = slow_put
    assert client(worker.address).cat_file("data/q/1.bin") == store.objects["q/1.bin"]
    assert held.wait(TIMEOUT)
    answer: list[int] = []
    freeing = threading.Thread(target=lambda: answer.append(_free(worker, "data/q/")))
    freeing.start()
    freeing.join(0.3)
    assert freeing.is_alive(), "Free answered while page writes under its prefix were still queued"
    gate.set()
    freeing.join(TIMEOUT)
    assert answer == [2]
    assert worker.pages.stats().pages == 0
    assert _cached(worker, "data/q/1.bin") == [0]


def test_get_cached_reports_full_partial_none_and_zero_after_a_change(store, make_worker):
    full, part = payload(3 * PAGE + 9, 20), payload(4 * PAGE, 21)
    store.add("full.bin", full)
    store.add("part.bin", part)
    store.add("cold.bin", payload(PAGE, 22))
    worker = make_worker(store.mount, page_size=PAGE, metadata_ttl=0.5, metadata_stale_grace=0,
                         readahead_pages=0)
    assert _load(worker, "data/full.bin").objects_loaded == 1
    assert client(worker.address).cat_file("data/part.bin", PAGE, 2 * PAGE) == part[PAGE:2 * PAGE]
    assert wait_for(lambda: _cached(worker, "data/part.bin") == [PAGE])
    paths = ["data/full.bin", "data/part.bin", "data/cold.bin", "data/missing.bin", "nomount/x"]
    assert _cached(worker, *paths) == [len(full), PAGE, 0, 0, 0]

    store.add("full.bin", payload(len(full), 23))  # (a local rewrite gets a new mtime: conftest)
    time.sleep(0.6)  # the metadata expires (time only has to pass: load only adds to it)
    assert _cached(worker, "data/full.bin") == [0]
    store.delete("part.bin")
    assert _cached(worker, "data/part.bin") == [0]
    with pytest.raises(grpc.RpcError) as err:
        _cached(worker, "data/../x")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_load_under_a_small_quota_ends_and_stays_within_it(store, make_worker, tmp_path):
    quota = 8 * (PAGE + TRAILER_SIZE)
    store.add("other.bin", payload(6 * PAGE, 29))
    for i in range(3):
        store.add(f"fits-{i}.bin", payload(5 * PAGE, 30 + i))  # each fits, no two together do
    store.add("huge.bin", payload(12 * PAGE, 34))  # never fits
    cache = tmp_path / "small-cache"
    worker = make_worker(store.mount, cache_dir=cache, quota=quota, page_size=PAGE, readahead_pages=0)
    assert client(worker.address).cat_file("data/other.bin") == store.objects["other.bin"]
    assert wait_for(lambda: worker.pages.stats().pages == 6)  # the cache is most of the way full
    paths = ["data/huge.bin"] + [f"data/fits-{i}.bin" for i in range(3)]
    before = _from_store(worker)

    t0 = time.monotonic()
    result = _load(worker, *paths)
    assert time.monotonic() - t0 < 20
    # The first object that fits loads (evicting older pages); the rest fail without being fetched.
    assert (result.objects_loaded, result.bytes_loaded) == (1, 5 * PAGE)
    assert _from_store(worker) - before == 5 * PAGE
    failed = list(result.failed)
    assert [f.partition(": ")[0] for f in failed] == ["data/huge.bin", "data/fits-1.bin", "data/fits-2.bin"]
    assert all("cache quota smaller than the load" in f for f in failed), failed
    assert _cached(worker, *paths) == [0, 5 * PAGE, 0, 0]
    assert worker.pages.stats().used_bytes <= quota
    assert coexisting_usage(cache) <= quota
    assert _load_metric(worker, "failed") == 12 * PAGE + 2 * 5 * PAGE


def test_a_load_past_its_deadline_answers_with_what_is_unfinished(make_worker, monkeypatch):
    root = f"/load-{uuid.uuid4().hex[:8]}"
    SlowMemoryFileSystem().pipe_file(f"{root}/small.bin", b"s" * 100)
    SlowMemoryFileSystem().pipe_file(f"{root}/slow.bin", payload(40 * PAGE, 7))
    monkeypatch.setattr(SlowMemoryFileSystem, "delay", 0.1)
    # A load window of two pages (half the write queue's room): slow.bin takes 20 store reads.
    worker = make_worker(MountSpec("mem", f"slowmem://{root}"), page_size=PAGE, fetch_group_pages=1,
                         fetch_threads=1, max_pending_write_bytes=4 * PAGE)
    t0 = time.monotonic()
    result = _stub(worker).Load(worker_pb2.LoadRequest(paths=["mem/small.bin", "mem/slow.bin"]), timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert result.objects_loaded == 1
    assert list(result.failed) == ["mem/slow.bin: not loaded within the deadline"]


def test_a_hint_fetches_an_unknown_small_object_with_one_get(store, make_worker, monkeypatch):
    """A client's hint (LoadRequest.hint) for an object the worker knows nothing of: one GET
    brings its metadata and its only page; no separate metadata request (HEAD) is made."""
    data = payload(PAGE // 2, 40)
    store.add("small.bin", data)
    worker = make_worker(store.mount, page_size=PAGE)
    calls = []
    original = type(worker.objects).info

    def counting_info(self, path, refresh=False):
        calls.append(str(path))
        return original(self, path, refresh)

    monkeypatch.setattr(type(worker.objects), "info", counting_info)
    reply = _stub(worker).Load(worker_pb2.LoadRequest(paths=["data/small.bin"], hint=True), timeout=TIMEOUT)
    assert (reply.objects_loaded, reply.bytes_loaded, reply.bytes_skipped) == (1, len(data), 0)
    assert calls == [] and _from_store(worker) == len(data)
    assert wait_for(lambda: _cached(worker, "data/small.bin") == [len(data)])


def test_load_and_free_from_an_older_leader_epoch_are_refused(local_store, make_worker):
    """Several masters: once a worker has heard of leader epoch N, a Load/Free stamped with an
    older epoch (a master whose term ended) is refused; epoch 0 (one master, a client's hint) never is."""
    local_store.add("e/a.bin", payload(5000, 1))
    worker = make_worker(local_store.mount)
    stub = _stub(worker)
    assert not stub.Load(worker_pb2.LoadRequest(paths=["data/e/a.bin"], leader_epoch=7), timeout=30).failed
    with pytest.raises(grpc.RpcError) as info:
        stub.Load(worker_pb2.LoadRequest(paths=["data/e/a.bin"], leader_epoch=5), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "leadership ended" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Free(worker_pb2.FreeRequest(prefix="data/e", leader_epoch=6), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _cached(worker, "data/e/a.bin") == [5000]  # the refused Free freed nothing
    assert worker.metrics.stale_leader_commands._value.get() == 2
    # Heard from a heartbeat answer (Registrar -> EpochGuard.observe): epoch 7 is now stale too.
    worker.servicer.epochs.observe(9)
    with pytest.raises(grpc.RpcError) as info:
        stub.Load(worker_pb2.LoadRequest(paths=["data/e/a.bin"], leader_epoch=7), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not stub.Load(worker_pb2.LoadRequest(paths=["data/e/a.bin"]), timeout=30).failed  # epoch 0
    assert stub.Free(worker_pb2.FreeRequest(prefix="data/e", leader_epoch=9), timeout=30).pages_freed >= 1


def test_a_load_joining_a_reads_fetch_counts_it_as_not_its_own(make_worker, monkeypatch):
    """Pages a read is fetching when a load comes are waited for, not fetched again, and the
    load reports them as skipped: its fetched bytes are store bytes it caused."""
    root = f"/join-{uuid.uuid4().hex[:8]}"
    data = payload(8 * PAGE, 41)
    SlowMemoryFileSystem().pipe_file(f"{root}/obj.bin", data)
    SlowMemoryFileSystem.reset_counters()
    monkeypatch.setattr(SlowMemoryFileSystem, "delay", 0.5)
    worker = make_worker(MountSpec("mem", f"slowmem://{root}"), page_size=PAGE, fetch_group_pages=8,
                         readahead_pages=0)
    fs = client(worker.address)
    assert fs.info("mem/obj.bin")["size"] == len(data)  # metadata known: the read is one 8-page GET
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fs.cat_file("mem/obj.bin")))
    reader.start()
    try:
        assert wait_for(lambda: SlowMemoryFileSystem.active > 0, timeout=10)
        before = _from_store(worker)
        fetched_metric = _load_metric(worker, "fetched")
        result = _load(worker, "mem/obj.bin")
    finally:
        reader.join(timeout=30)
    assert got == [data]
    assert (result.objects_loaded, result.bytes_loaded, result.bytes_skipped) == (1, 0, len(data))
    assert _load_metric(worker, "fetched") == fetched_metric
    assert _from_store(worker) - before <= len(data)  # the read's GET, once
    assert len(SlowMemoryFileSystem.reads) == 1
