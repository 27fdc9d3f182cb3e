"""Reads that local clients report, applied to the page store's recency behind the reply.

A client that reads page files itself (held descriptors, or by name) reports those reads in
batches, so that the worker's hit counters and its eviction order (recency, or the training
plans' next use) see them. Placing a page by its next use costs a few microseconds of Python a
page; answered inline, a warm epoch's reports kept the worker busy on the second core while the
training process needed it (a workers-0 DataLoader's ``torch.stack`` splits its copy over two
threads and waits for the slower). So the short-circuit thread only queues the digests and
answers; one thread applies them, at a lower CPU priority (``nice`` +10 on Linux, where a
thread's priority is its own: cachefs/priority.py) that yields to the training process and to the
worker's own serving threads. Recency is a hint with a second's slack already (clients batch
their reports): applying it milliseconds later changes nothing an eviction decides.

Bounded: past ``max_pending`` queued digests, the caller applies its batch itself (the thread
is behind; the reports slow down instead of growing a queue). ``flush`` waits for what is
queued (tests, and a clean stop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachefs.priority import BACKGROUND_NICE, lower_this_thread

log = logging.getLogger(__name__)

#: Digests queued at most before a reporter applies its own batch.
MAX_PENDING = 1 << 18


class TouchQueue:
    """Reported page reads (digests), applied by ``apply`` on one background thread."""

    def __init__(self, apply: Callable[[Sequence[str]], Any], *, nice: int = BACKGROUND_NICE,
                 max_pending: int = MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._apply = apply
        self._nice = nice
        self._max_pending = max_pending
        self._batches: list[Sequence[str]] = []
        self._pending = 0  # digests queued or being applied
        self._cv = threading.Condition()
        self._closed = False
        self.applied_inline = 0  # batches a reporter applied itself (the thread was behind)
        self._thread = threading.Thread(target=self._run, name="cachefs-touches", daemon=True)
        self._thread.start()

    def submit(self, digests: Sequence[str]) -> None:
        """Queue ``digests`` (applied soon); applied here and now when closed or too far behind."""
        if not digests:
            return
        with self._cv:
            queued = not self._closed and self._pending + len(digests) <= self._max_pending
            if queued:
                self._batches.append(digests)
                self._pending += len(digests)
                self._cv.notify()
            else:
                self.applied_inline += 1
        if not queued:
            self._apply(digests)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is applied; False at the timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Apply what is queued, then stop the thread; later submits apply inline."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        lower_this_thread(self._nice)
        while True:
            with self._cv:
                while not self._batches and not self._closed:
                    self._cv.wait(1.0)
                if not self._batches:
                    return  # closed, nothing left
                batches, self._batches = self._batches, []
            for digests in batches:
                try:
                    self._apply(digests)
                except Exception:  # noqa: BLE001 - a lost recency update never fails a read
                    log.exception("applying %d reported reads failed", len(digests))
                finally:
                    with self._cv:
                        self._pending -= len(digests)
                        if not self._pending:
                            self._cv.notify_all()
