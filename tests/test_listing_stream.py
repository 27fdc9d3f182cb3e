"""Listings that stream (#46): a page of a listing costs about a page of store work.

The worker answers page N of a prefix's listing from the chunk of the store's listing that holds
it (cachefs/store/listings.py): a local mount is walked in key order from ``start_after`` (whole
directories before it skipped unread), S3 is asked with its own paging (``StartAfter``,
``MaxKeys``); listers of one prefix share the chunks, which are kept within ``list_cache_bytes``.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from cachefs.config import WorkerConfig
from cachefs.paths import CachePath
from cachefs.proto import common_pb2, worker_pb2, worker_pb2_grpc
from cachefs.store import backends, localpages, objects
from cachefs.store.listings import Chunk, ListingCache
from cachefs.store.meta import ObjectMeta
from helpers import client, wait_for

# Names whose key order is not a directory walk's name order: '!', ' ', '-' and '.' sort before
# '/', so "a-b" and "a.b/c" come before "a/b", and "a/b.c" before "a/bb/c".
TRICKY = ["t/a-b", "t/a.b/c", "t/a/b", "t/a/b.c", "t/a/b-c", "t/a/bb/c", "t/a b/x y.bin", "t/a!", "t/ab",
          "t/é/ü.bin", "t/日本/語", "t/z", "t/a0/1", "t/a/b0"]


def _pages_grpc(address: str, path: str, max_entries: int = 0, refresh: bool = False) -> list[list[str]]:
    """Every page of a recursive listing through the worker's gRPC List, as the client asks."""
    pages, after = [], ""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        while True:
            (reply,) = list(stub.List(worker_pb2.ListRequest(path=path, recursive=True, paged=True, start_after=after,
                                                             max_entries=max_entries, refresh=refresh), timeout=30))
            pages.append([e.path for e in reply.entries])
            if not reply.next_after:
                return pages
            after = reply.next_after


def _pages_sockets(worker, path: str) -> list[list[str]]:
    """Every page as the workers' sockets answer ``MetaRequest.LIST`` (48 KiB pages)."""
    pages, after = [], ""
    while True:
        reply = worker.meta_ops.answer(common_pb2.MetaRequest(op=common_pb2.MetaRequest.LIST, path=path,
                                                              recursive=True, start_after=after))
        assert not reply.error_code, reply.error_message
        pages.append([e.path for e in reply.entries])
        if not reply.next_after:
            return pages
        after = reply.next_after


def _settled(worker) -> None:
    """Wait (10 s at most) until no chunk is being fetched (read-ahead included)."""
    deadline = time.monotonic() + 10
    while worker.objects._lists._fetching:
        assert time.monotonic() < deadline, "a listing fetch did not end"
        time.sleep(0.01)


@pytest.fixture
def dir_reads(monkeypatch, local_store):
    """Directories under the local store's root read so far (every os.scandir of one)."""
    root = os.path.realpath(local_store.mount.url)
    count = [0]
    real = os.scandir

    def counting(target=None):
        where = os.readlink(f"/proc/self/fd/{target}") if isinstance(target, int) else os.fspath(target or ".")
        if where == root or where.startswith(root + "/"):
            count[0] += 1
        return real(target) if target is not None else real()

    monkeypatch.setattr(os, "scandir", counting)
    return count


def test_the_first_page_of_a_large_local_mount_reads_a_few_directories(local_store, make_worker, dir_reads):
    """20,000 files in 200 directories: the first page reads the root and the ~10 directories it
    lists, not all 201 (the whole walk, which the old worker did before answering anything)."""
    for d in range(200):
        for f in range(100):
            local_store.add(f"big/{d:03d}/{f:03d}.bin", b"x")
    for name in TRICKY:
        local_store.add(f"big/{name}", b"y")
    expected = sorted(f"data/{key}" for key in local_store.objects)
    worker = make_worker(local_store.mount)

    started = time.perf_counter()
    with grpc.insecure_channel(worker.address) as channel:
        (first,) = list(worker_pb2_grpc.WorkerServiceStub(channel).List(
            worker_pb2.ListRequest(path="data/big", recursive=True, paged=True), timeout=30))
    first_s = time.perf_counter() - started
    assert [e.path for e in first.entries] == expected[:1000] and first.next_after == expected[999]
    _settled(worker)
    # 12: big, 000-009 and 010 (its first file ends the chunk); the next chunk, read ahead while the
    # first was handed out, as many again.
    assert dir_reads[0] <= 25, f"the first page read {dir_reads[0]} directories"

    dir_reads[0] = 0
    started = time.perf_counter()
    whole = worker.objects.list(CachePath("data", "big"), recursive=True, refresh=True)
    whole_s = time.perf_counter() - started
    assert dir_reads[0] == 1 + 200 + 8  # the whole walk: big, its 200 numbered dirs, t and its 7
    assert [str(m.path) for m in whole] == expected
    assert first_s < whole_s, (first_s, whole_s)

    # Together the pages are the whole listing, in its order, however they are asked.
    grpc_pages = _pages_grpc(worker.address, "data/big")
    assert [n for page in grpc_pages for n in page] == expected
    assert all(len(page) <= 1000 for page in grpc_pages)
    socket_pages = _pages_sockets(worker, "data/big")
    assert [n for page in socket_pages for n in page] == expected
    fs = client(worker.address, short_circuit=False, data_port=False)
    assert fs.find("cachefs://data/big") == expected


def test_pages_across_small_chunks_keep_key_order(local_store, make_worker, monkeypatch, dir_reads):
    """Chunks of 3 entries and pages of 2: every boundary falls somewhere awkward."""
    monkeypatch.setattr(objects, "LIST_CHUNK", 3)
    for name in TRICKY:
        local_store.add(name, b"z")
    expected = sorted(f"data/t/{key[2:]}" for key in TRICKY)
    worker = make_worker(local_store.mount)
    for size in (1, 2, 5, 0):
        pages = _pages_grpc(worker.address, "data/t", max_entries=size)
        assert [n for page in pages for n in page] == expected, size
        assert all(len(page) <= 3 for page in pages)
    # A directory listing (not recursive) pages the same way: directories sort by their own name.
    names, after = [], ""
    while True:
        reply = worker.meta_ops.answer(common_pb2.MetaRequest(op=common_pb2.MetaRequest.LIST, path="data/t/a",
                                                              start_after=after))
        names += [e.path for e in reply.entries]
        if not reply.next_after:
            break
        after = reply.next_after
    assert names == ["data/t/a/b", "data/t/a/b-c", "data/t/a/b.c", "data/t/a/b0", "data/t/a/bb"]
    # A file's own path lists the file; a missing one lists nothing, as before.
    assert _pages_grpc(worker.address, "data/t/z") == [["data/t/z"]]
    assert _pages_grpc(worker.address, "data/t/nothing") == [[]]


def test_simultaneous_listers_share_the_store_listing(local_store, make_worker, monkeypatch):
    """Two listers of one prefix, one through gRPC (pages of 1,000) and one through the sockets
    (pages of 48 KiB), at once: each chunk of the store's listing is fetched once."""
    for d in range(30):
        for f in range(100):
            local_store.add(f"shared/{d:02d}/{f:03d}.bin", b"x")
    expected = sorted(f"data/{key}" for key in local_store.objects)
    worker = make_worker(local_store.mount)
    walk = localpages.page_after

    def slow_walk(*args):
        time.sleep(0.05)  # a store request's latency: the second lister arrives while it is under way
        return walk(*args)

    monkeypatch.setattr(localpages, "page_after", slow_walk)
    start = threading.Barrier(2, timeout=10)
    results: dict[str, list[str]] = {}

    def lister(name: str, pages) -> None:
        start.wait()
        results[name] = [n for page in pages() for n in page]

    threads = [threading.Thread(target=lister, args=("grpc", lambda: _pages_grpc(worker.address, "data/shared"))),
               threading.Thread(target=lister, args=("sockets", lambda: _pages_sockets(worker, "data/shared")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {"grpc": expected, "sockets": expected}
    cache = worker.objects._lists
    assert cache.fetched == 3  # 3,000 entries: three chunks of 1,000, each listed once

    # Single flight: two callers of one chunk at once make one store request.
    worker.objects.forget_mount("data")
    chunks: list[Chunk] = []
    both = threading.Barrier(2, timeout=10)

    def first_chunk() -> None:
        both.wait()
        chunks.append(worker.objects.list_chunk(CachePath("data", "shared"), True, ""))

    threads = [threading.Thread(target=first_chunk) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(chunks) == 2 and chunks[0] is chunks[1]
    _settled(worker)
    assert cache.fetched == 5 and cache.joined >= 1  # the first chunk once, and the second read ahead


def test_the_listing_cache_is_bounded_in_bytes(local_store, make_worker):
    for d in range(5):
        for f in range(1000):
            local_store.add(f"b/{d}/{f:04d}", b"x")
    one_chunk = Chunk("", [ObjectMeta(CachePath("data", f"b/0/{f:04d}"), 1, "v", 0.0) for f in range(1000)], False).size
    worker = make_worker(local_store.mount, list_cache_bytes=int(2.5 * one_chunk))
    expected = sorted(f"data/{key}" for key in local_store.objects)
    assert [n for page in _pages_grpc(worker.address, "data/b") for n in page] == expected
    cache = worker.objects._lists
    assert cache.fetched == 5 and len(cache) == 2 and cache.bytes <= 2.5 * one_chunk
    # The first chunk was evicted (least recently used): listing again asks the store for it.
    _pages_grpc(worker.address, "data/b")
    assert cache.fetched == 10
    with pytest.raises(ValueError, match="list_cache_bytes"):
        WorkerConfig(cache_dirs=worker.config.cache_dirs, list_cache_bytes=-1)


def test_a_listing_cache_evicts_the_least_recently_used_chunk():
    now = [0.0]
    entries = [ObjectMeta(CachePath("m", f"k{i}"), 1, "v", 0.0) for i in range(4)]
    size = Chunk("", entries[:2], False).size
    cache = ListingCache(ttl=10, max_bytes=2 * size, clock=lambda: now[0], read_ahead=False)
    a = cache.chunk("a", "", lambda _: (entries[:2], False))
    cache.chunk("b", "", lambda _: (entries[:2], False))
    assert cache.chunk("a", "", lambda _: pytest.fail("kept")) is a  # used: now the most recent
    cache.chunk("c", "", lambda _: (entries[:2], True))
    assert len(cache) == 2 and cache.bytes == 2 * size
    assert cache.chunk("a", "m/k0", lambda _: pytest.fail("kept")) is a  # covered: after k0, up to k1
    assert cache.chunk("b", "", lambda _: (entries[:1], True)).final  # evicted: asked again
    now[0] = 11.0  # expired
    assert cache.chunk("a", "", lambda _: ([], True)).entries == []
    assert cache.fetched == 5


def test_refresh_applies_to_the_first_page_only(local_store, make_worker):
    for f in range(30):
        local_store.add(f"r/{f:02d}", b"x")
    worker = make_worker(local_store.mount)
    assert _pages_grpc(worker.address, "data/r", max_entries=10)[0][0] == "data/r/00"
    local_store.add("r/0", b"new")  # sorts first
    assert _pages_grpc(worker.address, "data/r", max_entries=10)[0][0] == "data/r/00"  # cached
    cache = worker.objects._lists
    before = cache.fetched
    pages = _pages_grpc(worker.address, "data/r", max_entries=10, refresh=True)
    assert pages[0][0] == "data/r/0" and len([n for p in pages for n in p]) == 31
    assert cache.fetched == before + 1  # one chunk: the later pages (asked with refresh too) did not refresh


def test_a_paged_listing_refreshes_known_directories_and_adds_none_never_read(local_store, make_worker):
    """A paged listing refreshes the metadata of directories the worker has entries in (a changed
    object's new version is seen) and keeps nothing of a directory never read: a million-object
    listing must not add a million entries (or their CPU) for reads that bring their own."""
    for f in range(20):
        local_store.add(f"seen/{f:02d}", b"x")
        local_store.add(f"unseen/{f:02d}", b"x")
    worker = make_worker(local_store.mount)
    objects = worker.objects
    read = CachePath("data", "seen/03")
    before = objects.info(read).version  # a read of one object of seen/: the directory is known
    local_store.add("seen/03", b"changed, and longer")
    listed = [n for page in _pages_grpc(worker.address, "data") for n in page]
    assert len(listed) == 40
    assert objects.cached_info(read).version != before and objects.cached_info(read).size == 19
    assert objects.cached_info(CachePath("data", "seen/07")) is not None  # refreshed with its directory
    assert all(objects.cached_info(CachePath("data", f"unseen/{f:02d}")) is None for f in range(20))
    assert objects.info(CachePath("data", "unseen/05")).size == 1  # asked of the store when asked for


@pytest.mark.parametrize("s3_client", ["auto", "s3fs"])
def test_an_s3_listing_pages_with_the_store(s3_store, make_worker, monkeypatch, s3_client):
    """ListObjectsV2's own pages (MaxKeys, StartAfter): a page is one store request."""
    monkeypatch.setattr(objects, "LIST_CHUNK", 50)
    keys = [f"s/{d}/{f:02d}" for d in range(4) for f in range(40)] + [f"s/{name[2:]}" for name in TRICKY]
    for key in keys:
        s3_store.add(key, b"x")
    expected = sorted(f"data/{key}" for key in keys)
    worker = make_worker(s3_store.mount, s3_client=s3_client)
    requests: list[str] = []
    counted = worker.objects.on_request
    worker.objects.on_request = lambda kind: (requests.append(kind), counted(kind))
    backend_pages = []
    if s3_client == "s3fs":
        real = backends._S3Backend.list_after
        monkeypatch.setattr(backends._S3Backend, "list_after",
                            lambda *a: backend_pages.append(a[4]) or real(*a))
    first = _pages_grpc(worker.address, "data/s", max_entries=50)
    assert requests.count("list") == len(first) == 4  # 174 keys: four requests of 50
    assert [n for page in first for n in page] == expected
    if s3_client == "s3fs":
        assert len(backend_pages) == 4
    whole = worker.objects.list(CachePath("data", "s"), recursive=True, refresh=True)
    assert [str(m.path) for m in whole] == expected
    assert [n for page in _pages_sockets(worker, "data/s") for n in page] == expected


def test_a_large_flat_directory_is_read_once_for_all_its_chunks(local_store, make_worker, monkeypatch, dir_reads):
    """A flat data set (every file in one directory): each chunk bisects the directory's sorted
    names, kept while it is unchanged, rather than reading and sorting it again."""
    monkeypatch.setattr(objects, "LIST_CHUNK", 20)
    monkeypatch.setattr(localpages, "KEEP_ABOVE", 50)
    for f in range(300):
        local_store.add(f"flat/{f:04d}.bin", b"x")
    worker = make_worker(local_store.mount)
    expected = [f"data/flat/{f:04d}.bin" for f in range(300)]
    dir_reads[0] = 0
    assert [n for page in _pages_grpc(worker.address, "data/flat") for n in page] == expected
    assert worker.objects._lists.fetched == 15 and dir_reads[0] == 1
    local_store.add("flat/0000a.bin", b"new")  # the directory changed: read again
    pages = _pages_grpc(worker.address, "data/flat", refresh=True)
    assert [n for page in pages for n in page] == sorted(expected + ["data/flat/0000a.bin"])
    assert dir_reads[0] == 2


def test_a_fetch_begun_before_a_refresh_keeps_nothing():
    """A refresh drops the listing and its fetches under way: one that ends after it does not put
    back what it found before, and no later lister joins it."""
    cache = ListingCache(ttl=10, max_bytes=1 << 20, read_ahead=False)
    old = [ObjectMeta(CachePath("m", "old"), 1, "v", 0.0)]
    new = [ObjectMeta(CachePath("m", "new"), 1, "v", 0.0)]
    release = threading.Event()

    def slow(_: str) -> tuple[list[ObjectMeta], bool]:
        assert release.wait(10)
        return list(old), True

    got: list[Chunk] = []
    first = threading.Thread(target=lambda: got.append(cache.chunk("k", "", slow)))
    first.start()
    deadline = time.monotonic() + 10
    while not cache._fetching and time.monotonic() < deadline:
        time.sleep(0.01)
    refreshed = cache.chunk("k", "", lambda _: (list(new), True), refresh=True)
    release.set()
    first.join(timeout=10)
    assert [str(m.path) for m in got[0].entries] == ["m/old"]  # its own caller gets what it found
    assert cache.chunk("k", "", lambda _: pytest.fail("kept")) is refreshed
    assert cache.whole("k") == refreshed.entries and not cache._dropped and not cache._fetching


def test_a_store_that_cannot_page_is_listed_whole_once(local_store, monkeypatch):
    """Any other fsspec store (no paging here): listed whole on the first page, as before, and
    every later page cut from that listing kept, with no store request of its own."""
    from cachefs.mounts import MountTable
    from cachefs.server.worker.metaops import ListingPages

    monkeypatch.setattr(objects, "_backend_for", lambda fs, s3_client="auto": backends._Backend())
    for name in TRICKY:
        local_store.add(name, b"z")
    store = objects.ObjectStore(MountTable([local_store.mount]))
    requests: list[str] = []
    store.on_request = requests.append
    pages, names, after = ListingPages(store), [], ""
    while True:
        page, after = pages.page("data/t", True, False, after, 4, 1000, 1 << 20)
        names += [e.path for e in page]
        if not after:
            break
    assert names == sorted(f"data/{key}" for key in TRICKY) and requests == ["list"]


def test_a_chunk_holds_its_entries_as_columns_and_gives_them_back_exactly():
    """A chunk keeps its entries as columns (listed.py): every field comes back as given (ETags,
    derived versions, directories, names no codec validated), sorted by name, in tens of bytes
    an entry rather than an ObjectMeta's few hundred."""
    from cachefs.store.listed import ListedEntries

    metas = [ObjectMeta(CachePath("m", f"train/{i // 100:03d}/{i:07d}.jpg"), 4096 + i, f"{4096 + i}-{1.7e9 + i / 8!r}",
                        1.7e9 + i / 8) for i in range(1000)]
    odd = [ObjectMeta(CachePath("m", "b/etag"), 7, "0123456789abcdef0123456789abcdef", 5.5),
           ObjectMeta(CachePath("m", "a/dir"), 0, "", 0.0, True),
           ObjectMeta(CachePath("m", "c/\udcff-undecodable"), 1, "v\u00e9rsion", 1.25),
           ObjectMeta(CachePath("m", ""), 0, "", 0.0, True)]
    chunk = Chunk("", list(reversed(metas)) + odd, False)
    want = sorted(metas + odd, key=lambda m: str(m.path))
    assert list(chunk.entries) == want and chunk.entries == want
    assert list(chunk.names) == [str(m.path) for m in want] and chunk.last == str(want[-1].path)
    assert chunk.entries[-1] == want[-1] and chunk.entries[10:13] == want[10:13]
    assert chunk.covers(str(want[0].path)) and not chunk.covers(chunk.last)
    per_entry = (chunk.size - 400) / len(want)
    assert per_entry < 60, per_entry  # 24-byte keys, derived versions: ~49 B an entry
    entries = ListedEntries("m")
    entries.add("z", 1, None, 2.5, False)  # None: derived from size and mtime, as a local walk gives
    assert entries[0].version == "1-2.5"
    with pytest.raises(IndexError):
        entries[1]


def test_a_local_directory_listed_a_page_at_a_time_says_which_entries_are_directories(local_store, make_worker):
    """``ls`` of a local directory (not recursive) pages through the walk too: its directories
    must come back as directories (size 0, no version), its files with their own size and the
    version a read checks (``cp -r`` descends only into what ``ls`` calls a directory)."""
    local_store.add("l/sub/deeper/f", b"abc")
    local_store.add("l/file", b"12345")
    worker = make_worker(local_store.mount)
    chunk = worker.objects.list_chunk(CachePath("data", "l"), False, "")
    got = {str(m.path): (m.is_dir, m.size, m.version) for m in chunk.entries}
    file_info = worker.objects.info(CachePath("data", "l/file"), refresh=True)
    assert got == {"data/l/file": (False, 5, file_info.version), "data/l/sub": (True, 0, "")}
    fs = client(worker.address)
    assert fs.isdir("data/l/sub") and fs.ls("data/l/sub", detail=False) == ["data/l/sub/deeper"]


@pytest.mark.parametrize("chunk", [3, 7, 1000])
def test_a_paged_listing_tells_the_revalidator_how_large_each_directory_is(local_store, make_worker, monkeypatch,
                                                                             chunk):
    """A directory's size is what lets the revalidator refresh many run-out objects of it by one
    listing (a warm epoch longer than the TTL); a data set's index is listed a chunk at a time, so
    the chunks count each directory's own objects, however the chunk boundaries fall (a directory
    with files on both sides of a subdirectory in key order included)."""
    monkeypatch.setattr(objects, "LIST_CHUNK", chunk)
    names = TRICKY + [f"t/d{d}/{f:02d}" for d in range(3) for f in range(5)]
    for name in names:
        local_store.add(name, b"z")
    own: dict[str, int] = {}
    for name in names:
        directory = name.rpartition("/")[0]
        own[directory] = own.get(directory, 0) + 1
    worker = make_worker(local_store.mount)
    listed = [n for page in _pages_grpc(worker.address, "data/t") for n in page]
    assert len(listed) == len(names)
    sizes = {d: worker.objects.revalidator._dir_size(CachePath("data", d)) for d in own}
    assert sizes == own
    # A listing that starts after a name (no chunk before it seen) says nothing of the directories
    # around that name, only of those it saw whole.
    fresh = make_worker(local_store.mount)
    fresh.objects.list_chunk(CachePath("data", "t"), True, "data/t/d1/02")
    assert fresh.objects.revalidator._dir_size(CachePath("data", "t/d1")) is None
    if chunk >= 1000:
        assert fresh.objects.revalidator._dir_size(CachePath("data", "t/d2")) == 5


def test_run_out_objects_of_a_directory_known_from_a_paged_listing_are_refreshed_by_one_listing(local_store,
                                                                                                make_worker,
                                                                                                monkeypatch):
    """Objects read once (their metadata kept), run out past the TTL: a read of many of them is
    answered by one listing of their directory, whose size the data set's paged listing told
    (chunks of 7: the directory never in one chunk)."""
    from collections import Counter

    monkeypatch.setattr(objects, "LIST_CHUNK", 7)
    for f in range(40):
        local_store.add(f"e/{f:02d}", b"x" * f)
    worker = make_worker(local_store.mount, metadata_ttl=0.3)
    store = worker.objects
    [n for page in _pages_grpc(worker.address, "data/e") for n in page]  # noqa: B018 - the data set's listing
    paths = [CachePath("data", f"e/{f:02d}") for f in range(40)]
    for p in paths:
        store.info(p)
    assert wait_for(lambda: not any(store._fresh(p) for p in paths), timeout=10)
    asked: Counter[str] = Counter()
    store.on_request = lambda kind: asked.update([kind])
    for p in paths:
        assert store.info(p).size == int(p.key[-2:])
    assert wait_for(lambda: all(store._fresh(p) for p in paths) and store.revalidator.waiting() == 0, timeout=30)
    assert asked["list"] >= 1 and asked["info"] < 20, asked  # a stat each would be 40
