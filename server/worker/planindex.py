"""Plans a worker derives itself: a data set's index, sent once, and orders made from their keys.

A job used to send its read order sample by sample, this epoch and the next, at every
``set_epoch`` (a million samples: tens of seconds on the client, ~1 KB a page here). Now it sends
the data set's **index** once per worker (``PlanIndex``: the units whose first page this worker
holds, by sample id; shared by every job over the same data set, by the index's digest), and per
epoch only what defines its order (seed, epoch, rank, world size, ...: ``PlanOrder``). The worker
computes the order with the sampler's own code (cachefs/order.py) into a few arrays
(``DerivedOrder``), checks it against the client's digest, and answers the page store's questions
from them. Memory per planned read is a few int32s; per unit of the index its path's bytes and ~30.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachefs.order import EpochOrder, digest, probe_positions

__all__ = ["NO_USE", "DerivedOrder", "IndexError_", "PlanIndex", "derive"]

MAX_INDEX_UNITS = 1 << 31
#: An epoch order over at most this many samples is inverted once, into an array (4 bytes a
#: sample, shared by the jobs of every rank reading that epoch); a larger one is inverted value
#: by value (Permutation.inverse), as the page store asks.
INVERSE_MAX_SAMPLES = 1 << 24
MAX_PAGES_PER_UNIT = 4096
HASH_CHUNK = 65_536
USES_KEPT = 8192  # DerivedOrder.uses answers kept per job's order


class IndexError_(ValueError):
    """A bad index chunk or plan order (INVALID_ARGUMENT)."""


class PlanIndex:
    """One data set's units on this worker: arrays, built from chunks, then frozen."""

    def __init__(self, index_id: str, size: int, page_size: int) -> None:
        self.id, self.size, self.page_size = index_id, int(size), page_size
        self.complete = False
        self.expires = 0.0
        self._chunks: list[tuple[np.ndarray, bytes, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, request: Any) -> None:
        samples = np.asarray(request.index_samples, dtype=np.int64)
        lengths = np.asarray(request.index_path_lengths, dtype=np.int64)
        offsets = np.asarray(request.index_offsets, dtype=np.int64)
        sizes = np.asarray(request.index_lengths, dtype=np.int64)
        n = len(samples)
        if not len(lengths) == len(offsets) == len(sizes) == n or int(lengths.sum()) != len(request.index_paths):
            raise IndexError_("an index chunk needs as many path lengths, offsets and lengths as samples")
        if n and (samples.min() < 0 or samples.max() >= self.size or offsets.min() < 0 or sizes.min() <= 0
                  or lengths.min() <= 0):
            raise IndexError_("bad sample ids, byte ranges or paths in an index chunk")
        self._chunks.append((samples, bytes(request.index_paths), lengths, offsets, sizes))

    def finish(self) -> None:
        """All chunks came: sort by sample id, validate and hash the paths (outside every lock)."""
        chunks, self._chunks = self._chunks, []
        if chunks:
            samples = np.concatenate([c[0] for c in chunks])
            blob = b"".join(c[1] for c in chunks)
            lengths = np.concatenate([c[2] for c in chunks])
            offsets = np.concatenate([c[3] for c in chunks])
            sizes = np.concatenate([c[4] for c in chunks])
        else:
            samples = lengths = offsets = sizes = np.zeros(0, dtype=np.int64)
            blob = b""
        if len(samples) > MAX_INDEX_UNITS:
            raise IndexError_("too many units in one index")
        starts = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        in_order = len(samples) < 2 or bool((samples[1:] > samples[:-1]).all())  # as the client sends them
        by_sample = np.arange(len(samples)) if in_order else np.argsort(samples, kind="stable")
        if len(samples) > 1 and (np.diff(samples[by_sample]) == 0).any():
            raise IndexError_("a sample id twice in one index")
        first = offsets // self.page_size
        last = (offsets + sizes - 1) // self.page_size
        if len(first) and int((last - first).max()) >= MAX_PAGES_PER_UNIT:
            raise IndexError_(f"a unit of more than {MAX_PAGES_PER_UNIT} pages: split it")
        # Python's str hash: stable within this process, which is all a lookup here needs. Paths
        # are not parsed one by one: one that is not canonical ("mount/key") matches no page,
        # and prefetch parses what it is handed (service.load_objects) like any request's.
        try:
            text = blob.decode()
        except UnicodeDecodeError:
            raise IndexError_("index paths must be UTF-8") from None
        ascii_only = len(text) == len(blob)  # else cut by bytes
        hashes = np.empty(len(samples), dtype=np.int64)
        for c in range(0, len(samples), HASH_CHUNK):  # a chunk of str objects at a time, not all
            bounds = starts[c:c + HASH_CHUNK + 1].tolist()
            cuts = zip(bounds[:-1], bounds[1:])
            paths = [text[a:b] for a, b in cuts] if ascii_only else [blob[a:b].decode() for a, b in cuts]
            hashes[c:c + len(paths)] = np.fromiter(map(hash, paths), dtype=np.int64, count=len(paths))
        del text
        order = by_sample
        self.samples = samples[order].astype(np.int32 if self.size < 1 << 31 else np.int64)
        self.blob = blob
        self.path_starts = starts[:-1][order].astype(np.uint32 if len(blob) < 1 << 32 else np.int64)
        self.path_lengths = lengths[order].astype(np.int32)
        self.first_page = first[order].astype(np.int32 if int(last.max(initial=0)) < 1 << 31 else np.int64)
        self.pages = (last - first + 1)[order].astype(np.int16)
        self.sizes = sizes[order].astype(np.int64)
        # sample -> unit as a table where this worker holds a good part of the data set (a gather,
        # not a search, for each sample of a plan); a search in ``samples`` otherwise.
        self.table: np.ndarray | None = None
        if len(samples) and 4 * len(samples) >= self.size:
            self.table = np.full(self.size, -1, dtype=np.int32)
            self.table[self.samples] = np.arange(len(samples), dtype=np.int32)
        hashed = hashes[order]
        self.by_hash = np.argsort(hashed, kind="stable").astype(np.int32)
        self.hashes = hashed[self.by_hash]
        self._hash_view, self._by_hash_view = memoryview(self.hashes), memoryview(self.by_hash)
        self.complete = True

    def __len__(self) -> int:
        return len(self.samples) if self.complete else 0

    def path(self, unit: int) -> str:
        start = int(self.path_starts[unit])
        return self.blob[start:start + int(self.path_lengths[unit])].decode()

    def find(self, mount: str, key: str) -> list[int]:
        """The units of object ``mount/key`` (usually one; none when it is not in the index)."""
        want = f"{mount}/{key}"
        h = hash(want)  # as finish() hashes it
        # Asked for every page read (the page store's eviction order), from threads that share
        # the GIL with the socket server: a bisect over the array's memoryview holds the GIL
        # throughout, where np.searchsorted lets it go and waits to take it back, twice a call.
        hashes = self._hash_view
        lo = bisect.bisect_left(hashes, h)
        if lo == len(hashes) or hashes[lo] != h:
            return []
        hi = bisect.bisect_right(hashes, h, lo)
        # the index holds canonical paths: a hash collision is told apart
        return [u for u in self._by_hash_view[lo:hi].tolist() if self.path(u) == want]

    def hash_spans(self, paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """For each path ("mount/key"), the span [lo, hi) of ``hashes`` (and ``by_hash``) with its
        hash: one unit where ``hi - lo == 1`` (a path not in the index may share a hash: compare
        ``path``), several for an object split into units, none for a path not held here."""
        hashes = np.fromiter(map(hash, paths), dtype=np.int64, count=len(paths))  # as finish() hashes them
        return np.searchsorted(self.hashes, hashes, side="left"), np.searchsorted(self.hashes, hashes, side="right")

    def units_of_samples(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(where in ``samples``, which unit) for the samples held here."""
        if not len(self.samples):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        if self.table is not None:
            u = self.table[samples]
            held = np.flatnonzero(u >= 0)
            return held, u[held]
        u = np.searchsorted(self.samples, samples)
        u[u >= len(self.samples)] = 0
        held = np.flatnonzero(self.samples[u] == samples)
        return held, u[held].astype(np.int32)

    def nbytes(self) -> int:
        arrays = (self.samples, self.path_starts, self.path_lengths, self.first_page, self.pages, self.sizes,
                  self.by_hash, self.hashes, self.table)
        return len(self.blob) + sum(a.nbytes for a in arrays if a is not None)


class Inverses:
    """Epoch orders' global orders inverted (sample -> where it is read in the global order),
    one array per order key, kept while a job's plan holds it (the ranks of one data set share
    it). The page store asks where each read page is used next, for every read and for every
    cached page after each ``set_epoch``: an array lookup, not the Feistel rounds in Python."""

    def __init__(self) -> None:
        self._by_key: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def of(self, order: EpochOrder) -> np.ndarray | None:
        """The inverse of ``order``'s global permutation; None for an order kept unshuffled (the
        identity) or too large to hold inverted (``INVERSE_MAX_SAMPLES``)."""
        perm = order.permutation
        if perm is None or perm.n > INVERSE_MAX_SAMPLES:
            return None
        with self._lock:
            found = self._by_key.get(order.key)
        if found is not None:
            return found
        made = perm.inverse_array()  # outside the lock: O(n), vectorised
        with self._lock:
            return self._by_key.setdefault(order.key, made)


INVERSES = Inverses()


@dataclass
class DerivedOrder:
    """A job's plan over ``index``, as what defines it: ``now`` from position ``start``, then all of
    ``after``. Where a unit is read is computed when asked (the order's inverse: O(1)); what the
    job reads next, from the order itself. Kept per job: one flag per unit of the index (planned)."""

    index: PlanIndex
    now: EpochOrder
    start: int
    after: EpochOrder
    length: int  # positions in the plan (this epoch's rest, then the next epoch)
    planned: np.ndarray  # bool per unit of the index: the plan reads it
    pages: int  # pages of the planned units
    reads: int  # positions of the plan that read a unit of the index
    read_bytes: int  # bytes those read
    last: int  # the last such position (-1: none)
    now_inverse: np.ndarray | None = field(default=None, repr=False, compare=False)  # Inverses.of(now)
    after_inverse: np.ndarray | None = field(default=None, repr=False, compare=False)
    _kept_uses: dict | None = field(default=None, repr=False, compare=False)  # uses(), recent answers

    @property
    def rest(self) -> int:
        return len(self.now) - self.start

    def positions_of(self, sample: int, memo: dict | None = None) -> list[int]:
        """Positions of the plan that read ``sample``. ``memo``: inverses already computed (one
        call asking several jobs of one data set: ranks share their epochs' global orders)."""
        def global_index(order: EpochOrder, inverse: np.ndarray | None) -> int:
            if inverse is not None:
                return int(inverse[sample])
            key = (order.key, sample)
            g = None if memo is None else memo.get(key)
            if g is None:
                g = order.global_index(sample)
                if memo is not None:
                    memo[key] = g
            return g

        rest = self.rest
        now = [p - self.start for p in self.now.positions_of_global(global_index(self.now, self.now_inverse))
               if p >= self.start]
        return now + [rest + p for p in self.after.positions_of_global(global_index(self.after, self.after_inverse))]

    def uses(self, mount: str, key: str, index: int, memo: dict | None = None) -> list[int]:
        """Positions at which the plan reads page ``index`` of ``mount/key`` (ascending). The last
        ``USES_KEPT`` answers are kept (the order never changes once made): a cold page is asked
        when it is added and again when its read is placed, moments apart."""
        kept = self._kept_uses
        if kept is None:
            kept = self._kept_uses = {}
        found_uses = kept.get((mount, key, index))
        if found_uses is not None:
            return found_uses
        out = self._uses(mount, key, index, memo)
        if len(kept) >= USES_KEPT:
            kept.clear()  # cheaper than an LRU's bookkeeping per call; refilled within moments
        kept[(mount, key, index)] = out
        return out

    def _uses(self, mount: str, key: str, index: int, memo: dict | None) -> list[int]:
        out: list[int] = []
        found = None if memo is None else memo.get((self.index.id, mount, key))
        if found is None:
            found = self.index.find(mount, key)
            if memo is not None:
                memo[(self.index.id, mount, key)] = found
        for u in found:
            first = int(self.index.first_page[u])
            if self.planned[u] and first <= index < first + int(self.index.pages[u]):
                out.extend(self.positions_of(int(self.index.samples[u]), memo))
        return sorted(out) if len(out) > 1 else out

    def uses_many(self, paths: list[str], indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``uses`` of many pages (page ``indices[i]`` of object ``paths[i]``, "mount/key") in one
        vectorised pass: (positions, answered). ``positions[i]``: the plan's positions that read
        the page, ascending, padded with ``NO_USE``; ``answered[i]`` False where this pass does
        not answer and ``uses`` must (an object split into several units, a shuffled order too
        large to hold inverted)."""
        n = len(paths)
        none = np.full((n, 1), NO_USE, dtype=np.int64)
        if not _invertible(self.now, self.now_inverse) or not _invertible(self.after, self.after_inverse):
            return none, np.zeros(n, dtype=bool)
        index = self.index
        lo, hi = index.hash_spans(paths)
        answered = hi - lo <= 1
        rows = np.flatnonzero(hi - lo == 1)
        units = index.by_hash[lo[rows]]
        # a path not in the index whose hash is one of its paths': told apart, as find() does
        same = np.fromiter((index.path(u) == paths[r] for u, r in zip(units.tolist(), rows.tolist())),
                           dtype=bool, count=len(rows))
        rows, units = rows[same], units[same]
        page = indices[rows]
        first = index.first_page[units].astype(np.int64)
        read = self.planned[units] & (first <= page) & (page < first + index.pages[units])
        rows, units = rows[read], units[read]
        if not len(rows):
            return none, answered
        samples = index.samples[units].astype(np.int64)
        now = _global_positions(self.now, _global_indices(self.now_inverse, samples))
        now = np.where((now != NO_USE) & (now >= self.start), now - self.start, NO_USE)
        after = _global_positions(self.after, _global_indices(self.after_inverse, samples))
        after = np.where(after != NO_USE, after + self.rest, NO_USE)
        found = np.sort(np.concatenate([now, after], axis=1), axis=1)
        out = np.full((n, found.shape[1]), NO_USE, dtype=np.int64)
        out[rows] = found
        return out, answered

    def pages_of(self, mount: str, key: str) -> int:
        return sum(int(self.index.pages[u]) for u in self.index.find(mount, key) if self.planned[u])

    def samples_between(self, start: int, end: int) -> np.ndarray:
        """The plan's samples at positions [start, end)."""
        rest = self.rest
        start, end = max(0, start), min(end, self.length)
        parts = []
        if start < min(end, rest):
            parts.append(self.now.array(np.arange(self.start + start, self.start + min(end, rest), dtype=np.int64)))
        if max(start, rest) < end:
            parts.append(self.after.array(np.arange(max(start, rest) - rest, end - rest, dtype=np.int64)))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def planned_between(self, start: int, end: int) -> list[tuple[str, int]]:
        """(path, ``pages_of`` it) of the units held here that the plan reads at positions
        [start, end), in order, each path once. Asked at every progress report of a job (its
        prefetch window): the pages of a path that is one unit of the index, as most are, come
        from one vectorised pass, not a search each."""
        index = self.index
        _, units = index.units_of_samples(self.samples_between(start, end))
        units = np.fromiter(dict.fromkeys(units.tolist()), dtype=np.int64)
        paths = [index.path(u) for u in units.tolist()]
        lo, hi = index.hash_spans(paths)
        alone = hi - lo == 1
        pages = np.where(self.planned[units], index.pages[units], 0).tolist()
        out: dict[str, int] = {}
        for path, n, single in zip(paths, pages, alone.tolist()):
            if path not in out:
                mount, _, key = path.partition("/")
                out[path] = n if single else self.pages_of(mount, key)
        return list(out.items())

    def nbytes(self) -> int:
        """The job's arrays (an inverse shared with other jobs counted in each)."""
        return self.planned.nbytes + sum(a.nbytes for a in (self.now_inverse, self.after_inverse) if a is not None)


NO_USE = np.iinfo(np.int64).max  # DerivedOrder.uses_many's padding: no position


def _invertible(order: EpochOrder, inverse: np.ndarray | None) -> bool:
    """Whether samples' places in ``order``'s global order can be looked up together."""
    return inverse is not None or order.permutation is None


def _global_indices(inverse: np.ndarray | None, samples: np.ndarray) -> np.ndarray:
    """Where ``samples`` are in an epoch's global order (``inverse`` None: unshuffled, the identity)."""
    return samples if inverse is None else inverse[samples].astype(np.int64)


def _global_positions(order: EpochOrder, g: np.ndarray) -> np.ndarray:
    """``order.positions_of_global`` of each global index in ``g``, as rows padded with NO_USE."""
    rest, ws = order.rest, order.world_size
    if rest <= 0:
        return np.full((len(g), 1), NO_USE, dtype=np.int64)
    total = len(order) * ws
    j0 = g - order.offset
    columns = []
    for step in range(-(-total // rest) + 1):  # the padding repeats the order from its start: a few laps
        j = j0 + step * rest
        columns.append(np.where((j0 >= 0) & (j < total) & (j % ws == order.rank), j // ws, NO_USE))
    return np.stack(columns, axis=1)


def _orders(order: Any) -> tuple[EpochOrder, EpochOrder]:
    if order.kind != "epoch":
        raise IndexError_(f"unknown plan order kind {order.kind!r}")
    try:
        now = EpochOrder(order.n_samples, order.rank, order.world_size, order.seed, order.epoch, order.shuffle,
                         order.drop_last, order.offset)
        after = EpochOrder(order.n_samples, order.rank, order.world_size, order.seed, order.epoch + 1,
                           order.shuffle, order.drop_last, 0)
    except ValueError as exc:
        raise IndexError_(f"bad plan order: {exc}") from None
    if not 0 <= order.start <= len(now):
        raise IndexError_(f"start {order.start} is outside the rank's {len(now)} samples")
    return now, after


def plan_samples(order: Any) -> np.ndarray:
    """The samples of a ``PlanOrder``'s plan, by position: the rest of its epoch, then the next."""
    now, after = _orders(order)
    return np.concatenate([now.array(np.arange(order.start, len(now), dtype=np.int64)), after.all()])


def derive(index: PlanIndex, order: Any) -> DerivedOrder | None:
    """The job's plan over ``index`` from ``order``; None when its digest is not the client's (the
    client then sends the plan itself). O(plan length), vectorised, once a plan: call it outside
    every lock. What it keeps is a flag per unit."""
    if order.n_samples != index.size:
        return None
    now, after = _orders(order)
    samples = np.concatenate([now.array(np.arange(order.start, len(now), dtype=np.int64)), after.all()])
    if digest(order.kind, len(samples), samples[probe_positions(len(samples))].tolist()) != order.digest:
        return None
    where, units = index.units_of_samples(samples)
    planned = np.zeros(len(index), dtype=bool)
    planned[units] = True
    return DerivedOrder(index, now, int(order.start), after, len(samples), planned, int(index.pages[planned].sum()),
                        len(where), int(index.sizes[units].sum()), int(where[-1]) if len(where) else -1,
                        INVERSES.of(now), INVERSES.of(after))
