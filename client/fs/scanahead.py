"""Read-ahead across objects: whole objects read in their directory's order get the next ones hinted.

Code that opens one object per sample through the plain fsspec API (``cat_file``, ``open().read()``)
tells the cache nothing of what comes next: a DataLoader with ``shuffle=False`` over a directory
(an evaluation pass over an ImageFolder tree, a preprocessing scan) then waits on the store for
every object, one request per reader in flight. Such reads follow the directory's listing order,
as a file read sequentially follows its offsets, so the same rule as the kernel's read-ahead
applies one level up: after two reads of adjacent names (in the listing's sorted order), the next
objects are hinted (a background ``Load``, client/fs/hints.py), a window that doubles while the reads
keep to the order, up to ``max_window`` objects (hinted half a window at a time: one ``Load``
each); a read out of order starts it over, unless it jumps forward into what was hinted (a
DataLoader worker skipping the other workers' batches).

Nothing is listed until two reads in a row went up in name order, and then once per directory,
on a thread of its own (a listing is a page of ~1,000 entries per request, a worker's cached
answer; never on the reader's time). The listing is taken a page at a time and given up at
``max_listing`` entries: a directory larger than that is left alone, having cost at most
``max_listing`` / 1,000 pages and ``max_listing`` names in memory, however large it is. Hints are what
CacheDataset sends from its sampler: bounded in flight, dropped when busy, backing off while
everything hinted was cached already. One per process (fork-aware: a DataLoader worker starts
afresh).
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cachefs.client import forksafe
from cachefs.client.forksafe import ForkSafeLock
from cachefs.paths import CachePath

log = logging.getLogger(__name__)

__all__ = ["ScanAhead"]

_LISTING = ()  # a directory whose listing is on its way (or not wanted)
#: Names of one directory held at most (and listed at most before giving up: a page is ~1,000).
#: Past it the window's index into the sorted names would cost a listing of 100+ requests per
#: process and ~10 MB of names in each DataLoader worker; an ordered pass over a bigger directory
#: is what CacheDataset's sampler hints, with no listing per process.
MAX_LISTING = 100_000


@dataclass
class _Dir:
    last_name: str
    rising: int = 0  # reads in a row that went up in name order (before the listing)
    names: tuple[str, ...] | None = None  # sorted file names; _LISTING while asked for or refused
    last_index: int = -2
    run: int = 0  # reads in a row of adjacent names
    window: int = 0
    hinted_to: int = 0  # names before this index were hinted already


class ScanAhead:
    """Notes whole-object reads; hints the objects that follow them in their directory's order."""

    def __init__(self, list_pages: Callable[[CachePath], Iterable[list[str]]], hint: Callable[[list[str]], int], *,
                 first_window: int = 8, max_window: int = 64, max_listing: int | None = None,
                 max_dirs: int = 64) -> None:
        """``list_pages(directory)``: the file names directly in it, a page (a list) at a time,
        fetched as they are taken (a generator over ``ClientSession.list_pages``)."""
        if not 1 <= first_window <= max_window:
            raise ValueError("need 1 <= first_window <= max_window")
        self._list_pages, self._hint = list_pages, hint
        self.first_window, self.max_window = first_window, max_window
        self.max_listing = MAX_LISTING if max_listing is None else max_listing
        self.max_dirs = max_dirs
        # Fresh in a forked child (forksafe.py): a parent thread may hold it at the fork, and the
        # child takes it before it can tell that the state behind it is the parent's.
        self._lock = ForkSafeLock()
        self._dirs: OrderedDict[tuple[str, str], _Dir] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = forksafe.pid()
        self.stats = {"listed": 0, "hinted": 0, "too_large": 0, "list_failed": 0}

    def note(self, cp: CachePath) -> None:
        """``cp`` is being read from its start (a read of the whole object, as a sample is)."""
        slash = cp.key.rfind("/")
        where, name = (cp.mount, cp.key[:slash] if slash >= 0 else ""), cp.key[slash + 1:]
        with self._lock:
            if self._pid != forksafe.pid():  # a forked child: the parent's state and thread are not ours
                self._dirs, self._pool, self._pid = OrderedDict(), None, forksafe.pid()
            d = self._dirs.get(where)
            if d is None:
                self._dirs[where] = _Dir(name)
                if len(self._dirs) > self.max_dirs:
                    self._dirs.popitem(last=False)
                return
            self._dirs.move_to_end(where)
            if d.names is None:
                d.rising = d.rising + 1 if name > d.last_name else 0
                d.last_name = name
                if d.rising >= 1:  # two reads in a row went up: worth a listing
                    d.names = _LISTING
                    self._list_later(where)
                return
            if not d.names:
                return
            start, wanted = self._advance(d, name, where)
        if not wanted:
            return
        try:
            taken = self._hint(wanted)
        except Exception as exc:  # noqa: BLE001 - a hint is only a hint
            log.debug("scan-ahead hint of %d objects failed: %s", len(wanted), exc)
            return
        with self._lock:  # what the cache refused (busy) is offered again with the next read
            d.hinted_to = max(d.hinted_to, start + max(0, min(taken, len(wanted))))
            self.stats["hinted"] += taken

    def _advance(self, d: _Dir, name: str, where: tuple[str, str]) -> tuple[int, list[str]]:  # lock held
        """(index of the first name, the paths) to hint after a read of ``name``; nothing: []."""
        names = d.names
        assert names
        i = bisect.bisect_left(names, name)
        if i >= len(names) or names[i] != name:
            d.last_index, d.run = -2, 0  # not in the listing (new since): no order to follow
            return 0, []
        if i == d.last_index + 1:
            d.run += 1
        elif not d.last_index < i < d.hinted_to:
            d.run, d.window = 0, 0
        # (A jump forward into what was hinted keeps the run: DataLoader workers read a batch
        # each, in turn, so each one skips the batches between its own.)
        d.last_index = i
        if d.run < 1:
            return 0, []
        if d.window == 0:  # a new run: what an earlier one hinted past here stays hinted
            d.window, d.hinted_to = self.first_window, max(d.hinted_to, i + 1)
        # Hinted ahead by half a window or less: the next stretch (one Load at most), and the
        # window grows.
        if d.hinted_to - (i + 1) > d.window // 2:
            return 0, []
        start, end = max(d.hinted_to, i + 1), min(len(names), i + 1 + d.window)
        d.window = min(self.max_window, 2 * d.window)
        if end <= start:
            return 0, []
        d.hinted_to = start  # moved past what the cache takes, once it answers
        mount, prefix = where
        base = f"{mount}/{prefix}/" if prefix else f"{mount}/"
        return start, [base + n for n in names[start:end]]

    def _list_later(self, where: tuple[str, str]) -> None:  # lock held
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cachefs-scan-ahead")
        try:
            self._pool.submit(self._list, where)
        except RuntimeError:  # shut down
            pass

    def _list(self, where: tuple[str, str]) -> None:
        mount, prefix = where
        names: list[str] = []
        pages = self._list_pages(CachePath(mount, prefix))
        try:
            for page in pages:
                names.extend(page)
                if len(names) > self.max_listing:  # no further page is asked for
                    self.stats["too_large"] += 1
                    return
        except Exception as exc:  # noqa: BLE001 - no listing: no read-ahead here
            log.debug("scan-ahead listing of %s/%s failed: %s", mount, prefix, exc)
            self.stats["list_failed"] += 1
            return
        finally:
            close = getattr(pages, "close", None)
            if close is not None:
                close()  # a generator left mid-listing: its session call ends now, not at collection
        ordered = tuple(sorted(names))
        with self._lock:
            d = self._dirs.get(where)
            if d is not None:
                d.names = ordered
                self.stats["listed"] += 1

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == forksafe.pid():
            pool.shutdown(wait=False, cancel_futures=True)
