"""The workers reach the object store exactly as s3fs does (#49): a conformance matrix.

Two moto servers hold the same bucket and key with different bytes, each behind a small
recording proxy: for each way of configuring the store (mount option, environment variables,
profiles in a config file, credentials from several sources, addressing, anonymous, requester
pays), s3fs alone and cachefs's data path read the same object and must hit the same server
with the same identity and return the same bytes. A misrouted request is seen (the other
server's bytes, or its log), not just a failure. Environment variables are set with monkeypatch
(restored after each test) or passed to the daemons' processes, never left behind.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cachefs.local import worker_process
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import CachePath
from cachefs.store.objects import ObjectStore
from cachefs.store.s3http import HttpS3Backend
from cachefs.testing import MotoServer, fake_s3_client
from helpers import client, payload

KEY = "dir/object.bin"
_CREDENTIAL = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/s3/")
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_STS", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                 "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_SESSION_NAME",
                 "AWS_EC2_METADATA_SERVICE_ENDPOINT", "AWS_EC2_METADATA_DISABLED", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CA_BUNDLE",
                 "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "AWS_S3_ADDRESSING_STYLE",
                 "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_ENDPOINT_URL_SSO")


@dataclass
class Seen:
    method: str
    path: str
    access_key: str  # "" = unsigned
    region: str
    payer: str


@dataclass
class Recorded:
    """A recording reverse proxy in front of one moto server."""

    name: str
    upstream: str
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None

    def clear(self) -> None:
        self.seen.clear()


def _proxy(recorded: Recorded) -> http.server.ThreadingHTTPServer:
    upstream = recorded.upstream.split("://", 1)[1]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            auth = _CREDENTIAL.search(self.headers.get("authorization", ""))
            recorded.seen.append(Seen(self.command, self.path, auth.group(1) if auth else "",
                                      auth.group(2) if auth else "", self.headers.get("x-amz-request-payer", "")))
            conn = http.client.HTTPConnection(upstream, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "transfer-encoding")}
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            self.send_response(reply.status)
            for name, value in reply.getheaders():
                if name.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                    self.send_header(name, value)
            head_length = reply.getheader("content-length") if self.command == "HEAD" else None
            self.send_header("Content-Length", head_length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    recorded.url = f"http://127.0.0.1:{server.server_address[1]}"
    recorded.server = server
    return server


@dataclass
class Stores:
    right: Recorded
    wrong: Recorded
    bucket: str
    data: bytes  # what the right store holds under KEY (the wrong one holds other bytes)


@pytest.fixture(scope="module")
def stores(moto_server: MotoServer) -> Iterator[Stores]:
    with MotoServer() as other:
        bucket = "conformance-bucket"
        right, wrong = Recorded("right", moto_server.endpoint_url), Recorded("wrong", other.endpoint_url)
        for recorded, seed in ((right, 1), (wrong, 2)):
            s3 = fake_s3_client(recorded.upstream)
            try:
                s3.create_bucket(Bucket=bucket)
            except s3.exceptions.BucketAlreadyOwnedByYou:
                pass
            s3.put_object(Bucket=bucket, Key=KEY, Body=payload(300_000, seed), ACL="public-read")
            _proxy(recorded)
        try:
            yield Stores(right, wrong, bucket, payload(300_000, 1))
        finally:
            for recorded in (right, wrong):
                assert recorded.server is not None
                recorded.server.shutdown()
                recorded.server.server_close()


@pytest.fixture
def clean_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No AWS variable from the developer's shell; no ~/.aws; no instance metadata service."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def _read_both(stores: Stores, options: dict) -> tuple[bytes, list[Seen], bytes, list[Seen]]:
    """(s3fs's bytes, its requests on the right store; cachefs's bytes, its data requests there).
    Neither may have sent anything to the wrong store."""
    import s3fs

    for recorded in (stores.right, stores.wrong):
        recorded.clear()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    by_s3fs = fs.cat_file(f"{stores.bucket}/{KEY}")
    s3fs_seen = list(stores.right.seen)
    assert not stores.wrong.seen, f"s3fs reached the wrong store: {stores.wrong.seen}"
    stores.right.clear()
    objects = ObjectStore(MountTable([MountSpec("data", f"s3://{stores.bucket}", options)]), s3_client="http")
    path = CachePath("data", KEY)
    backend = objects._backend(objects.mounts.resolve(path))
    assert isinstance(backend, HttpS3Backend), "the row must exercise the worker's data path"
    meta = objects.info(path)
    by_cachefs = objects.read(meta, 0, meta.size)
    assert not stores.wrong.seen, f"cachefs reached the wrong store: {stores.wrong.seen}"
    cachefs_seen = [s for s in stores.right.seen if s.method == "GET" and KEY in s.path]
    assert cachefs_seen, f"cachefs's data GET did not reach the right store: {stores.right.seen}"
    return by_s3fs, s3fs_seen, by_cachefs, cachefs_seen


def _assert_alike(stores: Stores, options: dict, key: str = "", region: str = "us-east-1", payer: str = "") -> None:
    by_s3fs, s3fs_seen, by_cachefs, cachefs_seen = _read_both(stores, options)
    assert by_s3fs == by_cachefs == stores.data
    identities = {(s.access_key, s.region, s.payer) for s in s3fs_seen + cachefs_seen}
    assert identities == {(key, region, payer)}, identities


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str, credentials: str = "") -> None:
    (tmp_path / "config").write_text(config)
    (tmp_path / "credentials").write_text(credentials)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))


ENV_KEYS = {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "secret-env"}


# --- where the store is ----------------------------------------------------------------------

def test_the_mount_option_wins_over_the_environment(stores, clean_aws):
    clean_aws.setenv("AWS_ENDPOINT_URL", stores.wrong.url)
    clean_aws.setenv("AWS_ENDPOINT_URL_S3", stores.wrong.url)
    _assert_alike(stores, {"key": "AKOPT", "secret": "s", "endpoint_url": stores.right.url}, key="AKOPT")


def test_aws_endpoint_url_from_the_environment(stores, clean_aws):
    for name, value in ENV_KEYS.items():
        clean_aws.setenv(name, value)
    clean_aws.setenv("AWS_ENDPOINT_URL", stores.right.url)
    _assert_alike(stores, {}, key="AKENV")


def test_aws_endpoint_url_s3_wins_over_aws_endpoint_url(stores, clean_aws):
    for name, value in ENV_KEYS.items():
        clean_aws.setenv(name, value)
    clean_aws.setenv("AWS_ENDPOINT_URL", stores.wrong.url)
    clean_aws.setenv("AWS_ENDPOINT_URL_S3", stores.right.url)
    _assert_alike(stores, {}, key="AKENV")


def test_a_profile_endpoint_url_and_region(stores, clean_aws, tmp_path):
    _config(tmp_path, clean_aws, f"[profile training]\nendpoint_url = {stores.right.url}\nregion = eu-west-3\n",
            "[training]\naws_access_key_id = AKPROFILE\naws_secret_access_key = s\n")
    _assert_alike(stores, {"profile": "training"}, key="AKPROFILE", region="eu-west-3")


def test_a_profile_services_section_wins_over_its_endpoint_url(stores, clean_aws, tmp_path):
    _config(tmp_path, clean_aws,
            f"[default]\nendpoint_url = {stores.wrong.url}\nservices = local\nregion = ap-south-1\n\n"
            f"[services local]\ns3 =\n  endpoint_url = {stores.right.url}\n",
            "[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = s\n")
    _assert_alike(stores, {}, key="AKDEFAULT", region="ap-south-1")


def test_the_profile_from_aws_profile_and_the_region_from_the_environment(stores, clean_aws, tmp_path):
    _config(tmp_path, clean_aws, f"[profile other]\nendpoint_url = {stores.right.url}\nregion = eu-west-3\n",
            "[other]\naws_access_key_id = AKOTHER\naws_secret_access_key = s\n")
    clean_aws.setenv("AWS_PROFILE", "other")
    clean_aws.setenv("AWS_DEFAULT_REGION", "ca-central-1")
    _assert_alike(stores, {}, key="AKOTHER", region="ca-central-1")


def test_the_region_from_a_mount_option(stores, clean_aws):
    _assert_alike(stores, {"key": "AKOPT", "secret": "s", "endpoint_url": stores.right.url,
                           "client_kwargs": {"region_name": "eu-north-1"}}, key="AKOPT", region="eu-north-1")


def test_ignore_configured_endpoint_urls_is_honoured_too(stores, clean_aws):
    """With configured endpoints ignored, botocore goes to AWS: so does the data path (here:
    an unreachable store, never the endpoint from the environment)."""
    from cachefs.store.s3config import resolve

    clean_aws.setenv("AWS_ENDPOINT_URL", stores.wrong.url)
    clean_aws.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    resolution = resolve({"key": "a", "secret": "b"})
    assert resolution.endpoint_url == "https://s3.amazonaws.com"
    assert resolution.target(stores.bucket).host == f"{stores.bucket}.s3.amazonaws.com"


# --- who asks ----------------------------------------------------------------------------------

def test_credentials_from_a_named_profile_in_the_credentials_file(stores, clean_aws, tmp_path):
    _config(tmp_path, clean_aws, "[profile p]\nregion = us-east-1\n",
            "[p]\naws_access_key_id = AKFILE\naws_secret_access_key = s\naws_session_token = tok\n")
    _assert_alike(stores, {"profile": "p", "endpoint_url": stores.right.url}, key="AKFILE")


def test_anonymous(stores, clean_aws):
    for name, value in ENV_KEYS.items():
        clean_aws.setenv(name, value)  # present, and not to be used
    _assert_alike(stores, {"anon": True, "endpoint_url": stores.right.url}, key="", region="")


def test_requester_pays(stores, clean_aws):
    for name, value in ENV_KEYS.items():
        clean_aws.setenv(name, value)
    _assert_alike(stores, {"requester_pays": True, "endpoint_url": stores.right.url}, key="AKENV",
                  payer="requester")


class _FakeMetadataService(http.server.BaseHTTPRequestHandler):
    """The parts of EC2's instance metadata service (IMDSv2) botocore asks for a role's keys."""

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:  # noqa: N802
        self._reply(200, "imds-token") if self.path == "/latest/api/token" else self._reply(404, "")

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("x-aws-ec2-metadata-token") != "imds-token":
            self._reply(401, "")
        elif self.path.rstrip("/") == "/latest/meta-data/iam/security-credentials":
            self._reply(200, "training-role")
        elif self.path == "/latest/meta-data/iam/security-credentials/training-role":
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
            self._reply(200, json.dumps({"Code": "Success", "AccessKeyId": "AKROLE", "SecretAccessKey": "s",
                                         "Token": "role-token", "Expiration": expires}))
        else:
            self._reply(404, "")


def test_credentials_from_an_instance_role(stores, clean_aws):
    imds = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeMetadataService)
    threading.Thread(target=imds.serve_forever, daemon=True).start()
    try:
        clean_aws.delenv("AWS_EC2_METADATA_DISABLED")
        clean_aws.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{imds.server_address[1]}/")
        clean_aws.setenv("AWS_ENDPOINT_URL_S3", stores.right.url)
        _assert_alike(stores, {}, key="AKROLE")
    finally:
        imds.shutdown()
        imds.server_close()


def test_credentials_from_a_web_identity_token(stores, clean_aws, tmp_path):
    """AssumeRoleWithWebIdentity at the STS endpoint botocore resolves (AWS_ENDPOINT_URL_STS:
    moto's), once by s3fs and once by cachefs: each gets keys of moto's STS (ASIA...)."""
    import s3fs

    (tmp_path / "token").write_text("a-web-identity-token")
    clean_aws.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/training")
    clean_aws.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    clean_aws.setenv("AWS_ENDPOINT_URL_STS", stores.right.upstream)
    clean_aws.setenv("AWS_ENDPOINT_URL_S3", stores.right.url)
    by_s3fs, s3fs_seen, by_cachefs, cachefs_seen = _read_both(stores, {})
    assert by_s3fs == by_cachefs == stores.data
    assert {s.access_key[:4] for s in s3fs_seen + cachefs_seen} == {"ASIA"}
    assert s3fs is not None


# --- how the URL is made -----------------------------------------------------------------------

@pytest.mark.parametrize("style", ["path", "virtual", "auto"])
def test_addressing_styles_give_the_url_botocore_gives(clean_aws, style):
    """Virtual-hosted names cannot be served from loopback here: the data path's URL for a
    bucket is compared with the one botocore itself sends a GetObject to."""
    import botocore.session
    from botocore.config import Config

    from cachefs.store.s3config import resolve

    clean_aws.setenv("AWS_ACCESS_KEY_ID", "a")
    clean_aws.setenv("AWS_SECRET_ACCESS_KEY", "b")
    for endpoint in ("", "https://objects.example.com:9443/base"):
        options = {"config_kwargs": {"s3": {"addressing_style": style}},
                   "client_kwargs": {"region_name": "eu-west-1"}}
        if endpoint:
            options["endpoint_url"] = endpoint
        target = resolve(options).target("my-bucket")
        sent: list[str] = []
        plain = botocore.session.Session().create_client(
            "s3", region_name="eu-west-1", endpoint_url=endpoint or None,
            config=Config(s3={"addressing_style": style}))
        plain.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url) or _Stop())
        with pytest.raises(_Stopped):
            plain.get_object(Bucket="my-bucket", Key="k")
        assert sent[0] == f"{target.scheme}://{target.netloc}{target.base}/k"


class _Stopped(Exception):
    pass


def _Stop():  # noqa: N802 - raised from botocore's before-send: nothing leaves the process
    raise _Stopped()


# --- the daemons ---------------------------------------------------------------------------------

def test_a_worker_process_reads_from_the_endpoint_in_its_environment(stores, tmp_path):
    """The issue's case: ``cachefs worker --mount data=s3://bucket`` with the store set the
    standard way, in the environment. Before #49 the data GET went to AWS."""
    env = {k: v for k, v in __import__("os").environ.items() if k not in AWS_VARIABLES}
    env.update(ENV_KEYS, AWS_ENDPOINT_URL=stores.wrong.url, AWS_ENDPOINT_URL_S3=stores.right.url,
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    stores.right.clear()
    stores.wrong.clear()
    with worker_process({"data": f"s3://{stores.bucket}"}, str(tmp_path / "cache"), env=env,
                        log_path=str(tmp_path / "worker.log")) as worker:
        assert client(worker.address).cat_file(f"data/{KEY}") == stores.data
    assert not stores.wrong.seen
    assert any(s.method == "GET" and KEY in s.path and s.access_key == "AKENV" for s in stores.right.seen)


def _process_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in AWS_VARIABLES}
    env.update(ENV_KEYS, AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", **extra)
    return env


def test_the_master_pins_the_endpoint_and_region_it_resolves_and_its_workers_follow(stores, tmp_path):
    """A mount added with no options to a master whose environment names the store: the master
    writes the endpoint and region in (``cachefs mounts`` shows them), so a worker whose own
    environment names another store still reads from the master's."""
    import subprocess
    import sys

    from cachefs.local import master_process

    master_env = _process_env(tmp_path, AWS_ENDPOINT_URL_S3=stores.right.url, AWS_DEFAULT_REGION="eu-west-3")
    worker_env = _process_env(tmp_path, AWS_ENDPOINT_URL_S3=stores.wrong.url, AWS_DEFAULT_REGION="us-west-2")
    stores.right.clear()
    stores.wrong.clear()
    with master_process(str(tmp_path / "m"), env=master_env, log_path=str(tmp_path / "master.log")) as master:
        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "cachefs.cli", *args, "--master", master.address],
                                  capture_output=True, text=True, timeout=60, env=worker_env)

        added = cli("mount", "data", f"s3://{stores.bucket}")
        assert added.returncode == 0, added.stderr
        (row,) = json.loads(cli("mounts", "--json").stdout)
        assert row["options"]["endpoint_url"] == stores.right.url
        assert row["options"]["client_kwargs"] == {"region_name": "eu-west-3"}
        text = cli("mounts").stdout
        assert f"endpoint {stores.right.url}" in text and "region eu-west-3" in text
        with worker_process({}, str(tmp_path / "cache"), extra=["--master", master.address], env=worker_env,
                            log_path=str(tmp_path / "worker.log")) as worker:
            fs = client(worker.address)
            deadline = time.monotonic() + 15
            while True:
                try:
                    assert fs.cat_file(f"data/{KEY}") == stores.data
                    break
                except Exception:  # noqa: BLE001 - the mount reaches the worker with its next heartbeat
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
    assert not stores.wrong.seen
    assert {s.region for s in stores.right.seen if s.method == "GET" and KEY in s.path} == {"eu-west-3"}


def test_against_a_store_that_is_not_aws_checksums_are_asked_only_where_required(clean_aws):
    """botocore 1.36+ adds CRC checksums to every upload by default, which many S3-compatible
    stores refuse: a pinned mount at such an endpoint asks for them only where required."""
    from cachefs.store.s3config import pinned_options

    clean_aws.setenv("AWS_ENDPOINT_URL", "http://minio.internal:9000")
    pinned = pinned_options("s3://bucket", {})
    assert pinned["endpoint_url"] == "http://minio.internal:9000"
    assert pinned["config_kwargs"] == {"request_checksum_calculation": "when_required",
                                       "response_checksum_validation": "when_required"}
    clean_aws.delenv("AWS_ENDPOINT_URL")
    assert pinned_options("s3://bucket", {}) == {"client_kwargs": {"region_name": "us-east-1"}}
    mine = pinned_options("s3://bucket", {"endpoint_url": "http://x:1",
                                          "config_kwargs": {"request_checksum_calculation": "when_supported"}})
    assert mine["config_kwargs"]["request_checksum_calculation"] == "when_supported"


def test_a_forked_child_reads_from_the_same_store(stores, clean_aws):
    """The client's fallback store runs in forked DataLoader workers: the resolution made in the
    parent serves the child (its own connections), and the parent's still works after."""
    import os

    for name, value in ENV_KEYS.items():
        clean_aws.setenv(name, value)
    clean_aws.setenv("AWS_ENDPOINT_URL", stores.right.url)
    objects = ObjectStore(MountTable([MountSpec("data", f"s3://{stores.bucket}", {})]), s3_client="http")
    meta = objects.info(CachePath("data", KEY))
    assert objects.read(meta, 0, 1000) == stores.data[:1000]
    pid = os.fork()
    if pid == 0:
        ok = objects.read(meta, 1000, 5000) == stores.data[1000:5000]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert objects.read(meta, 5000, 6000) == stores.data[5000:6000]


def test_a_proxy_keeps_the_mount_on_s3fs_and_the_log_says_why(stores, clean_aws, caplog):
    """An option the HTTP client cannot honour never sends its requests elsewhere: the mount
    reads through s3fs, and the log names the option."""
    from cachefs.store.backends import _S3Backend

    options = {"key": "a", "secret": "b", "endpoint_url": stores.right.url,
               "config_kwargs": {"proxies": {"http": "http://127.0.0.1:9", "https": "http://127.0.0.1:9"}}}
    objects = ObjectStore(MountTable([MountSpec("data", f"s3://{stores.bucket}", options)]), s3_client="http")
    with caplog.at_level("INFO", logger="cachefs.store.s3http"):
        backend = objects._backend(objects.mounts.resolve(CachePath("data", KEY)))
    assert type(backend) is _S3Backend
    assert "cannot honour a proxy" in caplog.text


class _FakeCredentialService(http.server.BaseHTTPRequestHandler):
    """An ECS/EKS container credentials endpoint and the SSO portal's GetRoleCredentials."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        expires = time.time() + 3600
        if self.path == "/container-credentials" and self.headers.get("authorization") == "container-token":
            body = {"AccessKeyId": "AKCONTAINER", "SecretAccessKey": "s", "Token": "t",
                    "Expiration": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))}
        elif self.path.startswith("/federation/credentials") and self.headers.get("x-amz-sso_bearer_token") == "sso-token":
            body = {"roleCredentials": {"accessKeyId": "AKSSO", "secretAccessKey": "s", "sessionToken": "t",
                                        "expiration": int(expires * 1000)}}
        else:
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def credential_service() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeCredentialService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_credentials_from_a_container_role(stores, clean_aws, credential_service):
    clean_aws.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{credential_service}/container-credentials")
    clean_aws.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "container-token")
    clean_aws.setenv("AWS_ENDPOINT_URL_S3", stores.right.url)
    _assert_alike(stores, {}, key="AKCONTAINER")


def test_credentials_from_sso(stores, clean_aws, credential_service, tmp_path):
    """A profile signed in with ``aws sso login`` (its cached token), the portal at the endpoint
    botocore resolves for it (``AWS_ENDPOINT_URL_SSO``, here a fake)."""
    import hashlib

    import botocore.credentials

    start_url = "https://example.awsapps.com/start"
    cache = tmp_path / "sso-cache"
    cache.mkdir()
    (cache / f"{hashlib.sha1(start_url.encode()).hexdigest()}.json").write_text(json.dumps(
        {"startUrl": start_url, "region": "eu-west-1", "accessToken": "sso-token",
         "expiresAt": "2099-01-01T00:00:00Z"}))
    clean_aws.setattr(botocore.credentials.SSOProvider, "_SSO_TOKEN_CACHE_DIR", str(cache))
    _config(tmp_path, clean_aws, f"[profile sso]\nsso_start_url = {start_url}\nsso_region = eu-west-1\n"
                                 "sso_account_id = 123456789012\nsso_role_name = training\nregion = us-east-1\n"
                                 f"endpoint_url = {stores.right.url}\n")
    clean_aws.setenv("AWS_ENDPOINT_URL_SSO", credential_service)
    _assert_alike(stores, {"profile": "sso"}, key="AKSSO")


def test_expiring_role_credentials_are_refreshed_between_reads(stores, clean_aws):
    """Keys that expire within botocore's mandatory refresh window (10 min) are fetched again
    before the next GET is signed: the data path signs with the role's new keys, as botocore
    would (a container role here: botocore stretches instance-role keys about to expire)."""
    issued: list[str] = []

    class Rotating(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            issued.append(f"AKROLE{len(issued)}")
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
            data = json.dumps({"AccessKeyId": issued[-1], "SecretAccessKey": "s", "Token": "t",
                               "Expiration": expires}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Rotating)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        clean_aws.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{server.server_address[1]}/creds")
        clean_aws.setenv("AWS_ENDPOINT_URL_S3", stores.right.url)
        objects = ObjectStore(MountTable([MountSpec("data", f"s3://{stores.bucket}", {})]), s3_client="http")
        meta = objects.info(CachePath("data", KEY))
        stores.right.clear()
        for start in (0, 1000):
            assert objects.read(meta, start, start + 1000) == stores.data[start:start + 1000]
        keys = [s.access_key for s in stores.right.seen if s.method == "GET"]
        assert len(keys) == 2 and keys[0] != keys[1] and set(keys) <= set(issued)
    finally:
        server.shutdown()
        server.server_close()
