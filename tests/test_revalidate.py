"""Background revalidation of expired metadata: many objects of a directory by one listing."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

import pytest

from cachefs.mounts import MountTable
from cachefs.paths import CachePath
from cachefs.priority import BACKGROUND_NICE
from cachefs.store.objects import ObjectStore
from cachefs.store.revalidate import LIST_MIN_STALE, LIST_OBJECTS_PER_STALE, SYNC_LIST_MAX, Revalidator, parent_of
from helpers import payload, store_requests, wait_for


def _expired(objects: ObjectStore, paths: list[CachePath]) -> bool:
    return not any(objects._fresh(p) for p in paths)


def _listed_directory(s3_store, n: int, **settings) -> tuple[ObjectStore, list[CachePath]]:
    """``n`` objects of one directory in moto, listed once by a new ObjectStore (its metadata
    known, the directory's size too)."""
    for i in range(n):
        s3_store.add(f"p/o{i:03d}.bin", payload(100 + i, i))
    objects = ObjectStore(MountTable([s3_store.mount]), **settings)
    paths = [e.path for e in objects.list(CachePath("data", "p"))]
    assert len(paths) == n
    return objects, paths


def test_many_expired_objects_of_a_directory_are_refreshed_by_one_listing(s3_store):
    n = 40
    objects, paths = _listed_directory(s3_store, n, metadata_ttl=0.3, stale_grace=600)
    versions = {p: objects.cached_info(p).version for p in paths}
    s3_store.add("p/o005.bin", payload(200, 99))  # changed meanwhile: the refresh must see it
    s3_store.delete("p/o007.bin")  # deleted meanwhile: not listed, asked for alone, found gone
    assert wait_for(lambda: _expired(objects, paths), timeout=30)
    requests: Counter[str] = Counter()
    objects.on_request = lambda kind: requests.update([kind])
    for p in paths:  # reads past the TTL: served from the old entry, refreshed behind
        assert objects.cached_info_until(p) is not None
    gone = CachePath("data", "p/o007.bin")
    live = [p for p in paths if p != gone]
    assert wait_for(lambda: all(objects._fresh(p) for p in live) and objects.revalidator.waiting() == 0, timeout=30)
    assert requests["list"] >= 1, requests
    assert requests["info"] < n // 2, requests  # a HEAD each would be 40
    assert objects.revalidator.stats["refreshed_by_listing"] >= n // 2
    assert objects.cached_info(CachePath("data", "p/o005.bin")).size == 200
    assert objects.cached_info(CachePath("data", "p/o005.bin")).version != versions[CachePath("data", "p/o005.bin")]
    assert objects.cached_info(gone) is None  # the HEAD found it gone


class _Fakes:
    """A directory of objects behind the revalidator's three callbacks, held at a gate so that
    every submission is in before any decision is made."""

    def __init__(self, names: list[str]) -> None:
        self.listed = {CachePath("m", f"d/{name}") for name in names}
        self.gate = threading.Event()
        self.one: list[CachePath] = []
        self.lists: list[CachePath] = []
        self.fresh: set[CachePath] = set()
        self.lock = threading.Lock()

    def refresh_one(self, path: CachePath) -> None:
        with self.lock:
            self.one.append(path)
            self.fresh.add(path)

    def list_dir(self, directory: CachePath) -> set[CachePath]:
        with self.lock:
            self.lists.append(directory)
            self.fresh |= self.listed
        return set(self.listed)

    def is_fresh(self, path: CachePath) -> bool:
        assert self.gate.wait(30)
        with self.lock:
            return path in self.fresh


def _run(fakes: _Fakes, wanted: list[CachePath], dir_size: int | None) -> Revalidator:
    reval = Revalidator(fakes.refresh_one, fakes.list_dir, fakes.is_fresh)
    if dir_size is not None:
        reval.note_listing(CachePath("m", "d"), dir_size)
    for path in wanted:
        reval.submit(path)
        reval.submit(path)  # twice: one refresh
    fakes.gate.set()
    assert wait_for(lambda: reval.waiting() == 0, timeout=30)
    reval.close()
    return reval


def test_a_directory_of_known_size_is_listed_once_and_an_unlisted_object_asked_alone():
    names = [f"o{i}" for i in range(20)]
    fakes = _Fakes(names)
    wanted = [CachePath("m", f"d/{n}") for n in names] + [CachePath("m", "d/new")]  # "new": not listed
    reval = _run(fakes, wanted, dir_size=20)
    assert fakes.lists == [CachePath("m", "d")]
    assert fakes.one == [CachePath("m", "d/new")]
    assert reval.stats["refreshed_by_listing"] == 20


@pytest.mark.parametrize("waiting, dir_size", [
    (LIST_MIN_STALE - 1, LIST_MIN_STALE - 1),  # too few waiting
    (2 * LIST_MIN_STALE, None),  # a directory never listed: its size unknown
    (2 * LIST_MIN_STALE, 1_000_000),  # many waiting in a huge directory
])
def test_few_waiting_an_unknown_or_a_large_directory_get_one_request_each(waiting, dir_size):
    names = [f"o{i}" for i in range(waiting)]
    fakes = _Fakes(names)
    wanted = [CachePath("m", f"d/{n}") for n in names]
    _run(fakes, wanted, dir_size=dir_size)
    assert fakes.lists == []
    assert sorted(fakes.one, key=str) == sorted(wanted, key=str)


@pytest.mark.parametrize("dir_size", [20, None], ids=["listed-once", "asked-alone"])
def test_a_report_of_many_objects_queues_a_task_a_directory_worth_listing(dir_size, monkeypatch):
    """A client's report of objects read past their time (submit_many): the objects of a
    directory one listing refreshes go to the pool as one task, not a task each; those of a
    directory not worth listing keep a task each (asked alone, as many at once as threads)."""
    names = [f"o{i}" for i in range(20)]
    fakes = _Fakes(names)
    wanted = [CachePath("m", f"d/{n}") for n in names] + [CachePath("m", "d/new")]
    reval = Revalidator(fakes.refresh_one, fakes.list_dir, fakes.is_fresh)
    if dir_size is not None:
        reval.note_listing(CachePath("m", "d"), dir_size)
    tasks: list[int] = []
    pool = reval._ensure_pool()
    submit = pool.submit
    monkeypatch.setattr(pool, "submit",
                        lambda fn, paths, *rest: (tasks.append(len(paths)), submit(fn, paths, *rest))[1])
    reval.submit_many(wanted + wanted[:3])  # named twice: refreshed once
    fakes.gate.set()
    assert wait_for(lambda: reval.waiting() == 0, timeout=30)
    reval.close()
    if dir_size is None:
        assert tasks == [1] * 21 and fakes.lists == [] and len(fakes.one) == 21
    else:
        assert tasks == [21] and fakes.lists == [CachePath("m", "d")] and fakes.one == [CachePath("m", "d/new")]
        assert reval.stats["refreshed_by_listing"] == 20


def test_a_failed_listing_leaves_no_object_waiting():
    names = [f"o{i}" for i in range(20)]
    fakes = _Fakes(names)

    def broken(directory: CachePath) -> set[CachePath]:
        with fakes.lock:
            fakes.lists.append(directory)
        raise ConnectionError("listing refused")

    fakes.list_dir = broken  # type: ignore[method-assign]
    wanted = [CachePath("m", f"d/{n}") for n in names]
    _run(fakes, wanted, dir_size=20)
    assert fakes.lists  # tried
    assert sorted(set(fakes.one), key=str) == sorted(wanted, key=str)  # then each on its own


def _past_grace(objects: ObjectStore, paths: list[CachePath]) -> bool:
    return all(objects._meta.get_with_expiry(p) is None for p in paths)


def test_reads_past_the_grace_wait_for_one_listing_instead_of_a_head_each(s3_store):
    """An epoch longer than TTL + grace: nothing is left to serve from. After a few HEADs, one
    listing refreshes the directory; a change and a deletion in the store are still seen."""
    objects, paths = _listed_directory(s3_store, 40, metadata_ttl=2.0, stale_grace=0.5)
    s3_store.add("p/o030.bin", payload(300, 99))  # changed meanwhile
    s3_store.delete("p/o031.bin")  # deleted meanwhile
    assert wait_for(lambda: _past_grace(objects, paths), timeout=30)
    requests: Counter[str] = Counter()
    objects.on_request = lambda kind: requests.update([kind])
    for p in paths:
        if p.key == "p/o031.bin":
            with pytest.raises(FileNotFoundError):
                objects.info(p)
        else:
            assert objects.info(p).size == (300 if p.key == "p/o030.bin" else 100 + int(p.key[3:6]))
    assert requests["list"] == 1, requests
    assert requests["info"] <= LIST_MIN_STALE, requests  # the first few alone, and the deleted one
    assert objects.revalidator.stats["expired_by_listing"] == 1  # the read that listed; the rest found it fresh


def _expired_fakes(names: list[str], dir_size: int | None) -> tuple[_Fakes, Revalidator]:
    fakes = _Fakes(names)
    fakes.gate.set()
    reval = Revalidator(fakes.refresh_one, fakes.list_dir, fakes.is_fresh, relist_after=0)
    if dir_size is not None:
        reval.note_listing(CachePath("m", "d"), dir_size)
    return fakes, reval


def test_a_run_out_directory_is_listed_once_enough_reads_found_it_run_out():
    names = [f"o{i}" for i in range(20)]
    fakes, reval = _expired_fakes(names, dir_size=20)
    try:
        paths = [CachePath("m", f"d/{n}") for n in names]
        got = [reval.refresh_expired(p) for p in paths[:LIST_MIN_STALE]]
        assert got == [False] * (LIST_MIN_STALE - 1) + [True]  # the first ones ask alone; then one listing
        assert fakes.lists == [CachePath("m", "d")]
        assert all(reval.refresh_expired(p) is False for p in [CachePath("m", "d/new")])  # counts anew
        assert fakes.lists == [CachePath("m", "d")] and fakes.one == []
    finally:
        reval.close()


def test_reads_that_find_a_listing_under_way_wait_for_it():
    names = [f"o{i}" for i in range(20)]
    fakes = _Fakes(names)
    fakes.gate.set()
    release = threading.Event()

    def slow_list(directory: CachePath) -> set[CachePath]:
        assert release.wait(30)
        return fakes.list_dir(directory)

    reval = Revalidator(fakes.refresh_one, slow_list, fakes.is_fresh, relist_after=0)
    reval.note_listing(CachePath("m", "d"), 20)
    paths = [CachePath("m", f"d/{n}") for n in names]
    try:
        for p in paths[:LIST_MIN_STALE - 1]:
            assert reval.refresh_expired(p) is False
        results: dict[CachePath, bool] = {}

        def read(p: CachePath) -> None:
            results[p] = reval.refresh_expired(p)

        lister = threading.Thread(target=read, args=(paths[LIST_MIN_STALE - 1],))
        lister.start()
        assert wait_for(lambda: CachePath("m", "d") in reval._listing, timeout=30)
        waiters = [threading.Thread(target=read, args=(p,)) for p in paths[LIST_MIN_STALE:]]
        for t in waiters:
            t.start()
        release.set()
        for t in [lister, *waiters]:
            t.join(30)
            assert not t.is_alive()
        assert fakes.lists == [CachePath("m", "d")]  # one listing for all of them
        assert all(results[p] for p in paths[LIST_MIN_STALE - 1:])
        assert fakes.one == []
    finally:
        release.set()
        reval.close()


def test_a_directory_listed_within_the_ttl_is_not_listed_again_for_objects_it_did_not_have():
    """Reads of objects a fresh listing did not find (missing, or new since) ask alone: a loop of
    ``exists()`` over missing names must not list the directory every few calls."""
    now = [100.0]
    fakes = _Fakes([f"o{i}" for i in range(20)])
    fakes.gate.set()
    reval = Revalidator(fakes.refresh_one, fakes.list_dir, fakes.is_fresh, relist_after=30.0, clock=lambda: now[0])
    try:
        reval.note_listing(CachePath("m", "d"), 20)
        missing = [CachePath("m", f"d/missing{i}") for i in range(4 * LIST_MIN_STALE)]
        assert not any(reval.refresh_expired(p) for p in missing)
        assert fakes.lists == []
        now[0] += 31.0  # the listing is as old as the TTL: what runs out now is listed again
        assert [reval.refresh_expired(p) for p in missing[:LIST_MIN_STALE]] == [False] * LIST_MIN_STALE
        assert fakes.lists == [CachePath("m", "d")]  # (the fakes' listing does not note its size)
    finally:
        reval.close()


def test_run_out_reads_of_an_unlisted_directory_ask_alone_and_leave_nothing_behind():
    fakes, reval = _expired_fakes([f"o{i}" for i in range(50)], dir_size=None)
    try:
        assert not any(reval.refresh_expired(CachePath("m", f"d/o{i}")) for i in range(50))
        assert fakes.lists == [] and reval._expired == {}
    finally:
        reval.close()


def test_a_directory_too_large_to_wait_for_is_listed_behind_the_reads():
    size = 2 * SYNC_LIST_MAX
    fakes, reval = _expired_fakes(["o0"], dir_size=size)
    try:
        needed = -(-size // LIST_OBJECTS_PER_STALE)
        got = [reval.refresh_expired(CachePath("m", f"d/x{i}")) for i in range(needed)]
        assert got == [False] * needed  # every one asks alone ...
        assert wait_for(lambda: fakes.lists == [CachePath("m", "d")], timeout=30)  # ... and one listing ran behind
        assert wait_for(lambda: CachePath("m", "d") not in reval._listing, timeout=30)
    finally:
        reval.close()


def test_a_failed_listing_sends_the_run_out_reads_to_the_store_alone():
    names = [f"o{i}" for i in range(20)]
    fakes, reval = _expired_fakes(names, dir_size=20)

    def broken(directory: CachePath) -> set[CachePath]:
        with fakes.lock:
            fakes.lists.append(directory)
        raise ConnectionError("listing refused")

    reval._list_dir = broken  # type: ignore[method-assign]
    try:
        got = [reval.refresh_expired(CachePath("m", f"d/{n}")) for n in names[:LIST_MIN_STALE]]
        assert got == [False] * LIST_MIN_STALE and fakes.lists == [CachePath("m", "d")]
        assert reval._listing == {}
    finally:
        reval.close()


def test_a_warm_epoch_longer_than_ttl_and_grace_lists_the_directory_not_a_head_per_object(s3_store, make_worker):
    """End to end (a worker, a client reading through it): the second pass over a cached
    directory comes after its metadata ran out entirely, as every epoch longer than TTL + grace
    does; it is served from the cache with one listing, not a store request per object."""
    from cachefs.client.fs.filesystem import CacheFileSystem

    objects = {f"d/o{i:02d}": payload(1000 + i, 40 + i) for i in range(24)}
    for name, data in objects.items():
        s3_store.add(name, data)
    worker = make_worker(s3_store.mount, metadata_ttl=1.0, metadata_stale_grace=0.5)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True)
    try:
        assert len(fs.ls("cachefs://data/d")) == len(objects)  # as a dataset's listing: the directory's size known
        for name, data in objects.items():
            assert fs.cat_file(f"cachefs://data/{name}") == data
        paths = [CachePath("data", n) for n in objects]
        assert wait_for(lambda: _past_grace(worker.objects, paths), timeout=30)
        before = store_requests(worker)
        for name, data in objects.items():
            assert fs.cat_file(f"cachefs://data/{name}") == data
        sent = store_requests(worker) - before
        assert sent["list"] == 1, sent
        assert sent["info"] <= LIST_MIN_STALE - 1, sent  # the first few before the listing
        assert sent["open"] == sent["read"] == 0, sent  # the bytes came from the cache
    finally:
        fs.close()


def test_parent_of():
    assert parent_of(CachePath("m", "a/b/c.bin")) == CachePath("m", "a/b")
    assert parent_of(CachePath("m", "top.bin")) == CachePath("m", "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_refreshes_run_below_the_priority_of_the_threads_that_serve_reads():
    """Nothing waits on a refresh (the stale entry serves meanwhile): its threads yield the CPU."""
    seen: list[int] = []
    done = threading.Event()

    def refresh_one(path: CachePath) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        done.set()

    reval = Revalidator(refresh_one, lambda directory: set(), lambda path: False)
    try:
        reval.submit(CachePath("m", "d/x"))
        assert done.wait(30)
    finally:
        reval.close()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(19, mine + BACKGROUND_NICE)]


def test_the_queue_is_bounded_and_what_is_past_the_bound_is_asked_again_at_its_next_read():
    """#46: a million objects that ran out at once queue ``max_waiting`` refreshes, not a million;
    past the bound a refresh is dropped (counted), and offered again by the object's next read."""
    from cachefs.store.revalidate import MAX_WAITING

    assert Revalidator(lambda p: None, lambda d: set(), lambda p: False).max_waiting == MAX_WAITING == 10_000
    release, refreshed = threading.Event(), []

    def refresh_one(path: CachePath) -> None:
        release.wait(30)  # the store is slow: nothing leaves the queue meanwhile
        refreshed.append(path)

    reval = Revalidator(refresh_one, lambda d: set(), lambda p: False, threads=1, max_waiting=1_000)
    paths = [CachePath("m", f"d{i // 1000:04d}/o{i:07d}") for i in range(200_000)]
    for p in paths:
        reval.submit(p)
    assert reval.waiting() == 1_000 and reval.stats["dropped"] == 199_000
    assert reval._pool._work_queue.qsize() <= 1_000  # the pool's queue too, not 200,000 calls
    reval.submit(paths[5])  # already waiting: neither queued again nor dropped
    assert reval.waiting() == 1_000 and reval.stats["dropped"] == 199_000
    release.set()
    assert wait_for(lambda: reval.waiting() == 0, timeout=30)
    assert sorted(refreshed, key=str) == sorted(paths[:1_000], key=str)
    reval.submit(paths[-1])  # room again: its next read queues it
    assert wait_for(lambda: paths[-1] in refreshed, timeout=30) and reval.waiting() == 0
    reval.close()
