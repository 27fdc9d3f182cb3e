"""Short-circuit reads: cached page files handed to a client on the same host, as descriptors.

Through gRPC a cached page is read from disk into Python, copied into a message, sent over
TCP and copied again on the client's side. When the client runs on the worker's host, the
worker can instead open the page files and pass their descriptors over a Unix socket
(SCM_RIGHTS), as HDFS short-circuit reads do: the client reads the bytes straight into its own
(aligned) buffer and checks each page's checksum itself. The client never learns a path and
can read only the descriptors it is handed (opened read-only); the socket is guarded by its
file mode and, when the worker has an access token, by that token in every request.

Only fully cached ranges are served here: a range with a missing page gets NOT_CACHED and the
client reads it through gRPC, which fetches, caches and serves it as usual.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from cachefs.errors import to_status
from cachefs.localhost import MAX_MESSAGE, MAX_PAGES
from cachefs.paths import parse_path
from cachefs.proto import shortcircuit_pb2
from cachefs.server.rpc import info_message

log = logging.getLogger(__name__)

Reply = shortcircuit_pb2.ShortCircuitReply
IDLE_TIMEOUT = 300.0     # a connection idle this long is closed


class ShortCircuitServer:
    def __init__(self, path: str, resolve: Callable[[Any], Any], page_ids: Callable[[Any, int], Any],
                 open_page: Callable[[Any], int | None], page_size: int, token: Callable[[str], bool] | None = None,
                 mode: int = 0o660, max_connections: int = 256,
                 on_served: Callable[[int, int], None] | None = None) -> None:
        self.path, self.mode, self.max_connections = path, mode, max_connections
        self._resolve, self._page_id, self._open_page = resolve, page_ids, open_page
        self.page_size, self._token_ok, self._on_served = page_size, token, on_served
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "ShortCircuitServer":
        if len(os.fsencode(self.path)) >= 108:
            raise ValueError(f"short-circuit socket path is too long for a Unix socket: {self.path}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.mode)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="shortcircuit-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                conn.close()  # the client falls back to gRPC
                continue
            threading.Thread(target=self._serve, args=(conn,), name="shortcircuit-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IDLE_TIMEOUT)
        try:
            while not self._stopping.is_set():
                data = conn.recv(MAX_MESSAGE)
                if not data:
                    return
                reply, fds = self._answer(data)
                try:
                    socket.send_fds(conn, [reply.SerializeToString()], fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except OSError:
            return  # the client went away, or idled out
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, data: bytes) -> tuple[Any, list[int]]:
        request = shortcircuit_pb2.ShortCircuitRequest()
        try:
            request.ParseFromString(data)
        except Exception:
            return Reply(code=Reply.REFUSED, message="malformed request"), []
        if self._token_ok is not None and not self._token_ok(request.token):
            return Reply(code=Reply.REFUSED, message="UNAUTHENTICATED: missing or wrong access token"), []
        try:
            path = parse_path(request.path)
            if request.offset < 0 or request.length < -1:
                raise ValueError("offset must be >= 0 and length >= -1")
        except Exception as exc:  # a bad path, or range
            return Reply(code=Reply.REFUSED, message=f"{to_status(exc).name}: {exc}"), []
        # Only what the worker already knows: never a store call here (a store that is down or
        # slow is gRPC's to report), and anything unusual is left to gRPC too.
        meta = self._resolve(path)
        if meta is None or meta.is_dir or (request.version and meta.version != request.version):
            return Reply(code=Reply.NOT_CACHED), []
        end = meta.size if request.length == -1 else min(meta.size, request.offset + request.length)
        first, last = request.offset // self.page_size, max(request.offset, end - 1) // self.page_size
        if end <= request.offset:
            return Reply(code=Reply.OK, info=info_message(meta)), []
        if last - first + 1 > MAX_PAGES:
            return Reply(code=Reply.REFUSED, message=f"more than {MAX_PAGES} pages in one request"), []
        fds: list[int] = []
        try:
            for index in range(first, last + 1):
                fd = self._open_page(self._page_id(meta, index))
                if fd is None:
                    for opened in fds:
                        os.close(opened)
                    return Reply(code=Reply.NOT_CACHED, info=info_message(meta)), []
                fds.append(fd)
        except BaseException:
            for opened in fds:
                os.close(opened)
            raise
        offsets = [i * self.page_size for i in range(first, last + 1)]
        lengths = [min(meta.size, o + self.page_size) - o for o in offsets]
        if self._on_served is not None:
            self._on_served(len(fds), end - request.offset)
        return Reply(code=Reply.OK, info=info_message(meta), page_offsets=offsets, page_lengths=lengths), fds


def token_checker(tokens: list[str]) -> Callable[[str], bool] | None:
    """None when the worker has no token; else a constant-time check against any of ``tokens``."""
    wanted = [t.encode() for t in tokens if t]
    if not wanted:
        return None
    return lambda given: any(hmac.compare_digest(given.encode(), t) for t in wanted)
