"""TLS on the framed ports (the worker's data port, the master's client port), server side.

The ports' selector reads requests without blocking and a serving thread answers with blocking
sends (server/connections.py), so TLS sits between the socket and the framing as an
``ssl.SSLObject`` over memory buffers: the selector feeds it what the socket has (the handshake
included, never waiting for the peer), takes out the plaintext, and a serving thread's sends are
encrypted here and written to the socket. Page files cannot go out with ``sendfile`` (the kernel
would send them unencrypted): they are read and encrypted in pieces instead.
"""

from __future__ import annotations

import os
import select
import socket
import ssl

_READ = 64 << 10  # raw bytes read from the socket at a time
_PIECE = 256 << 10  # a page file's bytes read and encrypted at a time


class TlsStream:
    """One connection's TLS: ``take()`` in the selector (non-blocking), ``sendall``/``recv_into``
    on a serving thread (blocking, bounded by the socket's timeout)."""

    tls = True

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._in, self._out, server_side=True)
        self._handshaken = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self.sock.sendall(data)

    def _feed(self) -> bool:
        """What the socket has now, into the TLS buffer; False when it had nothing. EOFError
        when the peer closed."""
        try:
            data = os.read(self.sock.fileno(), _READ)
        except BlockingIOError:
            return False
        if not data:
            raise EOFError
        self._in.write(data)
        return True

    def _plain(self) -> bytes:
        """The plaintext the TLS buffer holds now (the handshake driven first); b"" if none yet."""
        if not self._handshaken:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                return b""
            self._handshaken = True
            self._flush()
        chunks = []
        while True:
            try:
                chunk = self._ssl.read(_READ)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                if chunks:
                    break
                raise EOFError from None
            if not chunk:
                break
            chunks.append(chunk)
        self._flush()  # a read may answer the peer (key updates, session tickets)
        return b"".join(chunks)

    def take(self) -> bytes | None:
        """Plaintext that came in (the selector's read): None when there was nothing to read,
        b"" while a record or the handshake is incomplete. Raises EOFError when the peer closed,
        ssl.SSLError on a bad handshake or record (the connection is then closed)."""
        fed = self._feed()
        plain = self._plain()
        return plain if plain or fed else None

    def drain(self) -> bytes:
        """Plaintext already decrypted but not read (after ``recv_into``), without reading the socket."""
        return self._plain()

    def recv_into(self, view: memoryview, n: int = 0) -> int:
        """Blocking read of up to ``n`` plaintext bytes (0: ``len(view)``), waiting at most the
        socket's timeout for each piece; 0 when the peer closed."""
        n = n or len(view)
        timeout = self.sock.gettimeout()
        while True:
            try:
                data = self._ssl.read(n)
            except ssl.SSLWantReadError:
                data = None
            except ssl.SSLZeroReturnError:
                return 0
            if data:
                view[:len(data)] = data
                return len(data)
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            if not poller.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError("the client sent nothing for too long")
            try:
                if not self._feed():
                    continue
            except EOFError:
                return 0

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _PIECE):
            self._ssl.write(view[start:start + _PIECE])
            self._flush()

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        """``count`` bytes of ``fd`` from ``offset``, encrypted (sendfile(2) would send them in clear)."""
        end = offset + count
        while offset < end:
            piece = os.pread(fd, min(_PIECE, end - offset), offset)
            if not piece:
                raise ConnectionError("page file ended early (truncated under us?)")
            self.sendall(piece)
            offset += len(piece)
