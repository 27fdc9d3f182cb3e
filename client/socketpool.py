"""Idle connections to one worker endpoint, reused one request at a time (the bulk paths' readers)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

#: Idle sockets older than this are closed, not reused: the worker closes a connection that has
#: sent no request for 60 s (server/worker/bulkpath.py IDLE_TIMEOUT), and a read that met such a
#: socket would fall back to gRPC and drop the lean path for a while.
MAX_IDLE_SECONDS = 30.0


class SocketPool:
    """Up to ``max_idle`` idle sockets kept; a socket in use belongs to its caller alone.

    A caller that fails mid-request closes its socket instead of giving it back: a stream
    out of step with its protocol is never reused.
    """

    def __init__(self, connect: Callable[[], socket.socket], max_idle: int = 8,
                 max_idle_seconds: float = MAX_IDLE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect, self.max_idle = connect, max_idle
        self.max_idle_seconds, self._clock = max_idle_seconds, clock
        self._idle: list[tuple[socket.socket, float]] = []  # (socket, when it was given back)
        self._lock = threading.Lock()

    def take(self) -> socket.socket:
        stale: list[socket.socket] = []
        fresh = None
        now = self._clock()
        with self._lock:
            while self._idle:
                sock, since = self._idle.pop()
                if now - since < self.max_idle_seconds:
                    fresh = sock
                    break
                stale.append(sock)
        for sock in stale:
            with contextlib.suppress(OSError):
                sock.close()
        return fresh if fresh is not None else self._connect()

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((sock, self._clock()))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def release_inherited(self) -> None:
        """In a forked child: close the child's copies of the idle sockets, taking no lock (a
        parent thread may have held it at the fork); sockets a parent thread was using stay
        unused here."""
        self._lock = threading.Lock()
        idle, self._idle = self._idle, []
        for sock, _ in idle:
            with contextlib.suppress(OSError):
                sock.close()

    def __del__(self) -> None:  # a dataset's per-process filesystem is never closed explicitly
        with contextlib.suppress(Exception):
            for sock, _ in self._idle:
                sock.close()
