"""Held page handles: the client's side of server/worker/handles.py (HDFS's ShortCircuitCache).

A short-circuit reply hands over page file descriptors; this process keeps those it is allowed to
(a slot in the worker's shared table) and reads them again with no message to the worker while

* the slot still holds the generation the page came with (the worker bumps it before it unlinks
  the page file: evicted, freed, corrupt, or the slot reassigned);
* the table's heartbeat is fresh and its state is "serving" (a worker that died or restarted
  drops all of its handles here);
* the worker's knowledge of the object's version, which came with the handle, is still fresh
  (``valid_ms``): a held handle is never staler than a read through the worker would be.

Handles are bounded (``capacity`` descriptors, at most a quarter of the process's descriptor
limit, least recently used out; a page is 1 MiB by default, so HDFS's 256 block descriptors,
128 MiB blocks each, would be a far smaller working set here) and reference-counted, so
a descriptor dropped while another thread reads it is closed only after that read: its number is
never reused under a reader. Reads through held handles are remembered as slots and reported to
the worker with the next request (``take_touched``), so its recency and hit counters see them.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from cachefs.localhost import (
    HANDLE_SWEEP_SECONDS,
    TABLE_HEADER_WORDS,
    TABLE_MAGIC,
    TABLE_SERVING,
    TABLE_STALE_SECONDS,
    TABLE_WORD_HEARTBEAT,
    TABLE_WORD_MAGIC,
    TABLE_WORD_SLOTS,
    TABLE_WORD_STATE,
)
from cachefs.client.timeouts import ONCE_SECONDS

__all__ = ["HandleCache", "Page", "TableView", "file_identity"]

_STALE_NS = int(TABLE_STALE_SECONDS * 1e9)
MAX_TOUCHED = 1024  # reads through held handles remembered before a report is sent on its own
#: The slot of a page kept for one read, briefly: one the worker served but did not cache
#: (RangeReply.once: an in-memory copy of one version, nothing to invalidate), or a page file it
#: handed out unheld to a request made ahead of its read (a prepare). A page file never changes,
#: so its bytes stay right; if it leaves the cache meanwhile, its space is back once that read is
#: done (or ONCE_SECONDS have passed: the sweep), not counted by the worker.
ONCE = -1
#: How often expired and invalidated handles are closed while any are held: the worker counts an
#: evicted page that a client held for HELD_CLOSE_SECONDS after its eviction, no longer.
SWEEP_SECONDS = HANDLE_SWEEP_SECONDS


class TableView:
    """The worker's table of generations, mapped read-only."""

    def __init__(self, fd: int, instance: str, slots: int) -> None:
        size = (TABLE_HEADER_WORDS + slots) * 8
        if os.fstat(fd).st_size < size:
            raise ValueError("the handle table is smaller than its slot count says")
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.words = memoryview(self._map).cast("Q")
        self.instance, self.slots = instance, slots
        if self.words[TABLE_WORD_MAGIC] != TABLE_MAGIC or self.words[TABLE_WORD_SLOTS] != slots:
            self.close()
            raise ValueError("not a cachefs handle table")

    def alive(self) -> bool:
        words = self.words
        return words[TABLE_WORD_STATE] == TABLE_SERVING and \
            time.monotonic_ns() - words[TABLE_WORD_HEARTBEAT] < _STALE_NS

    def valid(self, slot: int, generation: int) -> bool:
        return 0 < slot < self.slots and self.words[TABLE_HEADER_WORDS + slot] == generation

    def close(self) -> None:
        self.words.release()
        self._map.close()


@dataclass(eq=False, slots=True)
class Page:
    """One page file descriptor and where its payload sits in the object."""

    fd: int
    start: int  # object offset of the payload's first byte
    length: int  # payload bytes (the file ends with its trailer)
    slot: int = 0  # 0: not held (read once, then closed); ONCE: kept for one read (see add)
    generation: int = 0
    verified: bool = False  # its checksum was checked through this descriptor
    refs: int = 0
    dropped: bool = False
    key: tuple = field(default=())
    until: float = 0.0  # a ONCE page: read it before this (monotonic)
    fetched: bool = False  # the worker fetched it from the store for the request that brought it: its first read is a miss
    identity: tuple = ()  # the file's identity (VerifiedFiles), once looked up through this descriptor


@dataclass(slots=True)
class _Object:
    size: int
    version: str
    until: float  # monotonic
    mtime: float = 0.0


def file_identity(fd: int, length: int) -> tuple[int, ...]:
    """A page file's identity (device, inode, size, mtime, ctime) and the payload length read
    from it: page files are renamed into place and never changed, so the same identity holds
    the bytes checked before (shortcircuit.VerifiedFiles, namedpages.CheckedPages)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, length


def _within_fd_limit(capacity: int) -> int:
    """At most a quarter of this process's descriptor limit: the rest is the program's."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return min(capacity, 256)
    return capacity if soft == resource.RLIM_INFINITY else min(capacity, max(0, soft // 4))


class HandleCache:
    """Held descriptors of one worker's pages, keyed by (path, version, page start)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = _within_fd_limit(max(0, capacity))
        self.table: TableView | None = None
        self.page_size = 0
        self._lock = threading.Lock()
        self._pages: OrderedDict[tuple, Page] = OrderedDict()
        self._objects: OrderedDict[str, _Object] = OrderedDict()
        self._touched: list[int] = []
        self._touched_bytes = 0
        self.stats = {"held_reads": 0, "dropped_invalid": 0, "dropped_lru": 0, "dropped_expired": 0}
        # Closes handles whose hold ran out even if this process reads nothing more: the worker
        # stops counting an unlinked page's bytes then, so its file must not stay open past it.
        self._sweeper: threading.Thread | None = None
        self._closed = threading.Event()

    # -- the table ---------------------------------------------------------------------------------
    def attach(self, table: TableView, page_size: int) -> None:
        """A (new) table from a hello reply: handles from any earlier one are dropped."""
        with self._lock:
            old, self.table, self.page_size = self.table, table, page_size
            self._drop_all_locked()
        if old is not None:
            old.close()

    def usable(self) -> bool:
        """True while held handles may be used; a dead or closed table drops them all."""
        table = self.table
        if table is None:
            return False
        try:
            if table.alive():
                return True
        except ValueError:  # attach() closed it on another thread meanwhile: the new table decides
            return self.table is not table and self.usable()
        with self._lock:
            if self.table is table:
                self.table = None
                self._drop_all_locked()
        return False

    # -- lookups -------------------------------------------------------------------------------------
    def lookup(self, path: str, offset: int, length: int, version: str,
               read: bool = True) -> tuple[int, str, list[Page]] | None:
        """(size, version, pages) covering the range, each referenced (``release`` them after),
        or None if any of them is not held and valid. ``read=False``: only checking (prepare),
        not a read to report to the worker."""
        if not self.usable():
            return None
        now = time.monotonic()
        with self._lock:
            return self._lookup_locked(path, offset, length, version, read, now)

    def lookup_many(self, ranges: list[tuple[str, int, int]]) -> list[tuple[int, str, list[Page]] | None]:
        """``lookup`` of many ``(path, offset, length)`` reads under one lock (a batch of samples)."""
        if not self._objects or not self.usable():  # nothing held (a process reading by name)
            return [None] * len(ranges)
        now = time.monotonic()
        with self._lock:
            return [self._lookup_locked(path, offset, length, "", True, now) for path, offset, length in ranges]

    def _lookup_locked(self, path: str, offset: int, length: int, version: str, read: bool,
                       now: float) -> tuple[int, str, list[Page]] | None:
        table, ps = self.table, self.page_size
        obj = self._objects.get(path)
        if obj is None or obj.until <= now or (version and obj.version != version):
            return None
        end = obj.size if length < 0 else min(obj.size, offset + length)
        if end <= offset:
            return obj.size, obj.version, []
        pages = []
        for start in range(offset - offset % ps, end, ps):
            page = self._pages.get((path, obj.version, start))
            if page is None or table is None or not (
                    table.valid(page.slot, page.generation) if page.slot != ONCE else page.until > now):
                if page is not None:
                    self.stats["dropped_invalid"] += 1
                    self._drop_locked(page)
                for p in pages:
                    p.refs -= 1
                return None
            pages.append(page)
            page.refs += 1
        for page in pages:
            self._pages.move_to_end(page.key)
        if read:
            for page in pages:
                if page.slot == ONCE:  # its one read: closed when released
                    self._drop_locked(page)
            if len(self._touched) < 4 * MAX_TOUCHED:
                if len(pages) == 1:  # a sample of one page: the usual read
                    if pages[0].slot != ONCE:
                        self._touched.append(pages[0].slot)
                else:
                    self._touched.extend(p.slot for p in pages if p.slot != ONCE)
            self._touched_bytes += end - offset
            self.stats["held_reads"] += 1
        return obj.size, obj.version, pages

    def object_info(self, path: str) -> tuple[int, str, float] | None:
        """(size, version, mtime) of an object as the worker vouched for it, while that lasts."""
        if not self.usable():
            return None
        with self._lock:
            obj = self._objects.get(path)
            if obj is None or obj.until <= time.monotonic():
                return None
            # Vouched for only while a page of it that we hold is still the worker's: a removed or
            # rewritten object's pages are dropped there (their slots bumped), and so is this.
            table, ps = self.table, self.page_size
            for start in range(0, min(max(obj.size, 1), 64 * ps), ps) if ps else ():
                page = self._pages.get((path, obj.version, start))
                if page is None or page.slot == ONCE:  # a one-read copy vouches for nothing later
                    continue
                if table is not None and table.valid(page.slot, page.generation):
                    return obj.size, obj.version, obj.mtime
                self.stats["dropped_invalid"] += 1
                self._drop_locked(page)
                return None
            return None

    def add(self, path: str, size: int, version: str, valid_ms: int, pages: list[Page], mtime: float = 0.0) -> None:
        """Keep the holdable pages of a reply (each arrives referenced once by its reader)."""
        if self.capacity == 0 or valid_ms <= 0 or self.table is None:
            return
        until = time.monotonic() + valid_ms / 1000.0
        with self._lock:
            obj = self._objects.get(path)
            if obj is None or obj.version != version or obj.until < until:
                if obj is not None and obj.version != version:
                    self._drop_object_locked(path, obj.version)
                self._objects[path] = _Object(size, version, until, mtime)
            self._objects.move_to_end(path)
            for page in pages:
                if page.slot == 0:
                    continue
                if page.slot == ONCE:  # an in-memory copy of a page not admitted: one read, soon
                    page.until = time.monotonic() + ONCE_SECONDS
                key = (path, version, page.start)
                old = self._pages.pop(key, None)
                if old is not None and old is not page:
                    self._drop_locked(old, popped=True)
                page.key = key
                self._pages[key] = page
            while len(self._pages) > self.capacity:
                _, victim = self._pages.popitem(last=False)
                self.stats["dropped_lru"] += 1
                self._drop_locked(victim, popped=True)
            while len(self._objects) > 4 * self.capacity:
                self._objects.popitem(last=False)
            if self._pages and (self._sweeper is None or not self._sweeper.is_alive()):
                self._sweeper = threading.Thread(target=self._sweep_loop, name="cachefs-handle-sweeper", daemon=True)
                self._sweeper.start()

    def _sweep_loop(self) -> None:
        while not self._closed.wait(SWEEP_SECONDS):
            if not self.sweep():
                return  # nothing held: the next add starts another

    def sweep(self, now: float | None = None) -> int:
        """Close handles whose object's hold has run out, and those the worker invalidated (it
        evicted the page: the unlinked file's space is counted only for a few seconds after);
        returns how many are still held."""
        now = time.monotonic() if now is None else now
        self.usable()  # a dead worker's handles go at once
        with self._lock:
            expired = {path for path, obj in self._objects.items() if obj.until <= now}
            for path in expired:
                del self._objects[path]
            if expired:
                for key in [k for k in self._pages if k[0] in expired]:
                    self.stats["dropped_expired"] += 1
                    self._drop_locked(self._pages[key])
            table = self.table
            if table is not None:
                invalid = [page for page in self._pages.values()
                           if not (table.valid(page.slot, page.generation) if page.slot != ONCE else page.until > now)]
                for page in invalid:
                    self.stats["dropped_invalid"] += 1
                    self._drop_locked(page)
            return len(self._pages)

    def release(self, pages: list[Page]) -> None:
        """Done reading: close what is not held (or was dropped meanwhile)."""
        with self._lock:
            for page in pages:
                page.refs -= 1
                if page.refs <= 0 and (page.dropped or page.slot == 0 or not page.key):
                    self._close(page)

    def release_many(self, found: list[tuple[int, str, list[Page]] | None]) -> None:
        """``release`` the pages of a ``lookup_many`` under one lock."""
        with self._lock:
            for got in found:
                for page in got[2] if got is not None else ():
                    page.refs -= 1
                    if page.refs <= 0 and (page.dropped or page.slot == 0 or not page.key):
                        self._close(page)

    def take_touched(self) -> tuple[list[int], int]:
        """Slots read through held handles since the last call, and the bytes those reads returned."""
        with self._lock:
            touched, self._touched = self._touched, []
            nbytes, self._touched_bytes = self._touched_bytes, 0
        return touched, nbytes

    def touched_pending(self) -> int:
        return len(self._touched)

    def held(self) -> int:
        with self._lock:
            return len(self._pages)

    # -- dropping --------------------------------------------------------------------------------------
    def _close(self, page: Page) -> None:  # caller holds the lock
        if page.fd >= 0:
            fd, page.fd = page.fd, -1
            os.close(fd)

    def _drop_locked(self, page: Page, popped: bool = False) -> None:
        if not popped and page.key:
            self._pages.pop(page.key, None)
        page.dropped = True
        if page.refs <= 0:
            self._close(page)

    def _drop_object_locked(self, path: str, version: str) -> None:
        for key in [k for k in self._pages if k[0] == path and k[1] == version]:
            self._drop_locked(self._pages[key])

    def _drop_all_locked(self) -> None:
        pages = list(self._pages.values())
        self._pages.clear()
        self._objects.clear()
        self._touched, self._touched_bytes = [], 0
        for page in pages:
            self._drop_locked(page, popped=True)

    def drop_all(self) -> None:
        with self._lock:
            self._drop_all_locked()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            table, self.table = self.table, None
            self._drop_all_locked()
        if table is not None:
            table.close()

    def release_inherited(self) -> None:
        """In a forked child: close this process's copies of the parent's descriptors and mapping,
        taking no lock (a parent thread may have held it at the fork)."""
        self._lock = threading.Lock()
        self._sweeper = None  # the parent's thread does not exist here
        pages, self._pages = list(self._pages.values()), OrderedDict()
        self._objects, self._touched = OrderedDict(), []
        for page in pages:
            if page.fd >= 0:
                try:
                    os.close(page.fd)
                except OSError:
                    pass
                page.fd = -1
        table, self.table = self.table, None
        if table is not None:
            try:
                table.close()
            except (BufferError, ValueError):
                pass
