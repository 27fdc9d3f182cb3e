"""StepTimer: is the training loop waiting for data? Measured where the wait is felt.

    timer = cachefs.StepTimer()
    for epoch in range(epochs):
        for batch in timer(loader):      # the loop waits inside next(loader); it computes between
            ...
        print(timer.report())

Per step it records the time ``next()`` on the loader took (data wait) and the time from the
batch being handed out to the next ``next()`` (compute). The first batch of every pass over
the loader also pays the DataLoader's start-up (worker processes, first reads), so it is kept
apart (``startup_s``) and the data-wait share is taken over the steps after it. With CUDA the
loop only sees compute time if something in it waits for the GPU (``loss.item()``, a sync);
otherwise queued kernels look like time spent waiting for the next batch's copy.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

#: A data-wait share above this (after each pass's first batch) is reported as input-bound.
DEFAULT_THRESHOLD = 0.10
#: Steps whose median wait is under this found their batch ready: what they waited for is the
#: DataLoader handing it over from its worker process (~1.2 ms a batch here with torch's default
#: sharing strategy, ~0.5 ms with "file_system"), not reading.
HANDOFF_S = 0.002


@dataclass(frozen=True)
class StepSummary:
    """Totals of the steps seen (first batches of each pass apart)."""

    steps: int
    wait_s: float
    compute_s: float
    startup_s: float
    wait_share: float  # wait / (wait + compute), first batches excluded
    recent_wait_share: float  # the same over the last ``window`` steps
    input_bound: bool

    def scalars(self) -> dict[str, float]:
        """Flat numbers, e.g. for TensorBoard."""
        return {"steps": float(self.steps), "wait_s": self.wait_s, "compute_s": self.compute_s,
                "startup_s": self.startup_s, "wait_share": self.wait_share,
                "recent_wait_share": self.recent_wait_share}


class StepTimer:
    """Times a training loop's steps: data wait vs compute, and says when input is the bottleneck."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, window: int = 100) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be a share between 0 and 1, not {threshold!r}")
        if window < 1:
            raise ValueError(f"window must be at least 1 step, not {window!r}")
        self.threshold = float(threshold)
        self.steps = 0
        self.wait_s = self.compute_s = self.startup_s = 0.0
        self.passes = 0
        #: (wait, compute) seconds of the most recent steps (first batches excluded)
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(window))
        self._loader: dict[str, Any] = {}

    def __call__(self, batches: Iterable[T], *, loader: Any = None) -> Iterator[T]:
        """Iterate ``batches`` (a DataLoader, or e.g. ``ds.track(loader)``: then pass ``loader``
        too, for the advice), timing each step."""
        source = batches if loader is None else loader
        self._loader = {k: getattr(source, k) for k in ("num_workers", "pin_memory", "batch_size")
                        if hasattr(source, k)}
        self.passes += 1
        return self._timed(batches)

    def _timed(self, batches: Iterable[T]) -> Iterator[T]:
        asked = time.perf_counter()
        it = iter(batches)  # DataLoader workers start here: part of the first batch's wait
        first = True
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            got = time.perf_counter()
            if first:  # start-up: worker processes, first reads; kept out of the share
                self.startup_s += got - asked
            yield batch
            # Recorded when the loop asks for the next batch (a loop left by break records
            # nothing for its last step: its compute time is not known).
            wait, asked = got - asked, time.perf_counter()
            if first:
                first = False
            else:
                self._record(wait, asked - got)

    def _record(self, wait: float, compute: float) -> None:
        self.wait_s += wait
        self.compute_s += compute
        self.steps += 1
        self.recent.append((wait, compute))

    def mark(self) -> tuple[int, float, float, float]:
        """Where the totals stand now: ``summary(since=mark)`` covers only the steps after it
        (e.g. one epoch's)."""
        return self.steps, self.wait_s, self.compute_s, self.startup_s

    def summary(self, since: tuple[int, float, float, float] | None = None) -> StepSummary:
        """Totals of every step timed, or of those after ``since`` (a ``mark()``)."""
        if since is not None:
            steps, wait, compute, startup = (a - b for a, b in zip(self.mark(), since))
            total = wait + compute
            share = wait / total if total > 0 else 0.0
            return StepSummary(int(steps), wait, compute, startup, share, self._recent_share(),
                               steps > 0 and share > self.threshold)
        total = self.wait_s + self.compute_s
        share = self.wait_s / total if total > 0 else 0.0
        return StepSummary(self.steps, self.wait_s, self.compute_s, self.startup_s, share, self._recent_share(),
                           self.steps > 0 and share > self.threshold)

    def _recent_share(self) -> float:
        rw = sum(w for w, _ in self.recent)
        rt = rw + sum(c for _, c in self.recent)
        return rw / rt if rt > 0 else 0.0

    def advice(self) -> list[str]:
        """What to try when input is the bottleneck, given what is known of the loader."""
        tips = []
        workers = self._loader.get("num_workers")
        waits = sorted(w for w, _ in self.recent)
        median = waits[len(waits) // 2] if waits else 0.0
        if workers and median < HANDOFF_S:
            tips.append(f"most steps waited only {1000 * median:.1f} ms, so their batch was ready: that is the "
                        f"DataLoader handing it over from a worker process (with torch's default sharing "
                        f"strategy the training process asks that process for each batch's descriptor); "
                        f"torch.multiprocessing.set_sharing_strategy('file_system') makes it cheaper, "
                        f"and a larger batch makes it rarer")
        if workers is not None:
            tips.append(f"more DataLoader workers (num_workers is {workers}; each prefetches its own batches)")
        else:
            tips.append("more DataLoader workers (num_workers)")
        if self._loader.get("pin_memory") is False:
            tips.append("pin_memory=True (and .to(device, non_blocking=True)) when training on a GPU")
        tips.append("a warm cache: `cachefs load <prefix>` before the job (a cold read waits for the "
                    "object store; hints only reach a few hundred samples ahead)")
        tips.append("larger samples or shards (CacheIterableDataset over tar shards: one range read per batch)")
        return tips

    def report(self) -> str:
        """A few plain lines: the split of the time, and whether input is the bottleneck."""
        s = self.summary()
        if s.steps == 0:
            return "StepTimer: no steps timed yet (the first batch of each pass only counts as start-up)"
        lines = [f"StepTimer: {s.steps} steps after the first batch: waiting for data {s.wait_s:.2f} s, "
                 f"computing {s.compute_s:.2f} s; data-wait share {100 * s.wait_share:.1f}% "
                 f"(last {len(self.recent)} steps: {100 * s.recent_wait_share:.1f}%); "
                 f"start-up (first batch of {self.passes} pass{'es' if self.passes != 1 else ''}) "
                 f"{s.startup_s:.2f} s"]
        if s.input_bound:
            lines.append(f"INPUT-BOUND: the loop waits for data {100 * s.wait_share:.0f}% of the time "
                         f"(threshold {100 * self.threshold:.0f}%). Try:")
            lines.extend(f"  - {tip}" for tip in self.advice())
        else:
            lines.append(f"not input-bound: data wait {100 * s.wait_share:.1f}% is under the "
                         f"{100 * self.threshold:.0f}% threshold")
        return "\n".join(lines)
