"""Writing objects into a mount's store: all-or-nothing, whatever the store.

A write either replaces the object whole or leaves the old one in place: on S3 the data
goes up as a multipart upload that is completed only on ``commit`` (and aborted on
``discard``); on a local directory it goes to a hidden temporary file next to the target,
renamed over it on ``commit``. Used by the worker (server/worker/writer.py) and by a client
that writes to the store itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import stat
import threading
import uuid
from typing import Any, Protocol

import fsspec
from fsspec.asyn import sync
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from cachefs.mounts import ResolvedPath
from cachefs.store import beneath
from cachefs.paths import CachePath

COPY_CHUNK = 8 << 20  # bytes per read when a copy streams between two stores
PARTIAL_MARK = ".cachefs-partial-"  # in the name of a local file being written
S3_PART = 16 << 20  # bytes per multipart part (S3's minimum is 5 MiB, except the last)
S3_PARTS_IN_FLIGHT = 4


class StoreWriter(Protocol):
    def write(self, data: bytes | memoryview) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


class LocalWriter:
    """A hidden temporary file in the target's directory, renamed into place on commit."""

    def __init__(self, store_path: str) -> None:
        self.path = store_path
        parent, name = os.path.split(store_path)
        os.makedirs(parent, exist_ok=True)  # a store without directories (S3) needs none either
        if os.path.isdir(store_path):
            raise IsADirectoryError(errno.EISDIR, f"{store_path} is a directory")
        self.tmp = os.path.join(parent, f".{name}{PARTIAL_MARK}{uuid.uuid4().hex}")
        self._file = open(self.tmp, "wb")  # noqa: SIM115 - closed by commit/discard

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self._file.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class FsspecWriter:
    """Any fsspec store's own ``open(..., "wb")`` (s3fs: multipart upload, completed on close)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, store_path: str, block_size: int | None = None) -> None:
        kwargs: dict[str, Any] = {"block_size": block_size} if block_size else {}
        self._file = fs.open(store_path, "wb", **kwargs)

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.close()

    def discard(self) -> None:
        discard = getattr(self._file, "discard", None)
        if discard is not None:
            discard()  # s3fs aborts the multipart upload; nothing becomes visible
            if isinstance(self._file, AbstractBufferedFile):
                self._file.closed = True  # or its __del__ would try to publish what is left
        # Without discard (an in-memory file) the file is left unclosed: closing would publish it.


class S3Writer:
    """A multipart upload with several parts in flight while more data arrives.

    s3fs's own file uploads its parts one after another, after each fills; here part n goes up
    while part n+1 is still being received, so a checkpoint streamed through a worker is no
    slower than one written with s3fs directly. Small objects are one PUT on commit.
    """

    def __init__(self, fs: Any, store_path: str, part_size: int = S3_PART, concurrency: int = S3_PARTS_IN_FLIGHT,
                 timeout: float = 300.0) -> None:
        self.fs, self.store_path = fs, store_path
        self.bucket, self.key, _ = fs.split_path(store_path)
        self.part_size = part_size
        self._timeout = timeout
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._pending: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._slots = threading.Semaphore(concurrency)

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key, **kwargs)

    def write(self, data: bytes | memoryview) -> None:
        self._buf += data
        while len(self._buf) >= self.part_size:
            part = bytes(self._buf[:self.part_size])
            del self._buf[:self.part_size]
            self._start_part(part)

    def _start_part(self, body: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        number = len(self._pending) + 1
        if number % 1000 == 0:
            self.part_size *= 2  # S3 allows 10,000 parts: grow them so a huge object still fits
        if not self._slots.acquire(timeout=self._timeout):
            raise TimeoutError(errno.ETIMEDOUT, f"{self.store_path}: no part upload finished in {self._timeout} s")

        async def upload() -> dict[str, Any]:
            resp = await self.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.key, PartNumber=number,
                                          UploadId=self._upload_id, Body=body)
            return {"PartNumber": number, "ETag": resp["ETag"]}

        future = asyncio.run_coroutine_threadsafe(upload(), self.fs.loop)
        future.add_done_callback(lambda _: self._slots.release())
        self._pending.append(future)
        failed = next((f for f in self._pending if f.done() and f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]

    def commit(self) -> None:
        if self._upload_id is None:
            self._call("put_object", Body=bytes(self._buf))
        else:
            if self._buf or not self._pending:
                self._start_part(bytes(self._buf))
            parts = [f.result(timeout=self._timeout) for f in self._pending]
            self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        self._buf = bytearray()
        self.fs.invalidate_cache(self.store_path)

    def discard(self) -> None:
        for future in self._pending:
            future.cancel()
        concurrent.futures.wait(self._pending, timeout=self._timeout)
        if self._upload_id is not None:
            self._call("abort_multipart_upload", UploadId=self._upload_id)
        self._buf = bytearray()


def open_writer(resolved: ResolvedPath, block_size: int | None = None) -> StoreWriter:
    if isinstance(resolved.store_path, beneath.LocalStorePath):  # a local mount: no symlink followed
        return beneath.LocalWriter(resolved.store_path, PARTIAL_MARK, uuid.uuid4().hex)
    if isinstance(resolved.fs, LocalFileSystem):
        return LocalWriter(resolved.store_path)
    protocols = resolved.fs.protocol if isinstance(resolved.fs.protocol, (tuple, list)) else (resolved.fs.protocol,)
    if "s3" in protocols and hasattr(resolved.fs, "_call_s3"):
        return S3Writer(resolved.fs, resolved.store_path, part_size=block_size or S3_PART)
    return FsspecWriter(resolved.fs, resolved.store_path, block_size)


def copy_between(src: ResolvedPath, dst: ResolvedPath) -> None:
    """Copy one object: store-side when both paths are in the same store, else streamed."""
    if src.fs is dst.fs and not isinstance(dst.fs, LocalFileSystem):
        src.fs.cp_file(src.store_path, dst.store_path)  # S3: CopyObject (multipart copy if large)
        return
    writer = open_writer(dst)
    try:
        local = isinstance(src.store_path, beneath.LocalStorePath)
        with (beneath.open_file(src.store_path) if local else src.fs.open(src.store_path, "rb")) as f:
            while chunk := f.read(COPY_CHUNK):
                writer.write(chunk)
    except BaseException:
        writer.discard()
        raise
    writer.commit()


def remove(resolved: ResolvedPath, path: CachePath, is_dir: bool, recursive: bool) -> None:
    """Remove an object, or a directory (with ``recursive``, everything below it)."""
    fs, store_path = resolved.fs, resolved.store_path
    if isinstance(store_path, beneath.LocalStorePath):
        beneath.remove(store_path, is_dir, recursive)
        return
    if not is_dir:
        fs.rm_file(store_path)
    elif recursive:
        fs.rm(store_path, recursive=True)
    elif isinstance(fs, LocalFileSystem):
        os.rmdir(store_path)  # OSError(ENOTEMPTY) if it is not empty
    elif fs.ls(store_path, detail=False):
        raise OSError(errno.ENOTEMPTY, f"{path} is a directory and not empty: pass recursive=True")
    # An empty directory in a store without directories (S3) is already gone.


def make_dir(resolved: ResolvedPath, create_parents: bool, exist_ok: bool) -> None:
    """A directory on stores that have them; stores without directories (S3) need nothing."""
    fs, store_path = resolved.fs, resolved.store_path
    if not isinstance(fs, LocalFileSystem):
        return
    if isinstance(store_path, beneath.LocalStorePath):
        try:
            st = beneath.stat_beneath(store_path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not exist_ok or not stat.S_ISDIR(st.st_mode):
                raise FileExistsError(errno.EEXIST, f"{store_path} exists")
            return
        if create_parents:
            beneath.make_dirs(store_path, exist_ok=exist_ok)
        else:
            beneath.make_dir(store_path)
        return
    if os.path.isdir(store_path):
        if not exist_ok:
            raise FileExistsError(errno.EEXIST, f"{store_path} exists")
        return
    if create_parents:
        os.makedirs(store_path, exist_ok=exist_ok)
    else:
        os.mkdir(store_path)
