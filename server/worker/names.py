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

import mmap
import os
import threading
import time

from cachefs.pagenames import ENTRY, NAMES_HEADER, NAMES_MAGIC, SEQ, VERSION_BYTES, name_hashes, probe_slots

__all__ = ["NameIndex"]


class NameIndex:
    """Table of (path -> version, size, mtime, valid until), in a memfd: a path's entry is in one
    of its ``probe_slots`` (cachefs/pagenames.py)."""

    def __init__(self, slots: int = 1 << 16) -> None:
        if slots < 1:
            raise ValueError(f"a name index needs at least 1 slot, got {slots}")
        self.slots = slots
        self.size = NAMES_HEADER.size + slots * ENTRY.size
        self._fd = os.memfd_create("cachefs-names", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size)
            self._map = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        NAMES_HEADER.pack_into(self._map, 0, NAMES_MAGIC, slots, ENTRY.size)
        self._lock = threading.Lock()
        self._closed = False
        self.published = 0

    def reader_fd(self) -> int:
        """A new read-only descriptor of the table, to send to a client (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def _offsets(self, h: int, check: int) -> list[int]:
        return [NAMES_HEADER.size + slot * ENTRY.size for slot in probe_slots(h, check, self.slots)]

    def _find(self, h: int, check: int) -> int | None:  # caller holds the lock
        """The offset of ``path``'s entry, if it has one."""
        for off in self._offsets(h, check):
            kh, kc = ENTRY.unpack_from(self._map, off)[1:3]
            if (kh, kc) == (h, check):
                return off
        return None

    def _room(self, h: int, check: int) -> int:  # caller holds the lock
        """Where a new entry goes: a free or run-out slot of its window, else the one that runs out
        first (a cache of the worker's knowledge: the entry it replaces is asked of the worker)."""
        now_ns = time.monotonic_ns()
        best, best_until = 0, None
        for off in self._offsets(h, check):
            kh, kc, _size, until = ENTRY.unpack_from(self._map, off)[1:5]
            if (kh, kc) == (0, 0) or until <= now_ns:
                return off
            if best_until is None or until < best_until:
                best, best_until = off, until
        return best

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
            off = self._find(h, check)
            if off is None:
                off = self._room(h, check)
            seq, kh, kc, old_size, old_until, old_mtime, vlen, vbytes = ENTRY.unpack_from(self._map, off)
            if (kh, kc, old_size, old_mtime) == (h, check, size, mtime) and vbytes[:vlen] == raw \
                    and until_ns - old_until < 1_000_000_000:
                return True  # already there, as good as new (a warm epoch republishes every range)
            SEQ.pack_into(self._map, off, seq + 1)  # odd: being written
            ENTRY.pack_into(self._map, off, seq + 1, h, check, size, until_ns, mtime, len(raw), raw)
            SEQ.pack_into(self._map, off, seq + 2)
            self.published += 1
        return True

    def forget(self, path: str) -> None:
        """Stop vouching for ``path`` (freed, deleted, or a version the table cannot hold)."""
        h, check = name_hashes(path)
        with self._lock:
            if self._closed:
                return
            off = self._find(h, check)
            if off is not None:
                self._clear(off, SEQ.unpack_from(self._map, off)[0])

    def _clear(self, off: int, seq: int) -> None:  # caller holds the lock
        SEQ.pack_into(self._map, off, seq + 1)
        ENTRY.pack_into(self._map, off, seq + 1, 0, 0, 0, 0, 0.0, 0, b"")
        SEQ.pack_into(self._map, off, seq + 2)

    def forget_other(self, path: str, version: str) -> None:
        """The store has ``version`` of ``path`` now: stop vouching for any other (a client would
        read pages of the old version by name until the entry ran out)."""
        h, check = name_hashes(path)
        with self._lock:
            if self._closed:
                return
            off = self._find(h, check)
            if off is None:
                return
            seq, _kh, _kc, _size, _until, _mtime, vlen, vbytes = ENTRY.unpack_from(self._map, off)
            if vbytes[:vlen] != version.encode("utf-8", "surrogatepass"):
                self._clear(off, seq)

    def close(self) -> None:
        """Clients notice a closed worker through the handle table's heartbeat; here, only the
        memory goes (their mappings keep theirs until they drop them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._map.close()
            os.close(self._fd)
