"""The worker process's heap (server/worker/heap.py): freed pages' memory is reused, not faulted in again.

Process-wide allocator state, so measured in a child process, as only `cachefs worker` sets it."""

from __future__ import annotations

import subprocess
import sys

import pytest


_HEAP_CHURN = r"""
import queue, resource, sys, threading
from cachefs.server.worker.heap import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory(512 << 20):
    print("unsupported"); sys.exit(0)
pages = queue.Queue(maxsize=64)
def fetcher(n):  # as the worker's fetch threads: a new 1 MiB page each, touched, handed on
    for _ in range(n):
        page = bytearray(1 << 20)
        page[::4096] = b"\1" * 256
        pages.put(bytes(page))
    pages.put(None)
def writer():  # as its write threads: the page is freed in another thread
    ended = 0
    while ended < 4:
        ended += pages.get() is None
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    threads = [threading.Thread(target=fetcher, args=(200,)) for _ in range(4)] + [threading.Thread(target=writer)]
    for t in threads: t.start()
    for t in threads: t.join()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[3:]))
"""


def test_the_worker_heap_reuses_freed_pages_instead_of_faulting_new_ones():
    """Pages allocated by fetching threads and freed by writing threads: once the heap has grown,
    a round of 800 MiB of pages (204,800 pages of memory touched twice) faults little memory in
    (~60,000 faults a round with glibc's defaults)."""
    out = subprocess.run([sys.executable, "-c", _HEAP_CHURN, "keep"], capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip()
    if out == "unsupported":
        pytest.skip("not glibc: malloc's thresholds cannot be set here")
    assert int(out) < 25_000, f"{out} minor faults in a round of reused pages"
