"""The transports' limits for bench_read.py: a raw gRPC stream and a raw loopback TCP stream.

Each server runs in its own process (so server and client never share a GIL, as with a real
worker) and serves the benchmark's local copy of the objects, which is in the page cache:

    grpc  a generic gRPC handler (no proto: bytes in, bytes out): the key in, the object's bytes
          out as a stream of 1 MiB messages, read with pread
    tcp   a key line in, an 8-byte length and the file's bytes out with sendfile (1 MiB per call)

    python benchmarks/read_limits.py grpc|tcp ROOT    # prints its port; stops when stdin closes

The clients put the bytes into the caller's preallocated, aligned slot (gRPC: one copy per
message; TCP: recv_into the slot directly), so they are the ceilings for cachefs's gRPC path and
for a lean data path over the network.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

CHUNK = 1 << 20
METHOD = "/bench.Raw/Read"
HEADER = struct.Struct("!Q")


# -- servers (in their own process) ------------------------------------------------------------------
def _file(root: str, key: str) -> str:
    path = os.path.realpath(os.path.join(root, key))
    if not path.startswith(os.path.realpath(root) + os.sep):
        raise FileNotFoundError(key)
    return path


def serve_grpc(root: str) -> tuple[Any, int]:
    import grpc

    def read(request: bytes, context: Any) -> Iterator[bytes]:
        fd = os.open(_file(root, request.decode()), os.O_RDONLY)
        try:
            size, off = os.fstat(fd).st_size, 0
            while off < size:
                chunk = os.pread(fd, min(CHUNK, size - off), off)
                if not chunk:
                    break
                off += len(chunk)
                yield chunk
        finally:
            os.close(fd)

    server = grpc.server(ThreadPoolExecutor(max_workers=32),
                         options=[("grpc.max_send_message_length", 8 << 20),
                                  ("grpc.max_receive_message_length", 8 << 20)])
    handler = grpc.method_handlers_generic_handler("bench.Raw", {"Read": grpc.unary_stream_rpc_method_handler(read)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _tcp_conn(conn: socket.socket, root: str) -> None:
    with conn, conn.makefile("rb") as lines:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for line in lines:
            fd = os.open(_file(root, line.rstrip(b"\n").decode()), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                conn.sendall(HEADER.pack(size))
                off = 0
                while off < size:
                    n = os.sendfile(conn.fileno(), fd, off, min(CHUNK, size - off))
                    if n == 0:
                        break
                    off += n
            finally:
                os.close(fd)


def serve_tcp(root: str) -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_tcp_conn, args=(conn, root), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, listener.getsockname()[1]


def server_main(argv: list[str]) -> int:
    kind, root = argv
    _, port = serve_grpc(root) if kind == "grpc" else serve_tcp(root)
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    os._exit(0)  # daemon threads may be mid-sendfile; nothing to flush


@contextlib.contextmanager
def limit_server(kind: str, root: str, timeout: float = 30.0) -> Iterator[str]:
    """Start the ``kind`` server over ``root`` in its own process; yields its 127.0.0.1 address."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), kind, root], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().strip() if ready else ""
        if not line.isdigit():
            raise RuntimeError(f"{kind} limit server did not start within {timeout:.0f} s")
        yield f"127.0.0.1:{int(line)}"
    finally:
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


# -- clients -----------------------------------------------------------------------------------------
class GrpcRawClient:
    """One channel per process (as cachefs's client); each message copied once into the slot."""

    api = "grpc unary_stream of 1 MiB messages, each copied into the aligned slot"

    def __init__(self, address: str) -> None:
        import grpc

        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 8 << 20)])
        self.call = self.channel.unary_stream(METHOD)

    def read(self, key: str, out: np.ndarray) -> np.ndarray:
        view, pos = memoryview(out), 0
        for chunk in self.call(key.encode(), timeout=120):
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        return out[:pos]

    def close(self) -> None:
        self.channel.close()


class TcpRawClient:
    """One connection per reader thread; recv_into the slot directly (no copy in Python)."""

    api = "loopback TCP, server sendfile 1 MiB at a time, client recv_into(MSG_WAITALL) the aligned slot"

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.address = (host, int(port))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []

    def _sock(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.create_connection(self.address, timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Blocking socket with a kernel-side timeout: MSG_WAITALL then fills a slot in one call.
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 120, 0))
            self._local.sock = sock
            with self._lock:
                self._socks.append(sock)
        return sock

    @staticmethod
    def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
        """1 MiB at a time (measured a little faster here than one call for 64 MiB)."""
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:], min(CHUNK, len(view) - got), socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionError("limit server closed the connection mid-object")
            got += n

    def read(self, key: str, out: np.ndarray) -> np.ndarray:
        sock = self._sock()
        sock.sendall(key.encode() + b"\n")
        header = bytearray(HEADER.size)
        self._recv_exactly(sock, memoryview(header))
        (size,) = HEADER.unpack(header)
        if size > len(out):
            raise ValueError(f"{key}: {size} bytes do not fit the {len(out)}-byte slot")
        self._recv_exactly(sock, memoryview(out)[:size])
        return out[:size]

    def close(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


if __name__ == "__main__":
    sys.exit(server_main(sys.argv[1:]))
