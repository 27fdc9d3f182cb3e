"""A real cluster: master and workers as processes (cachefs.local.LocalCluster)."""

from __future__ import annotations

import grpc
import pytest

from cachefs.local import LocalCluster
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
from cachefs.ring import HashRing, RingConfig
from helpers import ReadLoop as _ReadLoop, client, payload, scrape, wait_for

FAST = ["--lease-seconds", "3", "--heartbeat-seconds", "0.5"]  # short, with room for a loaded CI machine


def _view(master: str) -> master_pb2.ClusterView:
    with grpc.insecure_channel(master) as channel:
        return master_pb2_grpc.MasterServiceStub(channel).GetView(master_pb2.GetViewRequest(), timeout=5)


def _live(master: str) -> int:
    """Live workers in the master's view (-1 if it did not answer: a loaded machine, not a failure)."""
    try:
        return len(_view(master).workers)
    except grpc.RpcError:
        return -1


def _status(address: str) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)


@pytest.fixture
def dataset(store):
    """30 objects in a local directory, and (second run) in moto S3."""
    for i in range(30):
        store.add(f"d/o{i:02d}.bin", payload(20_000 + 97 * i, i))
    return store


def _mounts(store) -> dict:
    return {"data": {"url": store.mount.url, "options": dict(store.mount.options)}}


def test_reads_spread_over_workers_as_placement_says(dataset, tmp_path):
    with LocalCluster(str(tmp_path / "c"), workers=3, mounts=_mounts(dataset), master_args=FAST) as cluster:
        assert cluster.wait_for_workers()
        fs = client(master=cluster.master_address)
        assert sorted(fs.find("data/d")) == sorted(f"data/{k}" for k in dataset.objects)
        for key, data in dataset.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        view = _view(cluster.master_address)
        ring = HashRing([w.address for w in view.workers], RingConfig(view.ring.vnodes, view.ring.stripe_size))
        expected = {w.address: 0 for w in view.workers}
        for key, data in dataset.objects.items():
            expected[ring.node(f"data/{key}")] += len(data)
        fetched = {w.address: _status(w.address).bytes_from_store for w in cluster.workers}
        assert fetched == expected
        assert sum(1 for v in fetched.values() if v) == 3


def test_worker_killed_during_reads_then_rejoins(dataset, tmp_path):
    with LocalCluster(str(tmp_path / "c"), workers=3, mounts=_mounts(dataset), master_args=FAST) as cluster:
        assert cluster.wait_for_workers()
        fs = client(master=cluster.master_address, timeout=5)
        keys = sorted(dataset.objects)
        for key in keys:
            assert fs.cat_file(f"data/{key}") == dataset.objects[key]
        victim = cluster.workers[0]
        victim_keys = [k for k in keys if fs.session.workers.ring.node(f"data/{k}") == victim.address]
        assert victim_keys
        with _ReadLoop(fs, dataset.objects) as loop:
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
            # its pages' index rows (written behind, within ~0.1 s) are committed: the kill loses none
            assert wait_for(lambda: scrape(victim.ready["metrics_port"])["cachefs_worker_cache_index_pending"] == 0)
            victim.kill()  # kill -9 under load
            # It leaves the master's view after its lease, and the client's view follows.
            assert wait_for(lambda: _live(cluster.master_address) == 2, timeout=15)
            assert wait_for(lambda: victim.address not in fs.session.workers.addresses, timeout=15)
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])  # and reads go on with two
        assert not loop.errors, loop.errors[:3]
        assert loop.reads > 20, loop.reads
        # Restarted on its cache dir and address (so the ring gives it the same keys), it
        # rejoins and serves its old pages without the store.
        cluster.workers[0] = restarted = cluster.start_worker(0, port=int(victim.address.rpartition(":")[2]))
        assert restarted.address == victim.address
        assert wait_for(lambda: _live(cluster.master_address) == 3, timeout=15)
        assert wait_for(lambda: restarted.address in fs.session.workers.addresses, timeout=15)
        for key in victim_keys:
            if fs.session.workers.ring.node(f"data/{key}") == restarted.address:
                assert fs.cat_file(f"data/{key}") == dataset.objects[key]
        # This client may still read its pages through what the dead worker handed out (held
        # descriptors, its name index: the same files, trusted until its heartbeat is 5 s old), so
        # a new one that takes every page from the worker itself checks what it serves.
        fresh = client(master=cluster.master_address, timeout=5, short_circuit=False)
        for key in victim_keys:
            if fresh.session.workers.ring.node(f"data/{key}") == restarted.address:
                assert fresh.cat_file(f"data/{key}") == dataset.objects[key]
        status = _status(restarted.address)
        assert status.hits > 0 and status.bytes_from_store == 0


def test_master_killed_and_restarted_during_reads(dataset, tmp_path):
    # The master binds port 0 and reports its port; start_master() brings it back on that port.
    cluster = LocalCluster(str(tmp_path / "c"), workers=2, mounts=_mounts(dataset), master_args=FAST)
    cluster.start()
    try:
        assert cluster.wait_for_workers()
        first_id = cluster.master.ready.get("master_id")
        fs = client(master=cluster.master_address, timeout=5)
        for key, data in dataset.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        with _ReadLoop(fs, dataset.objects) as loop:
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
            cluster.master.kill()  # kill -9: clients and workers keep working from their last view
            down_at = loop.reads
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
            reads_while_down = loop.reads - down_at
            dataset.add("d/new.bin", b"added while the master was down")
            assert fs.cat_file("data/d/new.bin") == b"added while the master was down"
            cluster.master = cluster.start_master()
            assert cluster.wait_for_workers()
            back_at = loop.reads
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
        assert not loop.errors, loop.errors[:3]
        assert loop.reads > back_at and reads_while_down >= 8
        # Same identity, durable mounts; the workers came back by re-registering.
        assert cluster.master.ready.get("master_id") == first_id
        assert [m.name for m in _view(cluster.master_address).mounts] == ["data"]
        for key, data in dataset.objects.items():
            assert fs.cat_file(f"data/{key}") == data
    finally:
        cluster.stop()
