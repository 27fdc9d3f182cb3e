"""A real cluster: master and workers as processes (cachefs.local.LocalCluster)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from cachefs.local import LocalCluster, master_process
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
from cachefs.ring import HashRing, RingConfig
from helpers import client, payload, wait_for

FAST = ["--lease-seconds", "1.5", "--heartbeat-seconds", "0.3"]


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
def dataset(local_store):
    for i in range(30):
        local_store.add(f"d/o{i:02d}.bin", payload(20_000 + 97 * i, i))
    return local_store


def test_reads_spread_over_workers_as_placement_says(dataset, tmp_path):
    with LocalCluster(str(tmp_path / "c"), workers=3, mounts={"data": dataset.mount.url},
                      master_args=FAST) as cluster:
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
    with LocalCluster(str(tmp_path / "c"), workers=3, mounts={"data": dataset.mount.url},
                      master_args=FAST) as cluster:
        assert cluster.wait_for_workers()
        fs = client(master=cluster.master_address, timeout=5)
        keys = sorted(dataset.objects)
        for key in keys:
            assert fs.cat_file(f"data/{key}") == dataset.objects[key]
        victim = cluster.workers[0]
        victim_keys = [k for k in keys if fs._workers.ring.node(f"data/{k}") == victim.address]
        assert victim_keys
        errors: list[BaseException] = []
        reads = [0]
        stop = threading.Event()

        def loop(seed: int) -> None:
            i = seed
            while not stop.is_set():
                key = keys[i % len(keys)]
                i += 7
                try:
                    if fs.cat_file(f"data/{key}", 3, 15_000) != dataset.objects[key][3:15_000]:
                        errors.append(AssertionError(f"wrong bytes for {key}"))
                    reads[0] += 1
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

        threads = [threading.Thread(target=loop, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        victim.kill()  # kill -9 under load
        # It leaves the master's view after its lease, and the client's view follows.
        assert wait_for(lambda: _live(cluster.master_address) == 2, timeout=15)
        assert wait_for(lambda: victim.address not in fs._workers.addresses, timeout=15)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors[:3]
        assert reads[0] > 20, reads[0]
        # Restarted on its cache dir, it rejoins and serves its old pages without the store.
        cluster.workers[0] = restarted = cluster.start_worker(0)
        assert wait_for(lambda: _live(cluster.master_address) == 3, timeout=15)
        assert wait_for(lambda: restarted.address in fs._workers.addresses, timeout=15)
        for key in victim_keys:
            if fs._workers.ring.node(f"data/{key}") == restarted.address:
                assert fs.cat_file(f"data/{key}") == dataset.objects[key]
        status = _status(restarted.address)
        assert status.hits > 0 and status.bytes_from_store == 0


def _free_port() -> int:
    # The master must come back on the same address for this test; ask the kernel for a free one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_master_down_and_restarted(dataset, tmp_path):
    port = _free_port()
    state = str(tmp_path / "master")
    args = [*FAST, "--mount", f"data={dataset.mount.url}"]
    master = master_process(state, args, log_path=str(tmp_path / "m1.log"))
    master.args[master.args.index("--port") + 1] = str(port)
    master.start()
    cluster = LocalCluster(str(tmp_path / "c"), workers=2, master_args=FAST)
    cluster.master = master
    try:
        cluster.workers = [cluster.start_worker(i) for i in range(2)]
        assert cluster.wait_for_workers()
        fs = client(master=master.address, timeout=5)
        for key, data in dataset.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        master.kill()
        # Clients and workers keep working from their last view.
        for key, data in dataset.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        dataset.add("d/new.bin", b"added while the master was down")
        assert fs.cat_file("data/d/new.bin") == b"added while the master was down"
        # The master comes back on the same address: mounts are durable, workers re-register.
        master2 = master_process(state, FAST, log_path=str(tmp_path / "m2.log"))
        master2.args[master2.args.index("--port") + 1] = str(port)
        cluster.master = master2.start()
        assert master2.ready.get("master_id") == master.ready.get("master_id")
        assert cluster.wait_for_workers()
        assert [m.name for m in _view(master2.address).mounts] == ["data"]
        for key, data in dataset.objects.items():
            assert fs.cat_file(f"data/{key}") == data
    finally:
        cluster.stop()
        master.kill()
