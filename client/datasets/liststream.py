"""The first epoch before the listing ends (#46): ``CacheDataset.from_prefix`` with ``shuffle=False``.

A listing of a million objects takes tens of seconds; an epoch in listing order needs only the
entries before the position it reads. So ``from_prefix`` lists on a thread into a ``ListingLog``
and returns after the first page; the first epoch's ``StreamingPlan`` hands out a position as
soon as the sample it stands for is listed. Everything that needs the whole listing waits for it.

* **The log** is one sparse memfd made before any DataLoader worker starts: a header (entries
  committed, state, an error message), then each entry's name end and size (int64, room for
  ``CAP`` entries) and the names' bytes (``BLOB_CAP``). Only its creator's listing thread writes;
  it writes a page's entries, then the committed count (one aligned 8-byte store), so a reader
  that sees the count sees the entries below it: x86-64 makes one thread's stores visible in the
  order they were made (a weaker machine would need a barrier here).
  Forked workers share the mapping; spawned ones map ``/proc/<pid>/fd/<fd>`` (sampleindex.py).
  Untouched room costs nothing (a memfd's pages exist once written).
* **The plan.** With ``shuffle=False`` the epoch's order is the listing's, dealt over ranks
  (rank r reads samples ``r, r + world_size, ...``), padded from the start (or cut with
  ``drop_last``) in the last round only. So position p is sample ``r + p * world_size`` as soon
  as that many are listed, the same sample the whole listing's ``EpochPlan`` gives it; the last
  round, and ``len``, wait for the end. Exactly once, equal per-rank counts and resume are
  therefore EpochPlan's.
* **Order.** The listing must come in name order, one entry a name (the workers' pages do): the
  positions handed out stand for listing ranks, so an out-of-order page fails the listing (and
  every read waiting on it) with a message, rather than reorder what was handed out.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from cachefs.client import forksafe
from cachefs.memseal import sealed_table
from cachefs.client.datasets.sampleindex import SampleIndex, map_shared, release
from cachefs.client.datasets.sampling import EpochPlan

log = logging.getLogger(__name__)

__all__ = ["ListingLog", "GrowingIndex", "StreamingPlan", "Listing", "ListingFailed"]

HEADER = 4096
CAP = 1 << 27  # entries: 2 GiB of room for ends and sizes each, touched only as used
BLOB_CAP = 1 << 35  # names' bytes
TOTAL = HEADER + 16 * CAP + BLOB_CAP
LISTING, DONE, FAILED = 0, 1, 2
HEAD = "cachefs://"
POLL_MIN, POLL_MAX = 0.001, 0.05


class ListingFailed(OSError):
    """The listing a streaming first epoch reads from failed; the message says how."""


class ListingLog:
    """Entries of a listing as they come, in shared memory (see the module doc)."""

    def __init__(self, fd: int, mapped: mmap.mmap, *, writable: bool = False) -> None:
        self._fd, self._map, self._writable = fd, mapped, writable
        self._hdr = np.frombuffer(mapped, dtype="<i8", count=8, offset=0)
        self._ends = np.frombuffer(mapped, dtype="<i8", count=CAP, offset=HEADER)
        self._sizes = np.frombuffer(mapped, dtype="<i8", count=CAP, offset=HEADER + 8 * CAP)
        self._blob = memoryview(mapped)[HEADER + 16 * CAP:]
        weakref.finalize(self, release, fd, None)  # the map goes with its last view

    @classmethod
    def create(cls) -> "ListingLog":
        # Sealed as the workers' tables are (cachefs/memseal.py): only this mapping writes it;
        # a DataLoader worker reopening it through /proc cannot.
        fd, mapped, _ = sealed_table("cachefs-listing", TOTAL)
        return cls(fd, mapped, writable=True)

    # -- the writer (the listing thread) -------------------------------------------------------------
    def append(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        if not names:
            return
        tails = [n.encode() for n in names]
        n0, b0 = int(self._hdr[0]), int(self._hdr[2])
        blob = b"".join(tails)
        if n0 + len(tails) > CAP or b0 + len(blob) > BLOB_CAP:
            raise ListingFailed(f"a streamed listing holds at most {CAP} entries and {BLOB_CAP} bytes of "
                                "names; pass stream=False")
        self._blob[b0:b0 + len(blob)] = blob
        lens = np.fromiter(map(len, tails), dtype=np.int64, count=len(tails))
        self._ends[n0:n0 + len(tails)] = b0 + np.cumsum(lens)
        self._sizes[n0:n0 + len(tails)] = np.asarray(sizes, dtype=np.int64)
        self._hdr[2] = b0 + len(blob)
        self._hdr[0] = n0 + len(tails)  # last: entries below the count are whole

    def finish(self) -> None:
        self._hdr[1] = DONE

    def fail(self, message: str) -> None:
        data = message.encode()[:HEADER - 64]
        self._map[64:64 + len(data)] = data
        self._hdr[3] = len(data)
        self._hdr[1] = FAILED

    # -- readers (any process) -------------------------------------------------------------------
    def count(self) -> int:
        return int(self._hdr[0])

    def state(self) -> int:
        return int(self._hdr[1])

    def message(self) -> str:
        return bytes(self._map[64:64 + int(self._hdr[3])]).decode(errors="replace")

    def name(self, i: int) -> str:
        start = int(self._ends[i - 1]) if i else 0
        return HEAD + str(self._blob[start:int(self._ends[i])], "utf-8")

    def __reduce__(self) -> Any:
        return _map_log, (forksafe.pid(), self._fd, os.fstat(self._fd).st_ino)


def _map_log(pid: int, fd: int, inode: int) -> ListingLog:
    mine, mapped = map_shared(pid, fd, inode, TOTAL, what="listing")
    return ListingLog(mine, mapped)


class GrowingIndex(Sequence[str]):
    """The paths and sizes listed so far (what ``SampleIndex`` is for a whole listing)."""

    head = HEAD

    def __init__(self, log: ListingLog, url: str = "the prefix") -> None:
        self.log, self.url = log, url

    def __len__(self) -> int:
        return self.log.count()

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i, n = i.__index__(), len(self)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} of {n} listed so far")
        return self.log.name(i)

    def __iter__(self) -> Iterator[str]:
        return (self.log.name(i) for i in range(len(self)))

    @property
    def sizes(self) -> np.ndarray:
        return self.log._sizes[:self.log.count()]

    def wait_done(self, timeout: float, url: str = "the prefix") -> None:
        _wait(self.log, lambda: False, timeout, url)


def _wait(log: ListingLog, ready: Callable[[], bool], timeout: float, url: str) -> bool:
    """Wait until ``ready()`` or the listing ends (then ``ready()`` once more); ``timeout``: with
    no new entry listed for that long."""
    delay, last, since = POLL_MIN, log.count(), time.monotonic()
    while True:
        if ready():
            return True
        state = log.state()  # before the count: once DONE, the count is final
        if state == DONE:
            return ready()
        if state == FAILED:
            raise ListingFailed(f"the listing of {url} failed after {log.count()} objects: {log.message()}")
        n = log.count()
        if n != last:
            last, since, delay = n, time.monotonic(), POLL_MIN
        elif time.monotonic() - since > timeout:
            raise TimeoutError(f"the listing of {url} listed nothing new for {timeout:.0f} s ({n} objects so far)")
        time.sleep(delay)
        delay = min(POLL_MAX, delay * 2)


class StreamingPlan:
    """Epoch 0 with ``shuffle=False`` over a listing that may not have ended (see the module doc).
    Reads as ``EpochPlan`` does; ``known()`` and ``has(p)`` do not wait for the end, ``len`` does."""

    epoch, shuffle, offset = 0, False, 0

    def __init__(self, log: ListingLog, rank: int, world_size: int, seed: int, drop_last: bool,
                 timeout: float, url: str) -> None:
        self.log, self.rank, self.world_size, self.seed = log, int(rank), int(world_size), int(seed)
        self.drop_last, self.timeout, self.url = bool(drop_last), float(timeout), url
        self._final: EpochPlan | None = None

    def final(self) -> EpochPlan | None:
        """The whole listing's plan, once the listing ended."""
        if self._final is None:
            state = self.log.state()
            if state == DONE:
                self._final = EpochPlan(self.log.count(), self.rank, self.world_size, self.seed, 0, False,
                                        self.drop_last)
            elif state == FAILED:
                raise ListingFailed(f"the listing of {self.url} failed after {self.log.count()} objects: "
                                    f"{self.log.message()}")
        return self._final

    def known(self) -> int:
        """Positions known now: all of them once the listing ended."""
        final = self.final()
        if final is not None:
            return len(final)
        n, w = self.log.count(), self.world_size
        return n // w if self.drop_last else max(0, -(-(n - self.rank) // w))

    def has(self, position: int) -> bool:
        """Whether ``position`` is in this rank's epoch, waiting until that is known."""
        return position >= 0 and _wait(self.log, lambda: position < self.known(), self.timeout, self.url)

    def __len__(self) -> int:
        _wait(self.log, lambda: False, self.timeout, self.url)
        return len(self.final())  # type: ignore[arg-type]

    def samples(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        q = np.asarray(positions, dtype=np.int64)
        if len(q) and not self.has(int(q.max())):
            raise IndexError(f"position {int(q.max())} is outside this rank's {len(self)} samples")
        out = self.rank + self.world_size * q
        final = self._final
        if final is not None:  # the last round may wrap to the start (padding)
            late = out >= final.n_samples
            if late.any():
                out[late] = final.samples(q[late])
        return out

    def sample(self, position: int) -> int:
        return int(self.samples([position])[0])

    def state(self, samples_seen: int) -> dict[str, Any]:
        final = self.final()
        if final is not None:
            return final.state(samples_seen)
        # n_samples -1: saved before the listing ended (checked against nothing at resume)
        return {"version": 1, "epoch": 0, "seed": self.seed, "samples_seen": int(samples_seen), "offset": 0,
                "world_size": self.world_size, "n_samples": -1, "shuffle": False, "drop_last": self.drop_last}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_final": None}  # made again where it is read


class Listing:
    """A prefix listed on a daemon thread into a ``ListingLog``; ``result()`` is the whole index."""

    def __init__(self, run: Callable[[Callable[[list[str], list[int]], None]], SampleIndex], url: str,
                 on_done: Callable[[SampleIndex | None, BaseException | None], None] | None = None) -> None:
        """``run(page)``: lists, calling ``page(names, sizes)`` with each page's files (names
        without ``cachefs://``), and returns the index (prefixindex.list_prefix); ``on_done(index,
        error)`` then runs on the listing thread."""
        self.log, self.url = ListingLog.create(), url
        self.first = threading.Event()  # a page is in the log, or the listing ended
        self.done = threading.Event()
        self._index: SampleIndex | None = None
        self._error: BaseException | None = None
        self._run, self._on_done = run, on_done
        self._lock = threading.Lock()
        self._then: list[Callable[[SampleIndex | None, BaseException | None], None]] = []
        self.seconds = 0.0
        threading.Thread(target=self._main, name="cachefs-prefix-listing", daemon=True).start()

    def _page(self, names: list[str], sizes: list[int]) -> None:
        self.log.append(names, sizes)
        if names:
            self.first.set()

    def _main(self) -> None:
        t0 = time.monotonic()
        try:
            index = self._run(self._page)
            if len(index) != self.log.count():  # cannot be, short of a bug: the plan would be wrong
                raise ListingFailed(f"{len(index)} objects indexed, {self.log.count()} streamed")
            self._index = index
        except BaseException as exc:  # noqa: BLE001 - every reader sees it (result(), the log)
            self._error = exc
        self.seconds = time.monotonic() - t0
        if self._on_done is not None:  # kept, handed to the other ranks: before anyone sees the end
            try:
                self._on_done(self._index, self._error)
            except Exception as exc:  # noqa: BLE001 - this process has its index all the same
                log.warning("after listing %s: %s", self.url, exc)
        if self._error is None:
            self.log.finish()
        else:
            self.log.fail(f"{type(self._error).__name__}: {self._error}")
        self.first.set()
        with self._lock:
            self.done.set()
            then, self._then = self._then, []
        for fn in then:
            fn(self._index, self._error)

    def then(self, fn: Callable[[SampleIndex | None, BaseException | None], None]) -> None:
        """Call ``fn(index, error)`` when the listing ends (now, here, if it has)."""
        with self._lock:
            if not self.done.is_set():
                self._then.append(fn)
                return
        fn(self._index, self._error)

    def result(self, timeout: float | None = None) -> SampleIndex:
        if not self.done.wait(timeout):
            raise TimeoutError(f"the listing of {self.url} did not end within {timeout} s "
                               f"({self.log.count()} objects so far)")
        if self._error is not None:
            raise self._error
        return self._index  # type: ignore[return-value]
