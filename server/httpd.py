"""The daemons' small HTTP port: /metrics, /healthz, /readyz, and extra pages (the master's /status).

One server per daemon instance (no process-global state): Prometheus scrapes /metrics,
Kubernetes probes /healthz (liveness: the process answers and is not stopping) and
/readyz (readiness: the daemon's own check, e.g. page store open, state readable).
Requests are served on a bounded pool of threads; idle and slow connections wait in a selector
and are closed on timeouts (server/connections.py), so thousands of them neither take
threads nor keep the others from an answer. Pages are snapshots refreshed at most once a second
(the master's /status asks every worker), built by one request while the others get the last.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from cachefs.server.connections import Connection

log = logging.getLogger(__name__)

# Bounds of the HTTP port (HttpServer's defaults; _HttpConnections).
MAX_CONNECTIONS = 512  # open connections at most; past it the one idle longest is closed
THREADS = 8  # threads serving requests, whatever the number of connections
IDLE_TIMEOUT = 15.0  # seconds a connection may wait between requests
HEAD_TIMEOUT = 5.0  # seconds from a request's first byte until its head is whole (slowloris)
SEND_TIMEOUT = 10.0  # seconds a client may take no bytes of a reply
MAX_HEAD = 16 << 10  # bytes of a request head
LISTEN_BACKLOG = 1024
SNAPSHOT_SECONDS = 1.0  # pages (the master's /status) are built at most once a second

# (ok, one line saying why) -- shown as the probe's body so `kubectl describe` tells the reason.
Check = Callable[[], tuple[bool, str]]
# () -> (content type, body)
Page = Callable[[], tuple[str, bytes]]


def always_ok() -> tuple[bool, str]:
    return True, "ok"


@dataclass(frozen=True)
class HttpEndpoints:
    """What one daemon serves on its HTTP port."""

    registry: CollectorRegistry
    live: Check = always_ok
    ready: Check = always_ok
    pages: Mapping[str, Page] = field(default_factory=dict)  # path -> page, e.g. "/status"
    redirects: Mapping[str, str] = field(default_factory=dict)  # path -> location, e.g. "/" -> "/status"


def _handler(endpoints: HttpEndpoints) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "cachefs"
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._serve(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(endpoints.registry), body)
                elif path in ("/healthz", "/readyz"):
                    ok, why = (endpoints.live if path == "/healthz" else endpoints.ready)()
                    self._send(200 if ok else 503, "text/plain; charset=utf-8", (why + "\n").encode(), body)
                elif path in endpoints.pages:
                    ctype, payload = endpoints.pages[path]()
                    self._send(200, ctype, payload, body)
                elif path in endpoints.redirects:
                    self._send(302, "text/plain; charset=utf-8", b"", body,
                               headers={"Location": endpoints.redirects[path]})
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n", body)
            except Exception as exc:  # a broken page must not take the port down
                log.exception("HTTP %s failed", path)
                self._send(500, "text/plain; charset=utf-8", f"{type(exc).__name__}\n".encode(), body)

        def _send(self, code: int, ctype: str, payload: bytes, body: bool,
                  headers: Mapping[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: stay quiet
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _Snapshot:
    """A page built at most once per ``max_age`` seconds, by one request at a time: the others get
    the last one (while it is rebuilt too), or wait for the first. The master's /status asks
    every worker; without this, each request would, and a burst of them would be a storm."""

    def __init__(self, page: Page, max_age: float) -> None:
        self._page, self.max_age = page, max_age
        self._cond = threading.Condition()
        self._value: tuple[str, bytes] | None = None
        self._at = float("-inf")
        self._building = False

    def __call__(self) -> tuple[str, bytes]:
        with self._cond:
            while True:
                fresh = self._value is not None and time.monotonic() - self._at < self.max_age
                if fresh or (self._building and self._value is not None):
                    return self._value  # type: ignore[return-value]
                if not self._building:
                    break
                self._cond.wait()  # the first build: wait for it
            self._building = True
        value = None
        try:
            value = self._page()
            return value
        finally:
            with self._cond:
                if value is not None:
                    self._value, self._at = value, time.monotonic()
                self._building = False
                self._cond.notify_all()


@functools.lru_cache(maxsize=1)
def _connections_class() -> type:
    """_HttpConnections, defined on first use: the worker package imports this module, so its
    connection server cannot be imported at this module's import."""
    from cachefs.server.connections import ConnectionServer, listen_tcp

    class _HttpConnections(ConnectionServer):
        """The HTTP port on the worker's connection server (server/connections.py): idle and
        half-sent connections wait in one selector and cost no thread; a request head is served on
        a bounded pool of threads once it is whole; a head not whole within ``HEAD_TIMEOUT`` seconds
        of its first byte (slowloris) and a connection idle for ``IDLE_TIMEOUT`` are closed; past
        ``MAX_CONNECTIONS`` the connection idle longest makes room for a new one."""

        name = "http"
        evict_idle = True

        def __init__(self, host: str, port: int, endpoints: HttpEndpoints, **limits: Any) -> None:
            super().__init__(**{"max_connections": MAX_CONNECTIONS, "max_per_peer": MAX_CONNECTIONS,
                                "threads": THREADS, "idle_timeout": IDLE_TIMEOUT, "frame_timeout": HEAD_TIMEOUT,
                                "send_timeout": SEND_TIMEOUT, "linger": 0.2, **limits})
            self.host, self.port = host, port
            self._handler_class = _handler(endpoints)

        def _listen(self) -> socket.socket:
            sock = listen_tcp(self.host, self.port, LISTEN_BACKLOG)
            self.port = sock.getsockname()[1]
            return sock

        def _peer(self, sock: socket.socket, address: Any) -> Hashable:
            return address[0]

        def _setup(self, sock: socket.socket) -> None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _read_request(self, conn: Connection) -> bytes | None:
            """A whole request head (through its blank line), else None; a head over MAX_HEAD closes."""
            head = self._head(conn)
            if head is not None:
                return head
            try:
                data = os.read(conn.fd, 65536)
            except BlockingIOError:
                return None
            if not data:
                raise EOFError
            conn.buf += data
            head = self._head(conn)
            if head is None and len(conn.buf) > MAX_HEAD:
                raise ConnectionError("request head too large")
            return head

        @staticmethod
        def _head(conn: Connection) -> bytes | None:
            end = conn.buf.find(b"\r\n\r\n")
            if end < 0 or end + 4 > MAX_HEAD:
                return None
            head = bytes(conn.buf[:end + 4])
            del conn.buf[:end + 4]
            return head

        def _handle(self, conn: Connection, head: bytes) -> bool:
            """Answer one request with http.server's parsing; False closes the connection."""
            handler = self._handler_class.__new__(self._handler_class)
            handler.rfile, handler.wfile = io.BytesIO(head), io.BytesIO()
            handler.client_address, handler.server, handler.request = ("", 0), self, conn.sock
            handler.close_connection = True
            handler.handle_one_request()
            reply = handler.wfile.getvalue()
            if reply:
                conn.sock.sendall(reply)
            return not handler.close_connection

    return _HttpConnections


class HttpServer:
    """``start()`` binds ``host:port`` (0 = pick one) and serves on a thread; ``port`` says where.
    Bounded (``_connections_class``): a few thousand idle or slow connections cost neither threads
    nor the answers to the others; pages are snapshots at most ``snapshot_seconds`` old."""

    def __init__(self, host: str, port: int, endpoints: HttpEndpoints, snapshot_seconds: float = SNAPSHOT_SECONDS,
                 **limits: Any) -> None:
        self.host = host
        self.requested_port = port
        self.endpoints = dataclasses.replace(
            endpoints, pages={path: _Snapshot(page, snapshot_seconds) for path, page in endpoints.pages.items()}) \
            if snapshot_seconds > 0 else endpoints
        self.port: int | None = None
        self._limits = limits
        self._server: Any = None

    def start(self) -> "HttpServer":
        self._server = _connections_class()(self.host, self.requested_port, self.endpoints, **self._limits).start()
        self.port = self._server.port
        return self

    def stats(self) -> dict[str, int]:
        return self._server.stats() if self._server is not None else {}

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.stop()
        self._server = None
