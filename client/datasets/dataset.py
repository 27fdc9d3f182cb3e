"""CacheDataset: a map-style torch Dataset that reads samples (one object each) through cachefs.

    ds = CacheDataset.from_prefix("cachefs://datasets/train/", storage_options={"master": "m:19998"},
                                  transform=decode)
    loader = DataLoader(ds, batch_size=256, sampler=ds.sampler(), num_workers=8, pin_memory=True)
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)
        for batch in ds.track(loader):          # counts consumed samples for state_dict()
            ...
            save({"data": ds.state_dict(), ...})

Index ``i`` is a **position in this rank's epoch order** (see sampling.py), not an index into
``paths``: ``len(ds)`` is this rank's sample count, ``ds[i]`` reads ``paths[ds.plan.sample(i)]``,
and the DataLoader's default sequential order already is the shuffled, sharded epoch order.
Positions are unique even where padding repeats a sample, so a DataLoader worker that is asked
for position i knows exactly which positions it will be asked for next, and prefetches them.
``ds.read(sample_index)`` reads by index into ``paths``.

The filesystem and the prefetcher are made lazily in each process (DataLoader workers included)
from ``storage_options``; nothing made in the parent is used after a fork or a pickle.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from cachefs.client import forksafe
from cachefs.client.fs.filesystem import CacheFileSystem, split_storage_options
from cachefs.client.forksafe import ProcessLocal
from cachefs.client.fs.hints import Hinter
from cachefs.client.stats.jobstats import CounterBlock, ProcessCounts, describe
from cachefs.client.datasets.plans import PlanPublisher, PlanReport
from cachefs.client.datasets.prefetch import Prefetcher
from cachefs.client.datasets.runbuffers import RunBuffers
from cachefs.client.datasets.epochboard import EpochBoard
from cachefs.client.datasets.liststream import GrowingIndex, Listing, StreamingPlan
from cachefs.client.datasets.manifests import manifest_index
from cachefs.client.datasets.prefixindex import MODES as KEPT_MODES, open_prefix
from cachefs.client.datasets.sampleindex import IndexBuilder, SampleIndex
from cachefs.client.datasets.sampling import EpochPlan, tag_epoch, untag
from cachefs.order import plan_digest
from cachefs.paths import PROTOCOL
from cachefs.client.transport.session import SessionBootstrap
from cachefs.client.transport.shortcircuit import Prepared

log = logging.getLogger(__name__)

MiB = 1 << 20
#: Parsed paths a process keeps (~250 bytes each): a data set up to this size is parsed once per
#: process (beyond, parse_path's own cache of 65,536, then ~4 us a sample), never held whole in
#: every DataLoader worker.
PARSED_PATHS = 1 << 14
_UNPARSED = object()
_URL_PREFIX = f"{PROTOCOL}://"


class ProcessParts(NamedTuple):
    """What a dataset reads with in one process."""

    fs: CacheFileSystem
    prefetcher: Prefetcher
    hinter: Hinter
    # sample -> its parsed path (None: read through fs by URL), parsed once per process
    cache_paths: dict[int, Any]
    # "next": the side job getting the next batch's page handles (see _read_held_batch)
    ahead: dict[str, tuple[Future, int]]  # the next batch's prepare, and how many it asked for
    counts: ProcessCounts  # samples and time counted by the dataset itself (jobstats.py)
    buffers: RunBuffers | None = None  # reused run buffers (the iterable dataset's tar blocks)


class SampleReadError(OSError):
    """Reading one sample failed; the message names the sample (index and path) and the cause."""


def to_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A writable, 64-byte-aligned uint8 tensor holding ``data``: one memcpy, no Python-level copy.

    The client hands out immutable ``bytes`` (the gRPC message); ``torch.frombuffer`` over them
    would give a tensor over read-only memory. Instead the bytes are copied once (numpy memcpy,
    ~10 GB/s here) into ``torch.empty`` (64-byte-aligned, owned by torch), ready for
    ``pin_memory`` and ``.to(device, non_blocking=True)``. ``torch.tensor(bytes)`` would go
    element by element through Python objects (~1000x slower).
    """
    out = torch.empty(len(data), dtype=torch.uint8)
    if len(data):
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out


def profiled(name: str) -> Any:
    """A ``torch.profiler`` range named ``name`` while a profiler runs in this process (a trace
    then shows cachefs time); otherwise nothing (a range costs ~7 µs even with no profiler)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """A dataset's rank and world size: both given, or neither (then torch.distributed's, else 0 of 1)."""
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither")
    if rank is None:
        return _default_rank_world()
    return int(rank), int(world_size)  # type: ignore[arg-type]


class PerProcessParts:
    """The filesystem, prefetcher and hinter of a dataset belong to one process (forksafe.py):
    a DataLoader worker, forked or spawned, builds its own on first use; a pickle carries none.

    What the main process learnt of the cluster when the dataset was made (``learn_cluster``:
    the view and each worker's lean paths) does travel, so that a DataLoader worker's first
    batch needs no gRPC call on a worker's host (session.SessionBootstrap says why).
    """

    _local: ProcessLocal[ProcessParts]
    storage_options: dict[str, Any]
    _bootstrap: SessionBootstrap | None = None
    _counters: CounterBlock
    plan_ahead: bool = True
    _owner_pid: int = 0
    _publisher: PlanPublisher | None = None  # main process only (never pickled)
    _hint_budget: int = -1  # bytes of cache the workers offer this job for hints (-1: unknown)
    _plan_prefetch: bool = False  # the workers prefetch by the registered plan: no hints
    _plan_job: str = ""  # the registered plan's id, and the position its 0 is at in this epoch
    _plan_base: int = 0
    _board: EpochBoard | None = None  # the main process's set_epoch / load_state_dict, for persistent workers
    _board_seen: int = 0  # the board's generation this copy of the dataset reflects

    def _parts(self, fs: CacheFileSystem, prefetcher: Prefetcher) -> ProcessParts:
        info = get_worker_info()
        if info is not None:
            forksafe.freeze_inherited_heap()  # a forked DataLoader worker: no collection walks the parent's heap
        counts = ProcessCounts(0 if info is None else 1 + info.id)
        return ProcessParts(fs, prefetcher, Hinter(fs.session), {}, {}, counts)

    def _account(self, parts: ProcessParts, samples: int, since_ns: int) -> None:
        """Count ``samples`` handed out after waiting since ``since_ns``; publish this process's totals."""
        counts = parts.counts
        counts.samples += samples
        counts.wait_ns += time.perf_counter_ns() - since_ns
        if self._counters.path:  # off (stats=False, or no block could be made): nothing to publish
            self._counters.publish(counts.row, counts.values(parts.fs.session, parts.prefetcher, parts.hinter))

    def stats(self) -> dict[str, Any]:
        """The client counters of every process that read for this dataset (this one and its
        DataLoader workers, over all epochs so far): samples, bytes and reads by path taken, time
        waiting for cachefs (``wait_s``), hints, prefetch (jobstats.py lists them)."""
        return describe(self._counters.totals())

    @staticmethod
    def _filesystem(storage_options: dict[str, Any]) -> CacheFileSystem:
        # The datasets tell the workers their order themselves (hints, plans): no read-ahead
        # guessed from the order of their reads on top (client/fs/scanahead.py).
        return CacheFileSystem(skip_instance_cache=True, **{"scan_ahead": False, **storage_options})

    def learn_cluster(self) -> None:
        """Learn, in this (main) process, what DataLoader workers will need to start reading."""
        if "bootstrap" in self.storage_options:
            return
        fs = self._filesystem(self.storage_options)
        try:
            self._bootstrap = fs.session.bootstrap()
        except Exception as exc:  # noqa: BLE001 - workers then learn it themselves, as before
            log.debug("could not learn the cluster ahead of DataLoader workers: %s", exc)
        finally:
            fs.close()

    def _process_filesystem(self) -> CacheFileSystem:
        options = self.storage_options
        if self._bootstrap is not None and "bootstrap" not in options:
            options = {**options, "bootstrap": self._bootstrap}
        return self._filesystem(options)

    def _build_parts(self) -> ProcessParts:
        raise NotImplementedError

    # -- the read order, told to the workers (client/datasets/plans.py) ---------------------------------------
    def _plan_units(self) -> Sequence[tuple[str, int, int]]:
        """Each sample's bytes: (path, offset, length), indexed by sample id."""
        raise NotImplementedError

    def _plan_order(self) -> np.ndarray:
        """Sample ids this rank reads from now on: the rest of this epoch, then all of the next."""
        raise NotImplementedError

    def _plan_order_spec(self) -> dict[str, Any] | None:
        """What defines ``_plan_order`` for a worker to derive it (a ``PlanOrder``'s fields), or
        None: the order is sent sample by sample."""
        return None

    def _plan_replay_length(self) -> int:
        """How many of ``_plan_order`` are this epoch's: iterated again without ``set_epoch``,
        the dataset reads those again, not the next epoch's (PyTorch's samplers do the same)."""
        return max(0, len(self.plan) - int(getattr(self, "samples_seen", 0)))

    def _cache_prefetch(self) -> bool:
        """Whether the cache should fetch what comes next (off with hints off: hint_samples=0)."""
        raise NotImplementedError

    def publish_plan(self) -> PlanReport | None:
        """Tell the workers this rank's read order, so their caches keep what is read next
        (called at construction, ``set_epoch`` and ``load_state_dict``; main process only)."""
        if not self.plan_ahead or forksafe.pid() != self._owner_pid:
            return None
        try:
            if self._publisher is None:
                fs = self._process_filesystem()
                counters = self._counters
                publisher = PlanPublisher(fs.session, lambda: counters.totals()["samples"],
                                          prefetch=self._cache_prefetch())
                weakref.finalize(self, _close_publisher, publisher, fs)
                self._publisher = publisher
            spec = self._plan_order_spec()
            if spec is None:
                report = self._publisher.publish(self._plan_units(), self._plan_order(),
                                                 replay_after=self._plan_replay_length())
            else:  # the workers derive the order: the index once, then O(1) a plan
                # Held weakly: the publisher's renewer thread must not keep a dropped dataset alive
                # (its finalizer closes the publisher).
                report = self._publisher.publish_derived(_weakly(self._plan_units), spec, _weakly(self._plan_order),
                                                         replay_after=self._plan_replay_length())
        except Exception as exc:  # noqa: BLE001 - advisory: eviction falls back to recency
            log.warning("could not register the read plan with the workers: %s", exc)
            return None
        if report.workers:
            self._hint_budget = report.share_bytes // 2  # half: the rest keeps what is read next
        # The workers fetch what the plan reads next themselves: hints would only repeat it.
        self._plan_prefetch = report.complete
        self._plan_job, self._plan_base = self._publisher.job, self._plan_start()
        return report

    # -- persistent DataLoader workers (epochboard.py) --------------------------------------------------
    def _post(self, decision: dict[str, Any]) -> None:
        """Tell DataLoader workers that outlive this call (persistent ones) what the main process
        decided: ``{"epoch": e}`` (set_epoch) or ``{"state": state}`` (load_state_dict)."""
        board = self._board
        if board is None:
            return
        if forksafe.pid() != self._owner_pid:  # a worker's own load_state_dict (StatefulDataLoader):
            got = board.read()                 # it supersedes what the main process posted before it
            if got is not None:
                self._board_seen = got[0]
            return
        try:
            self._board_seen = board.post(decision)
        except (TypeError, ValueError) as exc:  # a state that is not plain JSON: say so, keep going
            log.warning("persistent DataLoader workers will not see this state (%s): start them after "
                        "load_state_dict", exc)

    def _follow_board(self) -> None:
        """In a DataLoader worker: take what the main process decided since this copy of the
        dataset was made, as it took it there (one header read when nothing changed)."""
        board = self._board
        if board is None or forksafe.pid() == self._owner_pid or board.generation() == self._board_seen:
            return
        got = board.read()
        if got is None or got[0] == self._board_seen:
            return
        self._board_seen, decision = got
        self._take_decision(decision)

    def _take_decision(self, decision: dict[str, Any]) -> None:
        raise NotImplementedError

    def _plan_start(self) -> int:
        """The epoch position the published plan's position 0 stands for."""
        return int(getattr(self, "samples_seen", 0))

    def _note_progress(self, parts: ProcessParts, position: int) -> None:
        """Tell local workers where this process reads in the plan (with its next request)."""
        if self._plan_job:
            parts.fs.session.note_progress(self._plan_job, max(0, position - self._plan_base))

    @property
    def plan_report(self) -> PlanReport | None:
        """What the workers said about this rank's read plan (None: not registered here)."""
        return None if self._publisher is None else self._publisher.report

    def _new_local(self) -> ProcessLocal[ProcessParts]:
        return ProcessLocal(self._build_parts, name=f"{type(self).__name__} per-process parts")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]
        state.pop("_publisher", None)
        state.pop("index_check", None)  # the main process's recheck
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = self._new_local()


def _weakly(method: Callable[[], Any]) -> Callable[[], Any]:
    """``method`` (bound) called through a weak reference to its object; ReferenceError once it is gone."""
    ref = weakref.WeakMethod(method)

    def call() -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError("the dataset of this read plan is gone")
        return bound()
    return call


def _close_publisher(publisher: PlanPublisher, fs: CacheFileSystem) -> None:
    publisher.close()
    fs.close()


class ConsumptionTracking:
    """``advance``/``track``: samples the training loop consumed, counted in the main process.

    Needs ``self.samples_seen`` and ``len(self.plan)`` (this rank's samples this epoch).
    """

    samples_seen: int
    plan: Any

    def advance(self, n: int) -> None:
        """Record that the training loop consumed ``n`` more samples (``track`` does this for you)."""
        # len() only past what is known: a streamed first epoch's length waits for the listing
        if n < 0 or self.samples_seen + n > _known(self.plan) and self.samples_seen + n > len(self.plan):
            raise ValueError(f"cannot advance {n} from {self.samples_seen} of {len(self.plan)} samples")
        self.samples_seen += n

    def track(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader`` (a DataLoader over this dataset), counting the samples handed out.

        The count is taken in the main process as each batch is yielded, so ``state_dict()``
        inside the loop body is exact whatever ``num_workers`` is (the sampler itself runs ahead
        of consumption by the DataLoader's prefetch). Needs a DataLoader with ``batch_size``
        (or ``batch_size=None``), not a custom ``batch_sampler``.
        """
        batch_sampler = getattr(loader, "batch_sampler", None)
        batch_size = getattr(loader, "batch_size", None)
        if batch_sampler is not None and batch_size is None:
            raise ValueError("track() needs a DataLoader built with batch_size (or batch_size=None), "
                             "not a custom batch_sampler; call advance(n) yourself instead")
        per_batch = 1 if batch_sampler is None else int(batch_size)  # type: ignore[arg-type]
        for batch in loader:
            self._consumed(per_batch)
            yield batch

    def _consumed(self, n: int) -> None:
        """A batch of ``n`` samples (fewer at the end of the epoch) was handed out."""
        self.samples_seen += min(n, _known(self.plan) - self.samples_seen)


def _known(plan: Any) -> int:
    """Positions of ``plan`` known now (a StreamingPlan's grow with the listing; others: all)."""
    known = getattr(plan, "known", None)
    return len(plan) if known is None else known()


class CacheDataset(PerProcessParts, ConsumptionTracking, Dataset):
    def __init__(self, paths: Sequence[str] | SampleIndex | GrowingIndex, *, storage_options: dict[str, Any] | None = None,
                 sizes: Sequence[int] | None = None, transform: Callable[[torch.Tensor], Any] | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, prefetch_bytes: int = 64 * MiB, prefetch_depth: int = 32,
                 prefetch_threads: int = 4, hint_samples: int = 256, timeout: float = 300.0,
                 plan_ahead: bool = True, stats: bool = True) -> None:
        self.storage_options = dict(storage_options or {})
        # One read-only buffer of paths and sizes (sampleindex.py): DataLoader workers share it.
        if not isinstance(paths, (SampleIndex, GrowingIndex)) or sizes is not None:
            if sizes is None:
                paths = paths if isinstance(paths, Sequence) else list(paths)
                sizes = self._resolve_sizes(paths, self.storage_options)
            builder = IndexBuilder()
            for path, size in itertools.zip_longest(paths, sizes, fillvalue=_UNPARSED):
                if path is _UNPARSED or size is _UNPARSED:
                    more = "paths" if size is _UNPARSED else "sizes"
                    raise ValueError(f"{len(sizes)} sizes, and the paths differ in number (more {more})")
                builder.add(str(path), int(size))
            paths = builder.finish()
        # A GrowingIndex: the listing so far, while it streams (from_prefix, liststream.py)
        self._index: SampleIndex | GrowingIndex = paths
        self._listing: Listing | None = None  # main process, while the listing streams
        self._settle_lock, self._publish_lock = threading.Lock(), threading.Lock()
        self._publishing: threading.Thread | None = None
        self.index_check: Future | None = None  # from_prefix(kept_index="auto"): the background recheck
        self.transform = transform
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.prefetch_bytes, self.prefetch_depth = int(prefetch_bytes), int(prefetch_depth)
        self.prefetch_threads, self.timeout = int(prefetch_threads), float(timeout)
        self.hint_samples = int(hint_samples)
        if isinstance(paths, GrowingIndex):
            if self.shuffle:
                raise ValueError("a streamed listing's first epoch is read in listing order: shuffle=False")
            self.plan: EpochPlan | StreamingPlan = StreamingPlan(paths.log, self.rank, self.world_size, self.seed,
                                                                 self.drop_last, self.timeout, paths.url)
        else:
            self.plan = EpochPlan(len(paths), self.rank, self.world_size, self.seed, 0, self.shuffle,
                                  self.drop_last)
        self.samples_seen = 0  # of this rank's order, counted in the main process (track/advance)
        self._calls = 0
        self._local = self._new_local()
        # before any DataLoader worker starts (jobstats.py); stats=False: no block, nothing published
        self._counters = CounterBlock() if stats else CounterBlock("")
        self._board = EpochBoard.make()
        self.learn_cluster()
        self.plan_ahead, self._owner_pid = bool(plan_ahead), forksafe.pid()
        self.publish_plan()

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def _resolve_sizes(cls, paths: Sequence[str], storage_options: dict[str, Any]) -> list[int]:
        """Sizes of ``paths`` by ``info``, a few at a time (once, here; then shipped with the dataset)."""
        if not paths:
            return []
        fs = cls._filesystem(storage_options)
        try:
            with ThreadPoolExecutor(8) as pool:
                return [int(info["size"]) for info in pool.map(fs.info, paths)]
        finally:
            fs.close()

    @classmethod
    def from_prefix(cls, url: str, *, storage_options: dict[str, Any] | None = None, kept_index: str | None = None,
                    index_cache: str | None = None, stream: bool = True, index_timeout: float = 900.0,
                    **kwargs: Any) -> "CacheDataset":
        """Every object below ``url`` (sorted by path), with sizes, from one recursive listing
        taken a page at a time into a compact index (prefixindex.py).

        ``kept_index``: ``None`` lists (the default); ``"refresh"`` lists the store (no listing the
        workers cached) and keeps the index in ``index_cache`` (default ``$CACHEFS_INDEX_CACHE``,
        else ``~/.cache/cachefs/shard-index``);
        ``"auto"`` starts from a kept index without listing, rechecks it in the background
        (``ds.index_check``: warns if the prefix changed, and keeps the fresh listing for the next
        start) and lists and keeps where there is none.

        ``stream`` (with ``shuffle=False``): return after the listing's first page; the first
        epoch reads in listing order while the rest is listed (liststream.py). ``len``, ``paths``,
        ``sizes``, ``set_epoch`` to another epoch and ``load_state_dict`` wait for the end.

        One lister per job: with ``world_size > 1``, a kept-index directory and a run token
        (prefixindex.job_token), rank 0 lists and the other ranks map its index, waiting for it
        at most ``index_timeout`` seconds."""
        if kept_index not in KEPT_MODES:
            raise ValueError(f"kept_index must be one of {KEPT_MODES}, not {kept_index!r}")
        storage_options, kwargs = split_storage_options(storage_options, kwargs, own=cls.__init__)
        rank, world = kwargs.get("rank"), kwargs.get("world_size")
        if rank is None and world is None:
            rank, world = _default_rank_world()
        return open_prefix(cls, url, storage_options, kwargs, kept_index=kept_index, index_cache=index_cache,
                           stream=stream, index_timeout=index_timeout, rank=int(rank or 0), world_size=int(world or 1))

    @classmethod
    def from_manifest(cls, path_or_url: str, *, storage_options: dict[str, Any] | None = None,
                      **kwargs: Any) -> "CacheDataset":
        """Paths from a manifest: a JSON list (of paths, or of {"path", "size"}), JSON lines (one
        such object or string a line), one path a line, or Parquet (``path`` and ``size``
        columns); see manifests.py. Sizes not given are looked up.

        A ``cachefs://`` manifest is read through the cache; anything else through fsspec. A path
        starting with ``./`` or ``../`` is relative to a ``cachefs://`` manifest's directory. The
        entries go one by one into the same compact index as ``from_prefix``'s.
        """
        storage_options, kwargs = split_storage_options(storage_options, kwargs, own=cls.__init__)
        resolve = functools.partial(cls._resolve_sizes, storage_options=dict(storage_options or {}))
        if path_or_url.startswith("cachefs://"):
            fs = cls._filesystem(dict(storage_options or {}))
            try:
                with fs.open(path_or_url, "rb") as f:
                    index = manifest_index(path_or_url, f, resolve)
            finally:
                fs.close()
        else:
            import fsspec

            with fsspec.open(path_or_url, "rb") as f:
                index = manifest_index(path_or_url, f, resolve)
        return cls(index, storage_options=storage_options, **kwargs)

    # -- pickling and per-process state ---------------------------------------------------------------
    def _build_parts(self) -> ProcessParts:
        fs = self._process_filesystem()
        prefetcher = Prefetcher(self._fetch_position, self._size_of_position, max_bytes=self.prefetch_bytes,
                                max_depth=self.prefetch_depth, threads=self.prefetch_threads, timeout=self.timeout)
        return self._parts(fs, prefetcher)

    def _process(self) -> tuple[CacheFileSystem, Prefetcher]:
        parts = self._local.get()
        return parts.fs, parts.prefetcher

    def _hint(self, upcoming: Iterator[int]) -> None:
        """Every few samples, tell the cache the samples after the prefetch window (hints.py).

        ``upcoming`` is what is left after the prefetcher took its window from it.
        """
        self._calls += 1
        if self.hint_samples <= 0 or self._plan_prefetch or self._calls % 16 != 1:
            return
        limit = self.hint_samples
        if self._hint_budget >= 0:  # never hint more than the workers can keep for this job
            limit = min(limit, int(self._hint_budget // max(1, int(self._index.sizes.mean()))))
        paths = [self._index[self.plan.sample(p)] for _, p in zip(range(limit), upcoming)]
        if paths:
            self._local.get().hinter.hint(paths)

    @property
    def hinter(self) -> Hinter:
        """This process's hinter (its ``stats`` hold the counters)."""
        return self._local.get().hinter

    @property
    def prefetcher(self) -> Prefetcher:
        """This process's prefetcher (its ``stats`` hold the counters)."""
        return self._process()[1]

    # -- reading ----------------------------------------------------------------------------------------
    def _fetch_position(self, position: int) -> torch.Tensor:
        return self._read_raw(self.plan.sample(position))

    def _size_of_position(self, position: int) -> int:
        return int(self._index.sizes[self.plan.sample(position)])

    def _cache_path(self, parts: ProcessParts, sample: int) -> Any:
        known = parts.cache_paths
        cp = known.get(sample, _UNPARSED)
        if cp is _UNPARSED:
            cp = parts.fs._path(self._index[sample])
            if len(known) >= PARSED_PATHS:  # bounded: a data set's worth per DataLoader worker is what #46 removed
                known.clear()
            known[sample] = cp
        return cp

    def _read_raw(self, sample: int) -> torch.Tensor:
        """Read straight into an aligned tensor of the listed size; from a worker on this host
        that is no copy through Python at all."""
        parts = self._local.get()
        fs = parts.fs
        size = int(self._index.sizes[sample])
        out = torch.empty(size, dtype=torch.uint8)
        cp = self._cache_path(parts, sample)
        with profiled("cachefs.read_into"):  # short-circuit, data port, gRPC or store
            if cp is None:
                n, actual = fs.read_into(self._index[sample], out.numpy())
            else:
                n, actual = fs.session.read_into(cp, out.numpy())
        if n != size or actual != size:  # changed since it was listed: take it whole, as it is now
            return to_tensor(fs.cat_file(self._index[sample]))
        return out

    def _error(self, sample: int, position: int | None, exc: BaseException) -> SampleReadError:
        where = "" if position is None else f" (position {position} of rank {self.rank}, epoch {self.plan.epoch})"
        return SampleReadError(f"cannot read sample {sample} {self._index[sample]!r}{where}: "
                               f"{type(exc).__name__}: {exc}")

    def read(self, sample: int) -> Any:
        """Sample ``sample`` (an index into ``paths``), transformed, without prefetch."""
        try:
            data = self._read_raw(sample)
        except Exception as exc:
            raise self._error(sample, None, exc) from exc
        return self.transform(data) if self.transform is not None else data

    def _get(self, position: int, upcoming: Iterable[int]) -> Any:
        if not self.plan.has(position):  # a streamed first epoch: waits until the listing gets there
            raise IndexError(f"position {position} is outside this rank's {len(self.plan)} samples")
        _, prefetcher = self._process()
        try:
            upcoming = iter(upcoming)
            data = prefetcher.get(position, upcoming)
            self._hint(upcoming)
        except Exception as exc:
            raise self._error(self.plan.sample(position), position, exc) from exc
        return self._apply(data)

    def _apply(self, data: torch.Tensor) -> Any:
        if self.transform is None:
            return data
        t0 = time.perf_counter_ns()
        try:
            return self.transform(data)
        finally:  # not time waiting for cachefs
            self._local.get().counts.transform_ns += time.perf_counter_ns() - t0

    @staticmethod
    def _num_workers() -> int:
        info = get_worker_info()
        return 1 if info is None else info.num_workers

    def __len__(self) -> int:
        self._settled()  # a streamed first epoch's length: at the listing's end
        return len(self.plan)

    def __getitem__(self, position: int) -> Any:
        # One position per call: batch_size=None, or a caller indexing by hand. The same worker
        # is next asked for position + num_workers.
        t0 = time.perf_counter_ns()
        epoch, (position,) = untag([int(position)])
        self._follow_main(epoch)
        self._note_progress(self._local.get(), position)
        with profiled("cachefs.read_sample"):
            out = self._get(position, EpochPlan.upcoming(position, 1, self._num_workers(), self.plan.known()))
        self._account(self._local.get(), 1, t0)
        return out

    def __getitems__(self, positions: list[int]) -> list[Any]:
        # A batch (DataLoader with batch_size): the batch's positions are consecutive (sampler()
        # or the default sequential sampler), and the worker's next batch starts num_workers
        # batches later. Anything else still reads correctly, with a less useful prefetch.
        t0 = time.perf_counter_ns()
        epoch, ints = untag([int(p) for p in positions])
        self._follow_main(epoch)
        with profiled("cachefs.read_batch"):
            out = self._getitems(ints)
        self._account(self._local.get(), len(out), t0)
        return out

    def _getitems(self, positions: list[int]) -> list[Any]:
        if not positions:
            return []
        start, n, workers = positions[0], len(positions), self._num_workers()
        end = self.plan.known() if self.plan.has(max(positions)) else 0  # streamed: up to what is listed
        self._note_progress(self._local.get(), start)
        local = self._read_held_batch(positions, EpochPlan.upcoming(start, n, workers, end, after=positions[-1]))
        if local is not None:
            return local
        out = []
        for j, pos in enumerate(positions):
            out.append(self._get(pos, EpochPlan.upcoming(start, n, workers, end, after=start + j)))
        return out

    def _read_held_batch(self, positions: list[int], upcoming: Iterator[int]) -> list[Any] | None:
        """The batch read here and now, if a worker on this host holds all of it: its page
        handles come in one message (fetched while the previous batch was read) and the samples
        are then read in one pass with no message and no thread hand-off. None: read it the
        usual way (prefetch, gRPC)."""
        if not positions or min(positions) < 0 or max(positions) >= self.plan.known():
            return None
        parts = self._local.get()
        pending = parts.ahead.pop("next", None)
        uncached = False
        quiet = True  # nothing for this batch needed a message: the next one likely needs none either
        if pending is not None:
            future, asked = pending
            try:
                got = future.result(timeout=self.timeout)
                uncached = got.held < asked or got.filled > 0
                quiet = got.asked == 0
            except Exception:  # noqa: BLE001 - only a hint that the handles are there
                uncached, quiet = True, False
        samples = self.plan.samples(positions).tolist()  # one call for the batch
        paths = self._held_paths(parts, samples)
        if paths is None:
            return None
        session = parts.fs.session
        sizes = self._index.sizes[samples].tolist()
        outs = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        with profiled("cachefs.held_reads"):  # page handles held here: no message
            got = session.read_held([(cp, out.numpy()) for cp, out in zip(paths, outs)])
        missing = [i for i, g in enumerate(got) if g is None]
        if missing:
            # Not held yet (the first read in this process, or dropped): one message for them all;
            # cold ones are fetched into the worker's cache first (fill), all at once. If the
            # worker could not (busy, a store error), the prefetcher reads them through gRPC.
            prepared = self._prepare(parts, [samples[i] for i in missing])
            not_cached = len(missing) - prepared.held
            if 4 * not_cached > len(samples):
                return None
            uncached = uncached or not_cached > 0 or prepared.filled > 0
            for i, g in zip(missing, session.read_held([(paths[i], outs[i].numpy()) for i in missing])):
                got[i] = g
        # The next batch's handles are fetched meanwhile, unless this one took no message at all
        # (held, or read by name: a warm epoch), where that would only cost this process CPU;
        # should the next one miss, it asks then, and its following batch is prepared again.
        following = [] if quiet and not missing else \
            [self.plan.sample(p) for p in itertools.islice(upcoming, len(positions))]
        if following:
            parts.ahead["next"] = (parts.prefetcher.run(lambda: self._prepare(parts, following)), len(following))
        out = outs if self.transform is None else []
        for i, (size, g) in enumerate(zip(sizes, got)):
            data = outs[i]
            if g is None or g != (size, size):  # not cached, dropped meanwhile, or changed since listed
                try:
                    data = self._read_raw(samples[i])
                except Exception as exc:
                    raise self._error(samples[i], positions[i], exc) from exc
                if self.transform is None:
                    outs[i] = data
            if self.transform is not None:
                out.append(self._apply(data))
        if uncached:  # all of it cached (the usual warm epoch): hints would only cost both sides
            self._hint(upcoming)
        return out

    def _held_paths(self, parts: ProcessParts, samples: list[int]) -> list[Any] | None:
        """Each sample's cachefs path for a held or named read: a ``cachefs://`` URL's
        "mount/key" as it stands (no parse a sample: a read by name matches the worker's own
        canonical path byte for byte, so one that is not canonical misses, and the fallback that
        follows parses it like any read), else its parsed path; None: a sample this filesystem
        reads past the cache (``unmounted="direct"``)."""
        index, known, out = self._index, parts.cache_paths, []
        if isinstance(index, SampleIndex) and index.head.startswith(_URL_PREFIX):
            return index.paths_of(samples, drop=len(_URL_PREFIX))  # every one a cachefs:// URL
        for s in samples:
            path = index[s]
            if path.startswith(_URL_PREFIX):
                out.append(path[len(_URL_PREFIX):])
                continue
            cp = known.get(s, _UNPARSED)
            if cp is _UNPARSED:
                cp = self._cache_path(parts, s)
            if cp is None:
                return None
            out.append(cp)
        return out

    def _prepare(self, parts: ProcessParts, samples: list[int]) -> Prepared:
        ranges = []
        for s in samples:
            cp = self._cache_path(parts, s)
            if cp is None:
                return Prepared(0, 0)
            ranges.append((cp, 0, int(self._index.sizes[s])))
        return parts.fs.session.prepare(ranges)

    # -- epochs, sampler, resume -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order. Progress resets only when the epoch changes, so calling
        it with the epoch a loaded state is in keeps the resume point. Call before ``iter(loader)``."""
        if int(epoch) == self.plan.epoch:
            return
        self._enter_epoch(int(epoch))
        self._post({"epoch": int(epoch)})
        self.publish_plan()

    def _enter_epoch(self, epoch: int) -> None:
        self._settled()  # a streamed first epoch's index, whole
        self.plan = EpochPlan(len(self.paths), self.rank, self.world_size, self.seed, epoch, self.shuffle,
                              self.drop_last)
        self.samples_seen = 0
        self._reset_prefetch()

    def _follow_main(self, tagged: int | None) -> None:
        """A persistent DataLoader worker's copy of the dataset stays in the epoch it started in:
        it takes what the main process decided since (the board), then the epoch the sampler
        tagged these positions with, which wins (a set_epoch while the batch was in flight)."""
        if forksafe.pid() == self._owner_pid:  # the main process's plan is the sampler's own
            return
        self._follow_board()
        if tagged is not None:
            self._follow_epoch(tagged)

    def _take_decision(self, decision: dict[str, Any]) -> None:
        if "state" in decision:
            self._load(decision["state"])
            self._plan_base = self.samples_seen  # as publish_plan left it in the main process
        elif "epoch" in decision:
            self._follow_epoch(int(decision["epoch"]))

    def _follow_epoch(self, epoch: int) -> None:
        """Epoch ``epoch``'s plan in a DataLoader worker, as ``set_epoch`` made it in the main process."""
        if epoch != getattr(self.plan, "epoch", 0):
            self._enter_epoch(epoch)
            self._plan_base = 0  # as publish_plan left it in the main process

    def _plan_units(self) -> Sequence[tuple[str, int, int]]:
        return self.paths.units()  # a tuple per sample when asked, never a list of them

    def _cache_prefetch(self) -> bool:
        return self.hint_samples > 0

    def _plan_order_spec(self) -> dict[str, Any] | None:
        plan, start = self.plan, int(self.samples_seen)
        after = EpochPlan(len(self.paths), self.rank, self.world_size, self.seed, plan.epoch + 1, self.shuffle,
                          self.drop_last)
        return {"kind": "epoch", "n_samples": plan.n_samples, "seed": plan.seed, "epoch": plan.epoch,
                "rank": plan.rank, "world_size": plan.world_size, "shuffle": plan.shuffle,
                "drop_last": plan.drop_last, "offset": plan.offset, "start": start,
                "digest": plan_digest(plan.epoch_order, start, after.epoch_order)}

    def _plan_order(self) -> np.ndarray:
        after = EpochPlan(len(self.paths), self.rank, self.world_size, self.seed, self.plan.epoch + 1, self.shuffle,
                          self.drop_last)
        return np.concatenate([self.plan.remaining(self.samples_seen), after.order])

    def _reset_prefetch(self) -> None:
        parts = self._local.peek()  # this process's, if it has read anything yet
        if parts is not None:
            parts.prefetcher.reset()
            parts.hinter.reset()

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def sampler(self) -> "CacheSampler":
        return CacheSampler(self)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: epoch, seed, samples of its order consumed (plus checks)."""
        return self.plan.state(self.samples_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the same or another number of DataLoader workers or ranks
        (see sampling.py for how a different world size is handled). Call before ``iter(loader)``.
        A streamed first epoch's listing is waited for (the count is checked, the rest dealt)."""
        self._load(state)
        self._post({"state": state})
        self.publish_plan()

    def _load(self, state: dict[str, Any]) -> None:
        self._settled()
        self.plan, self.samples_seen = EpochPlan.resume(
            state, n_samples=len(self.paths), rank=self.rank, world_size=self.world_size, shuffle=self.shuffle,
            drop_last=self.drop_last)
        self.seed = int(state["seed"])
        self._reset_prefetch()


    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in ("_listing", "_settle_lock", "_publish_lock", "_publishing"):  # the main process's
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._listing, self._publishing = None, None
        self._settle_lock, self._publish_lock = threading.Lock(), threading.Lock()

    # -- a listing that streams (from_prefix, liststream.py) ---------------------------------------------
    @property
    def paths(self) -> SampleIndex | GrowingIndex:
        """Every sample's path (a read-only sequence); while the listing streams, waits for its end."""
        self._settled()
        return self._index

    @property
    def sizes(self) -> np.ndarray:
        """Every sample's size (int64, read-only); while the listing streams, waits for its end."""
        return self.paths.sizes

    def _settled(self) -> None:
        """Wait until the whole index is here (at once unless the listing streams)."""
        listing = self._listing
        if listing is not None:
            self._settle(listing.result())
        elif isinstance(self._index, GrowingIndex):  # a DataLoader worker of a streamed epoch
            self._index.wait_done(self.timeout, self._index.url)

    def _settle(self, index: SampleIndex) -> None:
        """The listing ended: its index replaces the log, epoch 0's plan the streaming one (the same
        order), and the plan goes to the workers (on the listing thread, or whoever asked first)."""
        with self._settle_lock:
            if self._listing is None:
                return
            if isinstance(self.plan, StreamingPlan):
                self.plan = EpochPlan(len(index), self.rank, self.world_size, self.seed, 0, False, self.drop_last)
            self._index, self._listing = index, None
        self._publish_soon()

    def publish_plan(self) -> PlanReport | None:
        if isinstance(self.plan, StreamingPlan):  # not whole yet: published by _settle
            return None
        with self._publish_lock:  # one at a time: the last to run reads the newest plan
            return super().publish_plan()

    def _publish_soon(self) -> None:
        """Register the plan on a thread: sending the index costs seconds a million samples
        (docs/performance.md), which the first batch need not wait for (the plan is advisory)."""
        if self.plan_ahead:
            thread = threading.Thread(target=self.publish_plan, name="cachefs-plan-publish", daemon=True)
            thread.start()  # then kept: plan_report joins it (the latest waits behind any before it)
            self._publishing = thread

    @property
    def plan_report(self) -> PlanReport | None:
        publishing = self._publishing
        if publishing is not None:
            publishing.join()
        return PerProcessParts.plan_report.fget(self)  # type: ignore[attr-defined]


class CacheSampler(Sampler[int]):
    """Positions ``samples_seen .. len(ds)-1`` of the dataset's current epoch plan, read at ``iter``,
    each tagged with that epoch (sampling.tag_epoch: a persistent DataLoader worker follows it)."""

    def __init__(self, dataset: CacheDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[int]:
        plan = self.dataset.plan
        tag = tag_epoch(getattr(plan, "epoch", 0))  # for persistent DataLoader workers (sampling.py)
        if isinstance(plan, StreamingPlan):
            return (tag | p for p in _streamed(plan, self.dataset.samples_seen))
        return iter(range(tag + self.dataset.samples_seen, tag + len(self.dataset)))

    def __len__(self) -> int:
        """While a first epoch streams, waits for the listing's end (then exact): a DataLoader
        asks only when ``len(loader)`` is (tqdm, a progress bar), not to iterate."""
        return len(self.dataset) - self.dataset.samples_seen

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


def _streamed(plan: StreamingPlan, position: int) -> Iterator[int]:
    """Positions from ``position`` on, each once its sample is listed, to the epoch's end."""
    while plan.has(position):
        end = plan.known()
        yield from range(position, end)
        position = end
