"""What the worker's two bulk paths share: "open the cached pages of a range" (their connections:
connections.py).

gRPC carries control and metadata. Cached bytes can leave the worker two leaner ways: as page
file descriptors over a Unix socket to a client on this host (shortcircuit.py), or as page
files sent with sendfile over TCP to any client (dataport.py). Both serve only what is already
cached, using only metadata the worker already has (never a store call: a store that is slow
or down is gRPC's to report), and answer "not cached" for anything else, so that the client
reads it through gRPC, which fetches, caches and serves it as usual.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachefs.errors import to_status
from cachefs.localhost import MAX_PAGES
from cachefs.paths import parse_path

log = logging.getLogger(__name__)

OK, NOT_CACHED, REFUSED = 0, 1, 2  # the codes of both protocols' replies


@dataclass
class OpenedRange:
    """The outcome of a range request: a code, and on OK the object and its opened page files."""

    code: int
    message: str = ""
    meta: Any = None
    offset: int = 0
    end: int = 0  # exclusive, clipped to the object
    fds: list[int] = field(default_factory=list)
    page_offsets: list[int] = field(default_factory=list)
    page_lengths: list[int] = field(default_factory=list)
    pages: list[Any] = field(default_factory=list)  # the PageId behind each descriptor
    valid_until: float = 0.0  # monotonic: when the worker's knowledge of the object's version expires
    stale: bool = False  # that knowledge is past its TTL (within the stale grace), being refreshed

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class CachedPages:
    """Opens the cached page files behind a range request, with the worker's own metadata only."""

    def __init__(self, resolve: Callable[[Any], tuple[Any, float, bool] | None], page_id: Callable[[Any, int], Any],
                 open_page: Callable[[Any], int | None], page_size: int,
                 token: Callable[[str], bool] | None = None) -> None:
        """``resolve(path)``: the worker's metadata of the object, until when it is trusted, and
        whether it is past its TTL (ObjectStore.cached_info_until), or None."""
        self._resolve, self._page_id, self._open_page = resolve, page_id, open_page
        self.page_size, self._token_ok = page_size, token

    def token_ok(self, token: str) -> bool:
        return self._token_ok is None or self._token_ok(token)

    def open(self, request: Any, max_pages: int = MAX_PAGES) -> OpenedRange:
        """``request`` has path, offset, length and version (both protocols' range requests do);
        the caller has checked the token."""
        try:
            path = parse_path(request.path)
            if request.offset < 0 or request.length < -1:
                raise ValueError("offset must be >= 0 and length >= -1")
        except Exception as exc:  # a bad path, or range
            return OpenedRange(REFUSED, f"{to_status(exc).name}: {exc}")
        known = self._resolve(path)
        if known is None:
            return OpenedRange(NOT_CACHED)
        meta, until, stale = known
        if meta.is_dir or (request.version and meta.version != request.version):
            return OpenedRange(NOT_CACHED)
        end = meta.size if request.length == -1 else min(meta.size, request.offset + request.length)
        if end <= request.offset:
            return OpenedRange(OK, meta=meta, offset=request.offset, end=request.offset, valid_until=until,
                               stale=stale)
        first, last = request.offset // self.page_size, (end - 1) // self.page_size
        if last - first + 1 > max_pages:
            return OpenedRange(REFUSED, f"more than {max_pages} pages in one request")
        opened = OpenedRange(OK, meta=meta, offset=request.offset, end=end, valid_until=until, stale=stale)
        try:
            for index in range(first, last + 1):
                pid = self._page_id(meta, index)
                fd = self._open_page(pid)
                if fd is None:
                    opened.close()
                    return OpenedRange(NOT_CACHED, meta=meta)
                opened.fds.append(fd)
                opened.pages.append(pid)
                start = index * self.page_size
                opened.page_offsets.append(start)
                opened.page_lengths.append(min(meta.size, start + self.page_size) - start)
        except BaseException:
            opened.close()
            raise
        return opened
