"""The worker's object-store adapter against real stores: versions, one-GET opens, stale reads."""

from __future__ import annotations

import pytest

from cachefs.errors import StaleObjectError
from cachefs.mounts import MountTable
from cachefs.paths import CachePath
from cachefs.store.objects import ObjectStore, TTLCache
from helpers import payload


def test_version_is_stable_and_changes_with_the_object(store):
    store.add("a.bin", payload(1000, 1))
    objects = ObjectStore(MountTable([store.mount]), metadata_ttl=0)
    v1 = objects.info(CachePath("data", "a.bin")).version
    assert v1 and objects.info(CachePath("data", "a.bin")).version == v1
    store.add("a.bin", payload(1000, 2))  # same size, new content
    assert objects.info(CachePath("data", "a.bin")).version != v1


def test_read_of_a_changed_object_is_refused(store):
    store.add("a.bin", payload(5000, 1))
    objects = ObjectStore(MountTable([store.mount]), metadata_ttl=60)
    meta = objects.info(CachePath("data", "a.bin"))
    assert objects.read(meta, 10, 20) == store.objects["a.bin"][10:20]
    store.add("a.bin", payload(5000, 2))
    with pytest.raises(StaleObjectError):
        objects.read(meta, 10, 20)


def test_open_brings_metadata_and_first_bytes_in_one_request_on_s3(s3_store):
    data = payload(300_000, 3)
    s3_store.add("d/obj.bin", data)
    s3_store.add("d/empty.bin", b"")
    objects = ObjectStore(MountTable([s3_store.mount]), metadata_ttl=60)
    meta, head = objects.open(CachePath("data", "d/obj.bin"), 65536)
    assert (meta.size, meta.is_dir) == (len(data), False)
    assert head == data[:65536]
    assert meta.version == objects.info(CachePath("data", "d/obj.bin"), refresh=True).version
    meta, head = objects.open(CachePath("data", "d/obj.bin"), 65536)
    assert head is None  # metadata cached: nothing fetched
    meta, head = objects.open(CachePath("data", "d/empty.bin"), 65536)
    assert (meta.size, head) == (0, None)
    meta, head = objects.open(CachePath("data", "d"), 65536)
    assert meta.is_dir and head is None
    with pytest.raises(FileNotFoundError):
        objects.open(CachePath("data", "d/missing.bin"), 65536)


def test_listing_fills_the_metadata_cache(store):
    for i in range(5):
        store.add(f"p/o{i}.bin", payload(10 + i, i))
    objects = ObjectStore(MountTable([store.mount]), metadata_ttl=60)
    entries = objects.list(CachePath("data", "p"))
    assert [e.path.key for e in entries] == [f"p/o{i}.bin" for i in range(5)]
    assert [e.size for e in entries] == [10, 11, 12, 13, 14]
    for entry in entries:
        assert objects.info(entry.path).version == entry.version
    found = objects.list(CachePath("data", ""), recursive=True)
    assert [e.path.key for e in found] == [f"p/o{i}.bin" for i in range(5)]


def test_ttl_cache_expires_and_stays_bounded():
    now = [0.0]
    cache: TTLCache[str, int] = TTLCache(ttl=10, max_entries=3, clock=lambda: now[0])
    for i in range(5):
        cache.put(str(i), i)
    assert [cache.get(str(i)) for i in range(5)] == [None, None, 2, 3, 4]
    now[0] = 10.5
    assert cache.get("4") is None


def test_concurrent_opens_of_one_cold_object_share_one_request(s3_store):
    """A read and a hinted load opening the same cold object at once: one GET, the head bytes
    adopted once, every caller the same metadata (a cold epoch fetched ~20% twice before)."""
    import threading

    from helpers import wait_for

    data = payload(200_000, 4)
    s3_store.add("d/shared.bin", data)
    objects = ObjectStore(MountTable([s3_store.mount]), metadata_ttl=60)
    requests: list[str] = []
    objects.on_request = requests.append
    path, callers = CachePath("data", "d/shared.bin"), 6
    adopted: list[bytes] = []

    def adopt(meta, head) -> bool:  # the first caller's: the others are all waiting on it by now
        assert wait_for(lambda: objects.opens_joined == callers - 1, timeout=30)
        adopted.append(head)
        return True

    results: list[tuple] = []
    threads = [threading.Thread(target=lambda: results.append(objects.open(path, 65536, adopt=adopt)))
               for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert requests == ["open"] and adopted == [data[:65536]]
    assert len(results) == callers and len({(m.size, m.version) for m, _ in results}) == 1
    assert sorted(head is not None for _, head in results) == [False] * (callers - 1) + [True]
    assert objects._opening == {}


def test_a_failed_shared_open_fails_every_caller_and_leaves_nothing_behind(s3_store):
    objects = ObjectStore(MountTable([s3_store.mount]), metadata_ttl=60)
    with pytest.raises(FileNotFoundError):
        objects.open(CachePath("data", "d/nothing.bin"), 65536, adopt=lambda meta, head: True)
    assert objects._opening == {}
