"""The connections of the daemons' raw servers: the worker's short-circuit socket and data
port, the master's client port, the HTTP ports.

Connections waiting for a request cost no thread: one epoll selector per server reads requests
without blocking, and a whole request is served on a bounded pool of threads, a busy connection
back to back on its thread (``LINGER``). Incomplete requests, idle connections and too many
connections (in all, per peer) are closed within seconds, so a stalled or hostile client costs
neither a thread nor the other clients' reads.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import resource
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from typing import Any

from cachefs.proto import common_pb2, dataport_pb2
from cachefs.server.tlsstream import TlsStream

log = logging.getLogger(__name__)

# Limits of both raw servers (ConnectionServer's arguments; these are the defaults).
MAX_CONNECTIONS = 256  # connections in all
MAX_PER_PEER = 64  # connections from one peer: a remote IP on the data port, a process on the socket
#: Connections from one client (a process, named by its hello) on the framed ports: one host runs
#: dozens of training processes and DataLoader workers behind one IP, which its own limit bounds.
MAX_PER_CLIENT = 64
THREADS = 32  # serving threads at most, whatever the number of connections
IDLE_TIMEOUT = 30.0  # a connection with no request in flight for this long is closed
FRAME_TIMEOUT = 3.0  # once a request's first byte is in, the rest must come within this
SEND_TIMEOUT = 10.0  # a client that takes no bytes of a reply for this long is dropped
#: A serving thread waits this long for its connection's next request before handing it back to
#: the selector, unless another connection's request waits for a thread (then at once). Short
#: gaps between requests (a training step) then cost no hand-off between threads (~0.1 ms).
LINGER = 1.0
THREAD_KEEPALIVE = 30.0  # a serving thread with nothing to do for this long ends
#: Of a server's serving threads, at most this share may be in work that waits on the object
#: store or on heavy work of its own (fills, writes, mutations, listings, info, plans): the rest
#: are always there for cached reads, which a slow store must never hold up. Past it, such work
#: is told it is busy (or, a fill, left to the client's other ways) instead of taking a thread.
SLOW_SHARE = 0.5

def listen_tcp(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host`` (``0.0.0.0`` / ``::``: every address; IPv6 where the
    host is one) and ``port`` (0: a free one, read back with ``getsockname``)."""
    bind_host = "" if host in ("0.0.0.0", "::") else host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host or host == "::" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class Connection:
    """One accepted connection and what the server knows of it."""

    __slots__ = ("sock", "fd", "peer", "buf", "started", "since", "state", "request", "session", "stream",
                 "client")

    def __init__(self, sock: socket.socket, peer: Hashable, now: float) -> None:
        self.sock, self.fd, self.peer = sock, sock.fileno(), peer
        self.buf = bytearray()  # bytes of a request not complete yet (the data port's frames)
        self.started: float | None = None  # when the first byte of the incomplete request came
        self.since = now  # when it last became idle (accepted, or a reply went out)
        self.state = _IDLE
        self.request: Any = None  # the complete request it is handed to a serving thread with
        self.session: Any = None  # what the protocol keeps between requests (a write in progress)
        self.stream: Any = sock  # what requests are read from and replies sent on (TLS: tlsstream.py)
        self.client: str | None = None  # the client id its hello named (counted per client)


class _Kick:
    """A serving thread's doorbell: rung when a connection waits for a thread and all have one."""

    __slots__ = ("fd", "kicked", "lingering", "since")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.kicked = self.lingering = False
        self.since = 0.0


_IDLE, _READY, _BUSY, _CLOSED = range(4)  # watched by the selector / queued / on a thread / gone
_ARM = select.EPOLLIN | select.EPOLLONESHOT


class ConnectionServer:
    """A listening socket, one selector thread for every connection waiting for a request, and a
    bounded pool of threads that serve requests; limits on connections, per peer and in all.

    A connection waiting for a request costs no thread: the selector thread watches it (epoll,
    one-shot) and reads a request as it arrives, without blocking; once a request is whole, the
    connection goes to a serving thread, which answers it with blocking I/O (sendfile, SCM_RIGHTS:
    the GIL is released) and then waits up to ``linger`` seconds for the next request itself, so
    a busy connection is served back to back on one thread with no hand-off per request (a
    hand-off wakes two threads: ~0.1 ms here). The connection goes back to the selector when
    ``linger`` passes, when part of a request comes (its rest may never come), or at once when
    another connection's request waits and every thread has a connection (its eventfd is rung).
    So the number of threads is bounded by ``threads``, whatever the number of connections, and a
    thread is never held by a client that does not send. A request must be whole within
    ``frame_timeout`` of its first byte, and
    a connection with no request in flight is closed after ``idle_timeout`` (the clients reconnect
    when a pooled connection turns out closed). A connection over ``max_connections`` in all or
    ``max_per_peer`` for its peer (``_peer``) is closed at once, told it is busy where the protocol
    can say so (``_busy``: the framed ports' BUSY reply with a retry-after; the client backs off
    within its budget instead of taking the server for a wedged one).
    """

    name = "bulk"
    #: At ``max_connections``, close the connection idle longest to admit a new one (instead of
    #: refusing the new one): for a port where idle connections must not lock others out (HTTP).
    evict_idle = False

    def __init__(self, max_connections: int = MAX_CONNECTIONS, max_per_peer: int = MAX_PER_PEER,
                 threads: int = THREADS, idle_timeout: float = IDLE_TIMEOUT, frame_timeout: float = FRAME_TIMEOUT,
                 send_timeout: float = SEND_TIMEOUT, linger: float = LINGER,
                 thread_keepalive: float = THREAD_KEEPALIVE) -> None:
        self.max_connections, self.max_per_peer, self.threads = max_connections, max_per_peer, threads
        self.idle_timeout, self.frame_timeout, self.send_timeout = idle_timeout, frame_timeout, send_timeout
        self.linger, self.thread_keepalive = linger, thread_keepalive
        self._sock: socket.socket | None = None
        self._epoll: Any = None
        self._wake: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._conns: dict[int, Connection] = {}  # by descriptor
        self._peers: Counter[Hashable] = Counter()
        self._clients: Counter[str] = Counter()  # connections per client id (hello)
        self._ready: deque[Connection] = deque()  # whole requests waiting for a serving thread
        self._waiting = 0  # serving threads waiting for one
        self._pool = 0  # serving threads alive
        self._serving: set[_Kick] = set()  # the threads that have a connection
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._accept_paused_until = 0.0
        self._refusal_logged = 0.0
        self._slow = threading.BoundedSemaphore(max(1, int(threads * SLOW_SHARE)))
        self.counts: Counter[str] = Counter()  # refused, closed_idle, closed_frame (for tests and operators)

    # -- what each protocol provides ------------------------------------------------------------
    def _listen(self) -> socket.socket:
        raise NotImplementedError

    def _peer(self, sock: socket.socket, address: Any) -> Hashable:
        """Who a connection counts against for ``max_per_peer``."""
        raise NotImplementedError

    def _setup(self, sock: socket.socket) -> None:
        """Socket options of a new connection."""

    def _stream(self, sock: socket.socket) -> Any:
        """What a new connection's requests are read from and its replies sent on: the socket
        itself, or a TLS layer over it."""
        return sock

    def _busy(self, sock: socket.socket) -> None:
        """Tell a connection refused over a limit that this server is busy (before it is closed);
        a protocol without such a reply closes it silently."""

    def _read_request(self, conn: Connection) -> Any:
        """One whole request if there is one, reading what the socket has without blocking, else
        None (partial bytes stay in ``conn.buf``); EOFError when the peer closed between requests."""
        raise NotImplementedError

    def _handle(self, conn: Connection, request: Any) -> bool:
        """Answer one request (blocking sends, bounded by ``send_timeout``); False closes the connection."""
        raise NotImplementedError

    def _idle_limit(self, conn: Connection) -> float:
        """How long ``conn`` may wait with no request before it is closed."""
        return self.idle_timeout

    def _closed(self, conn: Connection) -> None:
        """``conn`` is gone: drop what the protocol kept for it (must not block: the selector calls it)."""

    def admit_client(self, conn: Connection, client_id: str, limit: int) -> bool:
        """Count ``conn`` against the client its hello named; False (counted: ``refused_client``)
        when that client has ``limit`` connections already."""
        with self._lock:
            if conn.client is not None:
                return True  # a second hello on the connection: counted once
            if self._clients[client_id] >= limit:
                self.counts["refused_client"] += 1
                return False
            conn.client = client_id
            self._clients[client_id] += 1
            return True

    @contextlib.contextmanager
    def slow_slot(self) -> Any:
        """Whether a thread may go into slow work now (``SLOW_SHARE``): yields True while it holds
        a slot, False (counted: ``slow_refused``) when every slot is taken; never waits."""
        got = self._slow.acquire(blocking=False)
        if not got:
            self.counts["slow_refused"] += 1
        try:
            yield got
        finally:
            if got:
                self._slow.release()

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "ConnectionServer":
        sock = self._listen()
        try:
            sock.setblocking(False)
            self._epoll = select.epoll()
            self._wake = os.pipe()
            os.set_blocking(self._wake[0], False)
            os.set_blocking(self._wake[1], False)
            self._epoll.register(sock.fileno(), select.EPOLLIN)
            self._epoll.register(self._wake[0], select.EPOLLIN)
        except BaseException:
            sock.close()
            self._close_selector()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._select_loop, name=f"{self.name}-select", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:
            busy = [c for c in self._conns.values() if c.state == _BUSY]
            self._cond.notify_all()
        for conn in busy:  # its thread is in a send: make it fail now; the thread closes it
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is None or not self._thread.is_alive():
            if self._sock is not None:
                self._sock.close()
            self._close_selector()

    def _close_selector(self) -> None:
        with self._lock:
            epoll, self._epoll = self._epoll, None
            wake, self._wake = self._wake, None
        if epoll is not None:
            epoll.close()
        for fd in wake or ():
            os.close(fd)

    def stats(self) -> dict[str, int]:
        """Connections (in all, idle in the selector, queued, being served), serving threads, and
        the connections refused or closed for a timeout since the start."""
        with self._lock:
            states = Counter(c.state for c in self._conns.values())
            return {"connections": len(self._conns), "idle": states[_IDLE], "queued": states[_READY],
                    "serving": states[_BUSY], "threads": self._pool, "peers": len(self._peers),
                    "clients": len(self._clients),
                    "refused": self.counts["refused"], "closed_idle": self.counts["closed_idle"],
                    "closed_frame": self.counts["closed_frame"]}

    # -- the selector thread ------------------------------------------------------------------------------
    def _select_loop(self) -> None:
        assert self._sock is not None and self._wake is not None
        listen_fd, wake_fd, epoll = self._sock.fileno(), self._wake[0], self._epoll
        next_scan = 0.0
        try:
            while not self._stopping.is_set():
                tick = max(0.01, min(0.5, self.frame_timeout / 4, self.idle_timeout / 4))
                try:
                    events = epoll.poll(tick)
                except InterruptedError:
                    continue
                now = time.monotonic()
                for fd, _mask in events:
                    if fd == listen_fd:
                        self._accept(now)
                    elif fd == wake_fd:
                        with contextlib.suppress(OSError):
                            os.read(wake_fd, 4096)
                    else:
                        with self._lock:
                            conn = self._conns.get(fd)
                        if conn is not None and conn.state == _IDLE:
                            self._readable(conn, now)
                if now >= next_scan:
                    self._expire(now)
                    next_scan = now + tick
        except Exception:  # a bug: log it; stop() still cleans up
            log.exception("%s selector failed", self.name)
        finally:
            self._shut_all()

    def _accept(self, now: float) -> None:
        assert self._sock is not None
        for _ in range(64):  # then the other events get their turn
            try:
                sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._stopping.is_set():
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: the listener stays readable, so stop watching
                    # it for a moment instead of spinning on it.
                    log.warning("%s: cannot accept a connection: %s", self.name, exc)
                    self._accept_paused_until = now + 0.1
                    with self._lock, contextlib.suppress(OSError, ValueError):
                        self._epoll.modify(self._sock.fileno(), 0)
                    return
                continue  # e.g. ECONNABORTED: the next one may work
            self._admit(sock, address, now)

    def _admit(self, sock: socket.socket, address: Any, now: float) -> None:
        try:
            sock.settimeout(self.send_timeout)  # non-blocking underneath: reads never wait
            self._setup(sock)
            peer = self._peer(sock, address)
        except OSError:
            sock.close()
            return
        evicted = None
        with self._lock:
            if self.evict_idle and len(self._conns) >= self.max_connections:
                # Full: the connection idle longest (no request begun) makes room for the new one.
                evicted = min((c for c in self._conns.values() if c.state == _IDLE and c.started is None),
                              key=lambda c: c.since, default=None)
                if evicted is not None:
                    self.counts["evicted"] += 1
        if evicted is not None:
            self._close(evicted)
        with self._lock:
            refused = len(self._conns) >= self.max_connections or self._peers[peer] >= self.max_per_peer
            if refused:
                self.counts["refused"] += 1
            else:
                conn = Connection(sock, peer, now)
                conn.stream = self._stream(sock)
                self._conns[conn.fd] = conn
                self._peers[peer] += 1
                self._epoll.register(conn.fd, _ARM)
        if refused:
            with contextlib.suppress(OSError):
                self._busy(sock)  # "busy, retry after": not a wedged server (the client backs off)
            sock.close()
            if now - self._refusal_logged > 60:
                self._refusal_logged = now
                log.warning("%s: refused a connection from %s (%d connections in all, %d from it)",
                            self.name, peer, len(self._conns), self._peers[peer])

    def _readable(self, conn: Connection, now: float) -> None:
        try:
            request = self._read_request(conn)
        except (EOFError, OSError):
            self._close(conn)
            return
        except Exception:  # a bug must cost one connection, never the worker
            log.exception("%s connection failed", self.name)
            self._close(conn)
            return
        if request is None:
            if conn.buf and conn.started is None:
                conn.started = now
            self._arm(conn)
            return
        conn.started = now if conn.buf else None
        self._dispatch(conn, request)

    def _expire(self, now: float) -> None:
        """Close what timed out: incomplete requests and idle connections; resume accepting."""
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            with self._lock, contextlib.suppress(OSError, ValueError):
                self._epoll.modify(self._sock.fileno(), select.EPOLLIN)
        expired = []
        with self._lock:
            for conn in self._conns.values():
                if conn.state != _IDLE:
                    continue
                if conn.started is not None:
                    if now - conn.started >= self.frame_timeout:
                        expired.append((conn, "closed_frame"))
                elif now - conn.since >= (self.idle_timeout if conn.session is None else self._idle_limit(conn)):
                    expired.append((conn, "closed_idle"))
            for conn, why in expired:
                self.counts[why] += 1
        for conn, _why in expired:
            self._close(conn)

    def _shut_all(self) -> None:
        """On stop: close every connection not on a serving thread, wake the idle threads."""
        with self._cond:
            mine = [c for c in self._conns.values() if c.state in (_IDLE, _READY)]
            self._ready.clear()
            self._cond.notify_all()
        for conn in mine:
            self._close(conn)

    # -- serving threads ----------------------------------------------------------------------------------
    def _dispatch(self, conn: Connection, request: Any) -> None:
        conn.request = request
        spawn = closed = False
        with self._cond:
            if self._stopping.is_set():
                closed = True
            else:
                conn.state = _READY
                self._ready.append(conn)
                if self._waiting >= len(self._ready):
                    self._cond.notify()
                elif self._pool < self.threads:
                    self._pool += 1
                    spawn = True
                else:  # every thread has a connection: the one that waits longest for its next request gives it up
                    victim = min((k for k in self._serving if not k.kicked), default=None,
                                 key=lambda k: (not k.lingering, k.since))
                    if victim is not None:
                        victim.kicked = True
                        os.eventfd_write(victim.fd, 1)
        if closed:
            self._close(conn)
        elif spawn:
            try:
                threading.Thread(target=self._serving_thread, name=f"{self.name}-serve", daemon=True).start()
            except RuntimeError:  # cannot start a thread: the others take it when free
                with self._lock:
                    self._pool -= 1
                log.warning("%s: cannot start a serving thread", self.name)

    def _serving_thread(self) -> None:
        kick = _Kick()
        poller = select.poll()
        poller.register(kick.fd, select.POLLIN)
        try:
            while True:
                with self._cond:
                    self._serving.discard(kick)
                    if kick.kicked:
                        kick.kicked = False
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(kick.fd)
                    deadline = time.monotonic() + self.thread_keepalive
                    while not self._ready:
                        remaining = deadline - time.monotonic()
                        if self._stopping.is_set() or remaining <= 0:
                            return
                        self._waiting += 1
                        try:
                            self._cond.wait(remaining)
                        finally:
                            self._waiting -= 1
                    if self._stopping.is_set():
                        return
                    conn = self._ready.popleft()
                    conn.state = _BUSY
                    self._serving.add(kick)
                self._serve(conn, kick, poller)
        finally:
            with self._lock:
                self._pool -= 1
                self._serving.discard(kick)
            os.close(kick.fd)

    def _serve(self, conn: Connection, kick: _Kick, poller: Any) -> None:
        """Requests on one connection back to back, while they come within ``linger`` seconds."""
        request, conn.request = conn.request, None
        poller.register(conn.fd, select.POLLIN)
        try:
            while request is not None:
                if not self._handle(conn, request) or self._stopping.is_set():
                    self._close(conn)
                    return
                conn.since = time.monotonic()
                request = self._next(conn, kick, poller)
        except (EOFError, OSError):
            self._close(conn)
            return
        except Exception:  # a bug must cost one connection, never the worker
            log.exception("%s connection failed", self.name)
            self._close(conn)
            return
        finally:
            poller.unregister(conn.fd)
        self._arm(conn)

    def _next(self, conn: Connection, kick: _Kick, poller: Any) -> Any:
        """The connection's next request if it comes whole within ``linger`` and no connection
        waits for this thread; else None (the connection goes back to the selector)."""
        if conn.buf:  # a request sent right behind the last one
            request = self._read_request(conn)
            if request is not None:
                conn.started = time.monotonic() if conn.buf else None
                return request
        kick.since, kick.lingering = conn.since, True
        end = conn.since + min(self.linger, self.idle_timeout)
        try:
            while not kick.kicked:
                remaining = end - time.monotonic()
                if remaining <= 0 or not poller.poll(remaining * 1000) or kick.kicked:
                    return None
                request = self._read_request(conn)
                if request is not None:
                    conn.started = time.monotonic() if conn.buf else None
                    return request
                if conn.buf:  # part of a request: the selector waits for the rest, not a thread
                    conn.started = time.monotonic()
                    return None
            return None
        finally:
            kick.lingering = False

    # -- both -------------------------------------------------------------------------------------------
    def _arm(self, conn: Connection) -> None:
        """Back to the selector: watched until its next request, or its timeout."""
        with self._lock:
            if not self._stopping.is_set() and conn.state != _CLOSED:
                conn.state = _IDLE
                try:
                    self._epoll.modify(conn.fd, _ARM)
                    return
                except (OSError, ValueError):
                    pass
        self._close(conn)

    def _close(self, conn: Connection) -> None:
        with self._lock:
            if self._conns.get(conn.fd) is conn:
                del self._conns[conn.fd]
                self._peers[conn.peer] -= 1
                if self._peers[conn.peer] <= 0:
                    del self._peers[conn.peer]
                if conn.client is not None:
                    self._clients[conn.client] -= 1
                    if self._clients[conn.client] <= 0:
                        del self._clients[conn.client]
                if self._epoll is not None:
                    with contextlib.suppress(OSError, ValueError):
                        self._epoll.unregister(conn.fd)
            conn.state = _CLOSED
        conn.sock.close()
        if conn.session is not None:
            try:
                self._closed(conn)
            except Exception:  # a bug must cost one connection, never the server
                log.exception("%s: dropping a closed connection's state failed", self.name)


def token_checker(tokens: list[str]) -> Callable[[str], bool] | None:
    """None when the server has no token; else a constant-time check against any of ``tokens``."""
    wanted = [t.encode() for t in tokens if t]
    if not wanted:
        return None
    return lambda given: any(hmac.compare_digest(given.encode(), t) for t in wanted)


#: What a connection refused over a limit is told to wait before it tries again.
BUSY_RETRY_AFTER = 0.2


def connection_limit(cap: int, share: int = 4) -> int:
    """Connections a raw server takes at most: ``1/share`` of the descriptors this process may
    open (the rest are page files, stores, gRPC), at least 64, at most ``cap``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return cap if soft == resource.RLIM_INFINITY else max(64, min(cap, soft // share))


_HELLO = common_pb2.MetaRequest.HELLO
FRAME = struct.Struct(">I")  # a frame's header: the length of the message that follows, big-endian
MAX_REQUEST = 64 << 10  # a request frame's body at most (a larger one is refused and closed)
_READ_SIZE = 16 << 10  # bytes read at a time while a request comes in (one read for any usual request)


class FramedServer(ConnectionServer):
    """A TCP server of length-prefixed frames (``FRAME``, then a message of that many bytes),
    one request at a time per connection: the data port's framing (proto/dataport.proto), also
    spoken by the master's client port. A subclass answers ``_answer(stream, body)`` (the stream:
    the socket, or its TLS layer where ``tls_context`` is set: server/tlsstream.py)."""

    def __init__(self, tls_context: ssl.SSLContext | None = None, **limits: Any) -> None:
        super().__init__(**limits)
        self.tls_context = tls_context

    def _stream(self, sock: socket.socket) -> Any:
        return sock if self.tls_context is None else TlsStream(sock, self.tls_context)

    def _listen(self) -> socket.socket:
        sock = listen_tcp(self.host, self.port, 128)
        self.port = sock.getsockname()[1]
        return sock

    def _peer(self, sock: socket.socket, address: Any) -> Hashable:
        return address[0]  # the remote IP

    def _setup(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _read_request(self, conn: Connection) -> bytes | int | None:
        """A whole frame's body, or its size when it is too large; None while it is incomplete."""
        if conn.buf:
            got = self._frame(conn.buf)
            if got is not None:
                return got
        if conn.stream is not conn.sock:  # TLS: what the records that came in hold
            try:
                data = conn.stream.take()
            except EOFError:
                if conn.buf:
                    raise ConnectionError("connection closed inside a frame") from None
                raise
            if not data:
                return None
            conn.buf += data
            return self._frame(conn.buf)
        try:
            data = os.read(conn.fd, _READ_SIZE)
        except BlockingIOError:
            return None
        if not data:
            if conn.buf:
                raise ConnectionError("connection closed inside a frame")
            raise EOFError
        if not conn.buf and len(data) >= FRAME.size and FRAME.unpack_from(data)[0] == len(data) - FRAME.size:
            return data[FRAME.size:]  # the usual case: one whole request in one read
        conn.buf += data
        return self._frame(conn.buf)

    @staticmethod
    def _frame(buf: bytearray) -> bytes | int | None:
        if len(buf) < FRAME.size:
            return None
        (size,) = FRAME.unpack_from(buf)
        if size > MAX_REQUEST:
            return size
        if len(buf) < FRAME.size + size:
            return None
        body = bytes(buf[FRAME.size:FRAME.size + size])
        del buf[:FRAME.size + size]
        return body

    max_per_client = MAX_PER_CLIENT

    def _handle(self, conn: Connection, body: bytes | int) -> bool:
        if isinstance(body, int):
            self._refuse(conn.stream, f"request of {body} bytes is too large")
            return False  # the stream is out of step: close it
        request = dataport_pb2.DataRequest()
        try:
            request.ParseFromString(body)
        except Exception:  # protobuf's DecodeError
            self._refuse(conn.stream, "malformed request")
            return conn.session is None  # a write's stream is out of step: closed, the write dropped
        if request.HasField("meta") and request.meta.op == _HELLO and request.meta.client_id:
            if not self.admit_client(conn, request.meta.client_id, self.max_per_client):
                self._refuse(conn.stream, f"BUSY: {self.max_per_client} connections from this client",
                             BUSY_RETRY_AFTER)
                return False
        return self._request(conn, request)

    def _request(self, conn: Connection, request: Any) -> bool:
        """Answer one parsed request (a ``DataRequest``); False closes the connection."""
        self._answer(conn.stream, request)
        return True

    @staticmethod
    def send_frame(conn: socket.socket, message: Any) -> None:
        data = message.SerializeToString()
        conn.sendall(FRAME.pack(len(data)) + data)

    def _refuse(self, conn: socket.socket, message: str, retry_after: float = 0.0) -> None:
        """A reply refusing the request (each protocol's own message); ``retry_after`` > 0: busy."""
        raise NotImplementedError

    def _busy(self, sock: socket.socket) -> None:
        # Sent at accept, before the client's request is read: the reply it reads first. Not
        # on TLS (no reply before a handshake): the connection is closed, and the client retries.
        if self.tls_context is None:
            self._refuse(sock, "BUSY: too many connections", BUSY_RETRY_AFTER)

    def _answer(self, stream: Any, request: Any) -> None:
        raise NotImplementedError
