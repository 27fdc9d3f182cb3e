"""The client's side of short-circuit reads (server/worker/shortcircuit.py).

When the worker placed first for a range runs on this host (its ``GetStatus`` reports this
kernel's ``host_id`` and a socket path that exists here), the range is asked for over that
Unix socket; the worker answers with the page files' descriptors, which are read here with
``preadv`` and checked against each page's own checksum. Anything else (a page not cached, a
refusal, a bad checksum, a socket error) returns None and the caller reads through gRPC as
usual, so this path can only make a read faster, never fail it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import OrderedDict
from typing import Any

import xxhash

from cachefs.localhost import MAX_MESSAGE, MAX_PAGES
from cachefs.client import rawbytes
from cachefs.client.socketpool import SocketPool
from cachefs.proto import shortcircuit_pb2
from cachefs.pagefile import TRAILER_SIZE, CorruptPageError, decode_trailer

log = logging.getLogger(__name__)

Reply = shortcircuit_pb2.ShortCircuitReply


class ShortCircuitReader:
    """Connections to one local worker's socket; one request at a time on each."""

    kind = "short_circuit"

    def __init__(self, path: str, token: str = "", timeout: float = 30.0, max_idle: int = 8) -> None:
        self.path, self.token, self.timeout, self.max_idle = path, token, timeout, max_idle
        self._pool = SocketPool(self._connect, max_idle)
        self.verified = VerifiedFiles()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None) -> tuple[Any, int, str] | None:
        """(data, object size, version) of the range, or None: read it through gRPC instead.

        With ``out`` (at least as long as what the range holds), the pages are read straight
        into it (no copy through Python) and the filled part of ``out`` is returned as the data.
        """
        request = shortcircuit_pb2.ShortCircuitRequest(path=path, offset=offset, length=length, version=version,
                                                       token=self.token)
        sock = self._pool.take()
        fds: list[int] = []
        try:
            sock.send(request.SerializeToString())
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_PAGES)
            if not message:
                raise ConnectionError("the worker closed the short-circuit socket")
        except OSError:
            sock.close()
            for fd in fds:
                os.close(fd)
            raise
        self._pool.give_back(sock)
        try:
            reply = Reply()
            reply.ParseFromString(message)
            if reply.code != Reply.OK or len(fds) != len(reply.page_offsets):
                return None
            return self._assemble(reply, fds, offset, length, out)
        finally:
            for fd in fds:
                os.close(fd)

    def _assemble(self, reply: Any, fds: list[int], offset: int, length: int,
                  into: memoryview | None) -> tuple[Any, int, str] | None:
        size = reply.info.size
        end = size if length < 0 else min(size, offset + length)
        want = max(0, end - offset)
        if into is not None and len(into) < want:
            return None
        if into is None:
            if len(fds) > 1 and rawbytes.SUPPORTED:
                # Several pages: read them into one new bytes object (no join of the pieces).
                result, view = rawbytes.fillable_bytes(want)
                with view:
                    filled = self._fill(reply, fds, offset, end, view)
                return (result, size, reply.info.version) if filled else None
            parts = self._pages_as_bytes(reply, fds, offset, end)
            if parts is None:
                return None
            return (parts[0] if len(parts) == 1 else b"".join(parts)), size, reply.info.version
        out = into[:want]
        if not self._fill(reply, fds, offset, end, memoryview(out).cast("B")):
            return None
        return out, size, reply.info.version

    def _fill(self, reply: Any, fds: list[int], offset: int, end: int, view: memoryview) -> bool:
        """The range [offset, end) into ``view``, each page checked once per file identity."""
        for fd, page_start, page_len in zip(fds, reply.page_offsets, reply.page_lengths):
            lo, hi = max(offset, page_start), min(end, page_start + page_len)
            if hi <= lo:
                continue
            identity = self.verified.identity(fd, page_len)
            if identity in self.verified:  # checked before: read only the part wanted
                if not _pread_all(fd, view[lo - offset:hi - offset], lo - page_start):
                    return False
                continue
            whole = lo == page_start and hi == page_start + page_len
            target = view[lo - offset:hi - offset] if whole else memoryview(bytearray(page_len))
            if not _read_page(fd, target, page_len):
                return False
            self.verified.add(identity)
            if not whole:
                view[lo - offset:hi - offset] = target[lo - page_start:hi - page_start]
        return True

    def _pages_as_bytes(self, reply: Any, fds: list[int], offset: int, end: int) -> list[bytes] | None:
        """The range as ``bytes`` straight from ``pread`` (cat_file's result: no buffer to copy out of)."""
        parts = []
        for fd, page_start, page_len in zip(fds, reply.page_offsets, reply.page_lengths):
            lo, hi = max(offset, page_start), min(end, page_start + page_len)
            if hi <= lo:
                continue
            identity = self.verified.identity(fd, page_len)
            checked = identity in self.verified
            data = os.pread(fd, hi - lo, lo - page_start) if checked else os.pread(fd, page_len, 0)
            if not checked:
                if len(data) != page_len or not _trailer_matches(fd, data, page_len):
                    return None
                self.verified.add(identity)
                data = data if hi - lo == page_len else data[lo - page_start:hi - page_start]
            if len(data) != hi - lo:
                return None
            parts.append(data)
        return parts

    def close(self) -> None:
        self._pool.close()

    def release_inherited(self) -> None:
        self._pool.release_inherited()


class VerifiedFiles:
    """Page files this process has already checked, by file identity (bounded, least recent out).

    A page file is written once and renamed into place, never changed after: the same file
    (device, inode, size, mtime and ctime in ns) holds the bytes checked the first time, so
    reading it again needs no second checksum pass, which costs ~20% of a warm large read
    here. A page rewritten, or evicted and its inode reused, is another identity and is checked
    anew. The worker's own reads still check every page they serve.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def identity(fd: int, page_len: int) -> tuple[int, ...]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, page_len

    def __contains__(self, identity: tuple[int, ...]) -> bool:
        with self._lock:
            if identity in self._seen:
                self._seen.move_to_end(identity)
                return True
            return False

    def add(self, identity: tuple[int, ...]) -> None:
        with self._lock:
            self._seen[identity] = None
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)


def _pread_all(fd: int, target: memoryview, offset: int) -> bool:
    got = 0
    while got < len(target):
        n = os.preadv(fd, [target[got:]], offset + got)
        if n <= 0:
            return False
        got += n
    return True


def _read_page(fd: int, target: memoryview, page_len: int) -> bool:
    """The whole payload of one page file into ``target``, verified against its trailer."""
    return _pread_all(fd, target, 0) and _trailer_matches(fd, target, page_len)


def _trailer_matches(fd: int, payload: Any, page_len: int) -> bool:
    try:
        payload_len, checksum = decode_trailer(os.pread(fd, TRAILER_SIZE, page_len))
    except CorruptPageError:
        return False
    return payload_len == page_len and xxhash.xxh3_64_intdigest(payload) == checksum
