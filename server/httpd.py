"""The daemons' small HTTP port: /metrics, /healthz, /readyz, and extra pages (the master's /status).

One server per daemon instance (no process-global state): Prometheus scrapes /metrics,
Kubernetes probes /healthz (liveness: the process answers and is not stopping) and
/readyz (readiness: the daemon's own check, e.g. page store open, state readable).
Every check and page runs on the request's own thread, so a slow one never blocks a scrape.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpServer:
    """``start()`` binds ``host:port`` (0 = pick one) and serves on a thread; ``port`` says where."""

    def __init__(self, host: str, port: int, endpoints: HttpEndpoints) -> None:
        self.host = host
        self.requested_port = port
        self.endpoints = endpoints
        self.port: int | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "HttpServer":
        cls = _Server6 if ":" in self.host else _Server
        self._server = cls((self.host, self.requested_port), _handler(self.endpoints))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="cachefs-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = None
