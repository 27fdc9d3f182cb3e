"""Is the cache disk working? Disk errors per cache dir, and whether the store is degraded.

A worker whose cache disk is full (ENOSPC) or failing (EIO, read-only, a directory gone) must
keep serving by reading through to the object store; this says so to GetStatus and metrics.
A dir is degraded from a failed write (or a read failing with a disk errno) until a page is
written to it again and no disk error has followed for ``settle_s`` seconds: a full disk still
takes the odd small page between ENOSPC errors, and the status must not flap with each one.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

log = logging.getLogger(__name__)

# Errnos that mean the disk (not one page, not the process) is in trouble.
DISK_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
    errno.EACCES, errno.EPERM, errno.ENODATA, errno.EBADMSG, errno.ENXIO, errno.ENODEV,
})


class DiskHealth:
    """Thread-safe counters; ``failed``/``ok`` are called by the page store after disk I/O."""

    def __init__(self, settle_s: float = 10.0, clock=time.monotonic) -> None:
        if settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s!r}")
        self._lock = threading.Lock()
        self._settle_s = settle_s
        self._clock = clock
        self._bad: dict[str, str] = {}  # dir root -> last error, while degraded
        self._last_error: dict[str, float] = {}  # dir root -> when its last error was seen
        self._recovered: set[str] = set()  # roots written to since their last error
        self.errors = 0

    def failed(self, root: str, exc: BaseException, writing: bool, what: str = "") -> bool:
        """Count a disk error; True if it was one (a write error always is).

        Logged as a warning when a dir turns degraded, then at debug level: a full disk fails
        every write, and the log must not drown in it (the counter and the status say it).
        """
        if not writing and not (isinstance(exc, OSError) and exc.errno in DISK_ERRNOS):
            return False
        with self._lock:
            self.errors += 1
            first = root not in self._bad
            self._bad[root] = f"{type(exc).__name__}: {exc}"
            self._last_error[root] = self._clock()
            self._recovered.discard(root)
        if what:
            log.log(logging.WARNING if first else logging.DEBUG, "%s: %s%s", what, exc,
                    " (cache dir degraded: reads pass through to the store)" if first else "")
        return True

    def ok(self, root: str) -> None:
        if root in self._bad and root not in self._recovered:
            with self._lock:
                if root in self._bad:
                    self._recovered.add(root)

    def _settle(self) -> None:  # caller holds the lock
        now = self._clock()
        for root in [r for r in self._recovered if now - self._last_error[r] >= self._settle_s]:
            self._recovered.discard(root)
            self._bad.pop(root, None)
            self._last_error.pop(root, None)

    @property
    def degraded(self) -> bool:
        with self._lock:
            self._settle()
            return bool(self._bad)

    def reasons(self) -> dict[str, str]:
        with self._lock:
            self._settle()
            return dict(self._bad)
