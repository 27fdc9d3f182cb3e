"""The tar-shard index in one read-only buffer: arrays and blobs, no object per sample.

``ShardIndex``/``SampleSpan`` (shards.py) hold a sample as Python objects (a key, a tuple of
field tuples): hundreds of bytes a sample in every process, which DataLoader workers copy page
by page as they touch reference counts. A ``ShardTable`` holds every shard of a data set as
sections of one buffer, the way ``SampleIndex`` (sampleindex.py) holds a map dataset's paths:

* per shard: its path (a UTF-8 blob and where each starts), size, and first sample's global id;
* per sample: its key (a UTF-8 blob and where each starts) and where its fields start;
* per field: its name (an id into the few names the data set uses: ``jpg``, ``cls``), offset and
  size within the shard; offsets, sizes and starts are uint32 where every value fits, else int64;
* a sample's byte span (first field's start to last field's end) follows from its fields when
  they are in file order (what a scan or ``write_tar_shards`` gives); otherwise it is two more
  arrays (``lo``, ``hi``).

The buffer is a sealed memfd when large (sampleindex.py's ``shared_buffer``: one mechanism for
shared memory), or the kept file itself, mapped (indexcache.py): forked DataLoader workers share
its pages, spawned ones map the same memory (the pickle carries ``/proc/<pid>/fd/<fd>``).

Format (also the kept file's): ``magic | u64 header length | JSON header | sections``; the header
names each section's dtype, count and offset (8-aligned), and for a format other than tar its
``meta`` (an MDS or LitData data set's columns: foreign.py). Loading checks the magic, the format,
that every section lies within the buffer and the counts agree; it reads no section in full
(a map's pages load as they are read), so a file damaged inside a section is not caught there:
a read of a sample it misplaces fails (short or wrong bytes), as with a wrong ``index.json``.
"""

from __future__ import annotations

import json
import struct
import weakref
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from cachefs.client.datasets.sampleindex import SharedBuffer, release, shared_buffer
from cachefs.client.datasets.shards import INDEX_VERSION, SampleSpan, ShardIndex

__all__ = ["ShardTable", "ShardView", "TableBuilder", "table_from_json", "FORMAT"]

MAGIC = b"CFSSHD01"
FORMAT = 1
U32_MAX = (1 << 32) - 1

#: Sections every table has: (name, count from (shards S, samples N, fields F, path bytes P, key bytes K)).
_SECTIONS = {
    "path_at": lambda S, N, F, P, K: S + 1, "paths": lambda S, N, F, P, K: P,
    "shard_size": lambda S, N, F, P, K: S, "shard_at": lambda S, N, F, P, K: S + 1,
    "key_at": lambda S, N, F, P, K: N + 1, "keys": lambda S, N, F, P, K: K,
    "field_at": lambda S, N, F, P, K: N + 1, "name": lambda S, N, F, P, K: F,
    "off": lambda S, N, F, P, K: F, "size": lambda S, N, F, P, K: F,
}


class ShardTableError(ValueError):
    """A buffer or file that is not a whole shard table (truncated, damaged, another format)."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _narrow(a: np.ndarray) -> np.ndarray:
    """uint32 where every value fits (offsets within shards of under 4 GiB), else int64."""
    if len(a) and (int(a.max()) > U32_MAX or int(a.min()) < 0):
        return a.astype("<i8", copy=False)
    return a.astype("<u4", copy=False)


class ShardTable(SharedBuffer, Sequence["ShardView"]):
    """Every shard of a data set (``Sequence`` of ``ShardView``, each as a ``ShardIndex``), its
    samples addressed by global id (shard after shard, in file order), over one buffer."""

    SHARED_WHAT = "shard table"

    def __init__(self, buffer: Any, *, fd: int = -1, path: str = "") -> None:
        view = memoryview(buffer)
        where = path or "shard table"
        if len(view) < 16 or bytes(view[:8]) != MAGIC:
            raise ShardTableError(f"{where}: not a cachefs shard table (no {MAGIC!r} magic)")
        (hlen,) = struct.unpack_from("<Q", view, 8)
        if 16 + hlen > len(view):
            raise ShardTableError(f"{where}: truncated: a {hlen}-byte header in {len(view)} bytes")
        try:
            header = json.loads(bytes(view[16:16 + hlen]))
            if header.get("format") != FORMAT:
                raise ShardTableError(f"{where}: shard table format {header.get('format')}, this release reads {FORMAT}")
            S, N, F = int(header["shards"]), int(header["samples"]), int(header["fields"])
            P, K = int(header["path_bytes"]), int(header["key_bytes"])
            sections = header["sections"]
            self.names: list[str] = [str(n) for n in header["names"]]
            self.format: str = str(header.get("fmt", "tar"))
            # what a format other than tar needs to read its samples' bytes (foreign.py: columns)
            self.meta: dict[str, Any] = dict(header.get("meta") or {})
        except ShardTableError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ShardTableError(f"{where}: damaged header: {type(exc).__name__}: {exc}") from None
        want = {name: count(S, N, F, P, K) for name, count in _SECTIONS.items()}
        if "lo" in sections or "hi" in sections:
            want.update(lo=N, hi=N)
        arrays: dict[str, Any] = {}
        for name, count in want.items():
            if name not in sections:
                raise ShardTableError(f"{where}: damaged header: no section {name!r}")
            dtype, n, at = sections[name]
            dt = np.dtype(dtype)
            end = int(at) + int(n) * dt.itemsize
            if int(n) != count:
                raise ShardTableError(f"{where}: section {name!r} holds {n} items, its counts say {count}")
            if end > len(view):
                raise ShardTableError(f"{where}: truncated: section {name!r} needs bytes {at}-{end}, "
                                      f"the file has {len(view)}")
            if name in ("paths", "keys"):
                arrays[name] = view[int(at):end]
            else:
                arrays[name] = a = np.frombuffer(buffer, dtype=dt, count=int(n), offset=int(at))
                a.flags.writeable = False  # shared pages: nobody writes them
        self._buffer, self._fd, self.path = buffer, fd, path
        self.nbytes = len(view)
        self.n_samples, self.n_fields = N, F
        self._paths, self._keys = arrays["paths"], arrays["keys"]
        self.path_at, self.shard_size, self.shard_at = arrays["path_at"], arrays["shard_size"], arrays["shard_at"]
        self.key_at, self.field_at = arrays["key_at"], arrays["field_at"]
        self.name, self.off, self.size = arrays["name"], arrays["off"], arrays["size"]
        self.lo, self.hi = arrays.get("lo"), arrays.get("hi")
        # O(1) and O(shards) checks; a section's whole content is never read here (see module doc)
        if S and (int(self.shard_at[0]) != 0 or int(self.shard_at[-1]) != N or np.any(np.diff(self.shard_at) < 0)):
            raise ShardTableError(f"{where}: damaged: shard sample counts do not add up to {N}")
        for name, a, total in (("key_at", self.key_at, K), ("field_at", self.field_at, F), ("path_at", self.path_at, P)):
            if int(a[0]) != 0 or int(a[-1]) != total:
                raise ShardTableError(f"{where}: damaged: section {name!r} does not end at {total}")
        if self.names and F and len(self.name) and int(self.name[-1]) >= len(self.names):
            raise ShardTableError(f"{where}: damaged: a field name id past the {len(self.names)} names")
        if fd >= 0:
            weakref.finalize(self, release, fd, buffer if not isinstance(buffer, (bytes, bytearray)) else None)

    # -- shards (the Sequence) ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.shard_size)

    def __getitem__(self, s: Any) -> Any:
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        s = s.__index__()
        if s < 0:
            s += len(self)
        if not 0 <= s < len(self):
            raise IndexError(f"shard {s} of {len(self)}")
        return ShardView(self, s)

    def __iter__(self) -> Iterator["ShardView"]:
        return (ShardView(self, s) for s in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards, {self.n_samples} samples, {self.nbytes} bytes)"

    def shard_path(self, s: int) -> str:
        return str(self._paths[int(self.path_at[s]):int(self.path_at[s + 1])], "utf-8", "surrogateescape")

    @property
    def counts(self) -> np.ndarray:
        """Samples per shard (int64)."""
        return np.diff(self.shard_at).astype(np.int64)

    @property
    def starts(self) -> np.ndarray:
        """Each shard's first global sample id, and the total last (int64[shards + 1])."""
        return self.shard_at.astype(np.int64, copy=False)

    # -- samples by global id ----------------------------------------------------------------------
    def key(self, g: int) -> str:
        return str(self._keys[int(self.key_at[g]):int(self.key_at[g + 1])], "utf-8", "surrogateescape")

    def fields(self, g: int) -> tuple[tuple[str, int, int], ...]:
        a, b = int(self.field_at[g]), int(self.field_at[g + 1])
        names = self.names
        return tuple((names[n], o, z) for n, o, z in zip(self.name[a:b].tolist(), self.off[a:b].tolist(),
                                                         self.size[a:b].tolist()))

    def span(self, g: int) -> SampleSpan:
        return SampleSpan(self.key(g), self.fields(g))

    def entries(self, ids: Any) -> list[tuple[str, tuple[tuple[str, int, int], ...]]]:
        """(key, fields) of each of global ``ids`` (a block's), gathered a column at a time: a
        sample at a time, numpy's per-item indexing cost microseconds a sample."""
        ids = np.asarray(ids, dtype=np.int64)
        ka, kb = self.key_at[ids].tolist(), self.key_at[ids + 1].tolist()
        fa, fb = self.field_at[ids].astype(np.int64), self.field_at[ids + 1].astype(np.int64)
        counts = fb - fa
        ends = np.cumsum(counts)
        # every field of every sample, in order: the samples' field ranges laid end to end
        at = np.repeat(fa - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends) else 0)
        names, offs, sizes = self.name[at].tolist(), self.off[at].tolist(), self.size[at].tolist()
        keys, table_names = self._keys, self.names
        out = []
        j = 0
        for a, b, c in zip(ka, kb, counts.tolist()):
            out.append((str(keys[a:b], "utf-8", "surrogateescape"),
                        tuple((table_names[names[k]], offs[k], sizes[k]) for k in range(j, j + c))))
            j += c
        return out

    def bounds(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's byte span within its shard, [lo, hi) (int64 arrays), for global ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.lo is not None:
            return self.lo[ids].astype(np.int64), self.hi[ids].astype(np.int64)  # type: ignore[index]
        first, last = self.field_at[ids].astype(np.int64), self.field_at[ids + 1].astype(np.int64) - 1
        return self.off[first].astype(np.int64), self.off[last].astype(np.int64) + self.size[last]

    def sample_bytes(self, ids: Any) -> int:
        lo, hi = self.bounds(ids)
        return int((hi - lo).sum())

    def units(self) -> "Units":
        """``(shard path, start, length)`` per sample, made when asked (a read plan's index)."""
        return Units(self)

    # -- pickling and files: sampleindex.SharedBuffer ---------------------------------------------------
    @classmethod
    def from_shards(cls, shards: Iterable[ShardIndex], fmt: str = "tar") -> "ShardTable":
        if isinstance(shards, ShardTable):
            return shards
        builder = TableBuilder()
        for shard in shards:
            if isinstance(shard, ShardView):  # a table's shard: its columns, no SampleSpan each
                builder.add_shard(shard.path, shard.size, shard.table.entries(np.arange(shard.first, shard.first + shard.n)))
            else:
                builder.add_shard(shard.path, shard.size, ((s.key, s.fields) for s in shard.samples))
        return builder.finish(fmt)


class ShardView:
    """Shard ``s`` of a table, as a ``ShardIndex`` reads (path, size, ``len``, ``samples``), with
    ``key``/``fields``/``bounds`` by sample number within the shard."""

    __slots__ = ("table", "s", "path", "size", "first", "n")

    def __init__(self, table: ShardTable, s: int) -> None:
        self.table, self.s = table, s
        self.path, self.size = table.shard_path(s), int(table.shard_size[s])
        self.first = int(table.shard_at[s])
        self.n = int(table.shard_at[s + 1]) - self.first

    def __len__(self) -> int:
        return self.n

    @property
    def samples(self) -> "Spans":
        return Spans(self)

    def key(self, i: int) -> str:
        return self.table.key(self.first + i)

    def fields(self, i: int) -> tuple[tuple[str, int, int], ...]:
        return self.table.fields(self.first + i)

    def bounds(self, local: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.table.bounds(np.asarray(local, dtype=np.int64) + self.first)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ShardView, ShardIndex)):
            return self.path == other.path and self.size == other.size and self.samples == other.samples
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardView({self.path!r}, {self.size} bytes, {self.n} samples)"


class Spans(Sequence[SampleSpan]):
    """A shard's samples as ``SampleSpan``s, each made when asked."""

    def __init__(self, shard: ShardView) -> None:
        self._shard = shard

    def __len__(self) -> int:
        return self._shard.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i.__index__()
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        return self._shard.table.span(self._shard.first + i)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class Units(Sequence[tuple[str, int, int]]):
    """A read plan's units over a table: ``(shard path, start, length)`` per sample, when asked."""

    def __init__(self, table: ShardTable) -> None:
        self.table = table

    def __len__(self) -> int:
        return self.table.n_samples

    def __getitem__(self, g: Any) -> Any:
        if isinstance(g, slice):
            return [self[j] for j in range(*g.indices(len(self)))]
        g = g.__index__()
        t = self.table
        s = int(np.searchsorted(t.shard_at, g, "right")) - 1
        lo, hi = t.bounds([g])
        return t.shard_path(s), int(lo[0]), int(hi[0] - lo[0])

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        t = self.table
        for s in range(len(t)):
            path, a, b = t.shard_path(s), int(t.shard_at[s]), int(t.shard_at[s + 1])
            for c in range(a, b, 65536):  # a chunk's bounds at a time, not n of them
                lo, hi = t.bounds(np.arange(c, min(b, c + 65536)))
                for x, y in zip(lo.tolist(), hi.tolist()):
                    yield path, x, y - x


class TableBuilder:
    """Shards appended one at a time, held in arrays and bytearrays while they come."""

    def __init__(self) -> None:
        self._paths, self._keys = bytearray(), bytearray()
        self._path_at, self._key_at, self._field_at = array("q", [0]), array("q", [0]), array("q", [0])
        self._shard_size, self._shard_at = array("q"), array("q", [0])
        self._name, self._off, self._size = array("l"), array("q"), array("q")
        self._names: dict[str, int] = {}

    def add_shard(self, path: str, size: int, samples: Iterable[tuple[str, Sequence[Sequence[Any]]]]) -> None:
        """``samples``: (key, [(field name, offset, size), ...]) each, in file order."""
        names = self._names
        keys, key_at, field_at = self._keys, self._key_at, self._field_at
        name, off, sz = self._name, self._off, self._size
        n = 0
        for key, fields in samples:
            keys += key.encode("utf-8", "surrogateescape")
            key_at.append(len(keys))
            for f, o, z in fields:
                i = names.get(f)
                if i is None:
                    i = names[f] = len(names)
                name.append(i)
                off.append(int(o))
                sz.append(int(z))
            field_at.append(len(off))
            n += 1
        self._paths += path.encode("utf-8", "surrogateescape")
        self._path_at.append(len(self._paths))
        self._shard_size.append(int(size))
        self._shard_at.append(self._shard_at[-1] + n)

    def finish(self, fmt: str = "tar", shared: bool = True, meta: dict[str, Any] | None = None) -> ShardTable:
        def arr(a: array) -> np.ndarray:
            return np.frombuffer(a, dtype=np.int64) if a.itemsize == 8 else np.asarray(a, dtype=np.int64)
        names = sorted(self._names, key=self._names.__getitem__)
        return build_table(names, bytes(self._paths), arr(self._path_at), arr(self._shard_size), arr(self._shard_at),
                           bytes(self._keys), arr(self._key_at), arr(self._field_at), arr(self._name),
                           arr(self._off), arr(self._size), fmt, shared, meta)


def build_table(names: Sequence[str], paths: bytes, path_at: np.ndarray, shard_size: np.ndarray,
                shard_at: np.ndarray, keys: Any, key_at: np.ndarray, field_at: np.ndarray, name: np.ndarray,
                off: np.ndarray, size: np.ndarray, fmt: str = "tar", shared: bool = True,
                meta: dict[str, Any] | None = None) -> ShardTable:
    """A table from its columns (see the module doc), in one buffer: a sealed memfd when large
    and ``shared``, else a bytearray (pickled as bytes)."""
    S, N, F = len(shard_size), len(key_at) - 1, len(off)
    name_dt = "|u1" if len(names) <= 256 else "<u2" if len(names) <= 65536 else "<u4"
    columns: dict[str, Any] = {
        "path_at": path_at.astype("<i8", copy=False), "shard_size": shard_size.astype("<i8", copy=False),
        "shard_at": shard_at.astype("<i8", copy=False), "key_at": _narrow(key_at), "field_at": _narrow(field_at),
        "name": name.astype(name_dt, copy=False), "off": _narrow(off), "size": _narrow(size),
    }
    counts = np.diff(field_at) if N else np.zeros(0, np.int64)
    ordered = bool(N == 0 or counts.min() >= 1)
    if ordered and F > 1:  # fields of each sample in file order: its span is first start to last end
        ends = off + size
        inner = np.ones(F, dtype=bool)
        inner[field_at[:-1]] = False  # the first field of each sample starts its span
        ordered = bool(np.all((off[1:] >= ends[:-1])[inner[1:]]))
    if not ordered:  # spans stored: min start and max end of each sample's fields
        lo, hi = np.zeros(N, np.int64), np.zeros(N, np.int64)
        has = counts > 0
        if F:
            lo[has] = np.minimum.reduceat(off, field_at[:-1][has])
            hi[has] = np.maximum.reduceat(off + size, field_at[:-1][has])
        columns.update(lo=_narrow(lo), hi=_narrow(hi))
    blobs = {"paths": paths, "keys": keys}
    layout: dict[str, list[Any]] = {}
    at = 0
    for key, a in list(columns.items()) + list(blobs.items()):
        dt, n = (a.dtype.str, len(a)) if key in columns else ("|u1", len(a))
        layout[key] = [dt, n, at]
        at = _pad8(at + n * np.dtype(dt).itemsize)

    def header_at(base: int) -> bytes:  # the sections' offsets from the buffer's start
        sections = {k: [dt, n, pos + base] for k, (dt, n, pos) in layout.items()}
        return json.dumps({"format": FORMAT, "version": INDEX_VERSION, "fmt": fmt, "shards": S, "samples": N,
                           "fields": F, "path_bytes": len(paths), "key_bytes": len(keys), "names": list(names),
                           "sections": sections, **({"meta": meta} if meta else {})},
                          separators=(",", ":")).encode()
    base = 16
    while True:  # the offsets' digits are part of the header they follow: settle its length
        header = header_at(base)
        if 16 + _pad8(len(header)) <= base:
            break
        base = 16 + _pad8(len(header))
    for item in layout.values():
        item[2] += base
    total = base + at
    fd, buffer = shared_buffer("cachefs-shard-table", total) if shared else (-1, bytearray(total))
    view = memoryview(buffer)
    view[:8] = MAGIC
    struct.pack_into("<Q", view, 8, len(header))
    view[16:16 + len(header)] = header
    for key, a in columns.items():
        dt, n, pos = layout[key]
        np.frombuffer(buffer, dtype=dt, count=n, offset=pos)[:] = a
    for key, blob in blobs.items():
        _, n, pos = layout[key]
        view[pos:pos + n] = blob
    del view
    return ShardTable(buffer, fd=fd)


def one_shard(shard: ShardIndex | ShardView) -> ShardView:
    """One shard as a table of its own in private memory (bytes when pickled): a shard indexed on
    the way (shardscan.py), held compact until all are known and make one table."""
    if isinstance(shard, ShardView):
        return shard
    builder = TableBuilder()
    builder.add_shard(shard.path, shard.size, ((s.key, s.fields) for s in shard.samples))
    return builder.finish(shared=False)[0]


def table_from_json(text: str | bytes | dict[str, Any], base: str = "", shared: bool = True) -> ShardTable:
    """A table straight from an index document (``index.json``, or it parsed): no ``SampleSpan``
    per sample."""
    doc = text if isinstance(text, dict) else json.loads(text)
    if not isinstance(doc, dict) or doc.get("version") != INDEX_VERSION:
        raise ValueError(f"not a cachefs shard index (version {INDEX_VERSION})")
    prefix = base.rstrip("/") + "/" if base else ""
    builder = TableBuilder()
    items = doc["shards"]
    for k, item in enumerate(items):
        path = str(item["path"])
        if "://" not in path and not path.startswith("/"):
            path = prefix + path
        builder.add_shard(path, int(item["size"]), ((str(key), [(str(n), o, s) for n, o, s in fields])
                                                    for key, fields in item["samples"]))
        items[k] = None  # the parsed shard's objects go as the table grows
    return builder.finish(str(doc.get("format", "tar")), shared)
