"""Running a daemon in the foreground: one JSON line when ready, a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from typing import Any


def serve_until_signalled(stop: Callable[[], None], ready: dict[str, Any], stopped: dict[str, Any]) -> int:
    """Print ``ready`` (parents such as cachefs.local wait for it), wait for a signal, stop, print ``stopped``."""
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(json.dumps({"event": "ready", **ready}), flush=True)
        while not stop_requested.wait(1.0):
            pass
    finally:
        stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(json.dumps({"event": "stopped", **stopped}), flush=True)
    return 0


def liveness(stopping: threading.Event, server: Any) -> tuple[bool, str]:
    """/healthz of either daemon: its gRPC server is up and it is not stopping."""
    if stopping.is_set():
        return False, "stopping"
    return (server is not None), ("ok" if server is not None else "not started")
