"""Talking to workers: worker choice by placement, a breaker per worker, and each worker's
gRPC channel, opened only where gRPC is used (client/transport/grpcchannels.py: importing this module
loads no gRPC). Channels belong to one process: a filesystem that crosses a fork or is unpickled
starts with none and opens its own on first use; nothing made in the parent is touched in the child.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachefs.client import forksafe
from cachefs.ring import HashRing, RingConfig

PLACEMENT_MEMO = 1 << 16  # stripes whose ring order a WorkerSet remembers (per view)
_RING = object()  # the memo's entry naming the ring it was made for

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


def plain_connect(address: str) -> Any:
    """The default way to reach a worker: plaintext, no token (a gRPC channel)."""
    from cachefs.client.transport.grpcchannels import plain_connect as connect

    return connect(address)


@dataclass
class WorkerHandle:
    address: str
    breaker: Breaker = field(default_factory=Breaker)
    connect: Callable[[str], Any] = plain_connect  # opens the gRPC channel (TLS, token: cachefs/tls.py)
    _channel: Any = None
    _stub: Any = None  # worker_pb2_grpc.WorkerServiceStub
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stub(self) -> Any:
        """The worker's stub (worker_pb2_grpc.WorkerServiceStub); one channel per process, shared by
        all threads (channels are thread-safe). Raises forksafe.GrpcInheritedError in a process
        that must not call gRPC."""
        forksafe.forbid_grpc(f"worker {self.address} through gRPC")
        stub = self._stub
        if stub is None:
            from cachefs.proto import worker_pb2_grpc  # gRPC only where it is used

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
                 connect: Callable[[str], Any] = plain_connect) -> None:
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
