"""Fail fast when an object store is down: a circuit breaker per mount.

Without it, every uncached read against a store that refuses connections pays the client
library's retries and connect timeouts (s3fs/botocore: ~10-15 s) before it fails. After
``threshold`` consecutive *connection-level* failures the breaker opens: calls to that
mount fail at once with :class:`StoreUnavailableError` for ``cooldown`` seconds; then one
call is let through as a probe, and a success closes the breaker again. Errors about an
object (missing, denied, changed) say the store is up and never count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.errors import StoreUnavailableError

# Exception class names (anywhere in an exception's chain or its classes' MRO) that mean the
# store could not be reached at all. Named, not imported: botocore and aiohttp are optional.
_CONNECTION_ERROR_NAMES = frozenset({
    "ConnectionError",  # builtins (refused, reset, aborted) and botocore's base class
    "EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
    "ClientConnectorError", "ServerDisconnectedError", "ServerTimeoutError",
})


def is_connection_error(exc: BaseException | None) -> bool:
    """True if ``exc`` (or what caused it) says the store could not be reached."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, StoreUnavailableError):
            return True
        if any(cls.__name__ in _CONNECTION_ERROR_NAMES for cls in type(exc).__mro__):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@dataclass
class _State:
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False


class StoreBreaker:
    """Per-mount breakers; thread-safe. ``check`` before a store call, ``record`` after it."""

    def __init__(self, threshold: int = 3, cooldown: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or cooldown <= 0:
            raise ValueError("threshold must be >= 1 and cooldown > 0")
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._mounts: dict[str, _State] = {}
        self.rejected = 0  # calls refused at once while a breaker was open

    def check(self, mount: str, what: str) -> None:
        """Raise StoreUnavailableError if the mount's breaker is open (one probe gets through)."""
        with self._lock:
            state = self._mounts.get(mount)
            if state is None or state.failures < self.threshold:
                return
            now = self._clock()
            if now >= state.open_until and not state.probing:
                state.probing = True  # half-open: this caller tries the store
                return
            self.rejected += 1
            wait = max(0.0, state.open_until - now)
        raise StoreUnavailableError(
            f"{what}: {StoreUnavailableError.MARKER} (mount {mount!r}: {state.failures} connection failures "
            f"in a row; next try in {wait:.1f}s)"
        )

    def record(self, mount: str, exc: BaseException | None) -> bool:
        """Note a call's outcome; True if ``exc`` was a connection failure (now counted)."""
        down = exc is not None and is_connection_error(exc)
        with self._lock:
            state = self._mounts.setdefault(mount, _State())
            state.probing = False
            if not down:
                state.failures, state.open_until = 0, 0.0
                return False
            state.failures += 1
            if state.failures >= self.threshold:
                state.open_until = self._clock() + self.cooldown
        return True

    def open_mounts(self) -> list[str]:
        """Mounts whose store is considered down right now (sorted)."""
        with self._lock:
            return sorted(m for m, st in self._mounts.items() if st.failures >= self.threshold)

    def is_open(self, mount: str) -> bool:
        with self._lock:
            state = self._mounts.get(mount)
            return state is not None and state.failures >= self.threshold
