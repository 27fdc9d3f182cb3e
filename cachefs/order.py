"""Sample orders that cachefs defines itself: the same in every process, release and numpy version.

numpy's ``Generator`` streams are not promised stable across numpy versions (NEP 19), and an order
that a worker must compute exactly as the client's sampler does (server/worker/plans.py derives a
job's read order from its seed and epoch, instead of being sent it sample by sample) cannot rest on
them. So the epoch order is a **keyed Feistel permutation** over ``[0, n)``: four rounds of a
splitmix64-style mixer on a domain of ``2**(2h) >= n`` bits (``h`` per half), with cycle walking
back into ``[0, n)``. It takes O(1) memory, any one index is computed in O(1) (a few rounds, under
4 walks expected) and a whole permutation with a few vectorised numpy passes. Only fixed-width
unsigned integer arithmetic is used (wrapping multiplication, shifts, xor), which numpy and Python
integers compute the same on every platform.

``EpochOrder`` is one rank's order in an epoch, the way ``client/sampling.EpochPlan`` deals it
(padding by repeating the rest from its start, or ``drop_last``; ranks interleaved; an ``offset``
into the epoch after a resume with another world size). ``digest`` condenses an order by probing
fixed positions: a worker that derives an order sends nothing back unless its digest is the
client's (the client then falls back to sending the order itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["EpochOrder", "Permutation", "digest", "plan_digest", "probe_positions", "ORDER_VERSION"]

#: Changes whenever an order computed here changes: part of every digest.
ORDER_VERSION = 1
ROUNDS = 4
PROBES = 64
_M64 = (1 << 64) - 1
_C1, _C2, _GAMMA = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int (64-bit, wrapping)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _C1) & _M64
    x = ((x ^ (x >> 27)) * _C2) & _M64
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """The same on a uint64 array (numpy wraps uint64 arithmetic on arrays)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_C1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_C2)
    return x ^ (x >> np.uint64(31))


def shuffled(n: int, *key: int) -> np.ndarray:
    """A permutation of ``[0, n)`` keyed by integers, made whole at once: the indices sorted by the
    keyed mix of each (one vectorized pass and a sort, the same on every numpy). For small sets
    read whole, such as a tar block's samples, where a :class:`Permutation`'s per-position
    Feistel rounds and cycle walking cost ten times as much."""
    state = _mix(_GAMMA ^ ORDER_VERSION ^ 0x5348)
    for k in key:
        state = _mix((state ^ (int(k) & _M64)) + _GAMMA)
    scores = _mix_array(np.arange(n, dtype=np.uint64) + np.uint64(state))
    return np.argsort(scores, kind="stable").astype(np.int64)


class Permutation:
    """A bijection of ``[0, n)`` keyed by integers (seed, epoch, ...): ``p(i)`` for one index,
    ``p.array(indices)`` for many, ``p.array(np.arange(n))`` for the whole permutation."""

    def __init__(self, n: int, *key: int) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = int(n)
        bits = max(2, (max(1, self.n) - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        state = _mix(_GAMMA ^ ORDER_VERSION)
        for k in key:
            state = _mix((state ^ (int(k) & _M64)) + _GAMMA)
        self.keys = [_mix(state + (r + 1) * _GAMMA) for r in range(ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def _decrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in reversed(self.keys):
            left, right = right ^ (_mix(left ^ k) & self.mask), left
        return (left << self.half) | right

    def inverse(self, v: int) -> int:
        """The ``i`` with ``p(i) == v``: O(1), the same walk backwards."""
        if not 0 <= v < self.n:
            raise IndexError(f"{v} is outside [0, {self.n})")
        x = self._decrypt(int(v))
        while x >= self.n:
            x = self._decrypt(x)
        return x

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        x = self._encrypt(int(i))
        while x >= self.n:  # cycle walking: the domain is under 4 n, so a few steps at most on average
            x = self._encrypt(x)
        return x

    def _encrypt_array(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64(self.mask)
        left, right = x >> half, x & mask
        for k in self.keys:
            left, right = right, left ^ (_mix_array(right ^ np.uint64(k)) & mask)
        return (left << half) | right

    def inverse_array(self) -> np.ndarray:
        """The whole inverse: ``out[v] == i`` where ``p(i) == v`` (int32 below 2**31, else int64);
        one vectorised pass, for a caller that inverts many values (``inverse`` walks the
        rounds in Python, cycle walking included: several microseconds a value)."""
        dtype = np.int32 if self.n < 1 << 31 else np.int64
        out = np.empty(self.n, dtype=dtype)
        out[self.array(np.arange(self.n, dtype=np.int64))] = np.arange(self.n, dtype=dtype)
        return out

    def array(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """``p(i)`` for every ``i`` of ``indices`` (int64 out)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"indices outside [0, {self.n})")
        x = self._encrypt_array(idx.astype(np.uint64).ravel())
        n = np.uint64(self.n)
        out = x
        todo = np.flatnonzero(out >= n)
        while todo.size:
            walked = self._encrypt_array(out[todo])
            out[todo] = walked
            todo = todo[walked >= n]
        return out.astype(np.int64).reshape(idx.shape)


@dataclass(frozen=True)
class EpochOrder:
    """Rank ``rank``'s samples in epoch ``epoch``: position ``p`` reads ``at(p)``. The global
    order is ``Permutation(n, seed, epoch)`` (the identity without ``shuffle``); its rest after
    ``offset`` is padded by repeating it from its start (or cut, ``drop_last``) to a multiple
    of ``world_size`` and dealt interleaved (rank r: positions r, r + world_size, ...)."""

    n_samples: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    drop_last: bool = False
    offset: int = 0

    def __post_init__(self) -> None:
        if self.n_samples < 0:
            raise ValueError(f"n_samples must be >= 0, got {self.n_samples}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if not 0 <= self.offset <= self.n_samples:
            raise ValueError(f"offset {self.offset} is outside 0..{self.n_samples}")
        rest = self.n_samples - self.offset
        per_rank = rest // self.world_size if self.drop_last else -(-rest // self.world_size)
        object.__setattr__(self, "_rest", rest)
        object.__setattr__(self, "_len", per_rank)
        object.__setattr__(self, "_perm", Permutation(self.n_samples, self.seed, self.epoch)
                           if self.shuffle else None)

    def __len__(self) -> int:
        return self._len  # type: ignore[attr-defined]

    def at(self, position: int) -> int:
        """The sample at ``position`` of this rank's order: O(1)."""
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} is outside this rank's {len(self)} samples")
        g = self.offset + (position * self.world_size + self.rank) % self._rest  # type: ignore[attr-defined]
        perm = self._perm  # type: ignore[attr-defined]
        return g if perm is None else perm(g)

    def array(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """The samples at ``positions`` (int64)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= len(self)):
            raise IndexError(f"positions outside this rank's {len(self)} samples")
        g = self.offset + (pos * self.world_size + self.rank) % max(1, self._rest)  # type: ignore[attr-defined]
        perm = self._perm  # type: ignore[attr-defined]
        return g if perm is None else perm.array(g)

    def positions_of(self, sample: int) -> list[int]:
        """Every position of this rank that reads ``sample`` (ascending; two where padding repeats
        it, none where another rank reads it): O(1), by the permutation's inverse."""
        perm = self._perm  # type: ignore[attr-defined]
        return self.positions_of_global(sample if perm is None else perm.inverse(sample))

    def positions_of_global(self, g: int) -> list[int]:
        """``positions_of`` for the sample at index ``g`` of the epoch's global order (shared by
        every rank: a caller asking for several ranks inverts the permutation once)."""
        rest = self._rest  # type: ignore[attr-defined]
        if g < self.offset or rest <= 0:
            return []
        out, j, total = [], g - self.offset, len(self) * self.world_size
        while j < total:
            if j % self.world_size == self.rank:
                out.append(j // self.world_size)
            j += rest
        return out

    def global_index(self, sample: int) -> int:
        """Where ``sample`` is in the epoch's global order (before the deal)."""
        perm = self._perm  # type: ignore[attr-defined]
        return sample if perm is None else perm.inverse(sample)

    @property
    def rest(self) -> int:
        """Samples of the global order after ``offset`` (what is dealt)."""
        return self._rest  # type: ignore[attr-defined]

    @property
    def permutation(self) -> Permutation | None:
        """The epoch's global order (None: the identity, unshuffled)."""
        return self._perm  # type: ignore[attr-defined]

    @property
    def key(self) -> tuple[int, int, int, bool]:
        """What the global order depends on: orders with the same key share ``global_index``."""
        return (self.n_samples, self.seed, self.epoch, self.shuffle)

    def all(self) -> np.ndarray:
        return self.array(np.arange(len(self), dtype=np.int64))


def probe_positions(length: int, probes: int = PROBES) -> list[int]:
    """Fixed positions of an order of ``length`` that its digest reads (first, last, spread)."""
    if length <= 0:
        return []
    return sorted({i * (length - 1) // max(1, probes - 1) for i in range(probes)})


def digest(kind: str, length: int, values: Sequence[int]) -> str:
    """The digest of an order of ``length`` whose samples at ``probe_positions(length)`` are ``values``."""
    h = hashlib.blake2b(f"cachefs-order:{ORDER_VERSION}:{kind}:{length}:".encode(), digest_size=16)
    h.update(np.asarray(list(values), dtype="<i8").tobytes())
    return h.hexdigest()


def plan_digest(now: EpochOrder, start: int, after: EpochOrder) -> str:
    """The digest of a read plan (``now`` from position ``start``, then all of ``after``),
    probed one position at a time: O(1), what a client sends with the plan's definition."""
    rest = len(now) - start
    length = rest + len(after)
    values = [now.at(start + p) if p < rest else after.at(p - rest) for p in probe_positions(length)]
    return digest("epoch", length, values)
