"""Showing a running job: a redrawn bar on a terminal, plain periodic lines in a log or pipe."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

BAR_WIDTH = 24


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class JobProgress:
    """Renders a ``Job`` message's progress: bytes, objects, rate, ETA.

    On a terminal the line is redrawn in place (at most every ``tty_interval``); otherwise a
    new line is written every ``interval`` seconds, so logs stay readable.
    """

    def __init__(self, stream: TextIO, tty: bool | None = None, interval: float = 2.0, tty_interval: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.interval = tty_interval if self.tty else interval
        self._clock = clock
        self._start: tuple[float, int] | None = None
        self._last_draw = float("-inf")
        self._drawn = False

    def line(self, job: Any) -> str:
        now = self._clock()
        if self._start is None:
            self._start = (now, job.bytes_done)
        t0, b0 = self._start
        rate = (job.bytes_done - b0) / (now - t0) if now > t0 else 0.0
        fraction = job.bytes_done / job.bytes_total if job.bytes_total else (1.0 if job.objects_total == 0 else 0.0)
        finished = job.objects_done + job.objects_failed
        # A load still listing knows only the totals so far: no fraction, no ETA, "+" on the totals.
        listing = bool(getattr(job, "listing", False))
        more = "+" if listing else ""
        parts = ["listing" if listing else f"{fraction * 100:5.1f}%",
                 f"{human_bytes(job.bytes_done)} / {human_bytes(job.bytes_total)}{more}",
                 f"{finished}/{job.objects_total}{more} objects"
                 + (f" ({job.objects_failed} failed)" if job.objects_failed else "")]
        parts.append(f"{human_bytes(rate)}/s" if rate > 0 else "-/s")
        left = job.bytes_total - job.bytes_done
        parts.append(f"ETA {duration(left / rate)}" if rate > 0 and left > 0 and not listing else "ETA -")
        if listing:
            fraction = 0.0
        if self.tty:
            filled = int(BAR_WIDTH * min(1.0, fraction))
            return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "] " + "  ".join(parts)
        return ", ".join(parts)

    def update(self, job: Any, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._last_draw < self.interval:
            if self._start is None:
                self.line(job)  # start the rate clock at the first sighting
            return
        self._last_draw = now
        text = self.line(job)
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self._drawn = True
        else:
            self.stream.write(f"job {job.job_id}: {text}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line (a terminal), so what follows starts on its own line."""
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
