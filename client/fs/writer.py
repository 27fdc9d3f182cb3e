"""Write-through for the ``cachefs://`` client: writes go to the object store, caches are dropped.

By default every write goes to the worker that owns the path's first stripe (the one whose
caches hold it): ``open(..., "wb")``/``put`` stream the bytes to its data port while they are
produced (parts on a connection of the write's own; gRPC's client-streaming ``Write`` where the
worker has no data port for this process), and the worker streams them into the store
(multipart on S3) and drops its cached metadata, listings and old pages. With
``write_via="client"`` the client writes to the store itself (its own credentials, the
``fallback_mounts`` table) and then asks that worker to ``Free`` the path.
A write is all or nothing: a file left by an exception (``with fs.open(p, "wb")`` that
raises) or a cancelled stream publishes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
from typing import TYPE_CHECKING, Any, Protocol

from fsspec.callbacks import DEFAULT_CALLBACK
from fsspec.spec import AbstractBufferedFile
from fsspec.utils import isfilelike

from cachefs.errors import DeadlineExceededError, WorkerUnavailableError, from_rpc_error
from cachefs.paths import CachePath
from cachefs.client.transport.session import info_dict
from cachefs.proto import common_pb2, worker_pb2

if TYPE_CHECKING:
    from cachefs.client.transport.session import ClientSession

log = logging.getLogger(__name__)

Meta = common_pb2.MetaRequest
CHUNK = 4 << 20  # bytes per WriteChunk message
QUEUE_CHUNKS = 8  # messages handed to gRPC but not yet sent, per write (32 MiB)
# A stream of unknown length gets this long in all; each wait inside it has the client's timeout.
STREAM_DEADLINE = 3600.0
_END = None


class Sink(Protocol):
    def send(self, data: bytes) -> None: ...

    def finish(self) -> dict[str, Any]: ...

    def cancel(self) -> None: ...


class WriteStream:
    """One ``Write`` call: chunks are queued as they come and gRPC sends them on its own thread."""

    def __init__(self, stub: Any, cp: CachePath, timeout: float, min_throughput: int, size_hint: int = 0) -> None:
        self.cp = cp
        self._timeout = timeout
        self._min_throughput = min_throughput
        self._sent = 0
        self._queue: queue.Queue[worker_pb2.WriteChunk | None] = queue.Queue(maxsize=QUEUE_CHUNKS)
        deadline = STREAM_DEADLINE if size_hint <= 0 else timeout + 2 * size_hint / min_throughput
        first = worker_pb2.WriteChunk(path=str(cp), size_hint=size_hint)
        self._future = stub.Write.future(self._messages(first), timeout=deadline)

    def _messages(self, first: worker_pb2.WriteChunk) -> Any:
        yield first
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._future.done():  # failed, cancelled or past its deadline: stop feeding it
                    return
                continue
            if item is _END:
                return
            yield item

    def _put(self, item: worker_pb2.WriteChunk | None) -> None:
        waited = 0.0
        while True:
            if self._future.done():  # the worker gave up early (read-only mount, store error...)
                self._raise()
            try:
                self._queue.put(item, timeout=0.25)
                return
            except queue.Full:
                waited += 0.25
                if waited >= self._timeout:
                    self.cancel()
                    raise DeadlineExceededError(f"write {self.cp}: the worker took no data for {waited:.0f} s")

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), CHUNK):
            piece = view[start:start + CHUNK]
            self._put(worker_pb2.WriteChunk(data=bytes(piece)))
            self._sent += len(piece)

    def finish(self) -> dict[str, Any]:
        import grpc  # a write is a gRPC stream (loaded by its call already): only its exceptions here

        self._put(worker_pb2.WriteChunk(commit=True))  # only this publishes the object
        self._put(_END)
        try:
            return info_dict(self._future.result(timeout=self._timeout + self._sent / self._min_throughput))
        except grpc.FutureTimeoutError:
            self.cancel()
            raise DeadlineExceededError(f"write {self.cp}: the worker did not confirm it in time") from None
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"write {self.cp}") from None

    def _raise(self) -> None:
        import grpc

        try:
            self._future.result(timeout=0)
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"write {self.cp}") from None
        except grpc.FutureCancelledError:
            raise WorkerUnavailableError(f"write {self.cp}: cancelled") from None
        raise WorkerUnavailableError(f"write {self.cp}: the worker ended the write early")

    def cancel(self) -> None:
        self._future.cancel()


class SocketSink:
    """A write over the owning worker's data port (client/transport/dataport.py DataPortWrite)."""

    def __init__(self, write: Any) -> None:
        self._write = write

    def send(self, data: bytes) -> None:
        self._write.send(data)

    def finish(self) -> dict[str, Any]:
        return info_dict(self._write.finish())

    def cancel(self) -> None:
        self._write.cancel()


class DirectSink:
    """``write_via="client"``: into the store with the client's own credentials."""

    def __init__(self, writes: "Writes", cp: CachePath) -> None:
        self.writes, self.cp = writes, cp
        self._store = writes.session.fallback_store()
        self._writer = self._store.open_write(cp)

    def send(self, data: bytes) -> None:
        self._writer.write(data)

    def finish(self) -> dict[str, Any]:
        self._writer.commit()
        meta = self._store.written(self.cp)
        self.writes.free_on_owner(self.cp)
        return {"name": str(meta.path), "size": meta.size, "type": "file", "version": meta.version,
                "mtime": meta.mtime}

    def cancel(self) -> None:
        self._writer.discard()


class CacheWriteFile(AbstractBufferedFile):
    """A file open for writing; the bytes stream out every ``block_size``, published on close."""

    def __init__(self, fs: Any, writes: "Writes", cp: CachePath, mode: str, block_size: int, **kwargs: Any) -> None:
        self.cp = cp
        self.writes = writes
        self.sink: Sink | None = None
        self.written_info: dict[str, Any] | None = None
        super().__init__(fs, str(cp), mode, block_size, **kwargs)

    def _initiate_upload(self) -> None:
        self.sink = self.writes.sink(self.cp)

    def _upload_chunk(self, final: bool = False) -> bool:
        assert self.sink is not None
        try:
            data = self.buffer.getvalue()
            if data:
                self.sink.send(data)
            if final:
                self.written_info = self.sink.finish()
        except BaseException:
            self.discard()  # a failed write is over: closing it later must not try again
            raise
        return True

    def discard(self) -> None:
        """Abandon the write: the store keeps what it had."""
        if self.sink is not None:
            self.sink.cancel()
        self.buffer = None
        self.closed = True

    def __exit__(self, exc_type: Any, *args: Any) -> None:
        if exc_type is not None and not self.closed:
            self.discard()  # never publish half an object because the producer failed
            return
        self.close()


class Writes:
    """The write operations of one client session (kept here so filesystem.py stays about reads)."""

    def __init__(self, session: "ClientSession", via: str) -> None:
        if via not in ("worker", "client"):
            raise ValueError(f"write_via must be 'worker' or 'client', got {via!r}")
        self.session = session
        self.via = via

    def sink(self, cp: CachePath, size_hint: int = 0) -> Sink:
        """A write stream for ``cp``: to its owning worker (its data port, else gRPC), or
        (``write_via='client'``) the store."""
        if self.via == "client":
            return DirectSink(self, cp)
        by_socket = self.session.write_by_socket(cp, size_hint)
        if by_socket is not None:
            return SocketSink(by_socket)
        config = self.session.config
        stub = self.session.owner_stub(str(cp), f"write {cp}")
        return WriteStream(stub, cp, config.timeout, config.min_throughput, size_hint)

    def write_bytes(self, cp: CachePath, data: bytes) -> dict[str, Any]:
        sink = self.sink(cp, len(data))
        try:
            sink.send(data)
        except BaseException:
            sink.cancel()
            raise
        return sink.finish()

    def put_file(self, lpath: str, cp: CachePath, callback: Any = None) -> dict[str, Any]:
        size = os.path.getsize(lpath)
        if callback is not None:
            callback.set_size(size)
        sink = self.sink(cp, size)
        try:
            with open(lpath, "rb") as f:
                while chunk := f.read(CHUNK * 2):
                    sink.send(chunk)
                    if callback is not None:
                        callback.relative_update(len(chunk))
        except BaseException:
            sink.cancel()
            raise
        return sink.finish()

    def _call(self, cp: CachePath, what: str, op: int, rpc: str, request: Any, **fields: Any) -> Any:
        """A mutation: over the workers' sockets as MetaRequest ``op`` with ``fields``, else the
        gRPC call ``rpc`` with ``request``."""
        meta = common_pb2.MetaRequest(op=op, **fields)
        return self.session.mutate(cp, meta, what, lambda stub, left: getattr(stub, rpc)(request, timeout=left))

    def remove(self, cp: CachePath, recursive: bool) -> None:
        if self.via == "client":
            self.session.fallback_store().remove(cp, recursive)
            self.free_on_owner(cp)
            return
        self._call(cp, f"remove {cp}", Meta.REMOVE, "Remove", worker_pb2.RemoveRequest(path=str(cp), recursive=recursive),
                   path=str(cp), recursive=recursive)
        if recursive:  # what was under it is placed on every worker, not only the one that removed it
            self.session.free_everywhere(f"{cp}/", f"remove {cp}")

    def make_dir(self, cp: CachePath, create_parents: bool, exist_ok: bool) -> None:
        if self.via == "client":
            self.session.fallback_store().make_dir(cp, create_parents, exist_ok)
            return
        request = worker_pb2.MakeDirRequest(path=str(cp), create_parents=create_parents, exist_ok=exist_ok)
        self._call(cp, f"mkdir {cp}", Meta.MKDIR, "MakeDir", request, path=str(cp), create_parents=create_parents,
                   exist_ok=exist_ok)

    def copy(self, source: CachePath, destination: CachePath) -> None:
        if self.via == "client":
            self.session.fallback_store().copy(source, destination)
            self.free_on_owner(destination)
            return
        request = worker_pb2.CopyRequest(source=str(source), destination=str(destination))
        self._call(destination, f"copy {source} -> {destination}", Meta.COPY, "Copy", request, path=str(source),
                   destination=str(destination))

    def free_on_owner(self, cp: CachePath) -> None:
        """After a client-side write: the owning worker forgets the path (best effort; versions
        guard the rest once its metadata expires)."""
        try:
            self._call(cp, f"invalidate {cp}", Meta.FREE, "Free", worker_pb2.FreeRequest(prefix=str(cp)), path=str(cp))
        except OSError as exc:
            log.warning("could not invalidate %s on its worker: %s", cp, exc)


class WriteMethods:
    """CacheFileSystem's write methods (a mixin: ``self`` is the CacheFileSystem)."""

    _writes: Writes
    config: Any

    # The sync methods below may run on asyncio.to_thread's small pool (the async API): they must
    # not call fsspec's mirrored sync methods (exists, isdir, expand_path...), which would wait
    # on the event loop for a pool thread that may never come free.
    def _exists_now(self, path: str) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def _isdir_now(self, path: str) -> bool:
        try:
            return self.info(path)["type"] == "directory"
        except FileNotFoundError:
            return False

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        cp = self._write_path(path)
        if mode == "create" and self._exists_now(path):
            raise FileExistsError(f"{path} exists (mode 'create')")
        self._writes.write_bytes(cp, bytes(value))

    def put_file(self, lpath: str, rpath: str, callback: Any = DEFAULT_CALLBACK, mode: str = "overwrite",
                 **kwargs: Any) -> None:
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        if mode == "create" and self._exists_now(rpath):
            raise FileExistsError(f"{rpath} exists (mode 'create')")
        self._writes.put_file(lpath, self._write_path(rpath), callback)

    def get_file(self, rpath: str, lpath: Any, callback: Any = DEFAULT_CALLBACK, outfile: Any = None,
                 **kwargs: Any) -> None:
        if not isfilelike(lpath) and self._isdir_now(rpath):
            os.makedirs(lpath, exist_ok=True)
            return
        with self.open(rpath, "rb") as src:
            callback.set_size(src.size)
            out = lpath if isfilelike(lpath) else open(lpath, "wb")  # noqa: SIM115 - closed below
            try:
                while chunk := src.read(self.config.block_size):
                    out.write(chunk)
                    callback.relative_update(len(chunk))
            finally:
                if out is not lpath:
                    out.close()

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._writes.copy(self._write_path(path1), self._write_path(path2))

    def rm_file(self, path: str, **kwargs: Any) -> None:
        self._writes.remove(self._write_path(path), recursive=False)

    def rmdir(self, path: str) -> None:
        self._writes.remove(self._write_path(path), recursive=False)

    def _remove_all(self, paths: list[str], recursive: bool) -> None:
        """One Remove per path (parents first); with ``recursive`` the worker removes a whole tree."""
        removed: list[CachePath] = []
        for cp in sorted({self._write_path(p) for p in paths}, key=str):
            if any(cp.mount == r.mount and cp.key.startswith(r.key + "/") for r in removed):
                continue  # already gone with its directory
            self._writes.remove(cp, recursive)
            removed.append(cp)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._writes.make_dir(self._write_path(path), create_parents, exist_ok=False)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._writes.make_dir(self._write_path(path), True, exist_ok)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        if truncate or not self._exists_now(path):
            self.pipe_file(path, b"")
        else:
            raise NotImplementedError("cachefs cannot update an object's modification time")

    async def _pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        await asyncio.to_thread(self.pipe_file, path, value, **kwargs)

    async def _put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        await asyncio.to_thread(self.put_file, lpath, rpath, **kwargs)

    async def _get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        await asyncio.to_thread(self.get_file, rpath, lpath, **kwargs)

    async def _cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        await asyncio.to_thread(self.cp_file, path1, path2, **kwargs)

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        await asyncio.to_thread(self.rm_file, path, **kwargs)

    async def _rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None,
                  **kwargs: Any) -> None:
        paths = path if isinstance(path, list) else [path]
        if maxdepth is not None:
            # Only what lies within maxdepth: bottom-up, one object or empty directory at a time.
            for p in sorted(await self._expand_path(path, recursive=recursive, maxdepth=maxdepth), reverse=True):
                await asyncio.to_thread(self._remove_all, [p], False)
            return
        if any(c in p for p in paths for c in "*?["):  # a glob
            paths = await self._expand_path(path, recursive=False)
        await asyncio.to_thread(self._remove_all, paths, recursive)

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        await asyncio.to_thread(self.mkdir, path, create_parents, **kwargs)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        await asyncio.to_thread(self.makedirs, path, exist_ok)



def check_write_mode(mode: str) -> None:
    if mode not in ("wb", "xb"):
        raise NotImplementedError(f"cachefs writes whole objects ('wb', 'xb'): mode {mode!r} is not supported")
