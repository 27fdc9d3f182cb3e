"""The name index: which version of an object this worker vouches for, in shared memory.

Held handles (handles.py) make a page's second read in a process free of messages, but every
process still pays one message per batch for its first read of a page, and a DataLoader's
workers are new processes every epoch (persistent_workers=False), so in a warm epoch that is
every read. A client that runs as this worker's user could open the page files itself, as
Alluxio's short-circuit hands out paths and HDFS's "insecure" mode opens block files by name:
the page store's names are computed from (mount, key, version, page) (cachefs/pagenames.py). What it
lacks is the version, and the right to trust it: this table gives both, per object, with the
moment the worker's own metadata expires (a client reading by name is never staler than a read
through the worker). A page evicted or freed is simply gone: the client's open fails and it asks
the worker. A client of another user cannot open the files (the cache dirs are mode 0700), so
publishing the table gives nobody access the file system does not already give; the table goes
only to clients of this worker's user or root, and ``short_circuit_by_name = false`` turns the
whole path off.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np

from cachefs.memseal import sealed_table
from cachefs.pagenames import (ENTRY, NAMES_HEADER, NAMES_MAGIC, SEQ, STALE_WINDOW, STALE_WINDOW_AT, SUPERSEDED,
                               SUPERSEDED_AT, VERSION_BYTES, name_hashes, probe_offsets)

__all__ = ["NameIndex"]

log = logging.getLogger(__name__)

GROWTH = 2  # a full table is replaced by one this many times larger
_HASHES = struct.Struct("<QQ")  # an entry's path hash and check, after its seq
# In an entry's 4 spare bytes, which clients do not read: a count of the writes that changed
# what it says (not those that only moved its time on), so that extend_listed can tell an entry
# left as a listing found it from one published again, moved or cleared since.
GEN_AT = struct.calcsize("<QQQQqdI")  # the 4 bytes ENTRY skips, after the version length
_GEN = struct.Struct("<I")
_UNTIL = struct.Struct("<q")
_UNTIL_AT = 32
# An entry's sequence count, valid-until and generation as columns, for extend_listed.
_COLUMNS = np.dtype({"names": ["seq", "until", "gen"], "formats": ["<u8", "<i8", "<u4"],
                     "offsets": [0, _UNTIL_AT, GEN_AT], "itemsize": ENTRY.size})
# Entries of the listings kept for extend_listed, all together (12 bytes each): past it the
# listings extended longest ago are dropped (their next refresh checks every object again).
LISTED_ENTRIES = 1 << 22


def _columns(table: "_Table") -> np.ndarray:
    """``_COLUMNS`` over every entry of ``table`` (drop it before the table can be closed)."""
    return np.frombuffer(table.map, dtype=_COLUMNS, count=table.slots, offset=NAMES_HEADER.size)


class _Table:
    """One memfd of ``slots`` entries, mapped read-write."""

    def __init__(self, slots: int, stale_window: float = 0.0) -> None:
        self.slots = slots
        self.size = NAMES_HEADER.size + slots * ENTRY.size
        # An entry past its time is still read by name for this long (clients report it): only
        # after that is its slot free for another path, or is it left behind when the table grows.
        self.stale_window_ns = int(stale_window * 1e9)
        # Sealed: clients get read-only descriptors and cannot reopen them writable (memseal.py).
        self.fd, self.map, self.sealed = sealed_table("cachefs-names", self.size)
        NAMES_HEADER.pack_into(self.map, 0, NAMES_MAGIC, slots, ENTRY.size, 0)
        STALE_WINDOW.pack_into(self.map, STALE_WINDOW_AT, int(stale_window * 1e9))

    def offsets(self, h: int, check: int) -> list[int]:
        return list(probe_offsets(h, check, self.slots))

    def find(self, h: int, check: int) -> int | None:
        """The offset of the entry of (h, check), if it has one (reading its two hashes only)."""
        table = self.map
        for off in probe_offsets(h, check, self.slots):
            if _HASHES.unpack_from(table, off + 8) == (h, check):
                return off
        return None

    def room(self, h: int, check: int, now_ns: int) -> tuple[int, bool]:
        """Where a new entry goes, and whether it pushes out one clients may still read: a free
        slot of its window, or one whose entry is past its time and its stale window, else the
        entry that runs out first."""
        best, best_until = 0, None
        dead_before = now_ns - self.stale_window_ns
        for off in self.offsets(h, check):
            kh, kc, _size, until = ENTRY.unpack_from(self.map, off)[1:5]
            if (kh, kc) == (0, 0) or until <= dead_before:
                return off, False
            if best_until is None or until < best_until:
                best, best_until = off, until
        return best, True

    def live(self, now_ns: int) -> list[tuple]:
        """Every entry clients may still read: valid, or past its time within the stale window
        (fields as ENTRY packs them)."""
        dead_before = now_ns - self.stale_window_ns
        view = memoryview(self.map)[NAMES_HEADER.size:self.size]
        try:
            return [e for e in ENTRY.iter_unpack(view) if not e[0] & 1 and (e[1], e[2]) != (0, 0) and e[4] > dead_before]
        finally:
            view.release()

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class NameIndex:
    """Table of (path -> version, size, mtime, valid until), in a memfd: a path's entry is in one
    of its ``probe_slots`` (cachefs/pagenames.py). Grows by GROWTH up to ``max_slots`` when full."""

    def __init__(self, slots: int = 1 << 16, max_slots: int | None = None, stale_window: float = 0.0) -> None:
        """``stale_window``: seconds past an entry's time that clients may still read by name,
        reporting those objects to be refreshed (the worker's metadata stale grace)."""
        if slots < 1:
            raise ValueError(f"a name index needs at least 1 slot, got {slots}")
        if not stale_window >= 0:
            raise ValueError(f"stale_window must be >= 0 seconds, got {stale_window!r}")
        self.max_slots = max(slots, max_slots or slots)
        self.stale_window = float(stale_window)
        self._table = _Table(slots, self.stale_window)
        self._lock = threading.Lock()
        self._closed = False
        self.published = 0
        self.grown = 0  # times the table was replaced by a larger one
        self.moved = 0  # entries moved within their windows to make room (_move_one_out)
        # Per listing refreshed_many was told of: (its digest, the table, the entries it left
        # valid: their offsets and generations then), for extend_listed.
        self._listed: OrderedDict[Hashable, tuple[bytes, _Table, np.ndarray, np.ndarray]] = OrderedDict()
        self._listed_entries = 0
        self.extended = 0  # entries made valid again by extend_listed

    @property
    def slots(self) -> int:
        return self._table.slots

    def reader(self) -> tuple[int, int]:
        """(a new read-only descriptor of the current table, its slots), to send to a client
        (the caller closes the descriptor)."""
        with self._lock:
            table = self._table
            return os.open(f"/proc/self/fd/{table.fd}", os.O_RDONLY | os.O_CLOEXEC), table.slots

    def _grow(self, now_ns: int) -> None:  # caller holds the lock
        """Copy the live entries into a table GROWTH times larger, then mark the old one superseded."""
        old = self._table
        new = _Table(min(self.max_slots, old.slots * GROWTH), self.stale_window)
        try:
            for seq, h, check, size, until, mtime, vlen, vbytes in old.live(now_ns):
                off, full = new.room(h, check, now_ns)
                if full:  # rare at half the load, and then no entry may be lost in the copy
                    off = self._move_one_out(new, h, check, now_ns) or off
                ENTRY.pack_into(new.map, off, 2, h, check, size, until, mtime, vlen, vbytes)
        except BaseException:
            new.close()
            raise
        self._table = new
        SUPERSEDED.pack_into(old.map, SUPERSEDED_AT, new.slots)  # readers stop using it, and ask
        old.close()  # clients' mappings keep the memory until they drop them
        self._listed.clear()  # its entries' offsets were the old table's
        self._listed_entries = 0
        self.grown += 1
        log.info("name index full at %d slots: now %d", old.slots, new.slots)

    def publish(self, path: str, version: str, size: int, mtime: float, valid_until: float) -> bool:
        """Vouch for ``path`` at ``version`` until ``valid_until`` (monotonic seconds); False if
        it cannot be published (a version too long for an entry: reads of it keep asking)."""
        raw = version.encode("utf-8", "surrogatepass")
        if len(raw) > VERSION_BYTES:
            self.forget(path)
            return False
        h, check = name_hashes(path)
        until_ns = int(valid_until * 1e9)
        with self._lock:
            if self._closed:
                return False
            table = self._table
            off = table.find(h, check)
            if off is None:
                now_ns = time.monotonic_ns()
                off, pushes_out = table.room(h, check, now_ns)
                if pushes_out:
                    moved = self._move_one_out(table, h, check, now_ns)
                    if moved is not None:
                        off, pushes_out = moved, False
                if pushes_out and table.slots < self.max_slots:
                    self._grow(now_ns)
                    table = self._table
                    off, _ = table.room(h, check, now_ns)
            seq, kh, kc, old_size, old_until, old_mtime, vlen, vbytes = ENTRY.unpack_from(table.map, off)
            if (kh, kc, old_size, old_mtime) == (h, check, size, mtime) and vbytes[:vlen] == raw:
                if until_ns - old_until < 1_000_000_000:
                    return True  # already there, as good as new (a warm epoch republishes every range)
                self._extend(off, seq, until_ns)
            else:
                self._write(off, seq, h, check, size, until_ns, mtime, len(raw), raw)
            self.published += 1
        return True

    def _move_one_out(self, table: _Table, h: int, check: int, now_ns: int) -> int | None:  # lock held
        """Make room in the full window of (h, check) by moving one of its entries to a free slot
        of that entry's own window (one step of cuckoo hashing); the slot it leaves, or None.
        Without it a window of PROBES random slots fills at a low load (a table of 200,000
        objects grew to 4,194,304 slots, 512 MiB mapped by every process reading by name). A
        reader looking meanwhile finds the entry in either slot, or misses it and asks the worker."""
        dead_before = now_ns - table.stale_window_ns
        for off in table.offsets(h, check):
            entry = ENTRY.unpack_from(table.map, off)
            if entry[0] & 1:
                continue
            for other in table.offsets(entry[1], entry[2]):
                if other == off:
                    continue
                kh, kc, _size, until = ENTRY.unpack_from(table.map, other)[1:5]
                if (kh, kc) == (0, 0) or until <= dead_before:
                    self._write(other, SEQ.unpack_from(table.map, other)[0], *entry[1:], table=table)
                    self._clear(off, entry[0], table=table)
                    self.moved += 1
                    return off
        return None

    def forget(self, path: str) -> None:
        """Stop vouching for ``path`` (freed, deleted, or a version the table cannot hold)."""
        h, check = name_hashes(path)
        with self._lock:
            if self._closed:
                return
            off = self._table.find(h, check)
            if off is not None:
                self._clear(off, SEQ.unpack_from(self._table.map, off)[0])

    def clear_all(self) -> None:
        """Stop vouching for every object (what was dropped cannot be told path by path: a whole
        mount invalidated); clients ask the worker again and entries come back as they do."""
        with self._lock:
            if self._closed:
                return
            table = self._table
            view = memoryview(table.map)[NAMES_HEADER.size:table.size]
            try:
                used = [(i, e[0]) for i, e in enumerate(ENTRY.iter_unpack(view)) if (e[1], e[2]) != (0, 0)]
            finally:
                view.release()
            for i, seq in used:
                self._clear(NAMES_HEADER.size + i * ENTRY.size, seq)
            self._listed.clear()
            self._listed_entries = 0

    def _clear(self, off: int, seq: int, table: _Table | None = None) -> None:  # caller holds the lock
        self._write(off, seq, 0, 0, 0, 0, 0.0, 0, b"", table=table)

    def _write(self, off: int, seq: int, *fields: Any, table: _Table | None = None) -> None:  # lock held
        """Rewrite the entry at ``off`` of ``table`` (the current one by default) under its
        sequence count: odd while being written, so a reader that sees it change, or odd, treats
        the entry as absent."""
        table = self._table if table is None else table
        gen = _GEN.unpack_from(table.map, off + GEN_AT)[0]
        SEQ.pack_into(table.map, off, seq + 1)
        ENTRY.pack_into(table.map, off, seq + 1, *fields)
        _GEN.pack_into(table.map, off + GEN_AT, (gen + 1) & 0xFFFFFFFF)
        SEQ.pack_into(table.map, off, seq + 2)

    def _extend(self, off: int, seq: int, until_ns: int) -> None:  # lock held
        """``_write`` of the entry at ``off`` with only its time moved on (its generation kept)."""
        table = self._table
        SEQ.pack_into(table.map, off, seq + 1)
        _UNTIL.pack_into(table.map, off + _UNTIL_AT, until_ns)
        SEQ.pack_into(table.map, off, seq + 2)

    def refreshed(self, path: str, version: str, size: int, mtime: float, valid_until: float) -> None:
        """The store has ``version`` of ``path`` now (its metadata just fetched): stop vouching
        for any other (a client would read pages of the old version by name until the entry ran
        out), and vouch for this one until ``valid_until`` where the entry already names it, so
        that reads by name go on after a refresh without asking the worker again."""
        self.refreshed_many([(path, version, size, mtime)], valid_until)

    def refreshed_many(self, objects: list[tuple[str, str, int, float]], valid_until: float,
                       listing: Hashable | None = None, digest: bytes = b"") -> None:
        """``refreshed`` of many objects, (path, version, size, mtime) each, under one lock (a
        listing's worth: the revalidator refreshes a directory at a time). ``listing``: the
        whole listing they are (a path), kept with its ``digest`` for ``extend_listed``."""
        until_ns = int(valid_until * 1e9)
        hashed = [(name_hashes(path), version, size, mtime) for path, version, size, mtime in objects]
        kept: list[int] = []
        with self._lock:
            if self._closed:
                return
            table = self._table
            for (h, check), version, size, mtime in hashed:
                off = table.find(h, check)
                if off is None:
                    continue
                seq, kh, kc, old_size, old_until, old_mtime, vlen, vbytes = ENTRY.unpack_from(table.map, off)
                if vbytes[:vlen] != version.encode("utf-8", "surrogatepass") or old_size != size \
                        or old_mtime != mtime:
                    self._clear(off, seq)
                    continue
                if until_ns > old_until:
                    self._extend(off, seq, until_ns)
                kept.append(off)
            if listing is not None:
                self._keep_listed(listing, digest, table, kept)

    def _keep_listed(self, listing: Hashable, digest: bytes, table: _Table, offsets: list[int]) -> None:  # lock held
        old = self._listed.pop(listing, None)
        if old is not None:
            self._listed_entries -= len(old[2])
        if len(offsets) > LISTED_ENTRIES:
            return
        offs = np.array(offsets, dtype=np.int64)
        view = _columns(table)
        gens = view["gen"][(offs - NAMES_HEADER.size) // ENTRY.size].copy()
        del view
        self._listed[listing] = (digest, table, offs, gens)
        self._listed_entries += len(offs)
        while self._listed_entries > LISTED_ENTRIES:
            _, dropped = self._listed.popitem(last=False)
            self._listed_entries -= len(dropped[2])

    def extend_listed(self, listing: Hashable, digest: bytes, valid_until: float) -> bool:
        """Vouch until ``valid_until`` for the entries ``refreshed_many`` left valid for
        ``listing``, if that listing had this ``digest`` (the store lists the same objects at the
        same versions) and none was changed since (its generation is the same: an entry published
        again with another version, moved, cleared or in a table since replaced is not; one only
        extended meanwhile, by a read or a report, still is). One vectorised
        write for a directory, where checking each object again costs a lookup and a compare
        each. False, changing nothing, where that cannot be said: refresh them one by one."""
        until_ns = int(valid_until * 1e9)
        with self._lock:
            kept = self._listed.get(listing)
            if self._closed or kept is None or kept[0] != digest or kept[1] is not self._table:
                return False
            _, table, offs, gens = kept
            view = _columns(table)
            try:
                slots = (offs - NAMES_HEADER.size) // ENTRY.size
                if not np.array_equal(view["gen"][slots], gens):
                    return False
                # As _extend does, all at once: odd while written, so a reader in between treats
                # the entry as absent (and asks the worker).
                seqs = view["seq"][slots]
                view["seq"][slots] = seqs + 1
                view["until"][slots] = np.maximum(view["until"][slots], until_ns)
                view["seq"][slots] = seqs + 2
            finally:
                del view
            self._listed.move_to_end(listing)
            self.extended += len(offs)
            return True

    def close(self) -> None:
        """Clients notice a closed worker through the handle table's heartbeat; here, only the
        memory goes (their mappings keep theirs until they drop them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._table.close()
