"""The cluster view's version: one number that grows with every change a watcher must see.

Membership (workers joining, leaving, moving) and the mount table both bump the same
counter, so a client that holds view N knows it has everything up to N. Watchers block on
it with a timeout instead of polling.
"""

from __future__ import annotations

import threading

# Each master start gets its own range of versions (``boot << 32``), so a restarted master
# never hands out a version a client has already seen, without a disk write per change.
BOOT_SHIFT = 32


class ViewVersion:
    """A monotonically growing counter with a condition to wait for it to move."""

    def __init__(self, base: int = 0) -> None:
        self._value = base
        self._cond = threading.Condition()

    @property
    def value(self) -> int:
        with self._cond:
            return self._value

    def bump(self) -> int:
        """Record a change; wakes every watcher. Returns the new version."""
        with self._cond:
            self._value += 1
            self._cond.notify_all()
            return self._value

    def advance(self, to: int) -> int:
        """Move up to ``to`` (no change if already there or past): versions that come from
        elsewhere, etcd's revisions when the state is in etcd."""
        with self._cond:
            if to > self._value:
                self._value = to
                self._cond.notify_all()
            return self._value

    def wait_change(self, known: int, timeout: float) -> int:
        """Block until the version differs from ``known``, :meth:`wake_all`, or ``timeout``.

        Returns the version then; callers loop, re-checking their own reasons to stop.
        """
        with self._cond:
            if self._value == known:
                self._cond.wait(timeout)
            return self._value

    def wake_all(self) -> None:
        """Wake every waiter without a change (a watcher left, the master stops): they re-check."""
        with self._cond:
            self._cond.notify_all()
