"""Stalled and idle connections to the bulk ports (data port, short-circuit socket): they cost a
descriptor, never a thread; connections beyond a peer's bound are closed at once; and the server
closes incomplete requests and idle connections on its deadlines. Reads stay correct throughout."""

from __future__ import annotations

import socket
import threading
import time

from cachefs.client.filesystem import CacheFileSystem
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.server.worker.bulkpath import SERVING_THREADS
from helpers import payload, wait_for

import grpc

PAGE = 64 << 10
EXTRA = 40  # stalled connections beyond the per-peer bound


def _settled(worker, path: str, size: int) -> None:
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: stub.GetCached(worker_pb2.GetCachedRequest(paths=[path]), timeout=10)
                        .cached_bytes[0] == size)


def _closed(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (it never sends anything on a stalled one)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _server_threads(name: str) -> int:
    return sum(t.name.startswith(f"{name}-") for t in threading.enumerate())


def _abuse(worker, fs, kind: str, server, connect, stall: bytes, path: str, data: bytes) -> None:
    server.idle_timeout = server.frame_timeout = 300.0  # nothing expires while we look
    assert fs.cat_file(path) == data  # the client now holds one pooled connection
    stats = fs.session.bulk_stats[kind]
    reads, fallbacks, threads = stats["reads"], stats["fallbacks"], threading.active_count()
    assert server.connections == 1
    stalled = [connect() for _ in range(server.max_per_peer + EXTRA)]
    for sock in stalled[::2]:  # half stall inside a request, half before one
        if stall:
            sock.sendall(stall)
    # Beyond the per-peer bound (the client's own connection counts): closed at once.
    over = len(stalled) - (server.max_per_peer - 1)
    assert wait_for(lambda: sum(_closed(s) for s in stalled) == over, timeout=30)
    assert server.connections == server.max_per_peer
    # (a) reads stay correct and lean
    for i in range(20):
        start = (i * 7919) % len(data)
        assert fs.cat_file(path, start, start + PAGE) == data[start:start + PAGE]
    assert stats["reads"] == reads + 20 and stats["fallbacks"] == fallbacks
    # (b) no thread per connection
    assert threading.active_count() <= threads + 1
    assert _server_threads(server.name) == SERVING_THREADS + 1
    # (c) short deadlines: the server closes every stalled connection, and its set empties
    began = time.monotonic()
    server.frame_timeout, server.idle_timeout = 0.5, 1.0
    assert wait_for(lambda: all(_closed(s) for s in stalled), timeout=30)
    closed_after = time.monotonic() - began
    assert wait_for(lambda: server.connections == 0, timeout=30)  # the client's idle one too
    print(f"\n{kind}: {len(stalled)} stalled, {server.max_per_peer - 1} held, {over} refused at once; "
          f"threads {threads} -> {threading.active_count()}; all closed in {closed_after:.2f} s")
    for sock in stalled:
        sock.close()
    assert closed_after < 10
    assert fs.cat_file(path) == data  # its pooled socket is gone: this read takes gRPC, correctly


def test_stalled_data_port_connections(local_store, make_worker):
    data = payload(4 * PAGE + 11, 1)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", worker.data_port), timeout=10)

    _abuse(worker, fs, "data_port", worker.data_port_server, connect, b"\x00\x00", "cachefs://data/obj", data)


def test_short_circuit_idle_connections(local_store, make_worker):
    data = payload(4 * PAGE + 11, 2)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))
    server = worker.short_circuit

    def connect() -> socket.socket:  # a SEQPACKET message arrives whole: a stalled client sends none
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(server.path)  # blocking: with a timeout a full backlog is EAGAIN, not a wait
        sock.settimeout(10)
        return sock

    _abuse(worker, fs, "short_circuit", server, connect, b"", "cachefs://data/obj", data)


def test_a_trickled_frame_is_cut_off(local_store, make_worker):
    """Bytes that keep coming do not extend a request's deadline."""
    worker = make_worker(local_store.mount, page_size=PAGE)
    server = worker.data_port_server
    server.frame_timeout = 0.5
    with socket.create_connection(("127.0.0.1", worker.data_port), timeout=10) as sock:
        sock.sendall((60000).to_bytes(4, "big"))  # a frame of 60000 bytes announced, one byte at a time
        began = time.monotonic()

        def trickle() -> bool:
            try:
                sock.send(b"x")
            except OSError:
                return True
            return _closed(sock)

        assert wait_for(trickle, timeout=30)
        assert time.monotonic() - began < 10
    assert wait_for(lambda: server.connections == 0, timeout=30)
