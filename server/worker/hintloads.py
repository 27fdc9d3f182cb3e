"""Hints that come over the short-circuit socket: loads run in the background, bounded.

A Load hint over gRPC runs on the RPC thread that received it, and the client does not wait for
it (an async call). A hint over the short-circuit socket (from a DataLoader worker that must not
open a gRPC channel: client/forksafe.py) cannot hold that socket's serving thread for a load,
so it is handed to a small pool here and answered at once; when ``max_in_flight`` loads are
already queued or running, the rest is refused (a hint is only a hint: the reads fetch what is
still cold themselves).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

#: How long one hinted load may run before it gives up on what it has not fetched.
HINT_LOAD_SECONDS = 60.0


class HintLoads:
    def __init__(self, load: Callable[[list[str], float, bool], Any], *, threads: int = 2,
                 max_in_flight: int = 4) -> None:
        self._load = load
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cachefs-hint-load")
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._closed = False

    def submit(self, paths: list[str]) -> int:
        """Start loading ``paths`` in the background; how many were taken (0: busy or closed)."""
        if self._closed or not paths or not self._slots.acquire(blocking=False):
            return 0
        try:
            self._pool.submit(self._run, list(paths))
        except RuntimeError:  # shut down meanwhile
            self._slots.release()
            return 0
        return len(paths)

    def _run(self, paths: list[str]) -> None:
        try:
            self._load(paths, time.monotonic() + HINT_LOAD_SECONDS, True)
        except Exception as exc:  # noqa: BLE001 - a failed hint costs nothing but itself
            log.debug("hinted load of %d objects failed: %s", len(paths), exc)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
