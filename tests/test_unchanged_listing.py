"""A directory listed again unchanged (#46): what the last listing of it made (metadata rows,
name entries) is extended at once, not made again object by object, and only where nothing
was written since; a listing that differs, or an entry written meanwhile, takes the full path.
"""

from __future__ import annotations

import os
import time

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import CachePath
from cachefs.store.listed import ListedEntries, Relisted
from cachefs.store.meta import ObjectMeta
from cachefs.store.metatable import MetadataTable
from cachefs.store.objects import ObjectStore
from cachefs.server.worker.names import NameIndex
from helpers import FakeClock, payload, wait_for
from test_named_pages import _client

ROWS = [(f"d/o{i}", 10 + i, None, 1.5 + i, False) for i in range(5)]


def _entries(rows=ROWS) -> ListedEntries:
    out = ListedEntries("m")
    for key, size, version, mtime, is_dir in rows:
        out.add(key, size, version, mtime, is_dir)
    return out


def test_the_digest_tells_listings_apart_by_every_field():
    base = _entries().digest()
    assert _entries().digest() == base
    changed = [
        [(k, s + (i == 2), v, m, d) for i, (k, s, v, m, d) in enumerate(ROWS)],  # a size
        [(k, s, v, m + (i == 2) * 1e-6, d) for i, (k, s, v, m, d) in enumerate(ROWS)],  # an mtime
        [(k, s, "etag" if i == 2 else v, m, d) for i, (k, s, v, m, d) in enumerate(ROWS)],  # a version
        ROWS[:4],  # one gone
        ROWS + [("d/o9", 1, None, 1.0, False)],  # one more
        [(k + "x" if i == 4 else k, s, v, m, d) for i, (k, s, v, m, d) in enumerate(ROWS)],  # a name
    ]
    assert len({_entries(rows).digest() for rows in changed} | {base}) == len(changed) + 1


def test_the_metadata_of_a_listing_is_extended_while_no_row_was_put_since():
    clock = FakeClock()
    table = MetadataTable(10, clock=clock)
    table.put_rows("m", ROWS, ("d", False), b"one")
    paths = [CachePath("m", key) for key, *_ in ROWS]
    first = [table.get_with_expiry(p)[1] for p in paths]
    clock.now += 5
    assert not table.extend_listed(("d", False), b"two")  # another listing's digest
    assert not table.extend_listed(("e", False), b"one")  # a listing never kept
    assert [table.get_with_expiry(p)[1] for p in paths] == first
    assert table.extend_listed(("d", False), b"one")
    assert [table.get_with_expiry(p)[1] for p in paths] == [e + 5 for e in first]
    clock.now += 5
    assert table.extend_listed(("d", False), b"one")  # again
    # A row put again with the same fields (a HEAD's refresh): still as the listing left it.
    table.put(paths[1], table.get(paths[1]))
    assert table.extend_listed(("d", False), b"one")
    # One row put again since (a HEAD found the object changed): no longer the listing's.
    clock.now += 1
    table.put(paths[2], ObjectMeta(paths[2], 99, "other", 7.0))
    clock.now += 1
    assert not table.extend_listed(("d", False), b"one")
    assert table.get(paths[2]).version == "other"
    # Dropped and put back: another row or another expiry, so not the listing's either.
    table.put_rows("m", ROWS, ("d", False), b"one")
    table.pop(paths[0])
    table.put(paths[0], ObjectMeta(paths[0], 10, "10-1.5", 1.5))
    clock.now += 1
    assert not table.extend_listed(("d", False), b"one")


def test_name_entries_of_a_listing_are_extended_while_none_was_written_since():
    index = NameIndex(slots=64)
    client = _client(index)
    try:
        soon = time.monotonic() + 0.2
        objects = [(f"m/d/o{i}", f"v{i}", i + 1, 0.0) for i in range(6)]
        for path, version, size, mtime in objects:
            assert index.publish(path, version, size, mtime, soon)
        # The listing says o5 changed: its entry goes; the others are kept for the listing.
        listed = objects[:5] + [("m/d/o5", "v5-new", 6, 0.0)]
        index.refreshed_many(listed, soon, ("d", False), b"one")
        assert client.lookup("m/d/o5") is None
        assert not index.extend_listed(("d", False), b"two", time.monotonic() + 60)
        assert index.extend_listed(("d", False), b"one", time.monotonic() + 60)
        assert index.extended == 5
        assert wait_for(lambda: time.monotonic() > soon, timeout=5)
        assert [client.lookup(p) for p, *_ in objects[:5]] == [(s, v, m) for _, v, s, m in objects[:5]]
        assert client.lookup("m/d/o5") is None  # not brought back by the extend
        # Extended one by one meanwhile (a report of a read past its time; a read through the
        # worker publishing the same version): still as the listing left them.
        index.refreshed("m/d/o3", "v3", 4, 0.0, time.monotonic() + 90)
        assert index.publish("m/d/o4", "v4", 5, 0.0, time.monotonic() + 100)
        assert index.extend_listed(("d", False), b"one", time.monotonic() + 60)
        # An entry published again since (another version): the listing's entries are not all
        # as it left them, so nothing is extended.
        assert index.publish("m/d/o1", "v1-other", 2, 0.0, time.monotonic() + 60)
        assert not index.extend_listed(("d", False), b"one", time.monotonic() + 120)
        assert client.lookup("m/d/o1") == (2, "v1-other", 0.0)
    finally:
        client.close()
        index.close()


def test_name_entries_of_a_listing_are_not_extended_in_a_table_that_grew():
    index = NameIndex(slots=8, max_slots=64)
    try:
        far = time.monotonic() + 60
        objects = [(f"m/d/o{i}", "v", 1, 0.0) for i in range(4)]
        for path, version, size, mtime in objects:
            index.publish(path, version, size, mtime, far)
        index.refreshed_many(objects, far, ("d", False), b"one")
        for i in range(40):  # fills the table: it grows, and the entries move
            index.publish(f"m/other/{i}", "v", 1, 0.0, far)
        assert index.grown >= 1
        assert not index.extend_listed(("d", False), b"one", far + 60)
    finally:
        index.close()


def _store(tmp_path, n: int = 6):
    root = tmp_path / "store"
    (root / "d").mkdir(parents=True)
    for i in range(n):
        (root / "d" / f"o{i}").write_bytes(payload(100 + i, i))
    objects = ObjectStore(MountTable([MountSpec("data", str(root))]), metadata_ttl=30)
    heard: list[Relisted | None] = []
    objects.on_listed = lambda entries, keys, relisted: heard.append(relisted)
    return root, objects, heard


def test_an_object_store_lists_a_directory_again_unchanged_and_sees_a_change(tmp_path):
    root, objects, heard = _store(tmp_path)
    directory = CachePath("data", "d")
    objects.list(directory, refresh=True)
    objects.list(directory, refresh=True)
    assert [r.unchanged for r in heard] == [False, True]
    assert heard[0].digest == heard[1].digest and heard[0].listing == (directory, False)
    # A change of one object's bytes (and mtime): the next listing is not the same.
    target = root / "d" / "o3"
    stat = target.stat()
    target.write_bytes(payload(200, 9))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000))
    objects.list(directory, refresh=True)
    assert heard[-1].unchanged is False and heard[-1].digest != heard[0].digest
    assert objects.cached_info(CachePath("data", "d/o3")).size == 200
    objects.list(directory, refresh=True)
    assert heard[-1].unchanged is True


def test_a_worker_extends_names_of_an_unchanged_directory_and_never_serves_a_version_seen_in_between(
        tmp_path, make_worker):
    """End to end, in-process: refreshes of an unchanged directory extend its name entries at
    once; an object that changed and changed back (its old bytes and mtime again) after a read
    in between saw the other version is checked one by one, so no entry vouches for the version
    seen in between."""
    root = tmp_path / "store"
    (root / "d").mkdir(parents=True)
    data = {f"d/o{i}": payload(300 + i, i) for i in range(8)}
    for key, value in data.items():
        (root / key).write_bytes(value)
    worker = make_worker(MountSpec("data", str(root)), metadata_ttl=0.5, metadata_stale_grace=0.2)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True)
    try:
        for key, value in data.items():
            assert fs.cat_file(f"cachefs://data/{key}") == value
        directory = CachePath("data", "d")
        worker.objects.list(directory, refresh=True)  # kept for next time
        before = worker.name_index.extended
        worker.objects.list(directory, refresh=True)
        assert worker.name_index.extended - before == len(data)
        # o2 changes to B (same size) and is read through the worker (B's metadata fetched and
        # published), then changes back to A: its bytes and its mtime.
        target = root / "d" / "o2"
        stat = target.stat()
        other = payload(302, 77)
        target.write_bytes(other)
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 7_000_000))
        assert wait_for(lambda: fs.cat_file("cachefs://data/d/o2") == other, timeout=30)
        target.write_bytes(data["d/o2"])
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        worker.objects.list(directory, refresh=True)  # the same digest as the kept listing
        meta = worker.objects.cached_info(CachePath("data", "d/o2"))
        assert meta is not None and meta.mtime == target.stat().st_mtime == stat.st_mtime, meta
        assert wait_for(lambda: fs.cat_file("cachefs://data/d/o2") == data["d/o2"], timeout=30)
    finally:
        fs.close()
