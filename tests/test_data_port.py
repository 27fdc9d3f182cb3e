"""The data port: cached pages sent with sendfile over TCP to clients on other hosts (here: clients
with short-circuit off); anything it cannot serve goes through gRPC and never fails a read."""

from __future__ import annotations

import random
import socket
import struct
import threading

import grpc
import numpy as np
import pytest

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.config import WorkerConfig
from cachefs.proto import dataport_pb2, worker_pb2, worker_pb2_grpc
from helpers import flip_page_bytes, payload, wait_for

PAGE = 64 << 10
Reply = dataport_pb2.DataReply
FRAME = struct.Struct(">I")


def _fs(worker, **kw) -> CacheFileSystem:
    return CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False, **kw)


def _stub_call(worker, method: str, request, token: str = ""):
    metadata = [("x-cachefs-token", token)] if token else None
    with grpc.insecure_channel(worker.address) as ch:
        return getattr(worker_pb2_grpc.WorkerServiceStub(ch), method)(request, timeout=10, metadata=metadata)


def _settled(worker, path: str, size: int, token: str = "") -> None:
    """Pages are written behind the read that fetched them: wait until all are on disk."""
    assert wait_for(lambda: _stub_call(worker, "GetCached", worker_pb2.GetCachedRequest(paths=[path]), token)
                    .cached_bytes[0] == size)


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


def _ask(port: int, body: bytes, sock: socket.socket | None = None) -> tuple[Reply, bytes]:
    """One raw request on the wire; returns the reply and the payload bytes after it."""
    own = sock is None
    sock = sock or socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(FRAME.pack(len(body)) + body)
        (size,) = FRAME.unpack(_recv(sock, 4))
        reply = Reply.FromString(_recv(sock, size))
        data = _recv(sock, sum(seg.length for seg in reply.segments))
        return reply, data
    finally:
        if own:
            sock.close()


def test_worker_reports_its_data_port(local_store, make_worker):
    worker = make_worker(local_store.mount, page_size=PAGE)
    status = _stub_call(worker, "GetStatus", worker_pb2.GetStatusRequest())
    assert status.data_port == worker.data_port > 0
    off = make_worker(local_store.mount, page_size=PAGE, data_port=-1)
    assert _stub_call(off, "GetStatus", worker_pb2.GetStatusRequest()).data_port == 0 and off.data_port is None
    with pytest.raises(ValueError, match="data_port"):
        WorkerConfig(data_port=70000)


def test_cached_ranges_come_through_the_data_port(store, make_worker):
    data = payload(5 * PAGE + 777, 1)
    store.add("obj", data)
    worker = make_worker(store.mount, page_size=PAGE)
    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/obj") == data  # cold: NOT_CACHED, then gRPC fills the cache
    _settled(worker, "data/obj", len(data))
    stats = fs.session.bulk_stats["data_port"]
    reads, sent_before = stats["reads"], worker.metrics.data_port_bytes._value.get()
    ranges = [(0, None), (1, 2), (PAGE - 3, PAGE + 5), (PAGE, 3 * PAGE), (2 * PAGE + 9, None),
              (5 * PAGE, 5 * PAGE + 777), (0, 5 * PAGE + 777), (PAGE // 4, PAGE), (10, 3 * PAGE - 10)]
    rng = random.Random(3)
    for _ in range(40):
        a = rng.randrange(len(data))
        ranges.append((a, a + rng.randrange(1, 3 * PAGE)))
    for start, end in ranges:
        assert fs.cat_file("cachefs://data/obj", start, end) == data[start:end], (start, end)
    assert stats["reads"] == reads + len(ranges) and stats["fallbacks"] <= 1
    assert worker.metrics.data_port_bytes._value.get() > sent_before
    assert fs.session.bulk_stats["short_circuit"]["reads"] == 0


def test_read_into_across_stripes(local_store, make_worker):
    data = payload(9 * PAGE + 123, 2)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker, stripe_size=2 * PAGE)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))
    buf = np.zeros(len(data) + 4096, dtype=np.uint8)
    assert fs.read_into("cachefs://data/obj", buf) == (len(data), len(data))
    assert buf[:len(data)].tobytes() == data
    part = np.zeros(3 * PAGE, dtype=np.uint8)
    assert fs.read_into("cachefs://data/obj", part, offset=PAGE + 5) == (3 * PAGE, len(data))
    assert part.tobytes() == data[PAGE + 5:4 * PAGE + 5]
    assert fs.session.bulk_stats["data_port"]["reads"] >= 5 + 3  # one per stripe


def test_concurrent_readers_share_the_port(local_store, make_worker):
    objects = {f"o{i}": payload(PAGE * (1 + i % 3) + i, 10 + i) for i in range(12)}
    for key, data in objects.items():
        local_store.add(key, data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker)
    for key, data in objects.items():
        fs.cat_file(f"cachefs://data/{key}")
        _settled(worker, f"data/{key}", len(data))
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            key = rng.choice(sorted(objects))
            if fs.cat_file(f"cachefs://data/{key}") != objects[key]:
                errors.append(key)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert fs.session.bulk_stats["data_port"]["reads"] >= 8 * 30


def test_a_corrupt_page_is_never_served(local_store, make_worker, tmp_path):
    data = payload(3 * PAGE, 4)
    local_store.add("obj", data)
    cache = tmp_path / "dp-cache"
    worker = make_worker(local_store.mount, page_size=PAGE, cache_dir=cache)
    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/obj") == data
    _settled(worker, "data/obj", len(data))
    # Both reads through the port: the cold one filled by the worker in the same request.
    assert fs.cat_file("cachefs://data/obj") == data and fs.session.bulk_stats["data_port"]["reads"] == 2
    assert flip_page_bytes(cache) >= 1  # a byte flipped in every page's payload
    # Whole pages: the client's checksum fails (gRPC reads it, finds the page bad, drops and
    # refetches it); a small part: the worker's does, drops the page and fills it again.
    assert fs.cat_file("cachefs://data/obj") == data
    assert fs.cat_file("cachefs://data/obj", 2 * PAGE + 50, 2 * PAGE + 200) == data[2 * PAGE + 50:2 * PAGE + 200]
    assert worker.pages.stats().corrupt_pages >= 1
    # A part of a page found bad on the worker: dropped and filled again within the request,
    # served through the port (a process without gRPC has no other way).
    assert flip_page_bytes(cache) >= 1
    before = dict(fs.session.bulk_stats["data_port"])
    assert fs.cat_file("cachefs://data/obj", PAGE + 50, PAGE + 200) == data[PAGE + 50:PAGE + 200]
    after = fs.session.bulk_stats["data_port"]
    assert after["reads"] == before["reads"] + 1 and after["fallbacks"] == before["fallbacks"], (before, after)


def test_the_port_refuses_bad_requests_and_wrong_tokens(local_store, make_worker):
    data = payload(2 * PAGE, 5)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE, access_token="s3cret")
    ok = _fs(worker, token="s3cret")
    assert ok.cat_file("cachefs://data/obj") == data
    _settled(worker, "data/obj", len(data), token="s3cret")
    assert ok.cat_file("cachefs://data/obj") == data and ok.session.bulk_stats["data_port"]["reads"] == 2
    port = worker.data_port
    req = dataport_pb2.DataRequest
    reply, got = _ask(port, req(path="data/obj", length=-1, token="wrong").SerializeToString())
    assert reply.code == Reply.REFUSED and "UNAUTHENTICATED" in reply.message and got == b""
    for bad in [dict(path="data/../etc/passwd"), dict(path="data/a\x00b"), dict(path="data/obj", offset=-1),
                dict(path="data/obj", length=-2)]:
        reply, got = _ask(port, req(**{"token": "s3cret", "length": -1, **bad}).SerializeToString())
        assert reply.code == Reply.REFUSED and got == b"", bad
    for unknown in ["nomount/x", "data/missing"]:  # not known here: for gRPC to answer
        reply, got = _ask(port, req(token="s3cret", length=-1, path=unknown).SerializeToString())
        assert reply.code == Reply.NOT_CACHED and got == b"", unknown
    reply, got = _ask(port, req(token="s3cret", length=-1, path="data/obj", version="not-it").SerializeToString())
    assert reply.code == Reply.NOT_CACHED
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # one connection, many requests
        reply, got = _ask(port, b"\xff\x00garbage", sock)
        assert reply.code == Reply.REFUSED
        reply, got = _ask(port, req(path="data/obj", offset=PAGE - 10, length=20, token="s3cret").SerializeToString(),
                          sock)
        assert reply.code == Reply.OK and reply.info.size == len(data)
        assert [(s.offset, s.length, s.verified) for s in reply.segments] == [(PAGE - 10, 10, True), (PAGE, 10, True)]
        assert got == data[PAGE - 10:PAGE + 10]
        reply, got = _ask(port, req(path="data/obj", length=-1, token="s3cret").SerializeToString(), sock)
        assert reply.code == Reply.OK and got == data and not any(s.verified for s in reply.segments)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # an absurd frame: refused, closed
        sock.sendall(FRAME.pack(1 << 30))
        (size,) = FRAME.unpack(_recv(sock, 4))
        assert Reply.FromString(_recv(sock, size)).code == Reply.REFUSED
        assert sock.recv(1) == b""


def test_a_port_that_goes_away_costs_no_read(local_store, make_worker):
    data = payload(2 * PAGE + 1, 6)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))
    assert fs.cat_file("cachefs://data/obj") == data and fs.session.bulk_stats["data_port"]["reads"] == 2
    worker.data_port_server.stop()  # pooled connections are shut; new ones refused; gRPC still answers
    assert fs.cat_file("cachefs://data/obj") == data
    assert fs.cat_file("cachefs://data/obj", 5, 50) == data[5:50]


def test_switched_off_by_option_and_env(local_store, make_worker, monkeypatch):
    local_store.add("obj", payload(PAGE, 7))
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker, data_port=False)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", PAGE)
    assert fs.cat_file("cachefs://data/obj") == local_store.objects["obj"]
    assert fs.session.bulk_stats["data_port"]["reads"] == 0 and not fs.session.bulk_enabled
    monkeypatch.setenv("CACHEFS_DATA_PORT", "false")
    assert not CacheFileSystem(workers=worker.address, skip_instance_cache=True).config.data_port
