"""A standby master passes what only the leader does on to the leader, as the caller sent it.

The caller's token travels with the call (the leader checks it, as if called directly), and a
marker stops a call from being passed on twice (two masters that each think the other leads,
for a moment, answer UNAVAILABLE instead of bouncing it between them).
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from cachefs.auth import TOKEN_METADATA
from cachefs.errors import ControlPlaneUnavailableError, from_rpc_error, parse_detail
from cachefs.proto import master_pb2_grpc
from cachefs.tls import PLAINTEXT, TLSConfig, open_channel

FORWARDED = "cachefs-forwarded"
_PASSED = (TOKEN_METADATA,)


class LeaderForwarder:
    def __init__(self, master_id: str, tls: TLSConfig = PLAINTEXT, timeout: float = 30.0) -> None:
        self.master_id = master_id
        self._tls = tls
        self._timeout = timeout
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, master_pb2_grpc.MasterServiceStub]] = {}

    def _stub(self, address: str) -> master_pb2_grpc.MasterServiceStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = open_channel(address, self._tls)
                entry = self._stubs[address] = (channel, master_pb2_grpc.MasterServiceStub(channel))
            return entry[1]

    def forward(self, method: str, request: Any, context: grpc.ServicerContext, leader: dict, hint: str,
                soon: bool = True) -> Any:
        """Call ``method`` on the leader; its failure is re-raised as the leader's status.
        ``soon``: whether a leader is to be expected soon (False: etcd cannot be reached)."""
        metadata = list(context.invocation_metadata() or ())
        if any(key == FORWARDED for key, _ in metadata):
            raise ControlPlaneUnavailableError(f"{method}: passed on by another master, but this one does "
                                               f"not lead either; {hint}", soon)
        address = leader.get("address")
        if not address or leader.get("master_id") == self.master_id:
            raise ControlPlaneUnavailableError(f"{method} needs the leading master; {hint}", soon)
        passed = [(k, v) for k, v in metadata if k in _PASSED] + [(FORWARDED, self.master_id)]
        remaining = context.time_remaining()
        timeout = self._timeout if remaining is None else max(0.1, min(remaining, self._timeout))
        try:
            return getattr(self._stub(address), method)(request, timeout=timeout, metadata=passed)
        except grpc.RpcError as err:
            # The leader's failure as the same exception type (its detail read back), which the
            # servicer sends on with the same status: the caller cannot tell it was passed on.
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not parse_detail(err):
                raise ControlPlaneUnavailableError(f"{method}: the leader {address} did not answer "
                                                   f"({err.code().name}); {hint}") from None
            raise from_rpc_error(err) from None

    def close(self) -> None:
        with self._lock:
            channels = [c for c, _ in self._stubs.values()]
            self._stubs.clear()
        for channel in channels:
            channel.close()
