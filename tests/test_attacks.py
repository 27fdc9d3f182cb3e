"""Attacks as an attacker would run them, against real daemons started as the README starts them
(a LocalCluster: what `cachefs local` runs), through the `cachefs` command and a `cachefs://`
client, each asserting the precise error the attacker gets (issue #48, secure by default).

Host-local attacks on the worker's sockets and shared tables live in their own file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from cachefs.errors import InvalidPathError
from cachefs.local import LocalCluster
from cachefs.mounts import MountSpec, MountTable, redact
from cachefs.paths import parse_path
from cachefs.store.objects import ObjectStore
from helpers import client, local_master, wait_for

SECRET_LINE = b"this is outside the mount"


def _cachefs(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """An allowed data dir (with symlinks planted by someone who can write in it), and a secret
    dir outside it that the attacker wants."""
    base = tmp_path_factory.mktemp("attacks")
    data, outside = base / "data", base / "outside"
    data.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET_LINE)
    (data / "ok.txt").write_bytes(b"ok")
    (data / "sub").mkdir()
    (data / "sub" / "inner.txt").write_bytes(b"inner")
    (data / "passwd").symlink_to("/etc/passwd")
    (data / "etc").symlink_to("/etc")
    (data / "out").symlink_to(outside)
    (data / "rel").symlink_to("../outside/secret.txt")
    return {"base": base, "data": data, "outside": outside}


@pytest.fixture(scope="module")
def cluster(tree) -> LocalCluster:
    """Defaults, no token: what `cachefs local --mount data=DIR` starts."""
    with LocalCluster(str(tree["base"] / "cluster"), workers=1, mounts={"data": str(tree["data"])},
                      master_args=["--metrics-port", "0"]) as c:
        assert c.wait_for_workers()
        yield c


def _refused(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    return out.stderr.strip()


# --------------------------------------------------------------------------- mount policy

def test_mounting_etc_is_refused(cluster):
    out = _cachefs("mount", "evil", "/etc", "--master", cluster.master_address)
    assert _refused(out) == (
        "cachefs: permission denied: mount 'evil': local path /etc is not under allowed_local_roots "
        "(master setting allowed_local_roots, CACHEFS_MASTER_ALLOWED_LOCAL_ROOTS; now: "
        f"{os.path.realpath(cluster.mounts['data'])})")
    fs = client(master=cluster.master_address)
    with pytest.raises(FileNotFoundError, match="no mount named 'evil'"):
        fs.cat_file("cachefs://evil/passwd")


def test_file_url_to_etc_is_refused(cluster):
    out = _cachefs("mount", "evil", "file:///etc", "--master", cluster.master_address)
    assert "mount 'evil': local path /etc is not under allowed_local_roots" in _refused(out)


def test_a_symlink_in_an_allowed_dir_is_not_a_way_out(cluster, tree):
    out = _cachefs("mount", "evil", str(tree["data"] / "etc"), "--master", cluster.master_address)
    assert f"local path {tree['data'] / 'etc'} (really /etc) is not under allowed_local_roots" in _refused(out)
    # A sub-directory of the allowed dir is fine.
    ok = _cachefs("mount", "sub", str(tree["data"] / "sub"), "--master", cluster.master_address)
    assert ok.returncode == 0, ok.stderr


def test_instance_metadata_url_is_refused(cluster):
    out = _cachefs("mount", "imds", "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
                   "--master", cluster.master_address)
    assert _refused(out) == (
        "cachefs: permission denied: mount 'imds': URL scheme 'http' is not allowed (master setting "
        "allowed_schemes, CACHEFS_MASTER_ALLOWED_SCHEMES; now: s3, s3a, gs, gcs, az, abfs)")


@pytest.mark.parametrize("url", ["https://example.com/x", "memory://x", "simplecache::file:///etc",
                                 "zip://passwd::file:///etc/x.zip", "local:///etc"])
def test_other_schemes_and_chains_are_refused(cluster, url):
    out = _cachefs("mount", "other", url, "--master", cluster.master_address)
    why = _refused(out)
    assert any(text in why for text in ("is not allowed (master setting allowed_schemes",
                                        "is not under allowed_local_roots (master setting allowed_local_roots",
                                        "no filesystem for protocol 'simplecache::file'",  # chains: none
                                        "no filesystem for protocol 'zip'")), why


def test_an_s3_mount_with_a_metadata_endpoint_is_refused(cluster):
    out = _cachefs("mount", "imds", "s3://latest/meta-data", "-o", "endpoint_url=http://169.254.169.254",
                   "--master", cluster.master_address)
    assert _refused(out) == ("cachefs: permission denied: mount 'imds': an endpoint at 169.254.169.254 "
                             "(link-local, an instance metadata service) is never allowed")


def test_a_mount_refused_now_is_not_served_from_the_state(tmp_path, tree):
    """A mount of /etc added before the policy (in the durable state) is kept but not served."""
    from cachefs.server.master.state import MasterState

    state = MasterState(tmp_path / "c" / "master")
    state.add_mount(MountSpec("evil", "/etc"))
    state.close()
    with LocalCluster(str(tmp_path / "c"), workers=1, mounts={"data": str(tree["data"])}) as c:
        assert c.wait_for_workers()
        fs = client(master=c.master_address)
        assert fs.cat_file("data/ok.txt") == b"ok"
        with pytest.raises(FileNotFoundError, match="no mount named 'evil'"):
            fs.cat_file("evil/passwd")
        listed = _cachefs("mounts", "--master", c.master_address, "--json")
        assert [m["name"] for m in json.loads(listed.stdout)] == ["data"]
        assert "not serving evil: mount 'evil': local path /etc is not under allowed_local_roots" in \
            Path(c.workdir, "master.log").read_text()


def test_cachefs_local_allows_its_mount_dirs_and_the_roots_it_is_given(tmp_path, tree):
    """`cachefs local` as the README runs it: its --mount dir and --allowed-local-root dirs may be
    mounted at run time, /etc may not."""
    extra = tmp_path / "extra"
    (extra / "sub").mkdir(parents=True)
    (extra / "sub" / "x.txt").write_bytes(b"extra")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "1", "--dir",
                             str(tmp_path / "c"), "--mount", f"data={tree['data']}", "--allowed-local-root",
                             str(extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        master = local_master(proc)
        m = ["--master", master]
        assert _cachefs("mount", "extra", str(extra / "sub"), *m).returncode == 0
        assert _cachefs("mount", "below", str(tree["data"] / "sub"), *m).returncode == 0
        refused = _refused(_cachefs("mount", "evil", "/etc", *m))
        assert refused.endswith(f"now: {extra}, {tree['data']})"), refused
        assert wait_for(lambda: client(master=master).exists("extra/x.txt"))
        assert client(master=master).cat_file("extra/x.txt") == b"extra"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_the_operators_own_mounts_are_allowed_whatever_their_scheme(tmp_path, tree):
    """Mounts the master is started with (cachefs local --mount, the config's mounts) are the
    operator's: served whatever their scheme; the same scheme at run time is still refused."""
    with LocalCluster(str(tmp_path / "c"), workers=1,
                      mounts={"data": str(tree["data"]), "mem": "memory://bucket"}) as c:
        m = ["--master", c.master_address]
        listed = _cachefs("mounts", *m, "--json")
        assert sorted(r["name"] for r in json.loads(listed.stdout)) == ["data", "mem"], listed.stderr
        assert "URL scheme 'memory' is not allowed" in _refused(_cachefs("mount", "mem2", "memory://bucket", *m))
        # Below a configured local mount is allowed; beside it is not.
        assert _cachefs("mount", "below", str(tree["data"] / "sub"), *m).returncode == 0
        assert "not under allowed_local_roots" in _refused(_cachefs("mount", "beside", str(tree["outside"]), *m))


def test_a_refused_mount_written_to_etcd_is_not_served(tmp_path, tree, etcd_cluster):
    """Several masters on etcd: a mount of /etc written there (by an older master, or by hand) is
    not served by the leader or a standby, which see it through their watch."""
    from cachefs.config import MasterConfig
    from cachefs.server.master import Master

    config = MasterConfig(port=0, state_dir=str(tmp_path / "m"), etcd=tuple(etcd_cluster.endpoints),
                          election_lease_seconds=2, lease_seconds=6, heartbeat_seconds=1,
                          mounts=(MountSpec("data", str(tree["data"])),))
    master = Master(config).start()
    try:
        assert wait_for(master.control.is_leader, timeout=15)
        assert wait_for(lambda: [m.name for m in master.state.mounts()[1]] == ["data"], timeout=10)
        master.state.add_mount(MountSpec("evil", "/etc"))  # straight into etcd, past AddMount
        assert wait_for(lambda: len(master.state.mounts()[1]) == 2, timeout=10)
        assert [m.name for m in master.servicer.build_view().mounts] == ["data"]
        assert [m.name for m in master.served.mounts()[1]] == ["data"]
    finally:
        master.stop()


# --------------------------------------------------------------------- no symlink is followed

@pytest.mark.parametrize("key", ["passwd", "etc/passwd", "out/secret.txt", "rel"])
def test_symlinks_inside_a_mount_are_not_followed(cluster, key):
    fs = client(master=cluster.master_address)
    with pytest.raises(InvalidPathError, match="symbolic link"):
        fs.cat_file(f"data/{key}")
    assert fs.cat_file("data/ok.txt") == b"ok"


def test_listing_through_a_symlink_is_refused(cluster):
    fs = client(master=cluster.master_address)
    with pytest.raises(InvalidPathError, match="symbolic link"):
        fs.ls("data/etc", refresh=True)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("data", detail=False, refresh=True))
    assert "ok.txt" in names and "sub" in names  # the links are listed as what they are, not followed
    info = {e["name"].rsplit("/", 1)[1]: e for e in fs.ls("data", detail=True, refresh=True)}
    assert info["etc"]["type"] != "directory" and info["passwd"]["size"] < 100  # the link's own size


def test_writes_through_a_symlink_are_refused(cluster, tree):
    fs = client(master=cluster.master_address)
    with pytest.raises(OSError, match="symbolic link"):
        fs.pipe_file("data/out/planted.txt", b"pwned")
    assert not (tree["outside"] / "planted.txt").exists()
    fs.pipe_file("data/sub/new.txt", b"fine")
    assert (tree["data"] / "sub" / "new.txt").read_bytes() == b"fine"


@pytest.fixture(params=["openat2", "walk"])
def opener(request, monkeypatch):
    """Both ways beneath.py opens: openat2 (Linux 5.6+) and the O_NOFOLLOW walk (without it)."""
    from cachefs.store import beneath

    if request.param == "openat2" and not beneath.uses_openat2():
        pytest.skip("no openat2 here")
    if request.param == "walk":
        monkeypatch.setattr(beneath, "_openat2", None)
    return request.param


def test_a_mounted_directory_swapped_for_a_symlink_is_not_followed(cluster, tree):
    """The mount's root itself replaced by a link to outside after the master allowed it: the
    workers' next opens fail, they never read outside."""
    swapdir = tree["data"] / "swapdir"
    swapdir.mkdir()
    (swapdir / "ok.txt").write_bytes(b"ok")
    out = _cachefs("mount", "swapme", str(swapdir), "--master", cluster.master_address)
    assert out.returncode == 0, out.stderr
    fs = client(master=cluster.master_address)
    assert wait_for(lambda: fs.exists("swapme/ok.txt"))
    swapdir.rename(tree["data"] / "swapdir.real")
    swapdir.symlink_to(tree["outside"])
    with pytest.raises(InvalidPathError, match="symbolic link"):
        fs.cat_file("swapme/secret.txt")


def test_a_worker_refuses_a_master_mount_whose_path_now_has_a_link(tmp_path):
    """A worker (re)starting after the swap: the master handed out a realpath, which now leads
    elsewhere: not mounted (MountTable.add(exact_root=True))."""
    real, outside = tmp_path / "real", tmp_path / "outside"
    real.mkdir()
    outside.mkdir()
    table = MountTable()
    table.add(MountSpec("m", str(real)), exact_root=True)
    real.rename(tmp_path / "moved")
    real.symlink_to(outside)
    with pytest.raises(InvalidPathError, match=f"its local path {real} now leads to {outside}"):
        table.add(MountSpec("m", str(real)), exact_root=True)
    table.add(MountSpec("own", str(real)))  # a worker's own configured mount: by its realpath, as before


def test_every_local_store_operation_refuses_symlinks(tmp_path, opener):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "f").write_bytes(b"inside")
    (outside / "secret.txt").write_bytes(SECRET_LINE)
    (root / "out").symlink_to(outside)
    (root / "d" / "link").symlink_to(outside / "secret.txt")
    store = ObjectStore(MountTable([MountSpec("data", str(root))]), metadata_ttl=0, list_ttl=0)
    p = parse_path
    for key in ("out/secret.txt", "d/link"):
        with pytest.raises(InvalidPathError, match="symbolic link"):
            store.info(p(f"data/{key}"), refresh=True)
    with pytest.raises(InvalidPathError, match="symbolic link"):
        store.list(p("data/out"), refresh=True)
    listed = {m.path.key: m for m in store.list(p("data"), recursive=True, refresh=True)}
    assert set(listed) == {"d/f", "d/link", "out"} and not listed["out"].is_dir  # links as themselves
    with pytest.raises(InvalidPathError, match="symbolic link"):
        store.open_write(p("data/out/planted"))
    with pytest.raises(InvalidPathError, match="symbolic link"):
        store.make_dir(p("data/out/newdir"))
    with pytest.raises(InvalidPathError, match="symbolic link"):
        store.remove(p("data/out/secret.txt"))
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    # What is inside works: write (a link in the target's place is replaced, not written through),
    # mkdir, copy, remove.
    writer = store.open_write(p("data/d/link"))
    writer.write(b"replaced")
    writer.commit()
    assert (root / "d" / "link").read_bytes() == b"replaced" and not (root / "d" / "link").is_symlink()
    assert (outside / "secret.txt").read_bytes() == SECRET_LINE
    store.make_dir(p("data/e/f"))
    store.copy(p("data/d/f"), p("data/e/f/g"))
    assert (root / "e" / "f" / "g").read_bytes() == b"inside"
    store.remove(p("data/e"), recursive=True)
    assert not (root / "e").exists()


def test_a_directory_swapped_for_a_symlink_mid_read_never_leaks(tmp_path, opener):
    """The race: a directory replaced by a symlink to outside between a check and an open."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "f").write_bytes(b"inside!")
    (outside / "f").write_bytes(SECRET_LINE)
    (root / "evil").symlink_to(outside)
    store = ObjectStore(MountTable([MountSpec("data", str(root))]), metadata_ttl=0, list_ttl=0)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.rename(root / "d", root / "d.real")
            os.rename(root / "evil", root / "d")
            os.rename(root / "d", root / "evil")
            os.rename(root / "d.real", root / "d")

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: set[bytes] = set()
    errors = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                meta = store.info(parse_path("data/d/f"), refresh=True)
                seen.add(store.read(meta, 0, meta.size))
                seen.update(m.path.key.encode() for m in store.list(parse_path("data/d"), refresh=True))
            except (OSError, ValueError):
                errors += 1
    finally:
        stop.set()
        swapper.join()
    assert SECRET_LINE not in seen and seen <= {b"inside!", b"d/f"}, seen
    assert b"inside!" in seen


# ------------------------------------------------------------------------------ redaction

CANARIES = ("CANARYKEY", "CANARYSECRET", "CANARYPROXYPASS", "CANARYURLPASS", "CANARYLIST", "CANARYTUPLE",
            "CANARYBEARER", "CANARYINURL")


def _canary_options() -> dict:
    return {
        "key": "CANARYKEY", "secret": "CANARYSECRET",
        "endpoint_url": "http://canaryuser:CANARYURLPASS@127.0.0.1:9",
        "config_kwargs": {"proxies": {"https": "http://proxyuser:CANARYPROXYPASS@127.0.0.1:3128"}},
        "client_kwargs": {"headers": [["Authorization", "Bearer CANARYBEARER"]]},
        "extra_credentials": ["CANARYLIST"],
        "fallbacks": [{"api_key": "CANARYLIST"}],
    }


def test_redaction_covers_lists_userinfo_and_proxies():
    shown = redact({**_canary_options(), "pairs": (("password", "CANARYTUPLE"),)})
    text = json.dumps(shown)
    assert not any(c in text for c in CANARIES), text
    assert shown["endpoint_url"] == "http://***@127.0.0.1:9"
    assert shown["config_kwargs"]["proxies"] == "***"
    assert MountSpec("m", "s3://user:CANARYURLPASS@bucket/p").public()["url"] == "s3://***@bucket/p"
    assert redact({"url": "https://a.blob.core.windows.net/c?sv=2022&sig=CANARYSIG&sp=r"}) == \
        {"url": "https://a.blob.core.windows.net/c?sv=2022&sig=***&sp=r"}


def test_no_canary_in_any_answer_page_log_or_command(cluster):
    m = ["--master", cluster.master_address]
    out = _cachefs("mount", "canary", "s3://bucket/p", "--options-json", json.dumps(_canary_options()), *m)
    assert out.returncode == 0, out.stderr
    seen = [out.stdout, out.stderr]
    # Credentials in the URL itself: refused, without echoing them.
    inurl = _cachefs("mount", "canary2", "s3://AKIDX:CANARYINURL@bucket/p", *m)
    assert _refused(inurl) == ("cachefs: permission denied: mount 'canary2': credentials in the URL (user info): "
                               "put them in the mount's options, which are never shown")
    seen.append(inurl.stdout + inurl.stderr)
    from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
    from cachefs.tls import PLAINTEXT, open_channel

    with open_channel(cluster.master_address, PLAINTEXT) as channel:
        stub = master_pb2_grpc.MasterServiceStub(channel)
        seen.append(str(stub.GetView(master_pb2.GetViewRequest(), timeout=10)))
        seen.append(str(stub.GetMounts(master_pb2.GetMountsRequest(), timeout=10)))
    worker = cluster.workers[0].address
    with open_channel(worker, PLAINTEXT) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        assert wait_for(lambda: "canary" in str(stub.ListMounts(worker_pb2.ListMountsRequest(), timeout=10)))
        seen.append(str(stub.ListMounts(worker_pb2.ListMountsRequest(), timeout=10)))
    fs = client(master=cluster.master_address)
    with pytest.raises(OSError) as failed:
        fs.cat_file("canary/x")
    seen.append(str(failed.value))
    with pytest.raises(FileNotFoundError):
        fs.cat_file("canary2/x")
    for command in (["mounts", *m], ["mounts", *m, "--json"], ["status", *m], ["status", *m, "--json"]):
        seen.append(_cachefs(*command).stdout)
    port = cluster.master.ready["metrics_port"]
    for page in ("/status", "/metrics", "/status?format=json"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{page}", timeout=10) as resp:
            seen.append(resp.read().decode())
    worker_metrics = cluster.workers[0].ready.get("metrics_port")
    if worker_metrics:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker_metrics}/metrics", timeout=10) as resp:
            seen.append(resp.read().decode())
    time.sleep(0.5)  # log lines of the failed read
    for log in Path(cluster.workdir).glob("*.log"):
        seen.append(log.read_text())
    text = "\n".join(seen)
    assert "canary" in text  # the mount itself is shown
    leaked = {c: [part[max(0, part.index(c) - 150):part.index(c) + 50] for part in seen if c in part]
              for c in CANARIES if c in text}
    assert not leaked, leaked


# --------------------------------------------------------------------------- S3 region

@pytest.mark.parametrize("region", ["us-east-1", "us-gov-west-1", "cn-north-1", "eu-central-2", "ap-southeast-4",
                                    "us-isob-east-1", "il-central-1"])
def test_real_region_names_are_accepted(region):
    from cachefs.store.s3http import check_region

    assert check_region(region) == region


@pytest.mark.parametrize("region", ["evil.com", "us-east-1.evil.com", "us-east-1\r\nX-Injected: 1", "127.0.0.1:9",
                                    "us-east-1/", "US-EAST-1", "", "a" * 200, "us-east-1@evil"])
def test_a_region_from_a_reply_that_is_not_a_region_name_is_refused(region):
    from cachefs.store.s3http import check_region

    with pytest.raises(ValueError, match="x-amz-bucket-region .*, which is not an AWS region name"):
        check_region(region)


def test_a_store_answering_with_a_bad_region_is_not_followed():
    """A store (or a man in the middle of plain HTTP) answers 301 with a region that would put
    another host in the Host header: the read fails with the precise error, nothing is sent."""
    import http.server

    requests: list[str] = []

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            requests.append(self.headers.get("Host", ""))
            self.send_response(301)
            self.send_header("x-amz-bucket-region", "x.evil.example")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        from cachefs.store.s3http import S3HttpClient, S3Settings

        s3 = S3HttpClient(S3Settings(endpoint=f"http://127.0.0.1:{server.server_address[1]}", key="k", secret="s",
                                     region="us-east-1", attempts=1))
        with pytest.raises(ValueError, match="x-amz-bucket-region .x.evil.example., which is not an AWS region name"):
            s3.get("bucket", "key", 0, [10], "", lambda i, piece: None)
        assert len(requests) == 1
        assert all("evil" not in host for host in requests)
    finally:
        server.shutdown()
        server.server_close()
