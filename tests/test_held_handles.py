"""Held page handles (#14): the worker's shared table of generations (server/worker/handles.py),
the client's cache of descriptors (client/transport/handles.py), the page store's charge for unlinked pages
still held open, and what a real in-process worker does with them: reads with no message, and no
read through a handle after the page left the cache.
"""

from __future__ import annotations

import mmap
import gc
import os
import time

import grpc
import pytest

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.client.transport.handles import HandleCache, Page, TableView
from cachefs.localhost import TABLE_STALE_SECONDS
from cachefs.pagefile import TRAILER_SIZE
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.server.pagestore import PageStore
from cachefs.server.pagestore.store import CacheDir, PageId
from cachefs.server.worker.handles import HandleTable
from cachefs.paths import parse_path as _cp
from helpers import payload, wait_for

PAGE = 64 << 10


def _fd_targets() -> dict[int, str]:
    """This process's descriptors and what each refers to."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            pass
    return out


def _view(table: HandleTable) -> TableView:
    fd = table.reader_fd()
    try:
        return TableView(fd, table.instance, table.slots)
    finally:
        os.close(fd)


# -- the worker's table ---------------------------------------------------------------------------
def test_a_slot_keeps_its_generation_until_its_page_leaves_and_clients_cannot_write():
    table = HandleTable(slots=4)
    view = _view(table)
    try:
        assert view.alive()
        a = table.assign("a")
        assert table.assign("a") == a and view.valid(*a)  # a cached page keeps its slot
        b, c = table.assign("b"), table.assign("c")
        assert len({a[0], b[0], c[0]}) == 3 and 0 not in (a[0], b[0], c[0])  # slot 0 is never handed out
        assert table.invalidate(["b", "unknown"]) == 1
        assert not view.valid(*b) and view.valid(*a) and view.valid(*c)
        d = table.assign("d")  # reuses b's slot with a new generation: b's holders stay invalid
        assert d[0] == b[0] and d[1] != b[1] and not view.valid(*b) and view.valid(*d)
        e = table.assign("e")  # full (3 usable slots): the least recently handed-out page (a) loses its slot
        assert e[0] == a[0] and not view.valid(*a) and view.valid(*e)
        assert table.in_use() == 3
        with pytest.raises(TypeError):  # mapped read-only
            view.words[10] = 1
        fd = table.reader_fd()
        try:
            with pytest.raises((OSError, PermissionError)):
                mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    finally:
        table.close()
    assert not view.alive()  # a closed table drops every handle taken from it
    assert not view.valid(*e)
    view.close()


def test_touched_slots_reach_the_page_store_recency():
    seen: list[list[str]] = []
    table = HandleTable(slots=8, on_touched=seen.append)
    try:
        s1, _ = table.assign("p1")
        s2, _ = table.assign("p2")
        table.invalidate(["p2"])
        assert table.touched([s1, s2, 0, 99999]) == 1  # freed, reserved and out-of-range slots ignored
        assert seen == [["p1"]]
    finally:
        table.close()


def test_a_closed_table_hands_out_no_slot_and_raises_nothing():
    """A request still being answered while the worker stops (its table closed under it) gets
    "read it now, do not keep it" for its pages; an eviction then changes nothing."""
    table = HandleTable(slots=8)
    slot, generation = table.assign("a" * 32)
    assert slot > 0 and generation > 0
    table.close()
    assert table.assign("b" * 32) == (0, 0)
    assert table.assign("a" * 32) == (0, 0)
    assert table.invalidate(["a" * 32]) == 0
    table.close()  # twice: nothing left to do


def test_a_table_with_a_stale_heartbeat_is_not_trusted(monkeypatch):
    table = HandleTable(slots=4)
    view = _view(table)
    try:
        assert view.alive()
        later = time.monotonic_ns() + int((TABLE_STALE_SECONDS + 1) * 1e9)
        monkeypatch.setattr(time, "monotonic_ns", lambda: later)
        assert not view.alive()  # what a client sees of a worker that was killed
    finally:
        monkeypatch.undo()
        view.close()
        table.close()


# -- the client's cache -----------------------------------------------------------------------------
def _page(tmp_path, name: str, start: int, data: bytes, slot: int, generation: int) -> Page:
    path = tmp_path / name
    path.write_bytes(data)
    return Page(os.open(path, os.O_RDONLY), start, len(data), slot, generation, refs=1)


def test_the_cache_serves_only_valid_fresh_handles_and_closes_every_descriptor(tmp_path):
    gc.collect()  # earlier tests' objects close their descriptors now, not in the middle of this one
    before = _fd_targets()
    table = HandleTable(slots=16)
    cache = HandleCache(capacity=3)
    cache.attach(_view(table), page_size=4)
    try:
        slot_a, gen_a = table.assign("a0")
        slot_b, gen_b = table.assign("a1")
        pages = [_page(tmp_path, "a0", 0, b"abcd", slot_a, gen_a), _page(tmp_path, "a1", 4, b"ef", slot_b, gen_b)]
        cache.add("m/a", 6, "v1", 60_000, pages)
        cache.release(pages)
        assert cache.lookup("m/a", 0, 6, "v2") is None  # another version
        found = cache.lookup("m/a", 2, 3, "")
        assert found is not None and found[:2] == (6, "v1") and [p.start for p in found[2]] == [0, 4]
        cache.release(found[2])
        assert cache.take_touched() == ([slot_a, slot_b], 3)
        table.invalidate(["a1"])  # the worker evicts page 1
        assert cache.lookup("m/a", 0, 6, "") is None
        assert cache.held() == 1  # the invalid handle was dropped (closed), the valid one kept
        found = cache.lookup("m/a", 0, 4, "")
        assert found is not None
        table.invalidate(["a0"])
        assert cache.lookup("m/a", 0, 4, "") is None  # dropped while referenced: closed after release
        assert found[2][0].fd >= 0
        cache.release(found[2])
        assert found[2][0].fd == -1
        # LRU bound: capacity 3
        extra = []
        for i in range(5):
            slot, gen = table.assign(f"b{i}")
            extra.append(_page(tmp_path, f"b{i}", 0, b"x", slot, gen))
            cache.add(f"m/b{i}", 1, "v", 60_000, [extra[-1]])
            cache.release([extra[-1]])
        assert cache.held() == 3 and cache.stats["dropped_lru"] == 2
        # Expiry: what the worker vouched for lasts valid_ms only
        slot, gen = table.assign("c")
        short = _page(tmp_path, "c", 0, b"y", slot, gen)
        cache.add("m/c", 1, "v", 1, [short])
        cache.release([short])

        def expired() -> bool:
            found = cache.lookup("m/c", 0, 1, "")
            if found is not None:
                cache.release(found[2])
            return found is None

        assert wait_for(expired, timeout=5)
        # ...and its descriptor is closed by then or soon after, read or not: the worker stops
        # charging an unlinked page's bytes when the hold ends.
        assert wait_for(lambda: short.fd == -1, timeout=10) and cache.stats["dropped_expired"] >= 1
        # Not holdable (slot 0): closed as soon as its read is done
        once = _page(tmp_path, "d", 0, b"z", 0, 0)
        cache.add("m/d", 1, "v", 60_000, [once])
        cache.release([once])
        assert once.fd == -1
    finally:
        cache.close()
        table.close()
    # None of this test's descriptors (page files under tmp_path, the table's memory file) is left;
    # other threads of this process may open or close their own meanwhile, so only ours count.
    left = [t for fd, t in _fd_targets().items() if before.get(fd) != t]
    assert not [t for t in left if str(tmp_path) in t or "memfd" in t], left


# -- the page store's charge for held, unlinked pages -----------------------------------------------
def test_unlinked_pages_still_held_count_against_the_quota_until_the_hold_ends(tmp_path):
    quota = 4 * (PAGE + TRAILER_SIZE)
    unlinked: list[list[str]] = []
    with PageStore([CacheDir(str(tmp_path / "c"), quota)], page_size=PAGE) as store:
        store.set_unlink_listener(unlinked.append)
        pids = [PageId("m", f"k{i}", "v", 0) for i in range(6)]
        for pid in pids[:4]:
            assert store.put(pid, payload(PAGE, 1))
        until = time.monotonic() + 1.0
        store.hold([pids[0].digest(), pids[1].digest()], until)
        assert store.delete(pids[0])  # freed while held: invalidated, unlinked, still charged
        assert unlinked[-1] == [pids[0].digest()]
        assert store.stats().held_unlinked_bytes == PAGE + TRAILER_SIZE
        assert store.stats().used_bytes == 4 * (PAGE + TRAILER_SIZE)
        # Full: a put must evict; the held LRU page (k1) goes but frees nothing, so k2 goes too.
        assert store.put(pids[4], payload(PAGE, 2))
        assert not store.contains(pids[1]) and not store.contains(pids[2]) and store.contains(pids[3])
        assert store.stats().held_unlinked_bytes == 2 * (PAGE + TRAILER_SIZE)
        assert store.stats().used_bytes <= quota
        assert wait_for(lambda: store.stats().held_unlinked_bytes == 0, timeout=10)
        assert store.stats().used_bytes == 2 * (PAGE + TRAILER_SIZE)  # k3, k4
        assert store.put(pids[5], payload(PAGE, 3))
        assert store.stats().used_bytes <= quota


def test_an_evicted_held_page_is_charged_only_until_its_holders_must_have_closed_it(tmp_path, monkeypatch):
    """Clients close invalidated descriptors within HELD_CLOSE_SECONDS (their sweep), so a held
    page that leaves the cache does not keep its room for the rest of a five-minute hold; a
    hold extended is counted once."""
    monkeypatch.setattr("cachefs.server.pagestore.store.HELD_CLOSE_SECONDS", 0.3)
    size = PAGE + TRAILER_SIZE
    with PageStore([CacheDir(str(tmp_path / "c"), 4 * size)], page_size=PAGE) as store:
        pids = [PageId("m", f"k{i}", "v", 0) for i in range(5)]
        for pid in pids[:4]:
            assert store.put(pid, payload(PAGE, 1))
        now = time.monotonic()
        store.hold([pids[0].digest()], now + 300)
        store.hold([pids[0].digest()], now + 400)  # extended: still one page held
        store.hold([pids[1].digest()], now + 300)
        assert store.held_bytes() == 2 * size
        assert store.delete(pids[0])
        assert store.held_bytes() == 2 * size and store.stats().held_unlinked_bytes == size
        assert wait_for(lambda: store.stats().held_unlinked_bytes == 0, timeout=10)  # not 400 s
        assert store.held_bytes() == size  # k1 is still held, and cached
        assert store.stats().used_bytes == 3 * size


def _one_held(tmp_path, table: HandleTable, cache: HandleCache, digest: str, path: str) -> Page:
    """A 4-byte page of ``path`` held by ``cache`` (slot from ``table``), not referenced."""
    cache.attach(_view(table), page_size=4)
    slot, generation = table.assign(digest)
    page = _page(tmp_path, digest, 0, b"abcd", slot, generation)
    cache.add(path, 4, "v1", 60_000, [page])
    cache.release([page])
    return page


def test_the_sweep_closes_handles_the_worker_invalidated_without_a_read(tmp_path):
    table = HandleTable(slots=16)
    cache = HandleCache(capacity=8)
    try:
        page = _one_held(tmp_path, table, cache, "s0", "m/s")
        assert cache.sweep() == 1 and page.fd >= 0  # valid: kept
        table.invalidate(["s0"])
        assert cache.sweep() == 0 and page.fd == -1  # closed with no read of it
        assert cache.stats["dropped_invalid"] == 1
    finally:
        cache.close()
        table.close()


# -- a real worker ---------------------------------------------------------------------------------------
def _fs(worker, **kw) -> CacheFileSystem:
    return CacheFileSystem(workers=worker.address, skip_instance_cache=True, **kw)


def _settled(worker, path: str, size: int) -> None:
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: stub.GetCached(worker_pb2.GetCachedRequest(paths=[path]), timeout=10)
                        .cached_bytes[0] == size, timeout=30)


def _served(worker) -> float:
    return worker.metrics.short_circuit_bytes._value.get()


def test_held_reads_send_nothing_and_are_reported_afterwards(local_store, make_worker):
    data = payload(3 * PAGE + 11, 1)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/obj") == data  # cold: filled by the worker, handed out, kept
    assert _served(worker) == len(data)  # through the short-circuit socket, not gRPC
    _settled(worker, "data/obj", len(data))
    assert fs.cat_file("cachefs://data/obj") == data  # through the handles kept
    fs.session.report_reads()
    served = _served(worker)
    held = worker.metrics.held_page_reads._value.get()
    assert fs.prepare([("cachefs://data/obj", 0, None)] * 3) == 3  # held already: no message, no read
    for start, end in [(0, None), (5, PAGE + 9), (3 * PAGE, None)]:
        assert fs.cat_file("cachefs://data/obj", start, end) == data[start:end]
    assert _served(worker) == served  # nothing reached the worker
    fs.session.report_reads()
    assert worker.metrics.held_page_reads._value.get() == held + 4 + 2 + 1
    assert _served(worker) == served + len(data) + (PAGE + 4) + 11
    assert worker.metrics.registry.get_sample_value("cachefs_worker_held_handles") == 4


def test_no_read_through_a_handle_after_its_page_is_freed_or_evicted(local_store, make_worker):
    data = payload(2 * PAGE, 2)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))
    assert fs.cat_file("cachefs://data/obj") == data
    reader = fs.session._state.get().bulk._readers[worker.address][0]
    assert reader.handles.held() == 2
    held_reads = reader.handles.stats["held_reads"]
    with grpc.insecure_channel(worker.address) as ch:
        assert worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix="data/obj"),
                                                          timeout=10).pages_freed == 2
    assert worker.pages.stats().held_unlinked_bytes == 2 * (PAGE + TRAILER_SIZE)  # charged while held
    assert fs.cat_file("cachefs://data/obj") == data  # not through the old handles: gRPC, from the store
    assert reader.handles.stats["held_reads"] == held_reads
    assert reader.handles.stats["dropped_invalid"] >= 1


def test_a_changed_object_is_seen_once_the_metadata_ttl_runs_out(local_store, make_worker):
    local_store.add("obj", payload(PAGE, 3))
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=1.0, metadata_stale_grace=0)
    fs = _fs(worker)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", PAGE)
    assert fs.cat_file("cachefs://data/obj") == payload(PAGE, 3)
    reader = fs.session._state.get().bulk._readers[worker.address][0]
    old_version = reader.handles.object_info("data/obj")[1]
    local_store.add("obj", payload(PAGE, 4))  # a new version in the store (new mtime)
    # A held handle lasts what was left of the worker's TTL: the new bytes show within it.
    assert wait_for(lambda: fs.cat_file("cachefs://data/obj") == payload(PAGE, 4), timeout=15)
    # The worker saw the new version and took the old one's slots back (its pages stay for
    # readers still within the stale grace, until evicted).
    new_version = worker.objects.info(_cp("data/obj")).version
    assert new_version != old_version
    older = worker.pages.other_versions("data", "obj", new_version)
    assert older and all(d not in worker.handle_table._slot_of for d in older)


def test_a_stopped_worker_drops_every_handle_and_a_new_one_is_used(local_store, make_worker, tmp_path):
    data = payload(PAGE, 5)
    local_store.add("obj", data)
    cache = tmp_path / "restart"
    worker = make_worker(local_store.mount, page_size=PAGE, cache_dir=cache)
    fs = _fs(worker)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", PAGE)
    assert fs.cat_file("cachefs://data/obj") == data
    reader = fs.session._state.get().bulk._readers[worker.address][0]
    assert reader.handles.held() == 1
    old_table = reader.handles.table
    worker.short_circuit.stop()
    worker._close_handle_table()  # what a worker's stop does to its table
    assert not reader.handles.usable() and reader.handles.held() == 0
    assert fs.cat_file("cachefs://data/obj") == data  # through gRPC meanwhile
    assert old_table is not None


def test_past_the_ttl_within_the_grace_reads_stay_on_the_socket(local_store, make_worker):
    """As a read through the worker would: metadata past its TTL but within the stale grace is
    used (and refreshed in the background), not sent to gRPC; a change shows once refreshed."""
    local_store.add("obj", payload(PAGE, 6))
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=0.3, metadata_stale_grace=60)
    fs = _fs(worker, short_circuit_handles=0)  # every read asks the socket
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", PAGE)
    time.sleep(0.4)  # past the TTL (time only has to pass)
    before = dict(fs.session.bulk_stats["short_circuit"])
    assert fs.cat_file("cachefs://data/obj") == payload(PAGE, 6)
    after = fs.session.bulk_stats["short_circuit"]
    assert after["reads"] == before["reads"] + 1 and after["fallbacks"] == before["fallbacks"]
    local_store.add("obj", payload(PAGE, 7))
    assert wait_for(lambda: fs.cat_file("cachefs://data/obj") == payload(PAGE, 7), timeout=15)


def test_a_dataset_batch_is_read_through_held_handles_in_one_pass(local_store, make_worker):
    """CacheDataset.__getitems__: one prepare message for the batch, then the next epoch's
    batch with no message at all; a freed sample is read anew, never through its old handle."""
    from cachefs.client.datasets.dataset import CacheDataset

    samples = [payload(PAGE + 7 * i, 10 + i) for i in range(6)]
    for i, data in enumerate(samples):
        local_store.add(f"s/{i}", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    # Not by name: with a registered plan the worker lets a client that reads by name hold
    # nothing (test_named_pages.py); held handles are the path of the others.
    ds = CacheDataset([f"cachefs://data/s/{i}" for i in range(6)],
                      storage_options={"workers": worker.address, "short_circuit_by_name": False},
                      shuffle=False, rank=0, world_size=1, hint_samples=0)
    first = ds.__getitems__(list(range(6)))  # cold: filled by the worker, one message
    assert [bytes(t.numpy()) for t in first] == samples
    for i, data in enumerate(samples):
        _settled(worker, f"data/s/{i}", len(data))
    reader = None
    assert [bytes(t.numpy()) for t in ds.__getitems__(list(range(6)))] == samples  # handles fetched
    reader = ds._local.get().fs.session._state.get().bulk._readers[worker.address][0]
    held_reads, served = reader.handles.stats["held_reads"], _served(worker)
    assert [bytes(t.numpy()) for t in ds.__getitems__(list(range(6)))] == samples
    assert reader.handles.stats["held_reads"] == held_reads + 6  # all six through held handles
    assert _served(worker) == served  # and no message reached the worker
    with grpc.insecure_channel(worker.address) as ch:
        worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix="data/s/2"), timeout=10)
    dropped = reader.handles.stats["dropped_invalid"]
    assert [bytes(t.numpy()) for t in ds.__getitems__(list(range(6)))] == samples
    assert reader.handles.stats["dropped_invalid"] > dropped  # sample 2's old handles were not used
    # Five through the handles held, the freed one filled anew by the worker and read through its
    # new handles (the same one-message prepare a cold batch takes).
    assert reader.handles.stats["held_reads"] == held_reads + 6 + 6


def test_held_batch_lookups_reference_and_release_every_page(tmp_path):
    """HandleCache.lookup_many / release_many: one lock for a batch, the same references as
    one lookup per read (a page dropped mid-batch closes only after its last reader)."""
    table = HandleTable(slots=16)
    cache = HandleCache(capacity=3)
    try:
        page = _one_held(tmp_path, table, cache, "b0", "m/b")
        found = cache.lookup_many([("m/b", 0, 4), ("m/missing", 0, 5), ("m/b", 1, 2)])
        assert found[1] is None and found[0][2] == [page] and found[2][2] == [page]
        assert page.refs == 2 and cache.stats["held_reads"] == 2
        table.invalidate(["b0"])
        assert cache.lookup("m/b", 0, 4, "") is None  # dropped while two reads hold it
        assert page.fd >= 0
        cache.release_many(found)
        assert page.fd == -1 and cache.held() == 0
    finally:
        cache.close()
        table.close()


def test_a_range_a_prepare_found_not_cached_is_read_through_grpc_without_asking_again(local_store, make_worker):
    """Right after a cold read the worker may still be writing its pages: the prepare's answer
    (not cached) sends the reads straight to gRPC for a moment, not through a second message."""
    data = payload(2 * PAGE, 7)
    local_store.add("cold", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker)
    assert fs.prepare([("cachefs://data/cold", 0, None)], fill=False) == 0
    reader = fs.session._state.get().bulk._readers[worker.address][0]
    exchanges = []
    inner = reader._exchange
    reader._exchange = lambda request, *more: exchanges.append(request) or inner(request, *more)
    assert fs.cat_file("cachefs://data/cold") == data
    assert exchanges == []  # gRPC answered, the socket was not asked again
    _settled(worker, "data/cold", len(data))
    reader._not_cached["data/cold"] = 0.0  # the moment is over
    assert fs.cat_file("cachefs://data/cold") == data
    assert len(exchanges) == 1 and reader.handles.held() == 2


def test_a_batch_held_whole_sends_no_hints_and_one_not_cached_does(local_store, make_worker):
    """Hints ask the worker to fetch what is coming; a batch read whole through held handles
    says the data is cached, and its hint would only cost both sides."""
    from cachefs.client.datasets.dataset import CacheDataset

    samples = [payload(PAGE, 40 + i) for i in range(16)]
    for i, data in enumerate(samples):
        local_store.add(f"h/{i}", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    ds = CacheDataset([f"cachefs://data/h/{i}" for i in range(16)], storage_options={"workers": worker.address},
                      shuffle=False, rank=0, world_size=1, hint_samples=8, plan_ahead=False)
    fs = ds._local.get().fs
    for i, data in enumerate(samples[:7]):
        assert fs.cat_file(f"cachefs://data/h/{i}") == data
        _settled(worker, f"data/h/{i}", len(data))
    hinter = ds.hinter
    ds._calls = 0  # the next batch is one that hints (every 16th)
    assert [bytes(t.numpy()) for t in ds.__getitems__([0, 1, 2, 3])] == samples[:4]
    assert hinter.stats["paths"] == 0  # all of it held: no hint
    ds._calls = 0
    assert [bytes(t.numpy()) for t in ds.__getitems__([4, 5, 6, 7])] == samples[4:8]  # 7 through gRPC
    assert hinter.stats["paths"] > 0  # the samples after the next batch's


def test_usable_while_another_thread_attaches_a_new_table():
    """usable() reads the table without the lock; attach() on another thread closes the old one
    in between: usable() answers for the new table instead of raising on a released view (which
    killed the sweeper thread and sent the process's reads to gRPC)."""
    old_table, new_table = HandleTable(slots=4), HandleTable(slots=4)
    cache = HandleCache(capacity=4)
    old_view, new_view = _view(old_table), _view(new_table)
    cache.attach(old_view, 4096)
    alive = old_view.alive

    def attach_then_check() -> bool:
        cache.attach(new_view, 4096)  # the other thread's hello reply lands here
        return alive()

    old_view.alive = attach_then_check  # type: ignore[method-assign]
    assert cache.usable() is True
    assert cache.table is new_view
    new_table.close()
    old_table.close()
