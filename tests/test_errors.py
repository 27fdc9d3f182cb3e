"""The one table between exceptions and gRPC statuses."""

from __future__ import annotations

import grpc
import pytest

from cachefs.errors import (
    DeadlineExceededError,
    InvalidPathError,
    StaleObjectError,
    StoreError,
    UnknownMountError,
    WorkerUnavailableError,
    from_rpc_error,
    to_status,
)


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "exc, code, back",
    [
        (InvalidPathError("bad"), grpc.StatusCode.INVALID_ARGUMENT, InvalidPathError),
        (UnknownMountError("m"), grpc.StatusCode.NOT_FOUND, FileNotFoundError),
        (FileNotFoundError("x"), grpc.StatusCode.NOT_FOUND, FileNotFoundError),
        (PermissionError("x"), grpc.StatusCode.PERMISSION_DENIED, PermissionError),
        (IsADirectoryError("x"), grpc.StatusCode.FAILED_PRECONDITION, IsADirectoryError),
        (StaleObjectError("x"), grpc.StatusCode.ABORTED, StaleObjectError),
        (DeadlineExceededError("x"), grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (WorkerUnavailableError("x"), grpc.StatusCode.UNAVAILABLE, WorkerUnavailableError),
        (StoreError("x"), grpc.StatusCode.INTERNAL, StoreError),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL, StoreError),
    ],
)
def test_round_trip_keeps_type_message_code_and_cause(exc, code, back):
    assert to_status(exc) == code
    err = _FakeRpcError(code, "details from the worker")
    out = from_rpc_error(err, "read data/x")
    assert isinstance(out, back)
    assert isinstance(out, OSError)
    assert "read data/x" in str(out) and "details from the worker" in str(out)
    assert out.grpc_code == code
    assert out.__cause__ is err


# ----------------------------------------------------------------- the whole table, on the wire
import ast  # noqa: E402
import errno  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from cachefs import errors  # noqa: E402
from cachefs.errors import (  # noqa: E402
    ERROR_METADATA,
    FAULTS,
    InternalError,
    StoreUnavailableError,
    UnauthenticatedError,
    fault_of,
    is_worker_fault,
)
from cachefs.server.rpc import rpc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "cachefs.test.Errors"
TABLE_TYPES = [row[0] for row in errors._TABLE]
BUILTIN_OS = [t for t in TABLE_TYPES if issubclass(t, OSError) and not issubclass(t, errors.CacheFSError)]


class _Counter:
    def labels(self, *names: str) -> "_Counter":
        return self

    def inc(self) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class _Metrics:
    requests = _Counter()
    request_seconds = _Counter()


def _make(name: str, number: str, message: str) -> BaseException:
    """The exception a request names: ``TypeName|errno-name-or-empty|message``."""
    exc_type = {t.__name__: t for t in TABLE_TYPES}.get(name) or {"RuntimeError": RuntimeError}[name]
    if number:
        return exc_type(getattr(errno, number), message)
    return exc_type(message)


class _Servicer:
    """Raises what it is asked to, through the decorator every worker and master RPC goes through."""

    metrics = _Metrics()

    def __init__(self) -> None:
        self.release = threading.Event()

    @rpc("Raise")
    def Raise(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise _make(*request.decode().split("|", 2))

    @rpc("RaiseStream", streaming=True)
    def RaiseStream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        raise _make(*request.decode().split("|", 2))

    def Bare(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """An older server: a status, no detail."""
        code, message = request.decode().split("|", 1)
        context.abort(grpc.StatusCode[code], message)

    def Wait(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.release.wait(30)
        return b""


@pytest.fixture(scope="module")
def loopback() -> Iterator[tuple[grpc.Channel, _Servicer]]:
    servicer = _Servicer()
    handlers = {
        "Raise": grpc.unary_unary_rpc_method_handler(servicer.Raise),
        "RaiseStream": grpc.unary_stream_rpc_method_handler(servicer.RaiseStream),
        "Bare": grpc.unary_unary_rpc_method_handler(servicer.Bare),
        "Wait": grpc.unary_unary_rpc_method_handler(servicer.Wait),
    }
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, servicer
    servicer.release.set()
    channel.close()
    server.stop(0)


def _call(channel: grpc.Channel, method: str, request: str, timeout: float = 10.0) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        if method == "RaiseStream":
            list(channel.unary_stream(f"/{SERVICE}/{method}")(request.encode(), timeout=timeout))
        else:
            channel.unary_unary(f"/{SERVICE}/{method}")(request.encode(), timeout=timeout)
    return info.value


def _cases() -> list[tuple[str, str]]:
    """(type name, errno name) for every table row: without an errno, and with one for the
    built-in OSError types (which the server may raise with any errno)."""
    out = [(t.__name__, "") for t in TABLE_TYPES]
    out += [(t.__name__, {OSError: "ENOSPC", TimeoutError: "ETIMEDOUT"}.get(t, errno.errorcode[errors._BY_NAME[t.__name__][3]]))
            for t in BUILTIN_OS]
    return out


def test_table_has_one_bare_meaning_per_code_and_known_faults():
    codes = {code for _, code, _, _, _ in errors._TABLE}
    for code in codes:
        bare = [t for t, c, _, _, b in errors._TABLE if c == code and b]
        assert len(bare) == 1, (code, bare)
        assert getattr(grpc.StatusCode, code)  # a real code name
    assert len({t.__name__ for t in TABLE_TYPES}) == len(TABLE_TYPES)
    assert all(fault in FAULTS for _, _, fault, _, _ in errors._TABLE)
    # Most specific first: no row is shadowed by an earlier, more general one.
    for i, t in enumerate(TABLE_TYPES):
        assert not any(issubclass(t, earlier) for earlier in TABLE_TYPES[:i]), t
    # What the old RETRYABLE_CODES said, now derived from the table.
    assert {c.name for c in errors.RETRYABLE_CODES} == {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED",
                                                          "RESOURCE_EXHAUSTED", "UNKNOWN"}


@pytest.mark.parametrize("method", ["Raise", "RaiseStream"])
@pytest.mark.parametrize("name, number", _cases())
def test_every_table_type_crosses_the_wire_intact(loopback, method, name, number):
    channel, _ = loopback
    sent = _make(name, number, f"it failed: {name}")
    row = errors._BY_NAME[name]
    err = _call(channel, method, f"{name}|{number}|it failed: {name}")
    assert err.code().name == row[1]
    assert err.details() == str(sent)  # the server's message, as it was
    assert any(k == ERROR_METADATA for k, _ in err.trailing_metadata())
    assert fault_of(err) == row[2]

    out = from_rpc_error(err, "read data/x")
    assert type(out) is type(sent)
    assert out.grpc_code == err.code()
    assert out.__cause__ is err
    assert str(sent) in str(out) and "read data/x" in str(out)
    assert fault_of(out) == row[2] and is_worker_fault(out) == (row[2] == "worker")
    if isinstance(sent, OSError):
        want = getattr(errno, number) if number else (sent.errno if sent.errno is not None else row[3])
        assert out.errno == want
        assert out.errno is not None


def test_a_bug_comes_back_as_internal_and_a_subclass_is_sent_as_its_table_type(loopback):
    channel, _ = loopback
    err = _call(channel, "Raise", "RuntimeError||boom")
    assert err.code() == grpc.StatusCode.INTERNAL
    out = from_rpc_error(err)
    assert type(out) is InternalError and fault_of(out) == "worker" and out.strerror == "boom"

    from cachefs.server.decodeguard import MalformedMessageError

    class _Ctx:
        def set_trailing_metadata(self, md):
            self.md = md

        def abort(self, code, details):
            self.code, self.details = code, details
            raise RuntimeError("aborted")

    ctx = _Ctx()
    with pytest.raises(RuntimeError, match="aborted"):
        errors.abort(ctx, MalformedMessageError("Read: malformed"))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.md == ((ERROR_METADATA, "type=InvalidPathError;fault=request;errno=EINVAL"),)


@pytest.mark.parametrize("code, back, want_fault", [
    ("NOT_FOUND", FileNotFoundError, "request"), ("UNAVAILABLE", WorkerUnavailableError, "worker"),
    ("INTERNAL", StoreError, "store"), ("FAILED_PRECONDITION", IsADirectoryError, "request"),
    ("INVALID_ARGUMENT", InvalidPathError, "request"), ("DEADLINE_EXCEEDED", DeadlineExceededError, "worker"),
    ("RESOURCE_EXHAUSTED", errors.OverloadedError, "worker"), ("CANCELLED", WorkerUnavailableError, "worker"),
    ("UNKNOWN", WorkerUnavailableError, "worker"), ("DATA_LOSS", StoreError, "store"),
])
def test_a_server_without_the_detail_falls_back_to_the_code(loopback, code, back, want_fault):
    channel, _ = loopback
    # The text of a store outage does not make it one: only the detail does.
    err = _call(channel, "Bare", f"{code}|x: {StoreUnavailableError.MARKER}")
    assert not any(k == ERROR_METADATA for k, _ in err.trailing_metadata())
    out = from_rpc_error(err, "w")
    assert type(out) is back and out.grpc_code.name == code and out.__cause__ is err
    assert fault_of(err) == fault_of(out) == want_fault


def test_a_dead_channel_and_a_client_deadline_are_worker_faults(loopback, dead_port):
    with grpc.insecure_channel(f"127.0.0.1:{dead_port}") as channel:
        err = _call(channel, "Raise", "FileNotFoundError||x", timeout=5)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    out = from_rpc_error(err, "read data/x")
    assert type(out) is WorkerUnavailableError and out.errno == errno.EHOSTUNREACH
    assert fault_of(err) == "worker" and out.__cause__ is err

    channel, servicer = loopback
    err = _call(channel, "Wait", "", timeout=0.2)
    servicer.release.set()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert type(from_rpc_error(err)) is DeadlineExceededError and fault_of(err) == "worker"


def test_a_detail_from_a_newer_server_keeps_its_fault():
    class _Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "newer"

        def trailing_metadata(self):
            return ((ERROR_METADATA, "type=SomethingNewError;fault=store;errno=ENOTAVAILABLE"),)

    out = from_rpc_error(_Err())
    assert type(out) is WorkerUnavailableError  # the code's meaning: the type is unknown here
    assert fault_of(out) == fault_of(_Err()) == "store"  # ... but the server said whose fault it is


# ------------------------------------------------------------ real daemons use the same path
def test_worker_and_master_errors_carry_the_detail(tmp_path):
    from cachefs.config import CacheDirSpec, MasterConfig, WorkerConfig
    from cachefs.mounts import MountSpec
    from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
    from cachefs.server.master import Master
    from cachefs.server.worker import Worker

    store = tmp_path / "store"
    (store / "dir").mkdir(parents=True)
    (store / "a.bin").write_bytes(b"a" * 100)
    mount = MountSpec("data", str(store))
    worker = Worker(WorkerConfig(host="127.0.0.1", port=0, mounts=(mount,),
                                 cache_dirs=(CacheDirSpec(str(tmp_path / "cache"), 16 << 20),))).start()
    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "m"), mounts=(mount,),
                                 access_token="acc", cluster_token="clu", shutdown_grace=0.5)).start()
    wch, mch = grpc.insecure_channel(worker.address), grpc.insecure_channel(master.address)
    try:
        w, m = worker_pb2_grpc.WorkerServiceStub(wch), master_pb2_grpc.MasterServiceStub(mch)

        def fails(call) -> OSError:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert any(k == ERROR_METADATA for k, _ in info.value.trailing_metadata()), info.value
            return from_rpc_error(info.value, "t")

        acc = (("x-cachefs-token", "acc"),)
        cases = [
            (lambda: w.GetInfo(worker_pb2.InfoRequest(path="nope/x"), timeout=10), UnknownMountError),
            (lambda: w.GetInfo(worker_pb2.InfoRequest(path="data/missing"), timeout=10), FileNotFoundError),
            (lambda: w.ReadBlock(worker_pb2.ReadRequest(path="data/dir", length=10), timeout=10), IsADirectoryError),
            (lambda: w.ReadBlock(worker_pb2.ReadRequest(path="data/a.bin", length=10, version="old"), timeout=10),
             StaleObjectError),
            (lambda: w.GetInfo(worker_pb2.InfoRequest(path="data/../x"), timeout=10), InvalidPathError),
            # the decode guard: bytes that are no InfoRequest
            (lambda: wch.unary_unary("/cachefs.v1.WorkerService/GetInfo")(b"\xff\xff\xff", timeout=10),
             InvalidPathError),
            (lambda: m.GetInfo(worker_pb2.InfoRequest(path="nope/x"), timeout=10, metadata=acc), UnknownMountError),
            (lambda: m.GetInfo(worker_pb2.InfoRequest(path="data/missing"), timeout=10, metadata=acc),
             FileNotFoundError),
            # the token check (no token at all), and the servicer's cluster-token check
            (lambda: m.GetInfo(worker_pb2.InfoRequest(path="data/a.bin"), timeout=10), UnauthenticatedError),
            (lambda: m.AddMount(master_pb2.AddMountRequest(name="x", url=str(store)), timeout=10, metadata=acc),
             UnauthenticatedError),
        ]
        for call, want in cases:
            out = fails(call)
            assert type(out) is want, (want, out)
        assert fault_of(out) == "request"
    finally:
        wch.close()
        mch.close()
        master.stop()
        worker.stop(grace=1.0)


def test_a_store_outage_through_a_real_worker_is_the_store_fault(tmp_path, aws_env, dead_port):
    from cachefs.config import CacheDirSpec, WorkerConfig
    from cachefs.mounts import MountSpec
    from cachefs.proto import worker_pb2, worker_pb2_grpc
    from cachefs.server.worker import Worker

    mount = MountSpec("m", "s3://bucket/root", {"endpoint_url": f"http://127.0.0.1:{dead_port}", "key": "k",
                                                "secret": "s"})
    worker = Worker(WorkerConfig(host="127.0.0.1", port=0, mounts=(mount,),
                                 cache_dirs=(CacheDirSpec(str(tmp_path / "cache"), 16 << 20),))).start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(worker_pb2.InfoRequest(path="m/k"), timeout=30)
        err = info.value
        assert err.code() == grpc.StatusCode.UNAVAILABLE  # the same code as a dead worker ...
        assert fault_of(err) == "store" and not is_worker_fault(err)  # ... but not the worker's fault
        out = from_rpc_error(err, "info m/k")
        assert type(out) is StoreUnavailableError and out.errno == errno.ECONNREFUSED
    finally:
        worker.stop(grace=1.0)


def test_every_servicer_method_goes_through_the_rpc_decorator():
    from cachefs.proto import master_pb2_grpc, worker_pb2_grpc
    from cachefs.server.master.service import MasterServicer
    from cachefs.server.worker.service import WorkerServicer

    for servicer, base in ((WorkerServicer, worker_pb2_grpc.WorkerServiceServicer),
                           (MasterServicer, master_pb2_grpc.MasterServiceServicer)):
        methods = [n for n in vars(base) if n[0].isupper()]
        assert methods
        for name in methods:
            assert getattr(getattr(servicer, name), "cachefs_rpc", None) == name, (servicer.__name__, name)


def test_no_server_code_aborts_an_rpc_but_through_errors_abort():
    """context.abort / set_code / abort_with_status anywhere else would send a status without the detail."""
    offenders = []
    for folder in ("cachefs", "server", "client"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith("_pb2_grpc.py") or path == ROOT / "cachefs" / "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("abort", "set_code", "abort_with_status", "set_details")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize("cls", sorted({c for c in TABLE_TYPES if issubclass(c, errors.CacheFSError)},
                                       key=lambda c: c.__name__))
def test_every_cachefs_error_pickles_as_itself(cls):
    """A DataLoader worker sends its exception to the main process by pickle: it must arrive whole."""
    import pickle

    original = cls(f"{cls.__name__} in a worker process")
    original.__cause__ = None
    original.path = "data/x"  # state set after construction travels too
    back = pickle.loads(pickle.dumps(original))
    assert type(back) is cls
    assert (back.errno, back.strerror, str(back)) == (original.errno, original.strerror, str(original))
    assert back.path == "data/x"
