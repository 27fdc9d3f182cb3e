"""Shards indexed on the way: the first epoch over tar shards without an index need not wait.

``CacheIterableDataset.from_prefix`` over shards with no index file must read every shard once to
find its samples. Done before the first batch, that is the whole data set's fetch (the store's
throughput, seconds to minutes) before anything is read. Instead the process that makes the
dataset starts a ``ShardScan``: a few threads index the shards **in file order** through the
cache (which fetches each in one request and keeps it for the reads that follow), and the first
epoch reads its shards in that same order (``BlockPlan(ordered=True)``), so a block is known as
soon as the shards before it are: the first batch comes after about one shard's fetch.

Each shard's index is also written to ``directory`` as it is done (tmp + rename, one small file a
shard), where other processes (DataLoader workers, which get this object pickled) find it: they
wait for files, polling with a growing pause, within the dataset's timeout. A shard that cannot
be indexed is an error every waiter sees (``ShardScanError``), in every process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cachefs.client import forksafe
from cachefs.client.datasets.indexcache import write_whole
from cachefs.client.datasets.shards import ShardIndex, index_to_json
from cachefs.client.datasets.shardtable import ShardView, one_shard, table_from_json

log = logging.getLogger(__name__)

__all__ = ["ShardScan", "ShardScanError"]

#: Waiting for another process's scan: pauses between looks at the directory.
_POLL_FIRST, _POLL_MAX = 0.005, 0.1


class ShardScanError(OSError):
    """A shard could not be indexed (unreadable, not a valid shard)."""


class ShardScan:
    """The indexes of ``listed`` shards, in file order, as they become known."""

    def __init__(self, listed: Sequence[tuple[str, int]], scan_one: Callable[[str, int], ShardIndex],
                 directory: str, threads: int = 2,
                 on_done: Callable[[list[ShardView]], None] | None = None) -> None:
        """``scan_one(path, size)`` indexes one shard (in the process that ``start``s the scan);
        ``on_done(shards)`` runs there once all are known (e.g. keep the whole index)."""
        if not listed:
            raise ValueError("no shards to scan")
        self.listed = [(str(p), int(s)) for p, s in listed]
        self.directory = directory
        self.threads = max(1, int(threads))
        self._scan_one, self._on_done = scan_one, on_done
        self._known: list[ShardView | None] = [None] * len(self.listed)
        self._error: str | None = None
        self._prefix = 0  # shards known in order from the first
        self._samples = 0  # samples in those
        self._changed = threading.Condition()
        self._owner = False
        self._pid = forksafe.pid()

    def _here(self) -> None:
        """A forked child (a DataLoader worker) has this object but not the scanning threads, and
        maybe a lock one of them held: from here on it reads the directory as any other process."""
        if self._pid != forksafe.pid():
            self._pid, self._owner, self._changed = forksafe.pid(), False, threading.Condition()

    # -- pickling: another process reads the directory -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        with self._changed:
            state = self.__dict__.copy()
        state.update(_scan_one=None, _on_done=None, _changed=None, _owner=False, _known=list(self._known))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._changed, self._pid = threading.Condition(), forksafe.pid()

    # -- the scanning process ---------------------------------------------------------------------------
    def start(self) -> "ShardScan":
        """Index every shard in file order, ``threads`` at a time, in the background."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        for name in os.listdir(self.directory):  # an earlier run's failure is not this one's
            if name.endswith(".error"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))
        self._owner, self._pid = True, forksafe.pid()
        threading.Thread(target=self._run, name="cachefs-shard-scan", daemon=True).start()
        return self

    def _run(self) -> None:
        with ThreadPoolExecutor(self.threads, thread_name_prefix="cachefs-shard-scan") as pool:
            futures = [pool.submit(self._one, i) for i in range(len(self.listed))]
            for future in futures:
                future.result()
        if self._error is None and self._on_done is not None:
            try:
                self._on_done(self.known_shards())
            except Exception as exc:  # noqa: BLE001 - keeping the index is only a saving for the next start
                log.warning("could not keep the scanned shard index: %s", exc)

    def _one(self, i: int) -> None:
        if self._error is not None:
            return
        path, size = self.listed[i]
        try:
            shard = one_shard(self._scan_one(path, size))  # compact: no object per sample
        except Exception as exc:  # noqa: BLE001 - every waiter, in every process, sees it
            message = f"cannot index shard {path!r}: {type(exc).__name__}: {exc}"
            self._write(f"{i}.error", message)
            with self._changed:
                self._error = message
                self._changed.notify_all()
            return
        with self._changed:  # known here before any other process can read it
            self._known[i] = shard
            self._advance()
            self._changed.notify_all()
        self._write(f"{i}.json", index_to_json([shard]))

    def _write(self, name: str, text: str) -> None:
        try:
            write_whole(self.directory, name, lambda f: f.write(text.encode()))
        except OSError as exc:  # DataLoader workers would wait in vain: say why
            log.warning("could not write the shard index to %s for other processes: %s", self.directory, exc)

    # -- what is known ---------------------------------------------------------------------------------------
    def _advance(self) -> None:  # caller holds _changed
        known = self._known
        while self._prefix < len(known) and known[self._prefix] is not None:
            self._samples += len(known[self._prefix])  # type: ignore[arg-type]
            self._prefix += 1

    def _look(self) -> None:
        """Another process's scan: take the files written since the last look."""
        while self._prefix < len(self.listed) and self._error is None:
            i = self._prefix
            base = os.path.join(self.directory, str(i))
            try:
                with open(base + ".json", "rb") as f:
                    shard = table_from_json(f.read(), shared=False)[0]
            except FileNotFoundError:
                try:
                    with open(base + ".error") as f:
                        self._error = f.read()
                except FileNotFoundError:
                    pass
                return
            except (OSError, ValueError, KeyError, IndexError) as exc:
                self._error = f"cannot read the index of shard {self.listed[i][0]!r} from {base}.json: {exc}"
                return
            with self._changed:
                self._known[i] = shard
                self._advance()

    @property
    def done(self) -> bool:
        self._here()
        if not self._owner:
            self._look()
        return self._prefix == len(self.listed)

    def known(self) -> tuple[int, int]:
        """(shards, samples) known so far, counted from the first shard in file order."""
        self._here()
        if not self._owner:
            self._look()
        with self._changed:
            return self._prefix, self._samples

    def known_shards(self) -> list[ShardView]:
        self._here()
        with self._changed:
            return list(self._known[:self._prefix])  # type: ignore[arg-type]

    def wait_samples(self, n: int, timeout: float) -> int:
        """Samples known once the shards in order hold at least ``n`` (or all are known)."""
        deadline = time.monotonic() + timeout
        pause = _POLL_FIRST
        while True:
            _, samples = self.known()
            if samples >= n or self._prefix == len(self.listed):
                return samples
            if self._error is not None:
                raise ShardScanError(self._error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"shards were not indexed within {timeout:.0f} s "
                                   f"({self._prefix} of {len(self.listed)} known)")
            if self._owner:
                with self._changed:
                    if self._samples < n and self._prefix < len(self.listed) and self._error is None:
                        self._changed.wait(min(left, 1.0))
            else:
                time.sleep(min(left, pause))
                pause = min(_POLL_MAX, pause * 2)

    def wait_all(self, timeout: float) -> list[ShardView]:
        self.wait_samples(1 << 62, timeout)
        return self.known_shards()
