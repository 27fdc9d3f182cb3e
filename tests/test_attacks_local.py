"""Attacks from the same host (issue #48, "Secure by default"), each run as an attacker would.

The tests run as root; an attacker is a forked child that drops to uid 65534 (nobody), against
a real worker (or master) process:

* the shared tables a worker hands to its short-circuit clients (handle table, name index) are
  memfds: a client reopening one through ``/proc/self/fd`` read-write must not be able to write
  it (memfd seals), whatever its uid;
* a process of a uid the worker does not allow gets nothing from its socket (``SO_PEERCRED``);
* a squatted socket (a fake worker under another uid) gets no token: the client checks who
  serves the socket before it sends a byte;
* a pre-created directory or state file owned by another uid, or a symlink, is refused;
* the HTTP port (metrics, probes, the master's status page) stays answerable under 2,000 idle
  connections with bounded threads, and closes a slowloris connection within its read timeout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachefs.local import DaemonProcess, master_process, worker_process
from cachefs.localhost import MAX_MESSAGE, TABLE_WORD_HEARTBEAT, TABLE_WORD_STATE
from cachefs.proto import shortcircuit_pb2
from fusemounts import REASON as NO_FUSE
from fusemounts import mount_fuse  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks run as root and drop to uid 65534")

NOBODY = 65534
TOKEN = "attack-canary-token-48"


def _in_child(fn: Callable[[], object], uid: int | None = NOBODY, gid: int | None = None,
              timeout: float = 20.0) -> object:
    """Run ``fn`` in a forked child (as ``uid``/``gid`` when given); its JSON result, or the
    exception's errno/name as a dict."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            if gid is not None:
                os.setgroups([])
                os.setgid(gid)
            if uid is not None:
                os.setgroups([])
                os.setuid(uid)
            try:
                result = fn()
            except OSError as exc:
                result = {"error": type(exc).__name__, "errno": exc.errno, "message": str(exc)}
            os.write(w, json.dumps(result).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            import select
            left = deadline - time.monotonic()
            poller = select.poll()  # not select(): a long test process may hold fds past 1024
            poller.register(r, select.POLLIN)
            if left <= 0 or not poller.poll(left * 1000):
                os.kill(pid, 9)
                raise TimeoutError("the attacker's child did not finish")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's child failed"
    return json.loads(b"".join(chunks))


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A root-owned directory every user may traverse (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-attack-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _worker(tmp_path: Path, sock_dir: Path, **env: str) -> DaemonProcess:
    cache = tmp_path / "cache"
    environ = dict(os.environ, CACHEFS_WORKER_ACCESS_TOKEN=TOKEN,
                   CACHEFS_WORKER_SHORT_CIRCUIT_SOCKET=str(sock_dir / "worker.sock"), **env)
    return worker_process({}, str(cache), log_path=str(tmp_path / "worker.log"), env=environ).start()


def _hello(path: str) -> tuple[shortcircuit_pb2.ShortCircuitReply | None, list[int]]:
    """Ask the worker's socket for its shared tables, as a client does (None: nothing came back)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        try:
            sock.send(shortcircuit_pb2.ShortCircuitRequest(hello=True, token=TOKEN).SerializeToString())
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 8)
        except (ConnectionError, BrokenPipeError):
            return None, []
    if not message:
        return None, fds
    reply = shortcircuit_pb2.ShortCircuitReply()
    reply.ParseFromString(message)
    return reply, fds


def _hello_summary(path: str) -> dict[str, object]:
    """What a hello got: an answer at all, and how many descriptors (closed here)."""
    reply, fds = _hello(path)
    for fd in fds:
        os.close(fd)
    return {"reply": reply is not None, "fds": len(fds)}


# -- 1. the shared tables cannot be written by a client ---------------------------------------------
def _try_to_write(fd: int) -> dict[str, object]:
    """What an attacking client does with a handed-out table: reopen it read-write through
    /proc and write (write(2), then a shared writable mapping, then a truncation)."""
    outcome: dict[str, object] = {}
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    except OSError as exc:
        return {"open": exc.errno}
    outcome["open"] = 0
    try:
        os.pwrite(rw, (1).to_bytes(8, "little"), TABLE_WORD_STATE * 8)
        outcome["write"] = 0
    except OSError as exc:
        outcome["write"] = exc.errno
    try:
        m = mmap.mmap(rw, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[TABLE_WORD_STATE * 8:TABLE_WORD_STATE * 8 + 8] = (1).to_bytes(8, "little")
        m.close()
        outcome["mmap"] = 0
    except OSError as exc:
        outcome["mmap"] = exc.errno
    try:
        os.ftruncate(rw, 0)
        outcome["truncate"] = 0
    except OSError as exc:
        outcome["truncate"] = exc.errno
    os.close(rw)
    return outcome


def test_a_client_cannot_write_the_shared_tables(tmp_path: Path, open_dir: Path):
    worker = _worker(tmp_path, open_dir)
    try:
        reply, fds = _hello(str(open_dir / "worker.sock"))
        assert reply is not None and reply.table_slots > 0 and len(fds) == 2  # the handle table, the name index
        try:
            table = mmap.mmap(fds[0], 4096, mmap.MAP_SHARED, mmap.PROT_READ)

            def contents() -> bytes:  # all but the heartbeat word, which the worker moves every tick
                beat = TABLE_WORD_HEARTBEAT * 8
                return table[:beat] + table[beat + 8:]

            before = contents()
            for uid in (NOBODY, None):  # a client of another user, and one of the worker's own (root)
                outcome = _in_child(lambda: {str(i): _try_to_write(fd) for i, fd in enumerate(fds)}, uid=uid)
                for which, got in outcome.items():
                    assert got.get("open") != 0 or all(
                        got[op] in (errno.EPERM, errno.EACCES) for op in ("write", "mmap", "truncate")), \
                        f"uid {uid} changed table {which} through /proc: {got}"
            assert contents() == before  # nothing changed
        finally:
            for fd in fds:
                os.close(fd)
        # The worker's own writes still work: a second client is served (its table is live).
        reply, fds = _hello(str(open_dir / "worker.sock"))
        assert reply is not None and len(fds) == 2
        for fd in fds:
            os.close(fd)
    finally:
        worker.stop()


def test_sealed_tables_in_process():
    """The seals themselves: an fd of the table carries them, and the owner's mapping still writes."""
    import fcntl

    from cachefs.memseal import F_SEAL_FUTURE_WRITE
    from cachefs.server.worker.handles import HandleTable
    from cachefs.server.worker.names import NameIndex

    table, names = HandleTable(slots=64), NameIndex(slots=64)
    try:
        for fd in (table.reader_fd(), names.reader()[0]):
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                assert seals & F_SEAL_FUTURE_WRITE and seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
            finally:
                os.close(fd)
        slot, generation = table.assign("ab" * 16)
        assert slot > 0 and generation > 0
        assert table.invalidate(["ab" * 16]) == 1
    finally:
        table.close()
        names.close()


def test_without_the_future_write_seal_the_table_is_narrowed_and_the_log_says_so(monkeypatch, caplog):
    """An older kernel (before 5.1) refuses F_SEAL_FUTURE_WRITE: the size seals still go on, the
    memfd becomes 0444 (another uid cannot reopen it writable) and a warning says what is left."""
    import fcntl
    import logging
    import stat

    from cachefs import memseal

    real = fcntl.fcntl

    def old_kernel(fd, cmd, arg=0):
        if cmd == fcntl.F_ADD_SEALS and arg & memseal.F_SEAL_FUTURE_WRITE:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(memseal.fcntl, "fcntl", old_kernel)
    monkeypatch.setattr(memseal, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="cachefs.memseal"):
        fd, table, sealed = memseal.sealed_table("cachefs-test", 4096)
    try:
        assert not sealed and "F_SEAL_FUTURE_WRITE" in caplog.text
        seals = real(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o444
        table[0:8] = b"12345678"  # the creator's own mapping still writes

        def reopen() -> dict[str, object]:  # the forked child holds the memfd, as a client would
            os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
            return {"opened": True}

        assert _in_child(reopen, uid=NOBODY).get("errno") == errno.EACCES  # another uid: the mode
        assert _in_child(reopen, uid=None) == {"opened": True}  # root still could (the warning says so)
    finally:
        table.close()
        os.close(fd)


# -- 2. a disallowed uid gets nothing from the worker's socket ----------------------------------------
def test_a_disallowed_uid_gets_nothing(tmp_path: Path, open_dir: Path):
    worker = _worker(tmp_path, open_dir)
    path = str(open_dir / "worker.sock")
    try:
        # The socket is 0660 root:root; a process of uid 65534 in group 0 can connect to it.
        assert _in_child(lambda: _hello_summary(path), uid=NOBODY, gid=0) == {"reply": False, "fds": 0}
        assert _hello(path)[0] is not None  # the worker's own user still is served
    finally:
        worker.stop()
    assert "not allowed" in (tmp_path / "worker.log").read_text()


def test_allowed_uids_and_group_are_served(tmp_path: Path, open_dir: Path):
    worker = _worker(tmp_path, open_dir, CACHEFS_WORKER_ALLOWED_UIDS=f"{NOBODY}")
    path = str(open_dir / "worker.sock")
    try:
        # Allowed: served the handle table, but not the name index (it is for the worker's user).
        assert _in_child(lambda: _hello_summary(path), uid=NOBODY, gid=0) == {"reply": True, "fds": 1}
    finally:
        worker.stop()


def test_allowed_gid_reaches_the_socket_in_the_private_cache_dir(tmp_path: Path, open_dir: Path):
    """With allowed_gid, the group may search the cache dir (not list it) and connect; others may not."""
    cache = open_dir / "cache"
    environ = dict(os.environ, CACHEFS_WORKER_ACCESS_TOKEN=TOKEN, CACHEFS_WORKER_ALLOWED_GID="4242")
    worker = worker_process({}, str(cache), log_path=str(tmp_path / "worker.log"), env=environ).start()
    path = str(cache / "worker.sock")
    try:
        st = os.stat(cache)
        assert (st.st_gid, st.st_mode & 0o777) == (4242, 0o710)
        assert _in_child(lambda: _hello_summary(path), uid=NOBODY, gid=4242) == {"reply": True, "fds": 1}
        # Another group cannot even reach it.
        assert _in_child(lambda: _hello_summary(path), uid=NOBODY, gid=NOBODY)["errno"] == errno.EACCES
    finally:
        worker.stop()


# -- 3. a squatted socket gets no token ----------------------------------------------------------------
def test_the_client_refuses_a_squatted_socket(open_dir: Path):
    from cachefs.client.transport.shortcircuit import ShortCircuitReader

    squat = open_dir / "squat"
    squat.mkdir()
    os.chmod(squat, 0o1777)  # a shared temp directory: anyone may create a socket in it
    path = str(squat / "worker.sock")
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: uid 65534 serves a fake worker and keeps whatever comes
        try:
            os.close(r)
            os.close(ready_r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            srv.bind(path)
            os.chmod(path, 0o666)
            srv.listen(8)
            os.write(ready_w, b"x")
            while True:
                conn, _ = srv.accept()
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    while data := conn.recv(MAX_MESSAGE):
                        os.write(w, data)
                conn.close()
        finally:
            os._exit(0)
    os.close(w)
    os.close(ready_w)
    raised: BaseException | None = None
    try:
        assert os.read(ready_r, 1) == b"x"
        reader = ShortCircuitReader(path, token=TOKEN, timeout=2.0)
        try:
            reader.request([("m/key", 0, 100, "")])
        except Exception as exc:  # noqa: BLE001
            raised = exc
        time.sleep(0.2)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.set_blocking(r, False)
        got = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(r, 1 << 20):
                got += chunk
        os.close(r)
        os.close(ready_r)
    assert TOKEN.encode() not in got, "the client sent its token to a squatted socket"
    assert isinstance(raised, PermissionError) and f"uid {NOBODY}" in str(raised), raised


# -- 4. pre-created directories and state files ---------------------------------------------------------
def test_a_cache_dir_of_another_user_is_refused(tmp_path: Path, open_dir: Path):
    cache = open_dir / "cache"
    cache.mkdir(mode=0o777)
    os.chown(cache, NOBODY, NOBODY)  # pre-created by the attacker
    with pytest.raises(RuntimeError, match="exited"):
        worker_process({}, str(cache), log_path=str(tmp_path / "worker.log")).start(timeout=30)
    log = (tmp_path / "worker.log").read_text()
    assert f"owned by uid {NOBODY}" in log and str(cache) in log


def test_a_symlinked_cache_dir_is_refused(tmp_path: Path, open_dir: Path):
    from cachefs.config import CacheDirSpec, WorkerConfig
    from cachefs.server.worker.daemon import Worker

    # The attacker's symlink to a directory of ours (another worker's pages, say), and to one of theirs.
    ours = open_dir / "ours"
    ours.mkdir(mode=0o700)
    theirs = open_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    for target, match in ((ours, f"symlink owned by uid {NOBODY}"), (theirs, f"owned by uid {NOBODY}")):
        link = open_dir / f"cache-{target.name}"
        link.symlink_to(target)
        os.lchown(link, NOBODY, NOBODY)
        config = WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(str(link), 1 << 30),))
        with pytest.raises(PermissionError, match=match):
            Worker(config).start()
    assert not os.listdir(theirs)  # nothing of ours went into it


def test_a_master_db_of_another_user_is_refused(tmp_path: Path, open_dir: Path):
    from cachefs.server.master.state import MasterState

    # The attacker's state dir, with a master.db of theirs in it.
    theirs = open_dir / "state"
    theirs.mkdir()
    (theirs / "master.db").write_bytes(b"")
    for p in (theirs, theirs / "master.db"):
        os.chown(p, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        MasterState(theirs)
    # Our own dir, but a master.db of theirs in it (left from before, or created while it was open).
    ours = tmp_path / "state"
    ours.mkdir(mode=0o700)
    (ours / "master.db").write_bytes(b"")
    os.chown(ours / "master.db", NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        MasterState(ours)
    # A symlink in place of master.db.
    other = tmp_path / "state2"
    other.mkdir(mode=0o700)
    (other / "master.db").symlink_to(theirs / "master.db")
    with pytest.raises(PermissionError, match="symlink"):
        MasterState(other)
    # And as a real master process: it exits with the reason.
    with pytest.raises(RuntimeError, match="exited"):
        master_process(str(theirs), log_path=str(tmp_path / "master.log")).start(timeout=30)
    assert f"owned by uid {NOBODY}" in (tmp_path / "master.log").read_text()


def test_default_paths_are_private(monkeypatch: pytest.MonkeyPatch, open_dir: Path):
    from cachefs.config import MasterConfig, WorkerConfig
    from cachefs.runtimedir import runtime_dir

    tmp = tempfile.gettempdir()
    assert not WorkerConfig().cache_dirs[0].path.startswith(tmp)
    assert not MasterConfig().state_dir.startswith(tmp)
    xdg = open_dir / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime_dir() == str(xdg / "cachefs")
    assert os.stat(xdg / "cachefs").st_mode & 0o777 == 0o700
    shutil.rmtree(xdg / "cachefs")
    (xdg / "cachefs").symlink_to(open_dir)  # squatted: a symlink to somewhere else
    with pytest.raises(PermissionError, match="symlink"):
        runtime_dir()
    (xdg / "cachefs").unlink()
    (xdg / "cachefs").mkdir()
    os.chown(xdg / "cachefs", NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        runtime_dir()


# -- 5. the HTTP port under idle and slow connections ----------------------------------------------------
def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _get(port: int, path: str = "/healthz", timeout: float = 10.0) -> tuple[int, float]:
    import http.client

    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - start
    finally:
        conn.close()


def test_http_port_survives_idle_connections_and_drops_slowloris(tmp_path: Path):
    worker = worker_process({}, str(tmp_path / "cache"), log_path=str(tmp_path / "worker.log")).start()
    port = worker.ready["metrics_port"]
    idle: list[socket.socket] = []
    try:
        threads_before = _threads(worker.pid)
        for _ in range(2000):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            idle.append(s)
        time.sleep(1.0)
        code, took = _get(port, "/metrics")
        assert code == 200 and took < 2.0, f"a normal request took {took:.2f}s behind 2,000 idle connections"
        assert _threads(worker.pid) < threads_before + 100, "a thread per idle connection"
        for s in idle:
            s.close()
        idle.clear()

        # Slowloris: a request head that never ends, one byte at a time.
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        start, closed = time.monotonic(), False
        while time.monotonic() - start < 20:
            try:
                slow.sendall(b"X")
                slow.settimeout(0.5)
                if slow.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        took = time.monotonic() - start
        slow.close()
        assert closed and took < 12, f"a slowloris connection still open after {took:.1f}s"
        assert _get(port)[0] == 200
    finally:
        for s in idle:
            s.close()
        worker.stop()


def test_status_pages_are_snapshots():
    from prometheus_client import CollectorRegistry

    from cachefs.server.httpd import HttpEndpoints, HttpServer

    calls = []

    def page() -> tuple[str, bytes]:
        calls.append(time.monotonic())
        time.sleep(0.2)  # asks every worker
        return "text/plain", b"ok"

    server = HttpServer("127.0.0.1", 0, HttpEndpoints(CollectorRegistry(), pages={"/status": page})).start()
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(_get(server.port, "/status")[0])) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 40
        assert len(calls) <= 2, f"/status built {len(calls)} times for 40 requests at once"
    finally:
        server.stop()


# -- 6. the FUSE mount: allow_other with the kernel checking modes -------------------------------------------
def test_fuse_mount_with_allow_other_checks_modes(local_store, make_worker, mount_fuse, open_dir: Path):
    if NO_FUSE is not None:
        pytest.skip(f"no FUSE here: {NO_FUSE}")
    local_store.add("secret.bin", b"training data only for group 4242")
    worker = make_worker(local_store.mount)
    config = open_dir / "fuse.toml"
    config.write_text(f'[client]\nworkers = ["{worker.address}"]\ntimeout = 5\n'
                      "[fuse]\nallow_other = true\ngid = 4242\numask = 0o027\n")
    mountpoint = open_dir / "mnt"
    mountpoint.mkdir()
    m = mount_fuse("--config", str(config), mountpoint=mountpoint)
    target = m.mountpoint / "data" / "secret.bin"
    assert target.read_bytes() == b"training data only for group 4242"  # the owner (root)
    st = os.stat(target)
    assert (st.st_gid, st.st_mode & 0o777) == (4242, 0o440)

    def read() -> dict[str, object]:
        with open(target, "rb") as f:
            return {"read": f.read().decode()}

    assert _in_child(read, uid=NOBODY, gid=NOBODY)["errno"] == errno.EACCES  # allow_other alone let it read
    assert _in_child(read, uid=NOBODY, gid=4242) == {"read": "training data only for group 4242"}
