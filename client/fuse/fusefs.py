"""The read-only file system that ``cachefs fuse`` mounts: FUSE operations over a ClientSession.

Each mount of the mount table is a top-level directory, the keys below it are files and
directories. Every byte and every attribute comes through the client session, as for
``cachefs://`` (short-circuit on this host, data port or gRPC otherwise, failover, fallback):
this module only maps paths, attributes and errors. It does not import the FUSE binding; the
binding (client/fuse/fusemount.py) calls these methods from libfuse's threads, many at once.

Caching, and why it is safe: the kernel keeps attributes and names for ``attr_timeout`` (no
longer than the workers' metadata TTL); a listing's entries answer the lookups that follow it
for as long. An open revalidates the object's version through the session and pins the
handle to it (a read of a changed object fails with ESTALE, never mixes versions); the kernel
keeps its page cache across opens only while the version is the one it cached.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

from cachefs.client.transport.session import ClientSession
from cachefs.errors import InvalidPathError, StaleObjectError
from cachefs.paths import CachePath, parse_path

log = logging.getLogger(__name__)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
#: Paths whose attributes (or versions last opened) are remembered at most; past it, forgotten.
_MAX_REMEMBERED = 1 << 16


@dataclass(frozen=True)
class Handle:
    """An open file: the object and the version and size it was opened at."""

    path: str
    cp: CachePath
    version: str
    size: int


class _Expiring:
    """path -> value for ``ttl`` seconds, bounded (cleared when full: a cache, never the truth)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._items: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            item = self._items.get(key)
        if item is None or item[0] < time.monotonic():
            return None
        return item[1]

    def discard(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        if self.ttl <= 0:
            return
        expires = time.monotonic() + self.ttl
        with self._lock:
            if len(self._items) + len(items) > _MAX_REMEMBERED:
                self._items.clear()
            for key, value in items:
                self._items[key] = (expires, value)


class CacheFuseOps:
    """FUSE operations (mfusepy's names and signatures, ``raw_fi``), read-only."""

    use_ns = True  # times in nanoseconds (mfusepy)

    def __init__(self, session: ClientSession, attr_timeout: float = 1.0, max_read: int = 1 << 20,
                 revalidate_open: bool = True) -> None:
        self.session = session
        self.revalidate_open = revalidate_open
        self.attr_timeout = attr_timeout
        self.max_read = max_read
        self._attrs = _Expiring(attr_timeout)  # from listings: the lookups that follow need no call
        self._mounts = _Expiring(attr_timeout)
        self._handles: dict[int, Handle] = {}
        self._opened: dict[str, str] = {}  # path -> version of the last open (the kernel's page cache)
        self._told: dict[str, str] = {}  # path -> version whose size the kernel was last told
        self._live: dict[str, dict[str, int]] = {}  # path -> {version: open handles}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._uid, self._gid = os.getuid(), os.getgid()
        self.umask = 0  # taken from every mode (the mount's umask setting)
        self.writable = False  # client/fuse/fusewrite.py's subclass writes (and its modes say so)

    # -- paths and attributes ---------------------------------------------------------------------
    def _mount_names(self) -> list[str]:
        names = self._mounts.get("")
        if names is None:
            names = sorted(m.name for m in self.session.public_mounts())
            self._mounts.put_many([("", names)])
        return names

    def _cache_path(self, path: str) -> CachePath:
        try:
            return parse_path(path.lstrip("/"))
        except InvalidPathError:
            raise OSError(errno.ENOENT, f"{path}: not a name a store object can have") from None

    def _stat(self, kind: str, size: int = 0, mtime: float = 0.0) -> dict[str, int]:
        ns = int(mtime * 1e9)
        write = 0o200 if self.writable else 0
        if kind == "directory":
            mode, nlink = stat.S_IFDIR | ((0o555 | write) & ~self.umask), 2
        else:
            mode, nlink = stat.S_IFREG | ((0o444 | write) & ~self.umask), 1
        return {"st_mode": mode, "st_nlink": nlink, "st_size": size, "st_uid": self._uid, "st_gid": self._gid,
                "st_mtime": ns, "st_ctime": ns, "st_atime": ns, "st_blocks": (size + 511) // 512,
                "st_blksize": self.max_read}

    def _entry_stat(self, entry: dict[str, Any]) -> dict[str, int]:
        return self._stat(entry["type"], int(entry.get("size") or 0), float(entry.get("mtime") or 0.0))

    def _tell(self, items: list[tuple[str, str]]) -> None:
        """Remember which version's attributes the kernel got for these paths (see ``open``)."""
        with self._lock:
            if len(self._told) + len(items) > _MAX_REMEMBERED:
                self._told.clear()
            self._told.update(items)

    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        if path == "/":
            return self._stat("directory")
        parts = path.strip("/").split("/", 1)
        if len(parts) == 1:
            if parts[0] not in self._guard("list mounts", path, self._mount_names):
                raise OSError(errno.ENOENT, path)
            return self._stat("directory")
        known = self._attrs.get(path)
        if known is not None:
            return known
        cp = self._cache_path(path)
        info = self._guard("info", path, lambda: self.session.info(cp))
        if info["type"] == "file":
            self._tell([(path, info.get("version", ""))])
        return self._entry_stat(info)

    def readdir(self, path: str, fh: Any) -> list[str]:
        if path == "/":
            return [".", "..", *self._guard("list mounts", path, self._mount_names)]
        cp = self._cache_path(path)
        entries = self._guard("list", path, lambda: self.session.list(cp, recursive=False))
        prefix = str(cp) + "/"
        names, attrs, told = [], [], []
        for entry in entries:
            name = entry["name"]
            if not name.startswith(prefix) or "/" in name[len(prefix):].strip("/"):
                continue  # not a direct child (never expected; never a path outside this one)
            child = name[len(prefix):].strip("/")
            if child:
                names.append(child)
                attrs.append((f"{path.rstrip('/')}/{child}", self._entry_stat(entry)))
                if entry["type"] == "file":
                    told.append((attrs[-1][0], entry.get("version", "")))
        self._attrs.put_many(attrs)
        self._tell(told)
        return [".", "..", *names]

    # -- files ---------------------------------------------------------------------------------------
    def open(self, path: str, fi: Any) -> int:
        """Revalidate the version (through the session, as the workers' metadata TTL allows) and
        pin the handle to it; the kernel keeps cached pages only if it cached this version.

        The page cache is the inode's, shared by every open of the path, so a file open at one
        version must never find another version's pages there. An open of a new version while
        handles of an older one are still open is therefore direct I/O (it bypasses the page
        cache and leaves the older handles' pages alone); so is an open whose version differs
        from the one whose size the kernel holds (its lookup came just before the change was
        seen): reads then end at the opened version's real size, not the kernel's stale one."""
        if fi.flags & _WRITE_FLAGS:
            raise OSError(errno.EROFS, f"{path}: the cachefs mount is read-only")
        if path.count("/") < 2:
            raise OSError(errno.EISDIR, path)
        if not self.revalidate_open:
            # ENOSYS once: the kernel then opens every file of this mount without asking (and
            # keeps its page cache across opens until a lookup shows a change): reads come with
            # no handle (``read_path``).
            raise OSError(errno.ENOSYS, f"{path}: the kernel opens files of this mount itself")
        cp = self._cache_path(path)
        info = self._guard("open", path, lambda: self.session.info(cp, read_ahead=self.max_read))
        if info["type"] != "file":
            raise OSError(errno.EISDIR, path)
        handle = Handle(path, cp, info.get("version", ""), int(info["size"]))
        with self._lock:
            fh = next(self._ids)
            self._handles[fh] = handle
            live = self._live.setdefault(path, {})
            others = any(v != handle.version for v in live)
            live[handle.version] = live.get(handle.version, 0) + 1
            direct = others or self._told.get(path, handle.version) != handle.version
            keep = others or (self._opened.get(path) == handle.version and bool(handle.version))
            if not others:  # the page cache will hold this version's pages (or none)
                if len(self._opened) >= _MAX_REMEMBERED:
                    self._opened.clear()
                self._opened[path] = handle.version
        log.debug("open %s version %s: keep_cache %s, direct_io %s", path, handle.version, keep, direct)
        fi.fh = fh
        fi.direct_io = 1 if direct else 0
        fi.keep_cache = 1 if keep else 0
        return 0

    def read_into(self, fh: int, out: memoryview, offset: int) -> int:
        """Fill ``out`` (libfuse's reply buffer) from ``offset`` of the open file: bytes read."""
        handle = self._handle(fh)
        want = min(len(out), max(0, handle.size - offset))
        if want == 0:
            return 0
        got, _size = self._guard("read", str(handle.cp), lambda: self.session.read_into(
            handle.cp, out[:want], offset, handle.version))
        return got

    def read_path(self, path: str, out: memoryview, offset: int) -> int:
        """A read with no open handle (``revalidate_open`` off): of the version the session knows now."""
        cp = self._cache_path(path)
        # At the start of a file (the kernel's first read of it), the first bytes' pages come with
        # the info in one message (as at open): a cold object then costs one GET, not a HEAD too.
        ahead = len(out) if offset == 0 else 0
        info = self._guard("read", path, lambda: self.session.info(cp, read_ahead=ahead))
        want = min(len(out), max(0, int(info["size"]) - offset))
        if want == 0:
            return 0
        got, _size = self._guard("read", path, lambda: self.session.read_into(
            cp, out[:want], offset, info.get("version", "")))
        return got

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        """The binding's plain read (a copy more than ``read_into``)."""
        buffer = bytearray(size)
        got = self.read_into(fi.fh, memoryview(buffer), offset)
        return bytes(buffer[:got])

    def release(self, path: str, fi: Any) -> int:
        with self._lock:
            handle = self._handles.pop(fi.fh, None)
            live = self._live.get(handle.path, {}) if handle is not None else {}
            if handle is not None and live.get(handle.version, 0) > 1:
                live[handle.version] -= 1
            elif handle is not None:
                live.pop(handle.version, None)
                if not live:
                    self._live.pop(handle.path, None)
        return 0

    def _handle(self, fh: int) -> Handle:
        with self._lock:
            handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, f"no open file {fh}")
        return handle

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": self.max_read, "f_frsize": self.max_read, "f_namemax": 255}

    def access(self, path: str, mode: int) -> int:
        if mode & os.W_OK:
            raise OSError(errno.EROFS, f"{path}: the cachefs mount is read-only")
        return 0

    # -- errors --------------------------------------------------------------------------------------
    def _guard(self, what: str, path: str, call: Any) -> Any:
        """``call()``, its exception turned into the errno a file system gives: ENOENT, EISDIR...;
        ESTALE when the object changed under an open file; EIO (one log line naming the object)
        when no worker nor the fallback could serve it."""
        try:
            return call()
        except OSError as exc:
            code = _errno_of(exc)
            if code == errno.EIO:
                log.error("cachefs fuse: %s %s failed: %s: %s", what, path, type(exc).__name__, exc)
            raise OSError(code, f"{path}: {exc}") from None
        except Exception as exc:  # never a crash of the mount: one line naming the object
            log.error("cachefs fuse: %s %s failed: %s: %s", what, path, type(exc).__name__, exc)
            raise OSError(errno.EIO, f"{path}: {exc}") from None


#: errnos that mean what they say wherever they come from (a store's refusal, an unsupported write).
_KEPT = frozenset({errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.EXDEV, errno.ENOSPC,
                   errno.EROFS, errno.EACCES, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF,
                   errno.EBUSY, errno.ENAMETOOLONG})


def _errno_of(exc: OSError) -> int:
    if isinstance(exc, StaleObjectError):
        return errno.ESTALE
    if isinstance(exc, (FileNotFoundError, InvalidPathError)):
        return errno.ENOENT
    if isinstance(exc, IsADirectoryError):
        return errno.EISDIR
    if isinstance(exc, NotADirectoryError):
        return errno.ENOTDIR
    if isinstance(exc, PermissionError):
        return errno.EACCES
    if isinstance(exc, FileExistsError):
        return errno.EEXIST
    if type(exc) is OSError and exc.errno in _KEPT:
        return exc.errno
    return errno.EIO
