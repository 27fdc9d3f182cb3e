"""Reused buffers for the byte runs a tar block is read into (client/datasets/iterable.py).

A block's samples are views of one tensor per run of nearby samples (up to ~8 MiB). A new
``torch.empty`` of that size per run comes from ``mmap`` or from heap memory glibc has just
trimmed, so every run faulted its pages in again (3-11 minor faults a sample in a warm
workers-0 epoch), and on a VM whose host takes back freed memory a first touch costs far more
than the copy. The same few buffers reused instead: 0.2 faults a sample, ~60 us a sample
against 73-104 (scratch harness, docs/performance.md).

A buffer is reused only once nothing refers to its memory: no sample view of it is alive (the
DataLoader collated them, or the user dropped them), counted by the storage's own reference
count; a buffer whose memory was moved to shared memory (samples sent uncollated from a
DataLoader worker: another process reads it) leaves the pool for good. A sample the user keeps keeps its buffer out of the pool; past ``max_bytes`` of buffers
a run gets a fresh tensor, as before. One pool per process (forked DataLoader workers build
their own, as they build their file system).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["RunBuffers"]

_ROUND = 1 << 20  # buffers are whole MiB: runs of similar length share them

try:  # the storage's reference count; without it (another torch), no reuse: fresh tensors as before
    _use_count = torch._C._storage_Use_Count
except AttributeError:  # pragma: no cover - every torch this package supports has it
    _use_count = None


def _unreferenced(buffer: torch.Tensor) -> bool:
    """True if only ``buffer`` itself (and the probe's own storage handle) refer to its memory."""
    return _use_count is not None and _use_count(buffer.untyped_storage()._cdata) <= 2


class RunBuffers:
    """Aligned uint8 buffers handed out as views, taken back when no view of them is alive."""

    def __init__(self, max_bytes: int = 96 << 20) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._buffers: list[torch.Tensor] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = {"reused": 0, "new": 0, "unpooled": 0, "shared": 0}

    def take(self, n: int) -> torch.Tensor:
        """A writable, 64-byte-aligned uint8 tensor of ``n`` bytes (its contents are garbage)."""
        if _use_count is not None:
            with self._lock:
                shared = [b for b in self._buffers if b.is_shared()]
                if shared:  # sent to another process (a DataLoader worker's uncollated samples):
                    # its memory is theirs now, whatever this process still refers to
                    self._buffers = [b for b in self._buffers if not b.is_shared()]
                    self._bytes -= sum(len(b) for b in shared)
                    self.stats["shared"] += len(shared)
                for buffer in self._buffers:
                    if len(buffer) >= n and _unreferenced(buffer):
                        self.stats["reused"] += 1
                        return buffer[:n]  # a view: the buffer counts as in use until it dies
                size = -(-max(n, 1) // _ROUND) * _ROUND
                if self._bytes + size <= self.max_bytes:
                    buffer = torch.empty(size, dtype=torch.uint8)
                    self._buffers.append(buffer)
                    self._bytes += size
                    self.stats["new"] += 1
                    return buffer[:n]
                self.stats["unpooled"] += 1
        return torch.empty(n, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes of buffers kept (in use or free)."""
        return self._bytes
