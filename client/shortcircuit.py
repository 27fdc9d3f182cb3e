"""The client's side of short-circuit reads (server/worker/shortcircuit.py).

When the worker placed first for a range runs on this host (its ``GetStatus`` reports this
kernel's ``host_id`` and a socket path that exists here), the range is asked for over that
Unix socket; the worker answers with the page files' descriptors, which are read here with
``preadv`` and checked against each page's own checksum. Anything else (a page not cached, a
refusal, a bad checksum, a socket error) returns None and the caller reads through gRPC as
usual, so this path can only make a read faster, never fail it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

import xxhash

from cachefs.localhost import MAX_MESSAGE, MAX_PAGES, host_id
from cachefs.proto import shortcircuit_pb2, worker_pb2
from cachefs.server.pagestore.pagefile import TRAILER_SIZE, CorruptPageError, decode_trailer

log = logging.getLogger(__name__)

Reply = shortcircuit_pb2.ShortCircuitReply
PROBE_RETRY = 60.0  # seconds before asking a worker again whether it is local
#: A local worker answers in well under a millisecond; one that takes this long is treated as
#: not local for PROBE_RETRY seconds (the read goes through gRPC), so a wedged socket costs a
#: read at most this much, never the gRPC deadline.
SOCKET_TIMEOUT = 5.0
_HOST_ID = host_id()


class ShortCircuitReader:
    """Connections to one local worker's socket; one request at a time on each."""

    def __init__(self, path: str, token: str = "", timeout: float = 30.0, max_idle: int = 8) -> None:
        self.path, self.token, self.timeout, self.max_idle = path, token, timeout, max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _take(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(sock)
                return
        sock.close()

    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None) -> tuple[Any, int, str] | None:
        """(data, object size, version) of the range, or None: read it through gRPC instead.

        With ``out`` (at least as long as what the range holds), the pages are read straight
        into it (no copy through Python) and the filled part of ``out`` is returned as the data.
        """
        request = shortcircuit_pb2.ShortCircuitRequest(path=path, offset=offset, length=length, version=version,
                                                       token=self.token)
        sock = self._take()
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
        self._give_back(sock)
        try:
            reply = Reply()
            reply.ParseFromString(message)
            if reply.code != Reply.OK or len(fds) != len(reply.page_offsets):
                return None
            return self._assemble(reply, fds, offset, length, out)
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _assemble(reply: Any, fds: list[int], offset: int, length: int,
                  into: memoryview | None) -> tuple[Any, int, str] | None:
        size = reply.info.size
        end = size if length < 0 else min(size, offset + length)
        want = max(0, end - offset)
        if into is not None and len(into) < want:
            return None
        out = into[:want] if into is not None else bytearray(want)
        view = memoryview(out).cast("B")
        for fd, page_start, page_len in zip(fds, reply.page_offsets, reply.page_lengths):
            lo, hi = max(offset, page_start), min(end, page_start + page_len)
            if hi <= lo:
                continue
            whole = lo == page_start and hi == page_start + page_len
            target = view[lo - offset:hi - offset] if whole else memoryview(bytearray(page_len))
            if not _read_page(fd, target, page_len):
                return None
            if not whole:
                view[lo - offset:hi - offset] = target[lo - page_start:hi - page_start]
        return (out if into is not None else bytes(out)), size, reply.info.version

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def __del__(self) -> None:  # a dataset's per-process filesystem is never closed explicitly
        with contextlib.suppress(Exception):
            for sock in self._idle:
                sock.close()


def _read_page(fd: int, target: memoryview, page_len: int) -> bool:
    """The whole payload of one page file into ``target``, verified against its trailer."""
    got = 0
    while got < page_len:
        n = os.preadv(fd, [target[got:]], got)
        if n <= 0:
            return False
        got += n
    try:
        payload_len, checksum = decode_trailer(os.pread(fd, TRAILER_SIZE, page_len))
    except CorruptPageError:
        return False
    return payload_len == page_len and xxhash.xxh3_64_intdigest(target) == checksum


class ShortCircuit:
    """Which workers are local, per process; reads through the first placed one when it is."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._pid = -1
        self._lock = threading.Lock()
        self._readers: dict[str, tuple[ShortCircuitReader | None, float]] = {}
        self.stats = {"reads": 0, "bytes": 0, "fallbacks": 0}

    def _reader(self, handle: Any) -> ShortCircuitReader | None:
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
            self._readers, self._pid = {}, os.getpid()
        known = self._readers.get(handle.address)
        if known is not None and (known[0] is not None or time.monotonic() - known[1] < PROBE_RETRY):
            return known[0]
        reader = None
        try:
            status = handle.stub().GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
            if status.host_id == _HOST_ID and status.short_circuit_socket \
                    and os.path.exists(status.short_circuit_socket):
                reader = ShortCircuitReader(status.short_circuit_socket, self.fs.config.token,
                                            timeout=min(SOCKET_TIMEOUT, self.fs.config.timeout))
        except Exception as exc:  # an old worker, an unreachable one: gRPC only
            log.debug("short-circuit probe of %s failed: %s", handle.address, exc)
        with self._lock:
            self._readers[handle.address] = (reader, time.monotonic())
        return reader

    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None) -> tuple[Any, int, str] | None:
        candidates = self.fs._process_state().candidates(path, offset, include_broken=False)
        if not candidates:
            return None
        reader = self._reader(candidates[0])
        if reader is None:
            return None
        try:
            got = reader.read(path, offset, length, version, out)
        except OSError as exc:  # the worker restarted, went away or is wedged: gRPC for a while
            log.debug("short-circuit read from %s failed: %s", candidates[0].address, exc)
            with self._lock:
                self._readers[candidates[0].address] = (None, time.monotonic())
            reader.close()
            got = None
        if got is None:
            self.stats["fallbacks"] += 1
            return None
        self.stats["reads"] += 1
        self.stats["bytes"] += len(got[0])
        return got

    def close(self) -> None:
        with self._lock:
            readers, self._readers = self._readers, {}
        if self._pid == os.getpid():
            for reader, _ in readers.values():
                if reader is not None:
                    with contextlib.suppress(OSError):
                        reader.close()
