"""CacheIterableDataset: samples streamed out of shard files (tar, WebDataset style) through cachefs.

    ds = CacheIterableDataset.from_prefix("cachefs://datasets/train-shards/", batch_size=256,
                                          storage_options={"master": "m:19998"}, transform=decode)
    loader = DataLoader(ds, batch_size=256, num_workers=8, pin_memory=True)
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)
        for batch in ds.track(loader):
            ...

Samples are read a **block** (``batch_size`` consecutive samples of one shard) at a time: one
range request through the cache per block, the fields sliced out of it into aligned tensors.
The order, dealing over ranks and DataLoader workers, and resume are BlockPlan's
(sampling.py): each sample once per epoch (up to the padding that gives every rank the same
count), the same order for the same seed and epoch, exact resume at a batch boundary, also with
another number of workers or ranks. Each DataLoader worker prefetches its next blocks (bounded
in bytes) and hints the shards after those to the cache (hints.py), so a cold epoch streams.

A sample is a dict: ``{"__key__": key, "__index__": global sample id, "<field>": uint8 tensor}``
(WebDataset field names: ``jpg``, ``cls``, ...), passed through ``transform`` if given. MosaicML
streaming (MDS) and LitData data sets are read the same way from their own ``index.json``
(foreign.py), their fields being their columns (columns.py).
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from cachefs.client import forksafe
from cachefs.client.datasets.dataset import (ConsumptionTracking, PerProcessParts, ProcessParts, SampleReadError,
                                    rank_and_world, profiled)
from cachefs.client.fs.filesystem import CacheFileSystem, split_storage_options
from cachefs.client.fs.hints import Hinter
from cachefs.client.datasets.indexcache import IndexCache, default_dir
from cachefs.client.stats.jobstats import CounterBlock
from cachefs.client.datasets.prefetch import Prefetcher
from cachefs.client.datasets.runbuffers import RunBuffers
from cachefs.client.datasets.sampling import BlockPlan, known_block
from cachefs.client.datasets.shardscan import ShardScan
from cachefs.client.datasets.columns import Columns, columns_for
from cachefs.client.datasets.epochboard import EpochBoard
from cachefs.client.datasets.foreign import FOREIGN_FORMATS, flavour, foreign_table
from cachefs.client.datasets.shards import FORMATS, ShardFormatError, ShardIndex, index_to_json
from cachefs.client.datasets.shardtable import ShardTable, ShardView, table_from_json

log = logging.getLogger(__name__)

MiB = 1 << 20
#: Two samples' byte spans closer than this are read in one request (tar headers and padding).
MERGE_GAP = 64 << 10


_UNPARSED = object()
#: A block read in the calling thread slower than this (bytes/ns: 1 GB/s, past a fixed 2 ms) came
#: from disk, not from the page cache: blocks are read ahead on the prefetch threads again
#: (_read_block_here). A page-cache read of an 8 MiB block takes 1-3 ms here.
HERE_MIN_BYTES_PER_NS = 1.0
HERE_SLACK_NS = 2_000_000


class CacheIterableDataset(PerProcessParts, ConsumptionTracking, IterableDataset):
    def __init__(self, shards: Sequence[ShardIndex] | ShardTable | ShardScan, *, storage_options: dict[str, Any] | None = None,
                 batch_size: int = 32, transform: Callable[[dict[str, Any]], Any] | None = None, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, prefetch_bytes: int = 64 * MiB, prefetch_blocks: int = 8,
                 prefetch_threads: int = 1, hint_shards: int = 2, timeout: float = 300.0,
                 plan_ahead: bool = True, stats: bool = True, first_epoch_in_order: bool | None = None,
                 decode: bool = False) -> None:
        """``prefetch_threads``: threads reading this process's next blocks; one keeps a block in
        flight while the worker fetches whole shards ahead by the plan, and a second competed with
        the reading thread for the two cores measured here (warm 43 against 78 us a sample, cold
        1,734-1,842 against 1,549-1,623 samples/s; docs/performance.md).
        ``first_epoch_in_order``: epoch 0 reads the shards in file order (blocks shuffled within),
        as it must while they are indexed on the way; the default for shards without an index file
        (``from_prefix``), so that every rank deals the same order whether its host kept an index.
        ``decode``: MDS and LitData columns of plain data (numbers, text, JSON, numpy) as values,
        not bytes (columns.py); never unpickles."""
        self.decode = bool(decode)
        self._columns: Columns | None = None  # a foreign sample's column splitter (_set_shards)
        # Shards still being indexed (from_prefix without an index: shardscan.py): the first epoch
        # reads them in file order as they become known; what needs all of them waits.
        self._scan = shards if isinstance(shards, ShardScan) else None
        # Every sample's key and fields in arrays of one shared buffer (shardtable.py), not objects.
        self._shards: Any = [] if self._scan is not None else ShardTable.from_shards(shards)  # type: ignore[arg-type]
        self._first_in_order = self._scan is not None if first_epoch_in_order is None else bool(first_epoch_in_order)
        if self._scan is not None:
            columns_for("tar", {}, self.decode)  # shards scanned are tar: decode=True is refused
        if self._scan is not None and not self._first_in_order:
            raise ValueError("shards indexed on the way are read in file order in the first epoch")
        if self._scan is None and not self._shards:
            raise ValueError("a CacheIterableDataset needs at least one shard")
        self.storage_options = dict(storage_options or {})
        self.transform = transform
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.block, self.seed, self.shuffle, self.drop_last = int(batch_size), int(seed), bool(shuffle), bool(drop_last)
        self.prefetch_bytes, self.prefetch_blocks = int(prefetch_bytes), int(prefetch_blocks)
        self.prefetch_threads, self.hint_shards, self.timeout = int(prefetch_threads), int(hint_shards), float(timeout)
        self._epoch = 0
        self._plan: BlockPlan | None = None
        if self._scan is None:
            self._set_shards(self._shards, ordered=self._first_in_order)
        else:
            self.counts, self._starts = (), np.zeros(1, dtype=np.int64)
            self._index = (self._shards, self._starts)
        self.samples_seen = 0
        self._iter_from = self._yielded = 0  # where this process's last iteration started, and its count
        self._worker_resume: tuple[int, int, int] | None = None
        self._board, self._board_seen = EpochBoard.make(), 0
        self._local = self._new_local()
        # before any DataLoader worker starts (jobstats.py); stats=False: no block, nothing published
        self._counters = CounterBlock() if stats else CounterBlock("")
        self.learn_cluster()
        self.plan_ahead, self._owner_pid = bool(plan_ahead), forksafe.pid()
        if self._scan is None:
            self.publish_plan()

    # -- shards, and the plan over them ---------------------------------------------------------------
    def _set_shards(self, shards: Sequence[ShardIndex] | ShardTable, ordered: bool) -> None:
        self._shards = ShardTable.from_shards(shards)
        self._columns = columns_for(self._shards.format, self._shards.meta, self.decode)
        self.counts = tuple(self._shards.counts.tolist())
        self._starts = self._shards.starts
        self._index = (self._shards, self._starts)
        self._plan = BlockPlan(self.counts, self.block, self.rank, self.world_size, self.seed, self._epoch,
                               self.shuffle, self.drop_last, ordered=ordered)

    @property
    def shards(self) -> ShardTable:
        """Every shard's index (each a ``ShardView``, read as a ``ShardIndex``); while shards are
        still being indexed, this waits for all of them."""
        if self._scan is not None:
            self._scan_complete()
        return self._shards

    @property
    def plan(self) -> BlockPlan:
        """The epoch's BlockPlan; while shards are still being indexed, this waits for all of them."""
        if self._scan is not None:
            self._scan_complete()
        return self._plan  # type: ignore[return-value]

    @plan.setter
    def plan(self, plan: BlockPlan) -> None:
        self._plan = plan

    def _scan_complete(self) -> None:
        scan = self._scan
        if scan is None:
            return
        shards = scan.wait_all(self.timeout)
        if self._scan is scan:  # another thread may have got here first: the same result
            self._set_shards(shards, ordered=self._epoch == 0)  # the order the epoch started in
            self._scan = None
            self.publish_plan()

    def _scanned_block(self, j: int, wait: bool) -> np.ndarray | None:
        """Block ``j``'s sample ids from the shards indexed so far (``wait``: until they cover it),
        or None when only the whole plan can tell (its last round, past the end, or all known)."""
        scan = self._scan
        if scan is None:
            return None
        need = (j + 1) * self.world_size * self.block
        known = scan.wait_samples(need, self.timeout) if wait else scan.known()[1]
        if known < need or scan.done:
            return None
        return known_block(j, self.block, self.rank, self.world_size, self.seed, self._epoch, self.shuffle)

    def _block_ids(self, j: int) -> np.ndarray:
        ids = self._scanned_block(j, wait=False) if self._scan is not None else None
        return ids if ids is not None else self.plan.block_samples(j)

    def _cache_prefetch(self) -> bool:
        return self.hint_shards > 0

    def _plan_units(self) -> Sequence[tuple[str, int, int]]:
        return self.shards.units()

    def _plan_order(self) -> np.ndarray:
        after = BlockPlan(self.counts, self.block, self.rank, self.world_size, self.seed, self.plan.epoch + 1,
                          self.shuffle, self.drop_last)
        return np.concatenate([self.plan.rank_order()[self.samples_seen:], after.rank_order()])

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def from_index(cls, url: str, *, storage_options: dict[str, Any] | None = None, **kwargs: Any
                   ) -> "CacheIterableDataset":
        """Shards and samples from an index file: ``index.json`` as ``write_tar_shards`` writes,
        or as MosaicML streaming (MDS shards) or LitData (pytree chunks) write theirs (foreign.py)."""
        storage_options, kwargs = split_storage_options(storage_options, kwargs, own=cls.__init__)
        return cls(cls._index_table(url, storage_options), storage_options=storage_options, **kwargs)

    @classmethod
    def _index_table(cls, url: str, storage_options: dict[str, Any] | None,
                     listing: dict[str, Any] | None = None) -> ShardTable:
        """The table of index file ``url``; ``listing``: ``find(detail=True)`` of the directory
        (taken here for a foreign index, whose shards' sizes are checked against it)."""
        base = url.rsplit("/", 1)[0]
        fs = cls._filesystem(dict(storage_options or {}))
        try:
            text = fs.cat_file(url)
            try:
                doc = json.loads(text)
                kind = flavour(doc)
            except ValueError as exc:
                raise ValueError(f"{url}: {exc}") from None
            if kind not in FOREIGN_FORMATS:
                del text
                return table_from_json(doc, base=base)
            if listing is None:
                listing = fs.find(base, detail=True)
            sizes = {name: int(info["size"]) for name, info in listing.items()}
            return foreign_table(doc, url, base, lambda path, off, n: fs.cat_file(path, off, off + n), sizes)
        finally:
            fs.close()

    @classmethod
    def from_prefix(cls, url: str, *, storage_options: dict[str, Any] | None = None, format: str = "tar",
                    index: str | None = "index.json", index_cache: str | None = None,
                    **kwargs: Any) -> "CacheIterableDataset":
        """The shards below ``url``: from its ``index`` file when there is one (cachefs's, or a
        MosaicML streaming or LitData ``index.json``: foreign.py), else by scanning every
        ``*.<format>`` object once (read through the cache, several shards at a time).

        A scanned index is kept in ``index_cache`` (default: ``$CACHEFS_INDEX_CACHE``, else
        ``~/.cache/cachefs/shard-index``; ``""``: not kept) under the shards' paths, sizes and
        versions, so the next start over the same shards needs no scan (indexcache.py)."""
        storage_options, kwargs = split_storage_options(storage_options, kwargs, own=cls.__init__)
        fs = cls._filesystem(dict(storage_options or {}))
        try:
            entries = fs.find(url, detail=True)
        finally:
            fs.close()
        base = url.rstrip("/")
        names = {name.rsplit("/", 1)[-1]: name for name in entries}
        if index and index in names:
            table = cls._index_table(f"cachefs://{names[index]}", storage_options, entries)
            return cls(table, storage_options=storage_options, **kwargs)
        listed = sorted((f"cachefs://{n}", int(i["size"]), str(i.get("version") or "")) for n, i in entries.items()
                        if n.endswith("." + format) and i.get("type", "file") == "file")
        if not listed:
            raise FileNotFoundError(f"no index and no .{format} shards below {base}")
        kept = IndexCache(default_dir() if index_cache is None else index_cache)
        key = IndexCache.key(base, format, listed) if kept.directory else None
        shards = kept.load(key) if key else None
        # Whether each host scans, kept an index or scans on the way, every rank reads the first
        # epoch in the same (file) order: the one a scan on the way needs.
        kwargs.setdefault("first_epoch_in_order", True)
        if shards is not None:
            kept.drop_parts(key)  # type: ignore[arg-type]
            return cls(shards, storage_options=storage_options, **kwargs)
        paths = [(path, size) for path, size, _ in listed]
        if key is None:  # nowhere to share shards' indexes with DataLoader workers: all of them first
            return cls(scan_shards(paths, storage_options, format), storage_options=storage_options, **kwargs)
        # Indexed on the way (shardscan.py): the first batch after about the first shard's fetch.
        indexer = _ShardIndexer(storage_options, format)

        def done(shards: list[ShardView]) -> None:
            kept.save(key, shards, format)
            indexer.close()
        scan = ShardScan(paths, indexer, kept.parts_dir(key), on_done=done)
        return cls(scan.start(), storage_options=storage_options, **kwargs)

    def index_json(self, base: str = "") -> str:
        """This dataset's index, to save (e.g. beside the shards) so the next start needs no scan."""
        if self.shards.format in FOREIGN_FORMATS:  # its columns are in its own index, not in cachefs's
            raise ValueError(f"a {self.shards.format} data set's index is the one its writer wrote")
        return index_to_json(self.shards, base)

    # -- pickling and per-process state ---------------------------------------------------------------
    def _build_parts(self) -> ProcessParts:
        fs = self._process_filesystem()
        prefetcher = Prefetcher(self._read_block, self._block_bytes, max_bytes=self.prefetch_bytes,
                                max_depth=self.prefetch_blocks, threads=self.prefetch_threads, timeout=self.timeout)
        # Blocks in flight (the prefetch window) and the one being handed out, reused (runbuffers.py).
        return self._parts(fs, prefetcher)._replace(buffers=RunBuffers(self.prefetch_bytes + 32 * MiB))

    def _process(self) -> tuple[CacheFileSystem, Prefetcher, Hinter]:
        return self._local.get()  # type: ignore[return-value]

    @property
    def prefetcher(self) -> Prefetcher:
        return self._process()[1]

    @property
    def hinter(self) -> Hinter:
        return self._process()[2]

    # -- reading -------------------------------------------------------------------------------------
    def _index_covering(self, ids: Sequence[int]) -> tuple[Any, np.ndarray]:
        """(shards, their start ids) covering ``ids``: one consistent view, whatever other threads
        learn meanwhile; while shards are being indexed, taken anew from the scan when short (a
        list of ``ShardIndex`` then, else the ``ShardTable``)."""
        index = self._index
        scan = self._scan
        if scan is not None and len(ids) and max(ids) >= index[1][-1]:
            shards = scan.known_shards()  # grows only; holds every id a known block has
            index = (shards, np.concatenate([[0], np.cumsum([len(s) for s in shards], dtype=np.int64)]))
            if len(shards) > len(self._index[0]):
                self._index = index  # a cache for the next block; never needed to be right
        return index

    @staticmethod
    def _locate_in(starts: np.ndarray, sample: int) -> tuple[int, int]:
        shard = bisect.bisect_right(starts, sample) - 1  # type: ignore[arg-type]
        return shard, sample - int(starts[shard])

    def _locate(self, sample: int) -> tuple[int, int]:
        return self._locate_in(self._index_covering([sample])[1], sample)

    @staticmethod
    def _bounds(shards: Any, starts: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each of ``ids``' shard, and its byte span [lo, hi) within that shard."""
        which = np.searchsorted(starts, ids, "right") - 1
        if isinstance(shards, ShardTable):
            return (which, *shards.bounds(ids))
        lo, hi = np.zeros(len(ids), np.int64), np.zeros(len(ids), np.int64)
        for s in np.unique(which).tolist():  # shards indexed on the way: a table each (shardscan.py)
            mine = which == s
            lo[mine], hi[mine] = shards[s].bounds(ids[mine] - starts[s])
        return which, lo, hi

    def _block_bytes(self, j: int) -> int:
        if self._scan is None:  # the whole index known: the block's members, in any order
            start, end = self.plan.block_span(j)
            return self._shards.sample_bytes(self.plan.order[start:end])
        ids = np.asarray(self._block_ids(j), dtype=np.int64)
        shards, starts = self._index_covering(ids.tolist())
        _, lo, hi = self._bounds(shards, starts, ids)
        return int((hi - lo).sum())

    def _block_runs(self, j: int) -> tuple[list[int], Any, list[tuple[int, int]], np.ndarray,
                                            list[tuple[int, int, int]]]:
        """Block ``j``'s sample ids, the shards covering them, each sample's (shard, member) and
        start within its shard, and the runs of nearby samples read in one range each:
        (shard, start, end)."""
        ida = np.asarray(self._block_ids(j), dtype=np.int64)
        ids = ida.tolist()
        shards, starts = self._index_covering(ids)
        which, lo, hi = self._bounds(shards, starts, ida)
        where = list(zip(which.tolist(), (ida - starts[which]).tolist()))
        runs: list[tuple[int, int, int]] = []  # (shard, start, end)
        for k in np.lexsort((lo, which)).tolist():  # by shard, then start
            shard, a, b = int(which[k]), int(lo[k]), int(hi[k])
            if runs and runs[-1][0] == shard and a - runs[-1][2] <= MERGE_GAP:
                runs[-1] = (shard, runs[-1][1], max(runs[-1][2], b))
            else:
                runs.append((shard, a, b))
        return ids, shards, where, lo, runs

    @staticmethod
    def _run_tensor(parts: ProcessParts, n: int) -> torch.Tensor:
        # One aligned tensor per run; fields are views of it (tar data starts on 512-byte
        # boundaries, so every view is 64-byte aligned too): one copy per run, not per field.
        pool = parts.buffers
        return pool.take(n) if pool is not None else torch.empty(n, dtype=torch.uint8)

    @staticmethod
    def _samples_of(ids: list[int], shards: Any, where: list[tuple[int, int]], lo: np.ndarray,
                    buffers: dict[int, list[tuple[int, torch.Tensor]]],
                    columns: Columns | None = None) -> list[dict[str, Any]]:
        out = []
        if isinstance(shards, ShardTable):  # by global id, the block's columns at once
            entries = shards.entries(ids)
        else:  # shards indexed on the way: a table each (shardscan.py)
            entries = [(shards[s].key(i), shards[s].fields(i)) for s, i in where]
        for sample, (shard, i), start, (key, fields) in zip(ids, where, lo.tolist(), entries):
            # runs never overlap: the one holding the sample's start holds all of it
            base, run = next((s, t) for s, t in buffers[shard] if s <= start < s + max(1, len(t)))
            item: dict[str, Any] = {"__key__": key, "__index__": sample}
            for name, offset, size in fields:
                if columns is not None:  # MDS, LitData: one field, the whole sample (foreign.py)
                    try:
                        item.update(columns.split(run[offset - base:offset - base + size],
                                                  lambda: f"shard {shards[shard].path!r}, sample {i}"))
                    except ShardFormatError as exc:
                        raise SampleReadError(str(exc)) from exc
                else:
                    item[name] = run[offset - base:offset - base + size]
            out.append(item)
        return out

    def _read_block(self, j: int) -> list[dict[str, Any]]:
        """Block ``j``'s samples: each run of nearby samples of a shard in one range read."""
        parts = self._local.get()
        fs = parts.fs
        ids, shards, where, lo, runs = self._block_runs(j)
        buffers: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for shard, start, end in runs:
            run = self._run_tensor(parts, end - start)
            try:
                with profiled("cachefs.read_into"):
                    got, _ = fs.read_into(shards[shard].path, run.numpy(), offset=start)
            except Exception as exc:
                raise SampleReadError(f"cannot read bytes {start}-{end} of shard {shards[shard].path!r} "
                                      f"(block {j} of rank {self.rank}, epoch {self._epoch}): "
                                      f"{type(exc).__name__}: {exc}") from exc
            if got != end - start:
                raise SampleReadError(f"shard {shards[shard].path!r} is shorter than its index says: "
                                      f"{got} of {end - start} bytes at {start}")
            buffers.setdefault(shard, []).append((start, run))
        return self._samples_of(ids, shards, where, lo, buffers, self._columns)

    def _read_block_here(self, parts: ProcessParts, j: int) -> list[dict[str, Any]] | None:
        """Block ``j`` read in this thread from page files of a worker on this host (descriptors
        held, or opened by name), with no message and no hand-off to a prefetch thread; None if
        any of it is not there (not cached, not local): read it the usual way then.

        A warm epoch is read so, as a local-files loader reads: on two cores a prefetch thread
        copying the next block competed with the collate's second thread and the training loop
        for the cores (a workers-0 tar epoch ~12% slower through the prefetch threads).
        """
        ids, shards, where, lo, runs = self._block_runs(j)
        fs, cps = parts.fs, parts.cache_paths
        reads = []
        for shard, start, end in runs:
            path = shards[shard].path
            cp = cps.get(path, _UNPARSED)
            if cp is _UNPARSED:
                cp = cps[path] = fs._path(path)
            if cp is None:
                return None
            reads.append((cp, self._run_tensor(parts, end - start)))
        try:
            with profiled("cachefs.held_reads"):
                got = fs.session.read_held([(cp, run.numpy()) for cp, run in reads], offsets=[r[1] for r in runs])
        except Exception:  # noqa: BLE001 - only a shortcut: the usual way reports what is wrong
            return None
        buffers: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (shard, start, end), (_cp, run), one in zip(runs, reads, got):
            if one is None or one[0] != end - start:
                return None
            buffers.setdefault(shard, []).append((start, run))
        return self._samples_of(ids, shards, where, lo, buffers, self._columns)

    def _hint_after(self, blocks: range, k: int) -> None:
        """Hint the shards of this worker's blocks after the prefetch window (once each per epoch)."""
        if self.hint_shards <= 0 or self._plan_prefetch:  # the workers prefetch by the registered plan
            return
        fs, _, hinter = self._process()[:3]
        stripe = fs.session.stripe_size
        shards: list[str] = []
        biggest = 0
        for j in blocks[k + self.prefetch_blocks:]:
            for sample in (self.plan.block_span(j)[0], self.plan.block_span(j)[1] - 1):
                shard = self._shards[self._locate(int(self.plan.order[sample]))[0]]
                # Load brings a whole object to one worker: only worth it within one stripe.
                if shard.path not in shards and shard.size <= stripe:
                    shards.append(shard.path)
                    biggest = max(biggest, shard.size)
            if len(shards) >= self.hint_shards:
                break
        limit = self.hint_shards
        if self._hint_budget >= 0 and shards:  # never hint more than the workers can keep for this job
            limit = min(limit, int(self._hint_budget // max(1, biggest)))
        if shards and limit > 0:
            hinter.hint(shards[:limit])

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if info is not None:
            self._follow_board()  # a persistent worker's copy may be epochs behind
        if self._scan is not None and self.samples_seen == 0 and self._worker_resume is None:
            yield from self._iter_scanning(worker, workers)
            return
        first, skip = divmod(self.samples_seen, self.block)
        blocks = self.plan.worker_blocks(worker, workers, first)
        # Resumed from a DataLoader worker's own state (StatefulDataLoader): skip what it yielded.
        own = self._worker_resume
        skip_own = own[2] if own is not None and own[:2] == (worker, workers) else 0
        self._iter_from, self._yielded = self.samples_seen, 0
        parts = self._local.get()
        k0 = 0
        while skip_own and k0 < len(blocks):
            start, end = self.plan.block_span(blocks[k0])
            size = end - start - (skip if blocks[k0] == first else 0)
            if size > skip_own:
                break
            skip_own -= size
            self._yielded += size
            k0 += 1
        # Blocks read here while all of them are cached, in the training process itself (workers
        # 0). A DataLoader worker keeps reading ahead on its prefetch threads: that overlaps its
        # reads with handing each batch to the main process (A/B in docs/performance.md).
        here = info is None and parts.fs.session.config.short_circuit
        for k in range(k0, len(blocks)):
            j = blocks[k]
            t0 = time.perf_counter_ns()
            samples = None
            if here and not parts.prefetcher.has(j):
                self._note_progress(parts, j * self.block)
                samples = self._read_block_here(parts, j)
                # Not all cached (a cold epoch), or read as slowly as a disk reads (pages out of
                # the page cache: reads ahead on the prefetch threads overlap it with the
                # training step): the prefetch threads read from here on, this epoch.
                here = samples is not None and \
                    time.perf_counter_ns() - t0 <= HERE_SLACK_NS + self._block_bytes(j) / HERE_MIN_BYTES_PER_NS
                if not here:
                    self._hint_after(blocks, k)
            elif (k - k0) % max(1, self.prefetch_blocks // 2) == 0:  # cached blocks need no hints
                self._hint_after(blocks, k)
            if samples is None:
                samples = self._get_block(parts, j, iter(blocks[k + 1:]))
            if j == first and skip:  # resumed inside this block (same world size only)
                samples = samples[skip:]
            if k == k0 and skip_own:
                self._yielded += skip_own
                samples, skip_own = samples[skip_own:], 0
            self._account(parts, len(samples), t0)  # counted as read (jobstats.py)
            for sample in samples:
                self._yielded += 1
                yield self.transform(sample) if self.transform is not None else sample

    def _get_block(self, parts: ProcessParts, j: int, upcoming: Iterator[int]) -> list[dict[str, Any]]:
        self._note_progress(parts, j * self.block)  # block j starts there in this rank's order
        try:
            with profiled("cachefs.read_block"):
                return parts.prefetcher.get(j, upcoming)
        except SampleReadError:
            raise
        except Exception as exc:
            raise SampleReadError(f"cannot read block {j} of rank {self.rank}, epoch {self._epoch}: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def _iter_scanning(self, worker: int, workers: int) -> Iterator[Any]:
        """The first epoch while its shards are still being indexed (see _scanning_blocks)."""
        self._iter_from, self._yielded = 0, 0
        parts = self._local.get()
        for j, upcoming in self._scanning_blocks(worker, max(1, workers)):
            t0 = time.perf_counter_ns()
            samples = self._get_block(parts, j, upcoming)
            self._account(parts, len(samples), t0)
            for sample in samples:
                self._yielded += 1
                yield self.transform(sample) if self.transform is not None else sample

    def _scanning_blocks(self, worker: int, step: int) -> Iterator[tuple[int, Iterator[int]]]:
        """This worker's blocks with those to prefetch after each: a block as soon as the shards
        before it are known (in file order), and once all are, the rest of the whole plan."""
        j = worker
        while self._scanned_block(j, wait=True) is not None:
            yield j, self._known_after(j, step)
            j += step
        blocks = range(j, self.plan.n_blocks, step)
        for k, j in enumerate(blocks):
            yield j, iter(blocks[k + 1:])

    def _known_after(self, j: int, step: int) -> Iterator[int]:
        """Blocks after ``j`` (every ``step``-th) that are known now: prefetch them; never waits."""
        while True:
            j += step
            if self._scanned_block(j, wait=False) is None:
                return
            yield j

    def __len__(self) -> int:
        """Samples this rank yields from where it stands (the whole epoch unless resumed)."""
        return len(self.plan) - self.samples_seen

    # -- epochs and resume ---------------------------------------------------------------------------
    def track(self, loader: Iterable[Any]) -> Iterator[Any]:
        """As CacheDataset.track; batch i of the loader is block i, so the count is exact."""
        workers = getattr(loader, "num_workers", 0)
        batch_size = getattr(loader, "batch_size", None)
        if workers and batch_size != self.block:
            raise ValueError(f"with DataLoader workers, track() needs the loader's batch_size ({batch_size}) "
                             f"equal to the dataset's ({self.block}): a batch must be one block")
        if not workers:
            yield from super().track(loader)
            return
        first = self.samples_seen // self.block
        j = first
        for batch in loader:
            start, end = self._block_span(j)
            done = (self.samples_seen % self.block) if j == first else 0
            self.samples_seen += end - start - done
            j += 1
            yield batch

    def _block_span(self, j: int) -> tuple[int, int]:
        if self._scanned_block(j, wait=False) is not None:  # a full round: no need to wait for all shards
            start = (j * self.world_size + self.rank) * self.block
            return start, start + self.block
        return self.plan.block_span(j)

    def _consumed(self, n: int) -> None:
        scan = self._scan
        if scan is not None and self.samples_seen + n <= scan.known()[1] // self.world_size:
            self.samples_seen += n  # within what this rank reads for sure: no need to wait for all shards
            return
        super()._consumed(n)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order; progress resets only when the epoch changes."""
        if int(epoch) == self._epoch:
            return
        self._enter_epoch(int(epoch))
        self._post({"epoch": int(epoch)})
        self.publish_plan()

    def _enter_epoch(self, epoch: int) -> None:
        self._scan_complete()
        self._epoch = epoch
        self.plan = BlockPlan(self.counts, self.block, self.rank, self.world_size, self.seed, epoch,
                              self.shuffle, self.drop_last, ordered=self._epoch == 0 and self._first_in_order)
        self.samples_seen = self._iter_from = self._yielded = 0
        self._worker_resume = None
        self._reset()

    def _take_decision(self, decision: dict[str, Any]) -> None:
        if "state" in decision:
            self._load(decision["state"])
        elif "epoch" in decision and int(decision["epoch"]) != self._epoch:
            self._enter_epoch(int(decision["epoch"]))

    @property
    def epoch(self) -> int:
        return self._epoch

    def _reset(self) -> None:
        parts = self._local.peek()
        if parts is not None:
            parts.prefetcher.reset()
            parts.hinter.reset()

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is. In a DataLoader worker (torchdata's StatefulDataLoader asks each
        worker), where that worker is: what it yielded of its own blocks since the loader started."""
        info = get_worker_info()
        if info is not None:
            return {**self._state(self._iter_from), "worker": info.id, "num_workers": info.num_workers,
                    "worker_yielded": self._yielded}
        return self._state(max(self.samples_seen, self._iter_from + self._yielded))

    def _state(self, samples_seen: int) -> dict[str, Any]:
        """The plan's state; while shards are being indexed, the same without the sample count
        (-1: not known yet), so a checkpoint (or StatefulDataLoader's snapshot of each worker)
        does not wait for every shard."""
        scan = self._scan
        if scan is None:
            return self.plan.state(samples_seen)
        return {**BlockPlan((), self.block, 0, self.world_size, self.seed, self._epoch, self.shuffle,
                            self.drop_last, ordered=True).state(samples_seen),
                "n_samples": -1, "n_shards": len(scan.listed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a rank's: any worker count or world size, see BlockPlan; a
        worker's, from StatefulDataLoader: the same worker count, as torchdata requires)."""
        self._load(state)
        self._post({"state": state})
        self.publish_plan()

    def _load(self, state: dict[str, Any]) -> None:
        self._scan_complete()
        self.plan, self.samples_seen = BlockPlan.resume(
            state, counts=self.counts, block=self.block, rank=self.rank, world_size=self.world_size,
            shuffle=self.shuffle, drop_last=self.drop_last)
        self.seed, self._epoch = int(state["seed"]), self.plan.epoch
        self._worker_resume = ((int(state["worker"]), int(state["num_workers"]), int(state["worker_yielded"]))
                               if "worker" in state else None)
        self._iter_from, self._yielded = self.samples_seen, 0
        self._reset()


class _ShardIndexer:
    """Indexes one shard at a time by reading it through the cache (bringing it into the cache)."""

    def __init__(self, storage_options: dict[str, Any] | None, format: str) -> None:
        self.format = FORMATS[format]
        self.fs = CacheFileSystem(skip_instance_cache=True, **{"scan_ahead": False, **dict(storage_options or {})})

    def __call__(self, path: str, size: int) -> ShardIndex:
        samples = self.format.scan(lambda off, n: self.fs.cat_file(path, off, off + n), size)
        return ShardIndex(path, size, tuple(samples))

    def close(self) -> None:
        self.fs.close()


def scan_shards(paths: Sequence[tuple[str, int]], storage_options: dict[str, Any] | None = None,
                format: str = "tar", threads: int = 8) -> list[ShardIndex]:
    """Index shards by reading each once through the cache (which also brings it into the cache)."""
    indexer = _ShardIndexer(storage_options, format)
    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(lambda item: indexer(*item), paths))
    finally:
        indexer.close()
