"""S3 data reads as plain HTTP/1.1: SigV4-signed ranged GETs on kept-alive sockets.

A cold epoch's worker spends most of its own CPU fetching (#15). Measured side by side
(benchmarks/bench_store_client.py, moto on loopback): a 256 KiB ranged GET costs ~1.2-1.3 ms of
client CPU through s3fs (aiobotocore), ~0.45 through obstore (Rust, but each blocking call hops
to its tokio threads and back, ~25 context switches a GET) and ~0.25 here, where the calling
thread sends the request and ``recv_into``s the body straight into the page it delivers (no
event loop, no thread hop, no copy out of a response object). 8 MiB GETs: 0.19 s/GB against
obstore's 0.88.

Only data reads take this path (``read``, ``read_pieces``, ``head_read``); metadata (HEAD,
listings) and writes stay on s3fs. The contract is the s3fs backend's: pinned to the version
with ``If-Match`` (412: StaleObjectError), 404 FileNotFoundError, 403 PermissionError, a store
that cannot be reached ConnectionError (the store breaker's signal). Retries: a kept-alive
connection the server closed meanwhile is redialled at once; 5xx, throttling and broken streams
are retried ``attempts`` times in all with backoff, a broken stream from the first piece it did
not deliver. A wrong region is learnt from the reply (``x-amz-bucket-region``) and asked again.

Nothing here reads a mount's options (#49): botocore resolves them as it does for s3fs
(cachefs/store/s3config.py), and the client takes from that resolution each bucket's URL
(endpoint, addressing style, region: ``AWS_ENDPOINT_URL*``, profiles and ``services`` sections
included), the signing region, the credentials (the whole chain, refreshed by botocore), the CA
bundle, the timeouts and the attempts. Signing is ours (SigV4, the same signature botocore makes,
tested side by side). A mount botocore would send through a proxy or with another auth scheme, or
one with ``s3_additional_kwargs`` (e.g. SSE-C keys) reads through s3fs.
"""

from __future__ import annotations

import calendar
import datetime as dt
import email.utils
import hashlib
import html
import hmac
import logging
import os
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from cachefs import rawbytes
from cachefs.errors import StaleObjectError
from cachefs.store.backends import PieceSink, _mtime_of, _S3Backend, s3_pages
from cachefs.store.s3config import S3Resolution, resolve, resolve_fs

log = logging.getLogger(__name__)

__all__ = ["HttpS3Backend", "S3Settings", "http_backend_for"]

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_MAX_HEAD = 64 << 10  # a reply's status line and headers, at most
_HEAD_START = 4 << 10  # the head's buffer to begin with (an S3 reply's head is ~0.5 KiB)
_MAX_IDLE = 64  # idle connections kept per host
_IGNORED = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                      "asynchronous", "loop", "default_block_size", "default_fill_cache", "default_cache_type",
                      "cache_regions", "version_aware", "session"})
# ListObjectsV2 replies, read with regular expressions (botocore's XML parsing cost ~0.15 ms a key
# here: a listing that refreshes 2,000 objects' metadata took 0.24-0.39 s of the worker's CPU).
# An AWS region name (us-east-1, us-gov-west-1, cn-north-1, us-isob-east-1): what a region learnt
# from a reply must be before it goes into a Host header (s3.<region>.amazonaws.com).
_REGION = re.compile(r"[a-z]{2}(-[a-z0-9]+)+-[0-9]{1,2}")


def check_region(region: str) -> str:
    """``region`` if it is an AWS region name, else ValueError (a reply naming another host)."""
    if len(region) > 32 or not _REGION.fullmatch(region):
        raise ValueError(f"the store answered with x-amz-bucket-region {region[:64]!r}, which is not an AWS "
                         "region name (like us-east-1): not followed")
    return region


_CONTENTS = re.compile(rb"<Contents>(.*?)</Contents>", re.S)
_COMMON = re.compile(rb"<CommonPrefixes>\s*<Prefix>(.*?)</Prefix>\s*</CommonPrefixes>", re.S)
_FIELDS = {name: re.compile(rb"<%s>(.*?)</%s>" % (name, name), re.S)
           for name in (b"Key", b"Size", b"ETag", b"LastModified", b"IsTruncated", b"NextContinuationToken",
                        b"EncodingType")}


def _encode_query(params: dict[str, str]) -> str:
    """A query string as SigV4 signs it: names sorted, everything but unreserved characters escaped."""
    return "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                    for k, v in sorted(params.items()))


def _xml_text(raw: bytes) -> str:
    return html.unescape(raw.decode("utf-8"))


def _listed_time(value: str) -> float:
    """Seconds since the epoch of an ISO 8601 time as ListObjectsV2 gives it (UTC, ``Z``)."""
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class S3Settings:
    """A shorthand for tests and benchmarks: :meth:`options` are s3fs options, which botocore resolves."""

    endpoint: str = ""  # "" = wherever botocore resolves (AWS_ENDPOINT_URL*, a profile, else AWS)
    region: str = ""  # "" = botocore's configured region, else us-east-1
    key: str = ""
    secret: str = ""
    token: str = ""
    profile: str = ""
    anon: bool = False
    requester_pays: bool = False
    verify: bool | str = True  # False, or a CA bundle path
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    attempts: int = 2  # requests in all, per read (botocore's default legacy mode: 5; the mounts' fail-fast: 2)

    def __post_init__(self) -> None:
        if self.endpoint:
            scheme = urllib.parse.urlsplit(self.endpoint).scheme
            if scheme not in ("http", "https") or not urllib.parse.urlsplit(self.endpoint).hostname:
                raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("timeouts must be > 0")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if bool(self.key) != bool(self.secret):
            raise ValueError("key and secret go together")


    def options(self) -> dict[str, Any]:
        """The s3fs options these settings stand for."""
        out: dict[str, Any] = {"anon": self.anon, "requester_pays": self.requester_pays,
                               "config_kwargs": {"connect_timeout": self.connect_timeout,
                                                 "read_timeout": self.read_timeout,
                                                 "retries": {"total_max_attempts": self.attempts,
                                                             "mode": "standard"}}}
        client_kwargs: dict[str, Any] = {"verify": self.verify}
        if self.region:
            client_kwargs["region_name"] = self.region
        out["client_kwargs"] = client_kwargs
        for name in ("endpoint_url", "key", "secret", "token", "profile"):
            value = getattr(self, "endpoint" if name == "endpoint_url" else name)
            if value:
                out[name] = value
        return out


# s3fs options that change a GET beyond what botocore resolves: those mounts read through s3fs.
_NOT_OURS = ("s3_additional_kwargs", "session")


def http_backend_for(fs: fsspec.AbstractFileSystem) -> "HttpS3Backend | None":
    """The HTTP client's backend for an s3fs filesystem, None where it cannot send what s3fs would."""
    options = dict(getattr(fs, "storage_options", {}) or {})
    ours = [name for name in _NOT_OURS if options.get(name)]
    if ours:
        log.info("S3 reads through s3fs, not the HTTP client: the mount sets %s", ", ".join(ours))
        return None
    try:
        resolution = resolve_fs(fs)
    except Exception as exc:  # noqa: BLE001 - an option botocore refuses: s3fs says which, on first use
        log.info("S3 reads through s3fs, not the HTTP client: botocore refuses the options: %s", exc)
        return None
    reason = resolution.unsupported()
    if reason:
        log.info("S3 reads through s3fs, not the HTTP client, which cannot honour %s", reason)
        return None
    return HttpS3Backend(resolution)


class _Signer:
    """AWS Signature Version 4 for S3 GETs; the day's signing key is derived once."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str], bytes] = {}

    def _key(self, secret: str, day: str, region: str) -> bytes:
        key = self._keys.get((secret, day, region))
        if key is None:
            key = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
            for part in (region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            if len(self._keys) > 8:
                self._keys.clear()
            self._keys[(secret, day, region)] = key
        return key

    def sign(self, credentials: tuple[str, str, str], region: str, path: str, query: str,
             headers: dict[str, str], now: dt.datetime | None = None) -> None:
        """Add the date, payload hash, token and authorization headers (``headers``: lowercase names)."""
        access, secret, token = credentials
        stamp = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
        headers["x-amz-date"] = stamp
        headers["x-amz-content-sha256"] = _EMPTY_SHA256
        if token:
            headers["x-amz-security-token"] = token
        names = sorted(headers)
        canonical = "\n".join(("GET", path, query, "".join(f"{n}:{headers[n].strip()}\n" for n in names),
                               ";".join(names), _EMPTY_SHA256))
        scope = f"{stamp[:8]}/{region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._key(secret, stamp[:8], region), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={signature}")


class _Reply:
    """A response's head, and its body read from the socket (content-length or chunked)."""

    def __init__(self, sock: socket.socket, origin: tuple[str, str, int], status: int, headers: dict[str, str],
                 rest: memoryview) -> None:
        self.sock, self.origin, self.status, self.headers = sock, origin, status, headers
        self._rest = rest  # body bytes that came with the head
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left = -1 if self._chunked or length is None else int(length)  # -1: until the end
        self._chunk_left = 0
        self._done = self._left == 0
        self.keep_alive = headers.get("connection", "").lower() != "close" and (self._chunked or length is not None)

    def _raw_into(self, view: memoryview) -> int:
        if self._rest:
            n = min(len(view), len(self._rest))
            view[:n] = self._rest[:n]
            self._rest = self._rest[n:]
            return n
        return self.sock.recv_into(view)

    def _line(self) -> bytes:
        """A chunk-size or trailer line; read in blocks, what follows it is kept for the body."""
        line = bytearray()
        while True:
            if not self._rest:
                block = bytearray(4096)
                n = self.sock.recv_into(block)
                if n == 0:
                    raise ConnectionResetError("reply ended inside a chunk header")
                self._rest = memoryview(block)[:n]
            end = bytes(self._rest[:1026]).find(b"\n")
            if end < 0:
                line += self._rest
                self._rest = self._rest[len(self._rest):]
            else:
                line += self._rest[:end + 1]
                self._rest = self._rest[end + 1:]
                if line.endswith(b"\r\n"):
                    return bytes(line[:-2])
            if len(line) > 1024:
                raise OSError("malformed chunked reply")

    def readinto(self, view: memoryview) -> int:
        """Up to len(view) body bytes; 0 at the body's end."""
        if self._done or not len(view):
            return 0
        if self._chunked:
            if self._chunk_left == 0:
                size = int(self._line().split(b";")[0] or b"0", 16)
                if size == 0:
                    while self._line():  # trailers
                        pass
                    self._done = True
                    return 0
                self._chunk_left = size
            view = view[:self._chunk_left]
        elif self._left > 0:
            view = view[:self._left]
        n = self._raw_into(view)
        if n == 0:
            if self._left < 0 and not self._chunked:
                self._done = True  # delimited by the connection's end
                return 0
            raise ConnectionResetError("reply ended early")
        if self._chunked:
            self._chunk_left -= n
            if self._chunk_left == 0 and self._line() != b"":
                raise OSError("malformed chunked reply")
        elif self._left > 0:
            self._left -= n
            self._done = self._left == 0
        return n

    def fill(self, view: memoryview) -> int:
        """Fill ``view`` unless the body ends first; how many bytes came."""
        got = 0
        while got < len(view):
            n = self.readinto(view[got:])
            if n == 0:
                break
            got += n
        return got

    def drain(self, limit: int = 64 << 10) -> bytes:
        out = bytearray()
        buf = bytearray(8192)
        while len(out) < limit:
            n = self.readinto(memoryview(buf))
            if n == 0:
                return bytes(out)
            out += buf[:n]
        self.keep_alive = False
        return bytes(out)

    @property
    def finished(self) -> bool:
        return self._done

    def settle(self) -> bool:
        """True if the body has been read to its end: a chunked body's last chunk is read here
        (a connection is reused only after its reply ended)."""
        if not self._done and self._chunked and self._chunk_left == 0:
            try:
                probe = bytearray(1)
                if self.readinto(memoryview(probe)):
                    return False  # more body than was asked for
            except OSError:
                return False
        return self._done


class _Pool:
    """Idle connections per (scheme, host, port): most recently used first."""

    def __init__(self, settings: S3Resolution) -> None:
        self._settings = settings
        self._idle: dict[tuple[str, str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        self._pid = os.getpid()  # a forked child must not share its parent's connections

    def _context(self) -> ssl.SSLContext:
        with self._lock:
            if self._tls is None:
                verify = self._settings.verify
                context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
                if verify is False:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                self._tls = context
            return self._tls

    def take(self, scheme: str, host: str, port: int) -> tuple[socket.socket, bool]:
        """A connection and whether it was idle (a reused one may have been closed by the server)."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = {}, os.getpid()  # the parent's: never read or closed here
            idle = self._idle.get((scheme, host, port))
            if idle:
                return idle.pop(), True
        try:
            sock = socket.create_connection((host, port), timeout=self._settings.connect_timeout)
        except OSError as exc:
            raise ConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "https":
                sock = self._context().wrap_socket(sock, server_hostname=host)
            sock.settimeout(self._settings.read_timeout)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, (ssl.SSLError, OSError)):
                raise ConnectionError(f"TLS to {host}:{port} failed: {exc}") from exc
            raise
        return sock, False

    def give(self, scheme: str, host: str, port: int, sock: socket.socket) -> None:
        with self._lock:
            if self._pid != os.getpid():
                sock.close()
                return
            idle = self._idle.setdefault((scheme, host, port), [])
            if len(idle) < _MAX_IDLE:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()


class _Retry(Exception):
    """A reply worth asking again (5xx, throttled, a broken stream); wraps what to raise at the end."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class S3HttpClient:
    """Ranged GETs of one S3 endpoint; thread-safe (a connection per request in flight)."""

    def __init__(self, settings: "S3Resolution | S3Settings") -> None:
        if isinstance(settings, S3Settings):
            settings = resolve(settings.options())
        self.resolution = settings
        self.attempts = settings.attempts
        self.read_timeout = settings.read_timeout
        self.requester_pays = settings.requester_pays
        self._signer = _Signer()
        self._pool = _Pool(settings)
        self._regions: dict[str, str] = {}  # bucket -> region learnt from a redirect
        self._sleep: Callable[[float], None] = time.sleep

    def close(self) -> None:
        self._pool.close()

    def _target(self, bucket: str, key: str) -> tuple[str, str, int, str, str, str]:
        """(scheme, host, port, Host header, path, signing region) for a key, where botocore
        would send it (a region learnt from a redirect re-resolved as botocore's redirector does)."""
        target = self.resolution.target(bucket, self._regions.get(bucket, ""))
        return (target.scheme, target.host, target.port, target.netloc,
                f"{target.base}/{urllib.parse.quote(key, safe='/~')}", target.region)

    def _request(self, bucket: str, key: str, first: int, last: int | None, if_match: str) -> _Reply:
        """Send one ranged GET of a key (``if_match``: pinned to that ETag) and read its head."""
        headers = {"range": f"bytes={first}-" + ("" if last is None else str(last))}
        if if_match:
            headers["if-match"] = f'"{if_match}"'
        return self._send(bucket, key, "", headers)

    def _send(self, bucket: str, key: str, query: str, extra: dict[str, str]) -> _Reply:
        """Send one signed GET (``query``: already encoded, sorted as the signature wants it) and
        read its head; a kept-alive connection closed meanwhile is redialled, a wrong region
        learnt from the reply and asked again once."""
        credentials = self.resolution.credentials()
        for _ in range(2):  # a learnt region, once
            scheme, host, port, host_header, path, region = self._target(bucket, key)
            headers = {"host": host_header, **extra}
            if self.requester_pays:
                headers["x-amz-request-payer"] = "requester"
            if credentials is not None:
                self._signer.sign(credentials, region, path, query, headers)
            target = f"{path}?{query}" if query else path
            message = (f"GET {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                       + "\r\n").encode("latin-1")
            reply = self._exchange(scheme, host, port, message)
            learnt = reply.headers.get("x-amz-bucket-region", "")
            if reply.status in (301, 307, 400) and learnt and learnt != region:
                reply.drain()
                self._done(reply)
                self._regions[bucket] = check_region(learnt)  # it goes into the Host header
                continue
            return reply
        return reply

    def _exchange(self, scheme: str, host: str, port: int, message: bytes) -> _Reply:
        while True:
            try:
                sock, reused = self._pool.take(scheme, host, port)
            except ConnectionError as exc:
                raise _Retry(exc) from exc
            try:
                sock.sendall(message)
                return self._head(sock, (scheme, host, port))
            except OSError as exc:  # refused, reset, timed out, TLS
                sock.close()
                if reused and isinstance(exc, (ConnectionError, ssl.SSLError)) and not isinstance(exc, _Started):
                    continue  # the server closed an idle connection: a fresh one, not an attempt
                if isinstance(exc, TimeoutError):
                    raise _Retry(TimeoutError(f"no reply from {host}:{port} in {self.read_timeout:g} s"))
                raise _Retry(ConnectionError(f"{host}:{port}: {exc}")) from exc

    @staticmethod
    def _head(sock: socket.socket, origin: tuple[str, str, int]) -> _Reply:
        # Small at first (grown as needed): what the head's recv takes of the body is copied
        # into the page afterwards, and a 64 KiB buffer zeroed for every GET took 64 KiB of it.
        buf = bytearray(_HEAD_START)
        n = 0
        while True:
            if n == len(buf):
                if n >= _MAX_HEAD:
                    raise _Started("reply head too large")
                buf.extend(bytes(n))
            got = sock.recv_into(memoryview(buf)[n:])
            if not got:
                if n:
                    raise _Started(f"reply ended inside its head ({n} bytes)")
                raise ConnectionResetError("connection closed before a reply")
            n += got
            end = buf.find(b"\r\n\r\n", max(0, n - got - 3), n)
            if end >= 0:
                break
        view = memoryview(buf)
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _Started(f"not an HTTP reply: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if parts[0] == "HTTP/1.0" and "keep-alive" not in headers.get("connection", "").lower():
            headers["connection"] = "close"
        return _Reply(sock, origin, int(parts[1]), headers, view[end + 4:n])

    def _done(self, reply: _Reply) -> None:
        if reply.keep_alive and reply.settle():
            self._pool.give(*reply.origin, reply.sock)
        else:
            reply.sock.close()

    def _fail(self, reply: _Reply, where: str, version: str) -> BaseException:
        """The exception for a reply that is not data (its body read, its connection settled)."""
        try:
            body = reply.drain()
        except OSError:
            body = b""
        reply.sock.close()
        code = _xml_field(body, "Code") or f"HTTP {reply.status}"
        message = _xml_field(body, "Message")
        text = f"{where}: {code}" + (f" ({message})" if message else "")
        status = reply.status
        if status == 412:
            return StaleObjectError(f"{where} changed in the store (ETag {version} no longer matches)")
        if status == 404:
            return FileNotFoundError(f"{where}: no such object ({code})")
        if status == 403:
            return PermissionError(text)
        if status in _RETRY_STATUS or code in ("SlowDown", "RequestTimeout", "InternalError"):
            return _Retry(OSError(text))
        return OSError(text)

    def _pause(self, attempt: int) -> None:
        """Backoff before attempt ``attempt + 1``: 50 ms doubling, at most 2 s, jittered."""
        self._sleep(min(2.0, 0.05 * 2 ** (attempt - 1)) * (0.5 + random.random()))

    def get(self, bucket: str, key: str, start: int, sizes: Sequence[int], version: str,
            deliver: PieceSink) -> None:
        """Bytes from ``start`` in pieces of ``sizes``, each filled straight from the socket and
        handed to ``deliver(i, piece)`` as it completes. ``version``: the ETag the bytes must
        have ("" = any)."""
        where = f"s3://{bucket}/{key}"
        done, at, attempt = 0, start, 0
        total_end = start + sum(sizes)
        while done < len(sizes):
            attempt += 1
            try:
                self._get_once(bucket, key, at, total_end, sizes, done, version, where, deliver)
                return
            except _Progress as progress:  # some pieces came before the stream broke
                done, at = progress.done, progress.at
                error = progress.error
                if progress.done > 0 and not version:
                    version = progress.etag  # the rest must be of the same version
            except _Retry as retry:
                error = retry.error
            if attempt >= self.attempts:
                raise error from None
            self._pause(attempt)

    def _get_once(self, bucket: str, key: str, at: int, total_end: int, sizes: Sequence[int], done: int,
                  version: str, where: str, deliver: PieceSink) -> None:
        reply = self._request(bucket, key, at, total_end - 1, version)
        if reply.status not in (200, 206):
            raise self._fail(reply, where, version)
        if reply.status == 206:
            got_range = _content_range(reply.headers.get("content-range", ""))
            if got_range is None or got_range[0] != at:
                reply.sock.close()
                raise OSError(f"{where}: asked bytes {at}-, got {reply.headers.get('content-range')!r}")
        elif at != 0:  # 200: the whole object, the range ignored
            reply.sock.close()
            raise OSError(f"{where}: the store ignored the range")
        etag = reply.headers.get("etag", "").strip('"')
        i = done
        try:
            while i < len(sizes):
                size = sizes[i]
                piece, view = _new_piece(size)
                n = reply.fill(view)
                if n < size:
                    if reply.finished:  # the object ends before the range does
                        raise StaleObjectError(f"{where}: stream ended at {at + n}, expected {total_end}")
                    raise ConnectionResetError("reply ended early")
                deliver(i, piece)
                i, at = i + 1, at + size
        except StaleObjectError:
            reply.sock.close()
            raise
        except (ConnectionError, TimeoutError, ssl.SSLError) as exc:
            reply.sock.close()
            raise _Progress(i, at, etag, ConnectionError(f"{where}: stream broke at {at}: {exc}")) from exc
        except BaseException:
            reply.sock.close()
            raise
        if reply.status == 200 and not reply.finished:
            reply.sock.close()  # the rest of a whole object we did not ask for
        else:
            self._done(reply)

    def list_page(self, bucket: str, prefix: str, delimiter: str = "/", token: str = "",
                  max_keys: int = 1000, start_after: str = "") -> tuple[list[tuple[str, int, str, float]], list[str], str]:
        """One ListObjectsV2 page: (objects as (key, size, etag, mtime), common prefixes, the
        token of the next page or ""). Keys travel URL-encoded (``encoding-type=url``)."""
        where = f"s3://{bucket}/{prefix}"
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url", "max-keys": str(max_keys)}
        if delimiter:
            query["delimiter"] = delimiter
        if token:
            query["continuation-token"] = token
        if start_after:
            query["start-after"] = start_after
        attempt = 0
        while True:
            attempt += 1
            try:
                reply = self._send(bucket, "", _encode_query(query), {})
                if reply.status != 200:
                    raise self._fail(reply, where, "")
                try:
                    body = reply.drain(limit=64 << 20)
                except (ConnectionError, TimeoutError, ssl.SSLError) as exc:
                    reply.sock.close()
                    raise _Retry(ConnectionError(f"{where}: listing broke: {exc}")) from exc
                self._done(reply)
                return _parse_listing(body)
            except _Retry as retry:
                if attempt >= self.attempts:
                    raise retry.error from retry
            self._pause(attempt)

    def first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, dict[str, str]]:
        """The first ``length`` bytes of whatever version is there (fewer for a smaller object),
        and the reply's headers (ETag, Content-Range, Last-Modified): a cold open in one GET."""
        where = f"s3://{bucket}/{key}"
        attempt = 0
        while True:
            attempt += 1
            try:
                reply = self._request(bucket, key, 0, length - 1, "")
                if reply.status != 206:
                    if reply.status == 200:
                        reply.sock.close()
                        raise OSError(f"{where}: the store ignored the range")
                    raise self._fail(reply, where, "")
                got = _content_range(reply.headers.get("content-range", ""))
                if got is None:
                    reply.sock.close()
                    raise OSError(f"{where}: no Content-Range in the reply")
                size = got[1] - got[0] + 1
                piece, view = _new_piece(size)
                try:
                    if reply.fill(view) != size:
                        raise ConnectionResetError("reply ended early")
                except (ConnectionError, TimeoutError, ssl.SSLError) as exc:
                    reply.sock.close()
                    raise _Retry(ConnectionError(f"{where}: stream broke: {exc}")) from exc
                self._done(reply)
                return piece, reply.headers
            except _Retry as retry:
                if attempt >= self.attempts:
                    raise retry.error from retry
            self._pause(attempt)


class _Started(ConnectionError):
    """The server answered something: not a stale kept-alive connection."""


class _Progress(Exception):
    def __init__(self, done: int, at: int, etag: str, error: BaseException) -> None:
        super().__init__(str(error))
        self.done, self.at, self.etag, self.error = done, at, etag, error


def _new_piece(size: int) -> tuple[bytes | bytearray, memoryview]:
    if rawbytes.SUPPORTED:
        return rawbytes.fillable_bytes(size)
    buf = bytearray(size)
    return buf, memoryview(buf)


def _content_range(value: str) -> tuple[int, int, int | None] | None:
    """(first, last, total) of 'bytes a-b/total' (total None where '*')."""
    match = re.match(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)", value)
    if not match:
        return None
    total = match.group(3)
    return int(match.group(1)), int(match.group(2)), None if total == "*" else int(total)


def _parse_listing(body: bytes) -> tuple[list[tuple[str, int, str, float]], list[str], str]:
    """(objects, common prefixes, next token) of a ListObjectsV2 reply body."""
    fields = _FIELDS
    encoded = (m := fields[b"EncodingType"].search(body)) is not None and m.group(1).strip() == b"url"

    def name(raw: bytes) -> str:
        text = _xml_text(raw)
        return urllib.parse.unquote_plus(text) if encoded else text

    objects = []
    for block in _CONTENTS.findall(body):
        key, size, etag, modified = (fields[f].search(block) for f in (b"Key", b"Size", b"ETag", b"LastModified"))
        if key is None:
            raise OSError("a listing entry without a key")
        objects.append((name(key.group(1)), int(size.group(1)) if size else 0,
                        _xml_text(etag.group(1)).strip('"') if etag else "",
                        _listed_time(modified.group(1).decode()) if modified else 0.0))
    prefixes = [name(raw) for raw in _COMMON.findall(body)]
    truncated = (m := fields[b"IsTruncated"].search(body)) is not None and m.group(1).strip() == b"true"
    token = fields[b"NextContinuationToken"].search(body) if truncated else None
    if truncated and token is None:
        raise OSError("a truncated listing without a continuation token")
    return objects, prefixes, _xml_text(token.group(1)) if token else ""


def _xml_field(body: bytes, name: str) -> str:
    match = re.search(rb"<%s>([^<]{0,300})</%s>" % (name.encode(), name.encode()), body)
    return match.group(1).decode("utf-8", "replace") if match else ""


_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                        "Nov", "Dec"), start=1)}


def _last_modified(value: str) -> float:
    """Seconds since the epoch of an HTTP date (``Sat, 05 Dec 2026 09:18:29 GMT``; 0.0 if it is
    not one). Split by hand: ``strptime`` cost ~0.1 ms, one per cold object."""
    parts = value.split()
    try:
        if len(parts) == 6 and parts[5] in ("GMT", "UTC") and parts[2] in _MONTHS:
            hour, minute, second = (int(x) for x in parts[4].split(":"))
            return float(calendar.timegm((int(parts[3]), _MONTHS[parts[2]], int(parts[1]), hour, minute, second)))
        return _mtime_of({"mtime": email.utils.parsedate_to_datetime(value)})
    except (TypeError, ValueError, IndexError):
        return 0.0


def _split(fs: fsspec.AbstractFileSystem, store_path: str) -> tuple[str, str]:
    """(bucket, key) of a store path: split here for the plain ``bucket/key`` the worker passes
    (s3fs's ``split_path`` cost ~0.1 ms, one per cold object), by s3fs for anything else."""
    if "://" not in store_path and "?" not in store_path and not store_path.startswith("/"):
        bucket, _, key = store_path.partition("/")
        return bucket, key
    bucket, key, _ = fs.split_path(store_path)
    return bucket, key


class HttpS3Backend(_S3Backend):
    """``_S3Backend`` with its data reads over :class:`S3HttpClient` (one per mount's settings)."""

    def __init__(self, settings: "S3Resolution | S3Settings") -> None:
        self.client = S3HttpClient(settings)
        self.resolution = self.client.resolution

    def ls(self, fs: fsspec.AbstractFileSystem, store_path: str) -> list[dict[str, Any]]:
        """A directory's entries as s3fs's ``ls(detail=True)`` gives them, listed with lean
        ListObjectsV2 requests; anything else (a bucket's root, a file's path, nothing found, an
        error other than an unreachable store) is left to s3fs, which knows those cases."""
        bucket, key = _split(fs, store_path)
        if not bucket or not key.strip("/"):
            return super().ls(fs, store_path)
        prefix = key.rstrip("/") + "/"
        entries: list[dict[str, Any]] = []
        token = ""
        try:
            while True:
                objects, prefixes, token = self.client.list_page(bucket, prefix, "/", token)
                for name, size, etag, mtime in objects:  # a directory's marker ("d/") too, as s3fs lists it
                    entries.append({"name": f"{bucket}/{name}", "size": size, "type": "file",
                                    "ETag": f'"{etag}"', "LastModified": mtime})
                for name in prefixes:
                    entries.append({"name": f"{bucket}/{name.rstrip('/')}", "size": 0, "type": "directory"})
                if not token:
                    break
        except ConnectionError:
            raise
        except Exception:  # noqa: BLE001 - s3fs answers it, or says what is wrong
            return super().ls(fs, store_path)
        return entries if entries else super().ls(fs, store_path)

    def list_after(self, fs: fsspec.AbstractFileSystem, store_path: str, recursive: bool, after: str,
                   limit: int) -> tuple[list[dict[str, Any]], bool] | None:
        """A recursive listing's page as one lean ListObjectsV2 request (``start-after``); other
        errors than an unreachable store are left to s3fs's request, which says what is wrong."""
        bucket, key = _split(fs, store_path)
        if not recursive or not bucket:
            return None
        prefix = key.strip("/") + "/" if key.strip("/") else ""

        def page(start_after: str) -> tuple[list[tuple[str, int, str, float]], bool]:
            objects, _, token = self.client.list_page(bucket, prefix, "", "", limit, start_after)
            return objects, not token

        try:
            return s3_pages(bucket, prefix, after, page)
        except ConnectionError:
            raise
        except Exception:  # noqa: BLE001
            return super().list_after(fs, store_path, recursive, after, limit)

    def read(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, end: int, version: str) -> bytes:
        if end <= start:
            return b""
        out: list[bytes] = []
        self.read_pieces(fs, store_path, start, [end - start], version, lambda i, piece: out.append(piece))
        return out[0]

    def read_pieces(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, sizes: Sequence[int],
                    version: str, deliver: PieceSink) -> None:
        """One ranged GET (If-Match), each piece filled from the socket and delivered as it completes."""
        if sum(sizes) <= 0:
            return
        bucket, key = _split(fs, store_path)
        self.client.get(bucket, key, start, sizes, version, deliver)

    def head_read(self, fs: fsspec.AbstractFileSystem, store_path: str,
                  length: int) -> tuple[tuple[int, str, float, bool], bytes | None]:
        """One GET for metadata and the first ``length`` bytes; anything unusual (a prefix, an
        empty object, an error other than an unreachable store) is left to s3fs's HEAD."""
        bucket, key = _split(fs, store_path)
        if not key or length <= 0:
            return self.info(fs, store_path), None
        try:
            data, headers = self.client.first_bytes(bucket, key, length)
        except ConnectionError:
            raise  # the store is down: asking again with a HEAD would only double the wait
        except Exception:  # noqa: BLE001 - a prefix, an empty object (416), a real error: info() tells
            return self.info(fs, store_path), None
        total = _content_range(headers.get("content-range", ""))
        version = headers.get("etag", "").strip('"')
        if total is None or total[2] is None or not version:
            return self.info(fs, store_path), None
        return (total[2], version, _last_modified(headers.get("last-modified", "")), False), data
