"""The data port: cached pages to clients on other hosts over plain TCP, sent with sendfile.

Python gRPC streams ~0.8 GB/s here where loopback TCP carries ~2.4 GB/s: every byte is copied
into a message, framed, and copied out again by Python on both ends. For bytes that are
already cached, this port sends the page files themselves (``sendfile(2)``: disk cache to
socket in the kernel, no Python copy), and the client receives them with ``recv_into``
straight into its buffer (proto/dataport.proto has the framing). Whole pages go out as they
lie on disk with the checksum their trailer records, which the client checks; a page of which
only a small part is wanted is read and checked here and only that part is sent.

Same rules as short-circuit reads (bulkpath.py): the worker's own metadata, the access token in
every request, NOT_CACHED for a range not cached (the client then uses gRPC) unless the request
asks for it to be filled (fill.py: a client that must not use gRPC, a forked DataLoader worker).
Metadata operations (info, listing pages, the view, the worker's status, the mutations) go
through the same framing (metaops.py), and so do streamed writes: a part's bytes follow its
frame, the write holds its connection until its commit (writer.py).
Plain TCP: a worker serving TLS does not open this port (daemon.py).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

from cachefs.errors import wire_error
from cachefs.proto import common_pb2, dataport_pb2
from cachefs.pagefile import TRAILER_SIZE, CorruptPageError, decode_trailer
from cachefs.server.rpc import info_message
from cachefs.server.worker.bulkpath import NOT_CACHED, OK, CachedPages, OpenedRange
from cachefs.server.connections import (BUSY_RETRY_AFTER, MAX_PER_PEER, SEND_TIMEOUT, Connection, FramedServer,
                                        connection_limit)
from cachefs.server.worker.fill import RangeFiller
from cachefs.server.worker.metaops import MetaOps

log = logging.getLogger(__name__)

Reply = dataport_pb2.DataReply
#: Connections at most, whatever the descriptor limit (server/connections.py connection_limit).
MAX_CONNECTIONS = 4096
#: A page of which less than this share is wanted is read and checked here and only that
#: part is sent; above it the whole page goes out (sendfile) and the client checks it.
WHOLE_PAGE_SHARE = 0.5
#: A write part's bytes at most (the client sends 4 MiB parts: client/fs/writer.py).
MAX_WRITE_PART = (4 << 20) + (64 << 10)
#: A write part's bytes must come at least this fast (beyond the frame timeout), bytes a second.
WRITE_MIN_RATE = 1 << 20
#: Writes in progress at once at most, so that writes (a serving thread each while the store
#: takes a part) always leave threads to cached reads; past it a write is told BUSY.
MAX_WRITES = 16
#: A connection with a write in progress may wait this long for its next part (a producer
#: slower than the idle timeout, e.g. a log), then the write is discarded.
WRITE_IDLE_TIMEOUT = 600.0


def _wait_writable(conn: socket.socket, timeout: float) -> None:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    if not poller.poll(timeout * 1000):
        raise TimeoutError("the client took no bytes for too long")


def sendfile_all(conn: Any, fd: int, offset: int, count: int, timeout: float = SEND_TIMEOUT) -> None:
    """``count`` bytes of ``fd`` from ``offset`` onto the socket, in the kernel (over TLS,
    read and encrypted: server/tlsstream.py)."""
    if getattr(conn, "tls", False):
        conn.sendfile(fd, offset, count)
        return
    end = offset + count
    while offset < end:
        try:
            sent = os.sendfile(conn.fileno(), fd, offset, end - offset)
        except BlockingIOError:  # the socket has a timeout, so it is non-blocking underneath
            _wait_writable(conn, timeout)
            continue
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            raise
        if sent == 0:
            raise ConnectionError("page file ended early (truncated under us?)")
        offset += sent


class DataPortServer(FramedServer):
    name = "dataport"

    def __init__(self, host: str, port: int, pages: CachedPages,
                 on_served: Callable[[int, int, int], None] | None = None, filler: RangeFiller | None = None,
                 meta: MetaOps | None = None, check_page: Callable[[Any], Any] | None = None,
                 writes: Any = None, on_write: Callable[[bool], None] | None = None, **limits: Any) -> None:
        """``filler``: ranges asked for with ``fill`` are fetched into the page store first
        (fill.py); ``meta``: metadata operations (metaops.py), and the view version in every reply.
        ``check_page(pid)``: reads and checks a page found bad here (the page store drops it if it
        is, and counts it: PageStore.get), so it is fetched again rather than refused for good.
        ``writes``: opens streamed writes (writer.py WriteHandler.open); None refuses them;
        ``on_write(ok)``: each write that ended (committed, or failed).
        ``limits``: ConnectionServer's (max_connections, max_per_peer, threads, timeouts)."""
        # Sized from the descriptors this process may open; from one IP (a host of many training
        # processes and their DataLoader workers, each with its connections) a quarter of them.
        limits.setdefault("max_connections", connection_limit(MAX_CONNECTIONS))
        limits.setdefault("max_per_peer", max(MAX_PER_PEER, limits["max_connections"] // 4))
        super().__init__(**limits)
        self.host, self.port, self.pages, self._on_served = host, port, pages, on_served
        self.filler, self.meta, self._check_page, self.writes = filler, meta, check_page, writes
        self._on_write = on_write
        self._writing = 0  # connections with a write in progress (under _lock)

    def _refuse(self, conn: socket.socket, message: str, retry_after: float = 0.0) -> None:
        self.send_frame(conn, Reply(code=Reply.REFUSED, message=message, retry_after_ms=int(retry_after * 1000)))

    def _bad(self, pid: Any) -> None:
        if self._check_page is not None and pid is not None:
            try:
                self._check_page(pid)
            except Exception:  # noqa: BLE001 - the page stays; the client's read goes another way
                log.exception("checking page %s failed", pid)

    def _request(self, conn: Connection, request: Any) -> bool:
        if request.HasField("write"):
            return self._write(conn, request)
        if conn.session is not None:
            self._refuse(conn.stream, "a request inside a write: the write is dropped")
            return False
        if not self.pages.token_ok(request.token):
            self.send_frame(conn.stream, Reply(code=Reply.REFUSED,
                                             message="UNAUTHENTICATED: missing or wrong access token"))
            return True
        self._answer(conn.stream, request)
        return True

    def _answer(self, conn: socket.socket, request: Any) -> None:
        view_version = self.meta.view_version() if self.meta is not None else 0
        if request.HasField("meta"):
            if self.meta is None:
                self.send_frame(conn, Reply(code=Reply.REFUSED, message="no metadata operations here"))
            else:
                self.send_frame(conn, Reply(code=Reply.OK, meta=self.meta.answer(request.meta, self.slow_slot),
                                             view_version=view_version))
            return
        filled = False
        fetched: list[set[Any]] = [set()]
        for attempt in range(2):  # the second: after a bad page was dropped, to fill it again
            opened = self.pages.open(request)
            if opened.code == NOT_CACHED and request.fill and self.filler is not None:
                failures: list[OSError | None] = [None]
                with self.slow_slot() as slot:  # none: NOT_CACHED (the client's other ways)
                    filling = slot and self.filler.fill([request], fetched, failures)
                if filling:
                    if failures[0] is not None:  # no use asking again: the client raises it
                        failure = failures[0]
                        self.send_frame(conn, Reply(code=Reply.FAILED, errno=failure.errno or errno.EIO,
                                                     message=failure.strerror or str(failure),
                                                     view_version=view_version))
                        return
                    opened.close()
                    opened, filled = self.pages.open(request), True
            plan = self._plan(opened, fetched[0]) if opened.code == OK else []
            if plan is not None or attempt or not request.fill:
                break
            opened.close()  # a bad page, dropped by _plan: fetched again on the next attempt
        try:
            info = info_message(opened.meta) if opened.meta is not None else None
            if opened.code != OK:
                self.send_frame(conn, Reply(code=opened.code, message=opened.message, info=info,
                                             view_version=view_version))
                return
            if plan is None:  # a bad page (dropped): read again, it is fetched again
                self.send_frame(conn, Reply(code=Reply.NOT_CACHED, info=info))
                return
            self.send_frame(conn, Reply(code=Reply.OK, info=info, segments=[seg for seg, _ in plan],
                                         view_version=view_version, filled=filled))
            sent = 0
            for (seg, part), fd in zip(plan, opened.fds):
                if part is not None:
                    conn.sendall(part)
                else:
                    sendfile_all(conn, fd, 0, seg.length, self.send_timeout)
                sent += seg.length
            if self._on_served is not None:
                self._on_served(len(plan), sent, sum(1 for seg, _ in plan if seg.fetched))
        finally:
            opened.close()

    # -- streamed writes (writer.py) -------------------------------------------------------------
    def _write(self, conn: Connection, request: Any) -> bool:
        """One part of a write: its bytes taken off the stream, handed to the store's upload; the
        reply says the part was taken (or the write's error, which ends it; on commit, the
        written object's info). False closes the connection (the stream is out of step)."""
        part = request.write
        if part.length > MAX_WRITE_PART:
            self._refuse(conn.stream, f"a write part of {part.length} bytes is too large")
            return False
        if not self.pages.token_ok(request.token):  # before its bytes: a stranger holds no thread with them
            self._drop_write(conn)
            self._refuse(conn.stream, "UNAUTHENTICATED: missing or wrong access token")
            return False  # its bytes were not read: the stream is out of step
        data = self._take(conn, part.length)  # off the stream before anything else: it stays in step
        with self.slow_slot() as slot:
            if not slot and not part.abort:  # the part's bytes are taken: the client sends it again
                self._refuse(conn.stream, "BUSY: the worker's threads for slow work are taken", BUSY_RETRY_AFTER)
                return True
            self._write_part(conn, part, data)
        return True

    def _write_part(self, conn: Connection, part: Any, data: bytearray) -> None:
        session = conn.session
        try:
            if session is None:
                if self.writes is None:
                    raise PermissionError("this worker takes no writes on its data port")
                if not self._admit_write():
                    self._refuse(conn.stream, f"BUSY: {MAX_WRITES} writes in progress", BUSY_RETRY_AFTER)
                    return
                try:
                    session = conn.session = self.writes.open(part.path)
                except BaseException:
                    self._release_write()
                    raise
            elif part.path and part.path != str(session.path):
                raise ValueError(f"a part of {part.path!r} inside the write of {session.path}")
            if part.abort:
                self._drop_write(conn)
                self.send_frame(conn.stream, Reply(code=Reply.OK, meta=common_pb2.MetaReply()))
                return
            if data:
                session.put(data)
            reply = common_pb2.MetaReply()
            if part.commit:
                conn.session = None
                self._release_write()
                reply.info.CopyFrom(info_message(session.commit()))
                self._counted(True)
        except Exception as exc:  # noqa: BLE001 - the write is over; its error goes back as gRPC's would
            self._drop_write(conn)
            self._counted(False)
            if not isinstance(exc, (OSError, ValueError, NotImplementedError)):
                log.exception("write part of %r failed", part.path)
            code, detail, message = wire_error(exc)
            reply = common_pb2.MetaReply(error_code=code, error_detail=detail, error_message=message)
        self.send_frame(conn.stream, Reply(code=Reply.OK, meta=reply))

    def _counted(self, ok: bool) -> None:
        if self._on_write is not None:
            self._on_write(ok)

    def _take(self, conn: Connection, n: int) -> bytearray:
        """The ``n`` bytes that follow a write part's frame: what the selector already read, then
        the socket, all within the frame timeout plus ``n`` at ``WRITE_MIN_RATE`` (a client that
        trickles its bytes holds a serving thread no longer than that)."""
        data = bytearray(n)
        got = min(n, len(conn.buf))
        data[:got] = conn.buf[:got]
        del conn.buf[:got]
        view = memoryview(data)
        deadline = time.monotonic() + self.frame_timeout + n / WRITE_MIN_RATE
        try:
            while got < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionError("a write part's bytes came too slowly")
                conn.sock.settimeout(left)
                try:
                    k = conn.stream.recv_into(view[got:], n - got)
                except TimeoutError:
                    raise ConnectionError("a write part's bytes stopped coming") from None
                if k == 0:
                    raise ConnectionError("the connection closed inside a write part")
                got += k
        finally:
            conn.sock.settimeout(self.send_timeout)
        if conn.stream is not conn.sock:  # TLS: what came in behind the part waits in the frames' buffer
            conn.buf += conn.stream.drain()
        return data

    def _admit_write(self) -> bool:
        with self._lock:
            if self._writing >= MAX_WRITES:
                return False
            self._writing += 1
            return True

    def _release_write(self) -> None:
        with self._lock:
            self._writing -= 1

    def _drop_write(self, conn: Connection) -> None:
        session, conn.session = conn.session, None
        if session is not None:
            self._release_write()
            session.discard()

    def _idle_limit(self, conn: Connection) -> float:
        return WRITE_IDLE_TIMEOUT

    def _closed(self, conn: Connection) -> None:
        session, conn.session = conn.session, None
        if session is not None:  # the client went away mid-write: nothing is published
            self._release_write()
            # Off the selector's thread: discarding waits for the upload thread to stop.
            threading.Thread(target=session.discard, name="dataport-write-discard", daemon=True).start()

    def _plan(self, opened: OpenedRange,
              fetched: set[Any]) -> list[tuple[dataport_pb2.DataSegment, bytes | None]] | None:
        """Per page: (segment, None) to sendfile the whole page, or (segment, bytes) of a checked
        part; None if a page is bad (it is dropped: ``check_page``). ``fetched``: ids of the pages
        fetched for this request (flagged: misses)."""
        plan = []
        for fd, start, length, pid in zip(opened.fds, opened.page_offsets, opened.page_lengths,
                                          opened.pages or [None] * len(opened.fds)):
            lo, hi = max(opened.offset, start), min(opened.end, start + length)
            try:
                payload_len, checksum = decode_trailer(os.pread(fd, TRAILER_SIZE, length))
            except (CorruptPageError, OSError):
                return self._bad(pid)
            if payload_len != length:
                return self._bad(pid)
            if hi - lo >= WHOLE_PAGE_SHARE * length:
                plan.append((dataport_pb2.DataSegment(offset=start, length=length, checksum=checksum,
                                                      fetched=pid in fetched), None))
                continue
            data = os.pread(fd, length, 0)
            if len(data) != length or xxhash.xxh3_64_intdigest(data) != checksum:
                return self._bad(pid)
            plan.append((dataport_pb2.DataSegment(offset=lo, length=hi - lo, verified=True, fetched=pid in fetched),
                         data[lo - start:hi - start]))
        return plan
