"""What the worker's two bulk paths share: connection handling and "open the cached pages of a range".

gRPC carries control and metadata. Cached bytes can leave the worker two leaner ways: as page
file descriptors over a Unix socket to a client on this host (shortcircuit.py), or as page
files sent with sendfile over TCP to any client (dataport.py). Both serve only what is already
cached, using only metadata the worker already has (never a store call: a store that is slow
or down is gRPC's to report), and answer "not cached" for anything else, so that the client
reads it through gRPC, which fetches, caches and serves it as usual.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from cachefs.errors import to_status
from cachefs.localhost import MAX_PAGES
from cachefs.paths import parse_path

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0  # a connection with no request for this long is closed
FRAME_TIMEOUT = 5.0  # once a request has begun to arrive, the rest must come within this
SEND_TIMEOUT = 60.0  # a client that takes no bytes of its reply for this long is dropped
MAX_PER_PEER = 128  # connections from one peer (a remote IP; a local process): half of max_connections
SERVING_THREADS = 8  # threads answering requests, however many connections are open

OK, NOT_CACHED, REFUSED = 0, 1, 2  # the codes of both protocols' replies


@dataclass
class OpenedRange:
    """The outcome of a range request: a code, and on OK the object and its opened page files."""

    code: int
    message: str = ""
    meta: Any = None
    offset: int = 0
    end: int = 0  # exclusive, clipped to the object
    fds: list[int] = field(default_factory=list)
    page_offsets: list[int] = field(default_factory=list)
    page_lengths: list[int] = field(default_factory=list)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class CachedPages:
    """Opens the cached page files behind a range request, with the worker's own metadata only."""

    def __init__(self, resolve: Callable[[Any], Any], page_id: Callable[[Any, int], Any],
                 open_page: Callable[[Any], int | None], page_size: int,
                 token: Callable[[str], bool] | None = None) -> None:
        self._resolve, self._page_id, self._open_page = resolve, page_id, open_page
        self.page_size, self._token_ok = page_size, token

    def open(self, request: Any) -> OpenedRange:
        """``request`` has path, offset, length, version and token (both protocols' requests do)."""
        if self._token_ok is not None and not self._token_ok(request.token):
            return OpenedRange(REFUSED, "UNAUTHENTICATED: missing or wrong access token")
        try:
            path = parse_path(request.path)
            if request.offset < 0 or request.length < -1:
                raise ValueError("offset must be >= 0 and length >= -1")
        except Exception as exc:  # a bad path, or range
            return OpenedRange(REFUSED, f"{to_status(exc).name}: {exc}")
        meta = self._resolve(path)
        if meta is None or meta.is_dir or (request.version and meta.version != request.version):
            return OpenedRange(NOT_CACHED)
        end = meta.size if request.length == -1 else min(meta.size, request.offset + request.length)
        if end <= request.offset:
            return OpenedRange(OK, meta=meta, offset=request.offset, end=request.offset)
        first, last = request.offset // self.page_size, (end - 1) // self.page_size
        if last - first + 1 > MAX_PAGES:
            return OpenedRange(REFUSED, f"more than {MAX_PAGES} pages in one request")
        opened = OpenedRange(OK, meta=meta, offset=request.offset, end=end)
        try:
            for index in range(first, last + 1):
                fd = self._open_page(self._page_id(meta, index))
                if fd is None:
                    opened.close()
                    return OpenedRange(NOT_CACHED, meta=meta)
                opened.fds.append(fd)
                start = index * self.page_size
                opened.page_offsets.append(start)
                opened.page_lengths.append(min(meta.size, start + self.page_size) - start)
        except BaseException:
            opened.close()
            raise
        return opened


class _Conn:
    """One client connection: its socket, peer key, the bytes of a request not yet whole, and
    since when it has been idle (empty ``buf``) or receiving its current request."""

    __slots__ = ("sock", "peer", "buf", "since")

    def __init__(self, sock: socket.socket, peer: Hashable, now: float) -> None:
        self.sock, self.peer, self.buf, self.since = sock, peer, bytearray(), now


class ConnectionServer:
    """A listening socket, one selector thread and a small fixed pool of serving threads.

    The selector thread accepts, waits on every idle connection at once and reads requests as
    their bytes arrive (non-blocking); a connection with a whole request goes to a serving
    thread, which answers it and hands the connection back. So threads do not grow with
    connections, and a stalled client costs a descriptor, never a thread. A connection idle
    for ``idle_timeout``, or inside a request for ``frame_timeout``, is closed; one over
    ``max_connections`` or ``max_per_peer`` is closed at once (the client falls back to gRPC).
    """

    name = "bulk"
    recv_size = 1 << 16  # the most bytes one read of a connection takes

    def __init__(self, max_connections: int = 256, max_per_peer: int = MAX_PER_PEER,
                 idle_timeout: float = IDLE_TIMEOUT, frame_timeout: float = FRAME_TIMEOUT,
                 threads: int = SERVING_THREADS, send_timeout: float = SEND_TIMEOUT) -> None:
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.idle_timeout, self.frame_timeout, self.send_timeout = idle_timeout, frame_timeout, send_timeout
        self.threads = threads
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}  # every open connection, idle or being served
        self._per_peer: Counter[Hashable] = Counter()
        self._ready: queue.SimpleQueue[tuple[_Conn, Any] | None] = queue.SimpleQueue()  # to serve
        self._back: queue.SimpleQueue[_Conn] = queue.SimpleQueue()  # served, for the selector
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []

    # What a protocol provides.
    def _listen(self) -> socket.socket:
        raise NotImplementedError

    def _admit(self, conn: socket.socket, addr: Any) -> Hashable:
        """Set up an accepted connection; returns its peer, the key ``max_per_peer`` counts by."""
        return None

    def _take_request(self, buf: bytearray) -> Any | None:
        """Remove one whole request from the front of ``buf`` and return it; None while it is
        incomplete. Raise ValueError to close the connection."""
        raise NotImplementedError

    def _answer_request(self, conn: socket.socket, request: Any) -> bool:
        """Send the reply to one request (blocking, under ``send_timeout``); False closes."""
        raise NotImplementedError

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def start(self) -> "ConnectionServer":
        self._sock = self._listen()
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._workers = [threading.Thread(target=self._work, name=f"{self.name}-serve", daemon=True)
                         for _ in range(self.threads)]
        for worker in self._workers:
            worker.start()
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-select", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:  # a serving thread hands a connection back only before this
            self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)  # it closes the listening socket and the idle connections
        elif self._sock is not None:
            self._sock.close()
        with self._lock:
            busy = list(self._conns)
        for conn in busy:  # unblocks a serving thread mid-reply
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _ in self._workers:
            self._ready.put(None)
        for worker in self._workers:
            worker.join(timeout=5)
        while True:  # handed back after the selector thread left
            try:
                self._close(self._back.get_nowait())
            except queue.Empty:
                break
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is already pending
            if self._wake_w is not None:
                self._wake_w.send(b"x")

    def _close(self, c: _Conn) -> None:
        with self._lock:
            if self._conns.pop(c.sock, None) is not None:
                self._per_peer[c.peer] -= 1
                if not self._per_peer[c.peer]:
                    del self._per_peer[c.peer]
        c.sock.close()

    def _loop(self) -> None:
        assert self._sock is not None and self._wake_r is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        next_scan = 0.0
        try:
            while not self._stopping.is_set():
                tick = max(0.05, min(1.0, self.frame_timeout / 4, self.idle_timeout / 4))
                events = sel.select(timeout=tick)
                now = time.monotonic()
                for key, _ in events:
                    if key.fileobj is self._sock:
                        self._accept(sel, now)
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._readable(sel, key.data, now)
                while True:
                    try:
                        c = self._back.get_nowait()
                    except queue.Empty:
                        break
                    c.since = now
                    sel.register(c.sock, selectors.EVENT_READ, c)
                if now >= next_scan:
                    next_scan = now + tick
                    self._expire(sel, now)
        except Exception:  # a bug: this server stops; the clients fall back to gRPC
            log.exception("%s selector failed", self.name)
        finally:
            for key in list(sel.get_map().values()):
                if key.data is not None:
                    self._close(key.data)
            sel.close()
            self._sock.close()

    def _accept(self, sel: selectors.BaseSelector, now: float) -> None:
        assert self._sock is not None
        for _ in range(64):
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # nothing more pending; or ECONNABORTED, EMFILE: the next accept may work
            try:
                peer = self._admit(conn, addr)
                conn.setblocking(False)
            except OSError:
                conn.close()
                continue
            with self._lock:
                full = (len(self._conns) >= self.max_connections
                        or self._per_peer[peer] >= self.max_per_peer)
                if not full:
                    c = self._conns[conn] = _Conn(conn, peer, now)
                    self._per_peer[peer] += 1
            if full:
                conn.close()  # the client falls back to gRPC
                continue
            sel.register(conn, selectors.EVENT_READ, c)

    def _readable(self, sel: selectors.BaseSelector, c: _Conn, now: float) -> None:
        try:
            data = c.sock.recv(self.recv_size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        request = None
        if data:
            if not c.buf:
                c.since = now  # a request begins: the rest must come within frame_timeout
            c.buf += data
            with contextlib.suppress(ValueError):
                request = self._take_request(c.buf)
                if request is None:
                    return
        sel.unregister(c.sock)
        if request is None:
            self._close(c)  # closed by the client, or a request out of step
        else:
            self._ready.put((c, request))

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        for key in list(sel.get_map().values()):
            c = key.data
            if c is not None and now - c.since > (self.frame_timeout if c.buf else self.idle_timeout):
                sel.unregister(c.sock)
                self._close(c)

    def _work(self) -> None:
        while (item := self._ready.get()) is not None:
            c, request = item
            keep = False
            try:
                c.sock.settimeout(self.send_timeout)
                while request is not None and self._answer_request(c.sock, request):
                    request = self._take_request(c.buf)  # one the client sent right behind it
                keep = request is None
                c.sock.setblocking(False)
            except (OSError, ValueError):
                pass  # the client went away, or was too slow to take its reply
            except Exception:  # a bug must cost one connection, never the worker
                log.exception("%s connection failed", self.name)
            if keep:
                with self._lock:
                    keep = not self._stopping.is_set()
                    if keep:
                        self._back.put(c)
            if keep:
                self._wake()
            else:
                self._close(c)


def token_checker(tokens: list[str]) -> Callable[[str], bool] | None:
    """None when the worker has no token; else a constant-time check against any of ``tokens``."""
    wanted = [t.encode() for t in tokens if t]
    if not wanted:
        return None
    return lambda given: any(hmac.compare_digest(given.encode(), t) for t in wanted)
