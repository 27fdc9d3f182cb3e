"""What the servicers share: exceptions become precise statuses (with the ``cachefs-error``
detail, see cachefs/errors.py), calls are counted and timed, objects have one wire form, and one
list of server interceptors.

Used by the worker's and the master's servicers; ``self.metrics`` must have ``requests``
(a counter by method and code) and ``request_seconds`` (a histogram by method).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc

from cachefs.auth import TokenCheck
from cachefs.errors import abort, to_status
from cachefs.proto import common_pb2
from cachefs.server.decodeguard import DecodeGuard
from cachefs.store.listed import ListedEntries
from cachefs.store.meta import ObjectMeta

log = logging.getLogger(__name__)


def _fail(servicer: Any, method: str, context: grpc.ServicerContext, exc: Exception) -> None:
    code = to_status(exc)
    servicer.metrics.requests.labels(method, code.name).inc()
    if not isinstance(exc, OSError):  # a bug, not a store or request problem: keep the trace
        log.exception("%s failed", method)
    elif code == grpc.StatusCode.INTERNAL:
        log.warning("%s failed: %s", method, exc)
    abort(context, exc)  # status, message and the cachefs-error detail (cachefs/errors.py)


def server_interceptors(access_token: str, cluster_token: str, open_methods: Iterable[str] = ()
                        ) -> list[grpc.ServerInterceptor]:
    """The interceptors a daemon's server runs: a token check when an access token is set, then
    request decoding that answers INVALID_ARGUMENT (not grpcio's INTERNAL) to a malformed message."""
    guard: list[grpc.ServerInterceptor] = [DecodeGuard()]
    if not access_token:
        return guard
    return [TokenCheck((access_token, cluster_token), open_methods), *guard]


def rpc(method: str, streaming: bool = False, timed: bool = True) -> Callable:
    """Decorate a servicer method; ``timed=False`` for streams that last as long as a client
    wants (a watch), whose duration says nothing about the service."""

    def decorate(fn: Callable) -> Callable:
        if streaming:
            @functools.wraps(fn)
            def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                t0 = time.perf_counter()
                try:
                    yield from fn(self, request, context)
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    _fail(self, method, context, exc)
                else:
                    self.metrics.requests.labels(method, "OK").inc()
                finally:
                    if timed:
                        self.metrics.request_seconds.labels(method).observe(time.perf_counter() - t0)

            stream.cachefs_rpc = method  # type: ignore[attr-defined]  # tests check every RPC has it
            return stream

        @functools.wraps(fn)
        def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                result = fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                _fail(self, method, context, exc)
            else:
                self.metrics.requests.labels(method, "OK").inc()
                return result
            finally:
                self.metrics.request_seconds.labels(method).observe(time.perf_counter() - t0)

        unary.cachefs_rpc = method  # type: ignore[attr-defined]
        return unary

    return decorate


def info_message(meta: ObjectMeta) -> common_pb2.ObjectInfo:
    """The wire form of one object or directory."""
    return info_of(str(meta.path), meta.size, meta.version, meta.mtime, meta.is_dir)


def listed_infos(entries: Sequence[ObjectMeta], start: int, end: int) -> list[common_pb2.ObjectInfo]:
    """``info_message`` of ``entries[start:end]``; a listing chunk's straight from its columns
    (cachefs/store/listed.py), no ObjectMeta made for each."""
    if not isinstance(entries, ListedEntries):
        return [info_message(m) for m in entries[start:end]]
    return [info_of(*entries.named_fields(i)) for i in range(start, min(end, len(entries)))]


def info_of(name: str, size: int, version: str, mtime: float, is_dir: bool) -> common_pb2.ObjectInfo:
    """``info_message`` from the fields (a listing's page: no ObjectMeta made for each entry)."""
    return common_pb2.ObjectInfo(path=name, size=size, version=version, mtime=mtime,
                                 type=common_pb2.DIRECTORY if is_dir else common_pb2.FILE)
