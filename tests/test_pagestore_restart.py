"""A restart that trusts the page index (#47): no stat or open per page at start, bad pages dropped
on their first read, debris swept in the background, and a kill -9 mid-write serving only right bytes.

Unit tests open the store in this process (real files, real SQLite); the worker tests run real
worker processes on a local-directory mount.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cachefs.local import worker_process
from cachefs.server.pagestore import CacheDir, PageStore
from cachefs.server.pagestore.sweep import Sweeper
from helpers import client, payload as object_bytes, scrape, wait_for
from test_pagestore import FILE, PAGE, disk_bytes, page_file, payload, pid

N = 300


def open_store(path, quota: int = 2 * N * FILE) -> PageStore:
    return PageStore([CacheDir(str(path), quota)], page_size=PAGE)


class _Counting:
    """Counts calls of an ``os`` function on a page file (``pages/<fan>/<name>``) or, for the
    listing functions, on a fan-out dir (``pages/<fan>``): what costs per page, not per dir."""

    def __init__(self, real, pages: str, depth: int) -> None:
        self.real, self.pages, self.depth, self.calls = real, pages, depth, 0

    def __call__(self, path, *args, **kw):
        if isinstance(path, (str, os.PathLike)):
            rel = os.path.relpath(os.fspath(path), self.pages)
            if not rel.startswith("..") and rel.count(os.sep) + 1 == self.depth:
                self.calls += 1
        return self.real(path, *args, **kw)


@pytest.mark.parametrize("clean", [True, False])
def test_restart_touches_no_page_file(tmp_path, monkeypatch, clean):
    """Opening a store of N pages stats, opens and lists no page file (the old recovery stat'ed
    every one and listed every fan-out dir before serving), after a clean or an unclean stop."""
    with open_store(tmp_path) as s:
        for i in range(N):
            assert s.put(pid(i), payload(i, 100))
        assert s.sweeper.wait(30)  # a new dir is swept once (no mark yet): done, so close marks it clean
    if not clean:
        os.unlink(tmp_path / "clean")
    pages = str(tmp_path / "pages")
    counters = {name: _Counting(getattr(os, name), pages, 2) for name in ("stat", "lstat", "open")}
    counters |= {name: _Counting(getattr(os, name), pages, 1) for name in ("listdir", "scandir")}
    for name, counter in counters.items():
        monkeypatch.setattr(os, name, counter)
    monkeypatch.setattr(Sweeper, "start", lambda self: None)  # started below, once the count is taken
    s = open_store(tmp_path)
    try:
        opened = {name: c.calls for name, c in counters.items()}
        monkeypatch.undo()
        assert opened == dict.fromkeys(counters, 0)
        Sweeper.start(s.sweeper)
        assert s.stats().pages == N and s.stats().used_bytes == N * (100 + FILE - PAGE)
        assert s.get(pid(7)) == payload(7, 100)
        assert s.sweeper.wait(30)
        assert s.stats().pages == N and disk_bytes(tmp_path) == N * (100 + FILE - PAGE)
    finally:
        s.close()


def test_debris_is_swept_in_the_background_only_after_an_unclean_stop(tmp_path):
    with open_store(tmp_path) as s:
        for i in range(3):
            s.put(pid(i), payload(i))
        assert s.sweeper.wait(30)
    assert os.path.exists(tmp_path / "clean")
    orphan = page_file(tmp_path, pid(50))
    Path(orphan).write_bytes(b"renamed, never indexed")
    torn = tmp_path / "tmp" / f"{pid(51).digest()}.1-0.tmp"
    torn.write_bytes(b"torn")
    with open_store(tmp_path) as s:  # a clean stop: tmp files go, page files are trusted
        assert not os.path.exists(tmp_path / "clean")  # taken at start: a crash now reads as unclean
        assert s.sweeper.wait(30)
        assert not torn.exists() and os.path.exists(orphan)
        assert (s.sweeper.tmp_removed, s.sweeper.orphans_removed) == (1, 0)
        s._dirs[0].mark_clean = lambda: None  # close as a kill -9 would: no mark
    torn.write_bytes(b"torn")
    with open_store(tmp_path) as s:
        assert s.stats().pages == 3  # served while the sweep runs
        assert s.sweeper.wait(30)
        assert not torn.exists() and not os.path.exists(orphan)
        assert (s.sweeper.tmp_removed, s.sweeper.orphans_removed) == (1, 1)
        assert disk_bytes(tmp_path) == s.stats().used_bytes == 3 * FILE
        assert [s.get(pid(i)) == payload(i) for i in range(3)] == [True] * 3
    assert os.path.exists(tmp_path / "clean")


def test_sweep_never_unlinks_a_page_being_put(tmp_path):
    """A put racing the orphan sweep of its own name: either the put is refused (the name is
    claimed) or its file survives; a page the store holds is never left without its file."""
    with open_store(tmp_path) as s:
        s._dirs[0].mark_clean = lambda: None
        for i in range(N):
            Path(page_file(tmp_path, pid(i))).write_bytes(b"orphan")  # every page an orphan first
    with open_store(tmp_path) as s:
        done = threading.Event()

        def put_all() -> None:
            while not done.is_set():
                for i in range(N):
                    s.put(pid(i), payload(i, 64))
                if s.sweeper.done.is_set():
                    done.set()

        t = threading.Thread(target=put_all)
        t.start()
        assert s.sweeper.wait(60)
        t.join(60)
        assert not t.is_alive()
        for i in range(N):
            assert s.get(pid(i)) in (None, payload(i, 64))
            if s.contains(pid(i)):
                assert os.path.getsize(page_file(tmp_path, pid(i))) == 64 + FILE - PAGE


def test_reads_are_served_while_the_index_loads_behind(tmp_path, monkeypatch):
    """A large index loads behind (here forced, and held until the test lets it go): a read loads
    its page's row ahead of the loader, a put waits for the quota's use to be known, and pages
    removed meanwhile (one by one, by prefix, dropped on a bad read) do not come back with it."""
    small = 100 + FILE - PAGE
    with open_store(tmp_path) as s:
        for i in range(N):
            assert s.put(pid(i), payload(i, 100))
        for i in range(5):
            assert s.put(pid(i, key="gone/x"), payload(i, 100))
        assert s.sweeper.wait(30)
    release = threading.Event()
    real = PageStore._recover

    def held(self, d):
        assert release.wait(30)
        return real(self, d)

    monkeypatch.setattr(PageStore, "_recover", held)
    s = PageStore([CacheDir(str(tmp_path), 2 * N * FILE)], page_size=PAGE, background_load_rows=0)
    try:
        assert not s.loaded.is_set() and s.stats().pages == 0
        assert s.get(pid(3)) == payload(3, 100)  # its row read on its own
        assert s.contains(pid(4)) and s.holds_object("data", "anything")  # may hold: metadata only
        assert not s.put(pid(N), payload(N, 100))  # nothing added until the quota's use is known
        assert s.delete(pid(5))  # loaded, then removed for good
        assert s.delete_prefix("data", "gone/") == 0  # none loaded yet: the loader drops them
        os.unlink(page_file(tmp_path, pid(6)))
        assert s.get(pid(6)) is None  # dropped on its first read
        release.set()
        assert s.loaded.wait(30)
        st = s.stats()
        assert st.pages == N - 2 and st.used_bytes == (N - 2) * small
        assert not s.contains(pid(5)) and not s.contains(pid(6))
        assert not any(s.contains(pid(i, key="gone/x")) for i in range(5))
        assert not any(os.path.exists(page_file(tmp_path, pid(i, key="gone/x"))) for i in range(5))
        assert s.get(pid(7)) == payload(7, 100)
        assert s.put(pid(N), payload(N, 100))
        assert s.sweeper.wait(30)
        assert disk_bytes(tmp_path) == s.stats().used_bytes == (N - 1) * small
    finally:
        s.close()
    monkeypatch.undo()
    with open_store(tmp_path) as s:  # the index followed: the removed pages' rows are gone
        assert s.stats().pages == N - 1
        assert s.get(pid(N)) == payload(N, 100) and s.get(pid(5)) is None


# ----------------------------------------------------------------------- worker processes
WPAGE = 64 << 10


def _worker(local_store, cache: Path, log: Path):
    return worker_process({"data": local_store.mount.url}, str(cache),
                          extra=["--page-size", str(WPAGE), "--metadata-ttl", "3600"], log_path=str(log))


def test_page_deleted_or_corrupted_while_down_is_dropped_on_first_read_and_refetched(local_store, tmp_path):
    objects = {f"o{i}.bin": object_bytes(WPAGE, 10 + i) for i in range(4)}  # one page each
    for key, data in objects.items():
        local_store.add(key, data)
    cache = tmp_path / "cache"
    with _worker(local_store, cache, tmp_path / "w1.log") as w1:
        fs = client(w1.address)
        assert all(fs.cat_file(f"data/{k}") == d for k, d in objects.items())
    files = sorted(p for p in (cache / "pages").rglob("*") if p.is_file())
    assert len(files) == 4
    files[0].unlink()  # gone while the worker was down
    raw = bytearray(files[1].read_bytes())
    raw[100] ^= 0xFF  # a flipped bit: the size is right, the checksum is not
    files[1].write_bytes(bytes(raw))
    with _worker(local_store, cache, tmp_path / "w2.log") as w2:
        m = scrape(w2.ready["metrics_port"])
        assert m["cachefs_worker_cache_pages"] == 4  # trusted at start: no file was looked at
        fs = client(w2.address)
        assert all(fs.cat_file(f"data/{k}") == d for k, d in objects.items())
        m = scrape(w2.ready["metrics_port"])
        assert m["cachefs_worker_bytes_from_store_total"] == 2 * WPAGE  # the two bad pages, refetched
        assert m["cachefs_worker_cache_corrupt_pages_total"] == 2  # dropped on their first read
        # The refetched pages are written behind the reads that fetched them.
        assert wait_for(lambda: scrape(w2.ready["metrics_port"])["cachefs_worker_cache_pages"] == 4, timeout=30)
        assert all(fs.cat_file(f"data/{k}") == d for k, d in objects.items())  # and now cached again
        assert scrape(w2.ready["metrics_port"])["cachefs_worker_bytes_from_store_total"] == 2 * WPAGE


def test_worker_killed_mid_write_restarts_serving_only_right_bytes(local_store, tmp_path):
    """kill -9 while cold reads fill the cache: the restarted worker serves every object's right
    bytes, and once its background sweep is done the page files are exactly its pages."""
    objects = {f"k{i}.bin": object_bytes(3 * WPAGE + 17 * i, 100 + i) for i in range(40)}
    for key, data in objects.items():
        local_store.add(key, data)
    cache = tmp_path / "cache"
    w1 = _worker(local_store, cache, tmp_path / "w1.log")
    with w1:
        fs = client(w1.address)
        errors: list[BaseException] = []
        started = threading.Event()

        def read_all() -> None:
            for key in objects:
                try:
                    fs.cat_file(f"data/{key}")
                    started.set()
                except Exception as exc:  # noqa: BLE001 - the kill cuts reads off
                    errors.append(exc)
                    return

        t = threading.Thread(target=read_all)
        t.start()
        assert started.wait(60)
        assert wait_for(lambda: scrape(w1.ready["metrics_port"])["cachefs_worker_cache_pages"] >= 20, timeout=60)
        w1.kill()  # mid-fill: pages written, rows queued, tmp files open
        t.join(60)
        assert not t.is_alive()
    assert not (cache / "pages" / "clean").exists() and not (cache / "clean").exists()
    with _worker(local_store, cache, tmp_path / "w2.log") as w2:
        fs = client(w2.address)
        for _ in range(2):  # the first pass drops and refetches what the crash broke, the second is warm
            assert all(fs.cat_file(f"data/{k}") == d for k, d in objects.items())
        pages = sum(-(-len(d) // WPAGE) for d in objects.values())

        def files_are_pages() -> bool:
            on_disk = sum(1 for p in (cache / "pages").rglob("*") if p.is_file())
            return on_disk == scrape(w2.ready["metrics_port"])["cachefs_worker_cache_pages"] == pages

        assert wait_for(files_are_pages, timeout=30)
        assert wait_for(lambda: not any((cache / "tmp").iterdir()), timeout=30)  # swept in the background
