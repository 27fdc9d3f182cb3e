"""Reads by name: a local worker's cached page files opened here, with no message to the worker.

The worker's side is server/worker/names.py: a shared table of the object versions it vouches for
(and until when), handed over with the handle table to clients of its own user. With it this
process computes a page file's path (cachefs/pagenames.py), opens it, reads it and closes it, as a
local-files loader would: a DataLoader worker's first read of a page (every read of a warm epoch
with non-persistent workers) costs an open and a pread, not a socket round trip and the worker's
CPU. Checks: the worker's table is alive (its heartbeat, client/transport/handles.py), the entry matches
the path and has not run out, the version is the one asked for, and each page's trailer and
checksum are verified as for a descriptor the worker hands out (once per page file and process:
CheckedPages). A page that is not there (evicted, freed, never cached) makes the read ask the
worker as before, so this path can make a read faster, never fail it. Reads are reported to the worker with its next message (digests),
so its recency, plans and hit counters see them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import struct
import time
from collections.abc import Container

import xxhash

from cachefs.client.transport.handles import Page, file_identity
from cachefs.pagefile import TRAILER_SIZE, CorruptPageError, decode_trailer
from cachefs.pagenames import (ENTRY, NAMES_HEADER, NAMES_MAGIC, SEQ, STALE_WINDOW, STALE_WINDOW_AT, SUPERSEDED,
                               SUPERSEDED_AT, name_hashes, page_digest, page_file, path_page_digest, pick_dir,
                               probe_offsets, raw_name_hashes)
from cachefs.paths import parse_path
from cachefs.client.timeouts import REPORT_SECONDS, STALE_REPORT_SECONDS

log = logging.getLogger(__name__)

__all__ = ["PARTIAL", "NamedPages"]

#: ``read_into``'s answer for a range that wants part of a page: the general path reads it.
PARTIAL = "partial"

_OPEN = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_KEY = struct.Struct("<QQQ")  # an entry's seq, path hash and path check: read first, the rest on a match
MAX_TOUCHED = 1024  # pages read by name remembered before a report goes on its own
STALE_REPORT_BYTES = 16 << 10  # paths named in one message, at most (it is bounded by MAX_MESSAGE)
POPULATE_MAX = 16 << 20  # a name index up to this size is mapped populated
MEMO_ENTRIES = 1 << 15  # paths whose slots, and page files whose names, are remembered (then start over)
MEMO_PAGES = 64  # ... for objects of up to this many pages (a larger one's are named as read)
#: A one-page object up to this size read by name is checked on every read, not known again by
#: its file's identity (CheckedPages): an xxh3 pass over 16 KiB costs less than the fstat.
ALWAYS_CHECKED_BYTES = 16 << 10


def _check_dirs(roots: list[str], ids: list[str]) -> None:
    if len(ids) != len(roots):
        raise ValueError("the worker sent no identity for its cache dirs")
    for root, wanted in zip(roots, ids):
        try:
            st = os.stat(root)
        except OSError as exc:
            raise ValueError(f"the worker's cache dir {root} is not visible here ({exc.strerror})") from None
        if f"{st.st_dev}:{st.st_ino}" != wanted:
            raise ValueError(f"{root} here is not the worker's cache dir (another mount namespace?)")


class CheckedPages:
    """Page files this process read by name and checked, by digest and file identity.

    A page file is written once and renamed into place, never changed: the same file (device,
    inode, size, mtime and ctime) holds the bytes checked before, so a later read needs no
    checksum pass (~15 us of a 256 KiB page here, a quarter of the read), nor its trailer read
    again (a second, small buffer in the ``preadv`` cost ~4 us more). Its identity costs an
    ``fstat``, so it is looked up only from a digest's second read on (or at once in a process
    that checked pages through handed-over descriptors): a DataLoader worker that
    lives one epoch reads each page once and pays a dict lookup, no ``fstat``; a process that
    reads the data set again (workers 0, persistent workers) checks each page once or twice
    and then reads it as a local file. A page rewritten or refilled is another file: checked anew.
    Bounded: past ``capacity`` digests the memory starts over (every page checked again once).
    """

    def __init__(self, capacity: int = 1 << 16, verified: Container[tuple[int, ...]] | None = None) -> None:
        """``verified``: files this process checked through descriptors the worker handed over
        (shortcircuit.VerifiedFiles, by ``file_identity``): while it holds any, a
        first read by name looks there too (a cold epoch's pages, read by name the next)."""
        self.capacity = capacity
        self._verified = verified
        self._seen: dict[str, tuple[int, ...] | None] = {}  # digest -> file_identity checked; None: read once

    def known(self, digest: str, fd: int, length: int) -> bool | tuple[int, ...] | None:
        """True: ``fd`` is the file checked before, with ``length`` payload bytes (no checksum
        pass needed); else, to ``add`` once its checksum matches, its identity, or None on a
        digest's first read."""
        seen = self._seen.get(digest, False)
        if seen is False:
            if len(self._seen) >= self.capacity:
                self._seen.clear()
            if not self._verified:
                self._seen[digest] = None  # read once: its identity is worth an fstat next time
                return None
        identity = file_identity(fd, length)
        if identity == seen:
            return True
        if seen is False and identity in self._verified:  # type: ignore[operator]
            self._seen[digest] = identity
            return True
        return identity

    def add(self, digest: str, identity: tuple[int, ...]) -> None:
        self._seen[digest] = identity

    @property
    def seen(self) -> dict[str, tuple[int, ...] | None]:
        """digest -> the identity of the file checked (None: read once, not checked yet)."""
        return self._seen


class NamedPages:
    """One worker's name index, mapped read-only, and the page files opened through it."""

    def __init__(self, fd: int, slots: int, dirs: list[tuple[str, int]], page_size: int,
                 dir_ids: list[str] | None = None, verified: Container[tuple[int, ...]] | None = None) -> None:
        """``dir_ids``: each dir's "device:inode" as the worker sees it; a dir this process sees
        as another (another container's mounts) or not at all means no reads by name here.
        ``verified``: page files checked through handed-over descriptors (CheckedPages)."""
        size = NAMES_HEADER.size + slots * ENTRY.size
        if slots < 1 or not dirs or page_size <= 0:
            raise ValueError("a name index needs slots, cache dirs and a page size")
        if dir_ids is not None:
            _check_dirs([root for root, _quota in dirs], dir_ids)
        if os.fstat(fd).st_size < size:
            raise ValueError("the name index is smaller than its slot count says")
        # Populated at once where it is small: lookups touch entries all over the table, and a
        # fault on each first touch cost more than the lookup itself (a new DataLoader worker
        # process reads this way); a table grown large is faulted in as it is used.
        populate = getattr(mmap, "MAP_POPULATE", 0) if size <= POPULATE_MAX else 0
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED | populate, mmap.PROT_READ)
        magic, got_slots, entry_size, superseded = NAMES_HEADER.unpack_from(self._map, 0)
        if (magic, got_slots, entry_size) != (NAMES_MAGIC, slots, ENTRY.size):
            self._map.close()
            raise ValueError("not a cachefs name index")
        self.slots, self.dirs, self.page_size = slots, list(dirs), page_size
        self._only_root = self.dirs[0][0] if len(self.dirs) == 1 else None  # pick_dir's answer for every page
        self.enabled = True
        # The worker moved to a larger table (its header says so): this one is no longer kept up.
        self.superseded = bool(superseded)
        # How long past an entry's time it may still be read by name (reported as stale, so the
        # worker refreshes it): the worker's metadata stale grace (0 from an older worker).
        self.stale_window_ns = STALE_WINDOW.unpack_from(self._map, STALE_WINDOW_AT)[0]
        self._stale: set[str] = set()  # objects read past their entry's time, not reported yet
        self._lock = threading.Lock()
        self._touched: list[bytes] = []
        self._touched_bytes = 0
        self._last_report = time.monotonic()
        self._checked = CheckedPages(verified=verified)
        # Per path, where its entry may be (hashes, slot offsets); per object version, its page
        # files (digest, path): a warm epoch asks for the same objects again and again, and
        # hashing names again cost ~2 us of a ~40 us read.
        self._where: dict[str, tuple[int, int, list[int]]] = {}
        self._pages: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self._memo_pages = 0  # page file names in _pages (bounded by MEMO_ENTRIES: ~8 MiB)
        # Per one-page object read whole: where its entry is and what it said (slot offset, seq,
        # size, until), its page's digest (hex and raw) and file: while the slot's seq is the
        # same the entry is unchanged, so a warm read checks one number, not the entry (read_whole);
        # and the version it named (an entry rewritten for the same version, as a metadata
        # refresh of a long epoch does, keeps its page's name: only the entry is read again).
        self._whole: dict[str, tuple[int, int, int, int, str, bytes, str, bytes]] = {}
        # reads noted (a batch counts once), pages asked for by name but not there, and pages
        # read with no checksum pass (this process had checked the same file before)
        self.stats = {"named_reads": 0, "named_missing": 0, "named_unhashed": 0}

    # -- the index ----------------------------------------------------------------------------------
    def lookup(self, path: str) -> tuple[int, str, float] | None:
        """(size, version, mtime) the worker vouches for now, or None."""
        found = self._entry(path)
        if found is None or found[3] <= time.monotonic_ns():
            return None
        return found[0], found[1], found[2]

    def _usable(self, path: str) -> tuple[int, str, float] | None:
        """(size, version, mtime) to read ``path`` by name with: the entry while it holds, or
        within the stale window after it (the object then named to the worker for a refresh)."""
        found = self._entry(path) if self.enabled else None
        if found is None:
            return None
        size, version, mtime, until_ns = found
        now_ns = time.monotonic_ns()
        if until_ns <= now_ns:
            if now_ns - until_ns >= self.stale_window_ns:
                return None
            with self._lock:
                self._stale.add(path)
        return size, version, mtime

    def _entry(self, path: str) -> tuple[int, str, float, int] | None:
        """(size, version, mtime, until in monotonic ns) of the worker's entry for ``path``, run
        out or not, or None."""
        found = self._locate(path)
        return None if found is None else found[2:]

    def _in_use(self) -> bool:
        """False once the worker moved to a larger table (or this one was closed)."""
        try:
            if SUPERSEDED.unpack_from(self._map, SUPERSEDED_AT)[0]:
                self.superseded = True  # the next message to the worker asks for the new table
                return False
        except ValueError:  # closed under us
            return False
        return True

    def _locate(self, path: str) -> tuple[int, int, int, str, float, int] | None:
        """(slot offset, seq, size, version, mtime, until in monotonic ns) of the worker's entry
        for ``path``, run out or not, or None."""
        if not self._in_use():
            return None
        where = self._where.get(path)
        if where is None:
            h, check = name_hashes(path)
            # the entry is in one of these slots (pagenames.py): their offsets, kept per path
            where = (h, check, list(probe_offsets(h, check, self.slots)))
            if len(self._where) >= MEMO_ENTRIES:
                self._where.clear()
            self._where[path] = where
        h, check, offsets = where
        table = self._map
        for off in offsets:
            try:
                seq, kh, kc = _KEY.unpack_from(table, off)
                if kh != h or kc != check:
                    continue
                seq, kh, kc, size, until_ns, mtime, vlen, vbytes = ENTRY.unpack_from(table, off)
            except ValueError:  # closed under us
                return None
            if kh != h or kc != check or seq & 1:
                return None
            version = vbytes[:vlen].decode("utf-8", "surrogatepass")
            if SEQ.unpack_from(table, off)[0] != seq:  # rewritten while we read it
                return None
            return off, seq, size, version, mtime, until_ns
        return None

    def info(self, path: str) -> tuple[int, str, float] | None:
        """(size, version, mtime) while the object's first page is still in the worker's cache (a
        deleted or overwritten object's pages are gone at once, its entry only when it runs out);
        None for an empty object (no page to vouch for it: ask the worker)."""
        known = self._usable(path)
        if known is None or known[0] <= 0:
            return None
        try:
            os.stat(self._page_files(path, known[1], known[0], 0, 0)[0][1])
        except OSError as exc:
            self._failed(exc)
            return None
        return known

    # -- page files ---------------------------------------------------------------------------------
    def _names(self, path: str, offset: int, length: int,
               version: str) -> tuple[int, str, list[tuple[str, str, int, int]]] | None:
        """(size, version, [(digest, page file, page start, payload length)]) of a range, or None."""
        known = self._usable(path)
        if known is None:
            return None
        size, current, _mtime = known
        if version and version != current:
            return None
        end = size if length < 0 else min(size, offset + length)
        if end <= offset:
            return size, current, []
        ps = self.page_size
        first = offset // ps
        names = []
        for index, (digest, name) in enumerate(self._page_files(path, current, size, first, (end - 1) // ps), first):
            start = index * ps
            names.append((digest, name, start, min(size, start + ps) - start))
        return size, current, names

    def open_range(self, path: str, offset: int, length: int,
                   version: str = "") -> tuple[int, str, list[Page], list[str]] | None:
        """(size, version, pages opened here, their digests) covering the range, each page
        referenced once and not held (``HandleCache.release`` closes it), or None: ask the worker."""
        named = self._names(path, offset, length, version)
        if named is None:
            return None
        size, current, names = named
        pages: list[Page] = []
        try:
            for _digest, name, start, plen in names:
                fd = os.open(name, _OPEN)
                pages.append(Page(fd, start, plen, refs=1))
        except OSError as exc:
            for page in pages:
                os.close(page.fd)
            self._failed(exc)
            return None
        return size, current, pages, [d for d, _n, _s, _l in names]

    def read_whole(self, reads: list[tuple[str, int, memoryview]], results: list[tuple[int, int] | None]) -> int:
        """The reads of ``reads`` not done yet (``results[i]`` None) that want a whole object of
        one page, done here by name; returns how many (their pages are noted for the worker's
        report, and objects read past their entry's time, within the stale window, named to it
        for a refresh, as ``read_into`` does). The rest are left to ``read_into`` (which also says why a page could not be opened).

        Samples of one page are what an epoch reads, so this is ``read_into`` without its
        generality: the entry is known unchanged by its slot's seq alone (the worker bumps it
        on every write), the page file's name is remembered; then open, one ``preadv`` into the
        sample's buffer (with the trailer and a checksum pass the first time this process reads
        the file; an ``fstat`` to know the file again after that), close."""
        if not self.enabled or not self._in_use():
            return 0
        table, memo, checked = self._map, self._whole, self._checked
        now_ns = time.monotonic_ns()
        seq_at, preadv, close, open_ = SEQ.unpack_from, os.preadv, os.close, os.open
        trailer = bytearray(TRAILER_SIZE)
        raw: list[bytes] = []
        stale: list[str] = []  # read past their entry's time, within the stale window: reported
        nbytes = unhashed = 0
        for i, (path, offset, out) in enumerate(reads):
            if results[i] is not None or offset:
                continue
            known = memo.get(path)
            if known is None or seq_at(table, known[0])[0] != known[1]:  # new, or its entry rewritten
                known = self._remember_whole(path)
                if known is None:
                    continue
            _off, _seq, size, until_ns, digest, digest_raw, name, _version = known
            if len(out) != size:
                continue  # not the whole object
            past = until_ns <= now_ns  # as read_into does: within the stale window, read and report it
            if past and now_ns - until_ns >= self.stale_window_ns:
                continue
            try:
                fd = open_(name, _OPEN)
            except OSError:
                continue
            try:
                # A small page is checked at every read: its checksum costs less than the fstat
                # that would know the file again (and nothing is remembered of it).
                identity = checked.known(digest, fd, size) if size > ALWAYS_CHECKED_BYTES else None
                if identity is True:  # the file checked before: its payload alone
                    if preadv(fd, (out,), 0) != size:
                        continue
                    unhashed += 1
                else:
                    if preadv(fd, (out, trailer), 0) != size + TRAILER_SIZE:
                        continue
                    payload_len, checksum = decode_trailer(trailer)
                    if payload_len != size or xxhash.xxh3_64_intdigest(out) != checksum:
                        continue  # read_into finds it again, and the worker answers for it
                    if identity is not None:
                        checked.add(digest, identity)
            except (OSError, CorruptPageError):
                continue
            finally:
                close(fd)
            results[i] = (size, size)
            raw.append(digest_raw)
            nbytes += size
            if past:
                stale.append(path)
        if stale:
            with self._lock:
                self._stale.update(stale)
        if raw:
            self.stats["named_unhashed"] += unhashed
            self._note_raw(raw, nbytes)
        return len(raw)

    def _remember_whole(self, path: str) -> tuple[int, int, int, int, str, bytes, str, bytes] | None:
        """(slot offset, seq, size, until, digest, raw digest, page file, version bytes) of the
        entry of a one-page object, remembered for ``path``'s next read; None: no such entry.

        Once a sample in a new DataLoader worker (a warm epoch's every read), so the slot, the
        digest and the file name are worked out in one pass over the entry's bytes (``_locate``,
        ``page_digest`` and ``_file`` say the same, with a str round trip each)."""
        table = self._map
        raw = path.encode("utf-8", "surrogatepass")
        h, check = raw_name_hashes(raw)
        try:
            for off in probe_offsets(h, check, self.slots):
                seq, kh, kc = _KEY.unpack_from(table, off)
                if kh == h and kc == check:
                    break
            else:
                return None
            _seq, _h, _c, size, until_ns, _mtime, vlen, vbytes = ENTRY.unpack_from(table, off)
            if seq & 1 or SEQ.unpack_from(table, off)[0] != seq:  # being rewritten, or rewritten as we read
                return None
        except ValueError:  # closed under us
            return None
        if not 0 < size <= self.page_size:
            return None
        version = vbytes[:vlen]
        memo = self._whole
        before = memo.get(path)
        if before is not None and before[7] == version:  # the entry extended: the same page file
            known = memo[path] = (off, seq, size, until_ns, *before[4:])
            return known
        # the path matched the worker's entry byte for byte: it is canonical ("mount/key")
        hashed = path_page_digest(raw, version, 0)
        digest = hashed.hexdigest()
        root = self._only_root
        name = page_file(root, digest) if root is not None else self._file(digest)
        if len(memo) >= MEMO_ENTRIES:
            memo.clear()
        known = memo[path] = (off, seq, size, until_ns, digest, hashed.digest(), name, version)
        return known

    def read_into(self, path: str, offset: int, out: memoryview) -> tuple[int, int, list[str]] | str | None:
        """The range ``[offset, offset + len(out))`` (cut at the object's end) read into ``out``,
        page by page: open, one ``preadv`` of the payload and its trailer, close; the checksum
        checked on the bytes just read. (bytes read, object size, page digests); None: not
        readable by name (ask the worker); PARTIAL: a page is only partly wanted (read it through
        ``open_range``, which checks the whole page first).

        The lean path of a warm epoch: no descriptor bookkeeping; the checksum pass is skipped
        for a file this process checked before (``CheckedPages``: from a page's third read on,
        at the cost of an ``fstat``; a new DataLoader worker's first reads only add a dict entry).
        """
        known = self._usable(path)  # past its time but within the stale window: read, and reported
        if known is None:
            return None
        size, version = known[0], known[1]
        ps = self.page_size
        end = min(size, offset + len(out))
        if end <= offset:
            return 0, size, []
        if offset % ps or (end != size and end % ps):
            return PARTIAL  # the first or the last page is wanted only in part
        first = offset // ps
        trailer = bytearray(TRAILER_SIZE)
        digests: list[str] = []
        checked = self._checked
        for index, (digest, name) in enumerate(self._page_files(path, version, size, first, (end - 1) // ps), first):
            try:
                fd = os.open(name, _OPEN)
            except OSError as exc:
                self._failed(exc)
                return None
            try:
                start = index * ps
                plen = min(size, start + ps) - start
                target = out if plen == len(out) else out[start - offset:start - offset + plen]
                identity = checked.known(digest, fd, plen)
                if identity is True:  # the file checked before: its payload alone
                    if os.preadv(fd, (target,), 0) != plen:
                        return None
                    self.stats["named_unhashed"] += 1
                else:
                    if os.preadv(fd, (target, trailer), 0) != plen + TRAILER_SIZE:
                        return None  # short: a page being replaced, or torn; the worker answers
                    payload_len, checksum = decode_trailer(trailer)
                    if payload_len != plen or xxhash.xxh3_64_intdigest(target) != checksum:
                        return None
                    if identity is not None:
                        checked.add(digest, identity)
            except (OSError, CorruptPageError):
                return None
            finally:
                os.close(fd)
            digests.append(digest)
        return end - offset, size, digests

    def _page_files(self, path: str, version: str, size: int, first: int, last: int) -> list[tuple[str, str]]:
        """(digest, file) of pages ``first``..``last`` of an object version; those of an object
        of up to MEMO_PAGES pages computed once."""
        pages = -(-size // self.page_size)
        if pages > MEMO_PAGES:
            return self._name_pages(path, version, range(first, last + 1))
        key = (path, version)
        files = self._pages.get(key)
        if files is None or len(files) != pages:
            files = self._name_pages(path, version, range(pages))
            self._memo_pages += len(files)
            if self._memo_pages > MEMO_ENTRIES:
                self._pages.clear()
                self._memo_pages = len(files)
            self._pages[key] = files
        return files if first == 0 and last == pages - 1 else files[first:last + 1]

    def _name_pages(self, path: str, version: str, indices: range) -> list[tuple[str, str]]:
        cp = parse_path(path)
        return [(d, self._file(d)) for d in (page_digest(cp.mount, cp.key, version, i) for i in indices)]

    def covers(self, path: str, offset: int, length: int, version: str = "") -> bool:
        """True if every page of the range is there to be opened by name now (a prepare need not
        ask the worker for it)."""
        named = self._names(path, offset, length, version)
        if named is None:
            return False
        try:
            for _digest, name, _start, _plen in named[2]:
                os.stat(name)
        except OSError as exc:
            self._failed(exc)
            return False
        return True

    def _file(self, digest: str) -> str:
        return page_file(pick_dir(digest, self.dirs), digest)

    def _failed(self, exc: OSError) -> None:
        if exc.errno == errno.ENOENT:  # evicted, freed, or not cached yet: the worker answers
            self.stats["named_missing"] += 1
            return
        # The dirs are not ours to read (another user, another mount namespace): stop trying.
        log.info("cannot open the worker's page files by name (%s): asking it for descriptors instead", exc)
        self.enabled = False

    # -- reports ------------------------------------------------------------------------------------
    def note_read(self, digests: list[str], nbytes: int) -> None:
        self._note_raw([bytes.fromhex(d) for d in digests], nbytes)

    def _note_raw(self, digests: list[bytes], nbytes: int) -> None:
        with self._lock:
            if len(self._touched) < 2 * MAX_TOUCHED:  # 16 bytes each: a report stays well within MAX_MESSAGE
                self._touched.extend(digests)
            self._touched_bytes += nbytes
            self.stats["named_reads"] += 1

    def report_due(self) -> bool:
        pending, stale = self._touched, self._stale
        age = time.monotonic() - self._last_report
        if stale and (len(stale) >= MAX_TOUCHED or age >= STALE_REPORT_SECONDS):
            return True
        return bool(pending) and (len(pending) >= MAX_TOUCHED or age >= REPORT_SECONDS)

    def take_stale(self, max_bytes: int = STALE_REPORT_BYTES) -> list[str]:
        """Objects read by name past their entries' time since the last report (the worker
        refreshes them), about ``max_bytes`` of paths at most (a message is bounded: the rest
        go with the next one)."""
        taken: list[str] = []
        with self._lock:
            stale = self._stale
            budget = max_bytes
            while stale and budget > 0:
                path = stale.pop()
                taken.append(path)
                budget -= len(path) + 4
        return taken

    def take_touched(self) -> tuple[list[bytes], int]:
        with self._lock:
            touched, self._touched = self._touched, []
            nbytes, self._touched_bytes = self._touched_bytes, 0
            self._last_report = time.monotonic()
        return touched, nbytes

    def close(self) -> None:
        self.enabled = False
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
