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
Metadata operations (info, listing pages, the view, the worker's status) go through the same
framing (metaops.py).
Plain TCP: a worker serving TLS does not open this port (daemon.py).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections.abc import Callable
from typing import Any

import xxhash

from cachefs.proto import dataport_pb2
from cachefs.pagefile import TRAILER_SIZE, CorruptPageError, decode_trailer
from cachefs.server.rpc import info_message
from cachefs.server.worker.bulkpath import NOT_CACHED, OK, CachedPages, OpenedRange
from cachefs.server.connections import MAX_PER_PEER, SEND_TIMEOUT, FramedServer, connection_limit
from cachefs.server.worker.fill import RangeFiller
from cachefs.server.worker.metaops import MetaOps

log = logging.getLogger(__name__)

Reply = dataport_pb2.DataReply
#: Connections at most, whatever the descriptor limit (server/connections.py connection_limit).
MAX_CONNECTIONS = 4096
#: A page of which less than this share is wanted is read and checked here and only that
#: part is sent; above it the whole page goes out (sendfile) and the client checks it.
WHOLE_PAGE_SHARE = 0.5


def _wait_writable(conn: socket.socket, timeout: float) -> None:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    if not poller.poll(timeout * 1000):
        raise TimeoutError("the client took no bytes for too long")


def sendfile_all(conn: socket.socket, fd: int, offset: int, count: int, timeout: float = SEND_TIMEOUT) -> None:
    """``count`` bytes of ``fd`` from ``offset`` onto the socket, in the kernel."""
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
                 **limits: Any) -> None:
        """``filler``: ranges asked for with ``fill`` are fetched into the page store first
        (fill.py); ``meta``: metadata operations (metaops.py), and the view version in every reply.
        ``check_page(pid)``: reads and checks a page found bad here (the page store drops it if it
        is, and counts it: PageStore.get), so it is fetched again rather than refused for good.
        ``limits``: ConnectionServer's (max_connections, max_per_peer, threads, timeouts)."""
        # Sized from the descriptors this process may open; from one IP (a host of many training
        # processes and their DataLoader workers, each with its connections) a quarter of them.
        limits.setdefault("max_connections", connection_limit(MAX_CONNECTIONS))
        limits.setdefault("max_per_peer", max(MAX_PER_PEER, limits["max_connections"] // 4))
        super().__init__(**limits)
        self.host, self.port, self.pages, self._on_served = host, port, pages, on_served
        self.filler, self.meta, self._check_page = filler, meta, check_page

    def _refuse(self, conn: socket.socket, message: str, retry_after: float = 0.0) -> None:
        self.send_frame(conn, Reply(code=Reply.REFUSED, message=message, retry_after_ms=int(retry_after * 1000)))

    def _bad(self, pid: Any) -> None:
        if self._check_page is not None and pid is not None:
            try:
                self._check_page(pid)
            except Exception:  # noqa: BLE001 - the page stays; the client's read goes another way
                log.exception("checking page %s failed", pid)

    def _answer(self, conn: socket.socket, body: bytes) -> None:
        request = dataport_pb2.DataRequest()
        try:
            request.ParseFromString(body)
        except Exception:
            self.send_frame(conn, Reply(code=Reply.REFUSED, message="malformed request"))
            return
        if not self.pages.token_ok(request.token):
            self.send_frame(conn, Reply(code=Reply.REFUSED, message="UNAUTHENTICATED: missing or wrong access token"))
            return
        view_version = self.meta.view_version() if self.meta is not None else 0
        if request.HasField("meta"):
            if self.meta is None:
                self.send_frame(conn, Reply(code=Reply.REFUSED, message="no metadata operations here"))
            else:
                self.send_frame(conn, Reply(code=Reply.OK, meta=self.meta.answer(request.meta),
                                             view_version=view_version))
            return
        filled = False
        fetched: list[set[Any]] = [set()]
        for attempt in range(2):  # the second: after a bad page was dropped, to fill it again
            opened = self.pages.open(request)
            if opened.code == NOT_CACHED and request.fill and self.filler is not None:
                failures: list[OSError | None] = [None]
                if self.filler.fill([request], fetched, failures):
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
