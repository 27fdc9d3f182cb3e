"""The master's status page in a real browser, the daemons' probes, and escaping of user data.

A real master and two workers run as processes; headless Chromium loads /status and the test
reads the DOM it built. Chromium comes from Debian's `chromium` package (.ci/setup installs it):
without it the browser test skips here, and fails under CI=true.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import grpc
import pytest

from cachefs.local import LocalCluster
from cachefs.proto import master_pb2, master_pb2_grpc
from cachefs.server.master.statuspage import ClusterStatus, WorkerRow, render
from helpers import payload, wait_for

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


def _chromium() -> str:
    if CHROMIUM:
        return CHROMIUM
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed (CI=true): .ci/setup should have installed Debian's chromium")
    pytest.skip("chromium is not installed (apt-get install chromium); the status page is not checked in a browser")


def _dump_dom(browser: str, url: str, profile: Path, timeout: float = 90) -> str:
    """The DOM Chromium built for ``url``, serialized."""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--dump-dom", url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Elements(HTMLParser):
    """Collects the data-* attributes of the rows the page marks, and every text node."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.text: list[str] = []
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if "data-worker-id" in a or "data-job-id" in a:
            self.rows.append(a)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(dom: str) -> _Elements:
    p = _Elements()
    p.feed(dom)
    return p


def _get(port: int, path: str) -> tuple[int, str, dict[str, str]]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def test_render_escapes_user_data_and_loads_nothing_external():
    evil = '<script>alert("x")</script>'
    status = ClusterStatus(
        master_id="m1", view_version=3, generated_at=0.0,
        workers=[WorkerRow(worker_id=evil, address="h:1", version="v", answered=False, health=f"bad {evil}",
                           heartbeat_age=1.0, capacity_bytes=100, used_bytes=50, hits=3, misses=1)],
        mounts=[{"name": "m", "url": f"s3://b/{evil}", "read_only": True}],
        jobs=[master_pb2.Job(job_id="j1", kind=master_pb2.LOAD, path=f"m/{evil}", state=master_pb2.RUNNING,
                             error=evil)],
    )
    page = render(status)
    assert "<script" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    parsed = _parse(page)
    assert not any(a.get("src") or a.get("href") for _, a in parsed.tags)  # no external assets at all
    assert [r["data-worker-id"] for r in parsed.rows if "data-worker-id" in r] == [evil]
    assert "75.0%" in "".join(parsed.text)  # 3 hits of 4 lookups


@pytest.fixture
def cluster(tmp_path: Path):
    store = tmp_path / "store"
    for i in range(6):
        (store / "d").mkdir(parents=True, exist_ok=True)
        (store / "d" / f"obj-{i}.bin").write_bytes(payload(100_000 + i, i))
    # A 30 s lease keeps a stopped worker in the view long enough to see it not answering, even on
    # a machine so busy that the worker's last heartbeat came late (busy-core CI once lost it at 10 s).
    c = LocalCluster(str(tmp_path / "cluster"), workers=2, mounts={"data": str(store)}, quota="64MiB",
                     master_args=["--metrics-port", "0", "--lease-seconds", "30"])
    with c:
        assert c.wait_for_workers(timeout=30)
        yield c


def test_probes_and_redirect(cluster: LocalCluster):
    port = cluster.master.ready["metrics_port"]
    assert _get(port, "/healthz")[0] == 200
    code, body, _ = _get(port, "/readyz")
    assert (code, body.strip()) == (200, "ok")
    code, _, headers = _get(port, "/")
    assert code == 302 and headers["Location"] == "/status"
    assert _get(port, "/nope")[0] == 404
    for worker in cluster.workers:
        wport = worker.ready["metrics_port"]
        assert _get(wport, "/healthz")[0] == 200
        assert wait_for(lambda: _get(wport, "/readyz")[0] == 200, timeout=10)  # registered with the master
        assert _get(wport, "/status")[0] == 404  # the status page is the master's only
        assert "cachefs_worker_cache_hit_ratio" in _get(wport, "/metrics")[1]


def test_status_page_in_headless_chromium(cluster: LocalCluster, tmp_path: Path):
    browser = _chromium()
    port = cluster.master.ready["metrics_port"]
    ids = [w.ready["worker_id"] for w in cluster.workers]
    with grpc.insecure_channel(cluster.master_address) as channel:
        stub = master_pb2_grpc.MasterServiceStub(channel)
        job_id = stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/d"), timeout=10).job_id
        assert wait_for(lambda: stub.GetJob(master_pb2.GetJobRequest(job_id=job_id), timeout=5).state
                        == master_pb2.SUCCEEDED, timeout=60)

    dom = _parse(_dump_dom(browser, f"http://127.0.0.1:{port}/status", tmp_path / "profile-1"))
    workers = {r["data-worker-id"]: r["data-health"] for r in dom.rows if "data-worker-id" in r}
    assert workers == {wid: "ok" for wid in ids}
    jobs = {r["data-job-id"]: r["data-state"] for r in dom.rows if "data-job-id" in r}
    assert jobs == {job_id: "SUCCEEDED"}
    text = " ".join(dom.text)
    assert "workers: 2 answering of 2 live" in text
    assert "6/6" in text  # the job's objects, all done
    assert "data" in text and "not answering" not in text
    assert not any(a.get("src") or a.get("href") for _, a in dom.tags)  # nothing loaded from elsewhere

    # A worker that stops answering (SIGSTOP: still in the view until its 30 s lease runs out). Read
    # with urllib, not the browser, so the page is surely taken within the lease.
    frozen = cluster.workers[1]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        time.sleep(1.1)  # past the page's last snapshot (pages are rebuilt at most once a second: server/httpd.py)
        started = time.monotonic()
        code, page, _ = _get(port, "/status")
        assert code == 200 and time.monotonic() - started < 5  # the short GetStatus deadline bounds the page
        dom = _parse(page)
        workers = {r["data-worker-id"]: r["data-health"] for r in dom.rows if "data-worker-id" in r}
        assert workers == {ids[0]: "ok", ids[1]: "bad"}
        assert "not answering (DEADLINE_EXCEEDED)" in " ".join(dom.text)
        assert "workers: 1 answering of 2 live" in " ".join(dom.text)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
