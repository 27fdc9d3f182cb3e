"""Reads by name (#14): the worker's name index (server/worker/names.py), the client's page files
opened by name (client/transport/namedpages.py), and what a real in-process worker does with them: a
process's first read of a cached page with no message, reported afterwards; nothing read by name
after the page left the cache or the worker's knowledge of the version ran out.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.client.transport.namedpages import NamedPages
from cachefs.pagenames import ENTRY, NAMES_HEADER, VERSION_BYTES, name_hashes, page_digest, path_page_digest
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.server.pagestore.store import PageId
from cachefs.server.worker.names import NameIndex
from cachefs.server.worker.shortcircuit import ShortCircuitServer
from helpers import payload, wait_for

PAGE = 64 << 10


def _client(index: NameIndex, dirs=(("/nonexistent", 1),), page_size: int = PAGE) -> NamedPages:
    fd, slots = index.reader()
    try:
        return NamedPages(fd, slots, list(dirs), page_size)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _store_with_names(tmp_path, quotas: tuple[int, ...], page_size: int = 4096,
                      stale_window: float = 0.0) -> Iterator[tuple]:
    """A real page store over one dir per quota, a name index, and a client of both."""
    from cachefs.server.pagestore import PageStore
    from cachefs.server.pagestore.store import CacheDir

    dirs = [CacheDir(str(tmp_path / f"d{i}"), quota) for i, quota in enumerate(quotas)]
    with PageStore(dirs, page_size=page_size) as store:
        index = NameIndex(slots=16, stale_window=stale_window)
        client = _client(index, dirs=store.dirs(), page_size=page_size)
        try:
            yield store, index, client
        finally:
            client.close()
            index.close()


# -- the index ---------------------------------------------------------------------------------------
def test_the_index_vouches_for_a_version_until_it_runs_out_and_forgets_on_request():
    index = NameIndex(slots=8)
    client = _client(index)
    try:
        far = time.monotonic() + 60
        assert client.lookup("m/a") is None
        assert index.publish("m/a", "v1", 123, 1.5, far)
        assert client.lookup("m/a") == (123, "v1", 1.5)
        assert client.lookup("m/b") is None  # another path, whatever its slot
        assert index.publish("m/a", "v2", 124, 2.5, far)  # a new version replaces the old
        assert client.lookup("m/a") == (124, "v2", 2.5)
        index.refreshed("m/a", "v2", 124, 2.5, far)  # the store's version: kept
        assert client.lookup("m/a") == (124, "v2", 2.5)
        index.refreshed("m/a", "v3", 124, 2.5, far)  # the store has another one now: not vouched for
        assert client.lookup("m/a") is None
        # A refresh of the same version extends an entry about to run out (reads by name go on
        # after the metadata TTL without asking the worker); it never creates one.
        assert index.publish("m/r", "v1", 10, 1.0, time.monotonic() + 0.3)
        index.refreshed("m/r", "v1", 10, 1.0, far)
        index.refreshed("m/never-published", "v1", 10, 1.0, far)
        assert wait_for(lambda: time.monotonic() > far - 59, timeout=30)  # past the first until
        assert client.lookup("m/r") == (10, "v1", 1.0)
        assert client.lookup("m/never-published") is None
        index.refreshed("m/r", "v1", 11, 1.0, far)  # same version name, another size: not vouched for
        assert client.lookup("m/r") is None
        assert index.publish("m/a", "v3", 1, 0.0, time.monotonic() - 0.001)  # already run out
        assert client.lookup("m/a") is None
        assert not index.publish("m/a", "x" * (VERSION_BYTES + 1), 1, 0.0, far)  # too long: not published
        assert client.lookup("m/a") is None
        index.publish("m/c", "v", 7, 0.0, far)
        index.forget("m/c")
        assert client.lookup("m/c") is None
    finally:
        client.close()
        index.close()


def test_a_collision_replaces_and_never_answers_for_another_path():
    index = NameIndex(slots=1)  # every path in one slot
    client = _client(index)
    try:
        far = time.monotonic() + 60
        index.publish("m/a", "va", 1, 0.0, far)
        index.publish("m/b", "vb", 2, 0.0, far)
        assert client.lookup("m/a") is None and client.lookup("m/b") == (2, "vb", 0.0)
    finally:
        client.close()
        index.close()


def test_paths_that_share_a_slot_are_all_found_within_the_probe_window():
    index = NameIndex(slots=64)
    client = _client(index)
    try:
        far = time.monotonic() + 60
        paths = [f"m/objs/{i:05d}" for i in range(24)]
        firsts = [name_hashes(p)[0] % 64 for p in paths]
        assert len(set(firsts)) < len(paths)  # these names do share first slots
        for i, p in enumerate(paths):
            assert index.publish(p, f"v{i}", i + 1, 0.0, far)
        assert [client.lookup(p) for p in paths] == [(i + 1, f"v{i}", 0.0) for i in range(len(paths))]
    finally:
        client.close()
        index.close()


def test_a_full_window_replaces_the_entry_that_runs_out_first_and_forget_frees_a_slot():
    index = NameIndex(slots=2)  # one window of both slots for every path
    client = _client(index)
    try:
        now = time.monotonic()
        index.publish("m/a", "va", 1, 0.0, now + 30)
        index.publish("m/b", "vb", 2, 0.0, now + 60)
        assert client.lookup("m/a") == (1, "va", 0.0) and client.lookup("m/b") == (2, "vb", 0.0)
        index.publish("m/c", "vc", 3, 0.0, now + 90)  # full: "m/a" runs out first, it goes
        assert client.lookup("m/a") is None
        assert client.lookup("m/b") == (2, "vb", 0.0) and client.lookup("m/c") == (3, "vc", 0.0)
        index.forget("m/b")
        assert client.lookup("m/b") is None and client.lookup("m/c") == (3, "vc", 0.0)
        index.publish("m/d", "vd", 4, 0.0, now + 10)  # into the freed slot, nothing replaced
        assert client.lookup("m/c") == (3, "vc", 0.0) and client.lookup("m/d") == (4, "vd", 0.0)
        index.refreshed("m/c", "vc2", 3, 0.0, now + 90)
        assert client.lookup("m/c") is None and client.lookup("m/d") == (4, "vd", 0.0)
    finally:
        client.close()
        index.close()


def test_an_entry_clients_may_still_read_past_its_time_keeps_its_slot():
    """Within the stale window a run-out entry is still read by name (reported for a refresh): a
    new path must not take its slot (the table grows instead), nor may growing leave it behind;
    one past the window is free."""
    index = NameIndex(slots=2, max_slots=8, stale_window=600)  # one window of both slots
    try:
        now = time.monotonic()
        index.publish("m/a", "va", 1, 0.0, now - 1)  # run out: clients read it and report it
        index.publish("m/b", "vb", 2, 0.0, now + 60)
        index.publish("m/c", "vc", 3, 0.0, now + 60)  # no free slot: the table grows
        assert index.grown == 1
        client = _client(index)
        try:
            assert client._usable("m/a") == (1, "va", 0.0)  # still there, past its time
            assert client.lookup("m/b") == (2, "vb", 0.0) and client.lookup("m/c") == (3, "vc", 0.0)
        finally:
            client.close()
    finally:
        index.close()
    index = NameIndex(slots=2, max_slots=8, stale_window=1.0)
    try:
        now = time.monotonic()
        index.publish("m/dead", "vd", 1, 0.0, now - 5)  # past its time and the window
        index.publish("m/b", "vb", 2, 0.0, now + 60)
        index.publish("m/c", "vc", 3, 0.0, now + 60)  # takes the dead entry's slot
        assert index.grown == 0
        client = _client(index)
        try:
            assert client._entry("m/dead") is None
            assert client.lookup("m/b") == (2, "vb", 0.0) and client.lookup("m/c") == (3, "vc", 0.0)
        finally:
            client.close()
    finally:
        index.close()


def test_a_full_table_grows_keeping_its_entries_and_the_old_one_says_so():
    index = NameIndex(slots=16, max_slots=4096)
    old = _client(index)
    try:
        far = time.monotonic() + 60
        paths = [f"m/objs/{i:05d}" for i in range(150)]
        index.publish("m/gone", "v", 1, 0.0, time.monotonic() - 1)  # run out: not carried over
        for i, p in enumerate(paths):
            assert index.publish(p, f"v{i}", i + 1, 0.0, far)
        assert index.slots in (256, 512) and index.grown >= 4  # 16 -> 32 -> 64 -> 128 -> 256 (-> 512)
        assert old.lookup(paths[0]) is None and old.superseded  # readers of a replaced table stop
        new = _client(index)
        try:
            assert not new.superseded and new.slots == index.slots
            assert [new.lookup(p) for p in paths] == [(i + 1, f"v{i}", 0.0) for i in range(len(paths))]
            assert new.lookup("m/gone") is None
        finally:
            new.close()
    finally:
        old.close()
        index.close()


def test_a_full_window_moves_an_entry_within_its_own_window_before_anything_is_pushed_out():
    """One step of cuckoo hashing: a new path whose slots are all taken moves one of their
    entries to a free slot of that entry's own window, so a table fills to 0.95 keeping every
    entry (without the move, some were pushed out at the same load), and every entry moved is
    still found by a client."""
    slots, n = 256, 243
    index = NameIndex(slots=slots, max_slots=slots)  # no growth: a full window must move or push out
    client = _client(index)
    try:
        far = time.monotonic() + 60
        paths = [f"m/objs/{i:05d}" for i in range(n)]
        for i, p in enumerate(paths):
            assert index.publish(p, f"v{i}", i + 1, 0.0, far)
        assert index.moved > 0 and index.grown == 0
        assert [client.lookup(p) for p in paths] == [(i + 1, f"v{i}", 0.0) for i in range(n)]
    finally:
        client.close()
        index.close()


def test_a_table_grown_many_times_keeps_every_entry_and_stays_dense():
    """20,000 objects from a table of 64 slots: every entry is still there after each growth (the
    copy moves entries as publishing does, rather than drop one whose window is full), and the
    table is at least 0.6 full (4 probes without moves grew 200,000 objects to 21x their count)."""
    index = NameIndex(slots=64, max_slots=1 << 20)
    try:
        far = time.monotonic() + 600
        paths = [f"data/train/{i // 1000:04d}/{i:08d}.bin" for i in range(20_000)]
        for i, p in enumerate(paths):
            assert index.publish(p, f"4096-{i}", 4096, float(i), far)
        assert index.grown >= 8 and len(paths) / index.slots >= 0.6
        assert all(index._table.find(*name_hashes(p)) is not None for p in paths)
    finally:
        index.close()


def test_at_its_largest_a_full_table_replaces_entries_instead():
    index = NameIndex(slots=4, max_slots=16)
    try:
        far = time.monotonic() + 60
        paths = [f"m/p{i}" for i in range(100)]
        for p in paths:
            assert index.publish(p, "v", 5, 0.0, far)
        assert index.slots == 16 and index.grown == 2  # 4 -> 8 -> 16
        client = _client(index)
        try:
            found = [p for p in paths if client.lookup(p) == (5, "v", 0.0)]
            assert 4 <= len(found) <= 16 and paths[-1] in found  # the newest always goes in
        finally:
            client.close()
    finally:
        index.close()


def test_an_entry_being_written_reads_as_absent_and_clients_cannot_write():
    index = NameIndex(slots=4)
    client = _client(index)
    try:
        index.publish("m/a", "v", 1, 0.0, time.monotonic() + 60)
        assert client.lookup("m/a") is not None
        off = NAMES_HEADER.size + (name_hashes("m/a")[0] % 4) * ENTRY.size
        seq = int.from_bytes(index._table.map[off:off + 8], "little")
        index._table.map[off:off + 8] = (seq + 1).to_bytes(8, "little")  # as the worker does mid-write
        assert client.lookup("m/a") is None
        index._table.map[off:off + 8] = (seq + 2).to_bytes(8, "little")
        assert client.lookup("m/a") is not None
        fd = index.reader()[0]
        try:
            with pytest.raises((OSError, PermissionError)):
                mmap.mmap(fd, index._table.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    finally:
        client.close()
        index.close()


def test_bad_tables_are_refused():
    index = NameIndex(slots=4)
    try:
        fd = index.reader()[0]
        try:
            with pytest.raises(ValueError):
                NamedPages(fd, 5, [("/x", 1)], PAGE)  # more slots than the table has
            with pytest.raises(ValueError):
                NamedPages(fd, 4, [], PAGE)
        finally:
            os.close(fd)
    finally:
        index.close()
    with pytest.raises(ValueError):
        NameIndex(slots=0)


def test_the_client_computes_the_page_stores_names(tmp_path):
    """Same digest and dir as the page store's own, for several dirs (rendezvous by quota)."""
    with _store_with_names(tmp_path, (1 << 20, 2 << 20, 3 << 20)) as (store, index, client):
        data = payload(5 * 4096 + 17, 9)
        for i in range(6):
            assert store.put(PageId("m", "dir/obj", "v9", i), data[i * 4096:(i + 1) * 4096])
        assert PageId("m", "dir/obj", "v9", 2).digest() == page_digest("m", "dir/obj", "v9", 2)
        index.publish("m/dir/obj", "v9", len(data), 0.0, time.monotonic() + 60)
        got = client.open_range("m/dir/obj", 4000, 4096 * 3, "v9")
        assert got is not None
        size, version, pages, digests = got
        assert (size, version, len(pages)) == (len(data), "v9", 4)  # pages 0-3 cover [4000, 16288)
        for page in pages:
            assert os.pread(page.fd, page.length, 0) == data[page.start:page.start + page.length]
            os.close(page.fd)
        assert client.covers("m/dir/obj", 0, -1) and not client.covers("m/dir/obj", 0, -1, "v8")
        assert client.open_range("m/dir/obj", 0, 10, "v8") is None  # another version asked for
        store.delete(PageId("m", "dir/obj", "v9", 5))
        assert not client.covers("m/dir/obj", 0, -1) and client.open_range("m/dir/obj", 0, -1) is None
        assert client.stats["named_missing"] == 2 and client.enabled  # missing is not a reason to stop


@pytest.mark.parametrize("quotas", [(1 << 20,), (1 << 20, 2 << 20, 3 << 20)], ids=["one-dir", "three-dirs"])
def test_whole_one_page_objects_are_read_by_the_names_the_page_store_gives(tmp_path, quotas):
    """read_whole's one-pass naming (path_page_digest, the single dir taken as is) finds the
    page store's own files, for keys that are not ASCII too."""
    keys = ["dir/obj-0", "dïr/ob✓-1", "a/b/c/ü-2"]
    assert all(path_page_digest(f"m/{k}".encode(), "v€".encode(), 0).hexdigest() == page_digest("m", k, "v€", 0)
               for k in keys)
    with _store_with_names(tmp_path, quotas) as (store, index, client):
        bodies = {k: payload(1000 + i, i) for i, k in enumerate(keys)}
        for k, body in bodies.items():
            assert store.put(PageId("m", k, "v€", 0), body)
            index.publish(f"m/{k}", "v€", len(body), 0.0, time.monotonic() + 60)
        outs = {k: bytearray(len(b)) for k, b in bodies.items()}
        reads = [(f"m/{k}", 0, memoryview(outs[k])) for k in keys] + [("m/none", 0, memoryview(bytearray(5)))]
        results: list[Any] = [None] * len(reads)
        assert client.read_whole(reads, results) == 3
        assert results == [(len(bodies[k]),) * 2 for k in keys] + [None]
        assert all(bytes(outs[k]) == bodies[k] for k in keys)
        for k in keys:
            assert client._whole[f"m/{k}"][6] == client._file(page_digest("m", k, "v€", 0))


def test_dirs_this_process_cannot_use_turn_reads_by_name_off(tmp_path):
    index = NameIndex(slots=4)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    client = _client(index, dirs=[(str(not_a_dir), 1)])
    try:
        index.publish("m/a", "v", 10, 0.0, time.monotonic() + 60)
        assert client.open_range("m/a", 0, -1) is None  # ENOTDIR: not a missing page, a wrong place
        assert not client.enabled and client.lookup("m/a") is not None
        assert client.open_range("m/a", 0, -1) is None
    finally:
        client.close()
        index.close()


def test_cache_dirs_that_are_not_the_workers_here_are_refused(tmp_path):
    """Another container's mounts: the same path, another dir (or none) -> no reads by name."""
    index = NameIndex(slots=4)
    here = tmp_path / "cache"
    here.mkdir()
    st = os.stat(here)
    fd = index.reader()[0]
    try:
        NamedPages(fd, 4, [(str(here), 1)], PAGE, [f"{st.st_dev}:{st.st_ino}"]).close()
        with pytest.raises(ValueError, match="not the worker's cache dir"):
            NamedPages(fd, 4, [(str(here), 1)], PAGE, [f"{st.st_dev}:{st.st_ino + 1}"])
        with pytest.raises(ValueError, match="not visible here"):
            NamedPages(fd, 4, [(str(tmp_path / "absent"), 1)], PAGE, ["1:2"])
    finally:
        os.close(fd)
        index.close()


def test_only_clients_of_the_workers_user_or_root_are_offered_the_index():
    server = ShortCircuitServer("/nonexistent.sock", pages=None)  # nothing started
    assert server._by_name_allowed((os.getuid(), 1)) and server._by_name_allowed((0, 1))
    assert not server._by_name_allowed((os.getuid() + 12345, 1)) and not server._by_name_allowed(None)


def test_whole_pages_are_read_into_a_buffer_checked_and_anything_else_left_to_the_general_path(tmp_path):
    """read_into: the lean path of a new process's batch (open, one preadv of payload and trailer,
    close): right bytes and digests for whole pages; PARTIAL for a range that wants part of a
    page; None for a page that is gone, torn or whose bytes do not match its checksum."""
    from cachefs.client.transport.namedpages import PARTIAL

    with _store_with_names(tmp_path, (1 << 20,)) as (store, index, client):
        data = payload(2 * 4096 + 100, 11)
        for i in range(3):
            assert store.put(PageId("m", "obj", "v1", i), data[i * 4096:(i + 1) * 4096])
        index.publish("m/obj", "v1", len(data), 0.0, time.monotonic() + 60)
        out = bytearray(len(data) + 50)  # room to spare: the read stops at the object's end
        n, size, digests = client.read_into("m/obj", 0, memoryview(out))
        assert (n, size) == (len(data), len(data)) and bytes(out[:n]) == data
        assert digests == [page_digest("m", "obj", "v1", i) for i in range(3)]
        n, _size, digests = client.read_into("m/obj", 4096, memoryview(bytearray(4096)))
        assert (n, digests) == (4096, [page_digest("m", "obj", "v1", 1)])
        assert client.read_into("m/obj", 10, memoryview(bytearray(4096))) is PARTIAL
        assert client.read_into("m/obj", 0, memoryview(bytearray(100))) is PARTIAL
        assert client.read_into("m/other", 0, memoryview(bytearray(10))) is None  # not vouched for

        first = client._file(page_digest("m", "obj", "v1", 0))
        with open(first, "r+b") as f:  # one payload byte flipped: the checksum refuses it
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data)))) is None
        path = client._file(page_digest("m", "obj", "v1", 1))
        os.truncate(path, 4096)  # torn: no trailer
        assert client.read_into("m/obj", 4096, memoryview(bytearray(4096))) is None
        os.unlink(path)  # gone (evicted): counted as missing, and reads by name stay on
        assert client.read_into("m/obj", 4096, memoryview(bytearray(4096))) is None
        assert client.stats["named_missing"] == 1 and client.enabled


def test_a_page_file_read_again_is_checked_once_and_a_replaced_file_anew(tmp_path):
    """A process checks a page file's checksum on its first two reads (the second remembers the
    file's identity) and reads the same file after that with no checksum pass; a page file
    replaced (written elsewhere and renamed over, as the worker writes) is another file: its
    bytes are checked again, and refused if they do not match."""
    with _store_with_names(tmp_path, (1 << 20,)) as (store, index, client):
        data = payload(2 * 4096, 12)
        for i in range(2):
            assert store.put(PageId("m", "obj", "v1", i), data[i * 4096:(i + 1) * 4096])
        index.publish("m/obj", "v1", len(data), 0.0, time.monotonic() + 60)
        for expect_unhashed in (0, 0, 2, 4):
            out = bytearray(len(data))
            assert client.read_into("m/obj", 0, memoryview(out))[0] == len(data) and bytes(out) == data
            assert client.stats["named_unhashed"] == expect_unhashed

        path = client._file(page_digest("m", "obj", "v1", 1))
        with open(path, "rb") as f:
            good = bytearray(f.read())
        bad = bytearray(good)
        bad[5] ^= 0xFF  # the trailer (size, checksum) kept: only the checksum pass can tell
        # Written outside the page dirs (the store's sweeper removes *.tmp debris there while it
        # starts: it took such a file from under this test once), then renamed over the page.
        replacement = os.path.join(str(tmp_path), "replacement")
        with open(replacement, "wb") as f:
            f.write(bad)
        os.rename(replacement, path)
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data)))) is None
        assert client.stats["named_unhashed"] == 5  # page 0 still the file checked before

        with open(replacement, "wb") as f:  # the right bytes again, in a new file: checked, then trusted
            f.write(good)
        os.rename(replacement, path)
        for _ in range(3):
            out = bytearray(len(data))
            assert client.read_into("m/obj", 0, memoryview(out))[0] == len(data) and bytes(out) == data
        assert client.stats["named_unhashed"] == 5 + 1 + 2 + 2  # page 1 checked once more, then trusted


def test_small_pages_read_whole_are_checked_at_every_read_and_not_remembered(tmp_path):
    """Below ALWAYS_CHECKED_BYTES a page read whole is checked each time (its checksum costs
    less than the fstat that would know the file again) and leaves nothing in the memory of
    checked files."""
    with _store_with_names(tmp_path, (1 << 20,)) as (store, index, client):
        data = payload(4096, 7)
        assert store.put(PageId("m", "small", "v1", 0), data)
        index.publish("m/small", "v1", len(data), 0.0, time.monotonic() + 60)
        for _ in range(3):
            out = bytearray(len(data))
            results = [None]
            assert client.read_whole([("m/small", 0, memoryview(out))], results) == 1 and bytes(out) == data
        assert client.stats["named_unhashed"] == 0 and not client._checked.seen


def test_one_page_samples_are_read_whole_checked_once_and_anything_else_left_to_read_into(tmp_path, monkeypatch):
    """read_whole: a batch's one-page objects read whole by name in one pass (a warm epoch's
    samples). The first read of a page file checks its checksum, a file read again is known by
    its identity (pages above ALWAYS_CHECKED_BYTES: every one here); an entry rewritten (a new
    version) is seen at once by its slot's seq; reads that are not a whole one-page object, an
    entry past its time, and a page file that is gone or does not match its checksum are left for
    read_into (their results stay None)."""
    monkeypatch.setattr("cachefs.client.transport.namedpages.ALWAYS_CHECKED_BYTES", 0)
    with _store_with_names(tmp_path, (1 << 20,)) as (store, index, client):
        objects = {f"s{i}": payload(1000 + i, 30 + i) for i in range(4)}
        big = payload(2 * 4096, 39)
        for key, data in objects.items():
            assert store.put(PageId("m", key, "v1", 0), data)
            index.publish(f"m/{key}", "v1", len(data), 0.0, time.monotonic() + 60)
        for i in range(2):
            assert store.put(PageId("m", "big", "v1", i), big[i * 4096:(i + 1) * 4096])
        index.publish("m/big", "v1", len(big), 0.0, time.monotonic() + 60)

        def batch(keys, sizes=None):
            outs = [bytearray(len(objects[k]) if sizes is None else sizes[n]) for n, k in enumerate(keys)]
            reads = [(f"m/{k}", 0, memoryview(out)) for k, out in zip(keys, outs)]
            results = [None] * len(reads)
            return client.read_whole(reads, results), results, outs

        keys = sorted(objects)
        for expect_unhashed in (0, 0, 4):  # checked on the first two reads, then known by identity
            done, results, outs = batch(keys)
            assert done == 4 and results == [(len(objects[k]),) * 2 for k in keys]
            assert [bytes(o) for o in outs] == [objects[k] for k in keys]
            assert client.stats["named_unhashed"] == expect_unhashed
        touched, nbytes = client.take_touched()
        assert sorted(touched) == sorted([bytes.fromhex(page_digest("m", k, "v1", 0)) for k in keys] * 3)
        assert nbytes == 3 * sum(map(len, objects.values()))

        # Not for read_whole: an object of two pages, a buffer shorter than the object, a path not vouched for.
        done, results, _outs = batch(["s0", "s1"], sizes=[10, len(objects["s1"])])
        assert done == 1 and results == [None, (len(objects["s1"]),) * 2]
        results = [None, None]
        assert client.read_whole([("m/big", 0, memoryview(bytearray(len(big)))),
                                  ("m/nope", 0, memoryview(bytearray(5)))], results) == 0
        assert results == [None, None]

        # A new version published (the entry rewritten): its page is read, not the old one's.
        new = payload(1500, 50)
        assert store.put(PageId("m", "s2", "v2", 0), new)
        index.publish("m/s2", "v2", len(new), 0.0, time.monotonic() + 60)
        out = bytearray(len(new))
        results = [None]
        assert client.read_whole([("m/s2", 0, memoryview(out))], results) == 1 and bytes(out) == new

        # A page file replaced by one whose bytes do not match its checksum: refused.
        path = client._file(page_digest("m", "s3", "v1", 0))
        with open(path, "rb") as f:
            bad = bytearray(f.read())
        bad[3] ^= 0xFF
        replacement = os.path.join(str(tmp_path), "replacement")  # not a *.tmp the sweeper may take
        with open(replacement, "wb") as f:
            f.write(bad)
        os.rename(replacement, path)
        results = [None]
        assert client.read_whole([("m/s3", 0, memoryview(bytearray(len(objects["s3"]))))], results) == 0
        assert results == [None]
        os.unlink(client._file(page_digest("m", "s1", "v1", 0)))  # evicted: left to read_into
        results = [None]
        assert client.read_whole([("m/s1", 0, memoryview(bytearray(len(objects["s1"]))))], results) == 0

        # Past its entry's time: left to read_into (which reads within the stale window and reports).
        index.publish("m/s0", "v1", len(objects["s0"]), 1.0, time.monotonic() - 1)  # rewritten, run out
        results = [None]
        assert client.read_whole([("m/s0", 0, memoryview(bytearray(len(objects["s0"]))))], results) == 0


def test_remembered_names_are_bounded_and_reads_stay_right_past_the_bound(tmp_path, monkeypatch):
    """Each path's slots and each object version's page file names are remembered per process,
    up to MEMO_ENTRIES of each; past it the memory starts over, and every read is still right."""
    monkeypatch.setattr("cachefs.client.transport.namedpages.MEMO_ENTRIES", 3)
    with _store_with_names(tmp_path, (1 << 20,)) as (store, index, client):
        objects = {f"o{i}": payload(4096 + 10 * i, 20 + i) for i in range(6)}  # two pages each
        for key, data in objects.items():
            for page in range(2):
                assert store.put(PageId("m", key, "v1", page), data[page * 4096:(page + 1) * 4096])
            index.publish(f"m/{key}", "v1", len(data), 0.0, time.monotonic() + 60)
        for _ in range(3):
            for key, data in objects.items():
                out = bytearray(len(data))
                assert client.read_into(f"m/{key}", 0, memoryview(out))[0] == len(data) and bytes(out) == data
                assert len(client._where) <= 3 and client._memo_pages <= 3


def test_a_page_checked_through_a_handed_over_descriptor_needs_no_second_check_by_name(tmp_path):
    """A cold epoch reads pages through descriptors the worker handed over (checked once, by file
    identity: shortcircuit.VerifiedFiles); the next epoch reads the same files by name: already
    checked, no checksum pass on their first read by name. A file not among them is checked."""
    from cachefs.client.transport.shortcircuit import VerifiedFiles
    from cachefs.server.pagestore import PageStore
    from cachefs.server.pagestore.store import CacheDir

    with PageStore([CacheDir(str(tmp_path / "d"), 1 << 20)], page_size=4096) as store:
        index = NameIndex(slots=16)
        verified = VerifiedFiles()
        fd, slots = index.reader()
        try:
            client = NamedPages(fd, slots, store.dirs(), 4096, verified=verified)
        finally:
            os.close(fd)
        try:
            data = payload(2 * 4096, 13)
            for i in range(2):
                assert store.put(PageId("m", "obj", "v1", i), data[i * 4096:(i + 1) * 4096])
            index.publish("m/obj", "v1", len(data), 0.0, time.monotonic() + 60)
            held = os.open(client._file(page_digest("m", "obj", "v1", 0)), os.O_RDONLY)
            try:
                verified.add(VerifiedFiles.identity(held, 4096))  # as a held read records it
            finally:
                os.close(held)
            out = bytearray(len(data))
            assert client.read_into("m/obj", 0, memoryview(out))[0] == len(data) and bytes(out) == data
            assert client.stats["named_unhashed"] == 1  # page 0 only
            assert client.read_into("m/obj", 0, memoryview(out))[0] == len(data)
            assert client.stats["named_unhashed"] == 3  # page 1 was checked on its first read
        finally:
            client.close()
            index.close()


# -- a real worker -----------------------------------------------------------------------------------
def _fs(worker, **kw) -> CacheFileSystem:
    return CacheFileSystem(workers=worker.address, skip_instance_cache=True, **kw)


def _served(worker) -> float:
    return worker.metrics.short_circuit_bytes._value.get()


def _named_reads(worker) -> float:
    return worker.metrics.named_page_reads._value.get()


def _settled(worker, paths: list[str], sizes: list[int]) -> None:
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: list(stub.GetCached(worker_pb2.GetCachedRequest(paths=paths), timeout=10)
                                     .cached_bytes) == sizes, timeout=30)


def _count_messages(reader, monkeypatch) -> list:
    """The requests ``reader`` sends from now on (reports of reads by name held back)."""
    sent: list = []
    exchange = reader._exchange

    def counted(request, *more):
        sent.append(request)
        return exchange(request, *more)

    monkeypatch.setattr(reader, "_exchange", counted)
    monkeypatch.setattr("cachefs.client.transport.namedpages.REPORT_SECONDS", 1e9)
    return sent


def _reader(fs, worker):
    return fs.session._state.get().bulk._readers[worker.address][0]


def test_a_new_process_reads_cached_pages_by_name_with_no_message(local_store, make_worker, monkeypatch):
    objects = {f"o{i}": payload(2 * PAGE + 100 * i, 20 + i) for i in range(4)}
    for name, data in objects.items():
        local_store.add(name, data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    first = _fs(worker)
    for name, data in objects.items():
        assert first.cat_file(f"cachefs://data/{name}") == data  # cold: filled, published
    _settled(worker, [f"data/{n}" for n in objects], [len(d) for d in objects.values()])
    hits = worker.pages.stats().hits

    fresh = _fs(worker, short_circuit_handles=0)  # as a new process: no held handle helps it
    assert fresh.cat_file("cachefs://data/o0") == objects["o0"]  # its hello brings the index
    reader = _reader(fresh, worker)
    assert reader.named is not None
    messages = _count_messages(reader, monkeypatch)
    assert fresh.cat_file("cachefs://data/o1") == objects["o1"]
    assert fresh.cat_file("cachefs://data/o2", 5, PAGE + 9) == objects["o2"][5:PAGE + 9]
    with fresh.open("cachefs://data/o3") as f:  # its info from the index too
        assert f.read() == objects["o3"]
    assert fresh.cat_ranges(["cachefs://data/o1", "cachefs://data/o3"], [0, PAGE], [10, None]) == \
        [objects["o1"][:10], objects["o3"][PAGE:]]
    assert messages == []  # nothing asked of the worker
    named = reader.counts["named_hits"]
    assert named == 3 + 2 + 3 + 1 + 2  # pages: o1, o2 in part, o3, then o1 in part and o3 in part
    counters = fresh.session.counters()  # the process's counters tell reads by name apart
    assert counters["named_hits"] == named and counters["held_hits"] == 0
    before = _named_reads(worker)
    fresh.session.report_reads()
    assert _named_reads(worker) == before + named  # reported: the worker's counters and recency see them
    # the page store's recency and hits: applied behind the reply (server/worker/touches.py)
    assert wait_for(lambda: worker.pages.stats().hits >= hits + named, timeout=30)


def test_more_objects_than_the_first_table_holds_are_all_read_by_name(local_store, make_worker, monkeypatch):
    """The index grows: a client holding the first table switches with its next message, and a
    new process's reads of every cached object need no message."""
    objects = {f"o{i:03d}": payload(PAGE // 4 + i, 300 + i) for i in range(120)}
    for name, data in objects.items():
        local_store.add(name, data)
    worker = make_worker(local_store.mount, page_size=PAGE, short_circuit_handles=16, name_index_max_slots=1024)
    first = _fs(worker)
    names = list(objects)
    assert first.cat_file(f"cachefs://data/{names[0]}") == objects[names[0]]
    reader = _reader(first, worker)
    assert reader.named is not None and reader.named.slots == 16
    for name in names[1:]:
        assert first.cat_file(f"cachefs://data/{name}") == objects[name]
    _settled(worker, [f"data/{n}" for n in names], [len(d) for d in objects.values()])
    slots = worker.name_index.slots
    assert worker.name_index.grown >= 2 and slots >= 128  # 120 objects: 16 -> ... -> 128 at least
    assert reader.named.superseded or reader.named.slots == slots
    assert first.cat_file(f"cachefs://data/{names[0]}") == objects[names[0]]  # its next message: a hello
    assert reader.named is not None and reader.named.slots == slots and not reader.named.superseded

    fresh = _fs(worker, short_circuit_handles=0)  # as a new process
    assert fresh.cat_file(f"cachefs://data/{names[0]}") == objects[names[0]]
    fresh_reader = _reader(fresh, worker)
    assert fresh_reader.named is not None and fresh_reader.named.slots == slots
    messages = _count_messages(fresh_reader, monkeypatch)
    for name in names[1:]:
        assert fresh.cat_file(f"cachefs://data/{name}") == objects[name]
    assert messages == []  # every object by name
    assert fresh_reader.counts["named_hits"] >= len(names) - 1


def test_a_dataset_batch_in_a_new_process_reads_by_name(local_store, make_worker, monkeypatch):
    from cachefs.client.datasets.dataset import CacheDataset

    data = [payload(PAGE // 2, 40 + i) for i in range(24)]
    for i, d in enumerate(data):
        local_store.add(f"s/{i:03d}", d)
    worker = make_worker(local_store.mount, page_size=PAGE)
    warm = _fs(worker)
    warm.cat([f"cachefs://data/s/{i:03d}" for i in range(24)])
    _settled(worker, [f"data/s/{i:03d}" for i in range(24)], [len(d) for d in data])
    ds = CacheDataset([f"cachefs://data/s/{i:03d}" for i in range(24)],
                      storage_options={"workers": worker.address, "short_circuit_handles": 0},
                      shuffle=False, rank=0, world_size=1, plan_ahead=False, hint_samples=0)
    fs = ds._local.get().fs  # this process's: as a DataLoader worker's, new

    def hello_done() -> bool:  # the socket is set up beside the first reads; its hello brings the index
        fs.cat_file("cachefs://data/s/000")
        readers = fs.session._state.get().bulk._readers
        return worker.address in readers and readers[worker.address][0].named is not None

    assert wait_for(hello_done, timeout=30)
    reader = _reader(ds._local.get().fs, worker)
    messages = _count_messages(reader, monkeypatch)
    named = reader.counts["named_hits"]
    batch = ds.__getitems__(list(range(24)))
    assert [bytes(t.numpy()) for t in batch] == data
    assert messages == []  # the batch took no message
    assert reader.counts["named_hits"] == named + 24


def test_nothing_is_read_by_name_after_a_free_or_once_the_version_is_not_vouched_for(local_store, make_worker):
    local_store.add("obj", payload(2 * PAGE, 50))
    local_store.add("other", payload(PAGE, 51))
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=1.0, metadata_stale_grace=0)
    fs = _fs(worker, short_circuit_handles=0)
    fs.cat_file("cachefs://data/other")
    fs.cat_file("cachefs://data/obj")
    _settled(worker, ["data/obj"], [2 * PAGE])
    reader = _reader(fs, worker)
    assert fs.cat_file("cachefs://data/obj") == payload(2 * PAGE, 50)
    named = reader.counts["named_hits"]
    assert named == 2
    assert reader.named.info("data/obj")[0] == 2 * PAGE  # what open() asks first
    with grpc.insecure_channel(worker.address) as ch:
        assert worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix="data/obj"),
                                                          timeout=10).pages_freed == 2
    assert reader.named.info("data/obj") is None  # its pages are gone: not vouched for, whatever the entry says
    assert fs.cat_file("cachefs://data/obj") == payload(2 * PAGE, 50)  # the files are gone: asked the worker
    assert reader.counts["named_hits"] == named
    local_store.add("obj", payload(2 * PAGE, 52))  # a new version in the store
    # What the worker vouched for runs out with its TTL: the new bytes show within it.
    assert wait_for(lambda: fs.cat_file("cachefs://data/obj") == payload(2 * PAGE, 52), timeout=15)


def test_reads_by_name_can_be_turned_off_on_either_side(local_store, make_worker):
    local_store.add("a", payload(PAGE, 60))
    local_store.add("b", payload(PAGE, 61))
    on = make_worker(local_store.mount, page_size=PAGE)
    off = make_worker(local_store.mount, page_size=PAGE, short_circuit_by_name=False)
    assert off.name_index is None
    for worker, client_on in ((on, False), (off, True)):
        fs = _fs(worker, short_circuit_handles=0, short_circuit_by_name=client_on)
        for name in ("a", "b"):
            fs.cat_file(f"cachefs://data/{name}")
        _settled(worker, ["data/a", "data/b"], [PAGE, PAGE])
        served = _served(worker)
        assert fs.cat_file("cachefs://data/b") == payload(PAGE, 61)
        assert _served(worker) == served + PAGE  # asked the worker
        assert _reader(fs, worker).named is None


def test_under_a_plan_a_client_reading_by_name_holds_nothing(local_store, make_worker, monkeypatch):
    """A held page that leaves the cache stays charged to the quota until its holders must have
    closed it; where plans read more than the cache holds, a client that can open pages by name
    is handed what it asks for to read once (what it asks for ahead is kept for that read), then
    reads the pages by name. One that cannot still holds them, and so does every client of a
    cache that holds all the plans read."""
    from cachefs.client.datasets.dataset import CacheDataset
    from cachefs.pagefile import TRAILER_SIZE

    data = [payload(PAGE // 2, 60 + i) for i in range(12)]
    for i, d in enumerate(data):
        local_store.add(f"p/{i:03d}", d)
    urls = [f"cachefs://data/p/{i:03d}" for i in range(12)]
    # 13 pages: all 12 fit, but the plans read more than 90% of it (the cache evicts by them)
    small = make_worker(local_store.mount, page_size=PAGE, quota=13 * (PAGE + TRAILER_SIZE), max_held_fraction=0.5)
    large = make_worker(local_store.mount, page_size=PAGE)

    def dataset(worker, by_name: bool) -> CacheDataset:
        return CacheDataset(urls, storage_options={"workers": worker.address, "short_circuit_by_name": by_name},
                            shuffle=False, rank=0, world_size=1, hint_samples=0)

    ds, other, roomy = dataset(small, True), dataset(small, False), dataset(large, True)
    assert wait_for(lambda: len(small.plans) == 2 and len(large.plans) == 1, timeout=30)
    assert [bytes(t.numpy()) for t in ds.__getitems__(list(range(12)))] == data  # cold: filled
    reader = _reader(ds._local.get().fs, small)
    assert reader.named is not None
    # Read through the descriptors its prepare brought (the pages fetched for it), none kept.
    assert reader.counts["misses"] == 12 and reader.counts["named_hits"] == 0
    assert reader.handles.held() == 0
    assert [bytes(t.numpy()) for t in other.__getitems__(list(range(12)))] == data
    assert _reader(other._local.get().fs, small).handles.held() > 0  # as many as max_held_fraction allows
    messages = _count_messages(reader, monkeypatch)
    assert [bytes(t.numpy()) for t in ds.__getitems__(list(range(12)))] == data
    assert messages == [] and reader.counts["named_hits"] == 12  # by name, no message
    assert [bytes(t.numpy()) for t in roomy.__getitems__(list(range(12)))] == data
    assert _reader(roomy._local.get().fs, large).handles.held() == 12


def test_an_entry_past_its_time_is_read_within_the_stale_window_and_reported(tmp_path):
    """Past an entry's time, within the window the worker's header gives (its metadata stale
    grace), whole pages are still read by name, and the object is named for a refresh once;
    past the window, or with no window (an older worker), the worker is asked. lookup (what
    open() and info ask) never answers past the entry's time."""
    with _store_with_names(tmp_path, (1 << 20,), stale_window=30.0) as (store, index, client):
        assert client.stale_window_ns == 30 * 10**9
        data = payload(4096, 12)
        assert store.put(PageId("m", "obj", "v1", 0), data)
        now = time.monotonic()
        index.publish("m/obj", "v1", len(data), 0.0, now - 5)  # ran out 5 s ago
        assert client.lookup("m/obj") is None
        out = bytearray(len(data))
        n, size, _digests = client.read_into("m/obj", 0, memoryview(out))
        assert (n, size, bytes(out)) == (len(data), len(data), data)
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data))))[0] == len(data)
        # Reported with a message soon (not after every batch): within STALE_REPORT_SECONDS.
        assert wait_for(client.report_due, timeout=10)
        assert client.take_stale() == ["m/obj"] and client.take_stale() == []
        long_paths = {f"m/{i:04d}/" + "k" * 200 for i in range(300)}  # ~62 KiB of paths
        client._stale.update(long_paths)
        first = client.take_stale()
        assert 0 < sum(len(p) for p in first) <= 16 << 10 and len(first) < len(long_paths)
        rest = []
        while client._stale:
            rest += client.take_stale()
        assert set(first) | set(rest) == long_paths and not set(first) & set(rest)
        index.forget("m/obj")
        index.publish("m/obj", "v1", len(data), 0.0, now - 31)  # past the window too
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data)))) is None
        index.forget("m/obj")
        index.publish("m/obj", "v1", len(data), 0.0, now + 60)  # fresh: nothing to report
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data))))[0] == len(data)
        assert client.take_stale() == []
        index.clear_all()  # the worker dropped what it knew: nothing is read by name
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data)))) is None
    with _store_with_names(tmp_path / "old", (1 << 20,)) as (store, index, client):
        assert client.stale_window_ns == 0
        assert store.put(PageId("m", "obj", "v1", 0), data)
        index.publish("m/obj", "v1", len(data), 0.0, time.monotonic() - 1)
        assert client.read_into("m/obj", 0, memoryview(bytearray(len(data)))) is None


def test_read_whole_reads_within_the_stale_window_and_names_what_it_read_for_a_refresh(tmp_path):
    """A batch read whole past its entries' time (a warm epoch longer than the metadata TTL):
    within the window every sample is read and named once for a refresh; past the window none
    is (read_into then asks the worker), and nothing is named for a read that did not happen."""
    with _store_with_names(tmp_path, (1 << 20,), stale_window=30.0) as (store, index, client):
        data = {f"s{i}": payload(2000 + i, 80 + i) for i in range(3)}
        now = time.monotonic()
        for key, d in data.items():
            assert store.put(PageId("m", key, "v1", 0), d)
            index.publish(f"m/{key}", "v1", len(d), 0.0, now - 5)  # ran out 5 s ago
        keys = sorted(data)
        outs = [bytearray(len(data[k])) for k in keys]
        results = [None] * 3
        assert client.read_whole([(f"m/{k}", 0, memoryview(o)) for k, o in zip(keys, outs)], results) == 3
        assert [bytes(o) for o in outs] == [data[k] for k in keys]
        assert sorted(client.take_stale()) == [f"m/{k}" for k in keys] and client.take_stale() == []
        os.unlink(client._file(page_digest("m", "s0", "v1", 0)))  # gone: not read, not named
        index.publish("m/s1", "v1", len(data["s1"]), 1.0, now - 31)  # rewritten, past the window
        results = [None] * 3
        assert client.read_whole([(f"m/{k}", 0, memoryview(bytearray(len(data[k])))) for k in keys],
                                 results) == 1
        assert results[:2] == [None, None] and client.take_stale() == ["m/s2"]


def test_clear_all_forgets_every_entry_and_the_window_survives_growth():
    index = NameIndex(slots=4, max_slots=64, stale_window=2.5)
    try:
        far = time.monotonic() + 60
        for i in range(12):  # grows the table
            assert index.publish(f"m/o{i}", "v1", 10 + i, 0.0, far)
        assert index.grown >= 1
        client = _client(index)
        try:
            assert client.stale_window_ns == 2_500_000_000
            assert all(client.lookup(f"m/o{i}") == (10 + i, "v1", 0.0) for i in range(12))
            index.clear_all()
            assert all(client.lookup(f"m/o{i}") is None for i in range(12))
            assert index.publish("m/o1", "v1", 11, 0.0, far)  # and it is usable afterwards
            assert client.lookup("m/o1") == (11, "v1", 0.0)
        finally:
            client.close()
    finally:
        index.close()
    with pytest.raises(ValueError):
        NameIndex(slots=4, stale_window=-1)


def test_past_the_metadata_ttl_reads_by_name_go_on_and_the_worker_refreshes_what_they_name(
        local_store, make_worker, monkeypatch):
    """A worker's metadata runs out every TTL, and a training epoch is longer than that: the
    objects read by name past their entries' time (within the stale grace) are named in the
    next message, the worker refreshes them in the background (one listing for many of a
    directory), and their entries are extended: no read waits on the worker meanwhile. A new
    version found by the refresh ends reads by name of the old one; a deleted object likewise."""
    objects = {f"d/o{i}": payload(PAGE // 2 + i, 70 + i) for i in range(12)}
    for name, data in objects.items():
        local_store.add(name, data)
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=1.0, metadata_stale_grace=600)
    assert worker.name_index.stale_window == 600
    fs = _fs(worker, short_circuit_handles=0)
    for name, data in objects.items():
        assert fs.cat_file(f"cachefs://data/{name}") == data
    _settled(worker, [f"data/{n}" for n in objects], [len(d) for d in objects.values()])
    reader = _reader(fs, worker)
    named = reader.named
    assert named is not None
    assert fs.cat_file("cachefs://data/d/o0") == objects["d/o0"]  # by name now
    rest = list(objects)[1:]
    assert wait_for(lambda: all(named.lookup(f"data/{n}") is None for n in rest), timeout=30)  # TTLs ran out
    hits = reader.counts["named_hits"]
    until = {n: named._entry(f"data/{n}")[3] for n in rest}  # when each entry ran out
    for name in rest:
        assert fs.cat_file(f"cachefs://data/{name}") == objects[name]
    assert reader.counts["named_hits"] == hits + len(rest)  # every one by name
    fs.session.report_reads()  # what the reads would send with the next message, sent now
    # The worker refreshed them in the background (listed the directory, or asked each) and
    # extended their entries (each by its TTL from the refresh).
    def extended(name: str) -> bool:
        entry = named._entry(f"data/{name}")
        return entry is not None and entry[3] > until[name]
    assert wait_for(lambda: all(extended(n) for n in rest), timeout=30)

    local_store.add("d/o3", payload(PAGE // 2, 99))  # a new version in the store
    local_store.delete("d/o4")
    assert wait_for(lambda: named.lookup("data/d/o3") is None, timeout=30)  # ran out again
    for name in ("d/o3", "d/o4"):
        fs.cat_file(f"cachefs://data/{name}")  # within the window: by name (or anew, if refreshed already)
    fs.session.report_reads()
    # The refresh finds the new version (the entry cleared) and the deletion (forgotten):
    # neither is read by name again, whatever the window says.
    assert wait_for(lambda: fs.cat_file("cachefs://data/d/o3") == payload(PAGE // 2, 99), timeout=30)

    def gone() -> bool:
        try:
            fs.cat_file("cachefs://data/d/o4")
        except FileNotFoundError:
            return True
        return False
    assert wait_for(gone, timeout=30)


def _cached_samples_and_messages(local_store, make_worker, monkeypatch, seed: int) -> tuple[list[bytes], Any, list]:
    """Eight one-page samples cached by a worker, and the list every short-circuit request of
    this process is appended to from now on."""
    from cachefs.client.transport.shortcircuit import ShortCircuitReader

    data = [payload(PAGE // 2, seed + i) for i in range(8)]
    for i, d in enumerate(data):
        local_store.add(f"s/{i}", d)
    worker = make_worker(local_store.mount, page_size=PAGE)
    _fs(worker).cat([f"cachefs://data/s/{i}" for i in range(8)])
    _settled(worker, [f"data/s/{i}" for i in range(8)], [len(d) for d in data])
    sent: list = []
    exchange = ShortCircuitReader._exchange
    monkeypatch.setattr(ShortCircuitReader, "_exchange", lambda self, request, *more: (
        sent.append(request), exchange(self, request, *more))[1])
    return data, worker, sent


def test_a_new_process_prepares_a_cached_batch_with_its_hello_alone(local_store, make_worker, monkeypatch):
    """A DataLoader worker is a new process every epoch: its first batch's prepare sends one
    hello with no ranges (the name index comes with it), and the cached samples are then read by
    name, not handed over as 32 descriptors."""
    from cachefs.paths import parse_path

    data, worker, sent = _cached_samples_and_messages(local_store, make_worker, monkeypatch, 80)
    fs = _fs(worker)  # as a new process, holding handles by default
    ranges = [(parse_path(f"data/s/{i}"), 0, len(d)) for i, d in enumerate(data)]
    prepared = fs.session.prepare(ranges)
    assert (prepared.held, prepared.asked) == (8, 0)
    assert len(sent) == 1 and sent[0].hello and not sent[0].ranges
    outs = [bytearray(len(d)) for d in data]
    assert fs.session.read_held([(cp, out) for (cp, _o, _n), out in zip(ranges, outs)]) == \
        [(len(d), len(d)) for d in data]
    assert [bytes(o) for o in outs] == data and len(sent) == 1
    assert _reader(fs, worker).counts["named_hits"] == 8


def test_a_new_process_reads_its_first_cached_batch_after_a_hello_alone(local_store, make_worker, monkeypatch):
    """A DataLoader worker's first batch (every epoch): the read itself asks for the name index
    (one hello, no ranges) and reads the batch by name, with no prepare before it (no descriptors
    asked for, no page file looked for); a dataset's first batch there sends that hello only."""
    from cachefs.client.datasets.dataset import CacheDataset
    from cachefs.paths import parse_path

    data, worker, sent = _cached_samples_and_messages(local_store, make_worker, monkeypatch, 120)
    fs = _fs(worker)  # as a new process
    fs.session.bootstrap()  # its worker's lean paths known (a DataLoader worker is handed them)
    sent.clear()
    outs = [bytearray(len(d)) for d in data]
    got = fs.session.read_held([(parse_path(f"data/s/{i}"), out) for i, out in enumerate(outs)])
    assert got == [(len(d), len(d)) for d in data] and [bytes(o) for o in outs] == data
    assert len(sent) == 1 and sent[0].hello and not sent[0].ranges
    assert _reader(fs, worker).counts["named_hits"] == 8

    ds = CacheDataset([f"cachefs://data/s/{i}" for i in range(8)], storage_options={"workers": worker.address},
                      shuffle=False, rank=0, world_size=1, plan_ahead=False, hint_samples=0)
    ds._local.get().fs.session.bootstrap()
    sent.clear()
    batch = ds.__getitems__(list(range(8)))
    assert [bytes(t.numpy()) for t in batch] == data
    assert len(sent) == 1 and sent[0].hello and not sent[0].ranges


def test_a_failed_hello_is_asked_again_only_after_a_while(local_store, make_worker, monkeypatch):
    from cachefs.client.transport import shortcircuit
    from cachefs.paths import parse_path

    data = payload(PAGE // 2, 7)
    local_store.add("s/0", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    _fs(worker).cat_file("cachefs://data/s/0")
    _settled(worker, ["data/s/0"], [len(data)])
    fs = _fs(worker)
    fs.session.bootstrap()
    reader = _reader(fs, worker)
    real, calls = reader._request, []

    def refused(*args, **kwargs):  # the socket is away (a worker restarting)
        calls.append(args)
        raise ConnectionRefusedError("no worker on the socket")

    monkeypatch.setattr(reader, "_request", refused)
    now = [1000.0]
    monkeypatch.setattr(shortcircuit.time, "monotonic", lambda: now[0])
    out = bytearray(len(data))
    for _ in range(3):
        assert fs.session.read_held([(parse_path("data/s/0"), out)]) == [None]  # read another way
    assert len(calls) == 1
    now[0] += shortcircuit.HELLO_RETRY
    monkeypatch.setattr(reader, "_request", real)
    assert fs.session.read_held([(parse_path("data/s/0"), out)]) == [(len(data), len(data))]
    assert bytes(out) == data and reader.named is not None


def test_a_worker_that_offers_no_index_gets_one_hello_not_one_a_batch(local_store, make_worker, monkeypatch):
    from cachefs.paths import parse_path

    data = payload(PAGE // 2, 8)
    local_store.add("s/0", data)
    worker = make_worker(local_store.mount, page_size=PAGE, short_circuit_by_name=False)
    _fs(worker).cat_file("cachefs://data/s/0")
    fs = _fs(worker)
    fs.session.bootstrap()
    sent = _count_messages(_reader(fs, worker), monkeypatch)
    out = bytearray(len(data))
    for _ in range(3):
        fs.session.read_held([(parse_path("data/s/0"), out)])
    assert len([m for m in sent if m.hello]) == 1 and _reader(fs, worker).named is None


def test_freeing_one_data_set_leaves_the_others_readable_by_name(local_store, make_worker, monkeypatch):
    """A free deletes the pages under its prefix (so nothing of it is read by name) and leaves
    every other object's entry alone: a benchmark freeing one data set before its cold epoch
    made the next warm epoch of another ask the worker for every batch."""
    for i in range(4):
        local_store.add(f"a/{i}", payload(PAGE // 2, 90 + i))
        local_store.add(f"b/{i}", payload(PAGE // 2, 95 + i))
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker, short_circuit_handles=0)
    names = [f"{d}/{i}" for d in "ab" for i in range(4)]
    for name in names:
        fs.cat_file(f"cachefs://data/{name}")
    _settled(worker, [f"data/{n}" for n in names], [PAGE // 2] * len(names))
    reader = _reader(fs, worker)
    assert all(reader.named.lookup(f"data/{n}") is not None for n in names)
    with grpc.insecure_channel(worker.address) as ch:
        assert worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix="data/a/"),
                                                          timeout=10).pages_freed == 4
    messages = _count_messages(reader, monkeypatch)
    hits = reader.counts["named_hits"]
    assert [fs.cat_file(f"cachefs://data/b/{i}") for i in range(4)] == [payload(PAGE // 2, 95 + i) for i in range(4)]
    assert messages == [] and reader.counts["named_hits"] == hits + 4
    assert fs.cat_file("cachefs://data/a/0") == payload(PAGE // 2, 90)  # its pages are gone: asked the worker
    assert reader.counts["named_hits"] == hits + 4 and len(messages) >= 1


def test_large_reads_hold_descriptors_and_fall_back_to_names_where_holds_are_refused(local_store, make_worker,
                                                                                   monkeypatch):
    """A range of many pages is read through descriptors held from the worker (one message,
    then one preadv a page on every later read) rather than opening each page file by name
    every time; a small one still by name. Where the worker will not let the client hold the
    pages, the path is read by name from then on."""
    from cachefs.client.transport.shortcircuit import HOLD_RANGE_PAGES

    big = payload((HOLD_RANGE_PAGES + 2) * PAGE + 123, 71)
    small = payload(2 * PAGE, 72)
    other = payload((HOLD_RANGE_PAGES + 1) * PAGE, 73)
    for name, data in (("big", big), ("small", small), ("other", other)):
        local_store.add(name, data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    warm = _fs(worker)
    for name, data in (("big", big), ("small", small), ("other", other)):
        assert warm.cat_file(f"cachefs://data/{name}") == data
    _settled(worker, ["data/big", "data/small", "data/other"], [len(big), len(small), len(other)])

    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/small") == small  # the hello: the index and the handle table
    reader = _reader(fs, worker)
    assert reader.named is not None
    messages = _count_messages(reader, monkeypatch)
    held, named = reader.handles.held(), reader.counts["named_hits"]
    out = bytearray(len(big))
    assert fs.read_into("cachefs://data/big", out) == (len(big), len(big)) and bytes(out) == big
    assert len(messages) == 1 and reader.handles.held() == held + HOLD_RANGE_PAGES + 3
    hits = reader.counts["hits"]
    out2 = bytearray(len(big))
    assert fs.read_into("cachefs://data/big", out2) == (len(big), len(big)) and bytes(out2) == big
    assert fs.cat_file("cachefs://data/big", 7, 5 * PAGE) == big[7:5 * PAGE]  # fewer pages: held already
    assert len(messages) == 1  # no message after the first
    assert reader.counts["hits"] == hits + HOLD_RANGE_PAGES + 3 + 5  # through the held descriptors
    assert reader.counts["named_hits"] == named

    monkeypatch.setattr(worker.pages, "held_bytes", lambda: 1 << 60)  # its holds at their bound
    held = reader.handles.held()
    out3 = bytearray(len(other))
    assert fs.read_into("cachefs://data/other", out3) == (len(other), len(other)) and bytes(out3) == other
    assert len(messages) == 2 and reader.handles.held() == held  # read once, not kept
    assert fs.read_into("cachefs://data/other", out3) == (len(other), len(other)) and bytes(out3) == other
    assert len(messages) == 2 and reader.counts["named_hits"] == named + HOLD_RANGE_PAGES + 1  # by name


def _child_reads_and_exits(fs, paths: list[str], conn) -> None:
    try:
        sizes = [len(fs.cat_file(p)) for p in paths]
        conn.send((sizes, fs.session.counters()["named_hits"]))
    finally:  # then returns: nothing closed, as a DataLoader worker
        conn.close()


def test_a_dataloader_worker_s_reads_by_name_reach_the_worker_as_it_exits(local_store, make_worker):
    """A DataLoader worker reads its epoch by name (no message a read), then exits without
    closing anything. What it read still reaches the worker: its pages' reads (recency, hit
    counters) and the objects it read past their entries' time, which the worker then refreshes
    (else the next epoch finds them run out and must wait for the store)."""
    import multiprocessing

    from cachefs.paths import parse_path

    objects = {f"o{i}": payload(PAGE // 2 + i, 90 + i) for i in range(6)}
    for name, data in objects.items():
        local_store.add(name, data)
    worker = make_worker(local_store.mount, page_size=PAGE, metadata_ttl=1.0, metadata_stale_grace=600)
    fs = _fs(worker, short_circuit_handles=0)
    for name, data in objects.items():
        assert fs.cat_file(f"cachefs://data/{name}") == data
    _settled(worker, [f"data/{n}" for n in objects], [len(d) for d in objects.values()])
    cps = [parse_path(f"data/{n}") for n in objects]
    assert wait_for(lambda: not any(worker.objects._fresh(cp) for cp in cps), timeout=30)  # past the TTL
    before = _named_reads(worker)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_reads_and_exits, args=(fs, [f"cachefs://data/{n}" for n in objects], child_end))
    proc.start()
    child_end.close()
    try:
        assert parent_end.poll(60), "the child did not read in 60 s"
        sizes, by_name = parent_end.recv()
        assert sizes == [len(d) for d in objects.values()]
        assert by_name >= len(objects) - 1  # (the first may come with the hello's request)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    # Each page read by name in the child, reported as it exited, not lost with it
    assert wait_for(lambda: _named_reads(worker) == before + by_name, timeout=30)
    # ... and the objects it read past their time refreshed (a listing or a HEAD each)
    assert wait_for(lambda: all(worker.objects._fresh(cp) for cp in cps), timeout=30)


def test_the_exit_report_gives_up_on_a_worker_that_never_answers(tmp_path):
    """An exiting process never waits long on a hung worker: the report is dropped at its deadline."""
    import socket
    import weakref

    from cachefs.client.transport import shortcircuit

    path = str(tmp_path / "hung.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(4)  # connections queue; nothing reads them
    reader = shortcircuit.ShortCircuitReader(path)
    try:
        reader.handles._touched.append(1)  # a read through a held handle, not reported yet
        started = time.monotonic()
        shortcircuit._report_at_exit(weakref.ref(reader))  # what runs at exit: logs, never raises
        assert time.monotonic() - started < shortcircuit.EXIT_REPORT_TIMEOUT + 5
        assert reader.handles.touched_pending() == 0  # taken for the report, not sent twice
    finally:
        reader.close()
        server.close()
