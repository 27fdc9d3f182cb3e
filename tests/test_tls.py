"""TLS on every gRPC port and the access-token check, against real servers.

Certificates are made at test time (tests/tlscerts.py). The cluster tests run a master and a
worker as child processes (cachefs.local), so worker -> master registration, master -> worker
calls (stat) and client -> both all cross process boundaries over TLS.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import grpc
import pytest

from cachefs.cli import main as cli_main
from cachefs.config import ClientConfig, CacheDirSpec, MasterConfig, WorkerConfig, load_worker_config
from cachefs.errors import UnauthenticatedError, WorkerUnavailableError
from cachefs.local import LocalCluster
from cachefs.mounts import MountSpec
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
from cachefs.server.master import Master
from cachefs.server.worker import Worker
from cachefs.tls import TLSConfig, open_channel
from helpers import wait_for
from tlscerts import PKI, make_pki

FAST = ["--heartbeat-seconds", "0.2", "--lease-seconds", "2"]
DATA = {"a.bin": b"alpha" * 1000, "dir/b.bin": b"bravo" * 3000}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for key, value in DATA.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(value)
    return root


def _client(**options) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("cachefs", skip_instance_cache=True, timeout=5, **options)


def _server_tls(pki: PKI, mutual: bool = False) -> TLSConfig:
    return TLSConfig(ca_file=pki.ca, cert_file=pki.server_cert, key_file=pki.server_key, require_client_cert=mutual)


# -- configuration -----------------------------------------------------------------------------

def test_tls_config_checks_files_eagerly(pki: PKI, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    cases = [
        (dict(ca_file=str(tmp_path / "missing.pem")), "does not exist"),
        (dict(ca_file=str(garbage)), "tls_ca_file"),
        (dict(cert_file=pki.server_cert), "set both"),
        (dict(cert_file=pki.server_cert, key_file=pki.client_key), "matching private key"),
        (dict(cert_file=str(garbage), key_file=pki.server_key), "tls_cert_file"),
        (dict(cert_file=pki.server_cert, key_file=pki.server_key, require_client_cert=True), "tls_ca_file"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            TLSConfig(**fields)
    assert TLSConfig(ca_file=pki.ca).enabled and not TLSConfig().enabled
    assert _server_tls(pki, mutual=True).require_client_cert
    with pytest.raises(ValueError, match="serves TLS"):  # a daemon that dials TLS must serve it too
        WorkerConfig(tls_ca_file=pki.ca)
    with pytest.raises(ValueError, match="set both"):
        MasterConfig(tls_cert_file=pki.server_cert)


def test_tls_and_tokens_come_through_the_config_layers(pki: PKI, tmp_path: Path) -> None:
    env = {"CACHEFS_WORKER_TLS_CERT_FILE": pki.server_cert, "CACHEFS_WORKER_TLS_KEY_FILE": pki.server_key,
           "CACHEFS_WORKER_TLS_CA_FILE": pki.ca, "CACHEFS_WORKER_TLS_REQUIRE_CLIENT_CERT": "true",
           "CACHEFS_WORKER_ACCESS_TOKEN": "tok-123456"}
    cfg = load_worker_config(None, environ=env, flags={"cache_dirs": [f"{tmp_path}/c:1GiB"]})
    assert cfg.tls == _server_tls(pki, mutual=True) and cfg.access_token == "tok-123456"
    assert "tok-123456" not in repr(cfg)
    client = ClientConfig.from_options({"workers": "127.0.0.1:1"}, environ={
        "CACHEFS_TOKEN": "tok-abc", "CACHEFS_TLS_CA_FILE": pki.ca})
    assert client.token == "tok-abc" and client.tls == TLSConfig(ca_file=pki.ca) and "tok-abc" not in repr(client)
    client = ClientConfig.from_options({"workers": "127.0.0.1:1", "token": "opt", "tls_ca_file": pki.ca,
                                        "tls_cert_file": pki.client_cert, "tls_key_file": pki.client_key},
                                       environ={"CACHEFS_TOKEN": "env"})
    assert client.token == "opt" and client.tls.cert_file == pki.client_cert  # options over env
    with pytest.raises(ValueError, match="tls_ca_file"):
        ClientConfig.from_options({"workers": "127.0.0.1:1", "tls_ca_file": str(tmp_path / "nope.pem")}, environ={})
    for bad in ("has space", "tab\there", "caf\u00e9"):
        with pytest.raises(ValueError, match="printable ASCII") as info:
            WorkerConfig(access_token=bad)
        assert bad not in str(info.value)
        with pytest.raises(ValueError, match="printable ASCII"):
            ClientConfig.from_options({"workers": "127.0.0.1:1", "token": bad}, environ={})


# -- TLS with real processes ---------------------------------------------------------------------

@pytest.fixture(scope="module", params=["server-only", "mutual"])
def tls_cluster(request: pytest.FixtureRequest, pki: PKI, data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    mutual = request.param == "mutual"
    workdir = tmp_path_factory.mktemp(f"tls-{request.param}")
    with LocalCluster(str(workdir), workers=1, mounts={"data": str(data_dir)}, master_args=FAST,
                      tls=_server_tls(pki, mutual)) as cluster:
        assert cluster.wait_for_workers(timeout=30), "the worker did not register over TLS"
        yield cluster, mutual


def _good_client_options(pki: PKI, mutual: bool) -> dict:
    options = {"tls_ca_file": pki.ca}
    if mutual:
        options.update(tls_cert_file=pki.client_cert, tls_key_file=pki.client_key)
    return options


def test_client_with_the_right_ca_reads_through_master_and_worker(tls_cluster, pki: PKI, capsys) -> None:
    cluster, mutual = tls_cluster
    fs = _client(master=cluster.master_address, **_good_client_options(pki, mutual))
    try:
        assert fs.cat_file("data/a.bin") == DATA["a.bin"]
        assert fs.cat_file("data/dir/b.bin", start=5, end=25) == DATA["dir/b.bin"][5:25]
        assert sorted(fs.find("data")) == ["data/a.bin", "data/dir/b.bin"]
        handle = fs.session.candidates("data/a.bin", 0)[0]
        status = handle.stub().GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        assert status.data_port > 0  # served over TLS
    finally:
        fs.close()
    # The admin command over TLS; `stat` makes the master call the worker (GetCached) over TLS.
    args = ["stat", "--master", cluster.master_address, "--tls-ca-file", pki.ca, "--json", "data/a.bin"]
    if mutual:
        args += ["--tls-cert-file", pki.client_cert, "--tls-key-file", pki.client_key]
    outputs = []

    def cached() -> bool:  # pages are written in the background: the stat may come before them
        assert cli_main(args) == 0
        outputs.append(json.loads(capsys.readouterr().out))
        return outputs[-1]["cached_bytes"] == len(DATA["a.bin"])

    assert wait_for(cached, timeout=15, interval=0.2), outputs[-1]
    assert outputs[-1]["workers"][0]["address"] == cluster.workers[0].address


TRAINING_OVER_TLS = textwrap.dedent('''
    import json, os, sys
    import cachefs, fsspec

    options = json.loads(sys.argv[2])
    # The data port (another host's path) and the master's client port, both over TLS.
    fs = fsspec.filesystem("cachefs", master=sys.argv[1], short_circuit=False, **options)
    out = {"read": fs.cat_file("data/a.bin") == b"alpha" * 1000,
           "find": sorted(fs.find("data")) == ["data/a.bin", "data/dir/b.bin"]}
    fs.pipe_file("data/written-over-tls.bin", b"w" * 300_000)
    out["write"] = fs.cat_file("data/written-over-tls.bin") == b"w" * 300_000
    fs.rm("data/written-over-tls.bin")
    pid = os.fork()
    if pid == 0:  # a DataLoader worker's case: the parent's filesystem, its own sockets
        os._exit(0 if fs.cat_file("data/dir/b.bin") == b"bravo" * 3000 else 1)
    out["child"] = os.waitpid(pid, 0)[1]
    out["data_port_reads"] = fs.session.bulk_stats["data_port"]["reads"] > 0
    out["grpc_loaded"] = "grpc" in sys.modules
    print(json.dumps(out), flush=True)
''')


def test_a_training_process_on_a_tls_cluster_loads_no_grpc(tls_cluster, pki: PKI, tmp_path: Path) -> None:
    """The framed ports speak TLS where the cluster does: the view from the master's client port,
    reads, listings and writes over the worker's data port, a forked child's reads too, and no
    gRPC in the process (before, a TLS cluster opened neither port and the client used gRPC)."""
    cluster, mutual = tls_cluster
    script = tmp_path / "train.py"
    script.write_text(TRAINING_OVER_TLS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_")) and k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), cluster.master_address,
                           json.dumps(_good_client_options(pki, mutual))],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "read": True, "find": True, "write": True, "child": 0, "data_port_reads": True, "grpc_loaded": False}


def test_the_framed_ports_refuse_clients_without_tls_or_the_right_ca(tls_cluster, pki: PKI) -> None:
    """A plaintext frame to a TLS data port or client port is never answered as a request; a
    client trusting another CA fails the handshake."""
    from cachefs.client.transport.dataport import DataPortReader
    from cachefs.proto import common_pb2

    cluster, mutual = tls_cluster
    hello = common_pb2.MetaRequest(op=common_pb2.MetaRequest.HELLO)
    master_host, master_port = cluster.master_address.rsplit(":", 1)
    worker = cluster.workers[0]
    status_port = worker_status(worker.address, pki, mutual).data_port
    for host, port in ((master_host, int(master_port) + 1), ("127.0.0.1", status_port)):
        with pytest.raises(OSError):
            DataPortReader(host, port, timeout=5).meta(hello, timeout=5)
        with pytest.raises(ssl.SSLError):
            DataPortReader(host, port, timeout=5, tls=TLSConfig(ca_file=pki.other_ca)).meta(hello, timeout=5)
        good = TLSConfig(**{k.removeprefix("tls_"): v for k, v in _good_client_options(pki, mutual).items()})
        reader = DataPortReader(host, port, timeout=5, tls=good)
        assert reader.meta(hello, timeout=5).role in ("master", "worker")
        reader.close()
        if mutual:  # no client certificate: the handshake (or the first read) fails
            with pytest.raises(OSError):
                DataPortReader(host, port, timeout=5, tls=TLSConfig(ca_file=pki.ca)).meta(hello, timeout=5)


def worker_status(address: str, pki: PKI, mutual: bool) -> worker_pb2.WorkerStatus:
    tls = TLSConfig(**{k.removeprefix("tls_"): v for k, v in _good_client_options(pki, mutual).items()})
    with open_channel(address, tls) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def _refused(options: dict, address: str) -> OSError:
    fs = _client(workers=address, **options)
    try:
        with pytest.raises(WorkerUnavailableError) as info:
            fs.cat_file("data/a.bin")
    finally:
        fs.close()
    return info.value


def test_plaintext_and_wrong_ca_clients_are_refused_with_a_clear_error(tls_cluster, pki: PKI, capsys) -> None:
    cluster, mutual = tls_cluster
    worker = cluster.workers[0].address
    err = _refused({}, worker)
    assert "no worker could serve it" in str(err) and "may require TLS" in str(err)
    err = _refused({**_good_client_options(pki, mutual), "tls_ca_file": pki.other_ca}, worker)
    assert "CERTIFICATE_VERIFY_FAILED" in str(err) and "not signed by tls_ca_file" in str(err)
    for address in (cluster.master_address, worker):  # both daemons' ports, at the wire
        for tls in (TLSConfig(), TLSConfig(ca_file=pki.other_ca)):
            with open_channel(address, tls) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    master_pb2_grpc.MasterServiceStub(channel).GetView(master_pb2.GetViewRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert cli_main(["status", "--master", cluster.master_address, "--timeout", "5"]) == 3
    assert "may require TLS" in capsys.readouterr().err


@pytest.mark.parametrize("tls_cluster", ["mutual"], indirect=True)
def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(tls_cluster, pki: PKI) -> None:
    cluster, mutual = tls_cluster
    assert mutual
    worker = cluster.workers[0].address
    err = _refused({"tls_ca_file": pki.ca}, worker)  # no client certificate
    assert "client certificate" in str(err)
    err = _refused({"tls_ca_file": pki.ca, "tls_cert_file": pki.other_client_cert,
                    "tls_key_file": pki.other_client_key}, worker)  # one from another CA
    assert "client certificate" in str(err)
    # The master's port refuses such callers too (a would-be worker without a certificate).
    no_cert = TLSConfig(ca_file=pki.ca)
    with open_channel(cluster.master_address, no_cert) as channel:
        with pytest.raises(grpc.RpcError) as info:
            master_pb2_grpc.MasterServiceStub(channel).GetView(master_pb2.GetViewRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# -- tokens ----------------------------------------------------------------------------------------

def _code(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ByteSize"):
            list(result)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_worker_refuses_calls_without_the_access_token(make_worker, data_dir: Path) -> None:
    worker = make_worker(MountSpec("data", str(data_dir)), access_token="right-token")
    with open_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        info = worker_pb2.InfoRequest(path="data/a.bin")
        listing = worker_pb2.ListRequest(path="data", recursive=True)
        for metadata in ((), (("x-cachefs-token", "wrong-token"),), (("x-cachefs-token", ""),)):
            assert _code(lambda: stub.GetInfo(info, timeout=5, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: stub.List(listing, timeout=5, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5,
                                                metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
        good = (("x-cachefs-token", "right-token"),)
        assert stub.GetInfo(info, timeout=5, metadata=good).size == len(DATA["a.bin"])
        assert _code(lambda: stub.List(listing, timeout=5, metadata=good)) == grpc.StatusCode.OK
    # The client: without the token a clear PermissionError, with it the bytes.
    fs = _client(workers=worker.address)
    with pytest.raises(UnauthenticatedError, match="access token") as refused:
        fs.cat_file("data/a.bin")
    assert isinstance(refused.value, PermissionError)
    fs.close()
    fs = _client(workers=worker.address, token="right-token")
    assert fs.cat_file("data/a.bin") == DATA["a.bin"]
    fs.close()


def test_open_status_leaves_only_get_status_open(make_worker, data_dir: Path) -> None:
    worker = make_worker(MountSpec("data", str(data_dir)), access_token="t", open_status=True)
    with open_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        assert stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).worker_id == worker.worker_id
        assert _code(lambda: stub.GetInfo(worker_pb2.InfoRequest(path="data/a.bin"), timeout=5)) \
            == grpc.StatusCode.UNAUTHENTICATED


def test_master_refuses_calls_without_the_access_token_and_workers_still_join(tmp_path: Path, data_dir: Path) -> None:
    config = MasterConfig(port=0, state_dir=str(tmp_path / "state"), access_token="acc", cluster_token="clu",
                          heartbeat_seconds=0.2, lease_seconds=2, mounts=(MountSpec("data", str(data_dir)),))
    with Master(config) as master, open_channel(master.address) as channel:
        stub = master_pb2_grpc.MasterServiceStub(channel)
        view = master_pb2.GetViewRequest()
        for metadata in ((), (("x-cachefs-token", "wrong"),)):
            assert _code(lambda: stub.GetView(view, timeout=5, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: stub.WatchView(view, timeout=1, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: stub.GetMounts(master_pb2.GetMountsRequest(), timeout=5, metadata=metadata)) \
                == grpc.StatusCode.UNAUTHENTICATED
        access, cluster = (("x-cachefs-token", "acc"),), (("x-cachefs-token", "clu"),)
        assert stub.GetView(view, timeout=5, metadata=access).master_id == master.master_id
        assert stub.GetView(view, timeout=5, metadata=cluster).master_id == master.master_id
        # The access token reads; changing the cluster or taking credentials still needs the cluster token.
        add = master_pb2.AddMountRequest(name="x", url=str(data_dir))
        assert _code(lambda: stub.AddMount(add, timeout=5, metadata=access)) == grpc.StatusCode.UNAUTHENTICATED
        creds = master_pb2.GetMountsRequest(with_credentials=True)
        assert _code(lambda: stub.GetMounts(creds, timeout=5, metadata=access)) == grpc.StatusCode.UNAUTHENTICATED
        # A worker with the cluster token registers (and the master's calls to it carry the token).
        worker_config = WorkerConfig(port=0, cache_dirs=(CacheDirSpec(str(tmp_path / "cache"), 1 << 30),),
                                     master=master.address, access_token="acc", cluster_token="clu")
        with Worker(worker_config) as worker:
            assert worker.registrar is not None and worker.registrar.registered.wait(10)
            stub_for_worker = master.worker_stubs(worker.address)
            assert stub_for_worker.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).worker_id == worker.worker_id
            fs = _client(master=master.address, token="acc")
            try:
                assert fs.cat_file("data/a.bin") == DATA["a.bin"]
            finally:
                fs.close()


def test_master_open_status_serves_the_view_only(tmp_path: Path) -> None:
    config = MasterConfig(port=0, state_dir=str(tmp_path / "state"), access_token="acc", open_status=True)
    with Master(config) as master, open_channel(master.address) as channel:
        stub = master_pb2_grpc.MasterServiceStub(channel)
        assert stub.GetView(master_pb2.GetViewRequest(), timeout=5).master_id == master.master_id
        assert _code(lambda: stub.GetMounts(master_pb2.GetMountsRequest(), timeout=5)) \
            == grpc.StatusCode.UNAUTHENTICATED


def test_documented_tls_example_loads(pki: PKI, tmp_path: Path) -> None:
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    for name, path in (("daemon.pem", pki.server_cert), ("daemon.key", pki.server_key), ("ca.pem", pki.ca)):
        example = example.replace(f"/etc/cachefs/tls/{name}", path)
    config_file = tmp_path / "worker.toml"
    config_file.write_text(example + f'cache_dirs = ["{tmp_path}/c:1GiB"]\n')
    assert load_worker_config(str(config_file), environ={}).tls == _server_tls(pki, mutual=True)
