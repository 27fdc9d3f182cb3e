"""A compact object-metadata table: millions of ``CachePath -> ObjectMeta`` entries, no object each.

Drop-in for ``TTLCache[CachePath, ObjectMeta]`` as :class:`ObjectStore` uses it (``get``, ``put``,
``pop``, ``pop_where``), with the same semantics: entries expire ``ttl`` seconds after their last
``put`` (``get`` of an expired entry drops it and answers None), ``ttl <= 0`` makes ``put`` a no-op,
and when ``max_entries`` are held a ``put`` of a new key evicts the entry put longest ago (FIFO by
put order, exactly as TTLCache's OrderedDict; with one ttl the oldest put is also the first to
expire, so expired entries go first).

Layout (why it fits DESIGN.md section 5's "10 M objects in < 2 GiB"): one fixed 60-byte record per
entry in one ``bytearray`` (read and written with one ``struct`` call, so a lookup touches one or
two cache lines rather than one per column; ``numpy.frombuffer`` with a packed structured dtype
gives zero-copy column views for the bulk operations), and the key and version bytes in a second
``bytearray`` arena. Record: hash 8, arena offset 8, key length 4, mount id + flags 4, version
length 4, size 8, mtime 8, expiry 8, put sequence 8 = 60 bytes, plus the key's UTF-8 bytes, plus the version:
an ETag of 32 lowercase hex digits is kept as its 16 raw bytes, a version equal to
``f"{size}-{mtime!r}"`` (what local and generic stores get from ``version_of``) takes no bytes at
all, anything else is kept as UTF-8 text. Mount names are interned in a small side table.

Index: open addressing over an ``array('i')`` of row numbers (power-of-two size, load <= 0.7
counting tombstones, linear probing), keyed by ``xxh3_64(key bytes, seed=mount id)``; a hash hit
is confirmed against the stored key bytes, so a collision never answers with another object's
metadata. Freed rows go on a free list and are reused (their arena bytes too, when the new entry
fits); the arena is compacted in place when more than half of it is garbage.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable

import numpy as np
import xxhash

from cachefs.paths import CachePath
from cachefs.store.meta import ObjectMeta

_hash = xxhash.xxh3_64_intdigest  # module level so tests can force collisions

_EMPTY = -1
_TOMB = -2
_MAX_LOAD = 0.7
_DEAD_SEQ = (1 << 64) - 1  # freed rows: never chosen for eviction
_COMPACT_MIN = 1 << 20  # garbage arena bytes tolerated before a compaction is considered

# Low 4 bits of the mount/flags column; the mount id sits above them.
_LIVE = 1
_DIR = 2
_ETAG = 4  # version = 16 raw bytes in the arena, shown as 32 lowercase hex digits
_DERIVED = 8  # version == f"{size}-{mtime!r}": nothing stored
_FLAG_BITS = 4

_ROW = struct.Struct("<QqIIIqddQ")  # hash, off, klen, mf, vlen, size, mtime, expiry, seq
_RS = _ROW.size
_ZERO_ROW = bytes(_RS)
_MF_AT, _MF = 20, struct.Struct("<I")
_SEQ_AT, _SEQ = 52, struct.Struct("<Q")
_OFF_AT, _OFF = 8, struct.Struct("<q")
_LENS = struct.Struct("<qII")  # off, klen, mf at +8
_ROW_DTYPE = np.dtype({"names": ["hash", "off", "klen", "mf", "vlen", "size", "mtime", "expiry", "seq"],
                       "formats": ["<u8", "<i8", "<u4", "<u4", "<u4", "<i8", "<f8", "<f8", "<u8"],
                       "offsets": [0, 8, 16, 20, 24, 28, 36, 44, 52], "itemsize": _RS})
assert _RS == 60


def _encode(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # lone surrogates: an unvalidated path, still kept exactly
        return text.encode("utf-8", "surrogatepass")


class MetadataTable:
    """``CachePath -> ObjectMeta`` with a TTL and a bound, about 130 bytes per entry."""

    def __init__(self, ttl: float, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 grace: float = 0.0):
        self.ttl = ttl
        self.grace = grace  # an expired entry is kept this long more, for get_stale()
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._mount_ids: dict[str, int] = {}
        self._mounts: list[str] = []
        self._rows = bytearray()  # _RS bytes per row
        self._arena = bytearray()
        self._free = array("i")  # reusable rows
        self._live = 0
        self._live_bytes = 0  # arena bytes owned by live rows; the rest is garbage
        self._next_seq = 0
        # Index: row numbers, _EMPTY or _TOMB.
        self._index = array("i", [_EMPTY]) * 8
        self._mask = 7
        self._used = 0  # live + tombstone slots
        # Eviction candidates: the oldest rows at the last scan, oldest first, with their seq then.
        self._evict_rows: list[int] = []
        self._evict_seqs: list[int] = []
        self._evict_at = 0

    def __len__(self) -> int:
        with self._lock:
            return self._live

    def memory_bytes(self) -> int:
        """Bytes allocated for the entries (records, arena, index, free list)."""
        with self._lock:
            return sum(sys.getsizeof(p) for p in (self._rows, self._arena, self._free, self._index))

    def _view(self) -> np.ndarray:
        """Column view of the records; drop it before the records can grow."""
        return np.frombuffer(self._rows, dtype=_ROW_DTYPE)

    def _row(self, r: int) -> tuple:
        return _ROW.unpack_from(self._rows, r * _RS)

    # -- lookups -------------------------------------------------------------------------------

    def _find(self, mid: int, kb: bytes, h: int) -> tuple[int, int, tuple | None]:
        """(slot, row, record) of the key, or (first reusable slot, -1, None) when absent."""
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
                if rec[0] == h and rec[2] == n and rec[3] >> _FLAG_BITS == mid:
                    o = rec[1]
                    if arena[o:o + n] == kb:
                        return i, r, rec
            i = (i + 1) & mask

    def get(self, path: CachePath) -> ObjectMeta | None:
        """The entry while it is fresh (younger than the TTL)."""
        found = self.get_stale(path)
        return found[0] if found is not None and found[1] else None

    def get_stale(self, path: CachePath) -> tuple[ObjectMeta, bool] | None:
        """The entry and whether it is still fresh, up to ``grace`` seconds past its TTL."""
        found = self.get_with_expiry(path)
        return None if found is None else (found[0], found[1] > self._clock())

    def get_fresh_until(self, path: CachePath) -> tuple[ObjectMeta, float] | None:
        """The entry while it is fresh, and when (on this table's clock) it stops being so."""
        found = self.get_with_expiry(path)
        return found if found is not None and found[1] > self._clock() else None

    def get_with_expiry(self, path: CachePath) -> tuple[ObjectMeta, float] | None:
        """The entry (up to ``grace`` seconds past its TTL) and its expiry on this table's clock."""
        mid = self._mount_ids.get(path.mount)
        if mid is None:
            return None
        kb = _encode(path.key)
        h = _hash(kb, mid)
        with self._lock:
            slot, r, rec = self._find(mid, kb, h)
            if rec is None:
                return None
            _, o, klen, flags, vlen, size, mtime, expiry, _ = rec
            now = self._clock()
            if expiry + self.grace <= now:
                self._free_row(slot, r)
                return None
            if flags & _ETAG:
                o += klen
                version = self._arena[o:o + 16].hex()
            elif flags & _DERIVED:
                version = f"{size}-{mtime!r}"
            else:
                o += klen
                version = self._arena[o:o + vlen].decode("utf-8", "surrogatepass")
        return ObjectMeta(path, size, version, mtime, bool(flags & _DIR)), expiry

    # -- updates -------------------------------------------------------------------------------

    def put(self, path: CachePath, meta: ObjectMeta) -> None:
        if self.ttl <= 0 or self._max <= 0:
            return
        kb = _encode(path.key)
        size, mtime, version = meta.size, float(meta.mtime), meta.version
        flags = _LIVE | (_DIR if meta.is_dir else 0)
        vb = b""
        if len(version) == 32:
            try:
                raw = bytes.fromhex(version)
            except ValueError:
                raw = None
            if raw is not None and raw.hex() == version:
                flags |= _ETAG
                vb = raw
        if not flags & _ETAG:
            if version == f"{size}-{mtime!r}":
                flags |= _DERIVED
            else:
                vb = _encode(version)
        with self._lock:
            mid = self._mount_ids.get(path.mount)
            if mid is None:
                mid = self._mount_ids[path.mount] = len(self._mounts)
                self._mounts.append(path.mount)
            h = _hash(kb, mid)
            now = self._clock()
            slot, r, rec = self._find(mid, kb, h)
            if rec is not None:  # update in place: a new put moves the entry to the back of the queue
                off = self._store_version(rec, kb, vb)
            else:
                if self._live >= self._max:
                    self._evict_one()
                    slot, _, _ = self._find(mid, kb, h)  # eviction may have left an earlier tombstone
                r, off = self._new_row(kb, vb)
                if self._index[slot] == _EMPTY:
                    self._used += 1
                self._index[slot] = r
                self._live += 1
            _ROW.pack_into(self._rows, r * _RS, h, off, len(kb), mid << _FLAG_BITS | flags, len(vb), size, mtime,
                           now + self.ttl, self._next_seq)
            self._next_seq += 1
            if self._used > _MAX_LOAD * (self._mask + 1):
                self._rebuild_index()
            if len(self._arena) - self._live_bytes > max(_COMPACT_MIN, len(self._arena) >> 1):
                self._compact_arena()

    def pop(self, path: CachePath) -> None:
        mid = self._mount_ids.get(path.mount)
        if mid is None:
            return
        kb = _encode(path.key)
        h = _hash(kb, mid)
        with self._lock:
            slot, r, _ = self._find(mid, kb, h)
            if r >= 0:
                self._free_row(slot, r)

    def pop_where(self, predicate: Callable[[CachePath], bool]) -> None:
        with self._lock:
            view = self._view()
            rows = np.flatnonzero(view["mf"] & _LIVE).tolist()
            del view
            doomed = []
            mounts, recs, arena, unpack = self._mounts, self._rows, self._arena, _LENS.unpack_from
            for r in rows:
                o, klen, mf = unpack(recs, r * _RS + _OFF_AT)
                path = CachePath(mounts[mf >> _FLAG_BITS], arena[o:o + klen].decode("utf-8", "surrogatepass"))
                if predicate(path):
                    doomed.append(r)
            for r in doomed:
                self._drop_row(r)

    # -- internals (lock held) ---------------------------------------------------------------

    def _new_row(self, kb: bytes, vb: bytes) -> tuple[int, int]:
        """(row, arena offset) for a new entry, ``kb + vb`` already in the arena; the caller packs the record."""
        n = len(kb) + len(vb)
        if self._free:
            r = self._free.pop()
            _, o, klen, _, vlen = _ROW.unpack_from(self._rows, r * _RS)[:5]
            if n <= klen + vlen:  # reuse its arena bytes
                self._arena[o:o + n] = kb + vb
            else:
                o = len(self._arena)
                self._arena += kb
                self._arena += vb
        else:
            r = len(self._rows) // _RS
            self._rows += _ZERO_ROW
            o = len(self._arena)
            self._arena += kb
            self._arena += vb
        self._live_bytes += n
        return r, o

    def _store_version(self, rec: tuple, kb: bytes, vb: bytes) -> int:
        """Write a live row's new version bytes (its key stays); its arena offset, perhaps moved."""
        o, old = rec[1], rec[4]
        if len(vb) <= old:
            if vb:
                self._arena[o + len(kb):o + len(kb) + len(vb)] = vb
        else:  # does not fit: move key and version to the end
            o = len(self._arena)
            self._arena += kb
            self._arena += vb
        self._live_bytes += len(vb) - old
        return o

    def _free_row(self, slot: int, r: int) -> None:
        at = r * _RS
        _, _, klen, _, vlen = _ROW.unpack_from(self._rows, at)[:5]
        self._index[slot] = _TOMB
        _MF.pack_into(self._rows, at + _MF_AT, 0)
        _SEQ.pack_into(self._rows, at + _SEQ_AT, _DEAD_SEQ)
        self._live -= 1
        self._live_bytes -= klen + vlen
        self._free.append(r)

    def _drop_row(self, r: int) -> None:
        """Free live row ``r`` (finding its index slot from its own key)."""
        h, o, klen, mf = _ROW.unpack_from(self._rows, r * _RS)[:4]
        slot, found, _ = self._find(mf >> _FLAG_BITS, bytes(self._arena[o:o + klen]), h)
        assert found == r
        self._free_row(slot, r)

    def _evict_one(self) -> None:
        """Drop the entry put longest ago (TTLCache's order)."""
        while True:
            while self._evict_at < len(self._evict_rows):
                r = self._evict_rows[self._evict_at]
                s = self._evict_seqs[self._evict_at]
                self._evict_at += 1
                if _SEQ.unpack_from(self._rows, r * _RS + _SEQ_AT)[0] == s:  # live, not put again since
                    self._drop_row(r)
                    return
            self._scan_oldest()

    def _scan_oldest(self) -> None:
        """Refill the eviction queue with the oldest live rows (1/256 of the bound, at least 1).

        Rows not chosen were all put after every chosen one, and rows put later are younger
        still, so the queue's head (skipping rows freed or put again since) is the oldest entry.
        """
        view = self._view()
        seq = view["seq"].copy()
        del view
        k = min(max(1, self._max >> 8), self._live, len(seq))
        cand = np.argpartition(seq, k - 1)[:k] if k < len(seq) else np.arange(len(seq))
        cand = cand[np.argsort(seq[cand], kind="stable")]
        seqs = seq[cand]
        keep = seqs != np.uint64(_DEAD_SEQ)
        self._evict_rows = cand[keep].tolist()
        self._evict_seqs = seqs[keep].tolist()
        self._evict_at = 0

    def _rebuild_index(self) -> None:
        """Rehash every live row into a fresh index (doubling it when over half full), vectorised."""
        size = self._mask + 1
        while self._live > (size >> 1):
            size <<= 1
        mask = size - 1
        view = self._view()
        live = np.flatnonzero(view["mf"] & _LIVE)
        pos = (view["hash"][live] & np.uint64(mask)).astype(np.int64)
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
        """Slide live rows' bytes down over the garbage, in offset order, and truncate."""
        view = self._view()
        live = np.flatnonzero(view["mf"] & _LIVE)
        order = live[np.argsort(view["off"][live], kind="stable")].tolist()
        del view, live
        arena, recs, unpack, pack = self._arena, self._rows, _ROW.unpack_from, _OFF.pack_into
        to = 0
        for r in order:
            _, o, klen, _, vlen = unpack(recs, r * _RS)[:5]
            n = klen + vlen
            if o != to:
                arena[to:to + n] = arena[o:o + n]
                pack(recs, r * _RS + _OFF_AT, to)
            to += n
        del arena[to:]
        for r in self._free:  # their bytes are gone: a reused free row appends
            struct.pack_into("<II", recs, r * _RS + 16, 0, 0)  # klen, mf (already 0)
            struct.pack_into("<I", recs, r * _RS + 24, 0)  # vlen
        self._live_bytes = to
