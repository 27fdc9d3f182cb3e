"""Short-circuit reads: cached page files handed to a client on the same host, as descriptors.

Through gRPC a cached page is read from disk into Python, copied into a message, sent over
TCP and copied again on the client's side. When the client runs on the worker's host, the
worker can instead open the page files and pass their descriptors over a Unix socket
(SCM_RIGHTS), as HDFS short-circuit reads do: the client reads the bytes straight into its own
(aligned) buffer and checks each page's checksum itself. The client never learns a path and
can read only the descriptors it is handed (opened read-only); the socket is guarded by its
file mode and, when the worker has an access token, by that token in every request.

Only fully cached ranges are served here: a range with a missing page gets NOT_CACHED and the
client reads it through gRPC, which fetches, caches and serves it as usual.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from cachefs.localhost import MAX_MESSAGE
from cachefs.proto import shortcircuit_pb2
from cachefs.server.rpc import info_message
from cachefs.server.worker.bulkpath import OK, CachedPages, ConnectionServer, token_checker

__all__ = ["ShortCircuitServer", "token_checker"]

Reply = shortcircuit_pb2.ShortCircuitReply


class ShortCircuitServer(ConnectionServer):
    name = "shortcircuit"

    def __init__(self, path: str, pages: CachedPages, mode: int = 0o660, max_connections: int = 256,
                 on_served: Callable[[int, int], None] | None = None) -> None:
        super().__init__(max_connections)
        self.path, self.mode, self.pages, self._on_served = path, mode, pages, on_served

    def _listen(self) -> socket.socket:
        if len(os.fsencode(self.path)) >= 108:
            raise ValueError(f"short-circuit socket path is too long for a Unix socket: {self.path}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.mode)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        return sock

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self, conn: socket.socket) -> None:
        while not self._stopping.is_set():
            data = conn.recv(MAX_MESSAGE)
            if not data:
                return
            reply, fds = self._answer(data)
            try:
                socket.send_fds(conn, [reply.SerializeToString()], fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _answer(self, data: bytes) -> tuple[Any, list[int]]:
        request = shortcircuit_pb2.ShortCircuitRequest()
        try:
            request.ParseFromString(data)
        except Exception:
            return Reply(code=Reply.REFUSED, message="malformed request"), []
        opened = self.pages.open(request)
        info = info_message(opened.meta) if opened.meta is not None else None
        if opened.code != OK:
            return Reply(code=opened.code, message=opened.message, info=info), []
        if self._on_served is not None and opened.fds:
            self._on_served(len(opened.fds), opened.end - opened.offset)
        return Reply(code=Reply.OK, info=info, page_offsets=opened.page_offsets,
                     page_lengths=opened.page_lengths), opened.fds
