"""Epoch order and sharding for CacheDataset: pure, deterministic, no torch.distributed needed.

An epoch's order is known before it starts, which is what lets each DataLoader worker
prefetch exactly the samples it will be asked for next.

* **Global order.** A permutation of ``range(n_samples)`` keyed by ``(seed, epoch)`` that
  cachefs defines itself (cachefs/order.py: a Feistel permutation, not numpy's generator streams,
  which NEP 19 does not promise stable across numpy versions); identity when ``shuffle=False``.
  The same in every process, rank and release, and on the workers, which derive a job's read
  plan from it (server/worker/plans.py). Any position is computed in O(1): making a plan (a
  ``set_epoch``) costs nothing until the whole order is asked for.
* **Resume offset.** An epoch may start part-way into that permutation (``offset``: samples
  already consumed by *all* ranks together); only ``perm[offset:]`` is dealt out. Offset is
  0 except after resuming with a different world size (see below).
* **Ranks.** The rest is padded by repeating it from its start (or truncated, with
  ``drop_last``) to a multiple of ``world_size`` so every rank gets the same count (no DDP
  hang at the end of an epoch), then dealt out interleaved: rank r gets positions
  ``r, r + world_size, ...``, as torch's DistributedSampler does.
* **DataLoader workers.** A rank's order is consumed by position. With a batch sampler of
  ``batch_size`` over it, batch k goes to worker ``k % num_workers`` (torch's round robin for
  map-style datasets), so a worker that is serving the batch starting at position p will next
  be asked for the batch starting at ``p + num_workers * batch_size``.

Resume state (per rank): ``{"epoch", "seed", "samples_seen", "offset", "world_size", ...}``;
``samples_seen`` is how many samples of this rank's order were already yielded. Resuming with
the same world size skips exactly those (whatever the number of DataLoader workers, which
does not change the order). Resuming with another world size starts the rest of the epoch at
``offset + samples_seen * old_world_size`` of the global order, re-dealt over the new ranks:
exact when every old rank had consumed the same count, which DDP's lock-step guarantees (the
state saved by any rank, usually rank 0, is the state of all ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachefs.client.datasets.sampleindex import trim_heap
from cachefs.order import EpochOrder, Permutation, shuffled

STATE_VERSION = 1


def _permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The shards' order of a BlockPlan: cachefs's own permutation (order.py), as EpochPlan's."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return Permutation(n, int(seed), int(epoch)).array(np.arange(n, dtype=np.int64))


def _check_deal(rank: int, world_size: int, offset: int, n_samples: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if not 0 <= offset <= n_samples:
        raise ValueError(f"offset {offset} is outside 0..{n_samples}")


def _to_rank_multiple(rest: np.ndarray, world_size: int, drop_last: bool) -> np.ndarray:
    """``rest`` padded by repeating it from its start (several times if need be), or truncated
    with ``drop_last``, to a multiple of ``world_size``: every rank gets the same count."""
    total = (len(rest) // world_size if drop_last else -(-len(rest) // world_size)) * world_size
    return np.resize(rest, total) if total > len(rest) else rest[:total]


#: CacheSampler's positions carry the epoch they belong to (plus one) from this bit up: a
#: persistent DataLoader worker (``persistent_workers=True``) keeps the copy of the dataset it
#: started with, whose plan is that first epoch's, and learns each later epoch from the positions
#: it is handed (``set_epoch`` runs in the main process only). 0 above it: untagged, the process's
#: own plan. Positions stay below 2**40.
EPOCH_TAG_SHIFT = 40
POSITION_MASK = (1 << EPOCH_TAG_SHIFT) - 1


def tag_epoch(epoch: int) -> int:
    """What CacheSampler adds to each position of epoch ``epoch``."""
    return (int(epoch) + 1) << EPOCH_TAG_SHIFT


def untag(positions: list[int]) -> tuple[int | None, list[int]]:
    """(the epoch the sampler tagged ``positions`` with, or None: untagged; the positions)."""
    if not positions or positions[0] <= POSITION_MASK:
        return None, positions
    return (positions[0] >> EPOCH_TAG_SHIFT) - 1, [p & POSITION_MASK for p in positions]


@dataclass(frozen=True)
class EpochPlan:
    n_samples: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    drop_last: bool = False
    offset: int = 0  # global samples of this epoch consumed before this plan started

    def __post_init__(self) -> None:
        if self.n_samples < 0:
            raise ValueError(f"n_samples must be >= 0, got {self.n_samples}")
        _check_deal(self.rank, self.world_size, self.offset, self.n_samples)
        object.__setattr__(self, "_epoch_order", EpochOrder(self.n_samples, self.rank, self.world_size, self.seed,
                                                            self.epoch, self.shuffle, self.drop_last, self.offset))
        object.__setattr__(self, "_order", None)  # made on first use of ``order`` (O(n))

    @property
    def epoch_order(self) -> EpochOrder:
        """The order as cachefs/order.py defines it (what a worker derives the plan from)."""
        return self._epoch_order  # type: ignore[attr-defined]

    # -- this rank's order ------------------------------------------------------------------------
    @property
    def order(self) -> np.ndarray:
        """Sample indices of this rank, in the order they are read (positions 0..len-1); made
        once on first use (O(n)): ``sample``/``samples`` cost O(1) a position without it."""
        order = self._order  # type: ignore[attr-defined]
        if order is None:
            order = self.epoch_order.all()
            object.__setattr__(self, "_order", order)
            if len(order) >= 100_000:  # the permutation's scratch arrays: 9 MB of a DataLoader worker's RSS at 1 M
                trim_heap()
        return order

    def __len__(self) -> int:
        return len(self.epoch_order)

    def known(self) -> int:
        """Positions known now: all (a StreamingPlan's grow as the listing comes, liststream.py)."""
        return len(self)

    def has(self, position: int) -> bool:
        return 0 <= position < len(self)

    def sample(self, position: int) -> int:
        """The sample index at ``position`` of this rank's order, made whole on the epoch's first
        read (``set_epoch`` stays O(1)): worked out a position at a time it cost a visible share of
        a warm sample's read (docs/performance.md, "Fork safety without gRPC")."""
        return int(self.order[position])

    def samples(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The sample indices at ``positions`` (int64)."""
        return self.order[np.asarray(positions, dtype=np.int64)]

    def remaining(self, samples_seen: int = 0) -> np.ndarray:
        return self.order[samples_seen:]

    # -- DataLoader workers ------------------------------------------------------------------------
    def worker_positions(self, worker_id: int, num_workers: int, batch_size: int = 1,
                         start: int = 0) -> np.ndarray:
        """Positions worker ``worker_id`` will be asked for when the loader starts at ``start``."""
        pos = np.arange(start, len(self), dtype=np.int64)
        batch = (pos - start) // max(1, batch_size)
        return pos[batch % max(1, num_workers) == worker_id]

    @staticmethod
    def upcoming(batch_start: int, batch_len: int, num_workers: int, end: int,
                 after: int | None = None) -> Iterator[int]:
        """Positions the same worker will be asked for after ``after`` (default: the batch's first).

        The rest of the current batch first, then the batches ``num_workers`` batches apart.
        """
        after = batch_start if after is None else after
        yield from range(after + 1, min(end, batch_start + batch_len))
        step = max(1, num_workers) * max(1, batch_len)
        start = batch_start + step
        while start < end:
            yield from range(start, min(end, start + batch_len))
            start += step

    # -- resume ------------------------------------------------------------------------------------
    def state(self, samples_seen: int) -> dict[str, Any]:
        return {"version": STATE_VERSION, "epoch": self.epoch, "seed": self.seed,
                "samples_seen": int(samples_seen), "offset": self.offset, "world_size": self.world_size,
                "n_samples": self.n_samples, "shuffle": self.shuffle, "drop_last": self.drop_last}

    @classmethod
    def resume(cls, state: dict[str, Any], *, n_samples: int, rank: int, world_size: int, shuffle: bool,
               drop_last: bool) -> tuple["EpochPlan", int]:
        """The plan and this rank's samples_seen that continue ``state`` (see the module doc)."""
        if state.get("version", STATE_VERSION) != STATE_VERSION:
            raise ValueError(f"unknown CacheDataset state version {state.get('version')}")
        # n_samples -1: saved before the listing of a streamed first epoch ended (liststream.py)
        if state["n_samples"] not in (n_samples, -1):
            raise ValueError(f"the state is for {state['n_samples']} samples, this dataset has {n_samples}")
        if bool(state["shuffle"]) != shuffle:
            raise ValueError("the state was saved with shuffle={}; this dataset has shuffle={}".format(
                state["shuffle"], shuffle))
        seen, offset, old_ws = int(state["samples_seen"]), int(state.get("offset", 0)), int(state["world_size"])
        same_deal = old_ws == world_size and bool(state["drop_last"]) == drop_last
        if not same_deal:  # re-deal what no rank has consumed yet
            offset, seen = min(n_samples, offset + seen * old_ws), 0
        plan = cls(n_samples, rank, world_size, int(state["seed"]), int(state["epoch"]), shuffle, drop_last, offset)
        if not 0 <= seen <= len(plan):
            raise ValueError(f"samples_seen {seen} is outside this rank's {len(plan)} samples")
        return plan, seen


class ShardOrder(Sequence[int]):
    """A BlockPlan's order (shards' id ranges in a permutation, from ``offset``, repeated from
    its start or cut to ``total``, see ``_to_rank_multiple``) as an int64 array would read, with
    O(shards) memory: an array of every sample was 8 bytes a sample in each process, a spawned
    DataLoader worker's pickle included. Positions are worked out when asked (a block's, a
    searchsorted over the shards)."""

    def __init__(self, counts: np.ndarray, shards: np.ndarray, offset: int, total: int) -> None:
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        moved = counts[shards]
        self._lands = np.concatenate([[0], np.cumsum(moved)]).astype(np.int64)  # where each lands
        self._from = starts[:-1][shards] if len(shards) else np.zeros(0, np.int64)  # its first id
        self._offset, self._rest, self._total = int(offset), int(starts[-1]) - int(offset), int(total)

    def __len__(self) -> int:
        return self._total

    def _at(self, q: np.ndarray) -> np.ndarray:
        if not len(q):
            return np.zeros(0, dtype=np.int64)
        p = self._offset + q % self._rest
        k = np.searchsorted(self._lands, p, "right") - 1
        return self._from[k] + (p - self._lands[k])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._at(np.arange(*i.indices(self._total), dtype=np.int64))
        if isinstance(i, (np.ndarray, list, tuple)):
            q = np.asarray(i, dtype=np.int64)
            q = np.where(q < 0, q + self._total, q)
            if len(q) and (q.min() < 0 or q.max() >= self._total):
                raise IndexError(f"position out of 0..{self._total}")
            return self._at(q)
        i = i.__index__()
        if i < 0:
            i += self._total
        if not 0 <= i < self._total:
            raise IndexError(f"position {i} of {self._total}")
        return self._at(np.array([i], dtype=np.int64))[0]

    def __iter__(self) -> Iterator[int]:
        for lo in range(0, self._total, 65536):
            yield from self._at(np.arange(lo, min(self._total, lo + 65536), dtype=np.int64)).tolist()

    def tolist(self) -> list[int]:
        return self[:].tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self[:]
        return a if dtype is None else a.astype(dtype)


def known_block(j: int, block: int, rank: int, world_size: int, seed: int, epoch: int,
                shuffle: bool) -> np.ndarray:
    """Block ``j`` of ``rank`` in an ordered BlockPlan (shards in file order, offset 0), for a
    caller that knows the data set holds at least ``(j + 1) * world_size * block`` samples: the
    block is then one of the full rounds, which padding and the last round never touch, and its
    ids are its positions. Equal to ``BlockPlan(..., ordered=True).block_samples(j)``."""
    start = (j * world_size + rank) * block
    return _within_block(np.arange(start, start + block, dtype=np.int64), seed, epoch, start, shuffle)


def _within_block(ids: np.ndarray, seed: int, epoch: int, start: int, shuffle: bool) -> np.ndarray:
    """A block's ids in the order they are yielded: shuffled by (seed, epoch, its start)."""
    if not shuffle or len(ids) < 2:
        return ids
    return ids[shuffled(len(ids), int(seed), int(epoch), 2, int(start))]


@dataclass(frozen=True)
class BlockPlan:
    """The epoch order of a sharded dataset, dealt in **blocks** of consecutive samples.

    A shard is read by byte range, so samples that follow each other in a shard should be read
    together. The global order keeps shards whole: the shards in a seeded permutation (by
    ``(seed, epoch)``), each shard's samples in file order. What has not been consumed yet
    (``order[offset:]``) is padded by repeating its start (or truncated, with ``drop_last``) to
    a multiple of ``world_size``, so every rank gets the same count, and cut into rounds:
    round k gives block k of every rank, ``block`` samples each (``rank * block`` into the
    round), and a last, shorter round splits what is left equally. Within a block the order is
    shuffled (seeded), which costs no extra reads.

    A DataLoader worker ``w`` of ``W`` takes its rank's blocks ``w, w + W, ...``: with the
    loader's ``batch_size`` equal to ``block``, batch i is block i, so what the loader has
    handed out is always a prefix of the rank's order, and the samples all ranks consumed in
    lock-step (``samples_seen`` each, a multiple of ``block``) are the prefix
    ``order[offset : offset + samples_seen * world_size]``. That is what resume with another
    world size continues from, as in EpochPlan.
    """

    counts: tuple[int, ...]
    block: int = 32
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    drop_last: bool = False
    offset: int = 0
    #: Shards in file order (blocks still shuffled within): the first epoch over shards that are
    #: being indexed on the way (shardscan.py), whose sample ids are then known shard by shard.
    ordered: bool = False

    def __post_init__(self) -> None:
        if any(c < 0 for c in self.counts):
            raise ValueError("shard sample counts must be >= 0")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        _check_deal(self.rank, self.world_size, self.offset, self.n_samples)
        object.__setattr__(self, "_rest", self._make_rest())

    @property
    def n_samples(self) -> int:
        return int(sum(self.counts))

    def _make_rest(self) -> "ShardOrder":
        counts = np.asarray(self.counts, dtype=np.int64)
        shards = _permutation(len(counts), self.seed, self.epoch, self.shuffle and not self.ordered)
        rest = len(counts) and int(counts.sum()) - self.offset
        total = (rest // self.world_size if self.drop_last else -(-rest // self.world_size)) * self.world_size
        return ShardOrder(counts, shards, self.offset, total)

    @property
    def order(self) -> "ShardOrder":
        """Every rank's samples of the rest of the epoch, padded, before dealing (global ids):
        indexable as an int64 array, with no array of them (``ShardOrder``)."""
        return self._rest  # type: ignore[attr-defined]

    def __len__(self) -> int:
        """Samples of this rank."""
        return len(self.order) // self.world_size

    @property
    def n_blocks(self) -> int:
        return -(-len(self) // self.block)

    def block_span(self, j: int) -> tuple[int, int]:
        """[start, end) of this rank's block ``j`` in ``order``."""
        if not 0 <= j < self.n_blocks:
            raise IndexError(f"block {j} is outside this rank's {self.n_blocks} blocks")
        full = len(self) // self.block
        if j < full:
            start = (j * self.world_size + self.rank) * self.block
            return start, start + self.block
        rem = len(self) - full * self.block
        base = full * self.world_size * self.block
        return base + self.rank * rem, base + (self.rank + 1) * rem

    def block_samples(self, j: int) -> np.ndarray:
        """Global sample ids of this rank's block ``j``, in the order they are yielded."""
        start, end = self.block_span(j)
        return _within_block(self.order[start:end], self.seed, self.epoch, start, self.shuffle)

    def rank_order(self) -> np.ndarray:
        """Global sample ids of this rank, in the order its blocks yield them."""
        if not self.n_blocks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.block_samples(j) for j in range(self.n_blocks)]).astype(np.int64)

    def worker_blocks(self, worker_id: int, num_workers: int, first: int = 0) -> range:
        """Blocks worker ``worker_id`` of ``num_workers`` reads, when the loader starts at ``first``."""
        return range(first + worker_id, self.n_blocks, max(1, num_workers))

    # -- resume ------------------------------------------------------------------------------------
    def state(self, samples_seen: int) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "blocks", "epoch": self.epoch, "seed": self.seed,
                "samples_seen": int(samples_seen), "offset": self.offset, "world_size": self.world_size,
                "n_samples": self.n_samples, "n_shards": len(self.counts), "block": self.block,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "ordered": self.ordered}

    @classmethod
    def resume(cls, state: dict[str, Any], *, counts: tuple[int, ...], block: int, rank: int, world_size: int,
               shuffle: bool, drop_last: bool) -> tuple["BlockPlan", int]:
        """The plan and this rank's samples_seen that continue ``state`` (see the class doc)."""
        if state.get("version") != STATE_VERSION or state.get("kind") != "blocks":
            raise ValueError("not a CacheIterableDataset state (version {}, kind {})".format(
                state.get("version"), state.get("kind")))
        # n_samples -1: saved while the shards were still being indexed (shardscan.py)
        if state["n_samples"] not in (sum(counts), -1) or state["n_shards"] != len(counts):
            raise ValueError(f"the state is for {state['n_samples']} samples in {state['n_shards']} shards; "
                             f"this dataset has {sum(counts)} in {len(counts)}")
        if bool(state["shuffle"]) != shuffle:
            raise ValueError(f"the state was saved with shuffle={state['shuffle']}; this dataset has {shuffle}")
        seen, offset, old_ws = int(state["samples_seen"]), int(state["offset"]), int(state["world_size"])
        ordered = bool(state.get("ordered", False))
        old = cls(counts, int(state["block"]), 0, old_ws, int(state["seed"]), int(state["epoch"]), shuffle,
                  bool(state["drop_last"]), offset, ordered)
        if not 0 <= seen <= len(old):
            raise ValueError(f"samples_seen {seen} is outside the {len(old)} samples of a rank")
        same_deal = old_ws == world_size and old.block == block and old.drop_last == drop_last
        if not same_deal:  # re-deal the prefix all ranks consumed
            if seen % old.block and seen != len(old):
                raise ValueError(f"cannot resume {seen} samples into a block of {old.block} with another world "
                                 "size, block or drop_last: resume at a batch boundary (batch_size == block)")
            offset, seen = min(old.n_samples, offset + seen * old_ws), 0
        plan = cls(counts, block, rank, world_size, int(state["seed"]), int(state["epoch"]), shuffle, drop_last,
                   offset, ordered)
        return plan, seen
