"""The worker's S3 HTTP client (cachefs/store/s3http.py) at the protocol level: signatures as
botocore makes them, kept-alive connections, and what a store may answer (throttling, broken
streams, chunked bodies, a wrong region, errors). A real loopback HTTP server replies from a
script; the whole contract against a real S3 endpoint (moto) is in test_store_clients.py."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from cachefs.errors import StaleObjectError
from cachefs.store.s3http import S3HttpClient, S3Settings, _Signer

Reply = Callable[["Request"], bytes | None]  # raw bytes to send (None: close without a word)


@dataclass
class Request:
    line: str
    headers: dict[str, str]
    connection: int  # which accepted connection carried it (0, 1, ...)


@dataclass
class Script:
    """Replies in order, one per request; ``close_after``: close the connection after a reply."""

    replies: list[Reply]
    close_after: set[int] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    connections: int = 0


def _read_head(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return data


@contextmanager
def scripted_server(script: Script, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """An HTTP/1.1 server on a free loopback port, answering from ``script`` (over TLS with
    ``tls``); yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket, number: int) -> None:
        conn.settimeout(30)
        with conn:
            while not stop.is_set():
                try:
                    head = _read_head(conn)
                except OSError:
                    return
                if head is None:
                    return
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                index = len(script.requests)
                request = Request(lines[0], headers, number)
                script.requests.append(request)
                out = script.replies[index](request) if index < len(script.replies) else None
                if out is None:
                    return
                try:
                    conn.sendall(out)
                except OSError:
                    return
                if index in script.close_after:
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if tls is not None:
                try:
                    conn.settimeout(10)
                    conn = tls.wrap_socket(conn, server_side=True)
                except (OSError, ssl.SSLError):  # a client that does not trust us: its loss
                    conn.close()
                    continue
            t = threading.Thread(target=serve, args=(conn, script.connections), daemon=True)
            script.connections += 1
            threads.append(t)
            t.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        acceptor.join(timeout=10)


def _ranged(body: bytes, etag: str = "e1", total: int | None = None, extra: str = "",
            cut: int | None = None) -> Reply:
    """A 206 reply for the request's Range over ``body`` (``cut``: send only that many body bytes)."""
    def reply(request: Request) -> bytes:
        first, _, last = request.headers["range"].removeprefix("bytes=").partition("-")
        lo, hi = int(first), min(int(last), len(body) - 1)
        data = body[lo:hi + 1]
        head = (f"HTTP/1.1 206 Partial Content\r\nETag: \"{etag}\"\r\nContent-Length: {len(data)}\r\n"
                f"Content-Range: bytes {lo}-{hi}/{total or len(body)}\r\n{extra}\r\n").encode()
        return head + (data if cut is None else data[:cut])
    return reply


def _status(code: int, text: str, xml_code: str = "", extra: str = "") -> Reply:
    body = f"<Error><Code>{xml_code}</Code><Message>{text}</Message></Error>".encode() if xml_code else b""
    return lambda request: (f"HTTP/1.1 {code} {text}\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _client(url: str, **settings) -> S3HttpClient:
    client = S3HttpClient(S3Settings(endpoint=url, key="AKID", secret="SECRET", region="us-east-1", **settings))
    client._sleep = lambda seconds: None  # backoff is not what these tests are about
    return client


def _get(client: S3HttpClient, start: int, sizes: list[int], version: str = "e1") -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    client.get("bucket", "dir/key one.bin", start, sizes, version, lambda i, piece: got.append((i, bytes(piece))))
    return got


BODY = bytes(range(256)) * 400  # 102,400 bytes


def test_the_signature_is_the_one_botocore_makes():
    botocore_auth = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    when = dt.datetime(2026, 12, 5, 1, 2, 3, tzinfo=dt.timezone.utc)
    for token in ("", "session-token"):
        headers = {"host": "127.0.0.1:9000", "range": "bytes=0-99", "if-match": '"abc"'}
        _Signer().sign(("AKID", "SECRET", token), "eu-west-1", "/bucket/dir/key%20one.bin", "", headers, now=when)
        request = AWSRequest(method="GET", url="http://127.0.0.1:9000/bucket/dir/key%20one.bin",
                             headers={"Range": "bytes=0-99", "If-Match": '"abc"'})
        signer = botocore_auth.S3SigV4Auth(Credentials("AKID", "SECRET", token or None), "s3", "eu-west-1")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(botocore_auth, "get_current_datetime", lambda: when.replace(tzinfo=None))
            signer.add_auth(request)
        assert headers["authorization"] == request.headers["Authorization"]
        assert headers["x-amz-date"] == request.headers["X-Amz-Date"] == "20261205T010203Z"


def test_pieces_come_in_order_on_one_kept_alive_connection():
    script = Script([_ranged(BODY), _ranged(BODY)])
    with scripted_server(script) as url:
        client = _client(url)
        assert _get(client, 100, [1000, 2000, 5]) == [(0, BODY[100:1100]), (1, BODY[1100:3100]), (2, BODY[3100:3105])]
        assert _get(client, 0, [10]) == [(0, BODY[:10])]
    assert script.connections == 1
    first = script.requests[0]
    assert first.line == "GET /bucket/dir/key%20one.bin HTTP/1.1"
    assert first.headers["range"] == "bytes=100-3104" and first.headers["if-match"] == '"e1"'
    assert "Credential=AKID/" in first.headers["authorization"]


def test_an_idle_connection_the_server_closed_is_redialled_without_costing_an_attempt():
    script = Script([_ranged(BODY), _ranged(BODY)], close_after={0})
    with scripted_server(script) as url:
        client = _client(url, attempts=1)
        assert _get(client, 0, [10]) == [(0, BODY[:10])]
        assert _get(client, 10, [10]) == [(0, BODY[10:20])]
    assert script.connections == 2


def test_throttling_and_server_errors_are_retried_then_reported():
    script = Script([_status(503, "Slow Down", "SlowDown"), _status(500, "Oops", "InternalError"), _ranged(BODY)])
    with scripted_server(script) as url:
        assert _get(_client(url, attempts=3), 0, [64]) == [(0, BODY[:64])]
    script = Script([_status(503, "Slow Down", "SlowDown")] * 2)
    with scripted_server(script) as url:
        with pytest.raises(OSError, match="SlowDown"):
            _get(_client(url, attempts=2), 0, [64])
    assert len(script.requests) == 2


def test_a_broken_stream_resumes_at_the_first_piece_not_delivered_and_pins_the_version():
    script = Script([_ranged(BODY, etag="v7", cut=1500), _ranged(BODY, etag="v7")], close_after={0})
    with scripted_server(script) as url:
        got = _get(_client(url, attempts=2), 0, [1000, 1000, 1000], version="")
    assert got == [(0, BODY[:1000]), (1, BODY[1000:2000]), (2, BODY[2000:3000])]  # each piece once
    assert script.requests[1].headers["range"] == "bytes=1000-2999"
    assert script.requests[1].headers["if-match"] == '"v7"'  # the rest of the same version


def test_an_object_shorter_than_the_range_is_stale_not_short():
    script = Script([_ranged(BODY[:1500])])
    with scripted_server(script) as url:
        got: list[int] = []
        with pytest.raises(StaleObjectError, match="stream ended"):
            _client(url).get("bucket", "k", 0, [1000, 1000], "e1", lambda i, piece: got.append(i))
    assert got == [0]


def test_a_chunked_body_is_read_whole():
    def chunked(request: Request) -> bytes:
        data = BODY[:3000]
        chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in (data[:1], data[1:2048], data[2048:]))
        return (b"HTTP/1.1 206 Partial Content\r\nETag: \"e1\"\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Range: bytes 0-2999/102400\r\n\r\n" + chunks + b"0\r\nX-Trailer: y\r\n\r\n")
    script = Script([chunked, _ranged(BODY)])
    with scripted_server(script) as url:
        client = _client(url)
        assert _get(client, 0, [1000, 2000]) == [(0, BODY[:1000]), (1, BODY[1000:3000])]
        assert _get(client, 5, [5]) == [(0, BODY[5:10])]  # the connection is still good
    assert script.connections == 1


def test_many_small_chunks_split_anywhere_are_read_whole():
    import random

    data = BODY[:20_000]
    rnd = random.Random(5)
    cuts, at = [], 0
    while at < len(data):
        step = rnd.randint(1, 700)
        cuts.append(data[at:at + step])
        at += step
    raw = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in cuts) + b"0\r\n\r\n"

    def chunked(request: Request) -> bytes:
        return (b"HTTP/1.1 206 Partial Content\r\nETag: \"e1\"\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Range: bytes 0-19999/102400\r\n\r\n" + raw)
    script = Script([chunked, _ranged(BODY)])
    with scripted_server(script) as url:
        client = _client(url)
        sizes = [4096, 4096, 4096, 4096, 3616]
        got = _get(client, 0, sizes)
        assert b"".join(piece for _, piece in got) == data and [i for i, _ in got] == [0, 1, 2, 3, 4]
        assert _get(client, 7, [3]) == [(0, BODY[7:10])]  # the chunked reply was read to its end
    assert script.connections == 1


def test_a_wrong_region_is_learnt_from_the_reply():
    script = Script([_status(301, "Moved Permanently", "PermanentRedirect", "x-amz-bucket-region: eu-west-1\r\n"),
                     _ranged(BODY), _ranged(BODY)])
    with scripted_server(script) as url:
        client = _client(url, attempts=1)
        assert _get(client, 0, [10]) == [(0, BODY[:10])]
        assert _get(client, 0, [10]) == [(0, BODY[:10])]
    scopes = [r.headers["authorization"].split("Credential=AKID/")[1].split(",")[0] for r in script.requests]
    assert [s.split("/")[1] for s in scopes] == ["us-east-1", "eu-west-1", "eu-west-1"]


@pytest.mark.parametrize("code, text, xml_code, error", [
    (412, "Precondition Failed", "PreconditionFailed", StaleObjectError),
    (404, "Not Found", "NoSuchKey", FileNotFoundError),
    (403, "Forbidden", "AccessDenied", PermissionError),
    (400, "Bad Request", "InvalidArgument", OSError),
])
def test_errors_map_to_the_exceptions_the_worker_expects(code, text, xml_code, error):
    script = Script([_status(code, text, xml_code)])
    with scripted_server(script) as url:
        with pytest.raises(error) as raised:
            _get(_client(url, attempts=3), 0, [10])
    assert len(script.requests) == 1  # never retried
    assert "bucket/dir/key one.bin" in str(raised.value)


def test_a_store_that_never_answers_fails_within_the_read_timeout():
    script = Script([lambda request: b""] * 2)  # accepts, reads the request, says nothing
    with scripted_server(script) as url:
        client = _client(url, attempts=2, read_timeout=0.3)
        with pytest.raises(TimeoutError):
            _get(client, 0, [10])
    assert len(script.requests) == 2


def test_a_refused_connection_is_a_connection_error(dead_port):
    client = _client(f"http://127.0.0.1:{dead_port}", attempts=2)
    with pytest.raises(ConnectionError):
        _get(client, 0, [10])


@pytest.mark.parametrize("options, ours", [
    ({"key": "a", "secret": "b", "token": "t", "endpoint_url": "http://127.0.0.1:9000",
      "client_kwargs": {"region_name": "eu-west-1"}, "skip_instance_cache": True}, True),
    ({"anon": True, "requester_pays": True, "client_kwargs": {"verify": False},
      "config_kwargs": {"connect_timeout": 3, "read_timeout": 60, "retries": {"max_attempts": 4, "mode": "standard"},
                        "max_pool_connections": 50, "s3": {"addressing_style": "path"}}}, True),
    ({"key": "a", "secret": "b"}, True),
    ({"key": "a", "secret": "b", "config_kwargs": {"proxies": {"https": "http://proxy:3128",
                                                                "http": "http://proxy:3128"}}}, False),
    ({"s3_additional_kwargs": {"SSECustomerKey": "k"}}, False),
    ({"endpoint_url": "ftp://host"}, False),
])
def test_the_http_client_takes_a_mount_only_where_it_sends_what_s3fs_would(options, ours, aws_env):
    """No option is translated by hand: botocore resolves them all (s3config.py); a mount whose
    requests botocore would send through a proxy, or with extra request parameters, stays on s3fs."""
    import s3fs

    from cachefs.store.s3http import HttpS3Backend, http_backend_for

    backend = http_backend_for(s3fs.S3FileSystem(**options))
    assert isinstance(backend, HttpS3Backend) is ours
    if ours and "config_kwargs" in options:
        resolution = backend.resolution
        # botocore's max_attempts counts retries: 4 of them, 5 requests in all
        assert (resolution.connect_timeout, resolution.read_timeout, resolution.attempts) == (3.0, 60.0, 5)
        assert resolution.verify is False and resolution.requester_pays and resolution.credentials() is None


def test_credentials_and_region_of_a_named_profile(tmp_path, monkeypatch):
    (tmp_path / "credentials").write_text("[training]\naws_access_key_id = AKPROFILE\naws_secret_access_key = SKP\n")
    (tmp_path / "config").write_text("[profile training]\nregion = eu-central-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    script = Script([_ranged(BODY)])
    with scripted_server(script) as url:
        client = S3HttpClient(S3Settings(endpoint=url, profile="training"))
        assert _get(client, 0, [10]) == [(0, BODY[:10])]
    assert "Credential=AKPROFILE/" in script.requests[0].headers["authorization"]
    assert "/eu-central-1/s3/aws4_request" in script.requests[0].headers["authorization"]
    with scripted_server(Script([])) as url:
        anonymous = S3HttpClient(S3Settings(endpoint=url, anon=True))
        assert anonymous.resolution.credentials() is None


def test_a_forked_child_never_uses_its_parents_connections():
    import os

    script = Script([_ranged(BODY)] * 3)
    with scripted_server(script) as url:
        client = _client(url)
        assert _get(client, 0, [10]) == [(0, BODY[:10])]  # one idle connection kept
        pid = os.fork()
        if pid == 0:
            ok = _get(client, 10, [10]) == [(0, BODY[10:20])]
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _get(client, 20, [10]) == [(0, BODY[20:30])]  # the parent's connection is still good
    assert script.connections == 2
    assert [r.connection for r in script.requests] == [0, 1, 0]


def test_https_endpoints_are_verified_against_the_ca_given(tmp_path):
    from tlscerts import make_pki

    pki = make_pki(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pki.server_cert, pki.server_key)
    script = Script([_ranged(BODY)] * 3)
    with scripted_server(script, tls=server) as url:
        assert url.startswith("https://")
        assert _get(_client(url, verify=pki.ca), 0, [100, 28]) == [(0, BODY[:100]), (1, BODY[100:128])]
        with pytest.raises(ConnectionError, match="TLS"):
            _get(_client(url, verify=pki.other_ca, attempts=1), 0, [10])  # not our CA: refused
        assert _get(_client(url, verify=False), 5, [5]) == [(0, BODY[5:10])]
    assert len(script.requests) == 2


def test_a_head_larger_than_the_first_buffer_is_read_and_one_too_large_refused():
    """The head's buffer starts small (what it takes of the body is copied once more) and grows;
    a head past _MAX_HEAD is not an S3 reply."""
    from cachefs.store import s3http

    padding = "".join(f"x-amz-meta-pad{i}: {'v' * 90}\r\n" for i in range(120))  # ~12 KiB of head
    assert len(padding) > 2 * s3http._HEAD_START
    huge = "".join(f"x-amz-meta-pad{i}: {'v' * 90}\r\n" for i in range(800))  # ~80 KiB
    assert len(huge) > s3http._MAX_HEAD
    script = Script([_ranged(BODY, extra=padding), _ranged(BODY, extra=huge), _ranged(BODY, extra=huge),
                     _ranged(BODY, extra=huge)])
    with scripted_server(script) as url:
        client = _client(url, attempts=1)
        assert _get(client, 5, [BODY.__len__() - 5]) == [(0, BODY[5:])]
        with pytest.raises(OSError, match="too large"):
            _get(client, 0, [10])


def _listing(keys: list[tuple[str, int, str]], prefixes: list[str] = (), token: str = "") -> Reply:
    """A ListObjectsV2 reply (keys as S3 sends them with encoding-type=url: '+' for a space)."""
    contents = "".join(f"<Contents><Key>{k}</Key><LastModified>2026-12-05T01:02:03.000Z</LastModified>"
                       f"<ETag>&quot;{etag}&quot;</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass>"
                       f"</Contents>" for k, size, etag in keys)
    common = "".join(f"<CommonPrefixes><Prefix>{p}</Prefix></CommonPrefixes>" for p in prefixes)
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>" if token \
        else "<IsTruncated>false</IsTruncated>"
    body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bucket</Name>{more}{contents}'
            f"{common}<EncodingType>url</EncodingType></ListBucketResult>").encode()
    return lambda request: f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def test_a_listing_is_read_page_by_page_with_keys_decoded():
    script = Script([_status(503, "Slow Down", "SlowDown"),
                     _listing([("dir/a+b.bin", 5, "e1"), ("dir/c%2Bd%26e.bin", 7, "e2")], ["dir/sub/"],
                              token="tok/1+2="),
                     _listing([("dir/%C3%A9.bin", 9, "e3")])])
    with scripted_server(script) as url:
        client = _client(url, attempts=2)
        objects, prefixes, token = client.list_page("bucket", "dir/")
        assert objects == [("dir/a b.bin", 5, "e1", dt.datetime(2026, 12, 5, 1, 2, 3, tzinfo=dt.timezone.utc).timestamp()),
                           ("dir/c+d&e.bin", 7, "e2", objects[1][3])]
        assert prefixes == ["dir/sub/"] and token == "tok/1+2="
        objects, prefixes, token = client.list_page("bucket", "dir/", token=token)
        assert [o[0] for o in objects] == ["dir/\u00e9.bin"] and prefixes == [] and token == ""
    assert len(script.requests) == 3  # the throttled first try, then the two pages
    first, second = script.requests[1].line, script.requests[2].line
    assert first == ("GET /bucket/?delimiter=%2F&encoding-type=url&list-type=2&max-keys=1000&prefix=dir%2F "
                     "HTTP/1.1")
    assert "continuation-token=tok%2F1%2B2%3D&" in second


def test_a_listing_query_is_signed_as_botocore_signs_it():
    botocore_auth = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    when = dt.datetime(2026, 12, 5, 1, 2, 3, tzinfo=dt.timezone.utc)
    query = "continuation-token=tok%2F1%2B2%3D&delimiter=%2F&encoding-type=url&list-type=2&prefix=d%20x%2F"
    headers = {"host": "127.0.0.1:9000"}
    _Signer().sign(("AKID", "SECRET", ""), "us-east-1", "/bucket/", query, headers, now=when)
    request = AWSRequest(method="GET", url=f"http://127.0.0.1:9000/bucket/?{query}")
    signer = botocore_auth.S3SigV4Auth(Credentials("AKID", "SECRET"), "s3", "us-east-1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(botocore_auth, "get_current_datetime", lambda: when.replace(tzinfo=None))
        signer.add_auth(request)
    assert headers["authorization"] == request.headers["Authorization"]


def test_a_listing_error_is_the_exception_the_worker_expects():
    for reply, error in ((_status(404, "Not Found", "NoSuchBucket"), FileNotFoundError),
                         (_status(403, "Forbidden", "AccessDenied"), PermissionError)):
        with scripted_server(Script([reply])) as url:
            with pytest.raises(error):
                _client(url, attempts=1).list_page("bucket", "dir/")
    body = b"<ListBucketResult><IsTruncated>true</IsTruncated><Contents><Key>dir/a</Key></Contents></ListBucketResult>"
    broken = lambda request: f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body  # noqa: E731
    with scripted_server(Script([broken])) as url:
        with pytest.raises(OSError, match="continuation token"):
            _client(url, attempts=1).list_page("bucket", "dir/")
