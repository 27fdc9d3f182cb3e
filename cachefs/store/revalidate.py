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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cachefs.paths import CachePath
from cachefs.priority import lower_this_thread

__all__ = ["Revalidator", "parent_of"]

log = logging.getLogger(__name__)

#: Objects of one directory waiting for a refresh before one listing replaces their HEADs.
LIST_MIN_STALE = 8
#: A listing is used while the directory holds at most this many objects per waiting one (a
#: listing page holds 1,000 objects, a HEAD one: below 1,000 the listing sends fewer requests).
LIST_OBJECTS_PER_STALE = 250


def parent_of(path: CachePath) -> CachePath:
    """The directory ``path`` is listed in (the mount's root for a top-level key)."""
    return CachePath(path.mount, path.key.rpartition("/")[0])


class Revalidator:
    """Background refreshes, at most one per object at a time, batched by directory."""

    def __init__(self, refresh_one: Callable[[CachePath], None], list_dir: Callable[[CachePath], set[CachePath]],
                 is_fresh: Callable[[CachePath], bool], threads: int = 2) -> None:
        """``refresh_one(path)`` asks the store about one object; ``list_dir(dir)`` lists a
        directory, refreshing what it lists, and returns the paths listed; ``is_fresh(path)``:
        its metadata needs no refresh now."""
        self._refresh_one, self._list_dir, self._is_fresh = refresh_one, list_dir, is_fresh
        self._threads = threads
        self._lock = threading.Lock()
        self._pending: dict[CachePath, set[CachePath]] = {}  # directory -> objects waiting
        self._listing: set[CachePath] = set()  # directories being listed now
        self._dir_sizes: dict[CachePath, int] = {}  # objects a listing found there, last time
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"refreshed_one": 0, "listings": 0, "refreshed_by_listing": 0}

    def note_listing(self, directory: CachePath, objects: int) -> None:
        """A listing of ``directory`` found ``objects`` objects directly in it."""
        with self._lock:
            if len(self._dir_sizes) >= 100_000 and directory not in self._dir_sizes:
                self._dir_sizes.pop(next(iter(self._dir_sizes)))
            self._dir_sizes[directory] = objects

    def submit(self, path: CachePath) -> None:
        """Refresh ``path`` in the background (nothing if it is already waiting)."""
        directory = parent_of(path)
        with self._lock:
            waiting = self._pending.setdefault(directory, set())
            if path in waiting:
                return
            waiting.add(path)
            if self._pool is None:
                # Nothing waits on a refresh (the stale entry serves meanwhile): below the
                # threads that serve reads (cachefs/priority.py).
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="cachefs-revalidate",
                                                initializer=lower_this_thread)
            pool = self._pool
        pool.submit(self._run, path, directory)

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
            waiting = len(self._pending.get(directory, ()))
            size = self._dir_sizes.get(directory)
            if size is None or waiting < LIST_MIN_STALE or size > waiting * LIST_OBJECTS_PER_STALE:
                return False
            self._listing.add(directory)
        try:
            listed = self._list_dir(directory)
            self.stats["listings"] += 1
        except Exception as exc:  # noqa: BLE001 - one at a time instead
            log.debug("listing %s to revalidate it failed: %s", directory, exc)
            with self._lock:
                self._listing.discard(directory)
                joined = [p for p in self._pending.get(directory, ()) if p != path]
                pool = self._pool
            for other in joined:  # those that waited for this listing: one request each
                if pool is not None:
                    with contextlib.suppress(RuntimeError):  # closed meanwhile
                        pool.submit(self._run, other, directory, False)
            return False
        with self._lock:
            self._listing.discard(directory)
            waiting_now = set(self._pending.get(directory, ()))
        refreshed = waiting_now & listed
        self.stats["refreshed_by_listing"] += len(refreshed)
        for missing in waiting_now - listed:  # not listed: gone, or new since; ask for it alone
            try:
                self._refresh_one(missing)
                self.stats["refreshed_one"] += 1
            except Exception as exc:  # noqa: BLE001 - e.g. deleted: the next read finds out
                log.debug("revalidating %s failed: %s", missing, exc)
        self._done(directory, list(waiting_now))
        return True

    def _done(self, directory: CachePath, paths: list[CachePath]) -> None:
        with self._lock:
            waiting = self._pending.get(directory)
            if waiting is None:
                return
            waiting.difference_update(paths)
            if not waiting:
                del self._pending[directory]

    def waiting(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._pending.values())

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
