"""#47: a load streams its listing and a master killed -9 mid-load resumes after its cursor.

A real master and 3 workers as processes over cachefs.testing's synthetic store (registered in
the children by a ``sitecustomize`` on their PYTHONPATH); the store appends each listing request
to a trace file with the asking process's pid, so the test sees what the restarted master listed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import grpc

from cachefs.local import LocalCluster
from cachefs.proto import master_pb2, master_pb2_grpc
from cachefs.server.master.state import MasterState
from helpers import wait_for

FAST = ["--lease-seconds", "1.5", "--heartbeat-seconds", "0.3"]
COUNT = 30_000  # objects of 64 bytes, 1,000 a directory: 30 listing pages


def _job(stub, job_id: str) -> master_pb2.Job | None:
    try:
        return stub.GetJob(master_pb2.GetJobRequest(job_id=job_id), timeout=5)
    except grpc.RpcError:
        return None  # a restarting master


def _listings(trace: Path, pid: int) -> list[str]:
    """The ``after`` of every paged listing request process ``pid`` sent to the store."""
    found = []
    for line in trace.read_text().splitlines():
        who, kind, after = (line.split(" ", 2) + ["", ""])[:3]
        if who == str(pid) and kind == "list_after":
            found.append(after)
    return found


def test_a_master_killed_mid_load_resumes_after_its_cursor(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import cachefs.testing  # registers synthetic://\n")
    trace = tmp_path / "trace.log"
    trace.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))  # the children's only
    mounts = {"data": {"url": "synthetic://data",
                       "options": {"count": COUNT, "per_dir": 1000, "size": 64, "trace": str(trace)}}}
    cluster = LocalCluster(str(tmp_path / "c"), workers=3, mounts=mounts, master_args=FAST, env=env)
    cluster.start()
    try:
        assert cluster.wait_for_workers()
        channel = grpc.insecure_channel(cluster.master_address)
        stub = master_pb2_grpc.MasterServiceStub(channel)
        job_id = stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data"), timeout=5).job_id
        first_pid = cluster.master.pid
        # Kill -9 once a sixth is done and the record has been saved since (about once a
        # second): the saved cursor is then past a page or more, the job far from its end. (The
        # test does not read the state while the master runs: with the test polling its SQLite
        # file every few ms, the master stopped answering at times; cause not found.)
        assert wait_for(lambda: (_job(stub, job_id) or master_pb2.Job()).objects_done >= COUNT // 6, timeout=60,
                        interval=0.005)
        time.sleep(1.5)
        cluster.master.kill()
        state = MasterState(tmp_path / "c" / "master")
        try:
            record = {r["job_id"]: r for r in state.jobs()}[job_id]
        finally:
            state.close()
        assert record["state"] == "RUNNING" and record["cursor"], record
        assert len(json.dumps(record)) < 600  # a few hundred bytes, whatever the load's size
        cursor = record["cursor"][len("data/"):]  # the store's name for it (below the mount's root)
        done = record["committed"]["objects_done"]
        assert done >= 1000 and record["planned_workers"] == 3
        before = _listings(trace, first_pid)
        assert before[0] == "" and len(before) < COUNT // 1000 + 1  # it streamed: not all listed at once

        cluster.master = cluster.start_master()
        assert wait_for(lambda: (_job(stub, job_id) or master_pb2.Job()).state == master_pb2.SUCCEEDED,
                        timeout=90), _job(stub, job_id)
        job = _job(stub, job_id)
        assert job.objects_done == job.objects_total == COUNT and not job.objects_failed and not job.listing
        after = _listings(trace, cluster.master.pid)
        # The restarted master listed only what comes after the cursor: one request per page left.
        assert after and after[0] == cursor and all(a >= cursor for a in after), (cursor, after)
        assert len(after) == -(-(COUNT - done) // 1000)
        channel.close()
    finally:
        cluster.stop()


def test_the_cursor_is_kept_in_etcd_and_the_next_leader_lists_after_it(etcd_cluster, tmp_path):
    """Several masters: the load's record (cursor, committed figures) lives in etcd; the next
    leader resumes from it and lists only what comes after the cursor."""
    import threading

    from cachefs.mounts import MountSpec
    from cachefs.server.etcd.client import EtcdClient, EtcdSettings
    from cachefs.server.master.catalog import Catalog
    from cachefs.server.master.election import Election
    from cachefs.server.master.etcdstate import EtcdState
    from cachefs.server.master.jobs import JobManager, JobSettings
    from cachefs.server.master.viewversion import ViewVersion
    from test_jobs import ADDRESSES, MEMBERS, PAGED, RING, FakeWorker, _record_listings

    store = tmp_path / "store"
    (store / "d").mkdir(parents=True)
    for i in range(40):
        (store / "d" / f"o{i:02d}.bin").write_bytes(bytes([i]) * (1000 + 37 * i))
    prefix = "/cachefs/loadtest/"

    def term(name: str):
        client = EtcdClient(EtcdSettings(tuple(etcd_cluster.endpoints), timeout=3.0))
        election = Election(client, prefix.encode(), name, f"127.0.0.1:{len(name)}", lease_seconds=2).start()
        assert wait_for(election.is_leader, timeout=15)
        fence = election.fence()
        state = EtcdState(client, prefix, name, ViewVersion(), lambda: fence).start()
        return election, state

    def manager(election, state, workers):
        catalog = Catalog(state, metadata_ttl=30, list_ttl=30)
        return catalog, JobManager(state, catalog, lambda: MEMBERS, workers.__getitem__, lambda: RING,
                                   JobSettings(load=PAGED, persist_seconds=0.05, settle_seconds=0.05,
                                               settle_max_seconds=2),
                                   epoch=election.epoch, leading=election.is_leader)

    sem = threading.Semaphore(0)

    class Gated(FakeWorker):
        def Load(self, request, timeout=None):
            sem.acquire(timeout=10)
            return super().Load(request, timeout)

    a, state_a = term("a")
    state_a.add_mount(MountSpec("data", str(store)))
    sizes = {f"data/d/o{i:02d}.bin": 1000 + 37 * i for i in range(40)}
    _, jobs_a = manager(a, state_a, {addr: Gated(addr, sizes) for addr in ADDRESSES})
    job_id = jobs_a.submit(master_pb2.LOAD, "data/d").job_id
    for _ in range(8):
        sem.release()

    def stored(state) -> dict:
        return {r["job_id"]: r for r in state.jobs()}[job_id]

    assert wait_for(lambda: stored(state_a)["cursor"] != "", timeout=10)
    jobs_a.stop(timeout=0.5)
    for _ in range(100):
        sem.release()
    record = stored(state_a)
    assert record["state"] == "RUNNING" and record["committed"]["objects_done"] >= 8
    cursor = record["cursor"]
    state_a.close()
    a.stop(resign=True)

    b, state_b = term("b")
    try:
        workers_b = {addr: FakeWorker(addr, sizes) for addr in ADDRESSES}
        catalog_b, jobs_b = manager(b, state_b, workers_b)
        asked = _record_listings(jobs_b)  # the listing pages the new leader asks for
        assert jobs_b.start() == [job_id]
        assert wait_for(lambda: jobs_b.get(job_id).state == master_pb2.SUCCEEDED, timeout=20), jobs_b.get(job_id)
        job = jobs_b.get(job_id)
        assert (job.objects_done, job.objects_total) == (40, 40)
        assert asked and asked[0] == cursor and all(x >= cursor for x in asked)
        again = [p for w in workers_b.values() for p in w.loaded_paths()]
        assert sorted(again) == sorted(p for p in sizes if p > cursor)
        jobs_b.stop(timeout=1)
    finally:
        state_b.close()
        b.stop()
