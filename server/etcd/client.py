"""A small synchronous etcd v3 client over etcd's gRPC API: several endpoints, TLS, user auth.

Why not a library: see docs/architecture.md ("Control plane on etcd"). Every call goes to the
endpoint that answered last; an endpoint that is down or times out makes the call move on to
the next one (each endpoint tried once per call, within the call's deadline), so a dead etcd
member is invisible while a majority lives. When none answers, :class:`EtcdUnavailableError`
(a ``ConnectionError``: UNAVAILABLE over gRPC) says which endpoints were tried and why.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cachefs.errors import ControlPlaneUnavailableError
from cachefs.server.etcd import api

log = logging.getLogger(__name__)

# Errors that say "this endpoint cannot serve now": try the next one.
_RETRY_ELSEWHERE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})


class EtcdUnavailableError(ControlPlaneUnavailableError):
    """No etcd endpoint answered within the deadline (UNAVAILABLE when it ends an RPC)."""


class EtcdError(OSError):
    """etcd answered with an error that another endpoint would repeat (bad request, auth)."""


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is and how to talk to it (the master's ``etcd_*`` settings)."""

    endpoints: tuple[str, ...]
    ca_file: str = ""  # PEM CA: use TLS and verify etcd with it (https:// endpoints imply TLS)
    cert_file: str = ""  # client certificate (etcd --client-cert-auth)
    key_file: str = ""
    user: str = ""  # etcd user auth (etcd auth enable): name and password
    password: str = field(default="", repr=False)
    timeout: float = 3.0  # seconds for one call over every endpoint (rides out an etcd leader election)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("etcd endpoints are empty")
        for url in self.endpoints:
            _target(url)
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("etcd cert_file and key_file go together")
        if self.password and not self.user:
            raise ValueError("etcd password without a user")
        if self.timeout <= 0:
            raise ValueError("etcd timeout must be > 0")

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file) or any(u.startswith("https://") for u in self.endpoints)


def settings_of(config: Any) -> EtcdSettings:
    """A master config's ``etcd*`` fields as settings (files checked to exist)."""
    for name in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"):
        path = getattr(config, name)
        if path and not Path(path).is_file():
            raise ValueError(f"{name}: no such file {path!r}")
    return EtcdSettings(tuple(config.etcd), ca_file=config.etcd_ca_file, cert_file=config.etcd_cert_file,
                        key_file=config.etcd_key_file, user=config.etcd_user, password=config.etcd_password,
                        timeout=config.etcd_timeout)


def _target(url: str) -> str:
    """``http://h:2379`` / ``https://h:2379`` / ``h:2379`` -> ``h:2379``."""
    text = url.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {url!r}: expected [http[s]://]HOST:PORT")
    return text


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class EtcdClient:
    """Thread-safe. ``close()`` ends it (and the watches it runs)."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._targets = [_target(u) for u in settings.endpoints]
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._current = 0
        self._token = ""
        self._closed = threading.Event()
        self._creds = None
        if settings.tls:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=_read(settings.ca_file) if settings.ca_file else None,
                private_key=_read(settings.key_file) if settings.key_file else None,
                certificate_chain=_read(settings.cert_file) if settings.cert_file else None)

    # -- plumbing --

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
                           ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 3_000)]
                channel = (grpc.secure_channel(target, self._creds, options) if self._creds is not None
                           else grpc.insecure_channel(target, options))
                self._channels[target] = channel
            return channel

    def _order(self) -> list[int]:
        with self._lock:
            start = self._current
        n = len(self._targets)
        return [(start + i) % n for i in range(n)]

    def _metadata(self) -> list[tuple[str, str]]:
        return [("token", self._token)] if self._token else []

    def _authenticate(self, channel: grpc.Channel, timeout: float) -> None:
        path, req_cls, resp_cls = api.METHODS["Authenticate"]
        call = channel.unary_unary(path, request_serializer=req_cls.SerializeToString,
                                   response_deserializer=resp_cls.FromString)
        resp = call(req_cls(name=self.settings.user, password=self.settings.password), timeout=timeout)
        self._token = resp.token

    def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary call, moving through the endpoints until one answers or time runs out."""
        if self._closed.is_set():
            raise EtcdUnavailableError("the etcd client is closed")
        path, req_cls, resp_cls = api.METHODS[method]
        budget = self.settings.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        errors: list[str] = []
        n = len(self._targets)
        attempt = 0
        # Round after round over the endpoints until the deadline: a member that lives but has no
        # raft leader for a moment (the leader was the member that died) answers again ~1 s later.
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            index = self._order()[0] if attempt % n == 0 else (self._order()[0] + attempt) % n
            if attempt and attempt % n == 0:
                time.sleep(min(0.1, left / 4))  # a full round failed: a breath before the next
                left = deadline - time.monotonic()
                if left <= 0:
                    break
            attempt += 1
            # One endpoint's share of what is left, so a hung one leaves time for the others.
            share = max(min(left, 0.5), left / n)
            target = self._targets[index]
            channel = self._channel(target)
            call = channel.unary_unary(path, request_serializer=req_cls.SerializeToString,
                                       response_deserializer=resp_cls.FromString)
            try:
                if self.settings.user and not self._token:
                    self._authenticate(channel, share)
                resp = call(request, timeout=share, metadata=self._metadata())
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAUTHENTICATED and self.settings.user and self._token:
                    self._token = ""  # an expired token: authenticate again on the next try
                    errors.append(f"{target}: token expired")
                    continue
                if code in _RETRY_ELSEWHERE:
                    errors.append(f"{target}: {code.name}")
                    continue
                raise EtcdError(f"etcd {method} at {target}: {code.name}: {err.details()}") from None
            with self._lock:
                self._current = index
            return resp
        raise EtcdUnavailableError(f"etcd unreachable within {budget:.1f}s ({'; '.join(errors[-n:]) or 'no time left'})")

    # -- KV --

    def get_prefix(self, prefix: bytes, timeout: float | None = None, revision: int = 0) -> Any:
        """Every key under ``prefix`` (at ``revision``, or the latest)."""
        return self.unary("Range", api.RangeRequest(key=prefix, range_end=api.prefix_end(prefix), revision=revision),
                          timeout)

    def get(self, key: bytes, timeout: float | None = None) -> Any:
        """The key's KeyValue, or None."""
        resp = self.unary("Range", api.RangeRequest(key=key), timeout)
        return resp.kvs[0] if resp.kvs else None

    def txn(self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = (),
            timeout: float | None = None) -> Any:
        return self.unary("Txn", api.TxnRequest(compare=list(compare), success=list(success),
                                                failure=list(failure)), timeout)

    def put(self, key: bytes, value: bytes, lease: int = 0, timeout: float | None = None) -> Any:
        return self.unary("Put", api.PutRequest(key=key, value=value, lease=lease), timeout)

    def delete(self, key: bytes, timeout: float | None = None) -> Any:
        return self.unary("DeleteRange", api.DeleteRangeRequest(key=key), timeout)

    # -- leases --

    def grant(self, ttl: int, timeout: float | None = None) -> int:
        resp = self.unary("LeaseGrant", api.LeaseGrantRequest(TTL=int(ttl)), timeout)
        if resp.error:
            raise EtcdError(f"etcd LeaseGrant: {resp.error}")
        return resp.ID

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        try:
            self.unary("LeaseRevoke", api.LeaseRevokeRequest(ID=lease), timeout)
        except EtcdError:
            pass  # already gone

    def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renew a lease once; returns its TTL (0: the lease is gone)."""
        path, req_cls, resp_cls = api.METHODS["LeaseKeepAlive"]
        budget = self.settings.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        errors: list[str] = []
        n = len(self._targets)
        attempt = 0
        while True:  # rounds over the endpoints until the deadline, as unary calls do
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if attempt and attempt % n == 0:
                time.sleep(min(0.1, left / 4))
            index = (self._order()[0] + attempt) % n
            attempt += 1
            left = deadline - time.monotonic()
            if left <= 0:
                break
            target = self._targets[index]
            call = self._channel(target).stream_stream(path, request_serializer=req_cls.SerializeToString,
                                                       response_deserializer=resp_cls.FromString)
            try:
                stream = call(iter([req_cls(ID=lease)]), timeout=max(min(left, 0.5), left / n),
                              metadata=self._metadata())
                resp = next(stream, None)
                stream.cancel()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED and self.settings.user:
                    self._token = ""
                errors.append(f"{target}: {err.code().name}")
                continue
            if resp is None:
                errors.append(f"{target}: no answer")
                continue
            with self._lock:
                self._current = index
            return int(resp.TTL)
        raise EtcdUnavailableError(f"etcd unreachable for a lease keep-alive ({'; '.join(errors[-n:]) or 'no time left'})")

    # -- watches --

    def watch_prefix(self, prefix: bytes, start_revision: int,
                     on_events: Callable[[int, list[Any]], None],
                     on_reset: Callable[[], int], name: str = "cachefs-etcd-watch") -> "Watch":
        """Watch ``prefix`` from ``start_revision`` on a thread: ``on_events(revision, events)``
        for each batch. When the watch cannot continue where it was (history compacted),
        ``on_reset()`` reloads everything and returns the revision to continue after."""
        watch = Watch(self, prefix, start_revision, on_events, on_reset, name)
        watch.start()
        return watch

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


class Watch:
    """One prefix watch, reconnecting through the endpoints and resuming at the next revision."""

    def __init__(self, client: EtcdClient, prefix: bytes, start_revision: int,
                 on_events: Callable[[int, list[Any]], None], on_reset: Callable[[], int], name: str) -> None:
        self._client = client
        self._prefix = prefix
        self._next = start_revision
        self._on_events = on_events
        self._on_reset = on_reset
        self._stop = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def _requests(self, done: "queue.Queue[None]") -> Iterator[Any]:
        yield api.WatchRequest(create_request=api.WatchCreateRequest(
            key=self._prefix, range_end=api.prefix_end(self._prefix), start_revision=self._next,
            progress_notify=True))
        while not self._stop.is_set():
            try:
                done.get(timeout=1.0)
                return
            except queue.Empty:
                continue

    def _run(self) -> None:
        path, req_cls, resp_cls = api.METHODS["Watch"]
        failures = 0
        while not self._stop.is_set() and not self._client.closed:
            # The endpoint that answered last, then the others in turn while reconnecting fails.
            index = (self._client._order()[0] + failures) % len(self._client._targets)
            target = self._client._targets[index]
            done: queue.Queue[None] = queue.Queue()
            try:
                call = self._client._channel(target).stream_stream(
                    path, request_serializer=req_cls.SerializeToString, response_deserializer=resp_cls.FromString)
                # "hasleader": a member cut off from etcd's raft leader ends the watch (etcd's
                # WithRequireLeader) instead of going silent, so it moves to another member.
                self._call = call(self._requests(done), metadata=self._client._metadata() + [("hasleader", "true")])
                for resp in self._call:
                    if resp.compact_revision:
                        log.warning("etcd watch of %r: history compacted at %d; reloading",
                                    self._prefix, resp.compact_revision)
                        self._next = self._on_reset() + 1
                        break
                    if resp.canceled:
                        raise EtcdError(f"watch cancelled: {resp.cancel_reason}")
                    if resp.created:
                        self.connected.set()
                    failures = 0
                    if resp.events:
                        revision = max(e.kv.mod_revision for e in resp.events)
                        self._on_events(revision, list(resp.events))
                        self._next = revision + 1
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning("etcd watch at %s: %s; reconnecting", target, err.code().name)
            except Exception:  # noqa: BLE001 - the watch must outlive one bad batch
                failures += 1
                log.exception("etcd watch of %r failed; reconnecting", self._prefix)
            finally:
                done.put(None)
                self.connected.clear()
            self._stop.wait(min(1.0, 0.1 * failures))

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout)
