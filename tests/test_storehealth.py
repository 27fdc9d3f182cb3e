"""Unit level: the store breaker, the store-unavailable error, the page store's degraded flag,
and the decode guard (on a real gRPC server)."""

from __future__ import annotations

import errno
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cachefs.errors import (
    ERROR_METADATA,
    StoreUnavailableError,
    WorkerUnavailableError,
    error_detail,
    fault_of,
    from_rpc_error,
    to_status,
)
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import CachePath
from cachefs.proto import worker_pb2
from cachefs.server.decodeguard import DecodeGuard
from cachefs.store.objects import ObjectStore
from cachefs.server.pagestore import CacheDir, PageId, PageStore
from cachefs import pagefile
from cachefs.store.health import StoreBreaker, is_connection_error


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_connection_failures_probes_and_closes():
    clock = _Clock()
    breaker = StoreBreaker(threshold=2, cooldown=5.0, clock=clock)
    breaker.check("m", "x")
    assert not breaker.record("m", FileNotFoundError("no such object"))  # the store answered
    assert breaker.record("m", ConnectionRefusedError(111, "refused"))
    breaker.check("m", "x")  # one failure: still closed
    assert breaker.record("m", ConnectionRefusedError(111, "refused"))
    with pytest.raises(StoreUnavailableError, match="object store unavailable"):
        breaker.check("m", "x")
    assert breaker.open_mounts() == ["m"] and breaker.rejected == 1
    breaker.check("other", "x")  # per mount
    clock.now += 5.0
    breaker.check("m", "probe")  # half-open: one caller goes through
    with pytest.raises(StoreUnavailableError):
        breaker.check("m", "x")  # ... and only one
    breaker.record("m", None)
    breaker.check("m", "x")
    assert breaker.open_mounts() == []


def test_connection_errors_are_recognised_through_the_chain():
    class EndpointConnectionError(Exception):  # botocore's, by name
        pass

    try:
        try:
            raise EndpointConnectionError("could not connect")
        except EndpointConnectionError as inner:
            raise OSError("wrapped") from inner
    except OSError as outer:
        assert is_connection_error(outer)
    assert not is_connection_error(FileNotFoundError("x"))
    assert not is_connection_error(PermissionError("x"))


def test_store_unavailable_status_round_trip():
    exc = StoreUnavailableError("data/k: object store unavailable (refused)")
    assert isinstance(exc, ConnectionError) and exc.errno == errno.ECONNREFUSED
    assert to_status(exc) == grpc.StatusCode.UNAVAILABLE

    class _Err(grpc.RpcError):
        def __init__(self, details: str, sent: BaseException | None) -> None:
            self._details, self._sent = details, sent

        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return self._details

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return ((ERROR_METADATA, error_detail(self._sent)),) if self._sent else ()

    # The error detail tells them apart, not the text: a worker's own outage reads the same.
    assert type(from_rpc_error(_Err(str(exc), exc))) is StoreUnavailableError
    assert fault_of(_Err(str(exc), exc)) == "store"
    assert type(from_rpc_error(_Err(str(exc), None))) is WorkerUnavailableError  # no detail: the code's meaning
    assert type(from_rpc_error(_Err("refused", WorkerUnavailableError("refused")))) is WorkerUnavailableError


def test_s3_store_that_refuses_connections_fails_fast_then_at_once(aws_env, dead_port):
    mounts = MountTable([MountSpec("m", "s3://bucket/root", {"endpoint_url": f"http://127.0.0.1:{dead_port}",
                                                            "key": "k", "secret": "s"})])
    store = ObjectStore(mounts, breaker=StoreBreaker(threshold=2, cooldown=30.0))
    timings = []
    for i in range(4):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            store.info(CachePath("m", f"k{i}"))
        timings.append(time.monotonic() - t0)
    # botocore's defaults took ~8.5 s here; the first call also makes the S3 client (imports, a
    # session: seconds on a loaded machine), so it gets more room than the retries after it.
    assert timings[0] < 6.0 and max(timings[1:]) < 3.0, timings
    assert timings[-1] < 0.05, timings  # the breaker answers without a store call
    assert store.breaker.open_mounts() == ["m"]


def test_page_store_degraded_while_writes_fail_and_recovers(tmp_path, monkeypatch):
    with PageStore([CacheDir(str(tmp_path / "c"), 1 << 20)], page_size=4096) as pages:
        assert pages.put(PageId("m", "a", "v", 0), b"x" * 100)
        assert not pages.stats().degraded

        def enospc(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        monkeypatch.setattr(pagefile, "_write_all", enospc)
        assert not pages.put(PageId("m", "a", "v", 1), b"y" * 100)
        s = pages.stats()
        assert s.degraded and s.disk_errors == 1 and s.put_failures == 1
        assert pages.get(PageId("m", "a", "v", 0)) == b"x" * 100  # what is cached still serves
        monkeypatch.undo()
        assert pages.put(PageId("m", "a", "v", 1), b"y" * 100)
        assert not pages.stats().degraded and pages.stats().disk_errors == 1


def _echo_server(*handlers: grpc.GenericRpcHandler) -> tuple[grpc.Server, int]:
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[DecodeGuard()])
    server.add_generic_rpc_handlers(handlers)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_decode_guard_answers_malformed_messages_with_invalid_argument():
    def info(request: worker_pb2.InfoRequest, context) -> worker_pb2.InfoRequest:
        return request

    def write(requests, context) -> worker_pb2.InfoRequest:
        return worker_pb2.InfoRequest(path="".join(r.path for r in requests))

    handler = grpc.method_handlers_generic_handler("t.S", {
        "Info": grpc.unary_unary_rpc_method_handler(info, worker_pb2.InfoRequest.FromString,
                                                    worker_pb2.InfoRequest.SerializeToString),
        "Write": grpc.stream_unary_rpc_method_handler(write, worker_pb2.InfoRequest.FromString,
                                                      worker_pb2.InfoRequest.SerializeToString),
    })
    server, port = _echo_server(handler)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary("/t.S/Info", request_serializer=None, response_deserializer=None)
            good = worker_pb2.InfoRequest(path="m/k").SerializeToString()
            assert unary(good, timeout=5) == good
            with pytest.raises(grpc.RpcError) as err:
                unary(b"\x0a\xff\xff", timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "/t.S/Info" in err.value.details()
            stream = channel.stream_unary("/t.S/Write", request_serializer=None, response_deserializer=None)
            assert worker_pb2.InfoRequest.FromString(stream(iter([good, good]), timeout=5)).path == "m/km/k"
            with pytest.raises(grpc.RpcError) as err:
                stream(iter([good, b"\x0a\xff\xff"]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop(0)


def test_disk_health_stays_degraded_until_writes_succeed_for_the_settle_time():
    from cachefs.server.pagestore.health import DiskHealth

    now = [100.0]
    health = DiskHealth(settle_s=10.0, clock=lambda: now[0])
    full = OSError(errno.ENOSPC, "No space left on device")
    assert health.failed("/a", full, writing=True) and health.degraded
    health.ok("/a")  # a small page fitted between ENOSPC errors
    now[0] += 9.9
    assert health.degraded and "/a" in health.reasons()
    assert health.failed("/a", full, writing=True)  # the disk is still full: the clock restarts
    now[0] += 9.9
    health.ok("/a")
    assert health.degraded
    now[0] += 0.2
    assert not health.degraded and health.reasons() == {} and health.errors == 2
    now[0] += 100
    health.ok("/a")  # a write with no error before it: nothing to clear, not degraded
    assert not health.degraded
    # Unwritten since the error: degraded however long ago it was; a read error that is not the
    # disk's (a bad page) does not count.
    assert health.failed("/b", OSError(errno.EIO, "I/O error"), writing=False)
    assert not health.failed("/b", ValueError("bad trailer"), writing=False)
    now[0] += 1000
    assert health.degraded and list(health.reasons()) == ["/b"]
    with pytest.raises(ValueError, match="settle_s"):
        DiskHealth(settle_s=-1)
