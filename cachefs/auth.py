"""Tokens on the wire: one gRPC metadata key, sent by callers and checked by servers.

Two secrets may ride on it. The *access token* (``access_token`` on the daemons, ``token`` on
clients) is checked on every call to every gRPC port by :class:`TokenCheck`. The *cluster
token* is the stronger one: daemons present it to each other, and the master asks for it on
calls that change the cluster or hand out credentials; a caller holding it passes the access
check too. Comparisons are constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from cachefs.errors import UnauthenticatedError, abort

log = logging.getLogger(__name__)

TOKEN_METADATA = "x-cachefs-token"


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata that carries ``token`` (none when there is no token)."""
    return ((TOKEN_METADATA, token),) if token else ()


def presented_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token a call carries ('' if none); the first one counts."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def token_matches(presented: str, accepted: Iterable[str]) -> bool:
    """Constant-time check of ``presented`` against every non-empty accepted token."""
    ok = False
    given = presented.encode()
    for token in accepted:
        if token:
            ok |= hmac.compare_digest(given, token.encode())
    return ok


class _WithToken:
    """A multi-callable that adds the token to each call's metadata (unless the call has one).

    Thinner than ``grpc.intercept_channel``, whose unary path goes through futures: ~35 us a
    call here, a tenth of a small read.
    """

    __slots__ = ("_inner", "_metadata")

    def __init__(self, inner: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._inner = inner
        self._metadata = metadata

    def _merged(self, metadata: Any) -> Any:
        if not metadata:
            return self._metadata
        if any(key == TOKEN_METADATA for key, _ in metadata):
            return metadata
        return tuple(metadata) + self._metadata

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner(request, timeout=timeout, metadata=self._merged(metadata), **kwargs)

    def with_call(self, request: Any, timeout: float | None = None, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner.with_call(request, timeout=timeout, metadata=self._merged(metadata), **kwargs)

    def future(self, request: Any, timeout: float | None = None, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner.future(request, timeout=timeout, metadata=self._merged(metadata), **kwargs)


class WrappedChannel(grpc.Channel):
    """A channel whose multi-callables are wrapped by ``_wrap`` (the token here; the client's fork
    gate in client/transport/workers.py); closing it closes the channel it wraps."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel

    def _wrap(self, multicallable: Any, stream: bool) -> Any:
        """``multicallable`` as this channel hands it out; ``stream``: its responses are a stream."""
        raise NotImplementedError

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self._channel.unsubscribe(callback)

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._channel.unary_unary(*args, **kwargs), False)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._channel.unary_stream(*args, **kwargs), True)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._channel.stream_unary(*args, **kwargs), False)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._channel.stream_stream(*args, **kwargs), True)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "WrappedChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TokenChannel(WrappedChannel):
    """A channel whose every call carries ``token`` (the channel it wraps is closed with it)."""

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        if not token:
            raise ValueError("token is empty")
        super().__init__(channel)
        self._metadata = token_metadata(token)

    def _wrap(self, multicallable: Any, stream: bool) -> Any:
        return _WithToken(multicallable, self._metadata)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    def deny(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        abort(context, UnauthenticatedError(message))

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class TokenCheck(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry one of ``accepted``.

    ``open_methods``: bare method names (e.g. ``"GetStatus"``) that answer without a token.
    The refusal never echoes what was presented.
    """

    def __init__(self, accepted: Iterable[str], open_methods: Iterable[str] = ()) -> None:
        self._accepted = tuple(t for t in accepted if t)
        if not self._accepted:
            raise ValueError("TokenCheck needs at least one non-empty token")
        self._open = frozenset(open_methods)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        if method in self._open:
            return handler
        if token_matches(presented_token(details.invocation_metadata), self._accepted):
            return handler
        log.debug("refused %s: no valid token", method)
        return _refusal(handler, f"{method} needs the access token (gRPC metadata {TOKEN_METADATA!r}; "
                                 "clients: token=... or CACHEFS_TOKEN)")


def outgoing_token(access_token: str, cluster_token: str) -> str:
    """What a daemon presents to its peers: the cluster token if set (it passes both checks)."""
    return cluster_token or access_token
