"""The client's side of a worker's data port (server/worker/dataport.py, proto/dataport.proto).

Cached ranges of a worker on another host come over TCP (TLS where the cluster has it): the worker sends its page files
with sendfile and they are received here with ``recv_into`` straight into the caller's buffer
(a training loop's aligned tensor), one copy fewer than gRPC and no message framing in Python.
Whole pages arrive with the checksum of their trailer, checked here. Anything unusual (not
cached, refused, a bad checksum, a socket error) returns None or raises OSError, and the
caller reads through gRPC instead.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

import xxhash

from cachefs import rawbytes
from cachefs.client.transport.socketpool import SocketPool
from cachefs.client.transport.shortcircuit import refusal_error
from cachefs.errors import (DeadlineExceededError, OverloadedError, WorkerUnavailableError, failed_range_error,
                            from_wire_error)
from cachefs.client import forksafe
from cachefs.localhost import PROTOCOL_VERSION, host_id
from cachefs.proto import common_pb2, dataport_pb2
from cachefs.tls import PLAINTEXT, TLSConfig, shared_client_context

Reply = dataport_pb2.DataReply
FRAME = struct.Struct(">I")
MAX_REPLY = 1 << 20
_HOST = host_id()
#: A write part's bytes (the worker takes up to 4 MiB + 64 KiB: server/worker/dataport.py).
WRITE_PART = 4 << 20


def busy_error(where: str, reply: Any) -> OverloadedError:
    """A server over its connection limit said so (a REFUSED reply with ``retry_after_ms``): an
    OverloadedError whose ``retry_after`` (seconds) is what it asked for."""
    error = OverloadedError(f"{where}: {reply.message} (retry after {reply.retry_after_ms} ms)")
    error.retry_after = reply.retry_after_ms / 1000  # type: ignore[attr-defined]
    return error


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (blocking, MSG_WAITALL: one call for most segments; TLS
    takes no flags)."""
    got, n = 0, len(view)
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < n:
        k = sock.recv_into(view[got:], n - got, flags)
        if k == 0:
            raise ConnectionError("the worker closed the data connection mid-reply")
        got += k


def _exchange_head(sock: socket.socket, frame: bytes) -> bytes | None:
    """Send a request, get its reply's frame header; None if the worker had closed (or reset)
    the connection before answering any of it: the request was not served, and may be sent again."""
    try:
        sock.sendall(frame)
        first = sock.recv(FRAME.size)
    except (ConnectionResetError, BrokenPipeError):
        return None
    if not first:
        return None
    return first if len(first) == FRAME.size else first + bytes(_recv_bytes(sock, FRAME.size - len(first)))


def _recv_bytes(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _set_timeouts(sock: socket.socket, timeout: float) -> None:
    """Kernel-side timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket, so that MSG_WAITALL
    works; a TLS socket's own timeout (its reads retry inside OpenSSL)."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(timeout)
        return
    seconds = int(timeout)
    value = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class DataPortReader:
    """Connections to one worker's data port; one request at a time on each."""

    kind = "data_port"

    def __init__(self, host: str, port: int, token: str = "", timeout: float = 30.0, max_idle: int = 8,
                 counts: dict[str, int] | None = None, huge_pages: bool = True, tls: TLSConfig = PLAINTEXT,
                 role: str = "client") -> None:
        """``tls``: the cluster's TLS settings (enabled: the port is spoken over TLS, verified as
        gRPC verifies the worker); ``role``: what this process is, said in each connection's hello."""
        self.host, self.port, self.token, self.timeout, self.max_idle = host, port, token, timeout, max_idle
        self.tls, self.role = tls, role
        self.server: Any = None  # the server's answer to the last hello (role, protocol version)
        self.huge_pages = huge_pages  # large results in transparent huge pages (rawbytes.py)
        # Pages read (hits: the data port serves only cached pages; a range with a missing page
        # is NOT_CACHED and read through gRPC, which counts its misses). Shared with BulkPaths.stats.
        self.counts = counts if counts is not None else {}
        self.counts.setdefault("hits", 0)
        self._pool = SocketPool(self._connect, max_idle)
        self.view_version = 0  # the newest cluster view version a reply said the worker has

    def connect(self) -> socket.socket:
        """A new connection of this process's own to the data port (a write holds one)."""
        return self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls.enabled:  # the handshake within the connect timeout
                sock = shared_client_context(self.tls).wrap_socket(sock, server_hostname=self.host.strip("[]"))
            else:
                sock.settimeout(None)
            _set_timeouts(sock, self.timeout)
            self._hello(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _hello(self, sock: socket.socket) -> None:
        """A new connection's first exchange: who this process is (the server counts its
        connections per client) and which protocol it speaks; the server's answer kept."""
        hello = common_pb2.MetaRequest(op=common_pb2.MetaRequest.HELLO, protocol=PROTOCOL_VERSION,
                                       client_id=f"{_HOST}:{forksafe.pid()}", client_role=self.role)
        body = dataport_pb2.DataRequest(token=self.token, meta=hello).SerializeToString()
        head = _exchange_head(sock, FRAME.pack(len(body)) + body)
        if head is None:
            raise ConnectionError(f"{self.host}:{self.port} closed the connection at its hello")
        (size,) = FRAME.unpack(head)
        if size > MAX_REPLY:
            raise ConnectionError(f"{self.host}:{self.port}: hello reply header of {size} bytes")
        reply = Reply.FromString(bytes(_recv_bytes(sock, size)))
        if reply.code == Reply.REFUSED:
            where = f"{self.host}:{self.port}"
            if reply.retry_after_ms:
                raise busy_error(where, reply)
            raise refusal_error(where, reply.message) or ConnectionError(f"{where} refused the hello: {reply.message}")
        if reply.view_version > self.view_version:
            self.view_version = reply.view_version
        self.server = reply.meta

    def hello(self) -> Any:
        """The server's answer to this process's hello (role, protocol): connecting if need be."""
        if self.server is None:
            self._pool.give_back(self._connect())
        return self.server

    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None, fill: bool = False,
             timeout: float | None = None) -> tuple[Any, int, str] | None:
        """(data, object size, version) of the range, or None: read it through gRPC instead.

        With ``out`` (at least as long as what the range holds), the bytes land in it and the
        filled part of ``out`` is returned as the data. ``fill``: the worker fetches what is not
        cached first (a process that must not use gRPC); a range it cannot fill at all (no such
        object, no permission) raises that error. ``timeout``: what is left of the caller's
        budget, bounding this exchange (at most the reader's own timeout).
        """
        request = dataport_pb2.DataRequest(path=path, offset=offset, length=length, version=version,
                                           token=self.token, fill=fill)
        failure: list[OSError] = []

        def receive(sock: socket.socket, reply: Any) -> Any:
            if reply.code == Reply.OK:
                return self._receive(sock, reply, offset, length, out, self.huge_pages)
            if reply.code == Reply.REFUSED:  # a wrong token, a bad request: final where the caller asks
                refused = refusal_error(path, reply.message)
                if refused is not None and fill:
                    failure.append(refused)
                return None
            if reply.code == Reply.FAILED:  # nothing follows the header: the connection stays in step
                message = reply.message if path in reply.message else f"{path}: {reply.message}"
                failure.append(failed_range_error(reply.errno, message))
            return None

        result, reply = self._roundtrip(request, receive, timeout)
        if failure:
            raise failure[0]
        if result is not None:
            misses = sum(1 for seg in reply.segments if seg.fetched)
            self.counts["hits"] += len(reply.segments) - misses
            self.counts["misses"] += misses
        return result

    def meta(self, request: Any, timeout: float | None = None) -> Any:
        """The worker's answer to a metadata operation (a common_pb2.MetaRequest: metaops.py);
        ``timeout``: what is left of the caller's budget (at most the reader's own timeout)."""
        result, reply = self._roundtrip(dataport_pb2.DataRequest(token=self.token, meta=request),
                                        lambda _sock, reply: reply, timeout)
        if reply.code != Reply.OK:
            raise refusal_error(f"{self.host}:{self.port}", reply.message) or ConnectionError(
                f"data port {self.host}:{self.port} refused a metadata request: {reply.message}")
        return result.meta

    def _roundtrip(self, request: Any, receive: Callable[[socket.socket, Any], Any],
                   timeout: float | None = None) -> tuple[Any, Any]:
        """Send one request, read its reply header and hand both to ``receive`` (which takes
        whatever follows the header off the socket); returns what it returned, and the header.
        ``timeout``: both tries (a pooled connection the worker had closed, then a new one) within it."""
        body = request.SerializeToString()
        frame = FRAME.pack(len(body)) + body
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in (0, 1):
            sock = self._pool.idle() if attempt == 0 else None
            reused = sock is not None
            sock = sock or self._connect()
            left = None if deadline is None else max(0.001, min(self.timeout, deadline - time.monotonic()))
            try:
                if left is not None and left < self.timeout:
                    _set_timeouts(sock, left)
                head = _exchange_head(sock, frame)
                if head is None:
                    if reused:
                        # The worker closed this pooled connection while it was idle (its idle
                        # timeout, or a restart), and so the older ones: once more on a new one.
                        sock.close()
                        self._pool.close()
                        continue
                    raise ConnectionError("the worker closed the data connection")
                (size,) = FRAME.unpack(head)
                if size > MAX_REPLY:
                    raise ConnectionError(f"data port reply header of {size} bytes")
                reply = Reply.FromString(bytes(_recv_bytes(sock, size)))
                if reply.retry_after_ms and reply.code == Reply.REFUSED:
                    raise busy_error(f"data port {self.host}:{self.port}", reply)
                if reply.view_version > self.view_version:
                    self.view_version = reply.view_version
                result = receive(sock, reply)
                if left is not None and left < self.timeout:
                    _set_timeouts(sock, self.timeout)
            except BaseException:
                sock.close()  # out of step with the stream, or gone: never reused
                raise
            self._pool.give_back(sock)
            return result, reply
        raise AssertionError("unreachable")

    @staticmethod
    def _receive(sock: socket.socket, reply: Any, offset: int, length: int,
                 into: memoryview | None, huge: bool = False) -> tuple[Any, int, str] | None:
        """Take every segment off the socket (so the connection stays usable) into the output
        (a caller's buffer, or a new ``bytes`` filled in place: no copy out of a bytearray)."""
        size = reply.info.size
        end = size if length < 0 else min(size, offset + length)
        want = max(0, end - offset)
        usable = into is None or len(into) >= want
        if not usable:
            out: Any = bytearray(0)
            view = memoryview(out)
        elif into is not None:
            out = into[:want]
            view = memoryview(out).cast("B")
        elif rawbytes.SUPPORTED:
            out, view = rawbytes.fillable_bytes(want, huge=huge)
        else:
            out = bytearray(want)
            view = memoryview(out)
        good, covered = usable, offset
        for seg in reply.segments:
            seg_end = seg.offset + seg.length
            direct = usable and seg.offset >= offset and seg_end <= end
            target = view[seg.offset - offset:seg_end - offset] if direct else memoryview(bytearray(seg.length))
            _recv_into(sock, target)
            if not seg.verified and xxhash.xxh3_64_intdigest(target) != seg.checksum:
                good = False  # keep reading: the rest of the reply must leave the socket
            lo, hi = max(offset, seg.offset), min(end, seg_end)
            if good and hi > lo:
                if lo > covered:
                    good = False  # a hole: never hand back bytes nobody wrote
                if not direct:
                    view[lo - offset:hi - offset] = target[lo - seg.offset:hi - seg.offset]
                covered = max(covered, hi)
        view.release()
        if not good or covered < end:
            return None
        return (out if into is not None or isinstance(out, bytes) else bytes(out)), size, reply.info.version

    def close(self) -> None:
        self._pool.close()

    def release_inherited(self) -> None:
        self._pool.release_inherited()


class DataPortWrite:
    """One object's streamed write to a worker's data port, on a connection of its own: parts of
    ``WRITE_PART`` bytes, each answered before the next (the worker hands it to the store's upload
    and says so, or says why the write failed); ``finish`` commits, and only that publishes the
    object. Closing the connection before it (``cancel``, an error, this process dying) discards
    the write on the worker."""

    def __init__(self, port: DataPortReader, path: str, size_hint: int, timeout: float,
                 min_throughput: int) -> None:
        self.where = f"write {path} (data port {port.host}:{port.port})"
        self._port, self._path, self._size_hint = port, path, size_hint
        self._timeout, self._min_throughput = timeout, min_throughput
        self._sock: socket.socket | None = None
        self._first = True

    def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_PART):
            self._part(view[start:start + WRITE_PART])

    def finish(self) -> Any:
        """Commit: the written object's info (a common_pb2.ObjectInfo) once the store has it."""
        try:
            return self._part(b"", commit=True).info
        finally:
            self.cancel()

    def cancel(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _part(self, data: bytes | memoryview, commit: bool = False) -> Any:
        part = dataport_pb2.WritePart(length=len(data), commit=commit)
        if self._first:
            part.path, part.size_hint = self._path, self._size_hint
        body = dataport_pb2.DataRequest(token=self._port.token, write=part).SerializeToString()
        # The worker answers a part once the store's upload has room for it: a part's bytes at
        # the least throughput beyond the metadata timeout; a commit, the whole upload's tail.
        wait = self._timeout + max(len(data), WRITE_PART) / self._min_throughput
        deadline = time.monotonic() + wait
        while True:
            try:
                if self._sock is None:
                    self._sock = self._port.connect()
                _set_timeouts(self._sock, wait)
                self._sock.sendall(FRAME.pack(len(body)) + body)
                if data:
                    self._sock.sendall(data)
                reply = self._reply()
            except OverloadedError as busy:  # the worker is busy with slow work: the part again, later
                retry_after = getattr(busy, "retry_after", 0.2)
                if time.monotonic() + retry_after >= deadline:
                    self.cancel()
                    raise
                if self._first:  # nothing of the write on it yet: a connection refused at accept is closed
                    self.cancel()
                time.sleep(retry_after)
                continue
            except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO/SO_SNDTIMEO ran out
                self.cancel()
                raise DeadlineExceededError(f"{self.where}: the worker took no part for {wait:.0f} s") from None
            except ConnectionError as exc:
                self.cancel()
                raise WorkerUnavailableError(f"{self.where}: {exc}") from exc
            except BaseException:
                self.cancel()  # the worker discards what it had
                raise
            break
        self._first = False
        meta = reply.meta
        if meta.error_code:
            self.cancel()
            raise from_wire_error(meta.error_code, meta.error_detail, meta.error_message, self.where)
        return meta

    def _reply(self) -> Any:
        assert self._sock is not None
        (size,) = FRAME.unpack(bytes(_recv_bytes(self._sock, FRAME.size)))
        if size > MAX_REPLY:
            raise ConnectionError(f"{self.where}: reply header of {size} bytes")
        reply = Reply.FromString(bytes(_recv_bytes(self._sock, size)))
        if reply.code == Reply.REFUSED:
            if reply.retry_after_ms:
                raise busy_error(self.where, reply)
            raise refusal_error(self.where, reply.message) or ConnectionError(f"{self.where}: {reply.message}")
        return reply
