"""Short-circuit reads: a client on the worker's host gets cached page files as descriptors over
the worker's Unix socket; anything the socket cannot serve goes through gRPC, never fails."""

from __future__ import annotations

import os
import socket
import stat

import grpc
import pytest

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.localhost import MAX_PAGES, host_id
from cachefs.paths import CachePath
from cachefs.proto import shortcircuit_pb2, worker_pb2, worker_pb2_grpc
from helpers import flip_page_bytes, page_files, payload, wait_for

PAGE = 64 << 10
Reply = shortcircuit_pb2.ShortCircuitReply
RangeReply = shortcircuit_pb2.RangeReply


def _fs(worker, **kw) -> CacheFileSystem:
    return CacheFileSystem(workers=worker.address, skip_instance_cache=True, **kw)


def _status(worker) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(worker.address) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def _settled(worker, path: str, size: int) -> None:
    """Pages are written behind the read that fetched them: wait until all are on disk."""
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: stub.GetCached(worker_pb2.GetCachedRequest(paths=[path]), timeout=10)
                        .cached_bytes[0] == size)


def _request(path: str, offset: int = 0, length: int = -1, token: str = "") -> shortcircuit_pb2.ShortCircuitRequest:
    return shortcircuit_pb2.ShortCircuitRequest(
        ranges=[shortcircuit_pb2.RangeRequest(path=path, offset=offset, length=length)], token=token)


def _ask(path: str, request: shortcircuit_pb2.ShortCircuitRequest) -> tuple[Reply, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.send(request.SerializeToString())
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 200)
    reply = Reply()
    reply.ParseFromString(message)
    return reply, fds


def test_worker_advertises_its_socket_and_host(local_store, make_worker):
    worker = make_worker(local_store.mount, page_size=PAGE)
    st = _status(worker)
    assert st.host_id == host_id() and st.short_circuit_socket
    mode = os.stat(st.short_circuit_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
    worker.stop(grace=1)
    assert not os.path.exists(st.short_circuit_socket)


def test_cached_reads_take_the_socket_and_return_the_same_bytes(store, make_worker):
    data = payload(5 * PAGE + 777, 1)
    store.add("obj", data)
    worker = make_worker(store.mount, page_size=PAGE)
    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/obj") == data  # cold: filled by the worker, then handed out
    _settled(worker, "data/obj", len(data))
    reads = fs.session.bulk_stats["short_circuit"]["reads"]
    for start, end in [(0, None), (1, 2), (PAGE - 3, PAGE + 5), (PAGE, 3 * PAGE), (2 * PAGE + 9, None),
                       (5 * PAGE, 5 * PAGE + 777), (0, 5 * PAGE + 777)]:
        assert fs.cat_file("cachefs://data/obj", start, end) == data[start:end]
    assert fs.session.bulk_stats["short_circuit"]["reads"] == reads + 7
    fs.session.report_reads()  # reads through held handles reach the worker with the next request
    totals = worker.metrics.totals()  # counted like any cached read
    assert totals["bytes_from_cache"] >= sum(len(data[s:e]) for s, e in [(0, None), (1, 2)])
    assert worker.metrics.short_circuit_bytes._value.get() > 0 and totals["hits"] >= 6


def test_cold_ranges_are_filled_by_the_worker_and_handed_out(local_store, make_worker):
    """A cold read on the worker's host: the worker fetches the range into its page store and
    answers with the page files; no byte of it crosses gRPC."""
    data = payload(4 * PAGE + 5, 9)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker)
    fs.info("cachefs://data/obj")  # probes the worker (gRPC): finds it local
    metrics = worker.metrics

    def through_grpc() -> float:  # bytes served other than over the short-circuit socket
        return metrics.bytes_served._value.get() - metrics.short_circuit_bytes._value.get()

    before = through_grpc()
    assert fs.cat_file("cachefs://data/obj", 3, 3 * PAGE + 1) == data[3:3 * PAGE + 1]
    # 4 pages, each fetched for this request: misses, as the reply says (nothing read through held handles)
    assert fs.session.bulk_stats["short_circuit"] == {"reads": 1, "bytes": 3 * PAGE - 2, "fallbacks": 0, "errors": 0,
                                                      "hits": 0, "misses": 4, "held_hits": 0, "held_misses": 0,
                                                      "named_hits": 0, "busy": 0}
    assert metrics.short_circuit_bytes._value.get() == 3 * PAGE - 2
    assert through_grpc() == before  # nothing through gRPC
    assert worker.filler.stats["ranges"] == 1 and worker.filler.stats["failed"] == 0
    assert worker.pages.cached_bytes("data", "obj", worker.objects.info(CachePath("data", "obj")).version) \
        >= 3 * PAGE  # the pages of that range (and what came with the first GET) in the page store
    assert fs.cat_file("cachefs://data/obj") == data  # the rest filled in the same way
    assert through_grpc() == before and worker.filler.stats["requests"] == 2


def test_uncached_ranges_fall_back_to_grpc(local_store, make_worker):
    """When the worker cannot fill a cold range (here: no filler, as when it is busy with other
    fills), it answers NOT_CACHED and the read goes through gRPC."""
    data = payload(4 * PAGE, 2)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    worker.short_circuit.filler = None
    fs = _fs(worker)
    fs.info("cachefs://data/obj")  # the first read probes the worker, finds it local and asks the socket
    assert fs.cat_file("cachefs://data/obj") == data  # nothing cached: NOT_CACHED, then gRPC
    assert fs.session.bulk_stats["short_circuit"] == {"reads": 0, "bytes": 0, "fallbacks": 1, "errors": 0,
                                                      "hits": 0, "misses": 0, "held_hits": 0, "held_misses": 0,
                                                      "named_hits": 0, "busy": 0}
    counters = fs.session.counters()
    assert (counters["grpc_reads"], counters["grpc_hits"], counters["grpc_misses"]) == (1, 0, 4)  # the reply said
    _settled(worker, "data/obj", len(data))
    fs.session._state.get().bulk._readers[worker.address][0]._not_cached.clear()  # its 0.5 s are over
    assert fs.cat_file("cachefs://data/obj") == data
    assert fs.session.bulk_stats["short_circuit"] == {"reads": 1, "bytes": len(data), "fallbacks": 1, "errors": 0,
                                                      "hits": 4, "misses": 0, "held_hits": 0, "held_misses": 0,
                                                      "named_hits": 0, "busy": 0}


def test_switched_off_by_option(local_store, make_worker):
    local_store.add("obj", payload(PAGE, 3))
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker, short_circuit=False)
    fs.cat_file("cachefs://data/obj")
    assert fs.cat_file("cachefs://data/obj") == local_store.objects["obj"]
    assert fs.session.bulk_stats["short_circuit"]["reads"] == 0


def test_a_corrupt_page_is_never_served(local_store, make_worker, tmp_path):
    data = payload(2 * PAGE, 4)
    local_store.add("obj", data)
    cache = tmp_path / "sc-cache"
    worker = make_worker(local_store.mount, page_size=PAGE, cache_dir=cache)
    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/obj") == data
    _settled(worker, "data/obj", len(data))
    # the cold read (filled by the worker) and this one: both short-circuit
    assert fs.cat_file("cachefs://data/obj") == data and fs.session.bulk_stats["short_circuit"]["reads"] == 2
    assert flip_page_bytes(cache) >= 1  # a byte flipped in every page's payload
    # A process checks each page file once (page files are never changed in place: a rewrite is
    # a new file); a process that has not checked these pages yet finds them bad.
    fresh = _fs(worker)
    assert fresh.cat_file("cachefs://data/obj") == data  # the checksum fails: gRPC, which refetches
    assert fresh.session.bulk_stats["short_circuit"]["fallbacks"] >= 1 and fresh.session.bulk_stats["short_circuit"]["reads"] == 0


def test_the_socket_refuses_bad_requests_and_wrong_tokens(local_store, make_worker):
    local_store.add("obj", payload(PAGE, 5))
    worker = make_worker(local_store.mount, page_size=PAGE, access_token="s3cret")
    path = worker.short_circuit.path
    ok = _fs(worker, token="s3cret")
    assert ok.cat_file("cachefs://data/obj") == local_store.objects["obj"]
    with grpc.insecure_channel(worker.address) as ch:  # wait for the page to be written (with the token)
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: stub.GetCached(worker_pb2.GetCachedRequest(paths=["data/obj"]), timeout=10,
                                               metadata=[("x-cachefs-token", "s3cret")]).cached_bytes[0] == PAGE)
    assert ok.cat_file("cachefs://data/obj") == local_store.objects["obj"]
    assert ok.session.bulk_stats["short_circuit"]["reads"] == 2  # cold (filled) and warm
    reply, fds = _ask(path, _request("data/obj", token="wrong"))
    assert reply.refused and "UNAUTHENTICATED" in reply.message and not reply.ranges and fds == []
    for bad in [dict(path="data/../etc/passwd"), dict(path="data/a\x00b"), dict(path="data/obj", offset=-1),
                dict(path="data/obj", length=-2)]:
        reply, fds = _ask(path, _request(**{"token": "s3cret", **bad}))
        assert reply.ranges[0].code == RangeReply.REFUSED and fds == [], bad
    for unknown in ["nomount/x", "data/missing", "data/obj?"]:  # not known here: for gRPC to answer
        reply, fds = _ask(path, _request(unknown, token="s3cret"))
        assert reply.ranges[0].code == RangeReply.NOT_CACHED and fds == [], unknown
    reply, fds = _ask(path, _request("data/obj", token="s3cret"))
    try:
        assert reply.ranges[0].code == RangeReply.OK and len(fds) == 1
        assert os.pread(fds[0], PAGE, 0) == local_store.objects["obj"]
        with pytest.raises(OSError):
            os.write(fds[0], b"x")  # read-only
    finally:
        for fd in fds:
            os.close(fd)
    # A batch: answered range by range, in order; more descriptors than one reply carries are refused.
    many = [shortcircuit_pb2.RangeRequest(path="data/obj", length=-1)] * (MAX_PAGES + 2)
    reply, fds = _ask(path, shortcircuit_pb2.ShortCircuitRequest(
        ranges=[shortcircuit_pb2.RangeRequest(path="data/missing", length=-1), *many], token="s3cret"))
    try:
        codes = [r.code for r in reply.ranges]
        assert codes == [RangeReply.NOT_CACHED] + [RangeReply.OK] * MAX_PAGES + [RangeReply.REFUSED] * 2
        assert len(fds) == MAX_PAGES
    finally:
        for fd in fds:
            os.close(fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:  # garbage: refused, connection kept
        sock.settimeout(10)
        sock.connect(path)
        sock.send(b"\xff\x00garbage")
        reply = Reply()
        reply.ParseFromString(sock.recv(1 << 16))
        assert reply.refused


def test_a_restarted_worker_is_probed_again(local_store, make_worker, tmp_path):
    local_store.add("obj", payload(PAGE, 6))
    cache = tmp_path / "restart-cache"
    worker = make_worker(local_store.mount, page_size=PAGE, cache_dir=cache)
    fs = _fs(worker)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", PAGE)
    assert fs.cat_file("cachefs://data/obj") == local_store.objects["obj"]
    assert fs.session.bulk_stats["short_circuit"]["reads"] == 2  # cold (filled) and warm
    worker.short_circuit.stop()  # the socket goes away; gRPC still answers
    assert fs.cat_file("cachefs://data/obj") == local_store.objects["obj"]


@pytest.mark.parametrize("short_circuit", [True, False])
def test_read_into_fills_the_callers_buffer(local_store, make_worker, short_circuit):
    import numpy as np

    data = payload(3 * PAGE + 5, 7)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = _fs(worker, short_circuit=short_circuit)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))
    buf = np.zeros(2 * PAGE, dtype=np.uint8)
    assert fs.read_into("cachefs://data/obj", buf, offset=PAGE - 7) == (2 * PAGE, len(data))
    assert buf.tobytes() == data[PAGE - 7:3 * PAGE - 7]
    tail = np.zeros(100, dtype=np.uint8)
    assert fs.read_into("cachefs://data/obj", tail, offset=3 * PAGE) == (5, len(data))  # short at the end
    assert tail[:5].tobytes() == data[3 * PAGE:]
    assert fs.session.bulk_stats["short_circuit"]["reads"] == (3 if short_circuit else 0)  # cold one filled


def test_a_page_file_checked_once_is_checked_again_when_replaced(local_store, make_worker, tmp_path):
    """The client skips the checksum only for a page file it has checked (same inode and times).
    (Without held handles: a held descriptor keeps reading the file it was handed.)"""
    data = payload(2 * PAGE, 8)
    local_store.add("obj", data)
    cache = tmp_path / "vf-cache"
    worker = make_worker(local_store.mount, page_size=PAGE, cache_dir=cache)
    fs = _fs(worker, short_circuit_handles=0)
    fs.cat_file("cachefs://data/obj")
    _settled(worker, "data/obj", len(data))
    assert fs.cat_file("cachefs://data/obj") == data  # checked here, once
    assert fs.cat_file("cachefs://data/obj", 10, 20) == data[10:20]  # a part of a checked page: no re-check
    # (the cold read above was filled by the worker and read here, checked: the next is not)
    # pages: 2 fetched for the cold read (misses), then 2 + 1 hits
    assert fs.session.bulk_stats["short_circuit"] == {"reads": 3, "bytes": 2 * len(data) + 10, "fallbacks": 0,
                                                      "errors": 0, "hits": 3, "misses": 2, "held_hits": 0,
                                                      "held_misses": 0, "named_hits": 3, "busy": 0}
    for f in page_files(cache):  # a new file in its place (new inode), one byte flipped
        raw = bytearray(f.read_bytes())
        raw[100] ^= 0xFF
        tmp = f.with_name(f.name + ".x")
        tmp.write_bytes(raw)
        os.replace(tmp, f)
    assert fs.cat_file("cachefs://data/obj") == data  # checked again, found bad: gRPC refetches
    assert fs.session.bulk_stats["short_circuit"]["fallbacks"] == 1
