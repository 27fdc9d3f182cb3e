"""A data set's sample index in one read-only buffer: paths and sizes, no object per sample.

``CacheDataset`` used to hold a ``list`` of ``str`` (one object per sample, ~1.1 KB each after a
listing); every DataLoader worker inherited it and, touching the objects' reference counts,
copied its pages. Here the paths are one UTF-8 blob of what follows their common head
(``cachefs://data/train/``), with an int64 array of where each starts and an int64 array of
sizes: ~16 bytes plus the path's tail per sample, in one buffer whose pages nothing writes.

* Forked DataLoader workers share its pages (numpy buffers have no per-element reference count).
* Spawned ones (a pickle) map the same memory: the buffer is a sealed memfd (cachefs/memseal.py,
  the one place shared memory is made) or the kept index file (prefixindex.py), and the
  pickle carries only ``/proc/<pid>/fd/<fd>`` and the inode, opened read-only by the child. A
  memfd, unlike a ``/dev/shm`` file, is freed with its last holder, so a killed job leaks nothing.
  A pickled large index therefore loads only on this host while this process lives (DataLoader
  workers); an index under ``SMALL_BYTES`` travels as bytes and loads anywhere.

The buffer is also the kept file's format (``FORMAT``):
``magic | u64 header length | JSON header (n, head, blob bytes, meta), padded to 8 |
starts int64[n+1] | sizes int64[n] | blob``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import struct
import weakref
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from cachefs.client import forksafe
from cachefs.memseal import sealed_table

log = logging.getLogger(__name__)

__all__ = ["IndexBuilder", "SampleIndex", "SMALL_BYTES", "FORMAT"]

MAGIC = b"CFSIDX01"
FORMAT = 1
#: An index this small pickles as bytes (portable); a larger one is shared memory on this host.
SMALL_BYTES = 1 << 20
#: Paths decoded per step of an iteration.
ITER_CHUNK = 4096
#: An index this long gives the memory its building used back to the OS (``trim_heap``).
TRIM_AFTER = 100_000


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class SharedBuffer:
    """What an index held in one buffer (a sealed memfd, a mapped kept file, or bytes) does
    besides being read, the same for SampleIndex and ShardTable: its bytes, written to a kept
    file, a kept file mapped, and pickling by reference to its memfd (a spawned DataLoader worker
    maps it; a small one travels as bytes). A subclass takes ``(buffer, fd=, path=)`` and sets
    ``_buffer``, ``_fd`` and ``nbytes``."""

    _buffer: Any
    _fd: int
    nbytes: int
    #: What it is called in an error when the holder's memfd cannot be mapped.
    SHARED_WHAT = "sample index"

    def tobytes(self) -> bytes:
        """The whole buffer (what a kept file holds)."""
        return bytes(memoryview(self._buffer)[:self.nbytes])

    def write(self, f: Any) -> None:
        """Write the buffer into the binary file ``f`` (the caller renames it into place)."""
        f.write(memoryview(self._buffer)[:self.nbytes])

    @classmethod
    def open(cls, path: str) -> Any:
        """Map a kept file read-only (its pages load as they are read)."""
        fd, mapped = map_file(path)
        try:
            return cls(mapped, fd=fd, path=path)  # type: ignore[call-arg]
        except BaseException:
            release(fd, mapped)
            raise

    def __reduce__(self) -> Any:
        if self._fd < 0 or self.nbytes <= SMALL_BYTES:
            return type(self), (self.tobytes(),)
        return _from_shared, (type(self), forksafe.pid(), self._fd, os.fstat(self._fd).st_ino, self.nbytes)


def _from_shared(cls: Any, pid: int, fd: int, inode: int, size: int) -> Any:
    """The buffer a process ``pid`` holds in its descriptor ``fd``, mapped read-only here as ``cls``."""
    mine, mapped = map_shared(pid, fd, inode, size, cls.SHARED_WHAT)
    try:
        return cls(mapped, fd=mine)
    except BaseException:
        release(mine, mapped)
        raise


class SampleIndex(SharedBuffer, Sequence[str]):
    """Read-only ``Sequence[str]`` of paths, with ``sizes`` (int64), over one buffer."""

    def __init__(self, buffer: Any, *, fd: int = -1, path: str = "") -> None:
        """``buffer``: the whole index (bytes, bytearray or mmap); ``fd``: a descriptor of the
        memfd or file holding it, kept open for processes that map it (see the module doc)."""
        view = memoryview(buffer)
        if bytes(view[:8]) != MAGIC:
            raise ValueError("not a cachefs sample index")
        (hlen,) = struct.unpack_from("<Q", view, 8)
        header = json.loads(bytes(view[16:16 + hlen]))
        if header.get("format") != FORMAT:
            raise ValueError(f"sample index format {header.get('format')}, this release reads {FORMAT}")
        n, blob_bytes = int(header["n"]), int(header["blob"])
        at = 16 + _pad8(hlen)
        if len(view) < at + 16 * n + 8 + blob_bytes:
            raise ValueError("truncated sample index")
        self._buffer, self._fd, self.path = buffer, fd, path
        self.head: str = header["head"]
        self.meta: dict[str, Any] = header.get("meta") or {}
        self.starts = np.frombuffer(buffer, dtype="<i8", count=n + 1, offset=at)
        self.sizes = np.frombuffer(buffer, dtype="<i8", count=n, offset=at + 8 * (n + 1))
        self._blob = view[at + 16 * n + 8:at + 16 * n + 8 + blob_bytes]
        for a in (self.starts, self.sizes):
            a.flags.writeable = False  # shared pages: nobody writes them
        self.nbytes = len(view)
        if fd >= 0:
            weakref.finalize(self, release, fd, buffer if isinstance(buffer, mmap.mmap) else None)

    # -- the Sequence ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i.__index__()
        n = len(self.sizes)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} of {n}")
        return self.head + str(self._blob[int(self.starts[i]):int(self.starts[i + 1])], "utf-8")

    def paths_of(self, samples: list[int], drop: int = 0) -> list[str]:
        """``self[i]`` of each of ``samples`` (each in range), without its first ``drop``
        characters (at most the head's): a batch's paths with one gather of their bounds."""
        starts = self.starts
        at = np.asarray(samples, dtype=np.int64)
        head, blob = self.head[drop:], self._blob
        return [head + str(blob[s:e], "utf-8") for s, e in zip(starts[at].tolist(), starts[at + 1].tolist())]

    def __iter__(self) -> Iterator[str]:
        head, blob, n = self.head, self._blob, len(self)
        for lo in range(0, n, ITER_CHUNK):  # a chunk's starts as ints at a time, not n of them
            starts = self.starts[lo:min(n, lo + ITER_CHUNK) + 1].tolist()
            for s, e in zip(starts, starts[1:]):
                yield head + str(blob[s:e], "utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SampleIndex) and self.head == other.head:
            return (len(self) == len(other) and bytes(self._blob) == bytes(other._blob)
                    and np.array_equal(self.starts, other.starts))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SampleIndex({len(self)} paths under {self.head!r}, {self.nbytes} bytes)"

    def units(self) -> "Units":
        """``(path, 0, size)`` per sample, made when asked (what a read plan's index is)."""
        return Units(self)



class Units(Sequence[tuple[str, int, int]]):
    """A read plan's units over an index, one tuple when asked (client/datasets/plans.py)."""

    def __init__(self, index: SampleIndex) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.index[i], 0, int(self.index.sizes[i])

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        sizes = self.index.sizes
        return ((p, 0, int(sizes[i])) for i, p in enumerate(self.index))


# -- read-only buffers shared with other processes (also the shard table's: shardtable.py) ---------
def release(fd: int, mapped: mmap.mmap | None) -> None:
    """Close a buffer's map and descriptor (a finalizer: never raises)."""
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:  # a numpy view outlived the index: the map goes with it
            pass
    try:
        os.close(fd)
    except OSError:
        pass



def map_file(path: str) -> tuple[int, mmap.mmap]:
    """A kept file's descriptor and read-only map (its pages load as they are read)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fd, mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise


def shared_buffer(name: str, total: int) -> tuple[int, Any]:
    """A writable buffer of ``total`` bytes to build an index in: a sealed memfd when large (its
    descriptor travels to spawned workers, ``map_shared``), else a bytearray (fd -1)."""
    if total > SMALL_BYTES:
        try:
            fd, buffer, _ = sealed_table(name, total)
            return fd, buffer
        except (OSError, AttributeError) as exc:  # no memfd here: plain memory (fork still shares it)
            log.debug("%s in plain memory: %s", name, exc)
    return -1, bytearray(total)


def map_shared(pid: int, fd: int, inode: int, size: int, what: str = "sample index") -> tuple[int, mmap.mmap]:
    """The buffer a process ``pid`` holds in its descriptor ``fd``, mapped read-only here."""
    where = f"/proc/{pid}/fd/{fd}"
    try:
        mine = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(f"cannot map the {what} of process {pid} ({where}): {exc}; a large index "
                      "pickles as shared memory, loadable on its host while that process lives") from exc
    try:
        st = os.fstat(mine)
        if st.st_ino != inode or st.st_size < size:
            raise OSError(f"{where} is no longer the {what} it was pickled from")
        return mine, mmap.mmap(mine, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except BaseException:
        os.close(mine)
        raise


class IndexBuilder:
    """Paths and sizes appended one at a time (a listing's pages), held compact while it grows:
    a ``bytearray`` of path tails and two ``array('q')``, never an object per path."""

    def __init__(self, head: str | None = None) -> None:
        """``head``: what every path starts with, if known (``None``: the first path; it
        shrinks to the common prefix as paths come)."""
        self._head = head
        self._blob = bytearray()
        self._ends = array("q")
        self._sizes = array("q")
        self._last = b""
        self.sorted = True  # paths came in order (a listing's pages do)
        self.unique = True

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, path: str, size: int) -> None:
        head = self._head
        if head is None:
            head = self._head = path
        elif not path.startswith(head):
            self._shrink_head(os.path.commonprefix([head, path]))
            head = self._head
        tail = path[len(head):].encode()
        if self._sizes and tail <= self._last:
            self.sorted = self.sorted and tail == self._last
            self.unique = self.unique and tail != self._last
        self._last = tail
        self._blob += tail
        self._ends.append(len(self._blob))
        self._sizes.append(int(size))

    def extend(self, items: Iterable[tuple[str, int]]) -> None:
        for path, size in items:
            self.add(path, size)

    def _shrink_head(self, head: str) -> None:
        """Every path kept so far gains the part of the head that is no longer common (rare:
        a manifest whose paths diverge early; a listing's paths share the prefix listed)."""
        dropped = self._head[len(head):].encode()  # type: ignore[index]
        old, ends = bytes(self._blob), self._ends.tolist()
        self._blob, self._ends, start = bytearray(), array("q"), 0
        for end in ends:
            self._blob += dropped + old[start:end]
            self._ends.append(len(self._blob))
            start = end
        self._last = dropped + self._last
        self._head = head

    def finish(self, *, sort: bool = False, meta: dict[str, Any] | None = None) -> SampleIndex:
        """The index; ``sort``: in path order, one entry per path (a listing's pages are already)."""
        ends = np.frombuffer(self._ends, dtype=np.int64) if len(self._ends) else np.zeros(0, np.int64)
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if len(self._sizes) else np.zeros(0, np.int64)
        blob: Any = self._blob
        if sort and not (self.sorted and self.unique):
            ends, sizes, blob = _sorted(ends, sizes, bytes(self._blob))
        index = build(self._head or "", ends, sizes, blob, meta)
        del ends, sizes, blob
        self._blob, self._ends, self._sizes = bytearray(), array("q"), array("q")
        if len(index) >= TRIM_AFTER:
            trim_heap()  # the growing arrays' old copies
        return index


def trim_heap() -> None:
    """Give the heap's free pages back to the OS. glibc keeps freed memory above its (growing)
    mmap threshold in the heap: after a listing's pages, or a read plan's index, of a million
    samples that is tens of MB of RSS holding nothing, which forked DataLoader workers inherit."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _sorted(ends: np.ndarray, sizes: np.ndarray, blob: bytes) -> tuple[np.ndarray, np.ndarray, bytes]:
    """Sorted by path (UTF-8 byte order is code point order, as ``sorted`` of str), duplicates
    dropped (the last kept, as a dict of a listing would)."""
    starts = np.concatenate([[0], ends[:-1]]).tolist()
    tails = [blob[s:e] for s, e in zip(starts, ends.tolist())]
    order = sorted(range(len(tails)), key=tails.__getitem__)
    keep = [i for j, i in enumerate(order) if j + 1 == len(order) or tails[order[j + 1]] != tails[i]]
    out = b"".join(tails[i] for i in keep)
    lengths = np.fromiter((len(tails[i]) for i in keep), dtype=np.int64, count=len(keep))
    return np.cumsum(lengths), sizes[keep], out


def build(head: str, ends: np.ndarray, sizes: np.ndarray, blob: Any, meta: dict[str, Any] | None = None) -> SampleIndex:
    """An index of ``len(sizes)`` paths ``head + blob[ends[i-1]:ends[i]]``, in one buffer: a
    sealed memfd when large (shared with spawned workers), else bytes."""
    n = len(sizes)
    header = json.dumps({"format": FORMAT, "n": n, "head": head, "blob": len(blob), "meta": meta or {}},
                        separators=(",", ":")).encode()
    at = 16 + _pad8(len(header))
    total = at + 16 * n + 8 + len(blob)
    fd, buffer = shared_buffer("cachefs-sample-index", total)
    view = memoryview(buffer)
    view[:8] = MAGIC
    struct.pack_into("<Q", view, 8, len(header))
    view[16:16 + len(header)] = header
    starts = np.frombuffer(buffer, dtype="<i8", count=n + 1, offset=at)
    starts[0] = 0
    starts[1:] = ends
    np.frombuffer(buffer, dtype="<i8", count=n, offset=at + 8 * (n + 1))[:] = sizes
    view[at + 16 * n + 8:total] = blob
    del view, starts
    return SampleIndex(buffer, fd=fd)
