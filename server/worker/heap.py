"""The worker's heap: freed memory kept for the next fetched page, not handed back to the kernel.

A cold read streams the store's bytes through the worker as 1 MiB pages: each one a new
``bytes`` that lives until its page file is written and its readers are served. glibc's malloc
serves blocks this size with ``mmap`` and returns them with ``munmap`` (or trims the heap), so
every page lands in freshly faulted memory: measured here, a cold epoch of 512 MB took ~100,000
minor faults in the worker and most of its CPU was kernel time (on this VM a fault is also a
fault on the host, whose balloon took the free memory back). With the threshold raised and
trimming bounded, the blocks are reused: ~2,000-6,000 faults an epoch once the heap has grown,
the worker's system time 0.25-0.9 s against 0.7-1.9 s (docs/performance.md), at the price of a
resident heap at its high-water mark (~300 MB in that run: the pages in flight and queued).

Process-wide state, so only the ``cachefs worker`` process sets it (``serve``), never a library
user's process or the tests' in-process workers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap (glibc's own maximum for the dynamic threshold is
#: 32 MiB; pages are at most 64 MiB).
MMAP_THRESHOLD = 64 << 20


def keep_freed_memory(keep_bytes: int) -> bool:
    """Have malloc reuse freed blocks (up to ``keep_bytes`` free at the heap's top before it is
    trimmed); False where that cannot be set (not glibc) or ``keep_bytes`` is 0 (glibc's defaults)."""
    if keep_bytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no mallopt): its defaults stay
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    value = min(keep_bytes, (1 << 31) - 1)
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, value)):
        log.warning("malloc did not take the heap settings: freed memory goes back to the kernel")
        return False
    return True
