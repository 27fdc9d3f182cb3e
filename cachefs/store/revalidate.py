"""Refreshing expired metadata in the background: one listing for many objects of a directory.

Past its TTL (within the stale grace) an object's metadata is still used, and refreshed behind
the read (stale-while-revalidate). One refresh per object is one HEAD: after a pause longer than
the TTL (a validation pass, a checkpoint), a training epoch over 2,000 objects sent 2,000 HEADs,
which on this machine kept moto and the worker busy ~10 s and slowed the epoch 5-8x. A listing
returns the size and version of up to 1,000 objects a request, so when many objects of one
directory wait to be refreshed, and the directory is not much larger than that (its size is
known from an earlier listing), the directory is listed once instead: the same freshness for a
fraction of the requests. An object missing from the listing is asked for by itself (a HEAD,
which also finds it gone).

Past the grace too (an epoch longer than TTL + grace, 10.5 minutes by default: most real ones)
nothing is left to serve from, and each read asked the store for its object alone before it went
on: every warm epoch of 2,000 objects in moto sent 2,000 HEADs and read ~190 items/s from a full
cache. Such reads now count toward a listing of their directory as background refreshes do
(``refresh_expired``): once enough of a directory of known size ran out, one read lists it and
the others wait for that listing instead of asking alone; a directory too large to wait for is
listed behind the reads.

The queue is bounded: at most ``MAX_WAITING`` objects wait for a background refresh. Past it a
refresh is not queued (counted as ``dropped``): the read goes on with the stale entry as it would
while one waits, and the object's next read past its TTL asks again; past the grace a read asks
the store itself. A million objects that ran out together (an epoch after a long pause) queue
ten thousand refreshes, not a million.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cachefs.paths import CachePath
from cachefs.priority import lower_this_thread

__all__ = ["Revalidator", "parent_of"]

log = logging.getLogger(__name__)

#: Objects of one directory waiting for a refresh before one listing replaces their HEADs.
LIST_MIN_STALE = 8
#: A listing is used while the directory holds at most this many objects per waiting one (a
#: listing page holds 1,000 objects, a HEAD one: below 1,000 the listing sends fewer requests).
LIST_OBJECTS_PER_STALE = 250
#: Reads wait for a listing of a directory of up to this many objects (a few listing pages); a
#: larger one is listed in the background while they ask for their objects alone.
SYNC_LIST_MAX = 5_000
#: How long a read waits for another's listing before it asks the store alone.
SYNC_LIST_WAIT = 60.0
_MAX_DIRS = 100_000  # directories whose size (and run-out reads) are remembered
#: Objects waiting for a background refresh at most. More than the refresh threads get through in
#: a TTL (30 s) at a store's HEAD latency, so what is past it would be stale again when its turn
#: came; a few MB at most (a path, a set slot, a queued call each), not one entry per object of a
#: data set that ran out at once.
MAX_WAITING = 10_000


def _put_bounded(table: dict, key: Any, value: Any) -> None:
    """``table[key] = value``, the entry put longest ago dropped first past _MAX_DIRS."""
    table.pop(key, None)
    table[key] = value
    if len(table) > _MAX_DIRS:
        table.pop(next(iter(table)))


def parent_of(path: CachePath) -> CachePath:
    """The directory ``path`` is listed in (the mount's root for a top-level key)."""
    return CachePath(path.mount, path.key.rpartition("/")[0])


def _below(directory: str, rest: str) -> str:
    return f"{directory}/{rest}" if directory else rest


class PagedDirectorySizes:
    """How many objects each directory holds, from a listing taken a chunk at a time (#46), for
    the revalidator: knowing a directory's size is what lets it refresh many run-out objects of it
    by one listing instead of a store request each (a warm epoch of a million objects longer than
    the metadata TTL). In key order every key below a directory is contiguous, so a directory is
    counted from its first key to the first key past it; the directories still open at a chunk's
    end carry over to the chunk after it (found by the name it starts after), and a directory the
    listing entered in the middle (a chunk asked after a name no tail is kept for) is not noted."""

    MAX_TAILS = 1024  # listings in progress whose open directories are kept

    def __init__(self, note: Callable[[CachePath, int], None]) -> None:
        self._note = note
        self._lock = threading.Lock()
        self._tails: OrderedDict[tuple[Hashable, str], list[list[Any]]] = OrderedDict()

    def chunk(self, listing: Hashable, root: CachePath, after_key: str | None, keys: list[str], last: str,
              final: bool) -> None:
        """Count the object ``keys`` of one chunk of ``listing`` (of the directory ``root``, in key
        order); ``after_key``: the key it starts after (None: the listing's first chunk);
        ``last``: its last name (where the next chunk starts)."""
        base = root.key
        with self._lock:
            stack = self._tails.pop((listing, after_key), None) if after_key is not None else [[base, 0, True]]
        if stack is None:  # entered in the middle: the directories down to the name are partly seen
            inner = after_key[len(base) + 1 if base else 0:].split("/")[:-1]
            stack = [[base, 0, False]] + [[_below(base, "/".join(inner[:i])), 0, False]
                                          for i in range(1, len(inner) + 1)]
        for key in keys:
            directory = key.rpartition("/")[0]
            while len(stack) > 1 and not (directory == stack[-1][0] or directory.startswith(stack[-1][0] + "/")):
                self._close(root.mount, stack.pop())
            top = stack[-1][0]
            if directory != top:  # the levels between the innermost open directory and this one
                rest = directory[len(top) + 1 if top else 0:].split("/")
                for i in range(1, len(rest) + 1):
                    stack.append([_below(top, "/".join(rest[:i])), 0, True])
            stack[-1][1] += 1
        if final:
            while stack:
                self._close(root.mount, stack.pop())
            return
        with self._lock:
            self._tails[(listing, last)] = stack
            while len(self._tails) > self.MAX_TAILS:
                self._tails.popitem(last=False)

    def _close(self, mount: str, entry: list[Any]) -> None:
        directory, objects, whole = entry
        if whole:
            self._note(CachePath(mount, directory), objects)


class Revalidator:
    """Background refreshes, at most one per object at a time, batched by directory."""

    def __init__(self, refresh_one: Callable[[CachePath], None],
                 list_dir: Callable[[CachePath], Container[CachePath]],
                 is_fresh: Callable[[CachePath], bool], threads: int = 2, relist_after: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_waiting: int = MAX_WAITING) -> None:
        """``refresh_one(path)`` asks the store about one object; ``list_dir(dir)`` lists a
        directory, refreshing what it lists, and returns the objects listed (a container of
        their paths); ``is_fresh(path)``: its metadata needs no refresh now. ``relist_after``: a
        directory listed more recently than this is not listed again for reads that find nothing
        known (the metadata TTL: what such a listing did not refresh is missing or new, and a HEAD
        each is the answer).
        ``max_waiting``: objects waiting for a refresh at most (``MAX_WAITING``)."""
        self._refresh_one, self._list_dir, self._is_fresh = refresh_one, list_dir, is_fresh
        self._threads = threads
        self._relist_after, self._clock = relist_after, clock
        self._lock = threading.Lock()
        self._pending: dict[CachePath, set[CachePath]] = {}  # directory -> objects waiting
        self._waiting, self.max_waiting = 0, max_waiting  # objects in _pending, and their bound
        self._listing: dict[CachePath, threading.Event] = {}  # directories being listed now: set when done
        self._dirs: dict[CachePath, tuple[int, float]] = {}  # objects a listing found there last, and when
        self._expired: dict[CachePath, int] = {}  # reads that found metadata run out, since the last listing
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"refreshed_one": 0, "listings": 0, "refreshed_by_listing": 0, "expired_by_listing": 0,
                      "dropped": 0}

    def note_listing(self, directory: CachePath, objects: int) -> None:
        """A listing of ``directory`` found ``objects`` objects directly in it."""
        with self._lock:
            _put_bounded(self._dirs, directory, (objects, self._clock()))
            self._expired.pop(directory, None)  # what ran out before is fresh again

    def _dir_size(self, directory: CachePath) -> int | None:
        known = self._dirs.get(directory)
        return None if known is None else known[0]

    @staticmethod
    def _worth_listing(size: int | None, waiting: int) -> bool:
        return size is not None and waiting >= LIST_MIN_STALE and size <= waiting * LIST_OBJECTS_PER_STALE

    def refresh_expired(self, path: CachePath, wait: float = SYNC_LIST_WAIT) -> bool:
        """A read needs ``path``'s metadata now and none is left (past the stale grace, or never
        known): True if a listing of its directory refreshed it (this thread listed it, or waited
        for another's listing); False: ask the store for it alone. Cheap when not worth a listing."""
        directory = parent_of(path)
        pool: ThreadPoolExecutor | None = None
        with self._lock:
            event = self._listing.get(directory)
            mine = event is None
            if mine:
                known = self._dirs.get(directory)
                if known is None:  # never listed: a HEAD each, as before
                    return False
                size, listed_at = known
                if self._clock() - listed_at < self._relist_after:
                    return False  # listed just now: what it did not refresh is missing, or new
                count = self._expired.get(directory, 0) + 1
                if not self._worth_listing(size, count):
                    _put_bounded(self._expired, directory, count)
                    return False
                self._expired.pop(directory, None)
                event = self._listing[directory] = threading.Event()
                behind = size > SYNC_LIST_MAX
                pool = self._ensure_pool() if behind else None
        if mine:
            if pool is not None:  # too large to wait for: this read asks alone meanwhile
                try:
                    pool.submit(self._list_and_settle, directory, None, event)
                except RuntimeError:  # closed meanwhile: no listing after all
                    with self._lock:
                        self._listing.pop(directory, None)
                    event.set()
                return False
            if not self._list_and_settle(directory, None, event):
                return False
        elif not event.wait(wait):
            return False
        fresh = self._is_fresh(path)
        if fresh:
            self.stats["expired_by_listing"] += 1
        return fresh

    def submit(self, path: CachePath) -> None:
        """Refresh ``path`` in the background (nothing if it is already waiting, or if
        ``max_waiting`` objects are: its next read asks again)."""
        self.submit_many([path])

    def submit_many(self, paths: list[CachePath]) -> None:
        """``submit`` of each, one background task a directory (a client's report of objects
        read past their time names thousands at once: a task, a future and a lock each cost
        more than the refresh that a listing makes of most of them)."""
        queued: dict[CachePath, list[CachePath]] = {}
        with self._lock:
            for path in paths:
                directory = parent_of(path)
                waiting = self._pending.get(directory)
                if waiting is not None and path in waiting:
                    continue
                if self._waiting >= self.max_waiting:
                    self.stats["dropped"] += 1
                    continue
                if waiting is None:
                    waiting = self._pending[directory] = set()
                waiting.add(path)
                self._waiting += 1
                queued.setdefault(directory, []).append(path)
            # A directory that one listing will refresh: one task for its objects; else a task an
            # object (each asked alone, as many at once as there are threads).
            tasks: list[tuple[list[CachePath], CachePath]] = []
            for directory, mine in queued.items():
                if self._worth_listing(self._dir_size(directory), len(self._pending[directory])):
                    tasks.append((mine, directory))
                else:
                    tasks.extend(([path], directory) for path in mine)
            pool = self._ensure_pool() if tasks else None
        for mine, directory in tasks:
            try:
                pool.submit(self._run_all, mine, directory)  # type: ignore[union-attr]
            except RuntimeError:  # closed meanwhile: nothing will settle them
                self._done(directory, mine)

    def _run_all(self, paths: list[CachePath], directory: CachePath) -> None:
        """``_run`` of each, in turn: the first lists the directory, and the others find
        themselves refreshed by it."""
        for path in paths:
            self._run(path, directory)

    def _ensure_pool(self) -> ThreadPoolExecutor:
        """(with the lock held)"""
        if self._pool is None:
            # Nothing waits on a background refresh (the stale entry serves meanwhile): below
            # the threads that serve reads (cachefs/priority.py).
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="cachefs-revalidate",
                                            initializer=lower_this_thread)
        return self._pool

    def _run(self, path: CachePath, directory: CachePath, may_list: bool = True) -> None:
        done = True
        try:
            if self._is_fresh(path):  # a listing (or a read) refreshed it meanwhile
                return
            listed = self._list_if_worth_it(directory, path) if may_list else False
            if listed is None:  # a listing under way: its thread settles this object after it
                done = False
                return
            if listed:
                return
            self._refresh_one(path)
            self.stats["refreshed_one"] += 1
        except Exception as exc:  # noqa: BLE001 - gone, store down...: the next read finds out
            log.debug("revalidating %s failed: %s", path, exc)
        finally:
            if done:
                self._done(directory, [path])

    def _list_if_worth_it(self, directory: CachePath, path: CachePath) -> bool | None:
        """List the directory if enough of it waits: True if this thread did (every object of it
        waiting then is settled), None if another thread is listing it, False if not worth it."""
        with self._lock:
            if directory in self._listing:
                return None
            if not self._worth_listing(self._dir_size(directory), len(self._pending.get(directory, ()))):
                return False
            event = self._listing[directory] = threading.Event()
        return self._list_and_settle(directory, path, event)

    def _list_and_settle(self, directory: CachePath, own: CachePath | None, event: threading.Event) -> bool:
        """List ``directory`` (marked as being listed, under ``event``), then settle the objects
        waiting for a background refresh there: those the listing did not find asked for alone,
        all of them one at a time if it failed (but ``own``: the caller asks for that one).
        True if the listing went through."""
        listed: Container[CachePath] | None = None
        try:
            listed = self._list_dir(directory)
            self.stats["listings"] += 1
        except Exception as exc:  # noqa: BLE001 - one at a time instead
            log.debug("listing %s to revalidate it failed: %s", directory, exc)
        finally:
            with self._lock:
                self._listing.pop(directory, None)
                waiting_now = set(self._pending.get(directory, ()))
                pool = self._pool
            event.set()
        if listed is None:
            for other in waiting_now - {own}:  # those that waited for this listing: one request each
                if pool is not None:
                    with contextlib.suppress(RuntimeError):  # closed meanwhile
                        pool.submit(self._run, other, directory, False)
            return False
        missing = [path for path in waiting_now if path not in listed]
        self.stats["refreshed_by_listing"] += len(waiting_now) - len(missing)
        for path in missing:  # not listed: gone, or new since; ask for it alone
            try:
                self._refresh_one(path)
                self.stats["refreshed_one"] += 1
            except Exception as exc:  # noqa: BLE001 - e.g. deleted: the next read finds out
                log.debug("revalidating %s failed: %s", path, exc)
        self._done(directory, list(waiting_now))
        return True

    def _done(self, directory: CachePath, paths: list[CachePath]) -> None:
        with self._lock:
            waiting = self._pending.get(directory)
            if waiting is None:
                return
            before = len(waiting)
            waiting.difference_update(paths)
            self._waiting -= before - len(waiting)
            if not waiting:
                del self._pending[directory]

    def waiting(self) -> int:
        with self._lock:
            return self._waiting

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
