"""Both raw ports of a worker (the short-circuit Unix socket, the TCP data port) under abuse: stalled
and silent connections cost no thread and are closed within their timeouts, connections are
bounded per peer and in all, and the clients reconnect when the worker closed an idle one."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import pytest

from cachefs.client.transport.dataport import DataPortReader
from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.errors import OverloadedError
from cachefs.proto import dataport_pb2, worker_pb2, worker_pb2_grpc
from cachefs.server.connections import BUSY_RETRY_AFTER, THREAD_KEEPALIVE
from helpers import payload, wait_for

PAGE = 64 << 10
FRAME = struct.Struct(">I")
Reply = dataport_pb2.DataReply


def _settled(worker, path: str, size: int) -> None:
    """Pages are written behind the read that fetched them: wait until all are on disk."""
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: stub.GetCached(worker_pb2.GetCachedRequest(paths=[path]), timeout=10)
                        .cached_bytes[0] == size)


def _cached_objects(store, worker, count: int, size: int) -> dict[str, bytes]:
    objects = {f"data/o{i}": payload(size, 100 + i) for i in range(count)}
    for path, data in objects.items():
        store.add(path.split("/", 1)[1], data)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False, data_port=False)
    for path, data in objects.items():
        assert fs.cat_file(f"cachefs://{path}") == data  # through gRPC: fills the cache
        _settled(worker, path, len(data))
    return objects


def _readers(worker) -> dict[str, CacheFileSystem]:
    """A client per raw path: short-circuit with no held handles (every read is a request on the
    socket), and the data port (short-circuit off, as for a client on another host)."""
    return {"short_circuit": CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit_handles=0),
            "data_port": CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False)}


def _serving_threads() -> dict[str, int]:
    """This process's raw-port serving threads, by server (the worker runs in this process)."""
    names = [t.name for t in threading.enumerate()]
    return {server: sum(1 for n in names if n == f"{server}-serve") for server in ("dataport", "shortcircuit")}


def _enough_descriptors(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


def _request(path: str, offset: int = 0, length: int = -1) -> bytes:
    body = dataport_pb2.DataRequest(path=path, offset=offset, length=length).SerializeToString()
    return FRAME.pack(len(body)) + body


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


def _ask(sock: socket.socket, frame: bytes) -> Reply:
    """One whole request and its whole reply (payload included) on a data port connection."""
    sock.sendall(frame)
    (size,) = FRAME.unpack(_recv(sock, 4))
    reply = Reply.FromString(_recv(sock, size))
    _recv(sock, sum(seg.length for seg in reply.segments))
    return reply


def _assert_busy_then_closed(sock: socket.socket, timeout: float = 10) -> None:
    """The server said BUSY (a REFUSED reply with a retry-after) and closed the connection."""
    sock.settimeout(timeout)
    got = b""
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        got += chunk
    (size,) = struct.unpack(">I", got[:4])
    reply = Reply.FromString(got[4:4 + size])
    assert reply.code == Reply.REFUSED and reply.message.startswith("BUSY")
    assert reply.retry_after_ms == int(BUSY_RETRY_AFTER * 1000)


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True if the other end closes (or resets) the connection within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_stalled_connections_hold_no_thread_and_are_closed_in_time(local_store, make_worker):
    stalled = 300  # on each port; the measured attack: 300 connections held 276 worker threads
    _enough_descriptors(8 * stalled + 1024)
    worker = make_worker(local_store.mount, page_size=PAGE)
    dp, sc = worker.data_port_server, worker.short_circuit
    frame_timeout, idle_timeout = 3.0, 4.0
    for server in (dp, sc):
        server.max_connections = server.max_per_peer = 2 * stalled  # all of them come from this process
        server.frame_timeout, server.idle_timeout = frame_timeout, idle_timeout
        server.threads, server.thread_keepalive = 8, 1.0
    objects = _cached_objects(local_store, worker, 6, 4 * PAGE)
    readers = _readers(worker)
    for kind, fs in readers.items():  # warm: both clients read through their raw path
        for path, data in objects.items():
            assert fs.cat_file(f"cachefs://{path}") == data
        assert fs.session.bulk_stats[kind]["reads"] == len(objects), kind
    baseline_threads = threading.active_count()
    baseline_others = baseline_threads - sum(_serving_threads().values())

    # Reads go on, on both paths, from before the stall until after it.
    done = threading.Event()
    reads: list[tuple[float, str]] = []
    failures: list[str] = []

    def reader(kind: str) -> None:
        fs, paths = readers[kind], sorted(objects)
        i = 0
        while not done.is_set():
            path = paths[i % len(paths)]
            i += 1
            try:
                if fs.cat_file(f"cachefs://{path}") != objects[path]:
                    failures.append(f"{kind}: wrong bytes of {path}")
            except Exception as exc:  # noqa: BLE001 - recorded, and the test fails on it
                failures.append(f"{kind}: {exc!r}")
            reads.append((time.monotonic(), kind))

    threads = [threading.Thread(target=reader, args=(kind,), daemon=True) for kind in readers]
    for t in threads:
        t.start()

    sel = selectors.DefaultSelector()
    opened: dict[socket.socket, tuple[str, float]] = {}  # how it stalls, and since when
    try:
        # Data port: two bytes of a frame, and stop; a third of them first have a request served.
        for i in range(stalled):
            sock = socket.create_connection(("127.0.0.1", worker.data_port), timeout=30)
            if i % 3 == 0:
                assert _ask(sock, _request("data/o0", 0, 100)).code == Reply.OK
            sock.sendall(FRAME.pack(200)[:2])
            opened[sock] = ("half-frame", time.monotonic())
        # Short-circuit socket: connect, and say nothing.
        for _ in range(stalled):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(sc.path)  # blocking: waits while the listen backlog is full
            opened[sock] = ("silent", time.monotonic())
        # One more on the data port that drips a byte at a time and never finishes its frame.
        drip = socket.create_connection(("127.0.0.1", worker.data_port), timeout=30)
        drip_frame = _request("data/o1")
        drip.send(drip_frame[:1])
        opened[drip] = ("drip", time.monotonic())
        for sock in opened:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        all_open = time.monotonic()
        assert wait_for(lambda: dp.stats()["connections"] >= stalled + 1 and sc.stats()["connections"] >= stalled)
        peak_threads, peak_serving = threading.active_count(), _serving_threads()
        stats_during = dp.stats(), sc.stats()

        closed: dict[socket.socket, float] = {}
        next_drip, dripped = time.monotonic() + 0.2, 1
        deadline = time.monotonic() + max(frame_timeout, idle_timeout) + 60
        while len(closed) < len(opened) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.1):
                sock = key.fileobj
                try:
                    data = sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except (ConnectionResetError, BrokenPipeError):
                    data = b""
                assert data == b"", f"a stalled {opened[sock][0]} connection got a reply"
                closed[sock] = time.monotonic()
                sel.unregister(sock)
            if drip not in closed and time.monotonic() >= next_drip and dripped < len(drip_frame):
                try:
                    drip.send(drip_frame[dripped:dripped + 1])
                    dripped += 1
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    pass
                next_drip = time.monotonic() + 0.2
            peak_threads = max(peak_threads, threading.active_count())
            serving = _serving_threads()
            peak_serving = {k: max(v, serving[k]) for k, v in peak_serving.items()}
        assert len(closed) == len(opened), f"{len(opened) - len(closed)} stalled connections still open"
        done.set()
        for t in threads:
            t.join(timeout=30)
    finally:
        done.set()
        sel.close()
        for sock in opened:
            sock.close()

    # Threads: bounded by the serving pools, not by the 600 connections. (The whole process: this
    # test's two reader threads, and a few the worker's gRPC server may add for their reads.)
    assert stats_during[0]["connections"] >= stalled + 1 and stats_during[1]["connections"] >= stalled
    assert peak_serving["dataport"] <= dp.threads and peak_serving["shortcircuit"] <= sc.threads, peak_serving
    assert peak_threads <= baseline_threads + 2 + dp.threads + sc.threads + 8, (baseline_threads, peak_threads)

    # Closed by the worker in time: not before their timeout, and within it plus the slack a busy
    # machine needs (the worker's own clock starts at or after ours).
    slack = 15.0
    for sock, (how, since) in opened.items():
        took = closed[sock] - since
        limit = idle_timeout if how == "silent" else frame_timeout
        assert limit - 0.05 <= took <= limit + slack, (how, took)
    assert dripped >= 3  # it kept sending while it waited
    took = {how: sorted(closed[s] - since for s, (h, since) in opened.items() if h == how)
            for how in ("half-frame", "drip", "silent")}
    print(f"threads: baseline {baseline_threads}, peak {peak_threads} (serving {peak_serving}) with "
          f"{stats_during[0]['connections']} + {stats_during[1]['connections']} connections; closed after "
          + ", ".join(f"{how} {t[0]:.2f}-{t[-1]:.2f} s" for how, t in took.items()))
    assert dp.counts["closed_frame"] >= stalled + 1 and sc.counts["closed_idle"] >= stalled
    sample = worker.metrics.registry.get_sample_value  # and operators see them
    assert sample("cachefs_worker_raw_connections_closed_total", {"server": "data_port", "why": "frame"}) \
        == dp.counts["closed_frame"]
    assert sample("cachefs_worker_raw_connections_closed_total", {"server": "short_circuit", "why": "idle"}) \
        == sc.counts["closed_idle"]

    # Reads were unaffected: none failed, every one went through its raw path, and both paths
    # kept reading while all the stalled connections were open.
    assert not failures, failures[:5]
    for kind, fs in readers.items():
        stats = fs.session.bulk_stats[kind]
        assert stats["errors"] == 0 and stats["fallbacks"] == 0, (kind, stats)
        assert sum(1 for t, k in reads if k == kind and all_open <= t <= min(closed.values())) >= 5, kind

    # And everything is given back: connections, peers, threads.
    for fs in readers.values():
        fs.session.close()
    assert wait_for(lambda: dp.stats()["connections"] == 0 and sc.stats()["connections"] == 0, timeout=30), \
        (dp.stats(), sc.stats())
    assert dp.stats()["peers"] == 0 and sc.stats()["peers"] == 0
    assert wait_for(lambda: dp.stats()["threads"] == 0 and sc.stats()["threads"] == 0, timeout=30)
    assert wait_for(lambda: sum(_serving_threads().values()) == 0, timeout=30)
    assert threading.active_count() <= baseline_others + 8, (threading.active_count(), baseline_others)


def test_data_port_bounds_connections_per_ip_and_in_all(local_store, make_worker):
    worker = make_worker(local_store.mount, page_size=PAGE)
    dp = worker.data_port_server
    dp.max_per_peer, dp.max_connections = 3, 5
    objects = _cached_objects(local_store, worker, 1, 2 * PAGE)
    frame = _request("data/o0")

    def connect(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", worker.data_port), timeout=10, source_address=(source, 0))
        return sock

    held = []
    try:
        for _ in range(3):  # 127.0.0.1's three: each served
            held.append(connect("127.0.0.1"))
            assert _ask(held[-1], frame).code == Reply.OK
        extra = connect("127.0.0.1")  # its fourth: told BUSY, with a retry-after, and closed
        _assert_busy_then_closed(extra)
        extra.close()
        # A client there raises OverloadedError with the retry-after (it backs off; not a failure).
        with pytest.raises(OverloadedError) as busy:
            DataPortReader("127.0.0.1", worker.data_port, timeout=10).read("data/o0", 0, 10, "")
        assert busy.value.retry_after == BUSY_RETRY_AFTER
        for _ in range(2):  # another peer is not bound by 127.0.0.1's limit, but by the total
            held.append(connect("127.0.0.2"))
            assert _ask(held[-1], frame).code == Reply.OK
        extra = connect("127.0.0.3")  # a sixth in all
        _assert_busy_then_closed(extra)
        extra.close()
        assert dp.stats()["refused"] == 3 and dp.stats()["connections"] == 5 and dp.stats()["peers"] == 2

        # A client refused there still reads, through gRPC.
        fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False)
        assert fs.cat_file("cachefs://data/o0") == objects["data/o0"]
        assert fs.session.bulk_stats["data_port"]["reads"] == 0
    finally:
        for sock in held:
            sock.close()
    assert wait_for(lambda: dp.stats()["connections"] == 0)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False)
    assert fs.cat_file("cachefs://data/o0") == objects["data/o0"]  # room again
    assert fs.session.bulk_stats["data_port"]["reads"] == 1


_CHILD = """
import json, socket, sys
path, count = sys.argv[1], int(sys.argv[2])
socks, served = [], []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    socks.append(s)
    try:
        s.send(b"\\xff\\x00garbage")  # a malformed request: any answer at all means it was served
        served.append(bool(s.recv(1 << 16)))
    except OSError:
        served.append(False)
print(json.dumps(served), flush=True)
sys.stdin.read()  # holds its connections until the test closes its stdin
"""


def test_short_circuit_socket_bounds_connections_per_process(local_store, make_worker):
    worker = make_worker(local_store.mount, page_size=PAGE)
    sc = worker.short_circuit
    sc.max_per_peer = 3
    objects = _cached_objects(local_store, worker, 1, 2 * PAGE)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, sc.path, "4"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(child.stdout.readline()) == [True, True, True, False]  # its fourth: refused
        assert sc.stats()["refused"] == 1 and sc.stats()["connections"] == 3
        # Another process (this one) is not bound by the child's limit.
        fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit_handles=0)
        assert fs.cat_file("cachefs://data/o0") == objects["data/o0"]
        assert fs.session.bulk_stats["short_circuit"]["reads"] == 1
        assert sc.stats()["peers"] == 2
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()
    assert wait_for(lambda: sc.stats()["peers"] == 1)  # the child's connections went with it


def test_clients_reconnect_when_the_worker_closed_an_idle_connection(local_store, make_worker):
    worker = make_worker(local_store.mount, page_size=PAGE)
    objects = _cached_objects(local_store, worker, 1, 3 * PAGE)
    servers = {"short_circuit": worker.short_circuit, "data_port": worker.data_port_server}
    for kind, fs in _readers(worker).items():
        server = servers[kind]
        assert fs.cat_file("cachefs://data/o0") == objects["data/o0"]
        assert fs.session.bulk_stats[kind]["reads"] == 1
        idle_closed = server.counts["closed_idle"]
        server.idle_timeout = 0.3
        assert wait_for(lambda: server.stats()["connections"] == 0)  # its pooled connection: closed idle
        assert server.counts["closed_idle"] > idle_closed
        server.idle_timeout = 60.0
        assert fs.cat_file("cachefs://data/o0", 5, 2 * PAGE) == objects["data/o0"][5:2 * PAGE]
        stats = fs.session.bulk_stats[kind]
        assert stats["reads"] == 2 and stats["errors"] == 0 and stats["fallbacks"] == 0, (kind, stats)
        fs.session.close()


def test_a_waiting_request_takes_the_thread_of_a_connection_that_waits(local_store, make_worker):
    """Serving threads keep their connection for its next request (``linger``), but give it up at
    once when another connection's request waits and every thread has one."""
    worker = make_worker(local_store.mount, page_size=PAGE)
    dp = worker.data_port_server
    dp.threads, dp.linger = 2, 120.0
    objects = _cached_objects(local_store, worker, 1, 2 * PAGE)
    frame = _request("data/o0")
    socks = [socket.create_connection(("127.0.0.1", worker.data_port), timeout=30) for _ in range(4)]
    try:
        for sock in socks[:2]:  # each keeps one of the two threads, waiting for its next request
            assert _ask(sock, frame).code == Reply.OK
        assert wait_for(lambda: dp.stats()["serving"] == 2 and dp.stats()["threads"] == 2)
        for sock in socks[2:]:  # answered long before those threads' linger ends
            start = time.monotonic()
            assert _ask(sock, frame).code == Reply.OK
            assert time.monotonic() - start < 20
        for sock in socks:  # and the first two are still served, from the selector
            reply = _ask(sock, _request("data/o0", 7, 100))
            assert reply.code == Reply.OK and reply.info.size == len(objects["data/o0"])
        assert dp.stats()["threads"] <= 2
    finally:
        for sock in socks:
            sock.close()


# A client process sending garbage on ``count`` connections: random bytes, oversized messages, a
# frame header promising more than comes, a length of ~4 GiB, empty messages, bursts of junk;
# then it closes each for writing. Prints, per kind, how many were neither answered nor closed
# by the worker within ``seconds``.
_GARBAGE = r"""
import json, os, random, select, socket, struct, sys, time
target, unix, count, seconds, seed = sys.argv[1], sys.argv[2] == "unix", int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
rng = random.Random(seed)
def frames(kind):
    if kind == "random": return [os.urandom(rng.randrange(1, 300))]
    if kind == "oversized": return [os.urandom(100_000 if unix else 70_000)]
    if kind == "truncated":
        body = os.urandom(rng.randrange(10, 200))
        return [body[: len(body) // 2]] if unix else [struct.pack(">I", len(body) + 50) + body]
    if kind == "huge-length": return [struct.pack(">I", 0xFFFFFFF0) + b"x" * 10]
    if kind == "empty": return [b""]
    return [os.urandom(rng.randrange(1, 64)) for _ in range(20)]
kinds = ["random", "oversized", "truncated", "huge-length", "empty", "burst"]
open_socks, refused = {}, 0
for i in range(count):
    kind = kinds[i % len(kinds)]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) if unix else socket.socket()
    s.settimeout(5)
    try:
        s.connect(target if unix else (target.rsplit(":", 1)[0], int(target.rsplit(":", 1)[1])))
        for f in frames(kind):
            (s.send if unix else s.sendall)(f)
        s.shutdown(socket.SHUT_WR)
    except OSError:  # refused, reset or closed at once over a limit: an answer too
        refused += 1
        s.close()
        continue
    s.setblocking(False)
    open_socks[s.fileno()] = (s, kind)
poller = select.poll()
for fd in open_socks:
    poller.register(fd, select.POLLIN)
end = time.monotonic() + seconds
while open_socks and time.monotonic() < end:
    for fd, _ev in poller.poll(100):
        s, kind = open_socks[fd]
        try:
            s.recv(1 << 17)  # an answer, or b"" (closed)
        except BlockingIOError:
            continue
        except OSError:
            pass  # reset: closed too
        poller.unregister(fd)
        del open_socks[fd]
stuck = {}
for s, kind in open_socks.values():
    stuck[kind] = stuck.get(kind, 0) + 1
print(json.dumps({"stuck": stuck, "refused": refused}), flush=True)
"""


def _descriptors(pid: int) -> Counter[str]:
    """A process's descriptors by kind: socket, pipe, anon_inode:[eventfd], a path..."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            kinds[os.readlink(f"/proc/{pid}/fd/{fd}").split(":[")[0]] += 1
    return kinds


def _raw_targets(worker) -> dict[str, str]:
    with grpc.insecure_channel(worker.address) as ch:
        status = worker_pb2_grpc.WorkerServiceStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    return {"unix": status.short_circuit_socket, "tcp": f"127.0.0.1:{status.data_port}"}


def test_600_connections_of_garbage_are_each_answered_or_closed(tmp_path):
    """Bad frames get an error or a close within seconds, whatever their number; the worker's
    threads and descriptors come back to where they were, and a real read works after."""
    from cachefs.local import worker_process

    store = tmp_path / "store"
    store.mkdir()
    (store / "o").write_bytes(payload(3 * PAGE, 7))
    with worker_process({"data": str(store)}, str(tmp_path / "cache"), extra=["--page-size", str(PAGE)],
                        log_path=str(tmp_path / "w.log")) as worker:
        targets = _raw_targets(worker)
        baseline = _descriptors(worker.pid)
        for kind, target in targets.items():
            # 10 processes of 60: under the socket's per-process limit (64); the data port's limits follow the
            # descriptor limit (server/connections.py connection_limit): over them, a BUSY reply.
            procs = [subprocess.Popen([sys.executable, "-c", _GARBAGE, target, kind, "60", "10", str(i)],
                                      stdout=subprocess.PIPE, text=True) for i in range(10)]
            results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
            assert all(not r["stuck"] for r in results), (kind, results)
        # Connections closed; the serving threads (an eventfd each) end after their keepalive.
        assert wait_for(lambda: _descriptors(worker.pid)["socket"] <= baseline["socket"], timeout=15), \
            _descriptors(worker.pid)
        assert wait_for(lambda: _descriptors(worker.pid) <= baseline, timeout=THREAD_KEEPALIVE + 15), \
            (baseline, _descriptors(worker.pid))
        fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True)
        assert fs.cat_file("cachefs://data/o") == payload(3 * PAGE, 7)
        fs.close()


def test_data_port_counts_connections_per_client_its_hello_names(local_store, make_worker):
    """Each connection's hello names its process (client id): one process past MAX_PER_CLIENT is
    told BUSY, while another process behind the same IP is still admitted, and a closed
    connection gives its client's slot back. The client's own reader says hello with its id."""
    from cachefs.proto import common_pb2
    from cachefs.server.connections import MAX_PER_CLIENT

    local_store.add("obj", b"x" * 1000)
    worker = make_worker(local_store.mount, page_size=PAGE)
    port = worker.data_port

    def hello(sock: socket.socket, client: str) -> Reply:
        body = dataport_pb2.DataRequest(meta=common_pb2.MetaRequest(
            op=common_pb2.MetaRequest.HELLO, client_id=client, client_role="client")).SerializeToString()
        sock.sendall(FRAME.pack(len(body)) + body)
        head = b""
        while len(head) < 4:
            head += sock.recv(4 - len(head))
        (size,) = FRAME.unpack(head)
        data = b""
        while len(data) < size:
            data += sock.recv(size - len(data))
        return Reply.FromString(data)

    socks = []
    try:
        for _ in range(MAX_PER_CLIENT):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(sock)
            assert hello(sock, "host-a:1").meta.role == "worker"
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        refused = hello(extra, "host-a:1")
        assert refused.code == Reply.REFUSED and refused.retry_after_ms > 0 and "this client" in refused.message
        assert extra.recv(1) == b""  # and closed
        extra.close()
        other = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert hello(other, "host-a:2").meta.role == "worker"  # the same IP, another process
        other.close()
        socks.pop().close()
        assert wait_for(lambda: worker.data_port_server.stats()["connections"] <= MAX_PER_CLIENT, timeout=10)
        again = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert hello(again, "host-a:1").code == Reply.OK
        again.close()
        assert worker.data_port_server.counts["refused_client"] == 1
    finally:
        for sock in socks:
            sock.close()
    reader = DataPortReader("127.0.0.1", port, timeout=10)
    assert reader.hello().role == "worker" and reader.hello().protocol >= 2
    assert wait_for(lambda: worker.data_port_server.stats()["clients"] == 1, timeout=10)
    reader.close()
