"""The masters' etcd client, election and fencing against a real 3-member etcd (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cachefs.config import MasterConfig
from cachefs.errors import ControlPlaneUnavailableError
from cachefs.mounts import MountSpec
from cachefs.server.etcd import api
from cachefs.server.etcd.client import EtcdClient, EtcdSettings, EtcdUnavailableError
from cachefs.server.master.election import Election, NotLeaderError
from cachefs.server.master.etcdstate import EtcdState
from cachefs.server.master.viewversion import ViewVersion
from helpers import refused_port, wait_for

PREFIX = b"/cachefs/test/"


def _client(cluster, timeout: float = 3.0) -> EtcdClient:
    return EtcdClient(EtcdSettings(tuple(cluster.endpoints), timeout=timeout))


def test_private_pool_leaves_the_default_pool_alone():
    """Another etcd client's generated code (kv.proto, etcdserverpb.*) loads beside ours."""
    code = (
        "from google.protobuf import descriptor_pb2, descriptor_pool\n"
        "import cachefs.server.etcd.api as ours\n"
        "f = descriptor_pb2.FileDescriptorProto(name='kv.proto', package='mvccpb', syntax='proto3')\n"
        "f.message_type.add(name='KeyValue')\n"
        "descriptor_pool.Default().Add(f)\n"
        "g = descriptor_pb2.FileDescriptorProto(name='rpc.proto', package='etcdserverpb', syntax='proto3')\n"
        "g.message_type.add(name='RangeRequest')\n"
        "descriptor_pool.Default().Add(g)\n"
        "assert ours.RangeRequest(key=b'k').key == b'k'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_training_processes_and_workers_never_load_the_etcd_client():
    code = ("import sys, cachefs, cachefs.client, cachefs.client.fs.filesystem, cachefs.client.datasets.dataset\n"
            "import cachefs.server.worker.daemon, cachefs.cli, cachefs.admin, cachefs.masters\n"
            "from cachefs.config import load_master_config\n"
            "load_master_config(environ={})\n"
            "bad = sorted(m for m in sys.modules if 'etcd' in m)\n"
            "print(','.join(bad) or 'none')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"


def test_kv_lease_watch_and_one_member_killed(etcd_cluster):
    client = _client(etcd_cluster)
    try:
        seen: list[tuple[int, bytes]] = []
        start = client.put(PREFIX + b"a", b"1").header.revision
        watch = client.watch_prefix(PREFIX, start + 1, lambda rev, evs: seen.extend((e.type, bytes(e.kv.key)) for e in evs),
                                    lambda: 0)
        assert watch.connected.wait(10)
        lease = client.grant(2)
        client.put(PREFIX + b"leased", b"x", lease=lease)
        assert client.keepalive(lease) == 2
        etcd_cluster.kill(0)  # the endpoint the client (and maybe the watch) used first
        t0 = time.monotonic()
        client.put(PREFIX + b"b", b"2")  # through a raft election if the dead member led etcd
        assert time.monotonic() - t0 < 3.0
        assert client.get(PREFIX + b"a").value == b"1"
        # The watch moved to a live member and lost nothing; the unrenewed lease expired.
        assert wait_for(lambda: (api.EVENT_DELETE, PREFIX + b"leased") in seen, timeout=15)
        assert (api.EVENT_PUT, PREFIX + b"b") in seen
        assert client.get(PREFIX + b"leased") is None
        watch.stop()
    finally:
        client.close()


def test_all_of_etcd_down_fails_fast_and_recovers(etcd_cluster):
    client = _client(etcd_cluster, timeout=1.5)
    try:
        client.put(PREFIX + b"k", b"v")
        for i in range(3):
            etcd_cluster.kill(i)
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailableError, match="etcd unreachable") as info:
            client.get(PREFIX + b"k")
        assert time.monotonic() - t0 < 3.0
        assert isinstance(info.value, ControlPlaneUnavailableError)
        for i in range(3):
            etcd_cluster.restart(i)
        assert wait_for(lambda: _answers(client, PREFIX + b"k"), timeout=30)
    finally:
        client.close()


def _answers(client: EtcdClient, key: bytes) -> bool:
    try:
        return client.get(key).value == b"v"
    except (EtcdUnavailableError, OSError):
        return False


def test_etcd_reads_as_unreachable_only_after_failing_for_a_whole_lease():
    """A gap shorter than the lease (the members electing a raft leader after one died) reads as an
    election under way, so admin calls wait for the next leader; a longer one as etcd down, so they
    fail fast (ENOTCONN) instead of waiting for a leader that cannot come."""
    with refused_port() as port:
        client = EtcdClient(EtcdSettings((f"http://127.0.0.1:{port}",), timeout=0.2))
        election = Election(client, PREFIX, "a", "127.0.0.1:1", lease_seconds=2, poll_seconds=0.1).start()
        try:
            started = time.monotonic()
            assert wait_for(lambda: election._failing_since is not None, timeout=5)
            if time.monotonic() - started < 1.5:  # a loaded machine may have taken longer already
                assert election.etcd_reachable()
                assert "election is under way" in election.leader_hint()
            assert wait_for(lambda: not election.etcd_reachable(), timeout=10)
            assert time.monotonic() - started >= election.ttl
            assert "etcd cannot be reached" in election.leader_hint()
        finally:
            election.stop(resign=False)
            client.close()


def test_a_leader_whose_lease_ended_is_fenced_in_etcd(etcd_cluster):
    """As a frozen leader wakes: its term is over locally, and its writes fail in etcd."""
    ca, cb = _client(etcd_cluster), _client(etcd_cluster)
    a = Election(ca, PREFIX, "a", "127.0.0.1:1", lease_seconds=2).start()
    try:
        assert wait_for(a.is_leader, timeout=10)
        epoch_a = a.epoch
        fence_a = a.fence()
        state_a = EtcdState(ca, PREFIX.decode(), "a", ViewVersion(), lambda: fence_a).start()
        state_a.add_mount(MountSpec("one", "file:///tmp"))
        # A stalls (stopped campaigning, as a frozen process), its lease runs out in etcd.
        a._stop.set()
        a._thread.join(5)
        b = Election(cb, PREFIX, "b", "127.0.0.1:2", lease_seconds=2).start()
        try:
            assert wait_for(b.is_leader, timeout=15)
            assert b.epoch > epoch_a
            assert not a.is_leader()  # its deadline passed before etcd could elect b
            with pytest.raises(NotLeaderError):
                a.fence()
            with pytest.raises(ConnectionError):  # the stale compare: not written
                state_a.save_job("j1", 1.0, {"job_id": "j1"})
            assert ca.get(PREFIX + b"jobs/j1") is None
            assert b.leader()["master_id"] == "b"
        finally:
            b.stop()
        state_a.close()
    finally:
        a.stop(resign=False)
        ca.close()
        cb.close()


def test_mutual_tls_to_etcd_and_a_master_on_it(tmp_path):
    """etcd serving TLS and requiring client certificates: the client with its certificate works
    (and a master elects itself and writes a mount); without one it is refused, fast."""
    from cachefs.server.etcd.localcluster import EtcdCluster, etcd_binary
    from cachefs.server.master.daemon import Master
    from tlscerts import make_pki

    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian's etcd-server; .ci/setup installs it as root)")
    pki = make_pki(tmp_path / "pki")
    settings = EtcdSettings(("https://127.0.0.1:1",), ca_file=pki.ca, cert_file=pki.client_cert,
                            key_file=pki.client_key)
    with EtcdCluster(1, base_dir=tmp_path / "etcd", tls=settings, server_cert=(pki.server_cert, pki.server_key)) as etcd:
        good = EtcdClient(EtcdSettings(tuple(etcd.endpoints), ca_file=pki.ca, cert_file=pki.client_cert,
                                       key_file=pki.client_key))
        bad = EtcdClient(EtcdSettings(tuple(etcd.endpoints), ca_file=pki.ca, timeout=1.0))
        try:
            good.put(PREFIX + b"k", b"v")
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailableError):
                bad.get(PREFIX + b"k")
            assert time.monotonic() - t0 < 2.0
        finally:
            good.close()
            bad.close()
        config = MasterConfig(port=0, state_dir=str(tmp_path / "m"), etcd=tuple(etcd.endpoints),
                              etcd_ca_file=pki.ca, etcd_cert_file=pki.client_cert, etcd_key_file=pki.client_key,
                              election_lease_seconds=2, lease_seconds=6, heartbeat_seconds=1)
        master = Master(config).start()
        try:
            assert wait_for(master.control.is_leader, timeout=15) and master.control.serving_epoch() > 0
            master.state.add_mount(MountSpec("tls", "file:///tmp"))
            assert [m.name for m in master.state.mounts()[1]] == ["tls"]
        finally:
            master.stop()


def test_master_config_etcd_settings(tmp_path):
    config = MasterConfig(etcd="http://127.0.0.1:2379, 127.0.0.2:2379", state_dir=str(tmp_path))
    assert config.etcd == ("http://127.0.0.1:2379", "127.0.0.2:2379")
    with pytest.raises(ValueError, match="etcd endpoint"):
        MasterConfig(etcd="nonsense", state_dir=str(tmp_path))
    with pytest.raises(ValueError, match="etcd_ca_file"):
        MasterConfig(etcd="127.0.0.1:2379", etcd_ca_file=str(tmp_path / "missing.pem"), state_dir=str(tmp_path))
    with pytest.raises(ValueError, match="election_lease_seconds"):
        MasterConfig(etcd="127.0.0.1:2379", election_lease_seconds=1, state_dir=str(tmp_path))
    with pytest.raises(ValueError, match="outlast a failover"):
        MasterConfig(etcd="127.0.0.1:2379", election_lease_seconds=8, lease_seconds=10, state_dir=str(tmp_path))
    assert "hunter2" not in repr(MasterConfig(etcd="127.0.0.1:2379", etcd_user="u", etcd_password="hunter2",
                                              state_dir=str(tmp_path)))
