"""Worker membership kept in etcd: one key per live worker, tied to a lease of its own.

Workers register through the leading master (gRPC, as with one master), not with etcd:
the leader writes the worker's key on a lease it grants (``lease_seconds``) and renews that
lease on each heartbeat. If the worker stops heartbeating, etcd drops its key when the lease
runs out; if the leader dies, the keys live on (their leases run on in etcd) until the
workers heartbeat to the next leader, which renews the same leases (the lease id is on the
key). Every master follows the keys through ``EtcdState``'s watch, so a standby's view lists
the same workers. Heartbeat statistics stay in the leader's memory (not a write per beat).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from cachefs.errors import ControlPlaneUnavailableError
from cachefs.proto import master_pb2
from cachefs.server.etcd import api
from cachefs.server.etcd.client import EtcdClient
from cachefs.server.master.etcdstate import EtcdState, MemberKey
from cachefs.server.master.membership import Member, MembershipStats
from cachefs.server.master.viewversion import ViewVersion

log = logging.getLogger(__name__)


class EtcdMembership:
    """The :class:`~cachefs.server.master.membership.Membership` interface over etcd keys."""

    def __init__(self, client: EtcdClient, state: EtcdState, lease_seconds: float, versions: ViewVersion,
                 fence: Callable[[], list[Any]]) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        self.client = client
        self.state = state
        self.lease_seconds = lease_seconds
        self.versions = versions
        self._fence = fence
        self._lock = threading.Lock()
        self._stats: dict[str, tuple[Any, float]] = {}  # worker -> (last stats, wall time of the beat)
        self._registrations = 0
        self._heartbeats = 0
        self._expirations = 0
        self._known: set[str] = set()
        state.member_listeners.append(self._on_members)

    @property
    def version(self) -> int:
        return self.versions.value

    def _on_members(self) -> None:
        current = set(self.state.members())
        with self._lock:
            gone = self._known - current
            self._expirations += len(gone)
            for wid in gone:
                self._stats.pop(wid, None)
            self._known = current

    def register(self, worker_id: str, address: str, version: str = "", stats: Any = None,
                 lean: Any = None) -> Member:
        """Write the worker's key on a fresh lease (leader only, fenced)."""
        wall = time.time()
        lease = self.client.grant(math.ceil(self.lease_seconds))
        lean_bytes = lean.SerializeToString() if lean is not None else b""
        value = json.dumps({"address": address, "version": version, "registered_at": wall,
                            "lean": base64.b64encode(lean_bytes).decode()}).encode()
        key = self.state.key("members", worker_id)
        old = self.state.members().get(worker_id)
        try:
            resp = self.client.txn(self._fence(), [api.RequestOp(request_put=api.PutRequest(
                key=key, value=value, lease=lease))])
        except Exception:
            self.client.revoke(lease, timeout=0.5)
            raise
        if not resp.succeeded:
            self.client.revoke(lease, timeout=0.5)
            self._fence()
            raise ControlPlaneUnavailableError("registration not written: this master's term as leader ended")
        if old is not None and old.lease and old.lease != lease:
            self.client.revoke(old.lease, timeout=0.5)  # its key is on the new lease now
        self.state.wait_revision(resp.header.revision, self.client.settings.timeout)
        with self._lock:
            self._registrations += 1
            self._stats[worker_id] = (stats, wall)
        if old is None or old.address != address:
            log.info("worker %s %s at %s", worker_id, "joined" if old is None else "moved", address)
        return self._member(MemberKey(worker_id, address, version, wall, lease, resp.header.revision, lean_bytes))

    def heartbeat(self, worker_id: str, stats: Any = None) -> bool:
        """Renew the worker's lease. False: its key is gone (expired), it must register again."""
        key = self.state.members().get(worker_id)
        if key is None or not key.lease:
            return False
        self._fence()  # only the leader answers heartbeats (a standby forwards them)
        if self.client.keepalive(key.lease) <= 0:
            return False
        with self._lock:
            self._heartbeats += 1
            old = self._stats.get(worker_id, (None, 0.0))[0]
            self._stats[worker_id] = (old if stats is None else stats, time.time())
        return True

    def expire(self) -> list[str]:
        return []  # etcd expires the leases

    def _member(self, key: MemberKey) -> Member:
        # Heartbeats reach only the leader: a standby knows the worker is live (its key is) but not
        # when it last beat, so it says 0 ("not known here") rather than a stale time.
        with self._lock:
            stats, beat = self._stats.get(key.worker_id, (None, 0.0))
        lean = None
        if key.lean:
            lean = master_pb2.LeanPaths()
            lean.ParseFromString(key.lean)
        return Member(key.worker_id, key.address, key.version, stats, registered_at=key.registered_at,
                      last_heartbeat=beat, lean=lean)

    def live(self) -> list[Member]:
        members = self.state.members()
        return [self._member(members[w]) for w in sorted(members)]

    def get(self, worker_id: str) -> Member | None:
        key = self.state.members().get(worker_id)
        return None if key is None else self._member(key)

    def stats(self) -> MembershipStats:
        with self._lock:
            return MembershipStats(len(self.state.members()), self._registrations, self._heartbeats,
                                   self._expirations)

    def start_reaper(self, interval: float | None = None) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass
