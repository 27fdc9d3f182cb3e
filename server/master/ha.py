"""Several masters, one leader: the pieces a master on etcd is made of, and its terms as leader.

Every master (leader or standby) loads the mounts and live workers from etcd and follows
them with a watch (``etcdstate.py``), so any of them serves the view, metadata, listings and
stat. What changes state (registrations and heartbeats, mounts, jobs) only the leader does;
a standby forwards those calls to it (``forward.py``). On election a master first catches up
with etcd to the revision it was elected at, adds the configured mounts that are absent, and
resumes the jobs the previous leader left unfinished (their records are in etcd); when its
term ends it stops dispatching at once (its writes would fail the fence anyway).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cachefs.config import MasterConfig
from cachefs.errors import ControlPlaneUnavailableError
from cachefs.server.etcd.client import EtcdClient, settings_of
from cachefs.server.master.election import Election, NotLeaderError
from cachefs.server.master.etcdmembers import EtcdMembership
from cachefs.server.master.etcdstate import EtcdState, local_master_id
from cachefs.server.master.viewversion import ViewVersion

log = logging.getLogger(__name__)

# How long a call that reached the leader waits for it to finish taking over.
TAKEOVER_WAIT = 10.0


class ControlPlane:
    """The etcd client, the state and membership over it, and the election (started by ``start``)."""

    def __init__(self, config: MasterConfig, versions: ViewVersion,
                 on_elected: Callable[[int], None], on_lost: Callable[[int], None]) -> None:
        self.config = config
        self.client = EtcdClient(settings_of(config))
        self.master_id = local_master_id(config.state_dir)
        self.prefix = config.etcd_prefix.encode()
        self.election: Election | None = None
        self.state = EtcdState(self.client, config.etcd_prefix, self.master_id, versions, self.fence)
        self.membership = EtcdMembership(self.client, self.state, config.lease_seconds, versions, self.fence)
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._term_lock = threading.Lock()
        self._ready = threading.Condition()
        self._ready_epoch = 0

    def start(self, address: str) -> "ControlPlane":
        """Load the state (waiting for etcd, so a master started before etcd comes up later), then campaign."""
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self.state.start()
                break
            except ControlPlaneUnavailableError:
                if time.monotonic() > deadline:
                    raise
                log.warning("etcd %s cannot be reached yet; retrying", ",".join(self.config.etcd))
                time.sleep(1.0)
        self.election = Election(self.client, self.prefix, self.master_id, address,
                                 self.config.election_lease_seconds, self._elected, self._lost).start()
        return self

    # -- leadership --

    def fence(self) -> list:
        if self.election is None:
            raise NotLeaderError("this master has not joined the election yet")
        return self.election.fence()

    def is_leader(self) -> bool:
        return self.election is not None and self.election.is_leader()

    @property
    def epoch(self) -> int:
        return self.election.epoch if self.election is not None else 0

    def serving_epoch(self, wait: float = TAKEOVER_WAIT) -> int:
        """The epoch when this master leads and has taken over (waiting up to ``wait`` for that);
        0 when it does not lead."""
        deadline = time.monotonic() + wait
        with self._ready:
            while True:
                epoch = self.epoch
                if not epoch:
                    return 0
                if self._ready_epoch == epoch:
                    return epoch
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ControlPlaneUnavailableError("this master was just elected and is still taking over; retry")
                self._ready.wait(min(left, 0.2))

    def leader(self) -> dict:
        return self.election.leader() if self.election is not None else {}

    def leader_hint(self) -> str:
        return self.election.leader_hint() if self.election is not None else "no election yet"

    def etcd_reachable(self) -> bool:
        """False while etcd cannot be reached: no master can lead until it can."""
        return self.election is None or self.election.etcd_reachable()

    def _elected(self, epoch: int) -> None:
        with self._term_lock:
            # Everything written before this election is at revisions below the epoch: read it all.
            try:
                self.state.resync()
            except ControlPlaneUnavailableError as exc:
                log.warning("elected (epoch %d) but could not re-read the state: %s", epoch, exc)
                return
            if self.epoch != epoch:
                return  # lost again already
            self._on_elected(epoch)
            with self._ready:
                self._ready_epoch = epoch
                self._ready.notify_all()

    def _lost(self, epoch: int) -> None:
        with self._ready:
            if self._ready_epoch == epoch:
                self._ready_epoch = 0
        with self._term_lock:
            self._on_lost(epoch)

    def stop(self) -> None:
        if self.election is not None:
            self.election.stop(resign=True)
        self.state.close()
        self.client.close()
