"""Talking to workers: lazily created gRPC channels, worker choice, and a breaker per worker.

Channels are gRPC's *synchronous* ones, on purpose: grpc.aio channels hang or crash in
forked children (DataLoader workers) even when the child opens new ones, while sync
channels opened after the fork work (tests/test_client.py forks under load). Channels
belong to one process: a filesystem that crosses a fork or is unpickled starts with none
and opens its own on first use; nothing made in the parent is touched in the child.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.experimental

from cachefs.auth import WrappedChannel
from cachefs.client import forksafe
from cachefs.client.forksafe import RpcGate
from cachefs.proto import worker_pb2_grpc
from cachefs.ring import HashRing, RingConfig
from cachefs.tls import MESSAGE_OPTIONS, open_channel

PLACEMENT_MEMO = 1 << 16  # stripes whose ring order a WorkerSet remembers (per view)
_RING = object()  # the memo's entry naming the ring it was made for

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


@dataclass
class Breaker:
    """Skips a worker for a while after it fails, so a dead worker does not cost every read a timeout."""

    base_delay: float = 0.5
    max_delay: float = 30.0
    failures: int = 0
    open_until: float = 0.0

    def available(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.open_until

    def record_failure(self) -> None:
        self.failures += 1
        delay = min(self.max_delay, self.base_delay * (2 ** min(self.failures - 1, 16)))
        self.open_until = time.monotonic() + delay

    def record_success(self) -> None:
        self.failures = 0
        self.open_until = 0.0


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


@dataclass
class WorkerHandle:
    address: str
    breaker: Breaker = field(default_factory=Breaker)
    connect: Callable[[str], grpc.Channel] = plain_connect  # opens the channel (TLS, token: cachefs/tls.py)
    _channel: grpc.Channel | None = None
    _stub: worker_pb2_grpc.WorkerServiceStub | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stub(self) -> worker_pb2_grpc.WorkerServiceStub:
        """The worker's stub; one channel per process, shared by all threads (channels are thread-safe).
        Raises forksafe.GrpcInheritedError in a process that must not call gRPC."""
        forksafe.forbid_grpc(f"worker {self.address} through gRPC")
        stub = self._stub
        if stub is None:
            with self._lock:
                if self._stub is None:
                    self._channel = self.connect(self.address)
                    self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
                stub = self._stub
        return stub

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()


class WorkerSet:
    """The workers a client may use, in placement order for each path (or stripe of a path).

    Placement is the consistent-hash ring (cachefs/ring.py): every client sends a path to the
    same first worker, so its pages are cached once, and a large object's stripes spread over
    several workers. Later candidates are the ring's next distinct workers (failover order).
    """

    def __init__(self, addresses: list[str], ring_config: RingConfig | None = None,
                 connect: Callable[[str], grpc.Channel] = plain_connect) -> None:
        self._lock = threading.Lock()
        self._connect = connect
        handles = {a: WorkerHandle(a, connect=connect) for a in addresses}
        # One tuple, replaced whole on a view change, so a reader never sees a ring and a
        # handle table from two different views.
        self._state: tuple[HashRing, dict[str, WorkerHandle]] = (HashRing(addresses, ring_config), handles)
        self._placement: dict[Any, Any] = {}  # (key, stripe) -> addresses, for the ring under _RING

    def __bool__(self) -> bool:
        return bool(self._state[1])

    @property
    def ring(self) -> HashRing:
        return self._state[0]

    @property
    def addresses(self) -> list[str]:
        return list(self._state[1])

    def candidates_all(self) -> list[WorkerHandle]:
        """Every worker of the current view, in no particular order."""
        return list(self._state[1].values())

    def update(self, addresses: list[str], ring_config: RingConfig | None = None) -> None:
        """A new view: keep the channels of workers that stay, close those of workers that left."""
        with self._lock:
            old = self._state[1]
            handles = {a: old.get(a) or WorkerHandle(a, connect=self._connect) for a in addresses}
            self._state = (HashRing(addresses, ring_config or self._state[0].config), handles)
        for address, handle in old.items():
            if address not in handles:
                handle.close()

    def candidates(self, key: str, offset: int = 0, include_broken: bool = True) -> list[WorkerHandle]:
        """Workers for the stripe of ``key`` holding ``offset``: healthy ones in ring order, then
        (if ``include_broken``) those behind an open breaker.

        Without a fallback store the broken ones are still tried last, so a read never fails
        only because every breaker happens to be open.
        """
        ring, handles = self._state
        ranked = self._ranked(ring, handles, key, offset)
        now = time.monotonic()
        healthy = [h for h in ranked if h.breaker.available(now)]
        if not include_broken:
            return healthy
        return healthy + [h for h in ranked if not h.breaker.available(now)]

    def placed(self, key: str, offset: int = 0) -> WorkerHandle | None:
        """The worker the ring places the stripe of ``key`` at ``offset`` on, whatever its breaker
        says now (None: no worker): what follows placement, not a moment's health (read plans)."""
        ring, handles = self._state
        if not handles:
            return None
        ranked = self._ranked(ring, handles, key, offset)
        return ranked[0] if ranked else None

    def first_healthy(self, reads: list[tuple[str, int]]) -> list[WorkerHandle | None]:
        """``candidates(key, offset, include_broken=False)[0]`` (or None) for many reads at once:
        a batch of samples asks once, not once a sample (a held read costs ~15 us in all)."""
        ring, handles = self._state
        now = time.monotonic()
        if len(handles) == 1:
            only = next(iter(handles.values()))
            return [only if only.breaker.available(now) else None] * len(reads)
        out: list[WorkerHandle | None] = []
        for key, offset in reads:
            out.append(next((h for h in self._ranked(ring, handles, key, offset) if h.breaker.available(now)), None))
        return out

    def _ranked(self, ring: HashRing, handles: dict[str, WorkerHandle], key: str, offset: int) -> list[WorkerHandle]:
        """Ring order for the stripe, remembered per view (a ring lookup hashes the key: a
        visible share of a held read's cost when every sample asks it once or twice)."""
        if len(handles) == 1:
            return list(handles.values())
        memo_key = (key, offset // ring.config.stripe_size)
        memo = self._placement
        found = memo.get(memo_key)
        if found is None or memo.get(_RING) is not ring:
            if memo.get(_RING) is not ring or len(memo) > PLACEMENT_MEMO:
                memo = self._placement = {_RING: ring}
            found = memo[memo_key] = tuple(ring.nodes_for_offset(key, offset, len(handles)))
        return [handles[a] for a in found]

    def close(self) -> None:
        for handle in self._state[1].values():
            handle.close()
