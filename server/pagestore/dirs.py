"""One cache directory on disk: its exclusive lock, layout, durable index and debris cleanup.

Layout (dirs 0o700, files 0o600)::

    <root>/lock                          flock(LOCK_EX|LOCK_NB) held while a PageStore has it open
    <root>/store.json                    {"format": 1, "page_size": N}: pages of another page
                                         size cover other byte ranges, so a change empties the dir
    <root>/pages/<digest[:2]>/<digest>   page files (see pagefile.py)
    <root>/tmp/<digest>.<pid>-<n>.tmp    pages being written; another process's are leftovers
                                         (removed in the background after a start: sweep.py)
    <root>/clean                         written by a clean close once every row is committed;
                                         taken (removed) at the next start: its absence means an
                                         unclean stop, so orphan page files are swept (sweep.py)
    <root>/index/                        diskcache: digest -> (mount, key, version, index,
                                         file_size, checksum, last_access)

Index settings, measured on this machine (2 cores, ext4 on virtio; medians of 300-2000 ops):

    diskcache.set, small tuple   WAL+synchronous=NORMAL 25 us | WAL+OFF 25 us | WAL+FULL 164 us
                                 DELETE journal+NORMAL 626 us | DELETE journal+OFF 59 us
    diskcache.delete             WAL+NORMAL 19 us
    batched last_access flush    16 us/page (one transaction, contains + set)
    recovery scan                7 us/entry (iterkeys + get); one streamed SELECT: less (performance.md #47)
    1 MiB page file write+rename 2,650 us (3,490 us with fsync)
    diskcache.set, 1 MiB value   2,290 us
    xxh3_64 over 1 MiB           18.5 us (~57 GB/s)

Chosen: ``eviction_policy="none"`` (the page store evicts, not diskcache), ``sqlite_journal_mode=
"wal"``, ``sqlite_synchronous=1`` (NORMAL): as cheap as OFF here (~1% of a page write), and unlike
OFF the database stays consistent after an OS crash; the last commits NORMAL may lose on power
loss only turn pages into orphans, which recovery removes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import shutil
import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import diskcache

from cachefs.pagenames import PAGES_SUBDIR, dir_score, page_file
from cachefs.runtimedir import private_dir
from cachefs.server.pagestore.policy import EvictionOrder, LruOrder

__all__ = ["INDEX_ERRORS", "CacheDirInUseError", "DirHandle", "IndexReset", "remove_path"]

log = logging.getLogger(__name__)

INDEX_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
INDEX_SETTINGS: dict[str, Any] = {
    "eviction_policy": "none",
    "cull_limit": 0,  # nothing expires: no search for expired rows on every set (92 -> 75 us a set here)
    "sqlite_journal_mode": "wal",
    "sqlite_synchronous": 1,
    "statistics": 0,
    "tag_index": 0,
    "timeout": 10,  # seconds sqlite waits on a busy database before diskcache.Timeout
}


def _private_index(path: str) -> None:
    """The index names every cached object: 0o700 dir, 0o600 database (SQLite gives -wal/-shm its mode)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    db = os.path.join(path, diskcache.core.DBNAME)
    os.close(os.open(db, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600))
    for name in (db, db + "-wal", db + "-shm"):  # an index made before this rule
        if os.path.exists(name):
            os.chmod(name, 0o600)


class IndexReset(Exception):
    """The index was unreadable while scanned and has been replaced by an empty one."""


class CacheDirInUseError(RuntimeError):
    """Another PageStore (in this or another process) holds the cache dir's lock file."""


class DirHandle:
    """An open, locked cache dir plus its in-memory accounting (guarded by the store's lock)."""

    def __init__(self, root: str, quota: int, page_size: int, order: EvictionOrder | None = None) -> None:
        self.root = root
        self.quota = quota
        self.pages = os.path.join(root, PAGES_SUBDIR)
        self.tmp = os.path.join(root, "tmp")
        self.used = 0  # bytes of READY + WRITING + not-yet-released REMOVING pages
        self.reset = False  # the index was emptied this run: every page file is an orphan
        self.order: EvictionOrder = order if order is not None else LruOrder()  # READY pages
        private_dir(root)  # ours, not a symlink; refused if another user made it (cachefs/runtimedir.py)
        lock_path = os.path.join(root, "lock")
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise CacheDirInUseError(
                f"cache dir {root} is in use by another process (lock {lock_path} is held)"
            ) from None
        try:
            for sub in (self.pages, self.tmp):
                os.makedirs(sub, mode=0o700, exist_ok=True)
            for i in range(256):
                fan = os.path.join(self.pages, f"{i:02x}")
                if os.path.lexists(fan) and not os.path.isdir(fan):
                    os.unlink(fan)
                os.makedirs(fan, mode=0o700, exist_ok=True)
            same = self._same_layout(page_size)
            self.index: diskcache.Cache | None = self._open_index(reset=not same)
            if not same:  # only after the old index is gone, so a crash cannot revive its pages
                self._write_layout(page_size)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def page_path(self, digest: str) -> str:
        return page_file(self.root, digest)

    def score(self, digest: str) -> float:
        """Weighted rendezvous score: the dir with the highest score holds the page (pagenames.py)."""
        return dir_score(digest, self.root, self.quota)

    def _layout(self, page_size: int) -> tuple[str, dict[str, int]]:
        return os.path.join(self.root, "store.json"), {"format": 1, "page_size": page_size}

    def _same_layout(self, page_size: int) -> bool:
        """False if the dir may hold pages of another size or format (they must not be served)."""
        path, want = self._layout(page_size)
        try:
            with open(path, encoding="utf-8") as f:
                if json.load(f) == want:
                    return True
            log.warning("cache dir %s holds pages of another size or format; emptying it", self.root)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s); emptying the cache dir", path, exc)
        return False

    def _write_layout(self, page_size: int) -> None:
        path, want = self._layout(page_size)
        tmp = f"{path}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(want, f)
        os.replace(tmp, path)

    def _open_index(self, reset: bool = False) -> diskcache.Cache:
        path = os.path.join(self.root, "index")
        if reset:
            self.reset = True
            shutil.rmtree(path, ignore_errors=True)
        _private_index(path)
        try:
            return diskcache.Cache(path, **INDEX_SETTINGS)
        except sqlite3.DatabaseError as exc:
            if reset:
                raise
            log.warning("page index %s is unreadable (%s); starting empty", path, exc)
            return self._open_index(reset=True)

    def scan_index(self) -> Iterator[tuple[str, object]]:
        """Every (digest, record) pair, streamed by one SELECT (no per-key lookup, no list of a
        million rows). An unreadable index is replaced by an empty one and IndexReset raised:
        what was yielded must then be discarded (its pages become orphans, swept later)."""
        index = self.index
        assert index is not None
        try:
            cursor = index._sql("SELECT key, raw, mode, filename, value FROM Cache")
            disk = index.disk
            while batch := cursor.fetchmany(4096):
                for key, raw, mode, filename, value in batch:
                    if raw and mode == diskcache.core.MODE_PICKLE and value is not None and type(key) is str:
                        yield key, pickle.loads(value)  # what disk.get/fetch do, without their copies
                    else:
                        yield disk.get(key, raw), disk.fetch(mode, filename, value, False)
        except (sqlite3.DatabaseError, pickle.UnpicklingError, EOFError, OSError) as exc:
            log.warning("page index in %s is unreadable (%s); starting empty", self.root, exc)
            index.close()
            self.index = self._open_index(reset=True)
            raise IndexReset(self.root) from exc

    def row_count(self) -> int:
        """How many rows the index holds (one COUNT: ~0.05 s at a million rows); 0 if unreadable."""
        assert self.index is not None
        try:
            return int(self.index._sql("SELECT COUNT(*) FROM Cache").fetchone()[0])
        except sqlite3.DatabaseError:
            return 0

    def take_clean_mark(self) -> bool:
        """True if the last run closed cleanly (every row committed, no debris left); the mark is
        removed at once, durably, so a crash of this run reads as unclean at the next start."""
        path = os.path.join(self.root, "clean")
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return not self.reset

    def mark_clean(self) -> None:
        """Record a clean stop (close(): rows committed, the orphan sweep done or not needed)."""
        path = os.path.join(self.root, "clean")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
        except OSError as exc:  # the next start sweeps for orphans: slower, never wrong
            log.warning("cannot mark %s cleanly closed: %s", self.root, exc)

    def close(self) -> None:
        """Close the index and release the lock. Idempotent."""
        if self.index is not None:
            try:
                self.index.close()
            except INDEX_ERRORS as exc:
                log.warning("cannot close page index in %s: %s", self.root, exc)
            self.index = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1


def remove_path(path: str) -> None:
    """Remove a file (or a stray directory) during cleanup, logging instead of raising."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
