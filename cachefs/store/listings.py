"""Listings kept in chunks, shared by every lister of a prefix and bounded in bytes (#46).

A chunk is what one store request (one ListObjectsV2 page, one piece of a sorted directory walk)
found after a name: every entry whose name sorts in ``(after, last]``, or everything after
``after`` when it is the listing's final chunk. A page of a listing after name X is cut from the
chunk that covers X, and a page never runs past its chunk's end, so every lister of a prefix asks
for the chunks starting at the same names: one fetch per chunk serves them all (single flight),
and a million-key listing costs one chunk of store work per page, never the whole prefix first.
A whole listing (a store that cannot page, or ``ObjectStore.list``) is one final chunk from "".

Chunks expire after the listing TTL, and the least recently used go first once their estimated
bytes pass the bound (``list_cache_bytes``); a chunk larger than the bound alone is kept until
the next one arrives.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from cachefs.store.listed import ListedEntries, Names
from cachefs.store.meta import ObjectMeta

CHUNK_BYTES = 400  # a chunk's own objects, so that many empty listings count too
#: How long a lister waits for another's fetch of the same chunk before asking the store itself.
JOIN_SECONDS = 120.0

#: Chunks fetched ahead at once (in all listings of a store).
AHEAD_THREADS = 2

Fetch = Callable[[str], "tuple[ListedEntries | list[ObjectMeta], bool]"]  # after -> (entries, final)


@dataclass
class Chunk:
    """Entries of one listing whose names (``str(path)``) sort in ``(after, last]``, held as
    columns (listed.py); a list of ``ObjectMeta`` given is sorted and taken into them."""

    after: str
    entries: ListedEntries
    final: bool
    expires: float = 0.0
    names: Names = field(init=False)
    size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.entries, ListedEntries):
            metas = list(self.entries)
            self.entries = ListedEntries.of(metas[0].path.mount if metas else "", metas)
        self.names = self.entries.names
        self.size = CHUNK_BYTES + self.entries.nbytes

    @property
    def last(self) -> str:
        return self.names[-1] if self.names else self.after

    def covers(self, name: str) -> bool:
        """Whether every entry after ``name`` up to this chunk's end is here."""
        return self.after <= name and (self.final or name < self.last)


class ListingCache:
    """Chunks of listings by (listing key, the name they start after)."""

    def __init__(self, ttl: float, max_bytes: int, clock: Callable[[], float] = time.monotonic,
                 read_ahead: bool = True) -> None:
        self.ttl, self.max_bytes, self._clock, self.read_ahead = ttl, max_bytes, clock, read_ahead
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._afters: dict[Hashable, list[str]] = {}  # per listing: its chunks' starting names, sorted
        self._chunks: OrderedDict[tuple[Hashable, str], Chunk] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._inflight: dict[tuple[Hashable, str], Future[Chunk]] = {}
        # Listings dropped (a refresh, a change) while fetches of them were under way, by the count
        # of drops then: a fetch that began before its listing's drop keeps nothing. Only while
        # such fetches are under way, so the map stays as small as they are few.
        self._drops = 0
        self._dropped: dict[Hashable, int] = {}
        self._fetching: dict[Hashable, int] = {}  # per listing: its fetches under way (joined or not)
        self.fetched = 0  # chunks asked of the store
        self.joined = 0  # chunk requests that shared another lister's fetch

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

    def chunk(self, key: Hashable, after: str, fetch: Fetch, refresh: bool = False) -> Chunk:
        """The chunk of listing ``key`` that covers the entries after ``after``: kept, another
        lister's fetch of it, or ``fetch(after)`` (which lists the store after that name).
        ``refresh``: drop what is kept of the listing and ask the store (the first page of a
        refreshed listing). The chunk after it is then fetched behind (read-ahead)."""
        with self._lock:
            if refresh:
                self._drop_listing(key)
                found = None
            else:
                found = self._covering(key, after)
            if found is None:
                pending = self._inflight.get((key, after))
                started = None if pending is not None else self._lead(key, after)
                if pending is None:
                    pending = self._inflight[(key, after)]
                else:
                    self.joined += 1
        if found is None and started is None:
            try:
                found = pending.result(timeout=JOIN_SECONDS)
            except FutureTimeout:  # a store this slow: ask on our own, keep nothing
                entries, final = fetch(after)
                return Chunk(after, entries, final)
        elif found is None:
            found = self._fetch(key, after, fetch, pending, started)
        if self.read_ahead and not found.final:
            self._ahead(key, found.last, fetch)
        return found

    def _ahead(self, key: Hashable, after: str, fetch: Fetch) -> None:
        """Fetch the chunk after ``after`` in the background unless it is kept or under way:
        the store lists it while the lister takes the page before (one chunk ahead at most)."""
        with self._lock:
            if (key, after) in self._inflight or self._covering(key, after, touch=False) is not None:
                return
            started = self._lead(key, after)
            pending = self._inflight[(key, after)]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="listing-ahead")
        self._pool.submit(self._fetch, key, after, fetch, pending, started, False)

    def _lead(self, key: Hashable, after: str) -> int:
        """(Under the lock) register a fetch of chunk ``after``: others join it. Returns the count
        of drops it started at."""
        self._inflight[(key, after)] = Future()
        self._fetching[key] = self._fetching.get(key, 0) + 1
        return self._drops

    def _fetch(self, key: Hashable, after: str, fetch: Fetch, pending: "Future[Chunk]", started: int,
               raise_errors: bool = True) -> Chunk | None:
        """Ask the store for the chunk after ``after``, keep it (unless its listing was dropped
        meanwhile) and hand it to those who joined."""
        try:
            entries, final = fetch(after)
            chunk = Chunk(after, entries, final, self._clock() + self.ttl)
            with self._lock:
                self.fetched += 1
                if self._dropped.get(key, -1) <= started:
                    self._keep(key, chunk)
        except BaseException as exc:
            pending.set_exception(exc)
            if raise_errors:
                raise
            return None  # read-ahead: whoever joined it has the error; a later lister asks again
        else:
            pending.set_result(chunk)
        finally:
            with self._lock:
                if self._inflight.get((key, after)) is pending:
                    del self._inflight[(key, after)]
                self._fetching[key] -= 1
                if not self._fetching[key]:
                    del self._fetching[key]
                    self._dropped.pop(key, None)
        return chunk

    def whole(self, key: Hashable) -> ListedEntries | None:
        """A fresh whole listing kept for ``key`` (one final chunk from ""), or None."""
        with self._lock:
            found = self._covering(key, "")
            return found.entries if found is not None and found.final and not found.after else None

    def put_whole(self, key: Hashable, entries: ListedEntries | list[ObjectMeta]) -> Chunk:
        """Keep a whole listing: it replaces every chunk kept of ``key`` (it is newer than them)."""
        chunk = Chunk("", entries, True, self._clock() + self.ttl)
        with self._lock:
            self._drop_listing(key)
            self._keep(key, chunk)
        return chunk

    def forget(self, predicate: Callable[[Hashable], bool]) -> None:
        """Drop every kept listing whose key ``predicate`` accepts (and let no fetch under way keep
        what it finds)."""
        with self._lock:
            for key in [k for k in {*self._afters, *self._fetching} if predicate(k)]:
                self._drop_listing(key)

    # -- under the lock -------------------------------------------------------------------------
    def _covering(self, key: Hashable, after: str, touch: bool = True) -> Chunk | None:
        afters = self._afters.get(key)
        if not afters:
            return None
        i = bisect.bisect_right(afters, after) - 1
        if i < 0:
            return None
        chunk = self._chunks[(key, afters[i])]
        if chunk.expires <= self._clock():
            self._remove(key, afters[i])
            return None
        if not chunk.covers(after):
            return None
        if touch:
            self._chunks.move_to_end((key, chunk.after))
        return chunk

    def _keep(self, key: Hashable, chunk: Chunk) -> None:
        if self.ttl <= 0 or self.max_bytes <= 0:
            return
        if (key, chunk.after) in self._chunks:
            self._remove(key, chunk.after)
        afters = self._afters.setdefault(key, [])
        bisect.insort(afters, chunk.after)
        self._chunks[(key, chunk.after)] = chunk
        self._bytes += chunk.size
        while self._bytes > self.max_bytes and len(self._chunks) > 1:
            old_key, old_after = next(iter(self._chunks))
            self._remove(old_key, old_after)

    def _remove(self, key: Hashable, after: str) -> None:
        chunk = self._chunks.pop((key, after))
        self._bytes -= chunk.size
        afters = self._afters[key]
        del afters[bisect.bisect_left(afters, after)]
        if not afters:
            del self._afters[key]

    def _drop_listing(self, key: Hashable) -> None:
        """Forget listing ``key``: its chunks, and its fetches under way (they keep nothing, and
        no later lister joins them)."""
        for after in list(self._afters.get(key, ())):
            self._remove(key, after)
        if key in self._fetching:
            self._drops += 1
            self._dropped[key] = self._drops
            for k in [k for k in self._inflight if k[0] == key]:
                del self._inflight[k]
