"""Undecodable request messages get INVALID_ARGUMENT, not gRPC's own INTERNAL.

grpcio decodes a request before any servicer code runs, and answers a message that does
not parse with INTERNAL "Exception deserializing request!": a server fault, by its code,
for what is the caller's. This interceptor moves decoding into the handler, so the caller
gets INVALID_ARGUMENT with the method named. Install it with
``grpc.server(..., interceptors=[DecodeGuard()])``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from cachefs.errors import InvalidPathError, abort


class MalformedMessageError(InvalidPathError):
    """A streamed request message that does not parse (INVALID_ARGUMENT through the errors table)."""


def _parser(method: str, decode: Callable[[bytes], Any]) -> Callable[[bytes, grpc.ServicerContext], Any]:
    def parse(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            abort(context, MalformedMessageError(f"{method}: malformed request message ({exc})"))

    return parse


class DecodeGuard(grpc.ServerInterceptor):
    """Decode requests inside the handler; a message that does not parse -> INVALID_ARGUMENT."""

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = _parser(handler_call_details.method, handler.request_deserializer)
        out = handler.response_serializer
        if handler.unary_unary is not None:
            inner = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(
                lambda raw, ctx: inner(parse(raw, ctx), ctx), response_serializer=out)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                lambda raw, ctx: inner_stream(parse(raw, ctx), ctx), response_serializer=out)

        decode, method = handler.request_deserializer, handler_call_details.method

        def requests(raws: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[Any]:
            # Raised, not aborted: the servicer is iterating, and maps the error like its own.
            for raw in raws:
                try:
                    yield decode(raw)
                except Exception as exc:  # noqa: BLE001
                    raise MalformedMessageError(f"{method}: malformed request message ({exc})") from None

        def guarded(inner: Callable) -> Callable:
            def call(raws: Iterator[bytes], ctx: grpc.ServicerContext) -> Any:
                try:
                    return inner(requests(raws, ctx), ctx)
                except MalformedMessageError as exc:  # a servicer that let it through
                    abort(ctx, exc)
            return call

        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(guarded(handler.stream_unary), response_serializer=out)
        inner_ss = handler.stream_stream

        def both(raws: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from inner_ss(requests(raws, ctx), ctx)
            except MalformedMessageError as exc:
                abort(ctx, exc)

        return grpc.stream_stream_rpc_method_handler(both, response_serializer=out)
