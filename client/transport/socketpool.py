"""Idle connections to one worker endpoint, reused one request at a time (the bulk paths' readers)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class SocketPool:
    """Up to ``max_idle`` idle sockets kept; a socket in use belongs to its caller alone.

    A caller that fails mid-request closes its socket instead of giving it back: a stream
    out of step with its protocol is never reused.
    """

    def __init__(self, connect: Callable[[], socket.socket], max_idle: int = 8) -> None:
        self._connect, self.max_idle = connect, max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def take(self) -> socket.socket:
        return self.idle() or self._connect()

    def idle(self) -> socket.socket | None:
        """The most recently given back idle socket, or None."""
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def release_inherited(self) -> None:
        """In a forked child: close the child's copies of the idle sockets, taking no lock (a
        parent thread may have held it at the fork); sockets a parent thread was using stay
        unused here."""
        self._lock = threading.Lock()
        idle, self._idle = self._idle, []
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()

    def __del__(self) -> None:  # a dataset's per-process filesystem is never closed explicitly
        with contextlib.suppress(Exception):
            for sock in self._idle:
                sock.close()
