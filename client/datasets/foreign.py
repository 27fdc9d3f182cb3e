"""Other libraries' shard indexes as a ShardTable: MosaicML streaming (MDS) and LitData.

Both write an ``index.json`` beside shards whose header is ``uint32 n`` then ``n + 1`` uint32
offsets, absolute within the shard, one sample between two offsets (MDS puts its config JSON
between the offsets and the first sample; LitData nothing). So a shard's samples are known from
its first ``4 * (n + 2)`` bytes: one small range read through the cache per shard, not a scan.

Each sample becomes one field (``SAMPLE``: the whole sample's bytes) in a ``ShardTable`` whose
``format`` is ``mds`` or ``litdata`` and whose ``meta`` names the columns: a sample's column sizes
are in the sample's own prefix, so the columns are split when its bytes arrive (columns.py),
not found here by reading every sample. Reads, plans and resume are the tar ones unchanged.

Refused with a ``ShardFormatError`` naming the file: compressed or encrypted shards (their
offsets are of the bytes before compression), MDS shards of another format (``jsonl``, ``xsv``),
LitData item loaders other than the pytree one (tokens, temporal) and chunks whose rows are an
Arrow footer, and any header that disagrees with
the index (sample count, last offset, the size listed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from cachefs.client.datasets.shards import INDEX_VERSION, ShardFormatError
from cachefs.client.datasets.shardtable import ShardTable, build_table

__all__ = ["flavour", "foreign_table", "SAMPLE", "FOREIGN_FORMATS"]

#: The one field of a foreign sample in the table: all of its bytes (columns.py splits them).
SAMPLE = "__sample__"
FOREIGN_FORMATS = ("mds", "litdata")
#: The last bytes of a LitData chunk whose rows are an Arrow table after the items (litdata >= 0.2.7x).
ARROW_FOOTER = b"LDARW01\0"

ReadRange = Callable[[str, int, int], bytes]  # (path, offset, length) -> bytes


def flavour(doc: Any) -> str:
    """``cachefs``, ``mds`` or ``litdata``: whose ``index.json`` this is, from its shape."""
    if isinstance(doc, dict):
        if isinstance(doc.get("chunks"), list) and isinstance(doc.get("config"), dict):
            return "litdata"
        shards = doc.get("shards")
        if isinstance(shards, list) and doc.get("version") == 2:
            return "mds"
        if isinstance(shards, list) and doc.get("version") == INDEX_VERSION:
            return "cachefs"
    raise ValueError("not a shard index this reads: neither cachefs's (version 1, shards with samples), "
                     "MosaicML streaming's (version 2, shards) nor LitData's (chunks and config)")


def foreign_table(doc: dict[str, Any], where: str, base: str, read: ReadRange,
                  sizes: dict[str, int] | None, threads: int = 8) -> ShardTable:
    """The table of an MDS or LitData index document read from ``where`` (for messages); shard
    paths are under ``base``; ``sizes``: each shard's size as listed (None: not checked)."""
    kind = flavour(doc)
    try:
        shards, meta = _mds(doc, where) if kind == "mds" else _litdata(doc, where)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, ShardFormatError):
            raise
        raise ShardFormatError(f"{where}: malformed {kind} index: {type(exc).__name__}: {exc}") from None
    paths = [base.rstrip("/") + "/" + name for name, _, _ in shards]
    for path, (name, _, size) in zip(paths, shards):
        if sizes is not None:
            listed = sizes.get(path.split("://", 1)[-1])
            if listed is None:
                raise ShardFormatError(f"{where}: shard {name} is not there ({path})")
            if listed != size:
                raise ShardFormatError(f"{path}: {listed} bytes, the index says {size} (truncated or replaced?)")

    def header(k: int) -> np.ndarray:
        name, n, size = shards[k]
        return _offsets(paths[k], read, n, size, meta["min_sample"], kind == "litdata")

    with ThreadPoolExecutor(max(1, min(threads, len(shards)))) as pool:
        offsets = list(pool.map(header, range(len(shards))))
    del meta["min_sample"]
    return _table(kind, meta, paths, shards, offsets)


def _table(kind: str, meta: dict[str, Any], paths: list[str], shards: list[tuple[str, int, int]],
           offsets: list[np.ndarray]) -> ShardTable:
    """The table's columns made a shard at a time with numpy, not a tuple per sample (the tar
    builder's way): one field a sample, keyed ``<shard file>/<i>``."""
    empty = np.zeros(0, np.int64)
    counts = np.array([len(o) - 1 for o in offsets], dtype=np.int64)
    n_samples = int(counts.sum())
    off = np.concatenate([o[:-1] for o in offsets]) if offsets else empty
    size = np.concatenate([np.diff(o) for o in offsets]) if offsets else empty
    key_len, keys = [], []
    for (name, _, _), count in zip(shards, counts.tolist()):
        prefix, numbers = f"{name}/", list(map(str, range(count)))
        keys.append(prefix.join(["", *numbers]).encode("utf-8", "surrogateescape"))  # name/0name/1...
        key_len.append(len(prefix.encode("utf-8", "surrogateescape")) + np.fromiter(map(len, numbers), np.int64, count))
    blobs = [p.encode("utf-8", "surrogateescape") for p in paths]
    cum = lambda a: np.concatenate([[0], np.cumsum(a, dtype=np.int64)])  # noqa: E731
    return build_table([SAMPLE], b"".join(blobs), cum([len(b) for b in blobs]),
                       np.array([size for _, _, size in shards], dtype=np.int64), cum(counts), b"".join(keys),
                       cum(np.concatenate(key_len) if key_len else empty), np.arange(n_samples + 1, dtype=np.int64),
                       np.zeros(n_samples, np.int64), off, size, kind, True, meta)


def _offsets(path: str, read: ReadRange, n: int, size: int, min_sample: int, exact_header: bool) -> np.ndarray:
    """Shard ``path``'s n + 1 sample offsets from its header, checked against the index."""
    want = 4 * (n + 2)
    head = read(path, 0, min(want, size))
    if len(head) < want:
        raise ShardFormatError(f"{path}: a {len(head)}-byte header, {n} samples need {want}")
    count = int.from_bytes(head[:4], "little")
    if count != n:
        raise ShardFormatError(f"{path}: its header says {count} samples, the index {n}")
    off = np.frombuffer(head, dtype="<u4", count=n + 1, offset=4).astype(np.int64)
    if (off[0] != want) if exact_header else (off[0] < want):
        raise ShardFormatError(f"{path}: the first sample at {off[0]}, inside or not after the {want}-byte header")
    if off[-1] != size:
        if exact_header and off[-1] < size and read(path, size - 8, 8) == ARROW_FOOTER:
            raise ShardFormatError(f"{path}: its rows are in LitData's Arrow footer (what litdata writes for "
                                   f"flat JSON-like samples); only pytree items are read")
        raise ShardFormatError(f"{path}: its samples end at {off[-1]}, the index says the shard has {size} bytes")
    lengths = np.diff(off)
    if n and int(lengths.min()) < min_sample:
        i = int(np.argmin(lengths))
        raise ShardFormatError(f"{path}: sample {i} is {int(lengths[i])} bytes, its columns' sizes need "
                               f"at least {min_sample}")
    return off


# -- MosaicML streaming -------------------------------------------------------------------------------
def _mds(doc: dict[str, Any], where: str) -> tuple[list[tuple[str, int, int]], dict[str, Any]]:
    shards: list[tuple[str, int, int]] = []
    columns: tuple[list[str], list[str], list[int | None]] | None = None
    for item in doc["shards"]:
        raw = item.get("raw_data") or {}
        name = str(raw.get("basename") or (item.get("zip_data") or {}).get("basename"))
        if item.get("format") != "mds":
            raise ShardFormatError(f"{where}: shard {name} is {item.get('format')!r}; only 'mds' shards are read")
        if item.get("version", 2) != 2:
            raise ShardFormatError(f"{where}: shard {name} is MDS version {item.get('version')}, this reads 2")
        if item.get("compression"):
            raise ShardFormatError(f"{where}: shard {name} is compressed ({item['compression']}); compressed MDS "
                                   f"shards are not read (their offsets are of the uncompressed bytes)")
        names = [str(c) for c in item["column_names"]]
        encodings = [str(c) for c in item["column_encodings"]]
        fixed = [None if s is None else int(s) for s in item["column_sizes"]]
        if not (len(names) == len(encodings) == len(fixed)) or not names:
            raise ShardFormatError(f"{where}: shard {name}: {len(names)} column names, {len(encodings)} "
                                   f"encodings, {len(fixed)} sizes")
        if columns is None:
            columns = (names, encodings, fixed)
        elif columns != (names, encodings, fixed):
            # one data set, one set of columns (what MDSWriter writes); a sample's columns are
            # read by the table's, not its shard's
            raise ShardFormatError(f"{where}: shard {name} has other columns than the first shard's")
        shards.append((name, int(item["samples"]), int(raw["bytes"])))
    if columns is None:
        raise ShardFormatError(f"{where}: an MDS index with no shards")
    names, encodings, fixed = columns
    min_sample = sum(4 if s is None else s for s in fixed)  # a size prefix per variable column
    return shards, {"columns": names, "encodings": encodings, "sizes": fixed, "min_sample": min_sample}


# -- LitData -------------------------------------------------------------------------------------------
def _litdata(doc: dict[str, Any], where: str) -> tuple[list[tuple[str, int, int]], dict[str, Any]]:
    config, chunks = doc["config"], doc["chunks"]
    first = str(chunks[0]["filename"]) if chunks else "(no chunks)"
    loader = config.get("item_loader") or "PyTreeLoader"
    if loader != "PyTreeLoader":
        raise ShardFormatError(f"{where}: chunks written by LitData's {loader}; only PyTreeLoader chunks are read")
    if config.get("compression"):
        how = config["compression"] + (f", {config['compression_level']} level" if config.get("compression_level") else "")
        raise ShardFormatError(f"{where}: chunk {first} and the rest are compressed ({how}); "
                               f"compressed LitData chunks are not read")
    if config.get("encryption"):
        raise ShardFormatError(f"{where}: chunk {first} and the rest are encrypted; encrypted chunks are not read")
    formats = [str(f) for f in config["data_format"]]
    keys = leaf_keys(config.get("data_spec"), len(formats))
    shards = [(str(c["filename"]), int(c["chunk_size"]), int(c["chunk_bytes"])) for c in chunks]
    if not shards:
        raise ShardFormatError(f"{where}: a LitData index with no chunks")
    return shards, {"columns": keys, "formats": formats, "min_sample": 4 * len(formats)}


def leaf_keys(spec: Any, n: int) -> list[str]:
    """The flattened keys of a pytree spec (``treespec_dumps``'s JSON): dict keys, and positions
    in tuples and lists, joined by ``.`` where nested; ``0``, ``1``... for a sample that is no dict."""
    if spec is None:
        return [str(i) for i in range(n)]
    node = json.loads(spec) if isinstance(spec, str) else spec
    if isinstance(node, list) and len(node) == 2 and isinstance(node[1], dict):
        node = node[1]  # [protocol, root]
    keys: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        children = node.get("children_spec") or []
        if node.get("type") is None and not children:
            keys.append(prefix or "0")
            return
        names: Sequence[Any] = range(len(children))
        if str(node.get("type", "")).endswith("dict"):  # dict, OrderedDict, defaultdict: keys in order
            context = node.get("context")
            context = json.loads(context) if isinstance(context, str) else context
            if isinstance(context, list) and len(context) == len(children):
                names = context
        for name, child in zip(names, children):
            walk(child, f"{prefix}.{name}" if prefix else str(name))

    walk(node, "")
    if len(keys) != n:
        raise ValueError(f"a data_spec of {len(keys)} leaves for {n} data formats")
    return keys
