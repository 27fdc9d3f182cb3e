"""Shard indexes kept between runs, so tar shards without an index file are scanned once.

``CacheIterableDataset.from_prefix`` over shards with no ``index.json`` reads every shard once to
find its samples (shards.py). That is the cold fetch the first epoch needs anyway, but a job
that restarts (a preemption, the next run of an experiment) would pay it again at every start.
The scanned index is kept in a local directory, under a key made of the prefix, the format and
every shard's path, size and version: a shard that changed in the store (a new version) gives a
new key and is scanned again, so a kept index never describes other bytes. A shard without a
version (a store that reports none) is never kept. Written tmp + rename: ranks on one host that
scan at once leave one whole file, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence

from cachefs.client.datasets.shards import ShardIndex, index_from_json, index_to_json

log = logging.getLogger(__name__)

#: Where indexes are kept unless the dataset is told otherwise ("" in it turns keeping off).
ENV_DIR = "CACHEFS_INDEX_CACHE"


def default_dir() -> str:
    configured = os.environ.get(ENV_DIR)
    if configured is not None:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachefs", "shard-index")


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
        return os.path.join(self.directory, f"{key}.json")

    def parts_dir(self, key: str) -> str:
        """Where a scan under way writes each shard's index for other processes (shardscan.py)."""
        return os.path.join(self.directory, f"{key}.parts")

    def drop_parts(self, key: str) -> None:
        """The whole index is kept: a scan's per-shard files are no longer needed."""
        shutil.rmtree(self.parts_dir(key), ignore_errors=True)

    def load(self, key: str) -> list[ShardIndex] | None:
        try:
            with open(self._file(key), "rb") as f:
                return index_from_json(f.read())[1]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable or not ours: scan again
            log.warning("ignoring the kept shard index %s: %s", self._file(key), exc)
            return None

    def save(self, key: str, shards: Sequence[ShardIndex], fmt: str) -> None:
        """Keep ``shards``' index; a failure (read-only home, full disk) costs only the next scan."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(index_to_json(shards, fmt=fmt))
                os.replace(tmp, self._file(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("could not keep the shard index in %s: %s", self.directory, exc)
