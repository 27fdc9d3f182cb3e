"""The master's channels to workers (for jobs and stat): one per address, opened on first use.

The cluster token, when set, rides on every call through an interceptor, so callers (and the
fakes that tests put in place of this class) never handle it.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from cachefs.auth import TOKEN_METADATA

from cachefs.proto import worker_pb2_grpc



class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        metadata = list(details.metadata or ()) + [(TOKEN_METADATA, self._token)]
        return continuation(_CallDetails(details, metadata), request)


class WorkerStubs:
    """``stubs(address)`` -> a WorkerService stub; thread-safe; ``close()`` closes every channel."""

    def __init__(self, cluster_token: str = "") -> None:
        self._token = cluster_token
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._closed = False

    def __call__(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        with self._lock:
            if self._closed:
                raise ConnectionError("the master is stopping")
            entry = self._channels.get(address)
            if entry is None:
                channel = grpc.insecure_channel(address)
                if self._token:
                    channel = grpc.intercept_channel(channel, _TokenInterceptor(self._token))
                entry = self._channels[address] = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
            return entry[1]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [channel for channel, _ in self._channels.values()]
            self._channels.clear()
        for channel in channels:
            channel.close()
