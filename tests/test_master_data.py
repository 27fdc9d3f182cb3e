"""The master's data RPCs over gRPC (in process): GetInfo, List, Stat, jobs, their status codes."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cachefs.config import MasterConfig
from cachefs.mounts import MountSpec
from cachefs.proto import common_pb2, master_pb2, master_pb2_grpc, worker_pb2
from cachefs.server.master import Master
from cachefs.auth import TOKEN_METADATA
from cachefs.server.master.service import LIST_BATCH
from helpers import scrape, wait_for


@pytest.fixture
def master(tmp_path, local_store) -> Iterator[tuple[Master, master_pb2_grpc.MasterServiceStub]]:
    for i in range(LIST_BATCH + 5):
        local_store.add(f"many/{i:05d}", b"x")
    local_store.add("d/a.bin", b"a" * 100)
    local_store.add("d/sub/b.bin", b"b" * 50)
    config = MasterConfig(port=0, metrics_port=0, state_dir=str(tmp_path / "state"), shutdown_grace=0.5,
                          mounts=(MountSpec("data", local_store.mount.url),), cluster_token="tok",
                          list_ttl=60)
    m = Master(config).start()
    channel = grpc.insecure_channel(m.address)
    yield m, master_pb2_grpc.MasterServiceStub(channel)
    channel.close()
    m.stop()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _ls(stub, path: str, **kw) -> list[common_pb2.ObjectInfo]:
    return [e for batch in stub.List(worker_pb2.ListRequest(path=path, **kw), timeout=10) for e in batch.entries]


def test_info_and_listing_through_the_master_cache(master, local_store):
    m, stub = master
    info = stub.GetInfo(worker_pb2.InfoRequest(path="data/d/a.bin"), timeout=5)
    assert info.size == 100 and info.type == common_pb2.FILE and info.version
    assert [(e.path, e.type) for e in _ls(stub, "data/d")] == [("data/d/a.bin", common_pb2.FILE),
                                                               ("data/d/sub", common_pb2.DIRECTORY)]
    assert [e.path for e in _ls(stub, "cachefs://data/d", recursive=True)] == ["data/d/a.bin", "data/d/sub/b.bin"]
    batches = list(stub.List(worker_pb2.ListRequest(path="data/many"), timeout=10))
    assert [len(b.entries) for b in batches] == [LIST_BATCH, 5]
    # Within the TTL the listing comes from the cache; refresh asks the store.
    local_store.delete("d/a.bin")
    assert [e.path for e in _ls(stub, "data/d")] == ["data/d/a.bin", "data/d/sub"]
    assert [e.path for e in _ls(stub, "data/d", refresh=True)] == ["data/d/sub"]
    assert _code(lambda: stub.GetInfo(worker_pb2.InfoRequest(path="data/d/a.bin", refresh=True), timeout=5)) \
        == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: stub.GetInfo(worker_pb2.InfoRequest(path="nope/x"), timeout=5)) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: _ls(stub, "data/../etc")) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _ls(stub, "data/missing")) == grpc.StatusCode.NOT_FOUND


def test_stat_without_workers_counts_nothing_cached(master):
    _, stub = master
    resp = stub.Stat(master_pb2.StatRequest(path="data/d"), timeout=5)
    assert (resp.objects, resp.total_bytes, resp.cached_bytes) == (2, 150, 0)
    assert resp.info.type == common_pb2.DIRECTORY and not resp.workers and not resp.truncated
    one = stub.Stat(master_pb2.StatRequest(path="data/d/a.bin"), timeout=5)
    assert one.objects == 1 and one.info.version


def test_jobs_need_the_token_and_valid_requests(master):
    m, stub = master
    md = [(TOKEN_METADATA, "tok")]
    submit = lambda **kw: stub.SubmitJob(master_pb2.SubmitJobRequest(**kw), timeout=5, metadata=md)  # noqa: E731
    assert _code(lambda: stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/d"),
                                        timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: submit(kind=master_pb2.LOAD, path="data/d", replicas=17)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: submit(kind=master_pb2.LOAD, path="nope/d")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: submit(path="data/d")) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: stub.GetJob(master_pb2.GetJobRequest(job_id="abc"), timeout=5)) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: stub.GetJob(master_pb2.GetJobRequest(job_id="../x"), timeout=5)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    job = submit(kind=master_pb2.LOAD, path="data/d", replicas=2)
    assert job.state in (master_pb2.PENDING, master_pb2.RUNNING, master_pb2.FAILED) and job.replicas == 2
    assert wait_for(lambda: stub.GetJob(master_pb2.GetJobRequest(job_id=job.job_id), timeout=5).state
                    == master_pb2.FAILED)
    failed = stub.GetJob(master_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
    assert "no live workers" in failed.error
    assert [j.job_id for j in stub.ListJobs(master_pb2.ListJobsRequest(), timeout=5).jobs] == [job.job_id]
    assert not stub.ListJobs(master_pb2.ListJobsRequest(active_only=True), timeout=5).jobs
    metrics = scrape(m.metrics_port)
    assert metrics['cachefs_master_jobs{kind="LOAD",state="FAILED"}'] == 1


def test_get_infos_answers_many_paths_in_one_call(tmp_path):
    import grpc

    from cachefs.config import MasterConfig
    from cachefs.mounts import MountSpec
    from cachefs.proto import master_pb2, master_pb2_grpc
    from cachefs.server.master import Master

    store = tmp_path / "store"
    store.mkdir()
    for i in range(50):
        (store / f"o{i}.bin").write_bytes(b"x" * i)
    config = MasterConfig(port=0, state_dir=str(tmp_path / "state"), mounts=(MountSpec("data", str(store)),))
    with Master(config) as master, grpc.insecure_channel(master.address) as channel:
        stub = master_pb2_grpc.MasterServiceStub(channel)
        paths = [f"data/o{i}.bin" for i in range(50)] + ["data/missing.bin", "data/../x", "nomount/x"]
        resp = stub.GetInfos(master_pb2.GetInfosRequest(paths=paths), timeout=10)
        assert [r.info.size for r in resp.results[:50]] == list(range(50))
        assert all(not r.error for r in resp.results[:50])
        errors = [r.error for r in resp.results[50:]]
        assert errors[0].startswith("not found") and errors[1].startswith("invalid") and errors[2].startswith("not found")
        assert not any(r.HasField("info") for r in resp.results[50:])
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfos(master_pb2.GetInfosRequest(paths=["data/o1.bin"] * 10_001), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
