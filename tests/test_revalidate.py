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
from cachefs.store.revalidate import LIST_MIN_STALE, Revalidator, parent_of
from helpers import payload, wait_for


def _expired(objects: ObjectStore, paths: list[CachePath]) -> bool:
    return not any(objects._fresh(p) for p in paths)


def test_many_expired_objects_of_a_directory_are_refreshed_by_one_listing(s3_store):
    n = 40
    for i in range(n):
        s3_store.add(f"p/o{i:03d}.bin", payload(100 + i, i))
    objects = ObjectStore(MountTable([s3_store.mount]), metadata_ttl=0.3, stale_grace=600)
    paths = [e.path for e in objects.list(CachePath("data", "p"))]
    assert len(paths) == n
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
