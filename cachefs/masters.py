"""A list of masters (``m1:19998,m2:19998``) and which of them to call now.

With several masters (etcd) any of them answers reads and forwards what only the leader does,
so a caller only has to move on when the one it talks to is down: it stays with the master
that last answered and, on UNAVAILABLE or a deadline, tries the next (each once per call). A
master that says it knows the leader's address is preferred after that. Workers, clients and
the admin commands use this; it is plain gRPC (no etcd anywhere near a training process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from cachefs.addresses import split_addresses
from cachefs.tls import PLAINTEXT, TLSConfig, open_channel

# After UNAVAILABLE (down, stopping, no leader: the call was not carried out) any call moves on.
# After a deadline or a broken call it may have been carried out, so only calls that can be
# repeated safely move on then (a SubmitJob repeated elsewhere would make a second job).
MOVE_ON = ("UNAVAILABLE",)
MOVE_ON_IF_REPEATABLE = ("DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN")
REPEATABLE = frozenset({"GetView", "GetMounts", "GetInfo", "GetInfos", "Stat", "GetJob", "ListJobs",
                        "RegisterWorker", "Heartbeat", "CancelJob"})


class MasterList:
    """Thread-safe. ``stub()`` is the current master's; ``call(name, request, ...)`` moves on by itself."""

    def __init__(self, masters: str | Sequence[str], tls: TLSConfig = PLAINTEXT,
                 options: Sequence[tuple[str, Any]] = (), token: str = "",
                 stub_class: Callable[[Any], Any] | None = None) -> None:
        self.addresses = split_addresses(masters, "master")
        if not self.addresses:
            raise ValueError("no master address given")
        if stub_class is None:
            from cachefs.proto import master_pb2_grpc

            stub_class = master_pb2_grpc.MasterServiceStub
        self._stub_class = stub_class
        self._tls = tls
        self._options = list(options)
        self._token = token
        self._lock = threading.Lock()
        self._index = 0
        self._channels: dict[str, tuple[Any, Any]] = {}

    @property
    def current(self) -> str:
        with self._lock:
            return self.addresses[self._index]

    def __str__(self) -> str:
        return ",".join(self.addresses)

    def stub(self, address: str | None = None) -> Any:
        address = address or self.current
        with self._lock:
            entry = self._channels.get(address)
            if entry is None:
                channel = open_channel(address, self._tls, self._options, token=self._token)
                entry = self._channels[address] = (channel, self._stub_class(channel))
            return entry[1]

    def move_on(self, failed: str | None = None) -> str:
        """The next master after ``failed`` (default: the current one) becomes current."""
        with self._lock:
            if failed is None or self.addresses[self._index] == failed:
                self._index = (self._index + 1) % len(self.addresses)
            return self.addresses[self._index]

    def prefer(self, address: str) -> None:
        """Make ``address`` current if it is one of the list (the leader, as a master reported it)."""
        with self._lock:
            if address in self.addresses:
                self._index = self.addresses.index(address)

    def call(self, name: str, request: Any, **kwargs: Any) -> Any:
        """A unary call on the current master, moving through the list while masters are down."""
        import grpc

        last: grpc.RpcError | None = None
        for _ in range(len(self.addresses)):
            address = self.current
            try:
                return getattr(self.stub(address), name)(request, **kwargs)
            except grpc.RpcError as err:
                code = err.code().name
                if len(self.addresses) == 1 or not (
                        code in MOVE_ON or (code in MOVE_ON_IF_REPEATABLE and name in REPEATABLE)):
                    raise
                last = err
                self.move_on(address)
        assert last is not None
        raise last

    def close(self) -> None:
        with self._lock:
            channels = [c for c, _ in self._channels.values()]
            self._channels.clear()
        for channel in channels:
            channel.close()
