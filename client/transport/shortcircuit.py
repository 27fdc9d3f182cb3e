"""The client's side of short-circuit reads (server/worker/shortcircuit.py).

When the worker placed first for a range runs on this host (its ``GetStatus`` reports this
kernel's ``host_id`` and a socket path that exists here), the range is asked for over that
Unix socket; the worker answers with the page files' descriptors, which are read here with
``preadv`` and checked against each page's own checksum. Anything else (a page not cached, a
refusal, a bad checksum, a socket error) returns None and the caller reads through gRPC as
usual, so this path can only make a read faster, never fail it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import xxhash

from cachefs import rawbytes
from cachefs.localhost import MAX_MESSAGE, MAX_PAGES
from cachefs.client import forksafe
from cachefs.client.transport.handles import MAX_TOUCHED, ONCE, HandleCache, Page, TableView, file_identity
from cachefs.client.transport.namedpages import PARTIAL, NamedPages
from cachefs.client.transport.socketpool import SocketPool
from cachefs.errors import REQUEST, InvalidPathError, UnauthenticatedError, failed_range_error
from cachefs.peercred import check_server
from cachefs.proto import shortcircuit_pb2
from cachefs.pagefile import TRAILER_SIZE, CorruptPageError, decode_trailer
from cachefs.client.timeouts import NOT_CACHED_SECONDS, HELLO_RETRY, EXIT_REPORT_TIMEOUT

log = logging.getLogger(__name__)

Reply = shortcircuit_pb2.ShortCircuitReply
RangeReply = shortcircuit_pb2.RangeReply
_BATCH_RANGES = 64  # ranges per prepare message (the reply carries at most MAX_PAGES descriptors)
_NOT_CACHED_MAX = 4096
#: A range of at least this many pages is read through descriptors held from the worker (asked
#: for once, then one ``preadv`` a page) rather than opened by name (``open``, ``fstat``,
#: ``preadv``, ``close`` a page, every read): 8 readers of 64 MiB objects read 0.83-0.86 of a
#: local file's speed by name, 0.92-0.96 held (benchmarks/bench_read.py, docs/performance.md).
#: Up to a quarter of the handles this process may hold; paths whose pages the worker will not
#: let a client hold (plan-driven eviction: server/pagestore/store.py worth_holding) go by name.
HOLD_RANGE_PAGES = 8


def refusal_error(path: str, message: str) -> OSError | None:
    """The error a refused request means, as gRPC would have raised it (its fault is the
    request's: no other worker, and no other path, would take it either); None for a range
    refused as too large (the caller asks for it in pieces) or an unexplained refusal."""
    if "pages in one" in message:
        return None
    if message.startswith("UNAUTHENTICATED"):
        failure: OSError = UnauthenticatedError(f"{path}: the worker refused this client's token "
                                                f"({message}): set the cluster's token (option token)")
    elif message.startswith(("INVALID_ARGUMENT", "malformed")):
        failure = InvalidPathError(f"{path}: {message}")
    else:
        return None
    failure.cachefs_fault = REQUEST  # type: ignore[attr-defined]
    return failure


class Prepared(NamedTuple):
    """What a prepare got: ranges whose page handles are now held here (or readable by name), how
    many of them the worker had to fetch from the store first (cold: reads further ahead are
    worth a hint), and how many ranges it had to ask the worker for at all."""

    held: int
    filled: int
    asked: int = 0


#: Before multiprocessing's own finalizers of priority 0 (queues, pools), after none that matter.
EXIT_PRIORITY = 10


def _report_at_exit(ref: "weakref.ref[ShortCircuitReader]") -> None:
    reader = ref()
    if reader is None:
        return
    try:
        reader.report_at_exit()
    except Exception as exc:  # noqa: BLE001 - counts and refreshes only: never fail an exit
        log.debug("report of reads at exit to %s failed: %s", reader.path, exc)


class ShortCircuitReader:
    """Connections to one local worker's socket (one request at a time on each) and the page
    handles this process holds from that worker (client/transport/handles.py)."""

    kind = "short_circuit"

    def __init__(self, path: str, token: str = "", timeout: float = 30.0, max_idle: int = 8,
                 handles: int = 4096, counts: dict[str, int] | None = None,
                 progress: Callable[[], tuple[str, int, int] | None] | None = None, by_name: bool = True,
                 huge_pages: bool = True) -> None:
        """``progress()``: the reading job's (plan job, position, furthest since the last call),
        sent with each request.
        ``by_name``: open cached page files by name where the worker offers it (namedpages.py).
        ``huge_pages``: large results in transparent huge pages (rawbytes.py)."""
        self.path, self.token, self.timeout, self.max_idle = path, token, timeout, max_idle
        self.huge_pages = huge_pages
        self._progress = progress
        self._pid = forksafe.pid()  # a reader belongs to one process (forksafe.py): the plan's reader id
        # Pages read, as the worker knew them: hits, misses (fetched for this process's request),
        # and the part of those read through held handles (held_*). Shared with BulkPaths.stats.
        self.counts = counts if counts is not None else {}
        for name in ("hits", "misses", "held_hits", "held_misses", "named_hits"):
            self.counts.setdefault(name, 0)
        self._pool = SocketPool(self._connect, max_idle)
        self.verified = VerifiedFiles()
        self.handles = HandleCache(handles)
        self._report_lock = threading.Lock()
        self._holds = handles > 0  # descriptors handed out are kept and read again
        self._want_hello = self._holds or by_name  # the handle table (and name index) wanted
        self._reporting = False  # a report is being sent behind the reads (report(wait=False))
        self._by_name = by_name
        self.named: NamedPages | None = None  # from the same hello as the handle table
        self._hello_after = 0.0  # a read asks for the name index itself from then on (_hello_for_names)
        self._not_cached: dict[str, float] = {}  # path -> until when reads skip this socket
        self._failed: dict[str, OSError] = {}  # path -> why the worker could not fill it at all
        self._not_held: dict[str, None] = {}  # paths of large reads the worker did not let us hold
        self.view_version = 0  # the newest cluster view version a reply said the worker has
        # Run as the process exits: by multiprocessing in its children (a DataLoader worker), by
        # atexit in a main process; dropped with this reader if it goes first.
        multiprocessing.util.Finalize(self, _report_at_exit, args=(weakref.ref(self),), exitpriority=EXIT_PRIORITY)

    def _connect(self, timeout: float | None = None) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            sock.connect(self.path)
            check_server(sock, self.path)  # before any byte (the token) goes out: UntrustedServerError
        except BaseException:
            sock.close()
            raise
        return sock

    # -- one request ---------------------------------------------------------------------------------
    def _exchange(self, request: Any, timeout: float | None = None) -> tuple[bytes, list[int]]:
        """Send one request, get its reply and descriptors; a reused connection that fails (the
        worker restarted) is retried once on a new one, one that times out is not (a frozen
        worker would cost the wait twice). ``timeout``: both tries within it."""
        data = request.SerializeToString()
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in (0, 1):
            left = None if deadline is None else max(0.001, min(self.timeout, deadline - time.monotonic()))
            sock = self._pool.take() if attempt == 0 else self._connect(left)
            fds: list[int] = []
            try:
                if left is not None:
                    sock.settimeout(left)
                sock.send(data)
                message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_PAGES + 1)
                if not message:
                    raise ConnectionError("the worker closed the short-circuit socket")
            except OSError as exc:
                sock.close()
                for fd in fds:
                    os.close(fd)
                if attempt == 1 or isinstance(exc, TimeoutError):
                    raise  # a worker that did not answer in time is not a stale connection: no second wait
                self._pool.close()  # the other idle connections went with the old worker too
                continue
            if left is not None:
                sock.settimeout(self.timeout)
            self._pool.give_back(sock)
            return message, fds
        raise AssertionError("unreachable")

    def _note_view(self, reply: Any) -> None:
        if reply.view_version > self.view_version:
            self.view_version = reply.view_version

    def meta(self, request: Any, timeout: float | None = None) -> Any:
        """The worker's answer to a metadata operation (a common_pb2.MetaRequest: metaops.py);
        ``timeout``: what is left of the caller's budget (at most the reader's own timeout)."""
        message, fds = self._exchange(shortcircuit_pb2.ShortCircuitRequest(token=self.token, meta=request), timeout)
        for fd in fds:
            os.close(fd)
        reply = Reply()
        reply.ParseFromString(message)
        if reply.refused:
            raise ConnectionError(f"short-circuit socket {self.path} refused a metadata request: {reply.message}")
        self._note_view(reply)
        return reply.meta

    def request(self, ranges: list[tuple[str, int, int, str]], ahead: bool = False,
                fill: bool = True) -> list[tuple[int, str, list[Page]] | None]:
        """Ask for several ranges in one message; per range, (size, version, pages referenced:
        ``self.handles.release`` them after reading) or None (not served here: use gRPC).
        ``ahead``: handles for reads to come (the worker counts those reads when reported).
        ``fill``: what is not cached is fetched into the worker's page store first (a cold read
        on this host takes no bytes through gRPC; server/worker/fill.py)."""
        return self._request(ranges, ahead, fill)[0]

    def _request(self, ranges: list[tuple[str, int, int, str]], ahead: bool, fill: bool,
                 timeout: float | None = None) -> tuple[list[tuple[int, str, list[Page]] | None], int]:
        """``request``'s results, and how many ranges the worker filled from the store for it
        (``timeout``: at most this long for the exchange)."""
        filled = 0
        named = self.named
        # A hello: for the worker's tables, or for its name index where that grew (a new table).
        hello = self._want_hello and (not self.handles.usable() or (named is not None and named.superseded))
        touched, touched_bytes = self.handles.take_touched()
        request = shortcircuit_pb2.ShortCircuitRequest(
            ranges=[shortcircuit_pb2.RangeRequest(path=p, offset=o, length=n, version=v, ahead=ahead, fill=fill)
                    for p, o, n, v in ranges],
            token=self.token, hello=hello, touched=touched, touched_bytes=touched_bytes,
            by_name=self._usable_named() is not None or (hello and self._by_name))
        self._add_named(request)
        self._add_progress(request)
        message, fds = self._exchange(request, timeout)
        try:
            reply = Reply()
            reply.ParseFromString(message)
            if reply.refused:
                log.debug("short-circuit request refused: %s", reply.message)
                for path, *_ in ranges:  # e.g. a wrong token: asking again cannot mend it
                    self._note_refused(path, reply.message)
                return [None] * len(ranges), 0
            self._note_view(reply)
            pos = 0
            if hello and reply.instance:
                if not fds:
                    return [None] * len(ranges), 0
                self._attach(fds[0], reply)
                pos = 1
                if reply.names_slots and len(fds) > 1:
                    self._attach_names(fds[1], reply)
                    pos = 2
            results: list[tuple[int, str, list[Page]] | None] = []
            for i, got in enumerate(reply.ranges):
                if got.code == RangeReply.NOT_CACHED:
                    self._note_not_cached(ranges[i][0])
                self._note_failed(ranges[i][0], got)
                n = len(got.page_offsets) if got.code == RangeReply.OK else 0
                if got.code != RangeReply.OK or pos + n > len(fds) or len(got.slots) not in (0, n):
                    pos += n  # those descriptors are closed below
                    results.append(None)
                    continue
                slots = list(got.slots) or [0] * n
                if ahead:  # not to be held, but asked for ahead of its read: keep it for that read
                    slots = [ONCE if slot == 0 else slot for slot in slots]
                elif len(got.once) == n:  # served, not admitted: keep for one read (handles.ONCE)
                    slots = [ONCE if once and slot == 0 else slot for slot, once in zip(slots, got.once)]
                generations = list(got.generations) or [0] * n
                fetched = list(got.fetched) if len(got.fetched) == n else [False] * n
                pages = [Page(fd, start, length, slot, generation, refs=1, fetched=miss)
                         for fd, start, length, slot, generation, miss in
                         zip(fds[pos:pos + n], got.page_offsets, got.page_lengths, slots, generations, fetched)]
                for page in pages:
                    fds[pos] = -1  # owned by its Page from here
                    pos += 1
                results.append((got.info.size, got.info.version, pages))
                filled += got.filled
                path = ranges[len(results) - 1][0]
                self.handles.add(path, got.info.size, got.info.version, got.valid_ms, pages, got.info.mtime)
            results.extend([None] * (len(ranges) - len(results)))
            return results, filled
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    def _add_named(self, request: Any) -> None:
        named = self.named
        if named is not None:
            request.touched_pages[:], request.touched_pages_bytes = named.take_touched()
            request.stale_paths[:] = named.take_stale()

    def _add_progress(self, request: Any) -> None:
        progress = self._progress() if self._progress is not None else None
        if progress is not None:
            request.plan_job, request.plan_position, furthest = progress
            if furthest > request.plan_position:
                request.plan_furthest = furthest
            request.plan_reader = self._pid

    def _note_refused(self, path: str, message: str) -> None:
        """A refusal (a wrong token) is final, gRPC would refuse it too: kept as the error its
        next read raises (a range too large is not: it is asked in pieces, or through gRPC)."""
        failure = refusal_error(path, message)
        if failure is not None:
            if len(self._failed) >= _NOT_CACHED_MAX:
                self._failed = {}
            self._failed[path] = failure

    def _note_failed(self, path: str, got: Any) -> None:
        """Keep the latest reply's verdict on ``path``: FAILED (asking again cannot mend it) or not."""
        if got.code == RangeReply.REFUSED:
            self._note_refused(path, got.message)
            return
        if got.code != RangeReply.FAILED:
            if self._failed:
                self._failed.pop(path, None)
            return
        if len(self._failed) >= _NOT_CACHED_MAX:
            self._failed = {}
        message = got.message if path in got.message else f"{path}: {got.message}"
        self._failed[path] = failed_range_error(got.errno, message)

    def _raise_if_failed(self, path: str) -> None:
        failure = self._failed.pop(path, None)
        if failure is not None:
            raise failure

    def _note_not_cached(self, path: str) -> None:
        if len(self._not_cached) >= _NOT_CACHED_MAX:
            self._not_cached = {}
        self._not_cached[path] = time.monotonic() + NOT_CACHED_SECONDS

    def _known_not_cached(self, path: str) -> bool:
        until = self._not_cached.get(path)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        self._not_cached.pop(path, None)
        return False

    def _attach(self, fd: int, reply: Any) -> None:
        try:
            table = TableView(fd, reply.instance, reply.table_slots)
        except (OSError, ValueError) as exc:
            log.warning("cannot map the worker's handle table (%s): page handles are not kept", exc)
            self._want_hello = False
            return
        self.handles.attach(table, reply.page_size)
        old, self.named = self.named, None  # a new table: what an older hello gave is over
        if old is not None:
            old.close()

    def _attach_names(self, fd: int, reply: Any) -> None:
        if not self._by_name or self.handles.table is None:
            return
        try:
            self.named = NamedPages(fd, reply.names_slots, list(zip(reply.page_dirs, reply.page_dir_quotas)),
                                    reply.page_size, list(reply.page_dir_ids), verified=self.verified)
        except (OSError, ValueError) as exc:
            log.info("page files are not opened by name here: %s", exc)

    def _usable_named(self) -> NamedPages | None:
        """The name index, while it may be used (the worker's table it came with is alive)."""
        named = self.named
        if named is None or not named.enabled or not self.handles.usable():
            return None
        return named

    # -- reads ---------------------------------------------------------------------------------------------
    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None, timeout: float | None = None) -> tuple[Any, int, str] | None:
        """(data, object size, version) of the range, or None: read it through gRPC instead.

        Pages this process holds are read with no message to the worker. With ``out`` (at least
        as long as what the range holds), the pages are read straight into it (no copy through
        Python) and the filled part of ``out`` is returned as the data. ``timeout``: what is left
        of the caller's budget, bounding this socket exchange (at most the reader's own timeout).
        """
        found = self.handles.lookup(path, offset, length, version)
        hold = found is None and self._worth_holding(path, offset, length)
        if found is None and self.named is not None and not hold:
            named = self._usable_named()
            by_name = named.open_range(path, offset, length, version) if named is not None else None
            if by_name is not None:
                return self._read_named(by_name, offset, length, out)
        if found is None:
            # A process off gRPC (forksafe.grpc_avoided) has no other way: it asks the socket
            # every time (its caller asks again, within its budget: client/transport/bulkpaths.py), and an
            # error that asking again cannot mend is raised here.
            persist = forksafe.grpc_avoided()
            if not persist and self._not_cached and self._known_not_cached(path):
                return None
            found = self._request([(path, offset, length, version)], False, True, timeout)[0][0]
            if found is None:  # e.g. no such object: no use asking again here or through gRPC
                self._raise_if_failed(path)
            if found is None:
                return None
            if hold and any(page.slot in (0, ONCE) for page in found[2]):  # handed out for this read only
                self._note_not_held(path)
        elif self.handles.touched_pending() >= MAX_TOUCHED:
            self.report(wait=False)
        size, version, pages = found
        try:
            got = self._assemble(size, version, pages, offset, length, out)
            if got is not None:
                self._tally(pages)
            return got
        finally:
            self.handles.release(pages)

    def _worth_holding(self, path: str, offset: int, length: int) -> bool:
        """Whether a read that could go by name should ask for held descriptors instead: the
        range (cut at the object's end, as the name index knows it) spans HOLD_RANGE_PAGES."""
        ps = self.handles.page_size
        if not self._holds or ps <= 0 or 0 <= length < HOLD_RANGE_PAGES * ps or path in self._not_held \
                or not self.handles.usable():
            return False
        named = self._usable_named()
        known = named.lookup(path) if named is not None else None
        if known is None:
            return False
        want = known[0] - offset if length < 0 else min(length, known[0] - offset)
        return HOLD_RANGE_PAGES * ps <= want <= self.handles.capacity // 4 * ps

    def _note_not_held(self, path: str) -> None:
        if len(self._not_held) >= _NOT_CACHED_MAX:
            self._not_held.pop(next(iter(self._not_held)))
        self._not_held[path] = None

    def _read_named(self, by_name: tuple[int, str, list[Page], list[str]], offset: int, length: int,
                    out: memoryview | None) -> tuple[Any, int, str] | None:
        size, version, pages, digests = by_name
        try:
            got = self._assemble(size, version, pages, offset, length, out)
        finally:
            self.handles.release(pages)
        if got is not None:
            self.counts["hits"] += len(pages)
            self.counts["named_hits"] += len(pages)
            self._note_named(digests, len(got[0]))
        return got

    def _note_named(self, digests: list[str], nbytes: int) -> None:
        named = self.named
        if named is None:
            return
        named.note_read(digests, nbytes)
        if named.report_due():
            self.report(wait=False)

    def _tally(self, pages: list[Page]) -> None:
        """Count the pages a read used (they cover its range exactly): a page the worker fetched
        for the request that brought it is a miss on its first read, any other read a hit
        (read_held_into counts its batch the same way, once per batch)."""
        misses = 0
        for page in pages:
            if page.fetched:
                page.fetched = False
                misses += 1
        counts = self.counts
        counts["hits"] += len(pages) - misses
        if misses:
            counts["misses"] += misses

    def read_held_into(self, reads: list[tuple[str, int, memoryview]]) -> list[tuple[int, int] | None]:
        """Reads ``(path, offset, out)`` through pages this process holds, with no message and
        one lock for the batch; per read, (bytes read, object size), or None: not held (read
        it another way). A read that fails midway is None too (its ``out`` may be partly filled)."""
        if self.named is None:
            self._hello_for_names()
        found = self.handles.lookup_many([(path, offset, len(out)) for path, offset, out in reads])
        results: list[tuple[int, int] | None] = []
        used = misses = 0  # pages read, and of those fetched for the request that brought them
        try:
            for (_path, offset, out), got in zip(reads, found):
                if got is None:
                    results.append(None)
                    continue
                size, version, pages = got
                page = pages[0] if len(pages) == 1 else None
                if page is not None and page.verified and offset == 0 == page.start and page.length == size == len(out):
                    # A whole one-page object through a checked descriptor (a warm sample): one preadv.
                    filled = (out, size, version) if _pread_all(page.fd, out, 0) else None
                else:
                    filled = self._assemble(size, version, pages, offset, len(out), out)
                if filled is not None:
                    used += len(pages)
                    for page in pages:
                        if page.fetched:
                            page.fetched = False
                            misses += 1
                results.append(None if filled is None else (len(filled[0]), size))
        finally:
            self.handles.release_many(found)
            counts = self.counts  # once per batch: this is the warm path
            counts["hits"] += used - misses
            counts["held_hits"] += used - misses
            if misses:
                counts["misses"] += misses
                counts["held_misses"] += misses
        if self.named is not None and None in results:
            self._read_named_into(reads, results)
        if self.handles.touched_pending() >= MAX_TOUCHED:
            self.report(wait=False)
        return results

    def _hello_for_names(self) -> None:
        """A process's first read (a DataLoader worker's, every epoch): its hello alone brings the
        name index, so that the batch is read by name at once, rather than first asked for as
        descriptors (and each page file looked for), then read. At most one try per HELLO_RETRY."""
        if not (self._by_name and self._want_hello) or self.handles.usable() \
                or time.monotonic() < self._hello_after:
            return
        try:
            self._request([], True, False)
        except Exception as exc:  # noqa: BLE001 - the reads go on the usual way, which tells the caller what is wrong
            log.debug("short-circuit hello failed: %s", exc)
        if self.named is None:
            self._hello_after = time.monotonic() + HELLO_RETRY

    def _read_named_into(self, reads: list[tuple[str, int, memoryview]],
                         results: list[tuple[int, int] | None]) -> None:
        """The reads ``read_held_into`` found no held pages for, by name where the index allows."""
        named = self._usable_named()
        if named is None:
            return
        # One-page samples read whole (a warm epoch) in one pass; the rest page by page below.
        pages_read = named.read_whole(reads, results)  # already noted for the report
        digests: list[str] = []
        nbytes = 0
        for i, (path, offset, out) in enumerate(reads):
            if results[i] is not None:
                continue
            lean = named.read_into(path, offset, memoryview(out).cast("B"))
            if lean is None:
                continue
            if lean is not PARTIAL:
                n, size, names = lean
                results[i] = (n, size)
                digests.extend(names)
                nbytes += n
                pages_read += len(names)
                continue
            by_name = named.open_range(path, offset, len(out))
            if by_name is None:
                continue
            size, version, pages, names = by_name
            try:
                filled = self._assemble(size, version, pages, offset, len(out), out)
            finally:
                self.handles.release(pages)
            if filled is not None:
                results[i] = (len(filled[0]), size)
                digests.extend(names)
                nbytes += len(filled[0])
                pages_read += len(pages)
        if pages_read:
            self.counts["hits"] += pages_read
            self.counts["named_hits"] += pages_read
            if digests:
                named.note_read(digests, nbytes)
            if named.report_due():
                self.report(wait=False)

    def prepare(self, ranges: list[tuple[str, int, int, str]], fill: bool = True) -> Prepared:
        """Fetch handles for the ranges not held yet, in as few messages as the descriptor bound
        allows, so that the reads after it find them held (``fill``: cold ranges are fetched into
        the worker's page store first); returns how many are now held, and how many were filled."""
        missing = []
        named = self._usable_named()
        if named is None:
            # A new process (a DataLoader worker each epoch): its hello alone brings the name index,
            # and the ranges cached are then read by name, not handed over as descriptors.
            self._hello_for_names()
            named = self._usable_named()
        for r in ranges:
            found = self.handles.lookup(*r, read=False)
            if found is not None:
                self.handles.release(found[2])
            elif named is None or not named.covers(*r):
                missing.append(r)
        if not missing or not self._holds:
            return Prepared(len(ranges) - len(missing), 0)
        ready, filled = len(ranges) - len(missing), 0
        for i in range(0, len(missing), _BATCH_RANGES):
            results, n_filled = self._request(missing[i:i + _BATCH_RANGES], True, fill)
            filled += n_filled
            for got in results:
                if got is not None:
                    ready += 1
                    self.handles.release(got[2])
        return Prepared(ready, filled, len(missing))

    def info(self, path: str, fetch: int = 0) -> tuple[int, str, float] | None:
        """(size, version, mtime) of a cached file from what the worker handed out with its pages;
        with ``fetch`` > 0 and nothing known, ask for the handles of its first ``fetch`` bytes
        (a read is coming: one message brings the info and the pages for it)."""
        known = self.handles.object_info(path)
        named = self._usable_named() if known is None else None
        if named is not None:
            known = named.info(path)
            if named.report_due():  # e.g. an entry past its time: the worker refreshes it now
                self.report(wait=False)
        if known is None and fetch > 0 and self._holds:
            got = self.request([(path, 0, fetch, "")], ahead=True)[0]
            if got is not None:
                self.handles.release(got[2])
                known = self.handles.object_info(path)
        return known

    def hint(self, keys: list[str]) -> int:
        """Objects for the worker to load in the background (it answers at once); how many it took."""
        message, fds = self._exchange(shortcircuit_pb2.ShortCircuitRequest(token=self.token, load=keys))
        for fd in fds:
            os.close(fd)
        reply = Reply()
        reply.ParseFromString(message)
        return 0 if reply.refused else reply.loading

    def report(self, wait: bool = True) -> None:
        """Send the reads made through held handles or by name that the worker has not heard of
        yet. ``wait=False``: from a short-lived thread, so that a reader never waits for the
        worker to take in a thousand reads (~9 ms here: a quarter of a warm epoch's time); at most
        one such report at a time (the reads stay queued for the next one meanwhile)."""
        if not wait:
            with self._report_lock:
                if self._reporting:
                    return
                self._reporting = True
            try:
                threading.Thread(target=self._report_behind, name="cachefs-report", daemon=True).start()
            except RuntimeError:  # interpreter shutting down: the next request carries them
                self._reporting = False
            return
        request = self._report_request()
        if request is not None:
            _message, fds = self._exchange(request)
            for fd in fds:
                os.close(fd)

    def _report_request(self) -> Any | None:
        """A message with the reads not reported yet (taken), or None if there are none."""
        touched, touched_bytes = self.handles.take_touched()
        request = shortcircuit_pb2.ShortCircuitRequest(token=self.token, touched=touched,
                                                       touched_bytes=touched_bytes)
        self._add_named(request)
        if not (touched or request.touched_pages or request.stale_paths):
            return None
        self._add_progress(request)
        return request

    def report_at_exit(self) -> None:
        """The reads not reported yet, sent as this process exits, on a connection of its own
        with a short deadline (exit never waits long on a hung worker). A DataLoader worker
        leaves after its epoch without closing anything: without this its reads by name never
        reached the worker's recency and counters, nor did the objects it read past their
        entries' time, which the worker refreshes (else the next epoch finds them run out)."""
        request = self._report_request() if self._pid == forksafe.pid() else None
        if request is None:
            return
        sock = self._connect(EXIT_REPORT_TIMEOUT)
        try:
            sock.send(request.SerializeToString())
            _message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_PAGES + 1)
            for fd in fds:
                os.close(fd)
        finally:
            sock.close()

    def _report_behind(self) -> None:
        try:
            self.report()
        except Exception as exc:  # noqa: BLE001 - counts and recency only: the next request carries on
            log.debug("report of reads to %s failed: %s", self.path, exc)
        finally:
            self._reporting = False

    def _assemble(self, size: int, version: str, pages: list[Page], offset: int, length: int,
                  into: memoryview | None) -> tuple[Any, int, str] | None:
        end = size if length < 0 else min(size, offset + length)
        want = max(0, end - offset)
        if into is not None and len(into) < want:
            return None
        if into is None:
            if len(pages) > 1 and rawbytes.SUPPORTED:
                # Several pages: read them into one new bytes object (no join of the pieces).
                # Huge pages only for a result of cached pages: a cold read waits on the store anyway,
                # and there fresh 2 MiB blocks cost more than they save on a VM whose host reclaims
                # free memory (docs/performance.md).
                huge = self.huge_pages and not any(page.fetched for page in pages)
                result, view = rawbytes.fillable_bytes(want, huge=huge)
                with view:
                    filled = self._fill(pages, offset, end, view)
                return (result, size, version) if filled else None
            parts = self._pages_as_bytes(pages, offset, end)
            if parts is None:
                return None
            return (parts[0] if len(parts) == 1 else b"".join(parts)) if parts else b"", size, version
        out = into[:want]
        if not self._fill(pages, offset, end, memoryview(out).cast("B")):
            return None
        return out, size, version

    def _checked(self, page: Page) -> bool:
        """True if this page's bytes need no checksum pass (checked through this descriptor,
        or this very file was checked before in this process)."""
        if page.verified:
            return True
        identity = page.identity = self.verified.identity(page.fd, page.length)
        if identity in self.verified:
            page.verified = True
        return page.verified

    def _verified(self, page: Page) -> None:
        page.verified = True
        self.verified.add(page.identity or self.verified.identity(page.fd, page.length))

    def _fill(self, pages: list[Page], offset: int, end: int, view: memoryview) -> bool:
        """The range [offset, end) into ``view``, each page checked once per descriptor."""
        for page in pages:
            page_start, page_len = page.start, page.length
            lo, hi = max(offset, page_start), min(end, page_start + page_len)
            if hi <= lo:
                continue
            if self._checked(page):  # read only the part wanted
                if not _pread_all(page.fd, view[lo - offset:hi - offset], lo - page_start):
                    return False
                continue
            whole = lo == page_start and hi == page_start + page_len
            target = view[lo - offset:hi - offset] if whole else memoryview(bytearray(page_len))
            if not _read_page(page.fd, target, page_len):
                return False
            self._verified(page)
            if not whole:
                view[lo - offset:hi - offset] = target[lo - page_start:hi - page_start]
        return True

    def _pages_as_bytes(self, pages: list[Page], offset: int, end: int) -> list[bytes] | None:
        """The range as ``bytes`` straight from ``pread`` (cat_file's result: no buffer to copy out of)."""
        parts = []
        for page in pages:
            page_start, page_len = page.start, page.length
            lo, hi = max(offset, page_start), min(end, page_start + page_len)
            if hi <= lo:
                continue
            checked = self._checked(page)
            data = os.pread(page.fd, hi - lo, lo - page_start) if checked else os.pread(page.fd, page_len, 0)
            if not checked:
                if len(data) != page_len or not _trailer_matches(page.fd, data, page_len):
                    return None
                self._verified(page)
                data = data if hi - lo == page_len else data[lo - page_start:hi - page_start]
            if len(data) != hi - lo:
                return None
            parts.append(data)
        return parts

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.report()
        self._pool.close()
        self.handles.close()
        named, self.named = self.named, None
        if named is not None:
            named.close()

    def release_inherited(self) -> None:
        self._pool.release_inherited()
        self.handles.release_inherited()
        self.named = None  # its mapping goes with the process; a child asks for its own
        self._report_lock, self._reporting = threading.Lock(), False  # the parent's report thread is not here


class VerifiedFiles:
    """Page files this process has already checked, by file identity (bounded, least recent out).

    A page file is written once and renamed into place, never changed after: the same file
    (device, inode, size, mtime and ctime in ns) holds the bytes checked the first time, so
    reading it again needs no second checksum pass, which costs ~20% of a warm large read
    here. A page rewritten, or evicted and its inode reused, is another identity and is checked
    anew. The worker's own reads still check every page they serve.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._lock = threading.Lock()

    identity = staticmethod(file_identity)

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, identity: object) -> bool:
        with self._lock:
            if identity in self._seen:
                self._seen.move_to_end(identity)
                return True
            return False

    def add(self, identity: tuple[int, ...]) -> None:
        with self._lock:
            self._seen[identity] = None
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)


def _pread_all(fd: int, target: memoryview, offset: int) -> bool:
    got = 0
    while got < len(target):
        n = os.preadv(fd, [target[got:]], offset + got)
        if n <= 0:
            return False
        got += n
    return True


def _read_page(fd: int, target: memoryview, page_len: int) -> bool:
    """The whole payload of one page file into ``target``, verified against its trailer."""
    return _pread_all(fd, target, 0) and _trailer_matches(fd, target, page_len)


def _trailer_matches(fd: int, payload: Any, page_len: int) -> bool:
    try:
        payload_len, checksum = decode_trailer(os.pread(fd, TRAILER_SIZE, page_len))
    except CorruptPageError:
        return False
    return payload_len == page_len and xxhash.xxh3_64_intdigest(payload) == checksum
