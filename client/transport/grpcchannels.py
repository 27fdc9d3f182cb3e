"""The client's gRPC channels to workers, loaded only by a process that uses gRPC.

Channels are gRPC's *synchronous* ones, on purpose: grpc.aio channels hang or crash in forked
children (DataLoader workers) even when the child opens new ones. A training process that
follows the view through the master's client port and reads over the workers' sockets never
imports this module (client/transport/masterport.py, client/transport/bulkpaths.py); the admin paths, writes and a
cluster without those sockets (TLS) do.
"""

from __future__ import annotations

from typing import Any

import grpc
import grpc.experimental

from cachefs.auth import WrappedChannel
from cachefs.client.forksafe import RpcGate
from cachefs.tls import MESSAGE_OPTIONS, open_channel

#: Every client channel: its own connections, not gRPC's process-wide subchannel pool. A forked
#: child's new channel would otherwise be handed the parent's connection, which is not the
#: child's: its first call then hangs past the deadline or fails with "Wrong file descriptor
#: generation" (1 to 4 forks in 100 with readers busy in the parent before this option, none in 600
#: after: /tmp experiment, in-process and separate worker).
OWN_CONNECTIONS = ("grpc.use_local_subchannel_pool", 1)

#: A response stream read by the calling thread itself, with no helper thread per call. Also
#: what lets a fork hook cancel a stream: with grpcio's fork support on, a helper-thread stream
#: does not see its cancellation until the fork is over (the hook waited its whole budget).
SINGLE_THREADED_STREAMS = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)

CHANNEL_OPTIONS = [
    *MESSAGE_OPTIONS,  # the worker's own limits (cachefs/tls.py)
    # A fresh connection attempt soon after a worker comes back, not minutes later.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    SINGLE_THREADED_STREAMS,
    OWN_CONNECTIONS,
]


class _GatedCall:
    """A multi-callable whose blocking calls (and each step of a response stream) pass through a gate."""

    __slots__ = ("_inner", "_gate", "_stream")

    def __init__(self, inner: Any, gate: RpcGate, stream: bool) -> None:
        self._inner, self._gate, self._stream = inner, gate, stream

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        gate = self._gate
        gate.enter()
        try:
            result = self._inner(*args, **kwargs)
        finally:
            gate.leave()
        return _GatedStream(result, gate) if self._stream else result

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        gate = self._gate
        gate.enter()
        try:
            return self._inner.with_call(*args, **kwargs)
        finally:
            gate.leave()

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.future(*args, **kwargs)  # completes on gRPC's threads, not the caller's


class _GatedStream:
    """A response stream whose every ``next`` passes through the gate (the rest is the call's)."""

    __slots__ = ("_inner", "_gate")

    def __init__(self, inner: Any, gate: RpcGate) -> None:
        self._inner, self._gate = inner, gate

    def __iter__(self) -> "_GatedStream":
        return self

    def __next__(self) -> Any:
        gate = self._gate
        gate.enter()
        try:
            return next(self._inner)
        finally:
            gate.leave()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # cancel, code, details, trailing_metadata, ...


class GatedChannel(WrappedChannel):
    """A channel whose calls pass through ``gate`` (client/forksafe.py ``RpcGate``), so that a
    fork can wait until no thread of this process is inside one."""

    def __init__(self, channel: grpc.Channel, gate: RpcGate) -> None:
        super().__init__(channel)
        self._gate = gate

    def _wrap(self, multicallable: Any, stream: bool) -> Any:
        return _GatedCall(multicallable, self._gate, stream)


def plain_connect(address: str) -> grpc.Channel:
    """The default way to reach a worker: plaintext, no token."""
    return open_channel(address, options=CHANNEL_OPTIONS)
