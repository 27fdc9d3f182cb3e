"""Background threads at a lower CPU priority than the threads that serve reads.

Bookkeeping that nothing waits for (recency of reported reads, refreshes of metadata that is
still usable) competes for the same cores as the training process on a small node: a
workers-0 DataLoader's ``torch.stack`` splits its copy over two threads and waits for the
slower whenever another thread holds the second core. Such threads lower their own priority
(``nice`` is per thread on Linux), so that they take what is idle and yield the rest.
"""

from __future__ import annotations

import os
import threading

#: How many ``nice`` levels below the process background bookkeeping threads run.
BACKGROUND_NICE = 10


def lower_this_thread(steps: int = BACKGROUND_NICE) -> bool:
    """Lower the calling thread's CPU priority by ``steps`` nice levels (Linux: this thread
    only); False where the platform cannot (the thread keeps the process's priority)."""
    if steps <= 0 or not hasattr(os, "setpriority"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except OSError:
        return False
    return True
