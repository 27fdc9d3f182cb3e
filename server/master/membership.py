"""Registered workers and their leases: soft state, rebuilt from re-registration after a restart.

A worker is live while its lease holds: it registers, then heartbeats well within
``lease_seconds``; one that stops heartbeating is removed by :meth:`Membership.expire`
(a reaper thread calls it about every lease/4). Only changes of the live set (join,
expiry, a new address) bump the view version: stats-only heartbeats arrive every couple of
seconds from every worker and must not make every watcher rebuild its ring.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachefs.server.master.viewversion import ViewVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One live worker. ``stats`` is opaque here (the master keeps the heartbeat's message)."""

    worker_id: str
    address: str
    version: str = ""
    stats: Any = None
    registered_at: float = 0.0  # wall clock, for people
    last_heartbeat: float = 0.0  # wall clock, for people
    renewed: float = 0.0  # membership clock: when the lease was last renewed
    lean: Any = None  # its sockets besides gRPC (master_pb2.LeanPaths, opaque here): in the view


@dataclass(frozen=True)
class MembershipStats:
    live: int
    registrations: int
    heartbeats: int
    expirations: int


class Membership:
    """Thread-safe set of live workers with leases; ``clock`` is injectable for tests."""

    def __init__(
        self,
        lease_seconds: float,
        versions: ViewVersion | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        self.lease_seconds = lease_seconds
        self.versions = versions if versions is not None else ViewVersion()
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._registrations = 0
        self._heartbeats = 0
        self._expirations = 0
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def version(self) -> int:
        return self.versions.value

    def register(self, worker_id: str, address: str, version: str = "", stats: Any = None,
                 lean: Any = None) -> Member:
        """Join (or re-join: a known id gets the new address and stats and a fresh lease)."""
        now, wall = self._clock(), self._wall()
        with self._lock:
            old = self._members.get(worker_id)
            member = Member(worker_id, address, version, stats, registered_at=wall, last_heartbeat=wall, renewed=now,
                            lean=lean)
            self._members[worker_id] = member
            self._registrations += 1
            changed = old is None or old.address != address or old.lean != lean
            if changed:
                self.versions.bump()
        if changed:
            log.info("worker %s %s at %s", worker_id, "joined" if old is None else "moved", address)
        return member

    def heartbeat(self, worker_id: str, stats: Any = None) -> bool:
        """Renew the lease. False: unknown or already expired, the worker must register again."""
        now = self._clock()
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                return False
            if now - member.renewed > self.lease_seconds:
                self._drop_locked([worker_id])  # the reaper had not come round yet
                return False
            self._members[worker_id] = dataclasses.replace(
                member, stats=member.stats if stats is None else stats, last_heartbeat=self._wall(), renewed=now
            )
            self._heartbeats += 1
            return True

    def expire(self) -> list[str]:
        """Remove every worker whose lease ran out; returns their ids."""
        now = self._clock()
        with self._lock:
            gone = [wid for wid, m in self._members.items() if now - m.renewed > self.lease_seconds]
            self._drop_locked(gone)
        return gone

    def _drop_locked(self, worker_ids: list[str]) -> None:
        for wid in worker_ids:
            del self._members[wid]
            log.info("worker %s left the view (lease of %.1fs expired)", wid, self.lease_seconds)
        if worker_ids:
            self._expirations += len(worker_ids)
            self.versions.bump()

    def live(self) -> list[Member]:
        """Live workers sorted by id (the order every view lists them in)."""
        with self._lock:
            return sorted(self._members.values(), key=lambda m: m.worker_id)

    def get(self, worker_id: str) -> Member | None:
        with self._lock:
            return self._members.get(worker_id)

    def stats(self) -> MembershipStats:
        with self._lock:
            return MembershipStats(len(self._members), self._registrations, self._heartbeats, self._expirations)

    def start_reaper(self, interval: float | None = None) -> None:
        """Run :meth:`expire` in a background thread about every lease/4."""
        if self._reaper is not None:
            return
        interval = self.lease_seconds / 4 if interval is None else interval
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    self.expire()
                except Exception:  # noqa: BLE001 - the reaper must outlive one bad round
                    log.exception("lease reaper failed")

        self._reaper = threading.Thread(target=run, name="cachefs-lease-reaper", daemon=True)
        self._reaper.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout)
            self._reaper = None
