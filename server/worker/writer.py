"""The worker's side of write-through: a streamed object goes into the store as it arrives.

Receiving (gRPC's thread) and uploading (a thread per write) overlap through a bounded
queue, so the client's bytes keep flowing while the store takes a part; the queue bounds
the memory one write holds. After a write the object's cached metadata, its mount's
listings and its pages of older versions are dropped (pages are keyed by version, so they
could not be served for the new one, but they would hold space until evicted).
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections.abc import Iterator

import grpc

from cachefs.errors import InvalidPathError
from cachefs.paths import CachePath, parse_path
from cachefs.proto import worker_pb2
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore
from cachefs.server.pagestore import PageStore

log = logging.getLogger(__name__)

QUEUE_BYTES = 64 << 20  # received but not yet uploaded, per write
_END = None


class _Uploader:
    """Drains a bounded queue of chunks into a store writer on its own thread."""

    def __init__(self, objects: ObjectStore, path: CachePath, queue_bytes: int, stall_timeout: float) -> None:
        self.writer = objects.open_write(path)  # PermissionError here, before any data moves
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._capacity = max(1, queue_bytes >> 20)  # in 1 MiB units
        self._room = threading.Semaphore(self._capacity)
        self._stall = stall_timeout
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"cachefs-write-{path}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not _END:
            try:
                if self.error is None:
                    self.writer.write(chunk)
            except BaseException as exc:  # noqa: BLE001 - handed to the receiving thread
                self.error = exc
            finally:
                self._room.release(self._units(chunk))

    def _units(self, data: bytes) -> int:
        return min(self._capacity, max(1, len(data) >> 20))

    def put(self, data: bytes) -> None:
        for _ in range(self._units(data)):
            if self.error is not None:
                raise self.error
            if not self._room.acquire(timeout=self._stall):
                raise TimeoutError(errno.ETIMEDOUT, f"the store took no data for {self._stall:.0f} s")
        self._queue.put(data)

    def finish(self, ok: bool) -> None:
        """Wait for the queue to drain; commit if ``ok`` and nothing failed, else discard."""
        self._queue.put(_END)
        self._thread.join(self._stall)
        if self._thread.is_alive():
            self.error = self.error or TimeoutError(errno.ETIMEDOUT, "the store did not finish the write in time")
        if ok and self.error is None:
            self.writer.commit()
            return
        try:
            self.writer.discard()
        except Exception:  # noqa: BLE001 - the first error is the one to report
            log.warning("discarding a failed write also failed", exc_info=True)
        if self.error is not None:
            raise self.error


class WriteHandler:
    def __init__(self, objects: ObjectStore, pages: PageStore, stall_timeout: float,
                 queue_bytes: int = QUEUE_BYTES) -> None:
        self.objects = objects
        self.pages = pages
        self.stall_timeout = stall_timeout
        self.queue_bytes = queue_bytes

    def open(self, raw_path: str) -> "WriteSession":
        """A write of the object at ``raw_path`` ("<mount>/<key>"), fed part by part: the data
        port's streamed writes (dataport.py) and the gRPC ``Write`` stream alike."""
        if not raw_path:
            raise InvalidPathError("a write must start by naming the path")
        return WriteSession(self, parse_path(raw_path))

    def write(self, requests: Iterator[worker_pb2.WriteChunk]) -> ObjectMeta:
        """Publish the streamed object only if the stream ends with a ``commit`` message."""
        try:
            first = next(requests, None)
        except grpc.RpcError as exc:
            raise ConnectionAbortedError(errno.ECONNABORTED, "write cancelled by the client") from exc
        if first is None:
            raise InvalidPathError("a write stream must start with a message naming the path")
        session = self.open(first.path)
        committed = first.commit
        try:
            if first.data:
                session.put(first.data)
            for msg in requests:
                if committed:
                    raise InvalidPathError(f"write of {session.path}: a message after the commit")
                if msg.data:
                    session.put(msg.data)
                committed = msg.commit
        except grpc.RpcError as exc:  # the client cancelled or went away: nothing is published
            session.discard()
            raise ConnectionAbortedError(errno.ECONNABORTED,
                                         f"write of {session.path} cancelled by the client") from exc
        except BaseException:
            session.discard()
            raise
        if not committed:
            session.discard()
            raise ConnectionAbortedError(errno.ECONNABORTED,
                                         f"write of {session.path} ended without a commit: discarded")
        return session.commit()

    def after_write(self, path: CachePath) -> ObjectMeta:
        meta = self.objects.written(path)
        self.pages.delete_object(path.mount, path.key)
        return meta

    def remove(self, path: CachePath, recursive: bool) -> int:
        self.objects.remove(path, recursive)
        freed = self.pages.delete_object(path.mount, path.key)
        if recursive:
            freed += self.pages.delete_prefix(path.mount, path.key + "/")
        return freed


class WriteSession:
    """One object being written: parts go to the store as they come; ``commit`` publishes it,
    ``discard`` (or never committing) leaves the store as it was."""

    def __init__(self, handler: WriteHandler, path: CachePath) -> None:
        self.handler, self.path = handler, path
        self.received = 0
        self._uploader: _Uploader | None = _Uploader(handler.objects, path, handler.queue_bytes,
                                                     handler.stall_timeout)

    def put(self, data: bytes) -> None:
        if self._uploader is None:
            raise InvalidPathError(f"write of {self.path}: a part after the write ended")
        try:
            self._uploader.put(data)
        except BaseException:
            self.discard()
            raise
        self.received += len(data)

    def commit(self) -> ObjectMeta:
        uploader, self._uploader = self._uploader, None
        if uploader is None:
            raise InvalidPathError(f"write of {self.path}: committed after the write ended")
        uploader.finish(True)  # raises the store's error (the write is then discarded)
        return self.handler.after_write(self.path)

    def discard(self) -> None:
        uploader, self._uploader = self._uploader, None
        if uploader is None:
            return
        try:
            uploader.finish(False)
        except Exception as exc:  # noqa: BLE001 - already failed: nothing to publish either way
            log.debug("write of %s discarded after: %s", self.path, exc)

    @property
    def active(self) -> bool:
        return self._uploader is not None
