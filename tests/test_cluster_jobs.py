"""Jobs, stat and ls on a real cluster: a master and 3 workers as processes, the CLI as a subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest

from cachefs.local import LocalCluster
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
from cachefs.ring import HashRing, RingConfig
from helpers import client, payload, wait_for

FAST = ["--lease-seconds", "1.5", "--heartbeat-seconds", "0.3"]
MANY = 3000  # tiny objects: a load of them takes long enough to cancel or interrupt


def _cachefs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _mounts(store) -> dict:
    return {"data": {"url": store.mount.url, "options": dict(store.mount.options)}}


def _master(address: str) -> tuple[grpc.Channel, master_pb2_grpc.MasterServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, master_pb2_grpc.MasterServiceStub(channel)


def _ring(stub) -> HashRing:
    view = stub.GetView(master_pb2.GetViewRequest(), timeout=5)
    return HashRing([w.address for w in view.workers], RingConfig(view.ring.vnodes, view.ring.stripe_size))


def _worker_call(address: str, method: str, request):
    with grpc.insecure_channel(address) as channel:
        return getattr(worker_pb2_grpc.WorkerServiceStub(channel), method)(request, timeout=10)


def _from_store(cluster) -> dict[str, int]:
    return {w.address: _worker_call(w.address, "GetStatus", worker_pb2.GetStatusRequest()).bytes_from_store
            for w in cluster.workers}


def _cached_on(address: str, paths: list[str]) -> dict[str, int]:
    resp = _worker_call(address, "GetCached", worker_pb2.GetCachedRequest(paths=paths))
    return dict(zip(paths, resp.cached_bytes))


def _job(stub, job_id: str) -> master_pb2.Job:
    return stub.GetJob(master_pb2.GetJobRequest(job_id=job_id), timeout=5)


def _finished(stub, job_id: str) -> bool:
    try:
        return _job(stub, job_id).state not in (master_pb2.PENDING, master_pb2.RUNNING)
    except grpc.RpcError:
        return False  # a restarting master


@pytest.fixture
def dataset(local_store):
    for i in range(40):
        local_store.add(f"d/o{i:02d}.bin", payload(20_000 + 311 * i, i))
    return local_store


def test_ls_load_stat_free_and_replicas_through_the_cli(dataset, tmp_path):
    for i in range(MANY):
        dataset.put(f"many/{i:05d}", b"m" * 1024)
    with LocalCluster(str(tmp_path / "c"), workers=3, mounts=_mounts(dataset), master_args=FAST) as cluster:
        assert cluster.wait_for_workers()
        m = ["--master", cluster.master_address]
        channel, stub = _master(cluster.master_address)
        ring = _ring(stub)
        d = {f"data/{k}": v for k, v in dataset.objects.items()}

        # ls through the master; a second ls within the TTL comes from its cache.
        listed = json.loads(_cachefs("ls", *m, "data/d", "--json").stdout)
        assert [e["path"] for e in listed] == sorted(d) and {e["size"] for e in listed} == {len(v) for v in d.values()}
        dataset.delete("d/o39.bin")
        del d["data/d/o39.bin"]
        assert "data/d/o39.bin" in _cachefs("ls", *m, "data/d").stdout
        refreshed = _cachefs("ls", *m, "data/d", "--refresh")
        assert refreshed.returncode == 0 and "data/d/o39.bin" not in refreshed.stdout
        missing = _cachefs("ls", *m, "data/nope")
        assert missing.returncode == 1 and "data/nope" in missing.stderr

        before = json.loads(_cachefs("stat", *m, "data/d", "--json").stdout)
        assert before["objects"] == 39 and before["cached_fraction"] == 0 and before["total_bytes"] == sum(
            len(v) for v in d.values())

        # load, then every read is served from the cache of the worker placement picks.
        loaded = _cachefs("load", *m, "data/d", "--json")
        assert loaded.returncode == 0, loaded.stderr
        job = json.loads(loaded.stdout)
        assert job["state"] == "SUCCEEDED" and job["objects_done"] == 39 and job["bytes_done"] == before["total_bytes"]
        stat = json.loads(_cachefs("stat", *m, "data/d", "--json").stdout)
        assert stat["cached_fraction"] == 1.0
        expected = {}
        for path, data in d.items():
            expected[ring.node(path)] = expected.get(ring.node(path), 0) + len(data)
        assert {w["address"]: w["cached_bytes"] for w in stat["workers"]} == expected
        text = _cachefs("stat", *m, "data/d/o01.bin").stdout
        assert "100.0%" in text and ring.node("data/d/o01.bin") in text
        fs = client(master=cluster.master_address)
        store_bytes = _from_store(cluster)
        for path, data in d.items():
            assert fs.cat_file(path) == data
        assert _from_store(cluster) == store_bytes  # not one byte from the store

        # free empties it: stat says 0%, and the next read goes to the store again.
        freed = _cachefs("free", *m, "data/d/")
        assert freed.returncode == 0, freed.stderr
        assert json.loads(_cachefs("stat", *m, "data/d", "--json").stdout)["cached_bytes"] == 0
        for path, data in d.items():
            assert fs.cat_file(path) == data
        after = _from_store(cluster)
        assert sum(after.values()) - sum(store_bytes.values()) == before["total_bytes"]

        # --replicas 2: each object on its first two ring workers.
        two = _cachefs("load", *m, "data/d", "--replicas", "2")
        assert two.returncode == 0, two.stderr
        assert "SUCCEEDED" in two.stdout and "%" in two.stderr  # progress lines on stderr (not a TTY)
        for address in {w.address for w in cluster.workers}:
            mine = [p for p in d if address in ring.nodes(p, 2)]
            assert _cached_on(address, mine) == {p: len(d[p]) for p in mine}
        assert _cachefs("load", *m, "data/d", "--replicas", "17").returncode == 1
        assert _cachefs("load", *m, "nomount/d").returncode == 1

        # Cancel once it is planned and dispatching: it stops and ends CANCELLED, part done.
        job_id = stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/many"), timeout=5).job_id
        assert wait_for(lambda: _job(stub, job_id).objects_total == MANY, timeout=10, interval=0.005)
        stub.CancelJob(master_pb2.GetJobRequest(job_id=job_id), timeout=5)
        assert wait_for(lambda: _finished(stub, job_id), timeout=10)
        cancelled = _job(stub, job_id)
        assert cancelled.state == master_pb2.CANCELLED and cancelled.objects_done < cancelled.objects_total
        listing = _cachefs("jobs", *m, "--json")
        assert {j["job_id"]: j["state"] for j in json.loads(listing.stdout)}[job_id] == "CANCELLED"

        # Ctrl-C while `cachefs load` waits: the job is cancelled and the command exits 130.
        free_many = _cachefs("free", *m, "data/many/")
        assert free_many.returncode == 0, free_many.stderr
        proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "load", *m, "data/many"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert wait_for(lambda: any(j.state == master_pb2.RUNNING for j in stub.ListJobs(
                master_pb2.ListJobsRequest(active_only=True), timeout=5).jobs), timeout=20)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        latest = stub.ListJobs(master_pb2.ListJobsRequest(), timeout=5).jobs[0]
        if proc.returncode == 0:  # it finished before the signal arrived: nothing to cancel
            assert latest.state == master_pb2.SUCCEEDED
        else:
            assert proc.returncode == 130, err
            assert "cancelled job" in err
            assert wait_for(lambda: _finished(stub, latest.job_id), timeout=10)
            assert _job(stub, latest.job_id).state == master_pb2.CANCELLED
        channel.close()


def _job_state_on_disk(state_dir, job_id: str) -> str:
    from cachefs.server.master.state import MasterState

    state = MasterState(state_dir)
    try:
        return {r["job_id"]: r["state"] for r in state.jobs()}[job_id]
    finally:
        state.close()


def test_master_restart_during_a_load_resumes_it(local_store, tmp_path):
    for i in range(MANY):
        local_store.add(f"many/{i:05d}", payload(1024, i))
    # The master binds port 0; start_master() restarts it on the port it reported.
    cluster = LocalCluster(str(tmp_path / "c"), workers=3, mounts=_mounts(local_store), master_args=FAST)
    cluster.start()
    try:
        assert cluster.wait_for_workers()
        channel, stub = _master(cluster.master_address)
        job_id = stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/many"), timeout=5).job_id
        assert wait_for(lambda: _job(stub, job_id).objects_done > 0, timeout=20, interval=0.005)
        cluster.master.kill()  # kill -9 mid-job
        assert _job_state_on_disk(tmp_path / "c" / "master", job_id) == "RUNNING"
        cluster.master = cluster.start_master()
        assert wait_for(lambda: _finished(stub, job_id), timeout=40)
        job = _job(stub, job_id)
        assert job.state == master_pb2.SUCCEEDED, job.error
        assert job.objects_done == job.objects_total == MANY
        # Stat counts what the workers placed for each object hold: with all three back in the view.
        assert cluster.wait_for_workers()
        stat = stub.Stat(master_pb2.StatRequest(path="data/many"), timeout=30)
        assert stat.cached_bytes == stat.total_bytes == MANY * 1024
        channel.close()
    finally:
        cluster.stop()


def test_load_stat_free_over_s3(s3_store, tmp_path):
    for i in range(12):
        s3_store.add(f"s/o{i:02d}.bin", payload(30_000 + i, i))
    with LocalCluster(str(tmp_path / "c"), workers=3, mounts=_mounts(s3_store), master_args=FAST) as cluster:
        assert cluster.wait_for_workers()
        m = ["--master", cluster.master_address]
        loaded = _cachefs("load", *m, "data/s", "--replicas", "2", "--json")
        assert loaded.returncode == 0, loaded.stderr
        assert json.loads(loaded.stdout)["objects_done"] == 12
        assert json.loads(_cachefs("stat", *m, "data/s", "--json").stdout)["cached_fraction"] == 1.0
        fs = client(master=cluster.master_address)
        store_bytes = _from_store(cluster)
        for key, data in s3_store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        assert _from_store(cluster) == store_bytes
        assert _cachefs("free", *m, "data/s").returncode == 0
        assert json.loads(_cachefs("stat", *m, "data/s", "--json").stdout)["cached_fraction"] == 0
