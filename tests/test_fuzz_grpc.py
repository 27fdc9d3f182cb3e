"""Fuzz every gRPC method of the worker and the master with hypothesis.

Structured messages (odd paths, `..`, NUL, huge and negative offsets, enormous lengths,
unknown mounts, odd Unicode) and raw bytes sent through a generic channel with identity
serializers. Each call must end, within its deadline, with a precise status: never UNKNOWN
or INTERNAL (nor a deadline: nothing here may hang), the servers must stay up, no file
outside the cache and state directories may change, and memory must stay bounded.

CI runs a few hundred examples per method; ``CACHEFS_FUZZ_EXAMPLES=5000`` runs a long mode.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.auth import TOKEN_METADATA
from cachefs.config import CacheDirSpec, MasterConfig, WorkerConfig
from cachefs.mounts import MountSpec
from cachefs.proto import common_pb2, master_pb2, worker_pb2
from cachefs.server.master import Master
from cachefs.server.worker import Worker

EXAMPLES = int(os.environ.get("CACHEFS_FUZZ_EXAMPLES", "200"))
DEADLINE = 10.0  # seconds per call: a call that needs it has hung
TOKEN = "fuzz-cluster-token"
PAGE = 4096
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.DEADLINE_EXCEEDED}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
TRIED: dict[str, int] = {}  # method -> inputs tried (reported at the end of the module)


# ------------------------------------------------------------------------- the servers
def _snapshot(root: Path, allowed: tuple[Path, ...]) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` outside the allowed dirs, with its size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in allowed]
        for name in filenames:
            st_ = (here / name).stat()
            out[str(here / name)] = (st_.st_size, st_.st_mtime_ns)
    return out


class _Cluster:
    def __init__(self, root: Path, worker: Worker, master: Master) -> None:
        self.root, self.worker, self.master = root, worker, master
        self.channels = {
            "worker": grpc.insecure_channel(worker.address, options=[("grpc.max_send_message_length", 100 << 20)]),
            "master": grpc.insecure_channel(master.address, options=[("grpc.max_send_message_length", 100 << 20)]),
        }

    def call(self, server: str, method: str, request: bytes | list[bytes], streaming: bool = False,
             metadata: list[tuple[str, str]] | None = None) -> grpc.StatusCode:
        """Send raw bytes; the status code that came back (OK if it succeeded)."""
        service = "cachefs.v1.WorkerService" if server == "worker" else "cachefs.v1.MasterService"
        name = f"/{service}/{method}"
        channel = self.channels[server]
        TRIED[f"{server}.{method}"] = TRIED.get(f"{server}.{method}", 0) + 1
        watch = method == "WatchView"  # a long poll: it answers a change, else waits for one
        try:
            if isinstance(request, list):  # a client stream (Write)
                channel.stream_unary(name, request_serializer=None, response_deserializer=None)(
                    iter(request), timeout=DEADLINE, metadata=metadata)
            elif streaming:
                stream = channel.unary_stream(name, request_serializer=None, response_deserializer=None)(
                    request, timeout=1.0 if watch else DEADLINE, metadata=metadata)
                for _ in stream:
                    if watch:  # it never ends by itself: one reply proves it answers
                        stream.cancel()
                        break
            else:
                channel.unary_unary(name, request_serializer=None, response_deserializer=None)(
                    request, timeout=DEADLINE, metadata=metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and streaming:
                return grpc.StatusCode.OK  # we cancelled it
            if watch and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return grpc.StatusCode.OK  # the view it knows is the current one: nothing to send yet
            assert err.code() not in FORBIDDEN, (method, request[:200], err.code(), err.details())
            return err.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Cluster]:
    """A worker (read-only local mount) and a master, in this process, with DecodeGuard installed
    as the daemons install it (cachefs.server.rpc.server_interceptors)."""
    root = tmp_path_factory.mktemp("fuzz")
    store = root / "store"
    (store / "dir").mkdir(parents=True)
    (store / "a.bin").write_bytes(bytes(range(256)) * 48)  # 3 pages
    (store / "dir" / "b.bin").write_bytes(b"b" * 10)
    (store / "empty.bin").write_bytes(b"")
    mount = MountSpec("data", str(store), read_only=True)
    worker = Worker(WorkerConfig(host="127.0.0.1", port=0, page_size=PAGE, mounts=(mount,),
                                 cache_dirs=(CacheDirSpec(str(root / "cache"), 64 << 20),))).start()
    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(root / "master"), cluster_token=TOKEN,
                                 mounts=(mount,), shutdown_grace=0.5)).start()
    c = _Cluster(root, worker, master)
    allowed = (root / "cache", root / "master")
    before = _snapshot(root, allowed)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield c
    c.close()
    # Nothing outside the cache and state dirs was touched, and memory stayed bounded.
    assert _snapshot(root, allowed) == before
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 400, f"peak RSS grew by {grown_mib:.0f} MiB during the fuzz"
    master.stop()
    worker.stop(grace=1.0)
    print("\nfuzz inputs tried per method:", dict(sorted(TRIED.items())), "total", sum(TRIED.values()))


# ------------------------------------------------------------------------- strategies
_TRICKY_PARTS = ["..", ".", "", "a.bin", "dir", "b.bin", "%2e%2e", "%2F", "%00", "\x00", "\\", "~", "é",
                 "\u202e", "\ufeff", "𝄞", "\n", " ", "*", "?", "[", "a" * 300, "dir/..", "//"]
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=64)
_part = st.one_of(st.sampled_from(_TRICKY_PARTS), _text)
_key = st.one_of(
    st.lists(_part, max_size=6).map("/".join),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "𝄞", "/", "../", "x/"]), st.integers(0, 2000)),
)
_mount = st.one_of(st.sampled_from(["data", "nope", "", "DATA", "..", ".", "cachefs://data", "/data", "data\x00"]),
                   _text)
PATHS = st.one_of(st.builds(lambda m, k: f"{m}/{k}", _mount, _key), _text,
                  st.sampled_from(["data", "data/", "data/a.bin", "data/dir", "data/dir/b.bin", "data/empty.bin",
                                   "cachefs://data/a.bin", "data/../etc/passwd", "data/%2e%2e/x"]))
INT64 = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1),
                  st.sampled_from([0, -1, 1, PAGE - 1, PAGE, 3 * PAGE, 3 * PAGE + 1, 1 << 62, (1 << 62) + 1,
                                   (1 << 63) - 1, -(1 << 63)]))
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
RAW = st.one_of(st.binary(max_size=512), st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8),
                                                    st.integers(1, 20_000)))
OK_OR_PRECISE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                 grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.ALREADY_EXISTS}

WORKER_UNARY = ["ReadBlock", "GetInfo", "ListMounts", "GetStatus", "Load", "Free", "GetCached",
                "Remove", "MakeDir", "Copy"]
WORKER_STREAM = ["Read", "List"]
MASTER_UNARY = ["RegisterWorker", "Heartbeat", "GetView", "AddMount", "RemoveMount", "GetMounts", "GetInfo",
                "GetInfos", "Stat", "SubmitJob", "GetJob", "ListJobs", "CancelJob"]
MASTER_STREAM = ["WatchView", "List"]


# ------------------------------------------------------------------------- raw bytes
@pytest.mark.parametrize("method", WORKER_UNARY + WORKER_STREAM)
def test_worker_raw_bytes(cluster, method):
    @FUZZ
    @given(raw=RAW)
    def run(raw: bytes) -> None:
        cluster.call("worker", method, raw, streaming=method in WORKER_STREAM)

    run()


@FUZZ
@given(chunks=st.lists(st.one_of(RAW, st.builds(lambda p, d: worker_pb2.WriteChunk(path=p, data=d).SerializeToString()
                                                if hasattr(worker_pb2, "WriteChunk") else b"", PATHS,
                                                st.binary(max_size=64))), max_size=4))
def test_worker_write_stream_raw_and_structured(cluster, chunks):
    """The client-streaming Write (where the worker has it): the read-only store is never written."""
    code = cluster.call("worker", "Write", chunks)
    assert code in OK_OR_PRECISE - {grpc.StatusCode.OK}


@pytest.mark.parametrize("method", MASTER_UNARY + MASTER_STREAM)
def test_master_raw_bytes(cluster, method):
    @FUZZ
    @given(raw=RAW)
    def run(raw: bytes) -> None:
        cluster.call("master", method, raw, streaming=method in MASTER_STREAM)

    run()


def test_oversized_messages_are_refused_not_fatal(cluster):
    huge = worker_pb2.ReadRequest(path="data/" + "a" * (90 << 20)).SerializeToString()  # over the 80 MiB limit
    assert cluster.call("worker", "ReadBlock", huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    big = master_pb2.GetInfosRequest(paths=["data/a.bin"] * 400_000).SerializeToString()  # over 4 MiB
    assert cluster.call("master", "GetInfos", big) == grpc.StatusCode.RESOURCE_EXHAUSTED
    many = worker_pb2.LoadRequest(paths=["data/a.bin"] * 10_001).SerializeToString()
    assert cluster.call("worker", "Load", many) == grpc.StatusCode.INVALID_ARGUMENT
    # Both still answer.
    assert cluster.call("worker", "GetStatus", b"") == grpc.StatusCode.OK
    assert cluster.call("master", "GetView", b"") == grpc.StatusCode.OK


# ------------------------------------------------------------------------- the worker
@FUZZ
@given(path=PATHS, offset=INT64, length=INT64, version=st.one_of(st.just(""), _text), block=st.booleans())
def test_worker_reads(cluster, path, offset, length, version, block):
    request = worker_pb2.ReadRequest(path=path, offset=offset, length=length, version=version)
    code = cluster.call("worker", "ReadBlock" if block else "Read", request.SerializeToString(), streaming=not block)
    assert code in OK_OR_PRECISE
    if code == grpc.StatusCode.OK:  # only the real objects, in range, at their real version
        assert path.removeprefix("cachefs://").rstrip("/") in ("data/a.bin", "data/dir/b.bin", "data/empty.bin")
        assert offset >= 0 and length >= -1


@FUZZ
@given(path=PATHS, flags=st.tuples(st.booleans(), st.booleans()), method=st.sampled_from(["GetInfo", "List", "Free"]))
def test_worker_metadata_and_free(cluster, path, flags, method):
    if method == "GetInfo":
        request = worker_pb2.InfoRequest(path=path, refresh=flags[0])
    elif method == "List":
        request = worker_pb2.ListRequest(path=path, recursive=flags[0], refresh=flags[1])
    else:
        request = worker_pb2.FreeRequest(prefix=path)
    assert cluster.call("worker", method, request.SerializeToString(), streaming=method == "List") in OK_OR_PRECISE


@FUZZ
@given(paths=st.lists(PATHS, max_size=20), method=st.sampled_from(["Load", "GetCached"]))
def test_worker_jobs(cluster, paths, method):
    request = (worker_pb2.LoadRequest if method == "Load" else worker_pb2.GetCachedRequest)(paths=paths)
    assert cluster.call("worker", method, request.SerializeToString()) in OK_OR_PRECISE


@FUZZ
@given(a=PATHS, b=PATHS, flags=st.tuples(st.booleans(), st.booleans()),
       method=st.sampled_from(["Remove", "MakeDir", "Copy"]))
def test_worker_writes_on_a_read_only_mount(cluster, a, b, flags, method):
    """Write methods (where the worker has them) never change the read-only store."""
    if not hasattr(worker_pb2, "RemoveRequest"):
        pytest.skip("this worker has no write methods")
    if method == "Remove":
        request = worker_pb2.RemoveRequest(path=a, recursive=flags[0])
    elif method == "MakeDir":
        request = worker_pb2.MakeDirRequest(path=a, create_parents=flags[0], exist_ok=flags[1])
    else:
        request = worker_pb2.CopyRequest(source=a, destination=b)
    code = cluster.call("worker", method, request.SerializeToString())
    assert code in OK_OR_PRECISE - {grpc.StatusCode.OK} or code == grpc.StatusCode.OK and method == "MakeDir"


# ------------------------------------------------------------------------- the master
@FUZZ
@given(path=PATHS, paths=st.lists(PATHS, max_size=20), refresh=st.booleans(),
       method=st.sampled_from(["GetInfo", "GetInfos", "List", "Stat"]))
def test_master_metadata(cluster, path, paths, refresh, method):
    if method == "GetInfo":
        request = worker_pb2.InfoRequest(path=path, refresh=refresh)
    elif method == "GetInfos":
        request = master_pb2.GetInfosRequest(paths=paths, refresh=refresh)
    elif method == "List":
        request = worker_pb2.ListRequest(path=path, recursive=refresh)
    else:
        request = master_pb2.StatRequest(path=path, refresh=refresh)
    assert cluster.call("master", method, request.SerializeToString(), streaming=method == "List") in OK_OR_PRECISE


@FUZZ
@given(kind=INT32, path=PATHS, replicas=INT32, job_id=_text, method=st.sampled_from(["SubmitJob", "GetJob", "CancelJob", "ListJobs"]))
def test_master_jobs(cluster, kind, path, replicas, job_id, method):
    if method == "SubmitJob":
        request = master_pb2.SubmitJobRequest(kind=kind, path=path, replicas=replicas)
    elif method == "ListJobs":
        request = master_pb2.ListJobsRequest(active_only=bool(kind & 1))
    else:
        request = master_pb2.GetJobRequest(job_id=job_id)
    assert cluster.call("master", method, request.SerializeToString()) in OK_OR_PRECISE


@FUZZ
@given(worker_id=_text, address=st.one_of(_text, st.builds(lambda h, p: f"{h}:{p}", _text, INT64)),
       name=_mount, url=st.one_of(st.sampled_from(["", "memory://fuzz", "data", "/nonexistent/fuzz"]),
                                  _text.filter(lambda u: "://" not in u and "::" not in u)),
       options=st.one_of(st.just(""), _text, st.sampled_from(["{}", "[]", "1", '{"anon": true}', "{"])),
       token=st.sampled_from([None, "wrong", TOKEN]),
       method=st.sampled_from(["RegisterWorker", "Heartbeat", "AddMount", "RemoveMount", "GetMounts", "GetView"]))
def test_master_membership_and_mounts(cluster, worker_id, address, name, url, options, token, method):
    if name == "data" and method in ("AddMount", "RemoveMount"):
        name = "fuzz-" + name  # keep the mount the other tests read
    if method == "RegisterWorker":
        # A registered fuzz worker would sit in the view; only a token-less one is tried.
        token = None if token == TOKEN else token
        request = master_pb2.RegisterWorkerRequest(worker=master_pb2.WorkerInfo(worker_id=worker_id, address=address))
    elif method == "Heartbeat":
        request = master_pb2.HeartbeatRequest(worker_id=worker_id)
    elif method == "AddMount":
        request = master_pb2.AddMountRequest(name=name, url=url, options_json=options)
    elif method == "RemoveMount":
        request = master_pb2.RemoveMountRequest(name=name)
    elif method == "GetMounts":
        request = master_pb2.GetMountsRequest(with_credentials=bool(options))
    else:
        request = master_pb2.GetViewRequest(known_version=len(url))
    metadata = [(TOKEN_METADATA, token)] if token else None
    assert cluster.call("master", method, request.SerializeToString(), metadata=metadata) in OK_OR_PRECISE


def test_fuzzed_servers_still_serve(cluster):
    """After all of the above: the real object still reads right, from both servers' views."""
    code = cluster.call("worker", "ReadBlock",
                        worker_pb2.ReadRequest(path="data/a.bin", offset=0, length=-1).SerializeToString())
    assert code == grpc.StatusCode.OK
    reply = worker_pb2.ReadChunk.FromString(
        cluster.channels["worker"].unary_unary("/cachefs.v1.WorkerService/ReadBlock")(
            worker_pb2.ReadRequest(path="data/a.bin", offset=0, length=-1).SerializeToString(), timeout=DEADLINE))
    assert reply.data == bytes(range(256)) * 48
    info = common_pb2.ObjectInfo.FromString(cluster.channels["master"].unary_unary("/cachefs.v1.MasterService/GetInfo")(
        worker_pb2.InfoRequest(path="data/a.bin").SerializeToString(), timeout=DEADLINE))
    assert info.size == 256 * 48
    assert sum(TRIED.values()) >= 8 * min(EXAMPLES, 100)


def test_daemon_answers_undecodable_messages_with_invalid_argument(tmp_path):
    worker = Worker(WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(str(tmp_path / "c"), 1 << 20),)))
    worker.start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            call = channel.unary_unary("/cachefs.v1.WorkerService/GetInfo", request_serializer=None,
                                       response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(b"\x0a\xff\xff", timeout=DEADLINE)  # a string field whose length runs off the end
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        worker.stop(grace=0.5)
