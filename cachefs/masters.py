"""A list of masters (``m1:19998,m2:19998``) and which of them to call now.

With several masters (etcd) any of them answers reads and forwards what only the leader does,
so a caller only has to move on when the one it talks to is down: it stays with the master
that last answered and, on UNAVAILABLE or a deadline, tries the next (each once per call). A
master that says it knows the leader's address is preferred after that. Workers, clients and
the admin commands use this; it is plain gRPC (no etcd anywhere near a training process).
"""

from __future__ import annotations

import threading
import time
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


def _not_soon(err: Any) -> bool:
    """A master said no leader is to be expected soon (ControlPlaneUnavailableError, ENOTCONN)."""
    from cachefs.errors import parse_detail

    return parse_detail(err).get("errno") == "ENOTCONN"


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

    def call(self, name: str, request: Any, budget: float = 0.0, **kwargs: Any) -> Any:
        """A unary call on the current master, moving through the list while masters are down.

        ``budget`` > 0: one deadline for the whole call, every master tried again (0.1 s back-off,
        doubling to 1 s) while none can carry it out, as after the leader was lost, until a new
        one is elected (its lease: server/master/election.py); each try's ``timeout`` is cut to
        what is left. 0: each master once."""
        import grpc

        deadline = time.monotonic() + budget
        pause = 0.1
        last: grpc.RpcError | None = None
        while True:
            for _ in range(len(self.addresses)):
                address = self.current
                left = deadline - time.monotonic()
                if budget > 0 and "timeout" in kwargs:
                    kwargs["timeout"] = max(0.05, min(kwargs["timeout"], left))
                try:
                    return getattr(self.stub(address), name)(request, **kwargs)
                except grpc.RpcError as err:
                    code = err.code().name
                    if not (code in MOVE_ON or (code in MOVE_ON_IF_REPEATABLE and name in REPEATABLE)):
                        raise
                    if len(self.addresses) == 1 and budget <= 0:
                        raise
                    last = err
                    self.move_on(address)
            assert last is not None
            left = deadline - time.monotonic()
            if left <= 0 or _not_soon(last):  # etcd cannot be reached: waiting for a leader would not help
                raise last
            time.sleep(min(pause, left))
            pause = min(1.0, pause * 2)

    def close(self) -> None:
        with self._lock:
            channels = [c for c, _ in self._channels.values()]
            self._channels.clear()
        for channel in channels:
            channel.close()
