"""How each kind of store is read: metadata, ranged reads checked against a version, pieces.

The version is part of every cached page's identity, so a read must never return bytes of
another version than the one it was asked for; how that is checked depends on the store:
S3 with ``If-Match`` on the ETag, local files by re-checking size+mtime on the open descriptor,
other fsspec stores not at all (a documented weakness). Used by ObjectStore (objects.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
from fsspec.asyn import sync
from fsspec.implementations.local import LocalFileSystem

from cachefs.errors import StaleObjectError
from cachefs.store import beneath, localpages
from cachefs.store.health import is_connection_error
from cachefs.store.meta import Listing

PieceSink = Callable[[int, bytes], None]  # (index of the piece, its bytes)


def _mtime_of(info: dict[str, Any]) -> float:
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0


def version_of(info: dict[str, Any]) -> str:
    """ETag where the store has one, else size+mtime."""
    for name in ("ETag", "etag", "e_tag"):
        if info.get(name):
            return str(info[name]).strip('"')
    return f"{int(info.get('size') or 0)}-{_mtime_of(info)!r}"


class _Backend:
    """Generic fsspec store: the version cannot be checked on read (documented weakness)."""

    def ls(self, fs: fsspec.AbstractFileSystem, store_path: str) -> Listing:
        """A directory's entries (``fs.ls(detail=True)``'s info dicts, or ``ListedEntry`` tuples),
        asked of the store itself."""
        fs.invalidate_cache(store_path)  # we own the TTL, not the filesystem
        return fs.ls(store_path, detail=True)

    def find(self, fs: fsspec.AbstractFileSystem, store_path: str) -> list[dict[str, Any]]:
        """Every object under ``store_path``, recursively (``fs.find(detail=True)``'s values)."""
        return list(fs.find(store_path, detail=True, withdirs=False).values())

    def list_after(self, fs: fsspec.AbstractFileSystem, store_path: str, recursive: bool, after: str,
                   limit: int) -> tuple[list[dict[str, Any]], bool] | None:
        """Up to ``limit`` entries of ``ls`` (``find`` if ``recursive``) whose keys below
        ``store_path`` sort after ``after`` (""; from the first), in that order, and whether they
        are the last; None: this store cannot page (the caller lists it whole). A filesystem that
        pages its own listings says so with ``cachefs_list_after`` (cachefs.testing's synthetic store)."""
        paged = getattr(fs, "cachefs_list_after", None)
        return None if paged is None else paged(store_path, recursive, after, limit)

    def info(self, fs: fsspec.AbstractFileSystem, store_path: str) -> tuple[int, str, float, bool]:
        fs.invalidate_cache(store_path)  # s3fs answers info() from its own listing cache otherwise
        info = fs.info(store_path)
        is_dir = info.get("type") == "directory"
        size = 0 if is_dir else int(info.get("size") or 0)
        return size, ("" if is_dir else version_of(info)), _mtime_of(info), is_dir

    def read(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, end: int, version: str) -> bytes:
        return fs.cat_file(store_path, start=start, end=end)

    def read_pieces(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, sizes: Sequence[int],
                    version: str, deliver: PieceSink) -> None:
        """Bytes from ``start`` cut in pieces of ``sizes``, each handed to ``deliver(i, piece)`` in order.

        Generic stores cannot stream a checked range: one read, then the pieces (all or none).
        """
        end = start + sum(sizes)
        data = self.read(fs, store_path, start, end, version)
        if len(data) != end - start:
            raise StaleObjectError(f"{store_path}: store returned {len(data)} bytes of [{start}, {end})")
        view, at = memoryview(data), 0
        for i, size in enumerate(sizes):
            deliver(i, data if size == len(data) else bytes(view[at:at + size]))
            at += size

    def head_read(self, fs: fsspec.AbstractFileSystem, store_path: str,
                  length: int) -> tuple[tuple[int, str, float, bool], bytes | None]:
        """Metadata, and the first ``length`` bytes where one request can give both (else None)."""
        return self.info(fs, store_path), None


class _LocalBackend(_Backend):
    """Local files: the version (size + mtime) is re-checked on the open descriptor after reading.

    Every path is opened beneath its mount's root without following any symlink (beneath.py):
    the store paths are :class:`~cachefs.store.beneath.LocalStorePath` (MountTable.resolve).
    """

    _version = staticmethod(beneath.local_version)

    def ls(self, fs: fsspec.AbstractFileSystem, store_path: str) -> Listing:
        return beneath.list_beneath(_local(store_path))

    def find(self, fs: fsspec.AbstractFileSystem, store_path: str) -> list[dict[str, Any]]:
        return beneath.find_beneath(_local(store_path))

    def list_after(self, fs: fsspec.AbstractFileSystem, store_path: str, recursive: bool, after: str,
                   limit: int) -> tuple[list[dict[str, Any]], bool] | None:
        return localpages.page_after(_local(store_path), recursive, after, limit)

    def info(self, fs: fsspec.AbstractFileSystem, store_path: str) -> tuple[int, str, float, bool]:
        st = beneath.stat_beneath(_local(store_path))
        if stat.S_ISDIR(st.st_mode):
            return 0, "", st.st_mtime, True
        return st.st_size, self._version(st), st.st_mtime, False

    def read(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, end: int, version: str) -> bytes:
        with beneath.open_file(_local(store_path)) as f:
            f.seek(start)
            buf = bytearray(end - start)
            n = f.readinto(buf)
            now = self._version(os.fstat(f.fileno()))
        if now != version:
            raise StaleObjectError(f"{store_path} changed while reading (version {version} -> {now})")
        del buf[n:]
        return bytes(buf)

    def read_pieces(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, sizes: Sequence[int],
                    version: str, deliver: PieceSink) -> None:
        """One read per piece (no slicing copies); delivered only once the version re-check passed."""
        pieces = []
        with beneath.open_file(_local(store_path)) as f:
            f.seek(start)
            at = start
            for size in sizes:
                piece = f.read(size)
                if len(piece) != size:
                    raise StaleObjectError(f"{store_path}: {len(piece)} bytes at {at}, expected {size}")
                pieces.append(piece)
                at += size
            now = self._version(os.fstat(f.fileno()))
        if now != version:
            raise StaleObjectError(f"{store_path} changed while reading (version {version} -> {now})")
        for i, piece in enumerate(pieces):
            deliver(i, piece)


def _local(store_path: str) -> beneath.LocalStorePath:
    """A local mount's path as MountTable.resolve made it; a bare path (a caller outside a mount
    table) is taken as the key of a mount rooted at /, so it is still opened without symlinks."""
    if isinstance(store_path, beneath.LocalStorePath):
        return store_path
    return beneath.LocalStorePath("/", str(store_path).strip("/"))


class _S3Backend(_Backend):
    """S3 via s3fs: ranged GET with If-Match on the ETag, so the store itself refuses a changed object."""

    def list_after(self, fs: fsspec.AbstractFileSystem, store_path: str, recursive: bool, after: str,
                   limit: int) -> tuple[list[dict[str, Any]], bool] | None:
        """A recursive listing in the store's own pages (ListObjectsV2 ``MaxKeys``, ``StartAfter``:
        keys come in UTF-8 byte order, which is the names' order). A listing by directory is not
        paged: S3 puts a common prefix "d/" where "d/" sorts, after "d-x" and "d.txt", not where "d"
        does."""
        bucket, key, _ = fs.split_path(store_path)
        if not recursive or not bucket:
            return None
        prefix = key.strip("/") + "/" if key.strip("/") else ""

        def page(start_after: str) -> tuple[list[tuple[str, int, str, float]], bool]:
            async def call() -> dict[str, Any]:
                return await fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, StartAfter=start_after,
                                         MaxKeys=limit)

            reply = sync(fs.loop, call)
            found = [(c["Key"], int(c.get("Size") or 0), str(c.get("ETag") or "").strip('"'),
                      _mtime_of({"mtime": c.get("LastModified")})) for c in reply.get("Contents", ())]
            return found, not reply.get("IsTruncated")

        return s3_pages(bucket, prefix, after, page)

    def read(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, end: int, version: str) -> bytes:
        if end <= start:
            return b""
        bucket, key, _ = fs.split_path(store_path)

        async def get() -> bytes:
            resp = await fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=f'"{version}"'
            )
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        try:
            return sync(fs.loop, get)
        except Exception as exc:  # s3fs raises OSError subclasses, or botocore's ClientError as is
            if _precondition_failed(exc):
                raise StaleObjectError(f"{store_path} changed in the store (ETag {version} no longer matches)") from exc
            raise

    def read_pieces(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, sizes: Sequence[int],
                    version: str, deliver: PieceSink) -> None:
        """One ranged GET (If-Match), streamed: each piece is delivered as soon as its bytes arrived.

        The first page of a large run reaches its reader after one page's transfer, not the whole
        run's, so runs can be long (few requests) without delaying the first bytes. ``deliver``
        runs on the store's event-loop thread and must be quick (it hands the piece on).
        """
        total = sum(sizes)
        if total <= 0:
            return
        bucket, key, _ = fs.split_path(store_path)

        async def get() -> None:
            resp = await fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + total - 1}", IfMatch=f'"{version}"'
            )
            body = resp["Body"]
            try:
                at = start
                for i, size in enumerate(sizes):
                    parts: list[bytes] = []
                    got = 0
                    while got < size:
                        chunk = await body.read(size - got)
                        if not chunk:
                            raise StaleObjectError(
                                f"{store_path}: stream ended at {at + got}, expected {start + total}")
                        parts.append(chunk)
                        got += len(chunk)
                    deliver(i, parts[0] if len(parts) == 1 else b"".join(parts))
                    at += size
            finally:
                body.close()

        try:
            sync(fs.loop, get)
        except Exception as exc:  # noqa: BLE001 - see read()
            if _precondition_failed(exc):
                raise StaleObjectError(f"{store_path} changed in the store (ETag {version} no longer matches)") from exc
            raise


    def head_read(self, fs: fsspec.AbstractFileSystem, store_path: str,
                  length: int) -> tuple[tuple[int, str, float, bool], bytes | None]:
        """One GET instead of HEAD + GET on a cold object: the reply carries size, ETag and data."""
        bucket, key, _ = fs.split_path(store_path)

        async def get() -> tuple[dict[str, Any], bytes]:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{length - 1}")
            try:
                return resp, await resp["Body"].read()
            finally:
                resp["Body"].close()

        try:
            resp, data = sync(fs.loop, get)
        except Exception as exc:  # noqa: BLE001
            if is_connection_error(exc):
                raise  # the store is down: asking again with a HEAD would only double the wait
            # A prefix ("directory"), an empty object (416) or a real error: let info() tell which.
            return self.info(fs, store_path), None
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else int(resp.get("ContentLength", len(data)))
        version = str(resp.get("ETag", "")).strip('"')
        if not version:
            return self.info(fs, store_path), None
        return (size, version, _mtime_of(resp), False), data


def s3_pages(bucket: str, prefix: str, after: str,
             page: Callable[[str], tuple[list[tuple[str, int, str, float]], bool]]) -> tuple[list[dict[str, Any]], bool]:
    """One page of a recursive S3 listing as ``find`` gives its entries: ``page(start_after)``
    asks the store for (objects as (key, size, etag, mtime), whether they are the last). Keys
    ending in "/" (directory markers) are not objects; a page of nothing else is passed over, so
    only the final page may come back empty."""
    start = prefix + after
    while True:
        objects, final = page(start)
        entries = [{"name": f"{bucket}/{key}", "size": size, "type": "file", "ETag": f'"{etag}"',
                    "LastModified": mtime} for key, size, etag, mtime in objects if not key.endswith("/")]
        if entries or final or not objects:
            return entries, final or not objects
        start = objects[-1][0]


def _precondition_failed(exc: BaseException | None) -> bool:
    """True if S3 answered 412 (s3fs hides botocore's error code in the exception chain)."""
    seen = 0
    while exc is not None and seen < 8:
        if "PreconditionFailed" in repr(exc) or "(412)" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _backend_for(fs: fsspec.AbstractFileSystem, s3_client: str = "auto") -> _Backend:
    """The backend for a mount's filesystem. S3 data reads: ``s3_client`` "http" (s3http.py),
    "obstore" (native.py) or "s3fs"; "auto" takes the first of them that the mount's options allow."""
    if isinstance(fs, LocalFileSystem):
        return _LocalBackend()
    if "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        # Imported here: both build on this module.
        from cachefs.store.native import native_backend_for
        from cachefs.store.s3http import http_backend_for

        if s3_client in ("auto", "http"):
            backend: _Backend | None = http_backend_for(fs)
            if backend is not None:
                return backend
        if s3_client in ("auto", "obstore"):
            backend = native_backend_for(fs)
            if backend is not None:
                return backend
        return _S3Backend()
    return _Backend()
