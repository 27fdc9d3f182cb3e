"""Manifests for CacheDataset: a file listing sample paths (and sizes), read into its compact index.

Accepted, told apart by their first bytes:

* a JSON list of paths or of ``{"path", "size"}`` objects (parsed whole, as before);
* JSON lines: one ``{"path": ..., "size": ...}`` object or one JSON string a line;
* plain text: one path a line;
* Parquet (``PAR1`` magic): a ``path`` column and an optional ``size`` column, read a row
  group at a time (pyarrow: the ``parquet`` extra).

Empty lines and lines starting with ``#`` are skipped in text and JSON lines. Lines, rows and
objects go one by one into ``IndexBuilder`` (sampleindex.py), never into a list of every path:
a manifest of millions of samples costs its compact index, not an object per path.

A path is used as given (a URL, or a cachefs path from the mount's name: ``data/train/x``),
except one starting with ``./`` or ``../``: that one is relative to the manifest's directory,
which must then be a ``cachefs://`` URL. Sizes not given are looked up (``resolve``), a chunk of
paths at a time.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Iterator
from typing import IO, Any

from cachefs.client.datasets.sampleindex import IndexBuilder, SampleIndex

__all__ = ["manifest_index", "entries"]

READ = 1 << 20
RESOLVE_CHUNK = 8192
UNKNOWN = -1


def manifest_index(url: str, f: IO[bytes], resolve: Callable[[list[str]], list[int]]) -> SampleIndex:
    """The index of manifest ``url``, read from its open file ``f``; ``resolve(paths)``: their sizes."""
    builder = IndexBuilder()
    held: list[tuple[str, int]] = []  # entries waiting for sizes: at most RESOLVE_CHUNK of them
    unknown: list[int] = []

    def flush() -> None:
        if unknown:
            for k, size in zip(unknown, resolve([held[k][0] for k in unknown])):
                held[k] = (held[k][0], int(size))
        builder.extend(held)
        held.clear()
        unknown.clear()
    for path, size in entries(url, f):
        if size == UNKNOWN:
            unknown.append(len(held))
        elif not unknown:  # nothing waiting: straight in
            builder.add(path, size)
            continue
        held.append((path, size))
        if len(held) >= RESOLVE_CHUNK:
            flush()
    flush()
    return builder.finish()


def entries(url: str, f: IO[bytes]) -> Iterator[tuple[str, int]]:
    """``(path, size)`` of every entry of manifest ``url`` (size ``UNKNOWN`` where not given)."""
    first = f.read(READ)
    start = first.lstrip()[:1]
    base = _base(url)
    if first[:4] == b"PAR1":
        yield from _parquet(url, f, base)
    elif start == b"[":
        items = json.loads(first + f.read())
        for n, item in enumerate(items):
            yield _entry(url, f"item {n}", item, base)
    else:
        as_json: bool | None = None  # JSON lines or text: as the first entry is
        for n, line in enumerate(_lines(first, f), 1):
            text = line.strip()
            if not text or text.startswith(b"#"):
                continue
            if as_json is None:
                as_json = text[:1] in (b"{", b'"')
            if as_json:
                try:
                    item = json.loads(text)
                except ValueError as exc:
                    raise ValueError(f"{url} line {n}: not JSON: {exc}") from None
                yield _entry(url, f"line {n}", item, base)
            else:
                yield _path(url, f"line {n}", text.decode("utf-8", "surrogateescape"), base), UNKNOWN


def _lines(first: bytes, f: IO[bytes]) -> Iterator[bytes]:
    rest = first
    while True:
        more = f.read(READ)
        if not more:
            break
        rest += more
        *whole, rest = rest.split(b"\n")
        yield from whole
    yield from rest.split(b"\n")


def _entry(url: str, where: str, item: Any, base: str | None) -> tuple[str, int]:
    if isinstance(item, str):
        return _path(url, where, item, base), UNKNOWN
    if not isinstance(item, dict) or not isinstance(item.get("path"), str):
        raise ValueError(f"{url} {where}: neither a path nor an object with a \"path\": {str(item)[:80]}")
    size = item.get("size")
    return _path(url, where, item["path"], base), UNKNOWN if size is None else int(size)


def _base(url: str) -> str | None:
    """The directory relative paths are under: a cachefs:// manifest's (None for any other)."""
    return url.rsplit("/", 1)[0] if url.startswith("cachefs://") and "/" in url[10:] else None


def _path(url: str, where: str, path: str, base: str | None) -> str:
    if not path.startswith(("./", "../")):
        return path
    if base is None:
        raise ValueError(f"{url} {where}: {path!r} is relative to the manifest, which is not a cachefs:// URL")
    root = base[len("cachefs://"):]
    joined = posixpath.normpath(posixpath.join(root, path))
    if joined.startswith("..") or joined.startswith("/"):
        raise ValueError(f"{url} {where}: {path!r} leads out of the cachefs namespace")
    return "cachefs://" + joined


def _parquet(url: str, f: IO[bytes], base: str | None) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{url} is a Parquet manifest: reading it needs pyarrow "
                          f"(pip install 'cachefs[parquet]')") from None
    f.seek(0)
    parquet = pq.ParquetFile(f)
    names = parquet.schema_arrow.names
    if "path" not in names:
        raise ValueError(f"{url}: a Parquet manifest needs a 'path' column; it has {names}")
    columns = ["path", "size"] if "size" in names else ["path"]
    n = 0
    for batch in parquet.iter_batches(columns=columns, batch_size=8192):
        paths = batch.column(0).to_pylist()
        if len(columns) == 2:
            sizes = [UNKNOWN if s is None else int(s) for s in batch.column(1).to_pylist()]
        else:
            sizes = [UNKNOWN] * len(paths)
        for k, (path, size) in enumerate(zip(paths, sizes)):
            if path is None:
                raise ValueError(f"{url} row {n + k}: no path")
            yield _path(url, f"row {n + k}", path, base), size
        n += len(paths)
