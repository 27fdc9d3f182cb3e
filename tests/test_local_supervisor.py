"""``cachefs local`` keeps its daemons running: the restart policy (fake clock), the Supervisor's
decisions (fake daemons), and the real command with a worker killed -9 under reads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cachefs.local import Backoff, RestartPolicy, Supervisor, port_is_free
from helpers import FakeClock, client, wait_for


# ------------------------------------------------------------------------- the policy
def test_backoff_doubles_up_to_its_cap_and_gives_up_only_on_a_crash_loop():
    clock = FakeClock()
    policy = RestartPolicy(initial=0.5, factor=2.0, cap=4.0, stable_after=30.0, give_up_after=6)
    b = Backoff(policy, clock)
    delays = []
    for _ in range(6):
        clock.advance(1.0)  # each run dies a second after its start: a crash loop
        delays.append(b.exited())
        b.started()
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    clock.advance(1.0)
    assert b.exited() is None  # the 7th quick exit in a row: give up


def test_backoff_starts_afresh_after_a_stable_run():
    clock = FakeClock()
    b = Backoff(RestartPolicy(initial=1.0, factor=3.0, cap=100.0, stable_after=30.0, give_up_after=3), clock)
    for expected in (1.0, 3.0, 9.0):
        clock.advance(29.9)
        assert b.exited() == expected
        b.started()
    clock.advance(30.0)  # this run lasted: it was not a crash loop
    assert b.exited() == 1.0
    b.started()
    clock.advance(0.1)
    assert b.exited() == 3.0


# ------------------------------------------------------ the supervisor, with fake daemons
class FakeProc:
    _next_pid = 50_000

    def __init__(self) -> None:
        FakeProc._next_pid += 1
        self.pid = FakeProc._next_pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeDaemon:
    def __init__(self, name: str, port: int) -> None:
        self.args = [name]
        self.proc = FakeProc()
        self.ready = {"address": f"127.0.0.1:{port}", "port": port}
        self.log_path = f"/tmp/{name}.log"
        self.stopped = False

    @property
    def address(self) -> str:
        return self.ready["address"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.returncode = -9

    def stop(self) -> None:
        self.stopped = True
        self.kill()


class FakeCluster:
    """LocalCluster's surface the Supervisor uses; records each start and can fail them."""

    def __init__(self, workers: int) -> None:
        self.master = FakeDaemon("master", 7000)
        self.workers = [FakeDaemon("worker", 7100 + i) for i in range(workers)]
        self.starts: list[tuple[str, int]] = []
        self.fail_starts = 0
        self.free_port = 9000

    def _start(self, name: str, port: int) -> FakeDaemon:
        self.starts.append((name, port))
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError(f"{name} exited with 1 before it was ready")
        if port == 0:
            port, self.free_port = self.free_port, self.free_port + 1
        return FakeDaemon(name, port)

    @property
    def master_address(self) -> str:
        return self.master.address

    def start_master(self, timeout: float = 60.0, port: int | None = None) -> FakeDaemon:
        return self._start("master", port or 0)

    def start_worker(self, i: int, timeout: float = 60.0, port: int = 0) -> FakeDaemon:
        return self._start(f"worker-{i}", port)


def _supervisor(cluster: FakeCluster, clock: FakeClock, **policy) -> tuple[Supervisor, list[str]]:
    lines: list[str] = []
    policy = {"initial": 1.0, "factor": 2.0, "cap": 8.0, "stable_after": 30.0, "give_up_after": 3, **policy}
    return Supervisor(cluster, RestartPolicy(**policy), clock=clock, log=lines.append), lines  # type: ignore[arg-type]


def test_a_dead_worker_is_restarted_on_its_port_after_its_back_off(monkeypatch):
    monkeypatch.setattr("cachefs.local.port_is_free", lambda host, port: True)
    clock, cluster = FakeClock(), FakeCluster(workers=3)
    sup, lines = _supervisor(cluster, clock)
    old = cluster.workers[1]
    old.proc.returncode = -9
    assert sup.check()
    assert "worker-1" in lines[-1] and "SIGKILL" in lines[-1] and "port 7101" in lines[-1]
    assert cluster.starts == []  # it waits its back-off first
    clock.advance(0.9)
    sup.check()
    assert cluster.starts == []
    clock.advance(0.2)
    sup.check()
    assert cluster.starts == [("worker-1", 7101)]
    assert cluster.workers[1] is not old and cluster.workers[1].address == "127.0.0.1:7101"
    assert "restarted" in lines[-1] and f"pid {cluster.workers[1].pid}" in lines[-1]
    status = sup.status()
    assert status["workers"][1]["restarts"] == 1 and status["workers"][1]["state"] == "running"
    assert status["workers"][1]["pid"] == cluster.workers[1].pid


def test_a_taken_port_means_a_new_one_and_the_log_says_so(monkeypatch):
    monkeypatch.setattr("cachefs.local.port_is_free", lambda host, port: port != 7100)
    clock, cluster = FakeClock(), FakeCluster(workers=2)
    sup, lines = _supervisor(cluster, clock)
    cluster.workers[0].proc.returncode = 1
    sup.check()
    clock.advance(5)
    sup.check()
    assert cluster.starts == [("worker-0", 0)]
    assert any("port 7100 is taken" in line for line in lines)
    assert "NEW port 127.0.0.1:9000" in lines[-1]


def test_a_master_on_a_new_port_takes_the_workers_along(monkeypatch):
    monkeypatch.setattr("cachefs.local.port_is_free", lambda host, port: port != 7000)
    clock, cluster = FakeClock(), FakeCluster(workers=2)
    sup, lines = _supervisor(cluster, clock)
    workers = list(cluster.workers)
    cluster.master.proc.returncode = -9
    sup.check()
    clock.advance(5)
    sup.check()
    assert cluster.starts == [("master", 0), ("worker-0", 7100), ("worker-1", 7101)]
    assert all(w.stopped for w in workers)
    assert any("CACHEFS_MASTER=127.0.0.1:9000" in line for line in lines)


def test_failed_restarts_back_off_then_a_crash_loop_is_given_up(monkeypatch):
    monkeypatch.setattr("cachefs.local.port_is_free", lambda host, port: True)
    clock, cluster = FakeClock(), FakeCluster(workers=2)
    sup, lines = _supervisor(cluster, clock, give_up_after=3)
    cluster.fail_starts = 100
    cluster.workers[0].proc.returncode = -9
    waits = []
    for _ in range(10):
        sup.check()
        m = sup.members[1]
        if m.given_up:
            break
        waits.append(m.restart_at - clock.now)
        clock.advance(m.restart_at - clock.now)
        sup.check()
    assert waits[:3] == [1.0, 2.0, 4.0]
    assert sup.members[1].given_up and len(cluster.starts) == 3
    assert "giving up" in lines[-1] and "worker-0" in lines[-1] and "other workers go on" in lines[-1]
    assert sup.check()  # a worker given up on leaves the rest running
    clock.advance(100)
    sup.check()
    assert len(cluster.starts) == 3  # and is not tried again
    cluster.master.proc.returncode = -9
    for _ in range(10):
        sup.check()
        clock.advance(10)
    assert not sup.check()  # the master given up on: the cluster stops
    assert sup.status()["master"]["state"] == "given up"


def test_no_restart_once_stop_is_set(monkeypatch):
    monkeypatch.setattr("cachefs.local.port_is_free", lambda host, port: True)
    clock, cluster = FakeClock(), FakeCluster(workers=1)
    sup, _ = _supervisor(cluster, clock)
    stop = threading.Event()
    cluster.workers[0].proc.returncode = -2  # a Ctrl-C reaches the whole process group
    sup.check(stop)
    stop.set()
    clock.advance(60)
    sup.check(stop)
    assert cluster.starts == []


def test_port_is_free_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)


# ------------------------------------------------------------------- the real command
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _Reads(threading.Thread):
    """Reads every object in a loop, checking bytes, until stopped; counts reads and errors."""

    def __init__(self, fs, objects: dict[str, bytes]) -> None:
        super().__init__(daemon=True)
        self.fs, self.objects = fs, objects
        self.halt = threading.Event()
        self.reads = 0
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.halt.is_set():
            for key, data in self.objects.items():
                try:
                    got = self.fs.cat_file(f"data/{key}")
                    if got != data:
                        self.errors.append(f"{key}: wrong bytes")
                    self.reads += 1
                except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                    self.errors.append(f"{key}: {exc!r}")

    def __enter__(self) -> "_Reads":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join(timeout=60)


@pytest.mark.slow
def test_cachefs_local_restarts_a_killed_worker_on_its_port(local_store, tmp_path):
    for i in range(12):
        local_store.add(f"o{i:02d}.bin", os.urandom(20_000 + i))
    workdir = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "3", "--dir", str(workdir),
                             "--mount", f"data={local_store.mount.url}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        master, printed = None, []
        deadline = time.monotonic() + 90
        while master is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"cachefs local exited: {proc.wait(timeout=10)}, {proc.stderr.read()}"
            printed.append(line)
            if "CACHEFS_MASTER=" in line:
                master = line.strip().split("=", 1)[1]
        assert master, "cachefs local did not print its master"
        status = json.loads((workdir / "local.json").read_text())
        assert status["master"]["address"] == master and len(status["workers"]) == 3
        first = status["workers"][1]
        assert any(f"pid {first['pid']} at {first['address']}" in line for line in printed), printed
        children = [status["master"]["pid"]] + [w["pid"] for w in status["workers"]]

        fs = client(master=master, timeout=5)
        for key, data in local_store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        with _Reads(fs, local_store.objects) as reads:
            assert wait_for(lambda: reads.reads > 20, timeout=30)
            os.kill(first["pid"], signal.SIGKILL)

            def restarted() -> dict | None:
                try:
                    w = json.loads((workdir / "local.json").read_text())["workers"][1]
                except (OSError, ValueError):
                    return None
                return w if w["restarts"] == 1 and w["state"] == "running" else None

            assert wait_for(restarted, timeout=60), "the killed worker was not restarted"
            again = restarted()
            assert again["address"] == first["address"], "a restarted worker must keep its port"
            assert again["pid"] != first["pid"] and _pid_alive(again["pid"])
            children.append(again["pid"])
            before = reads.reads
            assert wait_for(lambda: reads.reads > before + 20, timeout=30)
        assert not reads.errors, reads.errors[:3]
        assert reads.reads > 0

        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        assert "cachefs local: stopped" in out
        assert "worker-1" in err and "SIGKILL" in err and "restarted" in err, err
        assert wait_for(lambda: not any(_pid_alive(pid) for pid in children), timeout=30), \
            [pid for pid in children if _pid_alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid in children:
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
