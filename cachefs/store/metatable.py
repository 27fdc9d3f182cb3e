"""A compact object-metadata table: ten million ``CachePath -> ObjectMeta`` entries in < 64 bytes each.

What :class:`ObjectStore` keeps of each object it has seen (``get``, ``put``, ``pop``,
``pop_prefix``), as TTLCache did: entries expire ``ttl`` seconds after their last ``put``
(``get`` of one past its grace drops it and answers None), ``ttl <= 0`` makes ``put`` a no-op.

Bound (issue #47): ``max_bytes``, not a count. Each entry is charged ``ENTRY_BYTES`` (its record
and its share of the index) plus its name's bytes after the last ``/`` plus its stored version
bytes; each directory ``DIR_BYTES`` plus its path. A ``put`` that would take the total past
``max_bytes`` first drops the entries put longest ago (their expiry, to the millisecond, is the
order; with one ttl the oldest put is also the first to expire, so expired entries go first).
``max_entries`` is an optional count bound on top (tests compare against TTLCache with it).

Layout: one 40-byte record per entry in one anonymous memory map (one ``struct`` call per access;
``numpy.frombuffer`` gives column views for bulk work): hash 4, arena offset 4, name length 2,
version length 2, directory id + flags 4, size 4 (sizes of 4 GiB and more: in a side dict),
expiry 4 (milliseconds after the table's epoch, rebased before it wraps), previous and next
entry of the same directory 4 + 4, mtime 8. Keys are split at their last ``/``: the directory
is interned once (a ``dict``, with a sorted list per mount for prefixes), the record keeps the
name's UTF-8 bytes in an arena, with the version: an ETag of 32 lowercase hex digits as its 16
raw bytes, a version equal to ``f"{size}-{mtime!r}"`` (local and generic stores) as nothing.

Index: open addressing over an ``array('i')`` of row numbers, keyed by ``xxh3_64(name,
seed=directory id)`` (low 32 bits), confirmed against the stored name, so a collision never
answers for another object. Freed rows are reused; the arena is compacted when over half garbage.

Removing a prefix costs what it removes: the directories under it come from a bisect of the
sorted directory list, their entries from each directory's chain, freed a batch at a time with
the lock let go in between (reads never wait for a whole prefix); only the one directory a
prefix ends inside is walked whole (its names tested, 4,096 per hold of the lock).
"""

from __future__ import annotations

import bisect
import math
import mmap
import struct
import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np
import xxhash

from cachefs.paths import CachePath
from cachefs.store.meta import ObjectMeta

_hash = xxhash.xxh3_64_intdigest  # module level so tests can force collisions

_EMPTY = -1
_TOMB = -2
_MAX_LOAD = 0.7
_DEAD = 0xFFFFFFFF  # expiry of freed rows: never chosen for eviction
_MAX_EXPIRY = 0xFFFFFFF0  # a later expiry rebases the epoch first
_MAX_TTL_MS = 1 << 31  # ttls past ~24.8 days count as that
_BIG = 0xFFFFFFFF  # size column: the real size is in _big
_COMPACT_MIN = 1 << 20  # garbage arena bytes tolerated before a compaction is considered
_MAX_NAME = 0xFFFF  # longer names (after the last "/") or versions are not kept
_BATCH = 256  # entries a prefix removal frees, or put_many puts, per hold of the lock
# Rows of the listings kept for extend_listed, all listings together (8 bytes a row): past it
# the listings extended longest ago are dropped (their next refresh puts every row again).
_LISTED_ROWS = 1 << 22

# Low 4 bits of the directory/flags column; the directory id sits above them.
_LIVE = 1
_DIR = 2
_ETAG = 4  # version = 16 raw bytes in the arena, shown as 32 lowercase hex digits
_DERIVED = 8  # version == f"{size}-{mtime!r}": nothing stored
_FLAG_BITS = 4
_FLAG_MASK = (1 << _FLAG_BITS) - 1

#: Bytes each entry is charged besides its name and version: its record and about 8 of index.
ENTRY_BYTES = 48
#: Bytes each directory is charged besides its path (its dict and list entries).
DIR_BYTES = 160

_ROW = struct.Struct("<IIHHIIIiid")  # hash, off, klen, vlen, df, size, expiry, prev, next, mtime
_RS = _ROW.size
_ZERO_ROW = bytes(_RS)
_DF_AT, _U32 = 12, struct.Struct("<I")
_EXP_AT = 20
_PREV_AT, _NEXT_AT, _I32 = 24, 28, struct.Struct("<i")
_LINKS = struct.Struct("<ii")
_ROW_DTYPE = np.dtype({"names": ["hash", "off", "klen", "vlen", "df", "size", "expiry", "prev", "next", "mtime"],
                       "formats": ["<u4", "<u4", "<u2", "<u2", "<u4", "<u4", "<u4", "<i4", "<i4", "<f8"],
                       "offsets": [0, 4, 8, 10, 12, 16, 20, 24, 28, 32], "itemsize": _RS})
assert _RS == 40


def _encode(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # lone surrogates: an unvalidated path, still kept exactly
        return text.encode("utf-8", "surrogatepass")


def _buffer(size: int = mmap.PAGESIZE) -> mmap.mmap:
    """Anonymous memory: its pages cost nothing until written, so room to grow is free."""
    return mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _grown(buf: mmap.mmap, need: int) -> mmap.mmap:
    """``buf`` with room for ``need`` bytes (at least twice its size): resized in place where
    the system can (Linux: mremap, no copy), else copied."""
    size = -(-max(need, 2 * len(buf)) // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        buf.resize(size)
        return buf
    except (OSError, SystemError, ValueError):
        new = _buffer(size)
        new[:len(buf)] = buf[:]
        buf.close()
        return new


def _split(key: str) -> tuple[str, str]:
    """(directory with its trailing "/", or "" at the top; the name after it)."""
    head, sep, name = key.rpartition("/")
    return head + sep, name


class MetadataTable:
    """``CachePath -> ObjectMeta`` with a TTL, bounded by bytes; about 60 bytes per entry."""

    def __init__(self, ttl: float, max_bytes: int = 1 << 30, clock: Callable[[], float] = time.monotonic,
                 grace: float = 0.0, max_entries: int | None = None):
        self.ttl = ttl
        self.grace = grace  # an expired entry is kept this long more, for get_stale()
        self.max_bytes = max_bytes
        self._max = max_entries
        self._clock = clock
        self._epoch = clock()  # expiries are milliseconds after this
        self._lock = threading.Lock()
        self._mount_ids: dict[str, int] = {}
        self._mounts: list[str] = []
        # Records and arena in anonymous memory, grown in place: only written pages are resident
        # (a bytearray keeps an eighth spare, and a copy of one left the old in the heap).
        self._rows = _buffer()  # _RS bytes per row, self._nrows of them used
        self._nrows = 0
        self._arena = _buffer()  # self._arena_len bytes used
        self._arena_len = 0
        self._free = array("i")  # reusable rows
        self._big: dict[int, int] = {}  # row -> size, sizes that do not fit 32 bits
        self._live = 0
        self._live_bytes = 0  # arena bytes owned by live rows; the rest is garbage
        self._charged = 0  # what max_bytes bounds
        # Directories: (mount id, path) -> id; per id its path, mount, first entry, entry count.
        self._dirs: dict[tuple[int, str], int] = {}
        self._dir_path: list[str | None] = []
        self._dir_mount = array("i")
        self._dir_head = array("i")
        self._dir_count = array("i")
        self._dir_free = array("i")
        self._dir_writes = array("Q")  # changes of its rows (new, changed, dropped), per directory id (never reset)
        self._sorted: dict[int, list[str]] = {}  # mount id -> its directories' paths, sorted
        # Index: row numbers, _EMPTY or _TOMB.
        self._index = array("i", [_EMPTY]) * 8
        self._mask = 7
        self._used = 0  # live + tombstone slots
        # Eviction candidates: the oldest rows at the last scan, oldest first, with their expiry then.
        self._evict_rows: list[int] = []
        self._evict_exps: list[int] = []
        self._evict_at = 0
        # What put_rows put for each listing it was told of: (its digest, the rows, their
        # directories and those directories' write counts then), for extend_listed.
        self._listed: OrderedDict[Hashable, tuple[bytes, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._listed_rows = 0
        self._writes = 0  # puts and drops of rows, all directories

    def __len__(self) -> int:
        with self._lock:
            return self._live

    def charged_bytes(self) -> int:
        """What ``max_bytes`` bounds (see the module's docstring)."""
        with self._lock:
            return self._charged

    def memory_bytes(self) -> int:
        """Bytes allocated for the entries (records and arena as used, index, free list, directories)."""
        with self._lock:
            arrays = (self._free, self._index, self._dir_mount, self._dir_head, self._dir_count, self._dir_free)
            dirs = sys.getsizeof(self._dirs) + sys.getsizeof(self._dir_path) + sum(
                sys.getsizeof(p) + 64 + 8 for p in self._dir_path if p is not None)  # path, tuple key, list slot
            used = self._nrows * _RS + self._arena_len
            return used + sum(sys.getsizeof(p) for p in arrays) + dirs + 100 * len(self._big)

    def _view(self) -> np.ndarray:
        """Column view of the records; drop it before the records can grow."""
        return np.frombuffer(self._rows, dtype=_ROW_DTYPE, count=self._nrows)

    def _row(self, r: int) -> tuple:
        return _ROW.unpack_from(self._rows, r * _RS)

    def _now_ms(self) -> int:
        return round((self._clock() - self._epoch) * 1000)

    # -- lookups -------------------------------------------------------------------------------

    def _find(self, d: int, kb: bytes, h: int) -> tuple[int, int, tuple | None]:
        """(slot, row, record) of the name in directory ``d``, or (first reusable slot, -1, None)."""
        index, rows, arena, unpack = self._index, self._rows, self._arena, _ROW.unpack_from
        mask = self._mask
        i = h & mask
        reuse = -1
        n = len(kb)
        while True:
            r = index[i]
            if r == _EMPTY:
                return (i if reuse < 0 else reuse), -1, None
            if r == _TOMB:
                if reuse < 0:
                    reuse = i
            else:
                rec = unpack(rows, r * _RS)
                if rec[0] == h and rec[2] == n and rec[4] >> _FLAG_BITS == d:
                    o = rec[1]
                    if arena[o:o + n] == kb:
                        return i, r, rec
            i = (i + 1) & mask

    def _slot_of(self, r: int, h: int) -> int:
        index, mask = self._index, self._mask
        i = h & mask
        while index[i] != r:
            i = (i + 1) & mask
        return i

    def get(self, path: CachePath) -> ObjectMeta | None:
        """The entry while it is fresh (younger than the TTL)."""
        found = self.get_stale(path)
        return found[0] if found is not None and found[1] else None

    def get_stale(self, path: CachePath) -> tuple[ObjectMeta, bool] | None:
        """The entry and whether it is still fresh, up to ``grace`` seconds past its TTL."""
        found = self._get(path)
        return None if found is None else (found[0], found[1] > found[2])

    def get_fresh_until(self, path: CachePath) -> tuple[ObjectMeta, float] | None:
        """The entry while it is fresh, and when (on this table's clock) it stops being so."""
        found = self._get(path)
        return (found[0], self._epoch + found[1] / 1000) if found is not None and found[1] > found[2] else None

    def get_with_expiry(self, path: CachePath) -> tuple[ObjectMeta, float] | None:
        """The entry (up to ``grace`` seconds past its TTL) and its expiry on this table's clock."""
        found = self._get(path)
        return None if found is None else (found[0], self._epoch + found[1] / 1000)

    def _get(self, path: CachePath) -> tuple[ObjectMeta, int, int] | None:
        """(entry, expiry, now) in table milliseconds, up to ``grace`` past its TTL."""
        mid = self._mount_ids.get(path.mount)
        if mid is None:
            return None
        dpath, name = _split(path.key)
        kb = _encode(name)
        with self._lock:
            d = self._dirs.get((mid, dpath))
            if d is None:
                return None
            slot, r, rec = self._find(d, kb, _hash(kb, d) & 0xFFFFFFFF)
            if rec is None:
                return None
            _, o, klen, vlen, df, size, expiry, _, _, mtime = rec
            now = self._now_ms()
            if expiry + round(self.grace * 1000) <= now:
                self._free_row(slot, r)
                return None
            if size == _BIG:
                size = self._big[r]
            if df & _ETAG:
                o += klen
                version = self._arena[o:o + 16].hex()
            elif df & _DERIVED:
                version = f"{size}-{mtime!r}"
            else:
                o += klen
                version = self._arena[o:o + vlen].decode("utf-8", "surrogatepass")
        return ObjectMeta(path, size, version, mtime, bool(df & _DIR)), expiry, now

    # -- updates -------------------------------------------------------------------------------

    def put(self, path: CachePath, meta: ObjectMeta) -> None:
        if not self._keeps():
            return
        item = self._prepared(path, meta)
        if item is None:
            self.pop(path)  # no real name is that long; the store is asked each time
            return
        with self._lock:
            self._put_locked(path.mount, *item)

    def put_many(self, metas: list[ObjectMeta]) -> None:
        """``put(m.path, m)`` of each, the lock taken once a batch (``_BATCH``), not once an entry."""
        if not self._keeps():
            return
        items, too_long = [], []
        for meta in metas:
            item = self._prepared(meta.path, meta)
            if item is None:
                too_long.append(meta.path)
            else:
                items.append((meta.path.mount, *item))
        self._put_items(items, too_long)

    def put_rows(self, mount: str, rows: list[tuple[str, int, str | None, float, bool]],
                 listing: Hashable | None = None, digest: bytes = b"") -> None:
        """``put_many`` of a listing's objects of ``mount`` as (key, size, version, mtime, is_dir)
        rows (a version of None: derived from size and mtime): no ``ObjectMeta`` or ``CachePath``
        made for each (a refresh by listing puts a directory's worth at a time). ``listing``: what
        was listed (a path), under which the rows are kept with the listing's ``digest`` for
        ``extend_listed``."""
        if not self._keeps():
            return
        items, too_long = [], []
        for key, size, version, mtime, is_dir in rows:
            item = self._prepared_fields(key, size, version, mtime, is_dir)
            if item is None:
                too_long.append(CachePath(mount, key))
            else:
                items.append((mount, *item))
        placed = self._put_items(items, too_long, keep=listing is not None)
        if listing is not None:
            self._keep_listed(listing, digest, placed if not too_long else None)

    def _put_items(self, items: list[tuple], too_long: list[CachePath], keep: bool = False) -> list[int] | None:
        """Put ``items``; with ``keep``, the rows put, if no other write came between (the
        table's write count moved by exactly ours, batch after batch: no put, drop or eviction
        of anyone else's), else None."""
        placed: list[int] | None = [] if keep else None
        writes = None
        for start in range(0, len(items), _BATCH):  # let go between batches: reads never wait for a whole listing
            with self._lock:
                before = self._writes
                batch = [self._put_locked(*item) for item in items[start:start + _BATCH]]
                if placed is not None:
                    ours = (writes is None or before == writes) and self._writes - before == len(batch)
                    placed = placed + batch if ours else None
                writes = self._writes
        for path in too_long:
            self.pop(path)
        return placed

    def _keep_listed(self, listing: Hashable, digest: bytes, placed: list[int] | None) -> None:
        with self._lock:
            old = self._listed.pop(listing, None)
            if old is not None:
                self._listed_rows -= len(old[1])
            if placed is None or len(placed) > _LISTED_ROWS:
                return
            rows = np.array(placed, dtype=np.int64)
            view = self._view()
            dirs = np.unique(view["df"][rows] >> _FLAG_BITS).astype(np.int64)
            del view
            writes = np.array([self._dir_writes[d] for d in dirs], dtype=np.uint64)
            self._listed[listing] = (digest, rows, dirs, writes)
            self._listed_rows += len(rows)
            while self._listed_rows > _LISTED_ROWS:
                _, dropped = self._listed.popitem(last=False)
                self._listed_rows -= len(dropped[1])

    def extend_listed(self, listing: Hashable, digest: bytes) -> bool:
        """Make the rows that ``put_rows`` last put for ``listing`` fresh again, as a put of the
        same rows would, if that listing had this ``digest`` (the store lists the same objects at
        the same versions) and no row of their directories was added, changed or dropped since
        (each directory's write count; a put of the same fields again, a HEAD's refresh, is not a
        change). False, changing nothing, where not: put the rows."""
        with self._lock:
            kept = self._listed.get(listing)
            if kept is None or kept[0] != digest or not self._keeps():
                return False
            _, rows, dirs, writes = kept
            if any(self._dir_writes[d] != w for d, w in zip(dirs.tolist(), writes.tolist())):
                return False
            expiry = self._now_ms() + min(_MAX_TTL_MS, math.ceil(self.ttl * 1000))
            if expiry > _MAX_EXPIRY:
                return False  # (a put rebases first, then keeps the listing afresh)
            view = self._view()
            view["expiry"][rows] = expiry
            del view
            self._listed.move_to_end(listing)
            return True

    def knows_directory(self, mount: str, key: str) -> bool:
        """Whether the table has entries in the directory of ``key`` (no lock: one dict lookup)."""
        return (self._mount_ids.get(mount), _split(key)[0]) in self._dirs

    def _keeps(self) -> bool:
        return not (self.ttl <= 0 or self.max_bytes <= 0 or (self._max is not None and self._max <= 0))

    @staticmethod
    def _prepared(path: CachePath, meta: ObjectMeta) -> tuple | None:
        """What a put stores of ``meta``, worked out before the lock: (directory, name bytes,
        version bytes, flags, size, mtime); None for a name or version too long to keep."""
        return MetadataTable._prepared_fields(path.key, meta.size, meta.version, meta.mtime, meta.is_dir)

    @staticmethod
    def _prepared_fields(key: str, size: int, version: str | None, mtime: float, is_dir: bool) -> tuple | None:
        """``_prepared`` of an entry's fields; a version of None is the one derived from size and
        mtime (a local store's, as a listing gives it)."""
        dpath, name = _split(key)
        kb = _encode(name)
        mtime = float(mtime)
        flags = _LIVE | (_DIR if is_dir else 0)
        vb = b""
        if version is None:
            flags |= _DERIVED
        elif len(version) == 32:
            try:
                raw = bytes.fromhex(version)
            except ValueError:
                raw = None
            if raw is not None and raw.hex() == version:
                flags |= _ETAG
                vb = raw
        if version is not None and not flags & _ETAG:
            if version == f"{size}-{mtime!r}":
                flags |= _DERIVED
            else:
                vb = _encode(version)
        if len(kb) > _MAX_NAME or len(vb) > _MAX_NAME:
            return None
        return dpath, kb, vb, flags, size, mtime

    def _put_locked(self, mount: str, dpath: str, kb: bytes, vb: bytes, flags: int, size: int,
                    mtime: float) -> int:  # caller holds the lock; the row put
        small = 0 <= size < _BIG
        now = self._now_ms()
        expiry = now + min(_MAX_TTL_MS, math.ceil(self.ttl * 1000))
        if expiry > _MAX_EXPIRY:
            self._rebase(now)
            now = self._now_ms()
            expiry = now + min(_MAX_TTL_MS, math.ceil(self.ttl * 1000))
        mid = self._mount_ids.get(mount)
        if mid is None:
            mid = self._mount_ids[mount] = len(self._mounts)
            self._mounts.append(mount)
        d = self._dirs.get((mid, dpath))
        if d is None:
            d = self._new_dir(mid, dpath)
        h = _hash(kb, d) & 0xFFFFFFFF
        slot, r, rec = self._find(d, kb, h)
        self._writes += 1
        if rec is not None:  # update in place: a new put moves the entry to the back of the queue
            size_was = self._big.get(r, rec[5]) if rec[5] == _BIG else rec[5]
            vat = rec[1] + rec[2]
            changed = (size_was != size or rec[9] != mtime or rec[4] & _FLAG_MASK != flags
                       or rec[3] != len(vb) or self._arena[vat:vat + rec[3]] != vb)
            off = self._store_version(rec, kb, vb)
            self._charged += len(vb) - rec[3]
            prev, nxt = rec[7], rec[8]
        else:
            charge = ENTRY_BYTES + len(kb) + len(vb)
            evicted = False
            while self._live and (self._charged + charge > self.max_bytes
                                  or (self._max is not None and self._live >= self._max)):
                self._evict_one()
                evicted = True
            if evicted:
                if (mid, dpath) not in self._dirs:  # eviction emptied (and dropped) it
                    d = self._new_dir(mid, dpath)
                    h = _hash(kb, d) & 0xFFFFFFFF
                slot, _, _ = self._find(d, kb, h)  # eviction may have left an earlier tombstone
            r, off = self._new_row(kb, vb)
            self._dir_writes[d] += 1  # (the row's new directory, where eviction dropped the old)
            if self._index[slot] == _EMPTY:
                self._used += 1
            self._index[slot] = r
            self._live += 1
            self._charged += charge
            prev, nxt = -1, self._dir_head[d]
            if nxt >= 0:
                _I32.pack_into(self._rows, nxt * _RS + _PREV_AT, r)
            self._dir_head[d] = r
            self._dir_count[d] += 1
        if rec is not None and changed:  # (the same again, only fresher: extend_listed's rows still hold)
            self._dir_writes[d] += 1
        if small:
            self._big.pop(r, None)
        else:
            self._big[r] = size
        _ROW.pack_into(self._rows, r * _RS, h, off, len(kb), len(vb), d << _FLAG_BITS | flags,
                       size if small else _BIG, expiry, prev, nxt, mtime)
        if self._used > _MAX_LOAD * (self._mask + 1):
            self._rebuild_index()
        if self._arena_len - self._live_bytes > max(_COMPACT_MIN, self._arena_len >> 1):
            self._compact_arena()
        return r

    def pop(self, path: CachePath) -> None:
        mid = self._mount_ids.get(path.mount)
        if mid is None:
            return
        dpath, name = _split(path.key)
        kb = _encode(name)
        with self._lock:
            d = self._dirs.get((mid, dpath))
            if d is None:
                return
            slot, r, _ = self._find(d, kb, _hash(kb, d) & 0xFFFFFFFF)
            if r >= 0:
                self._free_row(slot, r)

    def pop_prefix(self, mount: str, prefix: str) -> int:
        """Drop every entry of ``mount`` whose key starts with ``prefix``; how many were dropped.

        Costs what it drops (plus the one directory the prefix ends inside), a batch of entries
        per hold of the lock, so reads go on meanwhile. Entries put while it runs may stay."""
        mid = self._mount_ids.get(mount)
        if mid is None:
            return 0
        dropped = 0
        inside, rest = _split(prefix)
        if rest:  # the directory the prefix ends inside: only its names that start with the rest
            rb = _encode(rest)
            with self._lock:
                d = self._dirs.get((mid, inside))
                r = self._dir_head[d] if d is not None else -1
            while r >= 0:  # _BATCH * 16 names tested per hold of the lock (a flat bucket's one directory)
                with self._lock:
                    rows, arena, unpack = self._rows, self._arena, _ROW.unpack_from
                    if self._dirs.get((mid, inside)) != d:
                        break  # emptied meanwhile
                    df = unpack(rows, r * _RS)[4]
                    if not df & _LIVE or df >> _FLAG_BITS != d:
                        r = self._dir_head[d]  # our place was freed meanwhile: from the start again
                    doomed = []
                    for _ in range(_BATCH * 16):
                        if r < 0:
                            break
                        rec = unpack(rows, r * _RS)
                        if arena[rec[1]:rec[1] + rec[2]].startswith(rb):
                            doomed.append((r, rec[0]))
                        r = rec[8]
                    for row, h in doomed:  # never r, the next to test
                        self._free_row(self._slot_of(row, h), row)
                    dropped += len(doomed)
        with self._lock:  # every directory whose path starts with the prefix: all of it
            paths = self._sorted.get(mid, [])
            i = bisect.bisect_left(paths, prefix)
            under = []
            while i < len(paths) and paths[i].startswith(prefix):
                under.append((paths[i], self._dirs[(mid, paths[i])]))
                i += 1
        for dpath, d in under:
            while True:
                with self._lock:
                    if self._dirs.get((mid, dpath)) != d:
                        break  # emptied (or emptied and made again) meanwhile
                    r = self._dir_head[d]
                    for _ in range(_BATCH):
                        if r < 0:
                            break
                        h, nxt = _U32.unpack_from(self._rows, r * _RS)[0], _I32.unpack_from(self._rows, r * _RS + _NEXT_AT)[0]
                        self._free_row(self._slot_of(r, h), r)
                        dropped += 1
                        r = nxt
                    if r < 0:
                        break
        return dropped

    # -- internals (lock held) ---------------------------------------------------------------

    def _new_dir(self, mid: int, dpath: str) -> int:
        if self._dir_free:
            d = self._dir_free.pop()
            self._dir_path[d] = dpath
            self._dir_mount[d] = mid
            self._dir_head[d] = -1
            self._dir_count[d] = 0
        else:
            d = len(self._dir_path)
            self._dir_writes.append(0)
            self._dir_path.append(dpath)
            self._dir_mount.append(mid)
            self._dir_head.append(-1)
            self._dir_count.append(0)
        self._dirs[(mid, dpath)] = d
        bisect.insort(self._sorted.setdefault(mid, []), dpath)
        self._charged += DIR_BYTES + len(dpath)
        return d

    def _drop_dir(self, d: int) -> None:
        dpath, mid = self._dir_path[d], self._dir_mount[d]
        del self._dirs[(mid, dpath)]
        paths = self._sorted[mid]
        del paths[bisect.bisect_left(paths, dpath)]
        self._dir_path[d] = None
        self._dir_free.append(d)
        self._charged -= DIR_BYTES + len(dpath)

    def _new_row(self, kb: bytes, vb: bytes) -> tuple[int, int]:
        """(row, arena offset) for a new entry, ``kb + vb`` already in the arena; the caller packs the record."""
        n = len(kb) + len(vb)
        if self._free:
            r = self._free.pop()
            _, o, klen, vlen = _ROW.unpack_from(self._rows, r * _RS)[:4]
            if n <= klen + vlen:  # reuse its arena bytes
                self._arena[o:o + n] = kb + vb
            else:
                o = self._append(kb + vb)
        else:
            r = self._nrows
            if (r + 1) * _RS > len(self._rows):
                self._rows = _grown(self._rows, (r + 1) * _RS)
            self._nrows = r + 1
            o = self._append(kb + vb)
        self._live_bytes += n
        return r, o

    def _append(self, data: bytes) -> int:
        """Put ``data`` at the arena's end; its offset."""
        o, n = self._arena_len, len(data)
        if o + n > len(self._arena):
            self._arena = _grown(self._arena, o + n)
        self._arena[o:o + n] = data
        self._arena_len = o + n
        return o

    def _store_version(self, rec: tuple, kb: bytes, vb: bytes) -> int:
        """Write a live row's new version bytes (its name stays); its arena offset, perhaps moved."""
        o, old = rec[1], rec[3]
        if len(vb) <= old:
            if vb:
                self._arena[o + len(kb):o + len(kb) + len(vb)] = vb
        else:  # does not fit: move name and version to the end
            o = self._append(kb + vb)
        self._live_bytes += len(vb) - old
        return o

    def _free_row(self, slot: int, r: int) -> None:
        at = r * _RS
        _, _, klen, vlen, df = _ROW.unpack_from(self._rows, at)[:5]
        prev, nxt = _LINKS.unpack_from(self._rows, at + _PREV_AT)
        d = df >> _FLAG_BITS
        self._writes += 1
        self._dir_writes[d] += 1
        if prev >= 0:
            _I32.pack_into(self._rows, prev * _RS + _NEXT_AT, nxt)
        else:
            self._dir_head[d] = nxt
        if nxt >= 0:
            _I32.pack_into(self._rows, nxt * _RS + _PREV_AT, prev)
        self._dir_count[d] -= 1
        if not self._dir_count[d]:
            self._drop_dir(d)
        self._index[slot] = _TOMB
        _U32.pack_into(self._rows, at + _DF_AT, 0)
        _U32.pack_into(self._rows, at + _EXP_AT, _DEAD)
        self._big.pop(r, None)
        self._live -= 1
        self._live_bytes -= klen + vlen
        self._charged -= ENTRY_BYTES + klen + vlen
        self._free.append(r)

    def _evict_one(self) -> None:
        """Drop the entry put longest ago (the smallest expiry)."""
        while True:
            while self._evict_at < len(self._evict_rows):
                r = self._evict_rows[self._evict_at]
                e = self._evict_exps[self._evict_at]
                self._evict_at += 1
                rec = _ROW.unpack_from(self._rows, r * _RS)
                if rec[6] == e and rec[4] & _LIVE:  # live, not put again since
                    self._free_row(self._slot_of(r, rec[0]), r)
                    return
            self._scan_oldest()

    def _scan_oldest(self) -> None:
        """Refill the eviction queue with the oldest live rows (1/256 of them, at least 1).

        Rows not chosen expire no sooner than every chosen one, and rows put later later still,
        so the queue's head (skipping rows freed or put again since) is the oldest entry."""
        view = self._view()
        exp = view["expiry"].copy()
        del view
        k = min(max(1, self._live >> 8), self._live, len(exp))
        cand = np.argpartition(exp, k - 1)[:k] if k < len(exp) else np.arange(len(exp))
        cand = cand[np.argsort(exp[cand], kind="stable")]
        exps = exp[cand]
        keep = exps != np.uint32(_DEAD)
        self._evict_rows = cand[keep].tolist()
        self._evict_exps = exps[keep].tolist()
        self._evict_at = 0

    def _rebase(self, now: int) -> None:
        """Move the epoch to now before expiries outgrow 32 bits (every ~49 days)."""
        view = self._view()
        exp = view["expiry"].astype(np.int64)
        live = exp != _DEAD
        exp[live] = np.maximum(exp[live] - now, 0)
        view["expiry"] = exp.astype(np.uint32)
        del view
        self._epoch += now / 1000
        self._evict_rows, self._evict_exps, self._evict_at = [], [], 0

    def _rebuild_index(self) -> None:
        """Rehash every live row into a fresh index (doubling it when over half full), vectorised."""
        size = self._mask + 1
        while self._live > (size >> 1):
            size <<= 1
        mask = size - 1
        view = self._view()
        live = np.flatnonzero(view["df"] & _LIVE)
        pos = (view["hash"][live] & np.uint32(mask)).astype(np.int64)
        del view
        index = np.full(size, _EMPTY, dtype=np.int32)
        rows = live.astype(np.int32)
        # Linear probing in rounds: every pending row tries its next slot; of those aiming at
        # one free slot the first wins. Each row ends at the first slot free when it got there,
        # and every slot it passed is taken, so a lookup from its home slot reaches it.
        while rows.size:
            free = np.flatnonzero(index[pos] == _EMPTY)
            slots, first = np.unique(pos[free], return_index=True)
            winners = free[first]
            index[slots] = rows[winners]
            pending = np.ones(rows.size, dtype=bool)
            pending[winners] = False
            rows = rows[pending]
            pos = (pos[pending] + 1) & mask
        self._index = array("i", index.tobytes())
        self._mask = mask
        self._used = self._live

    def _compact_arena(self) -> None:
        """Copy live rows' bytes into a fresh arena, in offset order, a chunk of rows at a time (vectorised)."""
        view = self._view()
        live = np.flatnonzero(view["df"] & _LIVE)
        offs = view["off"][live].astype(np.int64)
        lens = view["klen"][live].astype(np.int64) + view["vlen"][live]
        order = np.argsort(offs, kind="stable")
        live, offs, lens = live[order], offs[order], lens[order]
        to = np.cumsum(lens) - lens
        total = int(lens.sum())
        out = _buffer(max(total, 1))
        src, dst = np.frombuffer(self._arena, np.uint8), np.frombuffer(out, np.uint8)
        for a in range(0, len(live), 1 << 16):
            o, n, t = offs[a:a + (1 << 16)], lens[a:a + (1 << 16)], to[a:a + (1 << 16)]
            count = int(n.sum())
            if count:
                start = int(t[0])
                dst[start:start + count] = src[np.repeat(o - t, n) + np.arange(start, start + count)]
        view["off"][live] = to.astype(np.uint32)
        free = np.frombuffer(self._free, np.int32)
        view["klen"][free] = 0  # their bytes are gone: a reused free row appends
        view["vlen"][free] = 0
        del view, src, dst, free
        old, self._arena = self._arena, out
        old.close()
        self._arena_len = self._live_bytes = total
