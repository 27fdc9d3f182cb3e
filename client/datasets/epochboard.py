"""The main process's last word on a dataset's epoch, for DataLoader workers that outlive it.

A persistent DataLoader worker (``persistent_workers=True``) keeps the copy of the dataset it
started with, while ``set_epoch`` and ``load_state_dict`` run in the main process only. A map
dataset's worker learns the epoch from the sampler's positions (sampling.tag_epoch); an iterable
dataset's worker makes its own order at each ``iter``, so it reads the main process's last
decision here first.

The board is a small sealed memfd (cachefs/memseal.py) that only the creating process writes;
other processes map it read-only through ``/proc/<pid>/fd/<fd>`` (a forked worker and a spawned
one alike, as the sample index's buffer: sampleindex.map_shared). A seqlock guards it: the
writer makes the sequence odd while it writes, and a reader retries a copy that straddled a write.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import weakref
from typing import Any

from cachefs.client import forksafe
from cachefs.client.forksafe import ProcessLocal
from cachefs.client.datasets.sampleindex import map_shared, release
from cachefs.memseal import sealed_table

log = logging.getLogger(__name__)

__all__ = ["EpochBoard"]

SIZE = 4096
_HEADER = struct.Struct("<QI")  # sequence (odd while written), length of the JSON after it
READ_TRIES = 1000  # copies that straddled a write, before a reader gives up (keeps its own plan)


class EpochBoard:
    """One dataset's board (see the module doc): ``post`` in the creating process, ``read`` anywhere."""

    def __init__(self, where: tuple[int, int, int] | None = None) -> None:
        """``where``: (pid, fd, inode) of another process's board (a pickle); None makes one here."""
        self._mine: Any = None
        if where is None:
            fd, table, _sealed = sealed_table("cachefs-epoch-board", SIZE)
            self._mine = table
            where = (forksafe.pid(), fd, os.fstat(fd).st_ino)
            weakref.finalize(self, release, fd, table)
        self.where = where
        self._local: ProcessLocal[Any] = ProcessLocal(self._attach, name="epoch board map")

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpochBoard, (self.where,))

    @classmethod
    def make(cls) -> "EpochBoard | None":
        """A new board, or None where none can be made (no memfd): workers then keep their own epoch."""
        try:
            return cls()
        except (OSError, AttributeError) as exc:
            log.warning("persistent DataLoader workers will not follow set_epoch: cannot make the epoch "
                        "board: %s", exc)
            return None

    def _attach(self) -> Any:
        pid, fd, inode = self.where
        if pid == forksafe.pid() and self._mine is not None:
            return self._mine
        try:
            mine, mapped = map_shared(pid, fd, inode, SIZE, what="epoch board")
        except OSError as exc:  # once per process: its DataLoader worker keeps its own epoch
            log.warning("cannot read the main process's epoch (%s): this DataLoader worker keeps its own", exc)
            return None
        weakref.finalize(mapped, release, mine, None)
        return mapped

    def generation(self) -> int:
        """The last decision's generation (0: none yet; -1: unreadable, or being written)."""
        table = self._local.get()
        if table is None:
            return -1
        seq = _HEADER.unpack_from(table, 0)[0]
        return -1 if seq & 1 else seq // 2

    def post(self, decision: dict[str, Any]) -> int:
        """Write ``decision`` (JSON-able) for the workers; returns its generation. Creator only."""
        table = self._mine
        if table is None or self.where[0] != forksafe.pid():
            raise RuntimeError("an epoch board is written by the process that made it only")
        body = json.dumps(decision, separators=(",", ":")).encode()
        if _HEADER.size + len(body) > SIZE:
            raise ValueError(f"an epoch board holds {SIZE - _HEADER.size} bytes, not {len(body)}")
        seq = _HEADER.unpack_from(table, 0)[0]
        _HEADER.pack_into(table, 0, seq + 1, 0)  # odd: being written
        table[_HEADER.size:_HEADER.size + len(body)] = body
        _HEADER.pack_into(table, 0, seq + 2, len(body))
        return (seq + 2) // 2

    def read(self) -> tuple[int, dict[str, Any]] | None:
        """(generation, the last decision), (0, {}) before any, or None: unreadable (its creator
        is gone, or it was being rewritten through every try)."""
        table = self._local.get()
        if table is None:
            return None
        for _ in range(READ_TRIES):
            seq, length = _HEADER.unpack_from(table, 0)
            if seq & 1 == 0:
                body = bytes(table[_HEADER.size:_HEADER.size + length])
                if _HEADER.unpack_from(table, 0)[0] == seq:
                    return seq // 2, (json.loads(body) if length else {})
            time.sleep(0)  # the writer is mid-write: let it finish
        return None
