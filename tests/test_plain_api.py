"""The plain fsspec API on the lean path: cat_file, open().read(), read(n), readinto give the
object's bytes, at the right position and version, with and without short-circuit."""

from __future__ import annotations

import pytest

from cachefs import rawbytes
from helpers import client, payload

PAGE = 64 << 10


@pytest.fixture
def served(local_store, make_worker):
    objects = {"multi.bin": payload(7 * PAGE + 123, 1), "one.bin": payload(PAGE // 2, 2), "empty.bin": b""}
    for key, data in objects.items():
        local_store.add(key, data)
    return objects, make_worker(local_store.mount, page_size=PAGE)


def test_fillable_bytes_is_a_real_bytes_object_filled_in_place():
    data, view = rawbytes.fillable_bytes(5)
    view[:] = b"hello"
    view.release()
    assert type(data) is bytes and data == b"hello" and hash(data) == hash(b"hello")
    assert data.decode() == "hello" and data[1:3] == b"el"
    empty, _ = rawbytes.fillable_bytes(0)
    assert empty == b""


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (from /proc/self/smaps), in KiB."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _thp_fallbacks() -> int:
    with open("/proc/vmstat") as f:
        return sum(int(v) for k, v in (line.split() for line in f) if k == "thp_fault_fallback")


def test_advised_fresh_memory_is_faulted_in_huge_pages_where_the_kernel_allows():
    """The mechanism, on memory that is surely fresh (a new anonymous mapping): a result's own
    memory may come from a heap already touched, where the advice changes nothing."""
    import ctypes
    import mmap
    import os

    assert not rawbytes.advise_huge(0, rawbytes.HUGE_MIN - 1)  # too small to be worth a call
    n = 8 << 20
    region = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                mode = f.read()
        except OSError:
            pytest.skip("no transparent huge pages here (not Linux, or THP not built)")
        if "[never]" in mode:
            pytest.skip("transparent huge pages are off on this host: results stay in 4 KiB pages")
        assert rawbytes.advise_huge(address, n)
        fallbacks = _thp_fallbacks() if os.path.exists("/proc/vmstat") else 0
        region[:] = payload(1 << 20, 3) * 8
        if _thp_fallbacks() > fallbacks:
            pytest.skip("the kernel had no huge page at hand (thp_fault_fallback rose): 4 KiB pages, as designed")
        assert _anon_huge_kib(address + (4 << 20)) >= 2048  # at least one 2 MiB page under the region
    finally:
        region.close()


def test_a_large_result_is_advised_before_it_is_filled(monkeypatch):
    advised: list[tuple[int, int]] = []
    advise = rawbytes.advise_huge

    def recorded(address: int, n: int) -> bool:
        advised.append((address, n))
        return advise(address, n)

    monkeypatch.setattr(rawbytes, "advise_huge", recorded)
    n = 8 << 20
    data, view = rawbytes.fillable_bytes(n, huge=True)
    pattern = payload(1 << 20, 3)
    for i in range(8):
        view[i << 20:(i + 1) << 20] = pattern
    view.release()
    assert data == pattern * 8 and type(data) is bytes
    assert advised == [(id(data) + bytes.__basicsize__ - 1, n)]  # the payload, all of it
    small, small_view = rawbytes.fillable_bytes(1 << 20, huge=True)
    small_view.release()
    assert len(advised) == 2 and advised[1][1] == 1 << 20  # asked; advise_huge declines small ones


def test_join_is_one_copy_and_keeps_a_single_part():
    big = [payload(3 << 20, 4), payload(2 << 20, 5)]
    assert rawbytes.join(big, huge=True) == b"".join(big)
    assert rawbytes.join(big, huge=False) == b"".join(big)
    assert rawbytes.join([b"ab", b"c"], huge=True) == b"abc"
    assert rawbytes.join(big[:1], huge=True) is big[0]


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "small-pages"])
@pytest.mark.parametrize("path", ["short-circuit", "data-port", "grpc"])
def test_a_large_object_reads_whole_on_every_path(local_store, make_worker, path, huge):
    data = payload(5 * (1 << 20) + 123, 6)  # over HUGE_MIN: the result is advised when huge
    local_store.add("large.bin", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = client(worker.address, short_circuit=path == "short-circuit", data_port=path == "data-port",
                huge_pages=huge)
    for _ in range(2):  # cold (filled through gRPC), then warm (its path)
        got = fs.cat_file("cachefs://data/large.bin")
        assert type(got) is bytes and got == data
        with fs.open("cachefs://data/large.bin") as f:
            assert f.read() == data
    if path != "grpc":
        kind = path.replace("-", "_")
        assert fs.session.bulk_stats[kind]["reads"] > 0


def test_only_results_of_cached_pages_are_advised_into_huge_pages(local_store, make_worker, monkeypatch):
    """A cold read waits on the store and its fresh 2 MiB blocks can cost more than they save
    (rawbytes.py): its result stays in small pages; the same read warm is advised."""
    data = payload(5 * (1 << 20), 7)
    local_store.add("large.bin", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    asked: list[bool] = []
    fillable = rawbytes.fillable_bytes

    def recorded(n, huge=False):
        if n >= rawbytes.HUGE_MIN:
            asked.append(huge)
        return fillable(n, huge)

    monkeypatch.setattr(rawbytes, "fillable_bytes", recorded)
    fs = client(worker.address, short_circuit=True, data_port=False)
    assert fs.cat_file("cachefs://data/large.bin") == data  # cold: filled for this request
    assert fs.cat_file("cachefs://data/large.bin") == data  # warm
    assert asked and asked[0] is False and asked[-1] is True



@pytest.mark.parametrize("lean", [True, False], ids=["short-circuit", "grpc"])
def test_whole_reads_cat_and_open_return_the_object(served, lean):
    objects, worker = served
    fs = client(worker.address, short_circuit=lean, data_port=False, block_size=2 * PAGE)
    for _ in range(2):  # cold (filled through gRPC), then warm (short-circuit when lean)
        for key, data in objects.items():
            got = fs.cat_file(f"cachefs://data/{key}")
            assert type(got) is bytes and got == data
            with fs.open(f"cachefs://data/{key}") as f:
                whole = f.read()
                assert type(whole) is bytes and whole == data and f.tell() == len(data)
                assert f.read() == b""
    if lean:
        assert fs.session.bulk_stats["short_circuit"]["reads"] > 0


@pytest.mark.parametrize("lean", [True, False], ids=["short-circuit", "grpc"])
def test_reads_of_a_block_or_more_and_readinto_keep_the_position(served, lean):
    objects, worker = served
    data = objects["multi.bin"]
    fs = client(worker.address, short_circuit=lean, data_port=False, block_size=2 * PAGE)
    fs.cat_file("cachefs://data/multi.bin")  # warm
    with fs.open("cachefs://data/multi.bin") as f:
        assert f.read(10) == data[:10]  # below the block size: the block cache
        assert f.read(3 * PAGE) == data[10:10 + 3 * PAGE]  # a block or more: straight through
        f.seek(PAGE + 7)
        buf = bytearray(2 * PAGE + 1)
        assert f.readinto(buf) == len(buf) and bytes(buf) == data[PAGE + 7:3 * PAGE + 8]
        assert f.tell() == 3 * PAGE + 8
        f.seek(len(data) - 5)
        tail = bytearray(100)
        assert f.readinto(tail) == 5 and bytes(tail[:5]) == data[-5:]
        assert f.readinto(tail) == 0 and f.read(4 * PAGE) == b""


@pytest.mark.parametrize("lean", [True, False], ids=["short-circuit", "grpc"])
def test_a_read_to_the_end_keeps_no_copy_in_the_block_cache(served, lean):
    """read() to the end (smaller than a block) comes straight from the session: the file's
    block cache never holds the object (an unclosed file kept it until the GC found the cycle)."""
    objects, worker = served
    data = objects["multi.bin"]
    fs = client(worker.address, short_circuit=lean, data_port=False, block_size=64 * PAGE)
    with fs.open("cachefs://data/multi.bin") as f:
        assert f.read() == data and f.tell() == len(data)
        assert len(f.cache.cache) == 0
    with fs.open("cachefs://data/multi.bin") as f:
        assert f.read(7) == data[:7]  # a small read: through the block cache, as fsspec's files do
        assert f.read(len(data)) == data[7:]  # the rest, asked for by a length past the end
        assert f.read() == b"" and f.tell() == len(data)
        f.seek(3)
        assert f.read(-1) == data[3:]
        info = fs.info("cachefs://data/multi.bin")
        assert "LastModified" in info  # a local store's objects have an mtime
        assert f.details["size"] == len(data) and f.details["LastModified"] == info["LastModified"]


def test_an_open_file_keeps_its_version_when_the_object_changes(served, local_store):
    objects, worker = served
    fs = client(worker.address, short_circuit=False, data_port=False, block_size=PAGE)
    with fs.open("cachefs://data/multi.bin") as f:
        local_store.add("multi.bin", payload(7 * PAGE + 123, 99))  # a new version, same size
        buf = bytearray(3 * PAGE)
        try:
            n = f.readinto(buf)
        except OSError as err:  # the old version is gone from the store: a clear error, never mixed bytes
            assert "version" in str(err).lower() or "changed" in str(err).lower() or "stale" in str(err).lower(), err
        else:
            assert bytes(buf[:n]) == objects["multi.bin"][:n]


def test_a_filesystem_starts_its_event_loop_only_when_something_asks_for_it(local_store, make_worker):
    """A DataLoader worker builds a filesystem every epoch and reads through sync paths only:
    no fsspec IO thread for it. Whatever is async still runs (on the loop made at first use)."""
    from cachefs.client.fs import filesystem
    from cachefs.client.fs.filesystem import CacheFileSystem

    local_store.add("d/a", b"abc")
    worker = make_worker(local_store.mount)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True)
    assert fs.cat_file("cachefs://data/d/a") == b"abc" and fs.info("cachefs://data/d/a")["size"] == 3
    assert fs._loop is filesystem._NO_LOOP_YET  # nothing asked for it (fsspec's would start a thread)
    loop = fs.loop
    assert loop.is_running() and fs.loop is loop
    assert fs.exists("cachefs://data/d/a") and not fs.exists("cachefs://data/d/missing")
    assert CacheFileSystem(workers=worker.address, skip_instance_cache=True, asynchronous=True)._loop is None
