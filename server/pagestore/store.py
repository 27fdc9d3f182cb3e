"""The worker's page store: a hard-bounded on-disk cache of fixed-size object pages.

Why it is built this way (DESIGN.md s2-s4):

* One plain file per page, ``<dir>/pages/<digest[:2]>/<digest>``, payload at offset 0 so later
  code can ``sendfile`` it or pass the fd to a local client; a 32-byte trailer carries the xxh3_64
  checksum (see :mod:`cachefs.pagefile`). Every read verifies it; a bad page is dropped and
  reported as a miss, never served.
* Atomic writes: ``<dir>/tmp/<digest>.<pid>-<count>.tmp`` then ``os.replace``. Page files are not
  fsynced: a page torn by a power loss fails its size/checksum check and is dropped.
* The quota is never exceeded, not even transiently (the JuiceFS #3546 complaint): a put reserves
  its bytes under the lock, turning least-recently-used READY pages of its dir into its own
  reservation, and unlinks those victims *before* it writes. Entries move
  WRITING -> READY -> REMOVING -> gone; only READY pages are served or evicted.
* No global lock is held during file or sqlite I/O; the lock only guards the in-memory index.
* A page's dir is chosen by weighted rendezvous hashing of its digest (weight = quota).
* Durable index: one ``diskcache.Cache`` per dir (``<dir>/index``), digest ->
  ``(mount, key, version, index, file_size, checksum, last_access)``. Written behind
  (:mod:`cachefs.server.pagestore.rows`): a page is READY once its file is renamed into place; its
  row, or its deletion (queued before the unlink), reaches SQLite in a batch, one transaction per
  dir, within ``row_delay`` seconds (a flush thread), sooner when ``batch_rows`` are queued, and
  on close. A crash leaves at worst orphan files (their pages are lost) or rows without files.
* A restart trusts the index (#47): no stat or open per page, so a million pages load in seconds.
  The rule that makes this safe: a row is queued only after its page file was written complete
  and renamed into place, so a committed row never names a partial file, whatever instant a
  process is killed at (a power loss may still tear or lose a file: its checksum or size fails).
  Each page is verified on its first read as on every read, and a missing or bad file is then
  dropped and refetched. A row without a file keeps its bytes counted until it is read or evicted
  (at most the operations queued at the crash). Orphan files and tmp files are removed behind
  (sweep.py): tmp files after every start, orphans only after an unclean stop (a clean close
  leaves a ``clean`` mark, dirs.py) or an index reset; a put of a page being swept is refused.
  A large index is loaded behind while the store serves (``_load_behind``).
  ``last_access`` is batched too: the same thread
  writes it every ``flush_interval`` seconds, and only where the index's value is at least
  ``access_granularity`` seconds (600 by default) older than the page's last read, like the
  ``relatime`` mount option: epochs that read every page again write each page's row once in
  ten minutes, not every epoch (each row costs ~16 us of the worker's CPU, on the thread that
  also writes new pages' rows: 200,000 pages read every ~15 s and written once a minute would be
  ~3,300 rows a second). A clean close writes every page's last read, so a
  restart keeps the exact order; a crash keeps it to within the granularity (an order among
  pages with no planned use: plans place the rest).

Index settings (diskcache, WAL, synchronous=NORMAL, eviction_policy="none") and the measurements
behind them are in :mod:`cachefs.server.pagestore.dirs`: a small index insert costs 25 us, ~1% of writing
a 1 MiB page file (2,650 us).
"""

from __future__ import annotations

import enum
import errno
import gc
import heapq
import logging
import math
import os
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from cachefs.localhost import HELD_CLOSE_SECONDS
from cachefs.pagenames import page_digest
from cachefs.runtimedir import trusted_path
from cachefs.server.pagestore.dirs import INDEX_ERRORS, CacheDirInUseError, DirHandle, IndexReset
from cachefs.server.pagestore.health import DiskHealth
from cachefs.server.pagestore.passing import PassingPages
from cachefs.server.pagestore.policy import NextUse, NextUseOrder
from cachefs.server.pagestore.rows import RowQueue
from cachefs.server.pagestore.sweep import Sweeper
from cachefs.pagefile import (
    TRAILER_SIZE,
    CorruptPageError,
    read_page,
    read_page_into,
    write_page_file,
)

__all__ = ["CacheDir", "CacheDirInUseError", "PageId", "PageStore", "PageStoreStats"]

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 10.0
#: How much older than a page's last read its index row's access time may be (see the docstring).
ACCESS_GRANULARITY_S = 600.0
#: An index of more rows than this is loaded behind while the store serves (_load_behind).
BACKGROUND_LOAD_ROWS = 100_000
_BAD_FILE_ERRNOS = frozenset({errno.EIO, errno.ENODATA, errno.EBADMSG, errno.EISDIR, errno.ENOTDIR})


@dataclass(frozen=True, slots=True)
class PageId:
    """Identity of one cached page; the version is part of it, so a changed object never hits."""

    mount: str
    key: str
    version: str
    index: int

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"page index must be >= 0, got {self.index}")

    def digest(self) -> str:
        """Stable 32-hex-digit name: xxh3_128 over length-prefixed fields (never Python's hash())."""
        return page_digest(self.mount, self.key, self.version, self.index)


@dataclass(frozen=True)
class CacheDir:
    """One cache directory and its hard bound on page-file bytes (payload + trailer)."""

    path: str
    quota_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.quota_bytes, int) or self.quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be a positive int, got {self.quota_bytes!r}")
        if not self.path:
            raise ValueError("cache dir path must not be empty")


@dataclass(frozen=True)
class PageStoreStats:
    """A point-in-time snapshot of the store's counters (for metrics and tests)."""

    pages: int  # READY pages (servable)
    used_bytes: int  # page-file bytes on disk plus space reserved by writes in flight
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt_pages: int
    put_failures: int
    disk_errors: int = 0  # failed page writes, and reads failing with a disk errno
    degraded: bool = False  # a cache dir's last write failed: reads pass through to the store
    held_unlinked_bytes: int = 0  # in used_bytes: unlinked pages local clients may still hold open
    bypassed: int = 0  # pages used later than every cached one: cached only until the next put
    policy: str = "lru"  # which page leaves first: "lru" or "future" (policy.py)
    passing_dropped: int = 0  # pages not admitted that left memory before their reader took them
    index_pending: int = 0  # index rows and deletions not yet committed (rows.py): a crash loses those pages
    # CPU seconds the writing threads spent in page-file writes (payload copied into the page
    # cache, trailer, rename): what caching a cold byte costs, apart from fetching it
    write_cpu_s: float = 0.0


class _State(enum.Enum):
    WRITING = 1  # bytes reserved, file not yet visible: never served, never evicted
    READY = 2  # file and index entry in place: served, evictable
    REMOVING = 3  # being unlinked by some thread: not served; a new put of it is refused


@dataclass(eq=False, slots=True)
class _Entry:
    pid: PageId
    digest: str
    dir: DirHandle
    size: int  # page file bytes, payload + trailer
    state: _State
    last_access: float
    checksum: int = 0
    cancelled: bool = False  # deleted while WRITING: the writer removes it when done
    held_until: float = 0.0  # monotonic: local clients may hold its descriptor open until then
    next_use: float = math.inf  # when a registered plan reads it next (policy.NextUseOrder)
    saved_access: float = 0.0  # the last_access its index row holds (or will: a queued row)

    @property
    def path(self) -> str:
        return self.dir.page_path(self.digest)

    def record(self) -> tuple[str, str, str, int, int, int, float]:
        p = self.pid
        return (p.mount, p.key, p.version, p.index, self.size, self.checksum, self.last_access)


class PageStore:
    """Thread-safe page cache over one or more quota-bounded directories (one process per dir)."""

    def __init__(
        self, dirs: Sequence[CacheDir], page_size: int = 1 << 20, *, flush_interval: float = 2.0,
        next_use: NextUse | None = None, plan_moment: Callable[[], Any] | None = None,
        next_uses: Callable[..., list[tuple[float, float]]] | None = None, row_delay: float = 0.1,
        batch_rows: int = 512, max_rows: int = 8192, access_granularity: float = ACCESS_GRANULARITY_S,
        degraded_settle_s: float = 0.0, background_load_rows: int = BACKGROUND_LOAD_ROWS,
    ) -> None:
        """With ``next_use`` (the worker's plan table, server/worker/plans.py), pages leave by
        furthest next use (policy.NextUseOrder; with ``plan_moment``, reads are placed in that
        order when it next decides, as of their moment; ``next_uses``, many pages' next uses in
        one call, for a replan); without, least recently used first. Index rows
        wait up to ``row_delay`` s for a batch of ``batch_rows``; a put that finds ``max_rows``
        queued writes them itself (the flush thread fell behind). A read's time reaches the
        index only once it is ``access_granularity`` s past the time the index holds (and at
        close). A dir stays degraded ``degraded_settle_s`` s past its last disk error (health.py).
        An index of more than ``background_load_rows`` rows is loaded behind (see ``_load_behind``)."""
        if not dirs or not all(isinstance(d, CacheDir) for d in dirs):
            raise ValueError("dirs must be a non-empty sequence of CacheDir")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if flush_interval <= 0:
            raise ValueError("flush_interval must be > 0")
        if not access_granularity >= 0:
            raise ValueError(f"access_granularity must be >= 0 seconds, got {access_granularity!r}")
        self._access_granularity = float(access_granularity)
        roots = [os.path.realpath(trusted_path(d.path)) for d in dirs]  # no other user's symlink on the way
        if len(set(roots)) != len(roots):
            raise ValueError("cache dirs must be distinct")
        self.page_size = page_size
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # signalled when _busy drops to 0
        self._busy = 0
        self._closed = False
        self._entries: dict[str, _Entry] = {}
        # mount -> key -> its pages' digests: one page's digest itself, a set only for several
        # (a one-element set costs ~220 bytes more: most small objects are one page; _digests_of)
        self._by_object: dict[str, dict[str, str | set[str]]] = {}
        self._dirty: dict[str, _Entry] = {}  # pages whose last_access is to be written at the next flush
        self._sweeping: set[str] = set()  # orphan files being removed (sweep.py): puts of them refused
        # While the index loads behind (_load_behind): pages that left meanwhile (the loader must
        # not bring them back), prefixes removed meanwhile (mount, key or prefix, exact), and
        # pages a read loaded ahead of the loader (moved to the recent end when it is done).
        self._loading = False
        self.loaded = threading.Event()
        self._gone: set[str] = set()
        self._tombstones: list[tuple[str, str, bool]] = []
        self._loaded_ahead: list[_Entry] = []
        self._rows = RowQueue(self._lock, batch_rows=batch_rows, max_rows=max_rows, delay=row_delay)
        self._hits = self._misses = self._evictions = self._corrupt = self._put_failures = 0
        self._write_cpu_s = 0.0
        self._bypassed = 0  # pages used later than every cached one: served from memory, not admitted
        quota = sum(d.quota_bytes for d in dirs)
        # Pages not admitted wait here for their reader: fetched for a read under way, or ahead of
        # one by the plan's prefetch (whose window is bounded by this: passing_bytes).
        self.passing_bytes = max(64 * page_size, min(256 << 20, quota // 8))
        self._passing = PassingPages(self.passing_bytes)
        self._next_use = next_use
        self.policy = "future" if next_use is not None else "lru"
        # Unlinked pages that local clients may still read through held descriptors (their
        # bytes stay counted in their dir's ``used`` until then): (until, seq, dir, bytes).
        self._held: list[tuple[float, int, DirHandle, int]] = []
        self._held_seq = 0
        self._held_bytes = 0
        # Holds on cached pages: digest -> (until, bytes), and a heap of (until, digest) to end
        # them (an item whose until is no longer the digest's is skipped). With ``_held`` (the
        # unlinked ones) an upper bound of what clients may hold open now.
        self._holds: list[tuple[float, str]] = []
        self._hold_records: dict[str, tuple[float, int]] = {}
        self._holds_bytes = 0
        self._unlink_listener: Callable[[list[str]], None] | None = None
        self.health = DiskHealth(degraded_settle_s)
        self._dirs: list[DirHandle] = []
        unclean: list[bool] = []
        try:
            rows = 0
            for cfg, root in zip(dirs, roots):
                handle = DirHandle(root, cfg.quota_bytes, page_size)
                if next_use is not None:
                    handle.order = NextUseOrder(next_use, plan_moment, next_uses, quota=cfg.quota_bytes,
                                                room=lambda h=handle: h.quota - h.used)
                self._dirs.append(handle)
                unclean.append(not self._dirs[-1].take_clean_mark())
                rows += self._dirs[-1].row_count()
            self.sweeper = Sweeper(self._dirs, unclean, self._claim_orphans, self._release_orphans)
            self._stop = threading.Event()
            self._loader: threading.Thread | None = None
            if rows > background_load_rows:
                self._loading = True
                self._loader = threading.Thread(target=self._load_behind, name="pagestore-load", daemon=True)
                self._loader.start()
            else:
                self._load_behind()
        except BaseException:
            self._release_dirs()
            raise
        # Names of tmp files: this process's id and a count (unique among this store's writers;
        # a crashed process's leftovers are removed at the next start).
        self._tmp_names = itertools.count()
        self._flusher = threading.Thread(
            target=self._flush_loop, args=(flush_interval,), name="pagestore-flush", daemon=True
        )
        self._flusher.start()

    # ----------------------------------------------------------------- public API
    def get(self, pid: PageId) -> bytes | None:
        """Return the page's verified bytes, or None on a miss (a bad page is dropped first)."""
        entry = self._lookup(pid)
        if entry is None:
            return self._passing.get(pid.digest())
        try:
            data = read_page(entry.path, entry.size, entry.checksum)
        except (CorruptPageError, OSError) as exc:
            self._read_failed(entry, exc)
            return None
        self._read_done(hit=True)
        return data

    def get_into(self, pid: PageId, buf: memoryview) -> int | None:
        """Like :meth:`get` but ``readinto`` the caller's (ideally aligned) buffer; returns length.

        Raises ValueError if the page does not fit in ``buf``.
        """
        entry = self._lookup(pid)
        if entry is None:
            passing = self._passing.get(pid.digest())
            if passing is None:
                return None
            if len(passing) > len(buf):
                raise ValueError(f"page of {len(passing)} bytes does not fit a buffer of {len(buf)}")
            memoryview(buf)[:len(passing)] = passing
            return len(passing)
        try:
            n = read_page_into(entry.path, entry.size, memoryview(buf), entry.checksum)
        except (CorruptPageError, OSError) as exc:
            self._read_failed(entry, exc)
            return None
        except BaseException:
            self._read_done(hit=False)
            raise
        self._read_done(hit=True)
        return n

    def open_page(self, pid: PageId) -> int | None:
        """A read-only descriptor of the page's file (payload then trailer), or None on a miss.

        For short-circuit reads: the caller hands the descriptor to a local client, which
        verifies the trailer's checksum itself. An eviction after this only unlinks the name;
        the open descriptor keeps the bytes readable until it is closed.
        """
        entry = self._lookup(pid)
        if entry is None:
            return self._passing.open(pid.digest())  # served, not admitted (passing.py): read once
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:  # evicted under our feet (a miss), or gone since a restart (dropped)
            self._read_failed(entry, exc)
            return None
        except BaseException:
            self._read_done(hit=False)
            raise
        self._read_done(hit=True)
        return fd

    def put(self, pid: PageId, data: bytes | memoryview) -> bool:
        """Store a page; True if it is now cached (pages are immutable: an existing one is kept).

        False if it cannot fit (bigger than its dir's quota, or the quota is held by in-flight
        writes), on a disk/index error (counted in put_failures), or when the same page is being
        written or removed by another thread right now, or was deleted while this put wrote it.
        Raises ValueError only for a payload larger than page_size (a caller bug).
        """
        payload = memoryview(data).cast("B")
        if payload.nbytes > self.page_size:
            raise ValueError(f"page of {payload.nbytes} bytes exceeds page_size {self.page_size}")
        digest = pid.digest()
        target = self._target(digest)
        size = payload.nbytes + TRAILER_SIZE
        with self._lock:
            if self._closed:
                return False
            existing = self._entries.get(digest)
            if existing is not None:
                if existing.state is _State.READY:
                    self._touch(existing)
                    return True
                return False
            if digest in self._sweeping or self._loading:  # an orphan being unlinked (sweep.py); the
                return False  # quota's use is not known until the index is loaded: nothing added
            now = time.monotonic()
            self._release_held(now)
            if self._next_use is not None and self._not_worth_room(target, pid, size):
                self._bypassed += 1
                self._passing.add(digest, data if isinstance(data, bytes) else bytes(payload))
                return False
            victims = self._pick_victims(target, size, now)
            if victims is None:
                self._put_failures += 1
                return False
            for v in victims:
                v.state = _State.REMOVING
                target.order.remove(v)
            freed = sum(v.size for v in victims if not self._charge_held(v, now))
            target.used += size - freed  # the victims' bytes become this put's reservation
            self._evictions += len(victims)
            entry = _Entry(pid, digest, target, size, _State.WRITING, time.time())
            self._add(entry)
            self._busy += 1
        return self._write(entry, payload, victims)  # leaves (_busy) itself

    # ------------------------------------------------------- plan-driven eviction
    def _not_worth_room(self, target: DirHandle, pid: PageId, size: int) -> bool:  # caller holds the lock
        """True when making room for the page would push out only pages used sooner than it: it
        is then served from memory for a few seconds (passing.py) and not admitted."""
        order = target.order
        assert isinstance(order, NextUseOrder) and self._next_use is not None
        if target.used + size <= target.quota or order.has_unknown():
            return False
        furthest = order.furthest()
        # A use starting now or within the job's read-ahead (a reader waits, or will in a moment)
        # is served either way, from here or from memory: what counts is the use after it (the
        # oracle skips a use under way when told ``used``).
        return furthest > -math.inf and self._next_use(pid, True)[0] >= furthest

    def worth_admitting(self, pid: PageId) -> bool:
        """False when the page would not be admitted if fetched now (put(): it would only push out
        pages used sooner): a load or the plan's prefetch leaves it to its reader. Always True under LRU."""
        if self._next_use is None:
            return True
        digest = pid.digest()
        target = self._target(digest)
        size = self.page_size + TRAILER_SIZE
        if target.used + size <= target.quota:  # room: admitted (a guess either way; no lock for it)
            return True
        with self._lock:
            return not self._not_worth_room(target, pid, size)

    def replan(self) -> int:
        """The registered plans changed, or an order woke from rest: every cached page's next use
        is asked again (not in a dir whose order rests: it replans when it wakes). In slices, so
        reads and puts go on between them; returns the pages looked at."""
        if self._next_use is None:
            return 0
        done = 0
        for d in self._dirs:
            with self._lock:
                order = d.order
                assert isinstance(order, NextUseOrder)
                if order.rests():
                    continue
                order.replan_due = False
                entries = list(order.entries())
            for i in range(0, len(entries), 4096):
                with self._lock:
                    d.order.replan_many([entry for entry in entries[i:i + 4096]  # type: ignore[attr-defined]
                                         if entry.state is _State.READY])
                done += min(4096, len(entries) - i)
        return done

    def wants_replan(self) -> bool:
        """Whether an order woke from rest since its last replan (the worker then calls ``replan``)."""
        return any(getattr(d.order, "replan_due", False) for d in self._dirs)

    def refresh_stale(self) -> int:
        """Pages whose planned use went by unread (a skipped sample, reads through held
        descriptors not yet reported) get their next use again; returns how many."""
        if self._next_use is None:
            return 0
        now, n = time.time(), 0
        with self._lock:
            for d in self._dirs:
                order = d.order
                assert isinstance(order, NextUseOrder)
                stale = order.stale(now)
                order.replan_many(stale)
                n += len(stale)
        return n

    # ------------------------------------------------------- held descriptors
    def dirs(self) -> list[tuple[str, int]]:
        """(root, quota) of each cache dir: with a page's digest, where its file is (pagenames.py)."""
        return [(d.root, d.quota) for d in self._dirs]

    def set_unlink_listener(self, listener: Callable[[list[str]], None] | None) -> None:
        """``listener(digests)`` runs just before page files are unlinked (server/worker/handles.py
        invalidates held descriptors there). It must not call back into the store."""
        self._unlink_listener = listener

    def hold(self, digests: Iterable[str], until: float) -> None:
        """Local clients may read these pages through held descriptors until ``until`` (monotonic):
        a page that leaves the cache before then stays charged to the quota until its holders
        must have closed it (_charge_held)."""
        with self._lock:
            for digest in digests:
                entry = self._entries.get(digest)
                if entry is not None and entry.state is _State.READY and until > entry.held_until:
                    entry.held_until = until
                    if self._hold_records.pop(digest, None) is None:
                        self._holds_bytes += entry.size
                    self._hold_records[digest] = (until, entry.size)
                    heapq.heappush(self._holds, (until, digest))
            if len(self._holds) > 2 * len(self._hold_records) + 64:  # extended holds leave stale items
                self._holds = [(u, d) for u, d in self._holds if self._hold_records.get(d, (None,))[0] == u]
                heapq.heapify(self._holds)

    def worth_holding(self, digests: list[str]) -> bool:
        """Whether a client that can open these pages by name should also hold their descriptors.

        A held page that leaves the cache stays charged to the quota until its holders must
        have closed it, so under plan-driven eviction (a dir with pages that registered plans
        read), where pages leave by the plans' order and are read again an epoch later, a hold
        buys a few microseconds a read (the page is opened by name instead) at the cost of cache
        room: not worth it (nor while the order rests: its pages are placed nowhere, and the
        answer stays the one the plans would give). Without plans (plain reads by recency) holds
        keep their place."""
        if self._next_use is None:
            return True
        with self._lock:
            for digest in digests:
                entry = self._entries.get(digest)
                if entry is None or entry.state is not _State.READY:
                    return False
                order = entry.dir.order
                if isinstance(order, NextUseOrder) and (order.resting or order.key(entry) != math.inf
                                                        or order.furthest() != -math.inf):
                    return False
        return True

    def held_unlinked_bytes(self) -> int:
        """Bytes of unlinked page files that clients may still hold open (charged to the quota)."""
        with self._lock:
            self._release_held(time.monotonic())
            return self._held_bytes

    def held_bytes(self) -> int:
        """Bytes of pages, cached or unlinked, that local clients may hold open now (at most).

        Held pages can be evicted but free nothing for a while, so a worker bounds this, not only
        the unlinked part: were every cached page held, no page could be added."""
        now = time.monotonic()
        with self._lock:
            self._end_holds(now)
            self._release_held(now)
            return self._holds_bytes + self._held_bytes

    def _end_holds(self, now: float) -> None:  # caller holds the lock
        holds, records = self._holds, self._hold_records
        while holds and holds[0][0] <= now:
            until, digest = heapq.heappop(holds)
            record = records.get(digest)
            if record is not None and record[0] == until:
                del records[digest]
                self._holds_bytes -= record[1]

    def touch_digests(self, digests: Iterable[str]) -> int:
        """Reads made through held descriptors: count them as hits and as uses for eviction."""
        n = 0
        moment = self._dirs[0].order.moment() if isinstance(self._dirs[0].order, NextUseOrder) else None
        with self._lock:
            for digest in digests:
                entry = self._entries.get(digest)
                if entry is not None and entry.state is _State.READY:
                    self._touch(entry, moment)
                    n += 1
            self._hits += n
        return n

    def _release_held(self, now: float) -> None:  # caller holds the lock
        held = self._held
        while held and held[0][0] <= now:
            _, _, d, size = heapq.heappop(held)
            d.used -= size
            self._held_bytes -= size

    def _charge_held(self, entry: _Entry, now: float) -> bool:  # caller holds the lock
        """Keep an unlinked page's bytes counted while a client may hold it; True if so.

        Its slot is invalidated before the unlink, and clients close invalidated descriptors
        within HELD_CLOSE_SECONDS (client/transport/handles.py sweeps), so the charge ends then at the
        latest, not when the hold would have: evicted held pages do not shrink the cache for
        minutes."""
        record = self._hold_records.pop(entry.digest, None)
        if record is not None:
            self._holds_bytes -= record[1]  # now counted as unlinked (``_held``)
        if entry.held_until <= now:
            return False
        entry.held_until = min(entry.held_until, now + HELD_CLOSE_SECONDS)
        self._held_seq += 1
        heapq.heappush(self._held, (entry.held_until, self._held_seq, entry.dir, entry.size))
        self._held_bytes += entry.size
        return True

    def contains(self, pid: PageId) -> bool:
        """True if the page is READY (a later get may still miss if it is evicted meanwhile)."""
        return self.contains_digest(pid.digest())

    def available(self, pid: PageId) -> bool:
        """Cached, or waiting in memory for its reader (not admitted)."""
        digest = pid.digest()
        return self.contains_digest(digest) or self._passing.has(digest)

    def passing(self, digest: str) -> bool:
        """True for a page served but not admitted (passing.py): its descriptor is a copy to read once."""
        return self._passing.opened(digest)

    def contains_digest(self, digest: str) -> bool:
        if self._loading:
            self._load_one(digest)
        # No lock: one dict lookup and one attribute read are atomic under the interpreter's lock,
        # and the answer may be stale the moment it is given either way.
        entry = self._entries.get(digest)
        return entry is not None and entry.state is _State.READY

    def holds_object(self, mount: str, key: str) -> bool:
        """True if any page of any version of the object is stored (or being written); while the
        index loads behind, True (may be: the caller asks for metadata, not for the bytes)."""
        return self._loading or self.held_pages(mount, key) > 0

    def holding(self, mount: str, keys: list[str]) -> list[str]:
        """Those of ``keys`` (objects of ``mount``) with any page stored or being written, any
        version; while the index loads behind, all of them (as ``holds_object``)."""
        with self._lock:
            if self._loading:
                return list(keys)
            held = self._by_object.get(mount)
            return [k for k in keys if k in held] if held else []

    def held_pages(self, mount: str, key: str) -> int:
        """Pages of the object stored or being written, any version (from memory: no file touched;
        while the index loads behind, those loaded so far)."""
        # No lock, as contains_digest: a lookup and a len() (of a str or a set) are atomic.
        return len(self._digests_of(mount, key))

    def cached_bytes(self, mount: str, key: str, version: str) -> int:
        """Payload bytes of one version's READY pages: what a read would find, from memory only.

        Lets the worker answer "how much of this object is cached" without touching a file.
        """
        total = 0
        with self._lock:
            for digest in self._digests_of(mount, key):
                entry = self._entries.get(digest)
                if entry is not None and entry.state is _State.READY and entry.pid.version == version:
                    total += entry.size - TRAILER_SIZE
        return total

    def delete(self, pid: PageId) -> bool:
        """Drop one page; True if it was cached or being written (that write is then discarded)."""
        return self._delete_digests([pid.digest()]) > 0

    def delete_object(self, mount: str, key: str) -> int:
        """Drop every version's pages of one object (invalidation); returns the page count (while
        the index loads behind, of those loaded so far: the loader drops the others)."""
        with self._lock:
            if self._loading:
                self._tombstones.append((mount, key, True))
            digests = list(self._digests_of(mount, key))
        return self._delete_digests(digests)

    def other_versions(self, mount: str, key: str, version: str) -> list[str]:
        """Digests of the pages of every version of an object but ``version``."""
        return self.other_versions_many(mount, [(key, version)])

    def other_versions_many(self, mount: str, objects: list[tuple[str, str]]) -> list[str]:
        """``other_versions`` of many objects of ``mount``, (key, version) each, under one lock."""
        out: list[str] = []
        with self._lock:
            keys, entries = self._by_object.get(mount), self._entries
            if not keys:
                return out
            for key, version in objects:
                held = keys.get(key)
                if held is None:
                    continue
                for d in (held,) if isinstance(held, str) else held:
                    e = entries.get(d)
                    if e is not None and e.pid.version != version:
                        out.append(d)
        return out

    def delete_prefix(self, mount: str, prefix: str) -> int:
        """Drop the pages of every object whose key starts with ``prefix``; returns the count (as
        :meth:`delete_object` while the index loads behind)."""
        with self._lock:
            if self._loading:
                self._tombstones.append((mount, prefix, False))
            keys = self._by_object.get(mount, {})
            digests = [d for k, ds in keys.items() if k.startswith(prefix)
                       for d in ((ds,) if isinstance(ds, str) else ds)]
        return self._delete_digests(digests)

    def stats(self) -> PageStoreStats:
        """Snapshot of usage and counters."""
        with self._lock:
            self._release_held(time.monotonic())
            return PageStoreStats(
                pages=sum(len(d.order) for d in self._dirs),
                used_bytes=sum(d.used for d in self._dirs),
                capacity_bytes=sum(d.quota for d in self._dirs),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt_pages=self._corrupt,
                put_failures=self._put_failures,
                disk_errors=self.health.errors,
                degraded=self.health.degraded,
                held_unlinked_bytes=self._held_bytes,
                bypassed=self._bypassed,
                policy=self.policy,
                passing_dropped=self._passing.dropped,
                index_pending=self._rows.pending,
                write_cpu_s=self._write_cpu_s,
            )

    def close(self) -> None:
        """Wait (bounded) for in-flight writes, write the queued index rows and last_access times,
        release the dirs. Idempotent; a restart after it keeps every page."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._idle.wait_for(lambda: self._busy == 0, timeout=_CLOSE_WAIT_S):
                log.warning("page store closing with %d operations still running", self._busy)
        self._stop.set()
        if self._loader is not None:
            self._loader.join(_CLOSE_WAIT_S)
        self.sweeper.stop(_CLOSE_WAIT_S)
        with self._lock:
            self._rows.wake()
        self._flusher.join(timeout=_CLOSE_WAIT_S)
        try:
            self._flush_rows()
            self._flush_rows()  # deletions queued by the first one's failures, if any
            self._flush_access(every=True)
            with self._lock:
                committed = len(self._rows) == 0 and self._busy == 0 and self.loaded.is_set()
            for d, swept in zip(self._dirs, self.sweeper.swept):
                if committed and swept:
                    d.mark_clean()  # the next start trusts the files too: no orphan sweep
        finally:
            self._release_dirs()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _target(self, digest: str) -> DirHandle:
        """The dir that holds the page (rendezvous by score; one dir: no hashing)."""
        dirs = self._dirs
        return dirs[0] if len(dirs) == 1 else max(dirs, key=lambda d: d.score(digest))

    # ------------------------------------------------------------ read helpers
    def _lookup(self, pid: PageId) -> _Entry | None:
        digest = pid.digest()
        if self._loading:
            self._load_one(digest)
        with self._lock:
            entry = self._entries.get(digest)
            if self._closed or entry is None or entry.state is not _State.READY:
                self._misses += 1
                return None
            self._touch(entry)
            self._busy += 1
            return entry

    def _read_done(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1
            self._busy -= 1
            if self._busy == 0:
                self._idle.notify_all()

    def _read_failed(self, entry: _Entry, exc: BaseException) -> None:
        """Drop a page that failed verification; a page evicted under our feet is a plain miss.

        Only errors that condemn the file drop it: running out of fds or memory must not wipe
        the cache.
        """
        bad = isinstance(exc, (CorruptPageError, FileNotFoundError)) or (
            isinstance(exc, OSError) and exc.errno in _BAD_FILE_ERRNOS
        )
        self.health.failed(entry.dir.root, exc, writing=False)
        try:
            with self._lock:
                self._misses += 1
                if self._entries.get(entry.digest) is not entry or entry.state is not _State.READY:
                    return
                if not bad:
                    log.warning("cannot read page %s: %s", entry.path, exc)
                    return
                entry.state = _State.REMOVING
                entry.dir.order.remove(entry)
                self._corrupt += 1
            log.warning("dropping bad page %s (%s): %s", entry.path, entry.pid, exc)
            self._remove([entry])
        finally:
            self._leave()

    def _touch(self, entry: _Entry, moment: Any = None) -> None:  # caller holds the lock
        entry.dir.order.touch(entry, moment)
        now = entry.last_access = time.time()
        if now - entry.saved_access >= self._access_granularity and \
                not self._rows.queued(entry.digest, entry):  # a queued row carries it: no second write
            self._dirty[entry.digest] = entry

    # ----------------------------------------------------------- write helpers
    def _pick_victims(self, target: DirHandle, size: int, now: float) -> list[_Entry] | None:
        """READY pages to evict so ``size`` fits, in the dir's eviction order (caller holds the
        lock); None if impossible. A page a local client may still hold open is evicted too (its
        holders are told) but frees nothing until its charge ends (policy.py, _charge_held)."""
        need = target.used + size - target.quota
        if need <= 0:
            return []
        return target.order.pick(need, now)

    def _write(self, entry: _Entry, payload: memoryview, victims: list[_Entry]) -> bool:
        """The page's file, then its entry READY and its row queued; leaves the put's ``_busy``
        (with the lock taken after the write when nothing else follows: each acquisition of the
        store's lock is a chance of a convoy behind the interpreter's lock, many puts at once)."""
        left = False
        try:
            d = entry.dir
            if victims:
                stuck = self._unlink(victims)
                with self._lock:
                    self._forget(victims)  # their bytes already belong to this put's reservation
                if stuck:  # a victim file would not go away: its bytes stay used, this put gives up
                    return self._abort(entry, released=entry.size - sum(v.size for v in stuck))
            tmp = os.path.join(d.tmp, f"{entry.digest}.{os.getpid()}-{next(self._tmp_names)}.tmp")
            began = time.thread_time()
            try:
                entry.checksum = write_page_file(tmp, entry.path, payload)
            except OSError as exc:
                self.health.failed(d.root, exc, writing=True, what=f"cannot write page {entry.path}")
                return self._abort(entry, released=entry.size)
            spent = time.thread_time() - began
            self.health.ok(d.root)
            with self._lock:
                self._write_cpu_s += spent
                cancelled = entry.cancelled
                full = False
                if not cancelled:
                    entry.state = _State.READY
                    d.order.add(entry)
                    full = self._rows.put(entry.digest, d, entry)
                else:
                    entry.state = _State.REMOVING
                if not cancelled and not full:
                    self._leave_locked()
                    left = True
            if cancelled:
                self._remove([entry])  # deleted while we wrote it
                return False
            if full:  # the flush thread fell behind: this put waits for the queue to be written
                self._flush_rows()
            return True
        finally:
            if not left:
                self._leave()

    def _abort(self, entry: _Entry, released: int) -> bool:
        with self._lock:
            entry.dir.used -= released
            self._forget([entry])
            self._put_failures += 1
        return False

    # ---------------------------------------------------------- removal helpers
    def _delete_digests(self, digests: Iterable[str]) -> int:
        claimed: list[_Entry] = []
        count = 0
        if self._loading:  # a page not loaded yet is loaded first, so that it leaves for good
            digests = list(digests)
            for digest in digests:
                self._load_one(digest)
        with self._lock:
            if self._closed:
                return 0
            for digest in digests:
                entry = self._entries.get(digest)
                if entry is None or entry.state is _State.REMOVING or entry.cancelled:
                    continue
                count += 1
                if entry.state is _State.WRITING:
                    entry.cancelled = True
                else:
                    entry.state = _State.REMOVING
                    entry.dir.order.remove(entry)
                    claimed.append(entry)
            self._busy += 1
        try:
            self._remove(claimed)
        finally:
            self._leave()
        return count

    def _remove(self, entries: list[_Entry]) -> None:
        """Unlink REMOVING entries (outside the lock), then release their bytes (those of pages
        a client may still hold open only when the hold ends)."""
        stuck = self._unlink(entries)
        with self._lock:
            now = time.monotonic()
            for entry in entries:
                # a stuck file keeps its bytes counted: never over quota
                if entry not in stuck and not self._charge_held(entry, now):
                    entry.dir.used -= entry.size
            self._forget(entries)

    def _unlink(self, entries: list[_Entry]) -> list[_Entry]:
        """Queue the index rows' deletion, then delete the files; returns the entries whose file
        could not be removed. A crash before the deletions reach the index leaves rows without
        files, which recovery drops."""
        if not entries:
            return []
        stuck = []
        listener = self._unlink_listener
        if listener is not None:
            try:
                listener([entry.digest for entry in entries])
            except Exception:  # never let a listener keep a page on disk
                log.exception("unlink listener failed")
        with self._lock:
            for entry in entries:
                self._rows.delete(entry.digest, entry.dir)
        for entry in entries:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove page file %s: %s", entry.path, exc)
                stuck.append(entry)
        return stuck

    def _digests_of(self, mount: str, key: str) -> tuple[str, ...] | set[str]:  # caller holds the lock
        held = self._by_object.get(mount, {}).get(key)
        return () if held is None else (held,) if isinstance(held, str) else held

    def _add(self, entry: _Entry) -> None:  # caller holds the lock
        digest = entry.digest
        self._entries[digest] = entry
        keys = self._by_object.setdefault(entry.pid.mount, {})
        held = keys.get(entry.pid.key)
        if held is None:
            keys[entry.pid.key] = digest
        elif isinstance(held, str):
            if held != digest:
                keys[entry.pid.key] = {held, digest}
        else:
            held.add(digest)

    def _forget(self, entries: Iterable[_Entry]) -> None:  # caller holds the lock
        for entry in entries:
            if self._entries.get(entry.digest) is not entry:
                continue
            if self._loading:
                self._gone.add(entry.digest)  # the loader must not bring it back
            del self._entries[entry.digest]
            self._dirty.pop(entry.digest, None)
            keys = self._by_object[entry.pid.mount]
            held = keys[entry.pid.key]
            if isinstance(held, set):
                held.discard(entry.digest)
                if len(held) == 1:
                    keys[entry.pid.key] = next(iter(held))
            elif held == entry.digest:
                del keys[entry.pid.key]
                if not keys:
                    del self._by_object[entry.pid.mount]

    def _leave(self) -> None:
        with self._lock:
            self._leave_locked()

    def _leave_locked(self) -> None:  # caller holds the lock
        self._busy -= 1
        if self._busy == 0:
            self._idle.notify_all()

    # ------------------------------------------------------- persistence helpers
    def _flush_loop(self, interval: float) -> None:
        """Index rows as they gather (rows.py); last access times and stale plans every ``interval``."""
        next_access = time.monotonic() + interval
        while not self._stop.is_set():
            try:
                if self._rows.wait(next_access - time.monotonic(), self._stop):
                    self._flush_rows()
                if time.monotonic() >= next_access:
                    self._flush_access()
                    self.refresh_stale()
                    next_access = time.monotonic() + interval
            except Exception:  # never let the flusher die; the next round retries
                log.exception("page index flush failed")
                self._stop.wait(min(interval, 1.0))

    def _flush_rows(self) -> int:
        """Write the queued index rows and deletions; returns how many."""
        return self._rows.flush(self._dirs, self._row_of, self._rows_failed)

    def _row_of(self, entry: _Entry) -> tuple | None:  # caller holds the lock
        """A page's row, if it is still the READY page of its digest (a removed page gets none)."""
        if entry.state is _State.READY and self._entries.get(entry.digest) is entry:
            entry.saved_access = entry.last_access
            return entry.record()
        return None

    def _rows_failed(self, d: DirHandle, entries: list[_Entry], exc: BaseException) -> None:
        """A batch of rows did not reach the index (disk full, SQLite error): like a put whose
        row failed, its pages are dropped (a crash now would orphan them) and counted as failed."""
        self.health.failed(d.root, exc, writing=True, what=f"cannot write page index rows in {d.root}")
        dropped = []
        with self._lock:
            for entry in entries:
                if entry.state is _State.READY and self._entries.get(entry.digest) is entry:
                    entry.state = _State.REMOVING
                    d.order.remove(entry)
                    dropped.append(entry)
            self._put_failures += len(dropped)
        self._remove(dropped)

    def _flush_access(self, every: bool = False) -> None:
        """Write batched last_access updates, one transaction per dir, only for indexed pages;
        ``every``: also those read within the granularity (at close)."""
        with self._lock:
            dirty, self._dirty = self._dirty, {}
            if every:
                dirty.update((digest, entry) for digest, entry in self._entries.items()
                             if entry.last_access != entry.saved_access and not self._rows.queued(digest, entry))
            by_dir: dict[int, list[tuple[str, tuple]]] = {}
            for digest, entry in dirty.items():
                if entry.state is _State.READY:
                    entry.saved_access = entry.last_access
                    by_dir.setdefault(id(entry.dir), []).append((digest, entry.record()))
        for d in self._dirs:
            records = by_dir.get(id(d))
            if not records or d.index is None:
                continue
            try:
                with d.index.transact():
                    for digest, record in records:
                        if digest in d.index:  # a concurrent delete must not be resurrected
                            d.index.set(digest, record)
            except INDEX_ERRORS as exc:
                log.warning("cannot flush access times in %s: %s", d.root, exc)

    def _load_behind(self) -> None:
        """Load every dir's index, then start the debris sweep. Run by __init__ for a small index,
        else by a thread while the store serves (a million rows take ~5 s of CPU here): a read
        of a page not loaded yet asks the index for its row (``_load_one``), a removal is
        remembered so the loader does not bring its pages back, and puts are refused (the
        quota's use is not known yet) until ``loaded`` is set."""
        # A million pages are a few million new objects: without this, the collector walks the
        # growing heap again and again while they are made (~1/4 of the load's time here).
        collecting = gc.isenabled()
        gc.disable()
        failed = True
        try:
            for i, d in enumerate(self._dirs):
                if self._stop.is_set():
                    break
                if self._recover(d):
                    self.sweeper.need_orphans(i)
            failed = False
        except Exception:  # pages not loaded are fetched again; their files are swept as orphans
            if self._loader is None:
                raise
            log.exception("page index load failed")
            for i in range(len(self._dirs)):
                self.sweeper.need_orphans(i)
            failed = False
        finally:
            if collecting:
                gc.enable()
            with self._lock:
                self._loading = False
                ahead, self._loaded_ahead = self._loaded_ahead, []
                for entry in ahead:  # read while loading: more recent than what the loader added
                    if self._entries.get(entry.digest) is entry and entry.state is _State.READY:
                        entry.dir.order.touch(entry)
                self._gone.clear()
                self._tombstones.clear()
                start = not failed and not self._closed and not self._stop.is_set()
            self.loaded.set()
            if start:
                self.sweeper.start()

    def _recover(self, d: DirHandle) -> bool:
        """Rebuild memory state from the index alone (no file touched: see the module docstring);
        True when the dir's page files must be swept for orphans (an index reset)."""
        loaded: list[_Entry] = []
        stale: list[str] = []
        reset = False
        try:
            for n, (digest, record) in enumerate(d.scan_index()):
                entry = self._entry_from_record(d, digest, record)
                if entry is None:
                    stale.append(digest)
                else:
                    loaded.append(entry)
                if n & 8191 == 0 and self._stop.is_set():  # closed while loading
                    return False
        except IndexReset:  # emptied: every page file is an orphan now
            loaded, stale, reset = [], [], True
        if stale and d.index is not None:
            with d.index.transact():
                for digest in stale:
                    d.index.delete(digest)
        loaded.sort(key=lambda e: e.last_access)
        doomed: list[_Entry] = []
        for i in range(0, len(loaded), 8192):  # slices: reads and lookups go on between them
            if self._stop.is_set():
                return reset
            with self._lock:
                for entry in loaded[i:i + 8192]:
                    digest = entry.digest
                    if digest in self._entries or digest in self._gone:  # loaded ahead, or left since
                        continue
                    if self._tombstones and self._tombstoned(entry.pid):  # removed while loading
                        doomed.append(entry)
                        continue
                    d.order.add(entry)
                    d.used += entry.size
                    self._add(entry)
        count = len(loaded)
        del loaded
        self._unlink(doomed)
        evicted: list[_Entry] = []
        with self._lock:
            excess = d.used - d.quota  # the quota was lowered since the last run
            while excess > 0 and (entry := d.order.first()) is not None:
                d.order.remove(entry)
                entry.state = _State.REMOVING
                evicted.append(entry)
                excess -= entry.size
            self._evictions += len(evicted)
        self._remove(evicted)
        log.info("page store %s: %d pages, %d/%d bytes; dropped %d bad index rows and %d removed while "
                 "loading; evicted %d to fit the quota", d.root, count, d.used, d.quota, len(stale),
                 len(doomed), len(evicted))
        return reset

    def _tombstoned(self, pid: PageId) -> bool:  # caller holds the lock
        return any(pid.mount == mount and (pid.key == key if exact else pid.key.startswith(key))
                   for mount, key, exact in self._tombstones)

    def _load_one(self, digest: str) -> None:
        """While the index loads behind: the page's row, if any, read now (a point query) and its
        entry added ahead of the loader."""
        with self._lock:
            if not self._loading or digest in self._entries or digest in self._gone:
                return
        for d in self._dirs:
            index = d.index
            if index is None:
                return
            try:
                record = index.get(digest)
            except INDEX_ERRORS as exc:
                log.warning("cannot read page index row in %s: %s", d.root, exc)
                continue
            if record is None:
                continue
            entry = self._entry_from_record(d, digest, record)
            if entry is None:
                return
            with self._lock:
                if self._loading and digest not in self._entries and digest not in self._gone and \
                        not (self._tombstones and self._tombstoned(entry.pid)):
                    d.order.add(entry)
                    d.used += entry.size
                    self._add(entry)
                    self._loaded_ahead.append(entry)
            return

    def _entry_from_record(self, d: DirHandle, digest: str, record: object) -> _Entry | None:
        """A READY entry for an index record we wrote, else None; its file is trusted (checked on
        its first read). The record's digest is not computed again (~5 us a row, most of a load):
        rows are keyed by the digest of the page they were written for, and a read finds a page
        by its own digest, so a row filed under another name is never served for another page."""
        try:
            mount, key, version, index, size, checksum, last_access = record  # type: ignore[misc]
            # interned: a mount's and an object's version are shared by its pages
            pid = PageId(sys.intern(mount), key, sys.intern(version), index)
            valid = TRAILER_SIZE <= size <= self.page_size + TRAILER_SIZE and len(digest) == 32
        except (TypeError, ValueError, AttributeError):  # not a record we wrote
            return None
        if not valid:
            return None
        return _Entry(pid, digest, d, size, _State.READY, float(last_access), checksum,
                      saved_access=float(last_access))

    def _claim_orphans(self, d: DirHandle, names: list[str]) -> list[str]:
        """The sweep's names (in their right fan-out dir of ``d``) no page of ``d`` owns, reserved
        for removal: a put of one is refused until ``_release_orphans``."""
        with self._lock:
            if self._closed:
                return []
            entries, sweeping = self._entries, self._sweeping
            out = [n for n in names if n not in sweeping and ((e := entries.get(n)) is None or e.dir is not d)]
            sweeping.update(out)
            return out

    def _release_orphans(self, names: list[str]) -> None:
        with self._lock:
            self._sweeping.difference_update(names)

    def _release_dirs(self) -> None:
        for d in self._dirs:
            d.close()
