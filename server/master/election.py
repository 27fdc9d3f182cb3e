"""One leading master among several, elected through an etcd lease and a transaction.

A master is leader while its key ``<prefix>/leader`` (tied to its own lease, ``election_lease``
seconds, 5 by default) exists: a standby creates the key only when it is absent (one
transaction), so at most one master holds it. The leader's **epoch** is the key's create
revision: it grows with every new leader, travels on every Load/Free the leader sends, and
workers refuse a command whose epoch is older than one they have seen.

**Fencing.** The leader stops acting *before* etcd could hand the key to anyone else: it counts
its term from when it *sent* the last successful keep-alive, and gives it up ``margin``
before the lease's TTL runs out from then (etcd counts from when it *received* it, later). A
frozen leader (SIGSTOP, a long GC pause) wakes to a deadline long past, so it is not leader
when it runs again, whatever it was doing. Every write a leader makes to etcd is also a
transaction that compares the leader key's create revision with its epoch
(:meth:`Election.fence`): a write from a leader whose term ended fails in etcd itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cachefs.errors import ControlPlaneUnavailableError
from cachefs.server.etcd import api
from cachefs.server.etcd.client import EtcdClient, EtcdError, EtcdUnavailableError

log = logging.getLogger(__name__)


class NotLeaderError(ControlPlaneUnavailableError):
    """This master does not lead now (UNAVAILABLE: ask another master, or retry)."""


class Election:
    """Runs the campaign and the keep-alives on a thread; callbacks run on a thread of their own."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        master_id: str,
        address: str,
        lease_seconds: float = 5.0,
        on_elected: Callable[[int], None] | None = None,
        on_lost: Callable[[int], None] | None = None,
        poll_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.key = prefix + b"leader"
        self.masters_key = prefix + b"masters/" + master_id.encode()
        self.master_id = master_id
        self.address = address
        self.ttl = max(2, int(round(lease_seconds)))
        # Given up this long before the lease could expire: time for a last write to land.
        self.margin = min(1.0, self.ttl / 5)
        self.poll_seconds = poll_seconds if poll_seconds is not None else min(0.5, self.ttl / 8)
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._clock = clock
        self._lock = threading.Lock()
        self._lease = 0
        self._epoch = 0
        self._deadline = 0.0
        self._leader: dict[str, Any] = {}  # who leads (as last read from etcd), for redirects
        self._leader_read = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.terms = 0  # how many times this master has been elected
        # When the campaign's etcd calls began to fail (None: the last one succeeded, or none was made).
        self._failing_since: float | None = None

    # -- what the rest of the master asks --

    def is_leader(self) -> bool:
        with self._lock:
            return self._epoch > 0 and self._clock() < self._deadline

    @property
    def epoch(self) -> int:
        """The epoch while leading, else 0."""
        with self._lock:
            return self._epoch if self._epoch > 0 and self._clock() < self._deadline else 0

    def fence(self) -> list[Any]:
        """Compares that make an etcd transaction succeed only while this term lasts."""
        epoch = self.epoch
        if not epoch:
            raise NotLeaderError(f"master {self.master_id} does not lead now; {self.leader_hint()}")
        return [api.Compare(key=self.key, target=api.TARGET_CREATE, result=api.EQUAL, create_revision=epoch)]

    def leader(self) -> dict[str, Any]:
        """``{"master_id", "address", "epoch"}`` of the leader as last seen (empty: none known)."""
        with self._lock:
            if self.is_leader_locked():
                return {"master_id": self.master_id, "address": self.address, "epoch": self._epoch}
            fresh = self._clock() - self._leader_read < max(2.0, 2 * self.poll_seconds) + self.ttl / 2
            return dict(self._leader) if fresh else {}

    def etcd_reachable(self) -> bool:
        """False once every etcd call of the campaign has failed for a whole lease. A shorter gap (the
        members electing a raft leader after one died) reads as an election under way, so callers
        wait for the next leader instead of giving up."""
        with self._lock:
            since = self._failing_since
        return since is None or self._clock() - since < self.ttl

    def is_leader_locked(self) -> bool:
        return self._epoch > 0 and self._clock() < self._deadline

    def leader_hint(self) -> str:
        leader = self.leader()
        if leader.get("address"):
            return f"the leader is {leader['master_id']} at {leader['address']}"
        if not self.etcd_reachable():
            return "etcd cannot be reached, so no master can lead"
        return "no master leads now (an election is under way)"

    # -- the campaign --

    def start(self) -> "Election":
        self._thread = threading.Thread(target=self._run, name="cachefs-election", daemon=True)
        self._thread.start()
        return self

    def stop(self, resign: bool = True, timeout: float = 5.0) -> None:
        """Stop campaigning; ``resign``: revoke the lease so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            lease, epoch = self._lease, self._epoch
            self._epoch, self._deadline, self._lease = 0, 0.0, 0
        if epoch:
            self._notify(self._on_lost, epoch)
        if resign and lease:
            try:
                self.client.revoke(lease, timeout=1.0)
            except (EtcdUnavailableError, EtcdError):
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.is_leader():
                    wait = self._renew()
                else:
                    self._lose_if_expired()
                    wait = self._campaign()
                with self._lock:
                    self._failing_since = None
            except (EtcdUnavailableError, EtcdError) as exc:
                with self._lock:
                    if self._failing_since is None:
                        self._failing_since = self._clock()
                self._lose_if_expired()
                log.debug("election: %s", exc)
                wait = self.poll_seconds
            except Exception:  # noqa: BLE001 - the campaign must outlive a bug in one round
                log.exception("election round failed")
                wait = self.poll_seconds
            with self._lock:
                if self._epoch:
                    wait = max(0.0, min(wait, self._deadline - self._clock()))
            self._stop.wait(wait)
        self._lose_if_expired()

    def _identity(self) -> bytes:
        return json.dumps({"master_id": self.master_id, "address": self.address}).encode()

    def _campaign(self) -> float:
        lease = self._lease
        if not lease:
            lease = self.client.grant(self.ttl)
            self._lease = lease
            # Who is up (for `cachefs status`): on the same lease, gone with this master.
            self.client.put(self.masters_key, self.address.encode(), lease=lease)
        sent = self._clock()
        resp = self.client.txn(
            [api.Compare(key=self.key, target=api.TARGET_CREATE, result=api.EQUAL, create_revision=0)],
            [api.RequestOp(request_put=api.PutRequest(key=self.key, value=self._identity(), lease=lease))],
            [api.RequestOp(request_range=api.RangeRequest(key=self.key))])
        if resp.succeeded:
            epoch = resp.header.revision
            with self._lock:
                self._epoch, self._deadline = epoch, sent + self.ttl - self.margin
                self.terms += 1
            log.info("master %s leads (epoch %d, lease %ds)", self.master_id, epoch, self.ttl)
            self._notify(self._on_elected, epoch)
            return self.ttl / 3
        kvs = resp.responses[0].response_range.kvs if resp.responses else []
        if kvs:
            try:
                leader = json.loads(kvs[0].value)
            except ValueError:
                leader = {}
            leader["epoch"] = kvs[0].create_revision
            if leader.get("master_id") == self.master_id and kvs[0].lease != lease:
                # Our own key from before a restart, on a lease we no longer hold: let it expire.
                pass
            with self._lock:
                self._leader, self._leader_read = leader, self._clock()
        # Our lease is kept for the next try; renew it so it does not run out while we wait.
        if self.client.keepalive(lease) <= 0:
            self._lease = 0
        return self.poll_seconds

    def _renew(self) -> float:
        sent = self._clock()
        ttl = self.client.keepalive(self._lease, timeout=max(0.5, self.ttl / 3))  # unreachable: raised, retried
        if ttl <= 0:
            self._lose("its lease is gone")
            return 0.0
        with self._lock:
            if self._epoch:
                self._deadline = sent + ttl - self.margin
        return self.ttl / 3

    def _lose_if_expired(self) -> None:
        with self._lock:
            expired = self._epoch > 0 and self._clock() >= self._deadline
        if expired:
            self._lose("its lease could not be renewed in time")

    def _lose(self, why: str) -> None:
        with self._lock:
            epoch = self._epoch
            self._epoch, self._deadline, self._lease = 0, 0.0, 0
        if epoch:
            log.warning("master %s stops leading (epoch %d): %s", self.master_id, epoch, why)
            self._notify(self._on_lost, epoch)

    def _notify(self, callback: Callable[[int], None] | None, epoch: int) -> None:
        if callback is None:
            return

        def run() -> None:
            try:
                callback(epoch)
            except Exception:  # noqa: BLE001
                log.exception("leadership callback failed")

        threading.Thread(target=run, name="cachefs-leadership", daemon=True).start()
