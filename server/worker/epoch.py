"""The highest leader epoch this worker has seen, and the check that refuses older commands.

With several masters (etcd), the leader puts its epoch on every Load/Free and on its
heartbeat answers. A master whose term ended (frozen, cut off from etcd) may still send a
batch it had prepared: once this worker has heard of a newer leader, that batch is refused
(FAILED_PRECONDITION), so two leaders never drive the same worker. Epoch 0 (a single master,
a client's hint) is never refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from cachefs.errors import StaleLeaderError


class EpochGuard:
    def __init__(self, on_refused: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self.refused = 0
        self._on_refused = on_refused

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def observe(self, epoch: int) -> None:
        """A newer leader was heard of (a heartbeat answer, a command)."""
        with self._lock:
            if epoch > self._epoch:
                self._epoch = epoch

    def check(self, epoch: int, what: str) -> None:
        """Refuse a command from an older leader; otherwise remember its epoch."""
        if not epoch:
            return
        with self._lock:
            if epoch < self._epoch:
                self.refused += 1
                if self._on_refused is not None:
                    self._on_refused()
                raise StaleLeaderError(f"{what} from a master whose leadership ended (epoch {epoch}; "
                                       f"the current leader's is {self._epoch})")
            self._epoch = epoch
