"""The master's channels to workers (for jobs and stat): one per address, opened on first use.

The token, when set, rides on every call through the channel (cachefs/tls.py), so callers (and
the fakes that tests put in place of this class) never handle it; so does TLS.
"""

from __future__ import annotations

import threading

import grpc

from cachefs.proto import worker_pb2_grpc
from cachefs.tls import PLAINTEXT, TLSConfig, open_channel


class WorkerStubs:
    """``stubs(address)`` -> a WorkerService stub; thread-safe; ``close()`` closes every channel."""

    def __init__(self, cluster_token: str = "", tls: TLSConfig = PLAINTEXT) -> None:
        self._token = cluster_token
        self._tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._closed = False

    def __call__(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        with self._lock:
            if self._closed:
                raise ConnectionError("the master is stopping")
            entry = self._channels.get(address)
            if entry is None:
                channel = open_channel(address, self._tls, token=self._token)
                entry = self._channels[address] = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
            return entry[1]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [channel for channel, _ in self._channels.values()]
            self._channels.clear()
        for channel in channels:
            channel.close()
