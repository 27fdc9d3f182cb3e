"""The writable ``cachefs fuse --writable``: create/write/close streamed through to the store.

A file opened for writing is one ``Write`` stream to the worker that owns the path, exactly as
``fs.open(path, "wb")`` (client/fs/writer.py): the bytes leave as they are written (4 MiB
messages), the worker uploads them (multipart on S3) and the object is published when the file
is closed (FUSE's ``flush``, which close(2) waits for, so its error is close's error and a
``cat`` right after sees the object; a file still empty at close is published when its last
descriptor goes, see ``flush``). Until then nothing is visible in the store; if this
process dies (kill -9, OOM) the stream breaks and the worker discards the upload. An
application killed mid-write is closed by its kernel like any other: what it wrote is
published, as a local disk would keep a truncated file.

What an object store cannot do is refused with a clear errno: writes at other than the next
offset, opening an existing non-empty object to modify it (without ``O_TRUNC``), appends
(``EOPNOTSUPP``); renaming a directory or across mounts (``EXDEV``: ``mv`` then copies and
removes itself). A file rename is the store's copy then a remove of the source: on S3 it is
not atomic (a reader may see both names, or, if the remove fails, both stay).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from typing import Any

from cachefs.client.fuse.fusefs import _MAX_REMEMBERED, CacheFuseOps
from cachefs.client.transport.session import ClientSession
from cachefs.client.fs.writer import CHUNK, Sink, Writes
from cachefs.paths import CachePath

log = logging.getLogger(__name__)

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


class WriteHandle:
    """One file open for writing: bytes gathered into ``CHUNK`` pieces for one write stream."""

    def __init__(self, path: str, cp: CachePath, sink: Sink) -> None:
        self.path, self.cp, self.sink = path, cp, sink
        self.written = 0
        self.mtime = time.time()
        self.done = False  # published (or failed): later writes are refused
        self.error: OSError | None = None
        self._pending = bytearray()
        self.lock = threading.Lock()

    def write(self, data: bytes, offset: int) -> int:
        """Append ``data`` at ``offset`` (must be the end so far); called under ``lock``."""
        if self.done:
            raise OSError(errno.EIO, f"{self.path}: already published at an earlier close, or failed")
        if offset != self.written:
            raise OSError(errno.EOPNOTSUPP, f"{self.path}: write at {offset}, but {self.written} bytes written: "
                                            f"a cachefs object is written front to back, once")
        self._pending += data
        self.written += len(data)
        self.mtime = time.time()
        if len(self._pending) >= CHUNK:
            self._send()
        return len(data)

    def _send(self) -> None:
        data, self._pending = bytes(self._pending), bytearray()
        self.sink.send(data)

    def publish(self) -> dict[str, Any]:
        """Send what is left and commit (the object appears in the store); under ``lock``."""
        if self._pending:
            self._send()
        return self.sink.finish()

    def abandon(self) -> None:
        self.done = True
        self._pending = bytearray()
        self.sink.cancel()


class WritableFuseOps(CacheFuseOps):
    """``CacheFuseOps`` plus create, write, flush (publish), truncate, unlink, mkdir, rmdir, rename."""

    def __init__(self, session: ClientSession, attr_timeout: float = 1.0, max_read: int = 1 << 20,
                 revalidate_open: bool = True) -> None:
        super().__init__(session, attr_timeout=attr_timeout, max_read=max_read)  # writes need every open
        self.writable = True
        self._writes = Writes(session, "worker")
        self._writing: dict[int, WriteHandle] = {}  # fh -> handle
        self._by_path: dict[str, WriteHandle] = {}  # path -> the newest handle writing it
        self._made_dirs: dict[str, float] = {}  # directories made here (S3 has none until an object is put)

    # -- attributes of what is being written, and of directories made here ------------------------
    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        handle = self._writing.get(getattr(fh, "fh", -1)) if fh is not None else None
        handle = handle or self._by_path.get(path)
        if handle is not None and not handle.done:
            return self._stat("file", handle.written, handle.mtime)
        try:
            return super().getattr(path, fh)
        except OSError as exc:
            if exc.errno == errno.ENOENT and path in self._made_dirs:
                return self._stat("directory", 0, self._made_dirs[path])
            raise

    def readdir(self, path: str, fh: Any) -> list[str]:
        try:
            names = super().readdir(path, fh)
        except OSError as exc:
            if exc.errno != errno.ENOENT or path not in self._made_dirs:
                raise
            names = [".", ".."]
        prefix = path.rstrip("/") + "/"
        extra = [p[len(prefix):] for p in [*self._made_dirs, *self._by_path]
                 if p.startswith(prefix) and "/" not in p[len(prefix):]]
        return names + sorted(set(extra) - set(names))

    # -- files ------------------------------------------------------------------------------------------
    def create(self, path: str, mode: int, fi: Any) -> int:
        fi.fh = self._start(path)
        fi.direct_io = 0
        return 0

    def open(self, path: str, fi: Any) -> int:
        flags = fi.flags
        if not flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            return super().open(path, fi)
        if flags & os.O_APPEND:
            raise OSError(errno.EOPNOTSUPP, f"{path}: cachefs cannot append to an object (write it whole)")
        if not flags & os.O_TRUNC and self._size(path) > 0:
            raise OSError(errno.EOPNOTSUPP, f"{path}: cachefs cannot modify part of an object: open it with "
                                            f"O_TRUNC ('wb') to replace it whole")
        fi.fh = self._start(path)
        return 0

    def _size(self, path: str) -> int:
        return int(self.getattr(path).get("st_size", 0))

    def _start(self, path: str) -> int:
        cp = self._writable_path(path)
        sink = self._guard("write", path, lambda: self._writes.sink(cp))
        handle = WriteHandle(path, cp, sink)
        with self._lock:
            fh = next(self._ids)
            self._writing[fh] = handle
            self._by_path[path] = handle
        self._forget(path)
        return fh

    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        handle = self._writing.get(fi.fh)
        if handle is None:
            raise OSError(errno.EBADF, f"{path}: not open for writing")
        with handle.lock:
            try:
                return self._guard("write", handle.path, lambda: handle.write(data, offset))
            except OSError as exc:
                if exc.errno == errno.EOPNOTSUPP:
                    log.warning("cachefs fuse: %s", exc.strerror)
                if not handle.done:
                    handle.abandon()  # a failed write is over: nothing is published
                    handle.error = exc
                raise

    def read_into(self, fh: int, out: memoryview, offset: int) -> int:
        if fh in self._writing:
            raise OSError(errno.EOPNOTSUPP, "a file open for writing cannot be read back before it is closed")
        return super().read_into(fh, out, offset)

    def flush(self, path: str, fi: Any) -> int:
        """close(2): publish a written file (its error is close's error).

        A close before any byte is written publishes nothing yet: a shell's ``> file`` opens the
        file, dup2()s it onto stdout and closes the first descriptor before a byte is written.
        Such a file (and one left empty) is published when its last descriptor goes (release)."""
        handle = self._writing.get(fi.fh)
        if handle is None:
            return 0
        with handle.lock:
            if handle.error is not None:
                raise OSError(handle.error.errno or errno.EIO, f"{handle.path}: the write failed: nothing published")
            if handle.done or handle.written == 0:
                return 0
            self._publish(handle)
        return 0

    def _publish(self, handle: WriteHandle) -> None:
        """Under ``handle.lock``: commit the object (once)."""
        handle.done = True
        try:
            self._guard("publish", handle.path, handle.publish)
        except OSError as exc:
            handle.error = exc
            handle.sink.cancel()
            raise
        finally:
            self._forget(handle.path)

    def fsync(self, path: str, datasync: int, fi: Any) -> int:
        return 0  # an object is durable once published, at close: nothing to do before

    def release(self, path: str, fi: Any) -> int:
        """The last descriptor closed: an empty file not published at a close is published now
        (the kernel does not wait for this reply: its error can only be logged)."""
        handle = self._writing.pop(fi.fh, None)
        if handle is None:
            return super().release(path, fi)
        try:
            with handle.lock:
                if not handle.done and handle.error is None:
                    self._publish(handle)
        except OSError as exc:
            log.error("cachefs fuse: %s was not published: %s", handle.path, exc)
        finally:
            with self._lock:
                if self._by_path.get(handle.path) is handle:
                    del self._by_path[handle.path]
        return 0

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        handle = self._writing.get(getattr(fh, "fh", -1)) if fh is not None else self._by_path.get(path)
        if handle is not None and not handle.done:
            if length != handle.written:
                raise OSError(errno.EOPNOTSUPP, f"{path}: cannot truncate a file being written to {length}")
            return 0
        if length == self._size(path):
            return 0
        if length != 0:
            raise OSError(errno.EOPNOTSUPP, f"{path}: cachefs can only truncate an object to 0 (write it whole)")
        cp = self._writable_path(path)
        self._guard("truncate", path, lambda: self._writes.write_bytes(cp, b""))
        self._forget(path)
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        return 0  # an object's time is the store's (its last write): touch of an existing file does nothing

    def chmod(self, path: str, mode: int) -> int:
        return 0  # objects have no modes (the mount shows 644/755): rsync, tar and cp -p go on

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0  # nor owners

    # -- names --------------------------------------------------------------------------------------------
    def unlink(self, path: str) -> int:
        cp = self._writable_path(path)
        self._guard("remove", path, lambda: self._writes.remove(cp, recursive=False))
        self._forget(path)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        cp = self._writable_path(path)
        self._guard("mkdir", path, lambda: self._writes.make_dir(cp, create_parents=False, exist_ok=False))
        with self._lock:
            if len(self._made_dirs) >= _MAX_REMEMBERED:
                self._made_dirs.clear()
            self._made_dirs[path] = time.time()
        self._forget(path)
        return 0

    def rmdir(self, path: str) -> int:
        cp = self._writable_path(path)
        if self.readdir(path, None)[2:]:
            raise OSError(errno.ENOTEMPTY, f"{path}: directory not empty")
        try:
            self._guard("rmdir", path, lambda: self._writes.remove(cp, recursive=False))
        except OSError as exc:
            if exc.errno != errno.ENOENT or path not in self._made_dirs:
                raise  # made here and never holding an object: S3 has nothing to remove
        with self._lock:
            self._made_dirs.pop(path, None)
        self._forget(path)
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        """A file: the store's copy of ``old`` to ``new``, then a remove of ``old`` (not atomic)."""
        if flags & _RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, f"{old}: cachefs cannot exchange two objects")
        source, destination = self._writable_path(old), self._writable_path(new)
        if source.mount != destination.mount:
            raise OSError(errno.EXDEV, f"{old} -> {new}: across mounts")
        if stat.S_ISDIR(self.getattr(old)["st_mode"]):
            raise OSError(errno.EXDEV, f"{old}: cachefs renames files only (a directory is moved file by file)")
        if flags & _RENAME_NOREPLACE and self._exists(new):
            raise OSError(errno.EEXIST, f"{new} exists")
        if old in self._by_path:
            raise OSError(errno.EBUSY, f"{old} is still open for writing: close it first")
        self._guard("rename", old, lambda: self._writes.copy(source, destination))
        self._forget(new)
        self._guard("rename (remove the source)", old, lambda: self._writes.remove(source, recursive=False))
        self._forget(old)
        return 0

    def access(self, path: str, mode: int) -> int:
        if mode & os.W_OK:
            mount = path.strip("/").split("/", 1)[0]
            if not mount:
                raise OSError(errno.EACCES, "/: the top-level folders are the mount table's")
            if mount in self._guard("list mounts", path, self._read_only_mounts):
                raise OSError(errno.EROFS, f"{path}: mount {mount} is read-only")
        return 0

    # -- helpers ------------------------------------------------------------------------------------------
    def _exists(self, path: str) -> bool:
        try:
            self.getattr(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    def _writable_path(self, path: str) -> CachePath:
        """The object's path; EROFS when its mount is read-only in the mount table; EACCES at a mount's
        own folder or the root (they are the mount table's, not the store's)."""
        if path.count("/") < 2:
            raise OSError(errno.EACCES, f"{path}: the top-level folders are the mount table's")
        cp = self._cache_path(path)
        if cp.mount in self._guard("list mounts", path, self._read_only_mounts):
            raise OSError(errno.EROFS, f"{path}: mount {cp.mount} is read-only")
        return cp

    def _read_only_mounts(self) -> set[str]:
        known = self._mounts.get("read_only")
        if known is None:
            known = {m.name for m in self.session.public_mounts() if m.read_only}
            self._mounts.put_many([("read_only", known)])
        return known

    def _forget(self, path: str) -> None:
        """Drop what this process remembered of ``path`` (attributes from listings, the version whose
        pages the kernel holds): the next lookup and open ask the session."""
        self._attrs.discard(path)
        with self._lock:
            self._opened.pop(path, None)
            self._told.pop(path, None)
