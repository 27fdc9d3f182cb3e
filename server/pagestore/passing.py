"""Pages served but not admitted: read later than everything cached, so they do not displace it.

Under plan-driven eviction (policy.py) a page fetched for a reader whose next use lies beyond every
cached page's would, if admitted, push out a page that is needed sooner, and then leave first
itself: one lost page per such read. Instead it is kept here, in memory, for the few seconds the
readers that asked for it need: a short-circuit or data-port reader gets a descriptor of an
anonymous in-memory file in the page-file format (payload + trailer, so the client checks it as
any page) that it keeps for its one read (``RangeReply.once``); a gRPC reader takes the bytes.
Either way the page is gone from here once handed out; one nobody asks for (a gRPC read is served
from the fetch itself) goes after a few seconds, and the bytes held are bounded (oldest first):
a hand-off between the fetch and its reader, not a second cache beyond the quota.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

import xxhash

from cachefs.pagefile import encode_trailer

__all__ = ["PassingPages"]

#: How long a page passes through: a fill's wait (fill.py: 3 s) and the reply that follows.
TTL_SECONDS = 5.0


class PassingPages:
    def __init__(self, max_bytes: int, ttl: float = TTL_SECONDS) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self._lock = threading.Lock()
        self._pages: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # digest -> (expires, payload)
        self._bytes = 0
        self._opened: OrderedDict[str, float] = OrderedDict()  # handed out as descriptors lately
        self.dropped = 0  # pages that left before anyone took them (bound or age): refetched if read

    def add(self, digest: str, payload: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            old = self._pages.pop(digest, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._pages[digest] = (now + self.ttl, payload)
            self._bytes += len(payload)
            while self._pages and (self._bytes > self.max_bytes or next(iter(self._pages.values()))[0] <= now):
                _, (_, gone) = self._pages.popitem(last=False)
                self._bytes -= len(gone)
                self.dropped += 1

    def get(self, digest: str) -> bytes | None:
        """The page, once: its reader takes it (a later read is a miss, as for any page not cached)."""
        with self._lock:
            found = self._pages.pop(digest, None)
            if found is not None:
                self._bytes -= len(found[1])
        return found[1] if found is not None and found[0] > time.monotonic() else None

    def has(self, digest: str) -> bool:
        with self._lock:
            found = self._pages.get(digest)
        return found is not None and found[0] > time.monotonic()

    def opened(self, digest: str) -> bool:
        """Whether a descriptor of this page was just handed out from here (the reply says so)."""
        with self._lock:
            until = self._opened.get(digest)
        return until is not None and until > time.monotonic()

    def open(self, digest: str) -> int | None:
        """A read-only descriptor of the page in the page-file format, or None."""
        payload = self.get(digest)  # handed out once: the reader keeps the descriptor for its read
        if payload is None:
            return None
        with self._lock:
            self._opened[digest] = time.monotonic() + self.ttl
            self._opened.move_to_end(digest)
            while len(self._opened) > 4096:
                self._opened.popitem(last=False)
        fd = os.memfd_create("cachefs-passing-page", os.MFD_CLOEXEC)
        try:
            view = memoryview(payload + encode_trailer(len(payload), xxhash.xxh3_64_intdigest(payload)))
            while view:
                view = view[os.write(fd, view):]
            # The reader gets a read-only descriptor, as for any page file.
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes
