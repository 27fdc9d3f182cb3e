"""Who is at the other end of a local Unix socket (``SO_PEERCRED``), checked by both sides.

* The worker admits a short-circuit connection only from an allowed peer (:class:`PeerPolicy`):
  its own uid, root, the uids in ``allowed_uids``, or a process whose group (primary or
  supplementary, ``SO_PEERGROUPS``) is ``allowed_gid``. Anyone else's connection is closed before
  a byte is read: no table, no descriptor, no answer.
* A client checks who serves the socket before it sends anything (its token above all):
  :func:`check_server` accepts root, its own uid, or the owner of the directory the socket is in
  (the worker made that directory private to itself). A socket squatted by another user, e.g. in
  a shared temp directory, fails with :class:`UntrustedServerError`.

The kernel records the credentials when the connection (or ``listen``) is made, so a process
that passes its socket on, or changes uid later, is still judged by who it was then.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["PeerCredentials", "PeerNotAllowedError", "PeerPolicy", "UntrustedServerError", "check_server",
           "peer_credentials"]

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int


class PeerNotAllowedError(PermissionError):
    """The worker refused a local connection: its uid and groups are not allowed."""


class UntrustedServerError(PermissionError):
    """The process serving a local socket is not one this client may trust with its requests."""


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    return PeerCredentials(*_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)))


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups (empty where the kernel cannot tell)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
    except OSError:
        return ()
    return struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])


class PeerPolicy:
    """Which local processes a worker serves: its own uid, root, ``uids``, members of ``gid``."""

    def __init__(self, uids: Iterable[int] = (), gid: int = -1, own_uid: int | None = None) -> None:
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self.uids = frozenset({self.own_uid, 0, *uids})
        self.gid = gid
        self._logged: dict[int, float] = {}  # uid -> when its refusal was last logged

    def __repr__(self) -> str:
        return f"PeerPolicy(uids={sorted(self.uids)}, gid={self.gid})"

    def allows(self, sock: socket.socket, creds: PeerCredentials | None = None) -> bool:
        creds = creds or peer_credentials(sock)
        if creds.uid in self.uids:
            return True
        return self.gid >= 0 and (creds.gid == self.gid or self.gid in peer_groups(sock))

    def check(self, sock: socket.socket) -> PeerCredentials:
        """The peer's credentials, or PeerNotAllowedError."""
        creds = peer_credentials(sock)
        if not self.allows(sock, creds):
            error = PeerNotAllowedError(
                f"local connection from pid {creds.pid} (uid {creds.uid}, gid {creds.gid}) is not allowed: "
                f"allowed are uids {sorted(self.uids)}" + (f" and group {self.gid}" if self.gid >= 0 else "")
                + " (allowed_uids, allowed_gid)")
            now = time.monotonic()
            if now - self._logged.get(creds.uid, -1e9) > 60:  # once a minute per uid
                if len(self._logged) > 1024:
                    self._logged.clear()
                self._logged[creds.uid] = now
                log.warning("%s", error)
            raise error
        return creds


def check_server(sock: socket.socket, path: str) -> PeerCredentials:
    """Before a client sends anything on ``sock`` (connected to the Unix socket at ``path``): the
    serving process must be root, this process's uid, or the owner of the socket's directory."""
    creds = peer_credentials(sock)
    me = os.geteuid()
    if creds.uid in (0, me):
        return creds
    directory = os.path.dirname(os.path.abspath(path)) or "/"
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise UntrustedServerError(f"socket {path}: cannot check who owns {directory}: {exc}") from exc
    if creds.uid == st.st_uid:
        return creds
    raise UntrustedServerError(
        f"socket {path} is served by pid {creds.pid} as uid {creds.uid}, which is neither root, this process's "
        f"uid {me}, nor the owner of {directory} (uid {st.st_uid}): not sending it anything (a socket squatted "
        "by another user?)")
