"""Shard files for CacheIterableDataset: where every sample lies inside its shard.

A dataset of shards is read by byte range, not by unpacking: an **index** says, for each
shard, which samples it holds and at which offsets each of their fields lie. With it a
DataLoader worker reads a run of consecutive samples as one contiguous range (one request
through the cache) and slices the fields out; without it every worker would have to stream
every shard to find its own samples.

The index comes from the writer (``write_tar_shards`` writes ``index.json`` beside the
shards, as MosaicML streaming writes its ``index.json``) or, where there is none, from one
scan of each shard (``ShardFormat.scan``). Formats are pluggable: a ``ShardFormat`` turns a
shard's bytes into ``SampleSpan``s; tar in the WebDataset convention is the built-in one.

WebDataset convention: members are grouped into samples by *key*, the member name up to the
first dot of its base name (``train/0001.jpg`` and ``train/0001.cls`` form sample
``train/0001`` with fields ``jpg`` and ``cls``); consecutive members with one key are one sample.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

INDEX_VERSION = 1
BLOCK = tarfile.BLOCKSIZE  # 512


class ShardFormatError(ValueError):
    """A shard's bytes are not what its format says (a bad header, a truncated member)."""


@dataclass(frozen=True)
class SampleSpan:
    """One sample of a shard: its key and its fields as (name, offset, size) within the shard."""

    key: str
    fields: tuple[tuple[str, int, int], ...]

    @property
    def start(self) -> int:
        return min(off for _, off, _ in self.fields) if self.fields else 0

    @property
    def end(self) -> int:
        return max(off + size for _, off, size in self.fields) if self.fields else 0

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.fields)

    def to_json(self) -> list[Any]:
        return [self.key, [list(f) for f in self.fields]]

    @classmethod
    def from_json(cls, item: list[Any]) -> "SampleSpan":
        key, fields = item
        return cls(str(key), tuple((str(n), int(o), int(s)) for n, o, s in fields))


@dataclass(frozen=True)
class ShardIndex:
    """One shard: its path (absolute URL), size and samples in file order."""

    path: str
    size: int
    samples: tuple[SampleSpan, ...]

    def __len__(self) -> int:
        return len(self.samples)


class ShardFormat(Protocol):
    """A shard format: finds the samples in a shard read through ``read(offset, length)``."""

    name: str

    def scan(self, read: Callable[[int, int], bytes], size: int) -> list[SampleSpan]: ...


def split_key(name: str) -> tuple[str, str]:
    """``dir/0001.seg.jpg`` -> (``dir/0001``, ``seg.jpg``): the WebDataset key and field name."""
    directory, base = posixpath.split(name)
    stem, dot, ext = base.partition(".")
    key = posixpath.join(directory, stem) if directory else stem
    return key, ext if dot else ""


def group_members(members: Iterable[tuple[str, int, int]]) -> list[SampleSpan]:
    """(name, data offset, size) of regular members, in file order -> samples by key."""
    samples: list[SampleSpan] = []
    key: str | None = None
    fields: list[tuple[str, int, int]] = []
    for name, offset, size in members:
        k, field = split_key(name)
        if k != key and fields:
            samples.append(SampleSpan(key, tuple(fields)))  # type: ignore[arg-type]
            fields = []
        key = k
        fields.append((field, offset, size))
    if fields:
        samples.append(SampleSpan(key, tuple(fields)))  # type: ignore[arg-type]
    return samples


class _Window:
    """Sequential reads of a shard in large windows: headers are found without one request each."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, window: int) -> None:
        self._read, self.size, self._window = read, size, window
        self._start, self._data = 0, b""

    def get(self, offset: int, length: int) -> bytes:
        if offset + length > self.size:
            raise ShardFormatError(f"truncated: {length} bytes at {offset} run past the end ({self.size})")
        if not (self._start <= offset and offset + length <= self._start + len(self._data)):
            want = min(self.size - offset, max(length, self._window))
            self._start, self._data = offset, self._read(offset, want)
            if len(self._data) < length:
                raise ShardFormatError(f"short read: {len(self._data)} of {length} bytes at {offset}")
        rel = offset - self._start
        return self._data[rel:rel + length]


def _octal(field: bytes, what: str, at: int) -> int:
    text = field.rstrip(b"\0 ").strip()
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large sizes
        return int.from_bytes(field[1:], "big")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ShardFormatError(f"bad {what} field {field!r} in the header at {at}") from None


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header ("<len> path=<value>\\n" records)."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        if key == b"path":
            return value.decode("utf-8", "surrogateescape")
        pos += length
    return None


class TarFormat:
    """POSIX/GNU tar (what ``tarfile`` and ``tar`` write), regular members only."""

    name = "tar"

    def __init__(self, window: int = 8 << 20) -> None:
        self.window = window

    def members(self, read: Callable[[int, int], bytes], size: int) -> Iterator[tuple[str, int, int]]:
        """(name, data offset, size) of every regular file, following GNU long names and pax paths."""
        w = _Window(read, size, self.window)
        offset = 0
        long_name: str | None = None
        while offset + BLOCK <= size:
            header = w.get(offset, BLOCK)
            if header == b"\0" * BLOCK:
                return  # end-of-archive marker
            checksum = _octal(header[148:156], "checksum", offset)
            if checksum != sum(header[:148]) + 8 * 32 + sum(header[156:]):
                raise ShardFormatError(f"bad header checksum at offset {offset}")
            member_size = _octal(header[124:136], "size", offset)
            kind = header[156:157]
            data_at = offset + BLOCK
            offset = data_at + -(-member_size // BLOCK) * BLOCK
            if kind in (b"L", b"x"):  # a long name (GNU) or pax record for the next member
                data = w.get(data_at, member_size)
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape") if kind == b"L" else _pax_path(data)
                continue
            if kind not in (b"0", b"\0", b"7"):  # directories, links, global headers...: not samples
                long_name = None
                continue
            if long_name is not None:
                name = long_name
            else:
                name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                prefix = header[345:500].split(b"\0", 1)[0]
                if header[257:262] == b"ustar" and prefix:
                    name = prefix.decode("utf-8", "surrogateescape") + "/" + name
            long_name = None
            if data_at + member_size > size:
                raise ShardFormatError(f"member {name!r} runs past the end of the shard")
            yield name, data_at, member_size

    def scan(self, read: Callable[[int, int], bytes], size: int) -> list[SampleSpan]:
        return group_members(self.members(read, size))


FORMATS: dict[str, ShardFormat] = {"tar": TarFormat()}


# -- the index file -----------------------------------------------------------------------------
def index_to_json(shards: Iterable[ShardIndex], base: str = "", fmt: str = "tar") -> str:
    """An index document; shard paths under ``base`` are written relative to it (movable datasets)."""
    prefix = base.rstrip("/") + "/" if base else ""
    items = []
    for shard in shards:
        path = shard.path[len(prefix):] if prefix and shard.path.startswith(prefix) else shard.path
        items.append({"path": path, "size": shard.size, "samples": [s.to_json() for s in shard.samples]})
    return json.dumps({"version": INDEX_VERSION, "format": fmt, "shards": items}, separators=(",", ":"))


def index_from_json(text: str | bytes, base: str = "") -> tuple[str, list[ShardIndex]]:
    """(format name, shards) of an index document; relative shard paths are taken under ``base``."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("version") != INDEX_VERSION:
        raise ValueError(f"not a cachefs shard index (version {INDEX_VERSION})")
    prefix = base.rstrip("/") + "/" if base else ""
    shards = []
    for item in doc["shards"]:
        path = str(item["path"])
        if "://" not in path and not path.startswith("/"):
            path = prefix + path
        shards.append(ShardIndex(path, int(item["size"]), tuple(SampleSpan.from_json(s) for s in item["samples"])))
    return str(doc.get("format", "tar")), shards


# -- writing shards ----------------------------------------------------------------------------
def write_tar_shards(samples: Iterable[tuple[str, dict[str, bytes]]], url: str, *,
                     shard_bytes: int = 64 << 20, name: str = "shard-{:06d}.tar",
                     storage_options: dict[str, Any] | None = None) -> list[ShardIndex]:
    """Write ``(key, {field: bytes})`` samples as tar shards of about ``shard_bytes`` under ``url``
    (any fsspec URL: the object store itself, since cachefs reads it), plus ``index.json``."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocol = url.split("://", 1)[0] + "://" if "://" in url else ""
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)  # a no-op on object stores; local dirs must exist
    shards: list[ShardIndex] = []
    members: list[tuple[str, int, int]] = []
    buf: io.BytesIO | None = None
    tar: tarfile.TarFile | None = None

    def finish() -> None:
        nonlocal buf, tar, members
        if tar is None or buf is None:
            return
        tar.close()
        path = f"{root}/{name.format(len(shards))}"
        fs.pipe_file(path, buf.getvalue())
        shards.append(ShardIndex(protocol + path if protocol else path, buf.tell(), tuple(group_members(members))))
        buf, tar, members = None, None, []

    for key, fields in samples:
        if tar is None:
            buf = io.BytesIO()
            tar = tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT)
        for field, data in fields.items():
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            # addfile copies ``info``; the data ends the archive so far, padded to a block.
            members.append((info.name, tar.offset - -(-len(data) // BLOCK) * BLOCK, len(data)))
        if buf is not None and buf.tell() >= shard_bytes:
            finish()
    finish()
    fs.pipe_file(f"{root}/index.json", index_to_json(shards, protocol + root if protocol else root).encode())
    return shards
