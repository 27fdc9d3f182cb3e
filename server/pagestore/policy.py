"""Which READY page of a cache dir goes first when room is needed: by recency or by next use.

Training reads every sample once per epoch in an order the sampler knows in advance. Under such a
cyclic scan larger than the cache, LRU keeps exactly the pages needed last (DESIGN.md s7). When the
worker knows the future (jobs register their read order: server/worker/plans.py), the page whose
next use lies furthest ahead goes first (Belady's rule, optimal for a known future); pages with no
known next use count as furthest and leave first, least recently used among them.

Both orders are per cache dir and guarded by the page store's lock (callers hold it). Each costs
O(log n) per access (a plan-driven order places the pages read since its last decision when it
next decides: a dict entry a read until then): a plan-driven order keeps a max-heap of next uses with lazy deletion (a page
whose key changes is pushed again; the stale item is skipped when it surfaces) and a min-heap of
the same keys, so a page whose planned use went by without a read (the job skipped it, or its
reads came through descriptors held by the client) is found and given its next use again.

A plan-driven order rests while its dir has room to spare (REST_ROOM_FRACTION): the common case
of a data set the cache holds, where no page ever leaves. At rest it asks no next use (reads,
new pages and replans cost a dict operation or nothing) and wakes, owing a replan of every page,
when the dir nears its quota.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

__all__ = ["EvictionOrder", "LruOrder", "NextUseOrder", "NextUse"]

#: Reads a plan-driven order keeps unplaced at most (``NextUseOrder.touch``): the first decision
#: after a warm pass places them all at once, ~4 us each (8,192: ~35 ms under the store's lock,
#: once); past it the oldest are placed SETTLE_CHUNK at a time, as reads arrive (as eager
#: placing would cost: a pass over more pages than this gains nothing and loses nothing).
MAX_READ_BACKLOG = 8192
SETTLE_CHUNK = 1024

#: A plan-driven order rests while its dir has this much room (the larger of a share of the
#: quota and a floor in bytes): no page leaves before the dir fills, so no page's next use is
#: asked and reads only keep the LRU order of the pages placed nowhere. It wakes when the room
#: falls below the second pair (hysteresis), owing a replan of every page (``replan_due``). A
#: warm epoch of a data set the cache holds spent most of the worker's CPU on keeping an order
#: nothing was evicted by (docs/performance.md, "The worker at rest").
REST_ROOM_FRACTION, REST_ROOM_MIN_BYTES = 0.25, 64 << 20
WAKE_ROOM_FRACTION, WAKE_ROOM_MIN_BYTES = 0.125, 32 << 20
#: A woken order of at most this many pages replans on the spot when asked to pick (a few ms);
#: a larger one picks by the order it has (pages placed at rest leave first, least recently read
#: first) until the worker's replan thread has been through it (PageStore.replan, in slices).
SYNC_REPLAN_PAGES = 8192

#: A page's next use: (estimated time of next use or math.inf, the time its planned use ends:
#: after that it is stale and asked for again). Given by the worker's plan table, which also
#: takes a third argument: a moment (``PlanTable.moment``) to answer as of, instead of now.
NextUse = Callable[..., tuple[float, float]]


class EvictionOrder(Protocol):
    """The READY pages of one dir in the order they leave (caller holds the store's lock)."""

    def __len__(self) -> int: ...
    def __contains__(self, digest: str) -> bool: ...
    def add(self, entry: Any) -> None: ...
    def touch(self, entry: Any, moment: Any = None) -> None: ...
    def remove(self, entry: Any) -> None: ...
    def pick(self, need: int, now: float) -> list[Any] | None: ...
    def first(self) -> Any | None: ...
    def entries(self) -> Iterator[Any]: ...


def _pick_from(candidates: Iterator[Any], need: int, now: float, victims: list[Any]) -> int:
    """Take candidates until ``need`` bytes are freed; a page a client may still hold open is
    taken but frees nothing until its hold ends. Returns what is still needed."""
    for entry in candidates:
        if need <= 0:
            break
        victims.append(entry)
        if entry.held_until <= now:
            need -= entry.size
    return need


class LruOrder:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._pages: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, digest: str) -> bool:
        return digest in self._pages

    def add(self, entry: Any) -> None:
        self._pages[entry.digest] = entry

    def touch(self, entry: Any, moment: Any = None) -> None:
        if entry.digest in self._pages:
            self._pages.move_to_end(entry.digest)

    def remove(self, entry: Any) -> None:
        self._pages.pop(entry.digest, None)

    def pick(self, need: int, now: float) -> list[Any] | None:
        victims: list[Any] = []
        left = _pick_from(iter(self._pages.values()), need, now, victims)
        return victims if left <= 0 else None

    def first(self) -> Any | None:
        return next(iter(self._pages.values()), None)

    def entries(self) -> Iterator[Any]:
        return iter(list(self._pages.values()))


class NextUseOrder:
    """Furthest next use first; pages with no known next use before all others, LRU among them."""

    name = "future"

    def __init__(self, next_use: NextUse, moment: Callable[[], Any] | None = None,
                 next_uses: Callable[..., list[tuple[float, float]]] | None = None,
                 room: Callable[[], int] | None = None, quota: int = 0) -> None:
        """``moment()``: where the plans stand now, for a next use asked later as of now
        (``next_use(pid, used, moment)``); without it, each read is placed as it happens.
        ``next_uses(pids, used)``: ``next_use`` of many pages in one call (``replan_many``).
        ``room()``: the dir's free bytes of its ``quota``; with it the order rests while the dir
        has room to spare (REST_ROOM_FRACTION); a dir too small for that never rests."""
        self._rest_room = max(int(quota * REST_ROOM_FRACTION), REST_ROOM_MIN_BYTES)
        self._wake_room = max(int(quota * WAKE_ROOM_FRACTION), WAKE_ROOM_MIN_BYTES)
        self._room = room if room is not None and quota > self._rest_room else None
        self.resting = self._room is not None  # an empty dir has all its room
        self.replan_due = False  # woke from rest: every page's next use is to be asked (PageStore.replan)
        self._next_use = next_use
        self._next_uses = next_uses
        self._moment = moment
        self._unknown: OrderedDict[str, Any] = OrderedDict()
        self._planned: dict[str, tuple[int, Any]] = {}  # digest -> (seq of its live heap items, entry)
        self._furthest: list[tuple[float, int, str]] = []  # max-heap of (-next use, seq, digest)
        self._stale_at: list[tuple[float, int, str]] = []  # min-heap of (use ends, seq, digest)
        self._seq = 0
        # Pages read since the order last decided something, in read order, with the moment of
        # the read: placed (their next use asked as of that moment) when it next decides
        # (``_settle``), not per read. A warm epoch whose pages all fit decides nothing: its
        # reads (thousands a second, reported by clients) cost a dict entry each instead of a
        # plan lookup and two heap pushes (~5 us of the worker's Python a read, on the core the
        # training process needs). The order it decides by is the one eager placing would give.
        self._read: dict[str, tuple[Any, Any]] = {}

    def __len__(self) -> int:
        return len(self._unknown) + len(self._planned)

    def __contains__(self, digest: str) -> bool:
        return digest in self._unknown or digest in self._planned

    def touch(self, entry: Any, moment: Any = None) -> None:
        """A read: the page's use now is over, its next one counts. ``moment``: the plans'
        moment of the read (one for a batch of reads; taken here if None)."""
        digest = entry.digest
        if self.rests():
            if digest in self._unknown:
                self._unknown.move_to_end(digest)
            return
        if digest not in self:
            return
        if self._moment is None:
            self._place(entry, used=True)
            return
        read = self._read
        read.pop(digest, None)  # to the end: the read order is the LRU order among unknown pages
        read[digest] = (entry, self._moment() if moment is None else moment)
        if len(read) > MAX_READ_BACKLOG:  # a pass over more pages than that: the oldest reads now
            self._settle(SETTLE_CHUNK)

    def moment(self) -> Any:
        """The plans' moment now (None: this order places reads as they happen)."""
        return None if self._moment is None else self._moment()

    def rests(self) -> bool:
        """Whether the order rests now (its dir has room to spare: nothing will leave soon);
        asking moves it between rest and waking, with hysteresis."""
        room = self._room
        if room is None:
            return False
        free = room()
        if self.resting:
            if free < self._wake_room:
                self.resting = False
                self.replan_due = True
        elif free >= self._rest_room:
            self.resting = True
        return self.resting

    def add(self, entry: Any) -> None:
        if self.rests():  # placed nowhere until the order wakes (and replans every page)
            self._put(entry, math.inf, math.inf)
            return
        self._settle()  # reads before this page was added go before it in the LRU order
        self._place(entry, used=False)

    def replan(self, entry: Any) -> None:
        """The plans changed: ask the page's next use again (its use now is not over)."""
        self.replan_many([entry])

    def replan_many(self, entries: list[Any]) -> None:
        """``replan`` of many pages, their next uses asked in one call where the plans can."""
        if self.rests():
            return
        mine = [entry for entry in entries if entry.digest in self]
        for entry in mine:
            self._read.pop(entry.digest, None)
        if self._next_uses is None:
            for entry in mine:
                self._place(entry, used=False)
            return
        for entry, (when, stale_at) in zip(mine, self._next_uses([entry.pid for entry in mine], False)):
            self._put(entry, when, stale_at)

    def remove(self, entry: Any) -> None:
        self._read.pop(entry.digest, None)
        self._unknown.pop(entry.digest, None)
        self._planned.pop(entry.digest, None)  # its heap items are skipped when they surface
        self._compact()

    def key(self, entry: Any) -> float:
        """The page's next use as ordered now (math.inf: none known)."""
        self._settle()
        return entry.next_use if entry.digest in self._planned else math.inf

    def _settle(self, limit: int | None = None) -> None:
        """Place the pages read since the last decision (the oldest ``limit``), in read order."""
        read = self._read
        if not read:
            return
        if limit is None or limit >= len(read):
            self._read = {}
            batch: Iterable[tuple[str, tuple[Any, Any]]] = read.items()
        else:
            batch = list(itertools.islice(read.items(), limit))
            for digest, _ in batch:
                del read[digest]
        if self._next_uses is None:
            for digest, (entry, moment) in batch:
                if digest in self._unknown or digest in self._planned:
                    self._place(entry, used=True, moment=moment)
            return
        # Reads reported together share their moment (the same object): one call a run of them.
        for _, items in itertools.groupby(batch, key=lambda item: id(item[1][1])):
            run = [(entry, moment) for digest, (entry, moment) in items
                   if digest in self._unknown or digest in self._planned]
            if run:
                answers = self._next_uses([entry.pid for entry, _ in run], True, run[0][1])
                for (entry, _), (when, stale_at) in zip(run, answers):
                    self._put(entry, when, stale_at)

    def _place(self, entry: Any, used: bool, moment: Any = None) -> None:
        if moment is None:
            when, stale_at = self._next_use(entry.pid, used)
        else:
            when, stale_at = self._next_use(entry.pid, used, moment)
        self._put(entry, when, stale_at)

    def _put(self, entry: Any, when: float, stale_at: float) -> None:
        digest = entry.digest
        entry.next_use = when
        if math.isinf(when):
            self._planned.pop(digest, None)
            self._unknown[digest] = entry
            self._unknown.move_to_end(digest)
            return
        self._unknown.pop(digest, None)
        self._seq += 1
        self._planned[digest] = (self._seq, entry)
        heapq.heappush(self._furthest, (-when, self._seq, digest))
        heapq.heappush(self._stale_at, (stale_at, self._seq, digest))
        self._compact()

    def _live(self, seq: int, digest: str) -> Any | None:
        known = self._planned.get(digest)
        return known[1] if known is not None and known[0] == seq else None

    def _compact(self) -> None:
        """Drop stale heap items once they outnumber the live ones (bounds memory at 2x)."""
        live = len(self._planned)
        if len(self._furthest) > 2 * live + 64:
            self._furthest = [item for item in self._furthest if self._live(item[1], item[2]) is not None]
            heapq.heapify(self._furthest)
        if len(self._stale_at) > 2 * live + 64:
            self._stale_at = [item for item in self._stale_at if self._live(item[1], item[2]) is not None]
            heapq.heapify(self._stale_at)

    def replan_all(self) -> None:
        """Ask every page's next use again (an order woken from rest owes that)."""
        self.replan_due = False
        self.replan_many(list(self.entries()))

    def pick(self, need: int, now: float) -> list[Any] | None:
        if not self.rests() and self.replan_due and len(self) <= SYNC_REPLAN_PAGES:
            self.replan_all()
        self._settle()
        victims: list[Any] = []
        left = _pick_from(iter(self._unknown.values()), need, now, victims)  # removed by the caller after
        if left > 0:
            left = self._pick_planned(left, now, victims)
        return victims if left <= 0 else None

    def _pick_planned(self, need: int, now: float, victims: list[Any]) -> int:
        """Pop planned pages furthest first (pushed back if the room cannot be made)."""
        taken: list[tuple[float, int, str]] = []
        heap = self._furthest
        while need > 0 and heap:
            item = heapq.heappop(heap)
            entry = self._live(item[1], item[2])
            if entry is None:
                continue
            taken.append(item)
            victims.append(entry)
            if entry.held_until <= now:
                need -= entry.size
        if need > 0:
            for item in taken:
                heapq.heappush(heap, item)
        return need

    def furthest(self) -> float:
        """The next use of the page that would leave first among planned ones (-inf: none)."""
        self._settle()
        heap = self._furthest
        while heap and self._live(heap[0][1], heap[0][2]) is None:
            heapq.heappop(heap)
        return -heap[0][0] if heap else -math.inf

    def has_unknown(self) -> bool:
        self._settle()
        return bool(self._unknown)

    def first(self) -> Any | None:
        self._settle()
        if self._unknown:
            return next(iter(self._unknown.values()))
        heap = self._furthest
        while heap:
            entry = self._live(heap[0][1], heap[0][2])
            if entry is not None:
                return entry
            heapq.heappop(heap)
        return None

    def stale(self, now: float) -> list[Any]:
        """Pages whose planned use has ended (by the plan's clock) without a read moving them on
        (a page read since it was placed is placed anew when the order next decides)."""
        out: list[Any] = []
        if self.rests():
            return out
        heap, read = self._stale_at, self._read
        while heap and heap[0][0] <= now:
            _, seq, digest = heapq.heappop(heap)
            entry = self._live(seq, digest)
            if entry is not None and digest not in read:
                out.append(entry)
        return out

    def entries(self) -> Iterator[Any]:
        return iter(list(self._unknown.values()) + [e for _, e in self._planned.values()])
