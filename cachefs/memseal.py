"""Shared memory that only its creator can change: sealed memfds (the worker's shared tables).

A worker hands its short-circuit clients descriptors of tables in memfds (the handle table,
server/worker/handles.py; the name index, server/worker/names.py), opened read-only. That alone
protects nothing: a memfd's inode is mode 0777, so a client can reopen its descriptor through
``/proc/self/fd/N`` read-write and write the table every other client reads (mark it closed,
freeze generations so evicted pages stay pinned). Seals are on the inode, so they hold for every
descriptor, reopened or not, whatever the holder's uid (root too):

* ``F_SEAL_FUTURE_WRITE`` (Linux 5.1): no new writable mapping and no write(2) from now on; the
  creator's writable mapping made *before* sealing keeps working (``F_SEAL_WRITE`` would refuse
  while that mapping exists);
* ``F_SEAL_SHRINK`` / ``F_SEAL_GROW``: the size is fixed (a client truncating the table would
  make every reader fault);
* ``F_SEAL_SEAL``: nobody adds seals later (a holder adding ``F_SEAL_WRITE`` could not, with the
  creator's mapping live, but nothing else is left to add either).

Where the kernel lacks ``F_SEAL_FUTURE_WRITE``, the size seals still go on, the memfd's mode is
narrowed to 0444 (a reopen by another uid is then refused; root and the creator's own uid can
still write) and a warning says so once per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os

log = logging.getLogger(__name__)

__all__ = ["F_SEAL_FUTURE_WRITE", "SEALS", "sealed_table"]

#: Python 3.11's fcntl has no name for it (linux/fcntl.h: F_SEAL_FUTURE_WRITE 0x0010).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: What every shared table carries once handed out.
SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_warned = False


def sealed_table(name: str, size: int) -> tuple[int, mmap.mmap, bool]:
    """A new memfd of ``size`` bytes, its writable shared mapping (the creator's), and whether it
    is sealed against every other writer. The mapping is made before the seals go on."""
    global _warned
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        table = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd, table, True
    except OSError as exc:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o444)
        if not _warned:
            _warned = True
            log.warning("this kernel cannot seal shared memory against future writes (F_SEAL_FUTURE_WRITE, "
                        "Linux 5.1+: %s): a local client running as this worker's user or root could "
                        "rewrite the tables it is handed (%s); other users cannot reopen them", exc, name)
        return fd, table, False
