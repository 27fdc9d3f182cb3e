"""The daemons' HTTP port (server/httpd.py): routes, failing checks and pages, and the worker's readiness."""

from __future__ import annotations

import http.client
import shutil
import socket

from prometheus_client import CollectorRegistry, Counter

from cachefs.server.httpd import HttpEndpoints, HttpServer


def _request(port: int, path: str, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(), dict(resp.getheaders())
    finally:
        conn.close()


def test_routes_checks_and_a_failing_page():
    registry = CollectorRegistry()
    Counter("cachefs_test_things", "Things.", registry=registry).inc(3)
    state = {"ready": False}

    def broken() -> tuple[str, bytes]:
        raise RuntimeError("boom")

    server = HttpServer("127.0.0.1", 0, HttpEndpoints(
        registry, ready=lambda: (state["ready"], "ok" if state["ready"] else "page store closed"),
        pages={"/page": lambda: ("text/html; charset=utf-8", b"<p>hi</p>"), "/broken": broken},
        redirects={"/": "/page"})).start()
    try:
        assert server.port and server.port > 0
        code, body, headers = _request(server.port, "/metrics")
        assert code == 200 and "cachefs_test_things_total 3.0" in body
        assert headers["Content-Type"].startswith("text/plain")
        assert _request(server.port, "/healthz")[:2] == (200, "ok\n")
        assert _request(server.port, "/readyz")[:2] == (503, "page store closed\n")
        state["ready"] = True
        assert _request(server.port, "/readyz?verbose=1")[:2] == (200, "ok\n")
        assert _request(server.port, "/page")[:2] == (200, "<p>hi</p>")
        code, _, headers = _request(server.port, "/")
        assert code == 302 and headers["Location"] == "/page"
        assert _request(server.port, "/broken")[:2] == (500, "RuntimeError\n")
        assert _request(server.port, "/nothing")[0] == 404
        code, body, headers = _request(server.port, "/healthz", method="HEAD")
        assert code == 200 and body == "" and headers["Content-Length"] == "3"
        assert _request(server.port, "/page")[0] == 200  # still serving after the failure
    finally:
        server.stop()
    with socket.socket() as s:  # the port is released (SO_REUSEADDR: a TIME_WAIT is not a listener)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
        s.listen()


def test_worker_readiness_follows_registration_and_cache_dir(make_worker, tmp_path, dead_port):
    worker = make_worker(metrics_port=0, master=f"127.0.0.1:{dead_port}")  # the master is away
    code, body, _ = _request(worker.metrics_port, "/readyz")
    assert code == 503 and "not yet registered" in body
    assert _request(worker.metrics_port, "/healthz")[0] == 200

    standalone = make_worker(metrics_port=0)
    assert _request(standalone.metrics_port, "/readyz")[:2] == (200, "ok\n")
    shutil.rmtree(standalone.config.cache_dirs[0].path)  # the disk went away
    code, body, _ = _request(standalone.metrics_port, "/readyz")
    assert code == 503 and "cache dir missing" in body
    standalone.stop(grace=0.5)
    assert _request(worker.metrics_port, "/readyz")[0] == 503
