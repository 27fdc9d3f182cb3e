"""Write-behind index rows: a page is servable once its file is renamed into place; its row waits.

Why: one diskcache (SQLite) transaction per page costs ~35-45 us of CPU on the putting thread
here; a batch of rows in one transaction costs ~16 us a row (a delete ~7 us instead of ~35).
A page's file without its row is what a crash between the rename and the insert left before
this, and recovery removes such orphans; so losing the last batch on a crash only loses pages.

Ordering is what keeps a removed page's row from coming back: the queue holds each digest's
latest operation (its row, or its deletion), a removal replaces a queued row by a deletion, and
batches reach SQLite one at a time in the order they were taken. A row taken by a flush just
before its page was removed is deleted by a later batch. A row is written only for a page still
READY when its batch is taken, with the page's last access as of then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from cachefs.server.pagestore.dirs import INDEX_ERRORS, DirHandle

__all__ = ["RowQueue"]


Record = Callable[[Any], "tuple | None"]  # entry -> its row, or None if it must not be written
Failed = Callable[[DirHandle, list[Any], BaseException], None]


class RowQueue:
    """Pending index operations per digest (guarded by the store's lock) and their flushing.

    ``put``/``delete`` are called with the store's lock held; ``flush`` and ``wait`` without.
    """

    def __init__(
        self, lock: threading.Lock, *, batch_rows: int = 512, max_rows: int = 8192, delay: float = 0.1,
    ) -> None:
        if not 0 < batch_rows <= max_rows or delay <= 0:
            raise ValueError("need 0 < batch_rows <= max_rows and delay > 0")
        self.batch_rows = batch_rows
        self.max_rows = max_rows
        self.delay = delay
        self._ops: dict[str, tuple[DirHandle, Any]] = {}  # digest -> (dir, entry, or None: delete)
        self._cv = threading.Condition(lock)
        self._mutex = threading.Lock()  # one batch at a time, so they reach SQLite in queue order
        self._taken = 0  # operations of the batch being written (guarded by the lock)
        self.flushes = 0
        self.rows_written = 0

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def pending(self) -> int:  # caller holds the lock
        """Operations not yet committed: queued, or in the batch being written."""
        return len(self._ops) + self._taken

    def put(self, digest: str, d: DirHandle, entry: object) -> bool:  # caller holds the lock
        """Queue the page's row; True when the queue is full and the caller must flush it."""
        ops = self._ops
        ops.pop(digest, None)  # a later operation goes last, after the batches before it
        ops[digest] = (d, entry)
        n = len(ops)
        if n == 1 or n == self.batch_rows:
            self._cv.notify()
        return n >= self.max_rows

    def queued(self, digest: str, entry: object) -> bool:  # caller holds the lock
        """True while the page's row is queued, not yet taken by a flush: it will be written
        with the page's state as of then (its last access included)."""
        op = self._ops.get(digest)
        return op is not None and op[1] is entry

    def delete(self, digest: str, d: DirHandle) -> None:  # caller holds the lock
        """Queue the removal of the page's row (replacing its row if that is still queued)."""
        ops = self._ops
        ops.pop(digest, None)
        ops[digest] = (d, None)
        if len(ops) == 1:
            self._cv.notify()

    def wake(self) -> None:  # caller holds the lock
        self._cv.notify_all()

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Until rows are queued (then up to ``delay`` more for a batch to gather) or ``timeout``
        or ``stop``; True if there is something to flush."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._ops or stop.is_set(), timeout=max(timeout, 0.0)):
                return False
            if stop.is_set():
                return bool(self._ops)
            self._cv.wait_for(lambda: len(self._ops) >= self.batch_rows or stop.is_set(),
                              timeout=self.delay)
            return True

    def flush(self, dirs: Sequence[DirHandle], record: Record, failed: Failed) -> int:
        """Write everything queued, one transaction per dir; returns the rows written.

        ``record(entry)`` runs under the store's lock. On an index error the dir's batch is lost:
        ``failed(dir, entries whose rows were in it, error)`` runs after the flush (deletions
        that failed leave rows without files, which recovery drops).
        """
        failures: list[tuple[DirHandle, list[Any], BaseException]] = []
        written = 0
        with self._mutex:
            with self._cv:
                ops, self._ops = self._ops, {}
                self._taken = len(ops)
                by_dir: dict[int, list[tuple[str, Any, tuple | None]]] = {}
                for digest, (d, entry) in ops.items():
                    if entry is None:
                        by_dir.setdefault(id(d), []).append((digest, None, None))
                    elif (row := record(entry)) is not None:
                        by_dir.setdefault(id(d), []).append((digest, entry, row))
            try:
                for d in dirs:
                    batch = by_dir.get(id(d))
                    if not batch:
                        continue
                    try:
                        self._write(d, batch)
                    except INDEX_ERRORS as exc:
                        failures.append((d, [e for _, e, row in batch if row is not None], exc))
                        continue
                    written += len(batch)
            finally:
                with self._cv:
                    self._taken = 0
                    self.flushes += 1
                    self.rows_written += written
        for d, entries, exc in failures:
            failed(d, entries, exc)
        return written

    @staticmethod
    def _write(d: DirHandle, batch: list[tuple[str, Any, tuple | None]]) -> None:
        index = d.index
        if index is None:  # closed under a put that close() gave up waiting for
            raise OSError(f"page index of {d.root} is closed")
        with index.transact():
            for digest, _entry, row in batch:
                if row is None:
                    index.delete(digest)
                else:
                    index.set(digest, row)
