"""A dataset's client counters, summed over the processes that read for it (DataLoader workers).

DataLoader workers are separate processes (forked or spawned, and with ``persistent_workers``
off, new ones every epoch); what they count must reach the training loop without going through
the batches (the user's ``collate_fn`` must see only samples). So the dataset's main process
makes a small file-backed block (``/dev/shm`` where there is one) when the dataset is made,
before any worker starts: one row of int64 counters per process, row 0 the process that made
it, row ``1 + id`` DataLoader worker ``id``. The block pickles as its path, so forked and
spawned workers open the same file. A process publishes its own running totals into its row
after each call (a few dozen integer stores; the counting itself is a few ``+=`` per read in
the session); a worker that finds its row already filled (the previous epoch's worker of that
id) adds to it, so the counters accumulate over epochs. ``totals()`` sums the rows.

Two loaders iterating one dataset object at the same time would share worker rows: give each
its own dataset.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import tempfile
import weakref
from typing import Any

import numpy as np

from cachefs.client import forksafe
from cachefs.client.forksafe import ProcessLocal

log = logging.getLogger(__name__)

#: The counters, in row order. ``*_ns`` are nanoseconds; ``max_*`` are maxima (not summed);
#: GAUGES are live values (each process's latest, summed over processes), the rest running totals.
COLUMNS: tuple[str, ...] = (
    "samples", "wait_ns", "transform_ns",
    "short_circuit_reads", "short_circuit_bytes", "held_reads", "held_bytes",
    "data_port_reads", "data_port_bytes", "grpc_reads", "grpc_bytes", "store_reads", "store_bytes",
    "lean_fallbacks", "lean_errors", "failovers",
    "hints_sent", "hint_paths", "hints_dropped", "hints_failed",
    "prefetch_hits", "prefetch_on_demand", "max_prefetch_in_flight_bytes",
    # pages read, by hit or miss as the worker knew them, per worker path (held_*: part of short_circuit_*)
    "short_circuit_hits", "short_circuit_misses", "held_hits", "held_misses", "data_port_hits",
    "grpc_hits", "grpc_misses", "errors", "hints_answered",
    "prefetch_in_flight", "prefetch_in_flight_bytes", "data_port_misses",
)
GAUGES = frozenset({"prefetch_in_flight", "prefetch_in_flight_bytes"})
_MAX = np.array([c.startswith("max_") for c in COLUMNS])  # for totals()
_MAX_AT = [i for i, c in enumerate(COLUMNS) if c.startswith("max_")]
_GAUGE_AT = [i for i, c in enumerate(COLUMNS) if c in GAUGES]
#: One row as the block holds it (native int64, numpy's layout): written with one pack_into, a
#: third of the cost of numpy's array arithmetic on a row this short.
_ROW = struct.Struct(f"={len(COLUMNS)}q")
#: Rows: the dataset's own process and up to this many - 1 DataLoader workers.
ROWS = 257


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _unlink(path: str, owner: int) -> None:
    if forksafe.pid() == owner:  # never from a forked child that inherited the dataset
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _Mapped:
    """The block mapped in one process, and where this process's rows started."""

    def __init__(self, path: str, rows: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, rows * len(COLUMNS) * 8)
        finally:
            os.close(fd)
        self.array = np.ndarray((rows, len(COLUMNS)), dtype=np.int64, buffer=self.map)
        self.base: dict[int, list[int]] = {}  # row -> its values when this process first wrote it


class CounterBlock:
    """The shared rows of one dataset's counters (see the module docstring)."""

    def __init__(self, path: str | None = None, rows: int = ROWS) -> None:
        self.rows = int(rows)
        if path is None:  # the creating (main) process
            path = self._create()
        self.path = path  # "": no block (counters off), never an error for the dataset
        self._local: ProcessLocal[_Mapped | None] = ProcessLocal(self._map, name="client counter block")

    def _create(self) -> str:
        try:
            fd, path = tempfile.mkstemp(prefix="cachefs-stats-", dir=_shm_dir())
        except OSError as exc:
            log.warning("client counters are off: cannot make their block: %s", exc)
            return ""
        try:
            os.ftruncate(fd, self.rows * len(COLUMNS) * 8)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, path, forksafe.pid())
        return path

    def _map(self) -> _Mapped | None:
        if not self.path:
            return None
        try:
            return _Mapped(self.path, self.rows)
        except OSError as exc:  # the creator is gone (its file with it): count nothing here
            log.warning("client counters are off in this process: cannot map %s: %s", self.path, exc)
            return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (CounterBlock, (self.path, self.rows))

    def publish(self, row: int, values: list[int]) -> None:
        """Set ``row`` to this process's running totals ``values`` (in COLUMNS order), on top of
        what the row held when this process first wrote it."""
        mapped = self._local.get()
        if mapped is None or not 0 <= row < self.rows:
            return
        base = mapped.base.get(row)
        if base is None:
            base = mapped.base[row] = mapped.array[row].tolist()
        out = [b + v for b, v in zip(base, values)]
        for i in _MAX_AT:
            out[i] = max(base[i], values[i])
        for i in _GAUGE_AT:
            out[i] = values[i]
        _ROW.pack_into(mapped.map, row * _ROW.size, *out)

    def totals(self) -> dict[str, int]:
        """Every row summed (maxima: the largest)."""
        mapped = self._local.get()
        if mapped is None:
            return dict.fromkeys(COLUMNS, 0)
        array = mapped.array.copy()
        summed = np.where(_MAX, array.max(axis=0), array.sum(axis=0))
        return {name: int(v) for name, v in zip(COLUMNS, summed)}


class ProcessCounts:
    """What one process's dataset counts itself (the session, prefetcher and hinter count the rest)."""

    __slots__ = ("row", "samples", "wait_ns", "transform_ns")

    def __init__(self, row: int) -> None:
        self.row = row  # 0: the dataset's own process; 1 + id: DataLoader worker id
        self.samples = self.wait_ns = self.transform_ns = 0

    def values(self, session: Any, prefetcher: Any, hinter: Any) -> list[int]:
        """This process's running totals in COLUMNS order."""
        c = session.counters()
        h, p = hinter.stats, prefetcher.stats
        return [self.samples, self.wait_ns, self.transform_ns,
                c["short_circuit_reads"], c["short_circuit_bytes"], c["held_reads"], c["held_bytes"],
                c["data_port_reads"], c["data_port_bytes"], c["grpc_reads"], c["grpc_bytes"],
                c["store_reads"], c["store_bytes"], c["lean_fallbacks"], c["lean_errors"], c["failovers"],
                h["sent"], h["paths"], h["dropped"], h["failed"],
                p["hits"], p["on_demand"], p["max_in_flight_bytes"],
                c["short_circuit_hits"], c["short_circuit_misses"], c["held_hits"], c["held_misses"],
                c["data_port_hits"], c["grpc_hits"], c["grpc_misses"], c["errors"], h["answered"],
                prefetcher.in_flight, prefetcher.in_flight_bytes, c["data_port_misses"]]


def describe(totals: dict[str, int]) -> dict[str, Any]:
    """``totals`` plus derived numbers: ``wait_s`` (time reading inside the dataset's calls,
    transform excluded), ``bytes`` and ``reads`` (all paths), ``hits`` and ``misses`` (pages, all
    worker paths; store fallback reads are neither: no cache saw them) and ``hit_ratio``."""
    out: dict[str, Any] = dict(totals)
    out["wait_s"] = max(0, totals["wait_ns"] - totals["transform_ns"]) / 1e9
    out["bytes"] = sum(totals[f"{k}_bytes"] for k in ("short_circuit", "data_port", "grpc", "store"))
    out["reads"] = sum(totals[f"{k}_reads"] for k in ("short_circuit", "data_port", "grpc", "store"))
    out["hits"] = totals["short_circuit_hits"] + totals["data_port_hits"] + totals["grpc_hits"]
    out["misses"] = totals["short_circuit_misses"] + totals["data_port_misses"] + totals["grpc_misses"]
    looked = out["hits"] + out["misses"]
    out["hit_ratio"] = out["hits"] / looked if looked else 0.0
    return out
