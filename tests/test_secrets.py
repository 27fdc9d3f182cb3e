"""Secret hygiene with real processes: object-store credentials and tokens never leave the
master and the workers (no RPC response, log line, metric or status page holds them), and
cache files and the master's state are private to the daemon's user.

The cluster mounts moto S3 with canary credentials (moto takes any), then reads, lists,
loads, fails in every way a user can make it fail, and every answer, the daemons' stderr
and every HTTP page they serve are searched for the canaries.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import fsspec
import grpc
import pytest

from cachefs.cli import main as cli_main
from cachefs.local import LocalCluster
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
from cachefs.tls import open_channel

FAST = ["--heartbeat-seconds", "0.2", "--lease-seconds", "2", "--metrics-port", "0"]


def _canaries() -> dict[str, str]:
    tag = uuid.uuid4().hex
    return {
        "key": f"AKIACANARY{tag[:10].upper()}",
        "secret": f"canary-secret-{tag}",
        "access_token": f"canary-access-{tag[:12]}",
        "cluster_token": f"canary-cluster-{tag[12:24]}",
        "added_secret": f"canary-added-{tag[:16]}",
    }


def _http(port: int, path: str) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:  # a page the daemon does not serve: its body still counts
        return err.read().decode("utf-8", "replace")


def _error_text(call) -> str:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ByteSize"):
            return "".join(str(m) for m in result)
        return str(result)
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    except OSError as err:
        return f"{type(err).__name__}: {err}"


@pytest.mark.s3
def test_credentials_and_tokens_never_leave_the_daemons(moto_server, tmp_path: Path, capsys, dead_port) -> None:
    canary = _canaries()
    bucket = moto_server.new_bucket()
    s3 = moto_server.client()
    objects = {f"train/{i:03d}.bin": os.urandom(3000 + i) for i in range(12)}
    for key, data in objects.items():
        s3.put_object(Bucket=bucket, Key=f"root/{key}", Body=data)
    secret_options = {"key": canary["key"], "secret": canary["secret"], "endpoint_url": moto_server.endpoint_url,
                      "client_kwargs": {"region_name": "us-east-1"}}
    mounts = {
        "s3data": {"url": f"s3://{bucket}/root", "options": secret_options},
        # A bucket that does not exist: every read, listing and load of it fails at the store.
        "gone": {"url": f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", "options": secret_options},
        # A store that refuses connections: store errors, logged by the daemons with their messages.
        "down": {"url": f"s3://{bucket}/root", "options": {
            **secret_options, "endpoint_url": f"http://127.0.0.1:{dead_port}",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}},
    }
    seen: list[str] = []  # every answer, page and output a caller can get
    access = (("x-cachefs-token", canary["access_token"]),)
    workdir = tmp_path / "cluster"
    with LocalCluster(str(workdir), workers=2, mounts=mounts, master_args=FAST, access_token=canary["access_token"],
                      cluster_token=canary["cluster_token"]) as cluster:
        assert cluster.wait_for_workers(timeout=30)
        master = cluster.master_address
        fs = fsspec.filesystem("cachefs", master=master, token=canary["access_token"], skip_instance_cache=True,
                               timeout=20)
        try:
            for key, data in objects.items():  # cold, then warm
                assert fs.cat_file(f"s3data/{key}") == data
                assert fs.cat_file(f"s3data/{key}", start=10, end=100) == data[10:100]
            seen.append(json.dumps(sorted(fs.find("s3data")), default=str))
            seen.append(json.dumps(fs.ls("", detail=True), default=str))
            for bad in ("gone/x.bin", "down/train/000.bin", "s3data/missing.bin", "nomount/x",
                        "s3data/../etc/passwd", "s3data/train"):
                seen.append(_error_text(lambda: fs.cat_file(bad)))
                seen.append(_error_text(lambda: fs.info(bad)))
            seen.append(_error_text(lambda: fs.ls("gone")))
        finally:
            fs.close()

        # Admin commands: a mount added at run time with secrets in its options, loads (one that
        # fails at the store), listings, stat, status, the mount table.
        admin = ["--master", master, "--cluster-token", canary["cluster_token"]]
        reader = ["--master", master, "--token", canary["access_token"]]
        assert cli_main(["mount", *admin, "more", f"s3://{bucket}/root/train", "-o",
                         f"secret={canary['added_secret']}", "-o", f"key={canary['key']}",
                         "-o", f"endpoint_url={moto_server.endpoint_url}", "--read-only"]) == 0
        assert cli_main(["load", *admin, "s3data/train", "-q", "--json"]) == 0
        cli_main(["load", *admin, "gone/", "-q", "--json"])  # fails: the bucket does not exist
        cli_main(["load", *admin, "down/train", "-q", "--json"])  # fails: the store refuses connections
        for command in (["status", "--json"], ["mounts", "--json"], ["ls", "-r", "s3data"], ["ls", "gone"],
                        ["stat", "--json", "s3data/train"], ["jobs"], ["stat", "more"]):
            cli_main([command[0], *reader, *command[1:]])
        out = capsys.readouterr()
        seen += [out.out, out.err]
        assert "mounted more" in out.out and "(read-only)" in out.out and '"read_only": true' in out.out

        # The gRPC answers themselves, on every port.
        with open_channel(master) as channel:
            stub = master_pb2_grpc.MasterServiceStub(channel)
            seen.append(_error_text(lambda: stub.GetView(master_pb2.GetViewRequest(), timeout=10, metadata=access)))
            seen.append(_error_text(lambda: stub.GetMounts(master_pb2.GetMountsRequest(), timeout=10,
                                                           metadata=access)))
            creds = master_pb2.GetMountsRequest(with_credentials=True)
            refused = _error_text(lambda: stub.GetMounts(creds, timeout=10, metadata=access))
            assert refused.startswith("UNAUTHENTICATED")
            seen.append(refused)
            seen.append(_error_text(lambda: stub.ListJobs(master_pb2.ListJobsRequest(), timeout=10, metadata=access)))
            seen.append(_error_text(lambda: stub.AddMount(master_pb2.AddMountRequest(
                name="bad", url="s3://x/y", options_json=json.dumps({"secret": canary["secret"]}) + "}"),
                timeout=10, metadata=((("x-cachefs-token", canary["cluster_token"]),)))))
        for worker in cluster.workers:
            with open_channel(worker.address) as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                seen.append(_error_text(lambda: stub.ListMounts(worker_pb2.ListMountsRequest(), timeout=10,
                                                                metadata=access)))
                seen.append(_error_text(lambda: stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10,
                                                               metadata=access)))
                seen.append(_error_text(lambda: stub.GetInfo(worker_pb2.InfoRequest(path="gone/a"), timeout=30,
                                                             metadata=access)))
                seen.append(_error_text(lambda: stub.ListMounts(worker_pb2.ListMountsRequest(), timeout=10)))

        # Every HTTP page the daemons serve: /metrics, and whatever status pages they have.
        pages = []
        for daemon in (cluster.master, *cluster.workers):
            port = daemon.ready["metrics_port"]
            for path in ("/metrics", "/", "/status", "/healthz", "/readyz"):
                pages.append(_http(port, path))
        assert any("cachefs_worker" in p for p in pages) and any("cachefs_master" in p for p in pages)
        seen += pages

        # Cache files and the master's state are private to the daemon's user.
        _assert_private(workdir / "master", what="master state")
        caches = [workdir / f"worker-{i}" / "cache" for i in range(len(cluster.workers))]
        assert any(any(cache.rglob("pages/*/*")) for cache in caches), "the reads cached no page"
        for cache in caches:
            _assert_private(cache, what="cache dir")
    logs = {name: (workdir / name).read_text(errors="replace")
            for name in ("master.log", "worker-0.log", "worker-1.log")}
    # The logs saw the run (so their silence about secrets means something).
    assert "serving on" in logs["master.log"] and "job" in logs["master.log"]
    assert all("registered with master" in logs[f"worker-{i}.log"] for i in range(2))
    assert "down" in logs["master.log"]  # the failed load of the unreachable store, with its reason
    seen_text = "\n".join(seen)
    assert "no-such-bucket" in seen_text or "NoSuchBucket" in seen_text or "gone" in seen_text
    assert "endpoint_url" in seen_text  # public options are shown: what is searched is real output
    for name, value in canary.items():
        assert value not in seen_text, f"{name} leaked into an answer, a page or a command's output"
        for log_name, text in logs.items():
            assert value not in text, f"{name} leaked into {log_name}"


def _assert_private(root: Path, what: str) -> None:
    """Every directory 0700 and every regular file 0600 below (and including) ``root``.

    (Sockets, e.g. the short-circuit socket, are the server's business: they sit in a 0700 dir.)
    """
    checked = 0
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        mode = stat.S_IMODE(st.st_mode)
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            continue
        want = 0o700 if path.is_dir() else 0o600
        assert mode == want, f"{what}: {path} has mode {mode:o}, want {want:o}"
        checked += 1
    assert checked > 3


def test_secret_looking_options_are_redacted_at_any_depth() -> None:
    from cachefs.mounts import MountSpec, redact

    options = {"endpoint_url": "http://s3.local", "key": "AK", "secret": "SK", "anon": False,
               "connection_string": "DefaultEndpointsProtocol=https;AccountKey=XYZ", "passphrase": "pp",
               "client_kwargs": {"region_name": "r", "aws_session_token": "ST", "aws_secret_access_key": "SK2"}}
    assert redact(options) == {"endpoint_url": "http://s3.local", "anon": False, "client_kwargs": {"region_name": "r"}}
    spec = MountSpec("m", "s3://b/p", options)
    for text in (repr(spec), json.dumps(spec.public())):
        for secret in ("AK", "SK", "SK2", "ST", "XYZ", "pp"):
            assert f'"{secret}"' not in text and f"'{secret}'" not in text and "AccountKey" not in text


def test_an_old_index_is_made_private_when_opened(tmp_path: Path) -> None:
    from cachefs.server.pagestore import CacheDir, PageStore

    root = tmp_path / "cache"
    PageStore([CacheDir(str(root), 1 << 30)], 1 << 20).close()
    index = root / "index"
    os.chmod(index, 0o755)  # as an earlier version left it
    for db in index.glob("cache.db*"):
        os.chmod(db, 0o644)
    PageStore([CacheDir(str(root), 1 << 30)], 1 << 20).close()
    _assert_private(root, what="cache dir")
