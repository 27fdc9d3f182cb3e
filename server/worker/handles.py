"""Held page handles: the worker's side of the shared invalidation table (HDFS's ShortCircuitShm).

A short-circuit client may keep a page file's descriptor and read it again without asking the
worker, as HDFS's ShortCircuitCache does. Page files never change in place (the object version
is part of their name), so a held descriptor can only go wrong one way: the page left the cache
(evicted, freed, dropped as corrupt) and the client keeps reading a file the worker no longer
counts, holding disk space nobody sees. So every handed-out page gets a slot in a table of
generations in shared memory (a memfd, mapped read-only by each client); when the page file is
about to be unlinked the worker bumps the slot's generation, and a client checks its slot (one
memory load) before each read through a held descriptor. A heartbeat word lets clients notice a
dead or restarted worker without a message.

The table is bounded (``slots``): when every slot is taken the least recently handed-out one is
reassigned, which invalidates its page's holders (they simply ask again). The space of unlinked
pages that clients may still hold open is charged to the page store's quota until the clients
must have closed them (they look at their slots every second and close invalidated handles;
HELD_CLOSE_SECONDS) or their permission to hold them runs out if sooner (:meth:`PageStore.hold`),
so the quota still bounds the disk.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable

from cachefs.localhost import (
    HEARTBEAT_SECONDS,
    TABLE_CLOSED,
    TABLE_HEADER_WORDS,
    TABLE_MAGIC,
    TABLE_SERVING,
    TABLE_WORD_HEARTBEAT,
    TABLE_WORD_MAGIC,
    TABLE_WORD_SLOTS,
    TABLE_WORD_STATE,
)
from cachefs.memseal import sealed_table

log = logging.getLogger(__name__)

__all__ = ["HandleTable"]


class HandleTable:
    """Slots of handed-out pages and their generations, in a memfd shared with local clients."""

    def __init__(self, slots: int = 1 << 16, on_touched: Callable[[list[str]], None] | None = None) -> None:
        if slots < 2:
            raise ValueError(f"a handle table needs at least 2 slots, got {slots}")
        self.slots = slots
        self.instance = uuid.uuid4().hex
        self._on_touched = on_touched
        size = (TABLE_HEADER_WORDS + slots) * 8
        # Sealed: clients get read-only descriptors and cannot reopen them writable (memseal.py).
        self._fd, self._map, self.sealed = sealed_table("cachefs-handles", size)
        self._words = memoryview(self._map).cast("Q")
        self._words[TABLE_WORD_MAGIC] = TABLE_MAGIC
        self._words[TABLE_WORD_SLOTS] = slots
        self._words[TABLE_WORD_STATE] = TABLE_SERVING
        self._beat()
        self._lock = threading.Lock()
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recently handed out first
        self._digest_at: list[str | None] = [None] * slots
        self._free = list(range(slots - 1, 0, -1))  # slot 0 is "do not hold"
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat_loop, name="cachefs-handle-heartbeat", daemon=True)
        self._beater.start()

    # -- the shared words -----------------------------------------------------------------------
    def _beat(self) -> None:
        self._words[TABLE_WORD_HEARTBEAT] = time.monotonic_ns()

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            self._beat()

    def _bump(self, slot: int) -> None:  # caller holds the lock
        self._words[TABLE_HEADER_WORDS + slot] += 1

    def reader_fd(self) -> int:
        """A new read-only descriptor of the table, to send to a client (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    # -- slots ------------------------------------------------------------------------------------
    def assign(self, digest: str) -> tuple[int, int]:
        """(slot, generation) for a page about to be handed out; a page keeps its slot while cached.
        (0, 0), "read it now, do not keep it", once the table is closed (a request still being
        answered while the worker stops)."""
        with self._lock:
            if self._stop.is_set():
                return 0, 0
            slot = self._slot_of.get(digest)
            if slot is not None:
                self._slot_of.move_to_end(digest)
                return slot, self._words[TABLE_HEADER_WORDS + slot]
            if self._free:
                slot = self._free.pop()
            else:  # full: the least recently handed-out page's holders must ask again
                old, slot = self._slot_of.popitem(last=False)
                self._digest_at[slot] = None
                self._bump(slot)
            self._bump(slot)
            self._slot_of[digest] = slot
            self._digest_at[slot] = digest
            return slot, self._words[TABLE_HEADER_WORDS + slot]

    def invalidate(self, digests: Iterable[str]) -> int:
        """The pages are leaving the cache: every descriptor held for them is stale from now on."""
        count = 0
        with self._lock:
            if self._stop.is_set():  # closed: every handle from it is dropped already
                return 0
            for digest in digests:
                slot = self._slot_of.pop(digest, None)
                if slot is None:
                    continue
                self._bump(slot)
                self._digest_at[slot] = None
                self._free.append(slot)
                count += 1
        return count

    def touched(self, slots: Iterable[int]) -> int:
        """Reads a client made through held descriptors: hand their pages to the page store's recency."""
        with self._lock:
            digests = [d for s in slots if 0 < s < self.slots and (d := self._digest_at[s]) is not None]
        if digests and self._on_touched is not None:
            self._on_touched(digests)
        return len(digests)

    def in_use(self) -> int:
        with self._lock:
            return len(self._slot_of)

    def close(self) -> None:
        """Tell every client that this table is over (their handles from it are dropped)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._beater.join(timeout=5)
        with self._lock:
            self._words[TABLE_WORD_STATE] = TABLE_CLOSED
            self._words[TABLE_WORD_HEARTBEAT] = 0
            for slot in range(1, self.slots):
                self._words[TABLE_HEADER_WORDS + slot] += 1
            self._words.release()
            self._map.close()
            os.close(self._fd)
