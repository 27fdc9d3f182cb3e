"""Index rows written behind (server/pagestore/rows.py): real files, real SQLite, a real killed process.

A page is served once its file is in place; its row reaches the index in a later batch. What must
hold: a removed page's row is never written after its removal (nor left once both reached the
index), a clean close writes every row, a crash loses at most the unwritten pages (recovery
removes their files, and a stale row, if any, and the bytes accounting matches the files), an
index error drops the batch's pages and never stops the flush thread, and the queue is bounded.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading

import diskcache
import pytest

import cachefs.server.pagestore.rows as rows
import cachefs.server.pagestore.store as store_module
from cachefs.server.pagestore import CacheDir, PageStore
from helpers import wait_for
from test_pagestore import FILE, PAGE, disk_bytes, page_file, payload, pid

NEVER = 3600.0  # a row delay no test waits out: rows reach the index only when the test flushes


def open_store(path, quota: int = 64 * FILE, **kw) -> PageStore:
    return PageStore([CacheDir(str(path), quota)], page_size=PAGE, **kw)


def index_rows(root) -> set[str]:
    """The digests the on-disk index holds (read with the store closed, before any recovery)."""
    with diskcache.Cache(os.path.join(str(root), "index")) as idx:
        return set(idx.iterkeys())


def test_rows_are_written_behind_and_a_clean_close_writes_them_all(tmp_path):
    s = open_store(tmp_path, row_delay=NEVER)
    try:
        for i in range(5):
            assert s.put(pid(i), payload(i))
        assert s.get(pid(3)) == payload(3)  # served before its row is written
        assert s.stats().index_pending == 5
        assert s._dirs[0].index is not None and len(s._dirs[0].index) == 0
    finally:
        s.close()
    assert index_rows(tmp_path) == {pid(i).digest() for i in range(5)}
    with open_store(tmp_path) as s:
        assert s.stats().pages == 5 and s.stats().used_bytes == disk_bytes(tmp_path) == 5 * FILE
        assert all(s.get(pid(i)) == payload(i) for i in range(5))


def test_rows_gather_and_are_flushed_by_the_thread(tmp_path):
    with open_store(tmp_path, row_delay=0.02) as s:
        for i in range(3):
            s.put(pid(i), payload(i))
        assert wait_for(lambda: s.stats().index_pending == 0, timeout=20)
        assert set(s._dirs[0].index.iterkeys()) == {pid(i).digest() for i in range(3)}


def test_page_removed_before_its_row_is_flushed_gets_no_row(tmp_path):
    # quota of 3 pages: page 1 deleted, page 0 evicted, before any row is written
    s = open_store(tmp_path, quota=3 * FILE, row_delay=NEVER)
    kept = {pid(i).digest() for i in (2, 3, 4)}
    try:
        for i in range(3):
            s.put(pid(i), payload(i))
        assert s.delete(pid(1))
        assert s.put(pid(3), payload(3))
        assert s.put(pid(4), payload(4))  # evicts page 0 (least recently used)
        assert not s.contains(pid(0)) and not s.contains(pid(1)) and s.stats().evictions == 1
        s._flush_rows()
        assert set(s._dirs[0].index.iterkeys()) == kept
    finally:
        s.close()
    assert index_rows(tmp_path) == kept


def test_row_taken_by_a_flush_then_its_page_removed_is_deleted_after(tmp_path, monkeypatch):
    """The race: a flush has taken page 0's row (the page was READY) and is writing it when the
    page is deleted. The deletion is queued behind it and written by the next batch."""
    writing, release = threading.Event(), threading.Event()
    real = rows.RowQueue._write

    def slow_write(d, batch):
        writing.set()
        assert release.wait(10)
        real(d, batch)

    s = open_store(tmp_path, row_delay=NEVER)
    try:
        s.put(pid(0), payload(0))
        s.put(pid(1), payload(1))
        monkeypatch.setattr(rows.RowQueue, "_write", staticmethod(slow_write))
        flusher = threading.Thread(target=s._flush_rows)
        flusher.start()
        assert writing.wait(10)
        assert s.delete(pid(0))  # its file is gone now; its row is being written
        assert s.stats().index_pending == 3  # two rows being written, one deletion queued
        release.set()
        flusher.join(10)
        assert pid(0).digest() in s._dirs[0].index  # written after the removal ...
        s._flush_rows()
        assert set(s._dirs[0].index.iterkeys()) == {pid(1).digest()}  # ... and deleted behind it
    finally:
        release.set()
        s.close()
    assert index_rows(tmp_path) == {pid(1).digest()}


def test_concurrent_puts_deletes_and_evictions_leave_rows_matching_files(tmp_path):
    """Every interleaving of removals with flushes: after a clean close, rows == page files."""
    size = 1000 + FILE - PAGE  # a 1000-byte page's file
    s = open_store(tmp_path, quota=12 * size, row_delay=0.002, batch_rows=4, max_rows=16)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for n in range(150):
                i = (seed * 7 + n * 5) % 40
                if n % 4 == 3:
                    s.delete(pid(i))
                else:
                    s.put(pid(i), payload(i, 1000))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert s.stats().evictions > 0
        cached = {pid(i).digest() for i in range(40) if s.contains(pid(i))}
    finally:
        s.close()
    files = {name for _, _, names in os.walk(os.path.join(tmp_path, "pages")) for name in names}
    assert index_rows(tmp_path) == files == cached
    with open_store(tmp_path, quota=12 * size) as s2:
        assert s2.stats().pages == len(files)
        assert s2.stats().used_bytes == disk_bytes(tmp_path) == len(files) * size


_CRASH = r"""
import sys
from cachefs.server.pagestore import CacheDir, PageId, PageStore
root, page = sys.argv[1], int(sys.argv[2])
s = PageStore([CacheDir(root, 64 * (page + 32))], page_size=page, row_delay=3600)
pid = lambda i: PageId("data", "obj", "v1", i)
for i in range(3):
    assert s.put(pid(i), bytes([i]) * page)
assert s._flush_rows() == 3    # pages 0-2: rows committed
assert s.delete(pid(0))        # file unlinked, row deletion queued only
assert s.put(pid(3), b"\x03" * page)  # file renamed into place, row queued only
print(s.stats().index_pending, flush=True)
sys.stdin.read()               # killed here
"""


def test_worker_killed_between_rename_and_flush_recovers_consistent_state(tmp_path):
    """kill -9 with a page whose row is queued (an orphan file) and a removed page whose row
    deletion is queued (a stale row): recovery removes both, bytes match the files."""
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, str(tmp_path), str(PAGE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "2"
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -9
    assert os.path.exists(page_file(tmp_path, pid(3)))  # the orphan
    assert not os.path.exists(page_file(tmp_path, pid(0)))
    assert index_rows(tmp_path) == {pid(i).digest() for i in range(3)}  # the stale row of page 0
    with open_store(tmp_path) as s:
        assert s.stats().pages == 3  # the stale row is trusted until its page is read (#47)
        assert s.get(pid(0)) is None and s.get(pid(3)) is None  # lost with the crash: a miss
        assert s.sweeper.wait(30)  # the orphan goes in the background: no clean-stop mark
        st = s.stats()
        assert st.pages == 2 and st.used_bytes == disk_bytes(tmp_path) == 2 * FILE
        assert s.get(pid(1)) == b"\x01" * PAGE and s.get(pid(2)) == b"\x02" * PAGE
        assert not os.path.exists(page_file(tmp_path, pid(3)))
        assert s.put(pid(3), b"\x03" * PAGE) and s.get(pid(3)) == b"\x03" * PAGE
    assert index_rows(tmp_path) == {pid(i).digest() for i in (1, 2, 3)}


class _FailingIndex:
    """The dir's index whose transactions fail as a full disk or a broken database make them."""

    def __init__(self, real: diskcache.Cache, exc: BaseException) -> None:
        self._real, self._exc = real, exc

    def transact(self):
        raise self._exc

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("exc", [sqlite3.OperationalError("database or disk is full"),
                                 OSError(28, "No space left on device")])
def test_index_error_while_flushing_drops_the_batch_pages(tmp_path, exc):
    s = open_store(tmp_path, row_delay=NEVER)
    d = s._dirs[0]
    real = d.index
    try:
        s.put(pid(0), payload(0))
        s._flush_rows()
        s.put(pid(1), payload(1))
        s.put(pid(2), payload(2))
        d.index = _FailingIndex(real, exc)
        assert s._flush_rows() == 0
        st = s.stats()
        assert st.degraded and st.disk_errors == 1 and st.put_failures == 2
        assert s.get(pid(1)) is None and s.get(pid(2)) is None
        assert s.get(pid(0)) == payload(0)
        assert st.pages == 1 and st.used_bytes == disk_bytes(tmp_path) == FILE
        d.index = real
        assert s.put(pid(3), payload(3)) and not s.stats().degraded  # a written page clears it
        assert s._flusher.is_alive()
    finally:
        d.index = real
        s.close()
    assert index_rows(tmp_path) == {pid(0).digest(), pid(3).digest()}


def test_flush_thread_survives_an_unexpected_error(tmp_path, monkeypatch):
    failures = []
    real = rows.RowQueue._write

    def fail_once(d, batch):
        if not failures:
            failures.append(batch)
            raise RuntimeError("boom")
        real(d, batch)

    monkeypatch.setattr(rows.RowQueue, "_write", staticmethod(fail_once))
    with open_store(tmp_path, row_delay=0.01, flush_interval=0.05) as s:
        s.put(pid(0), payload(0))
        assert wait_for(lambda: failures and s.stats().index_pending == 0, timeout=20)
        s.put(pid(1), payload(1))
        assert wait_for(lambda: pid(1).digest() in s._dirs[0].index, timeout=20)
        assert s._flusher.is_alive()
        assert s.get(pid(0)) == payload(0)  # still served: its row is lost, not its file


def test_queue_is_bounded_a_put_flushes_when_the_thread_falls_behind(tmp_path):
    s = open_store(tmp_path, row_delay=NEVER, batch_rows=4, max_rows=4)
    try:
        seen = []
        for i in range(12):
            assert s.put(pid(i), payload(i))
            seen.append(s.stats().index_pending)
        assert max(seen) < 4 and s._rows.flushes >= 3
        assert set(s._dirs[0].index.iterkeys()) >= {pid(i).digest() for i in range(8)}
    finally:
        s.close()
    assert index_rows(tmp_path) == {pid(i).digest() for i in range(12)}


def test_bad_queue_settings_are_refused(tmp_path):
    with pytest.raises(ValueError):
        open_store(tmp_path, batch_rows=10, max_rows=5)
    with pytest.raises(ValueError):
        open_store(tmp_path / "b", row_delay=0)


def test_a_page_read_before_its_row_is_written_costs_one_index_write(tmp_path):
    """A cold page is read right after its put: its queued row carries the read's access time,
    so the access flush does not write the row a second time. A read after the row was taken
    is flushed as before (no granularity here: every read's time is due)."""
    s = open_store(tmp_path, row_delay=NEVER, access_granularity=0)
    try:
        s.put(pid(0), payload(0))
        s.put(pid(1), payload(1))
        put_time = s._entries[pid(0).digest()].last_access
        assert s.get(pid(0)) == payload(0)
        touched = s._entries[pid(0).digest()].last_access
        assert touched > put_time and not s._dirty  # nothing for the access flush
        s._flush_rows()
        idx = s._dirs[0].index
        assert idx.get(pid(0).digest())[6] == touched > idx.get(pid(1).digest())[6]
        assert s.get(pid(1)) == payload(1)  # row written: this read is an access update
        assert list(s._dirty) == [pid(1).digest()]
        s._flush_access()
        assert idx.get(pid(1).digest())[6] == s._entries[pid(1).digest()].last_access > touched
    finally:
        s.close()
