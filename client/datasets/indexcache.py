"""Shard indexes kept between runs, so tar shards without an index file are scanned once.

``CacheIterableDataset.from_prefix`` over shards with no ``index.json`` reads every shard once to
find its samples (shards.py). That is the cold fetch the first epoch needs anyway, but a job
that restarts (a preemption, the next run of an experiment) would pay it again at every start.
The scanned index is kept in a local directory, under a key made of the prefix, the format and
every shard's path, size and version: a shard that changed in the store (a new version) gives a
new key and is scanned again, so a kept index never describes other bytes. A shard without a
version (a store that reports none) is never kept. Written tmp + rename: ranks on one host that
scan at once leave one whole file, never a torn one.

The file is the index's binary table (shardtable.py, ``<key>.shards``), loaded by mapping it: no
parsing, and its pages are shared by every process on the host that maps it. One that is not a
whole table (truncated, damaged header) is logged with what is wrong, removed, and the shards are
scanned again. A kept index of an earlier release (``<key>.json``) is still read, then kept again
in the binary form (and the JSON file removed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import BinaryIO

from cachefs.client.datasets.shards import ShardIndex
from cachefs.client.datasets.shardtable import ShardTable, ShardTableError, table_from_json

log = logging.getLogger(__name__)

#: Where indexes are kept unless the dataset is told otherwise ("" in it turns keeping off).
ENV_DIR = "CACHEFS_INDEX_CACHE"


def default_dir() -> str:
    configured = os.environ.get(ENV_DIR)
    if configured is not None:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachefs", "shard-index")



def write_whole(directory: str, name: str, write: Callable[[BinaryIO], None]) -> str:
    """``write`` a file ``name`` in ``directory`` as a temporary one renamed into place, so a
    reader (another rank, a DataLoader worker, the next start) sees it whole or not at all; its
    path. Raises OSError (the temporary file removed)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        path = os.path.join(directory, name)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path

class IndexCache:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    @staticmethod
    def key(prefix: str, fmt: str, shards: Sequence[tuple[str, int, str]]) -> str | None:
        """The key of a listing (path, size, version per shard); None when a version is unknown."""
        if any(not version for _, _, version in shards):
            return None
        doc = json.dumps([prefix.rstrip("/"), fmt, sorted(shards)], separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()

    def _file(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.shards")

    def _old_file(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.json")

    def parts_dir(self, key: str) -> str:
        """Where a scan under way writes each shard's index for other processes (shardscan.py)."""
        return os.path.join(self.directory, f"{key}.parts")

    def drop_parts(self, key: str) -> None:
        """The whole index is kept: a scan's per-shard files are no longer needed."""
        shutil.rmtree(self.parts_dir(key), ignore_errors=True)

    def load(self, key: str) -> ShardTable | None:
        path = self._file(key)
        try:
            inode = os.stat(path).st_ino
            return ShardTable.open(path)
        except FileNotFoundError:
            return self._load_old(key)
        except (OSError, ShardTableError) as exc:  # not a whole table: scan again, and keep that
            log.warning("ignoring the kept shard index %s (the shards are scanned again): %s", path, exc)
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:  # not a whole one another process renamed in since
                    os.unlink(path)
            return None

    def _load_old(self, key: str) -> ShardTable | None:
        """An earlier release's JSON file: read, and kept again as a table."""
        path = self._old_file(key)
        try:
            with open(path, "rb") as f:
                table = table_from_json(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable or not ours: scan again
            log.warning("ignoring the kept shard index %s: %s", path, exc)
            return None
        if self.save(key, table, table.format):
            with contextlib.suppress(OSError):
                os.unlink(path)
        return table

    def save(self, key: str, shards: Sequence[ShardIndex] | ShardTable, fmt: str) -> bool:
        """Keep ``shards``' index; a failure (read-only home, full disk) costs only the next scan."""
        table = ShardTable.from_shards(shards, fmt)
        try:
            write_whole(self.directory, os.path.basename(self._file(key)), table.write)
        except OSError as exc:
            log.warning("could not keep the shard index in %s: %s", self.directory, exc)
            return False
        return True
