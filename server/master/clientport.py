"""The master's client port: the cluster view for training processes, with no gRPC.

A training process must never load gRPC (client/forksafe.py: its at-fork handlers and its core's
threads in forked DataLoader workers hung and crashed jobs), so it follows the cluster view here:
a plain TCP port next to the gRPC one (``port + 1``, which a client derives from the master
address it was given), in the data port's framing (proto/dataport.proto, server/connections.py
``FramedServer``): a ``DataRequest`` carrying a ``MetaRequest``. ``HELLO`` says who answers (role
``master``, the protocol version); ``VIEW`` with the version the client has is answered with the
view only when it differs (as ``WatchView``), so a poll costs a few dozen bytes. The token is the
gRPC port's: the access token or the cluster token; ``open_status`` lets ``VIEW`` through
without one, as it does ``GetView``. A master serving TLS serves this port with the same
certificates (server/tlsstream.py), client certificates required where gRPC requires them.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from cachefs.localhost import PROTOCOL_VERSION
from cachefs.proto import common_pb2, dataport_pb2
from cachefs.server.connections import FramedServer, connection_limit

log = logging.getLogger(__name__)

Reply = dataport_pb2.DataReply
MetaRequest = common_pb2.MetaRequest
#: Connections at most: one idle one per training process polling the view, so many more than a
#: worker's raw servers take, within half of the descriptors this process may open; from one IP
#: (a host of many training processes) half of them.
MAX_CONNECTIONS = 4096


class MasterClientPort(FramedServer):
    name = "clientport"

    def __init__(self, host: str, port: int, view: Callable[[], Any], version: Callable[[], int],
                 token_ok: Callable[[str], bool] | None, open_view: bool = False,
                 on_view_sent: Callable[[], None] | None = None, **limits: Any) -> None:
        """``view()``: the ClusterView now (MasterServicer.build_view); ``version()``: its version
        without building it; ``token_ok(token)``: None when the master has no token."""
        limits.setdefault("max_connections", connection_limit(MAX_CONNECTIONS, share=2))
        limits.setdefault("max_per_peer", max(64, limits["max_connections"] // 2))
        super().__init__(**limits)
        self.host, self.port = host, port
        self._view, self._version, self._token_ok, self._open_view = view, version, token_ok, open_view
        self._on_view_sent = on_view_sent

    def _refuse(self, conn: socket.socket, message: str, retry_after: float = 0.0) -> None:
        self.send_frame(conn, Reply(code=Reply.REFUSED, message=message, retry_after_ms=int(retry_after * 1000)))

    def _answer(self, conn: socket.socket, request: Any) -> None:
        if not request.HasField("meta"):
            self._refuse(conn, "the master's client port answers metadata operations only (HELLO, VIEW)")
            return
        op = request.meta.op
        if op == MetaRequest.HELLO:
            self.send_frame(conn, Reply(code=Reply.OK, meta=common_pb2.MetaReply(role="master", protocol=PROTOCOL_VERSION)))
            return
        if op != MetaRequest.VIEW:
            self._refuse(conn, f"unknown operation {op} on the master's client port (HELLO, VIEW)")
            return
        if self._token_ok is not None and not self._open_view and not self._token_ok(request.token):
            self._refuse(conn, "UNAUTHENTICATED: missing or wrong access token")
            return
        version = self._version()
        known = request.meta.known_version
        if known and known == version:
            self.send_frame(conn, Reply(code=Reply.OK, meta=common_pb2.MetaReply(view_version=version)))
            return
        view = self._view()
        if self._on_view_sent is not None:
            self._on_view_sent()
        self.send_frame(conn, Reply(code=Reply.OK, meta=common_pb2.MetaReply(
            view=view.SerializeToString(), view_version=view.version)))
