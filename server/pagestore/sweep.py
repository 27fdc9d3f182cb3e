"""Debris left by a crash, removed in the background after a start: reads never wait for it.

Why: a restart trusts the page index (no stat or open per page: at a million pages that walk took
~35 s before the worker served a read). What a crash can leave besides the index:

* tmp files (``<dir>/tmp``) of writes it tore: named ``<digest>.<pid>-<n>.tmp``, so any not of
  this process is debris (the dir's lock says no other process writes here);
* orphan page files: renamed into place, their row still queued when the process died (rows are
  written behind, rows.py), or pages of an index found unreadable and emptied. Only after an
  unclean stop (no ``clean`` mark, dirs.py) or an index reset are the fan-out dirs walked.

Bounded: one fan-out dir listed at a time (``os.scandir``: names only, no stat), its names checked
against the store in slices of ``SLICE`` under the store's lock, files unlinked outside it, and a
pause between dirs. A name the sweep is about to remove is claimed first, so a put of that page
waits for the next try instead of having its fresh file unlinked (the store's ``claim``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

from cachefs.server.pagestore.dirs import DirHandle, remove_path

__all__ = ["SLICE", "Sweeper"]

log = logging.getLogger(__name__)

SLICE = 1024  # names checked per hold of the store's lock
PAUSE_S = 0.002  # after each fan-out dir with files: the sweep yields the CPU to reads

#: ``claim(dir, names)``: of these page names in their right fan-out dir, those no page of the
#: store owns, now reserved for removal; ``release(names)`` ends the reservation.
Claim = Callable[[DirHandle, list[str]], list[str]]
Release = Callable[[list[str]], None]


class Sweeper:
    """One background thread over the store's dirs; ``orphans[i]``: walk dir i's page files too."""

    def __init__(self, dirs: Sequence[DirHandle], orphans: Sequence[bool], claim: Claim, release: Release) -> None:
        self._dirs = list(dirs)
        self._orphans = list(orphans)
        self._claim, self._release = claim, release
        self._stop = threading.Event()
        self.done = threading.Event()
        self.swept = [not o for o in self._orphans]  # dir i has no orphan left to find (close() marks it clean)
        self.started = False
        self.tmp_removed = self.orphans_removed = 0
        self._thread = threading.Thread(target=self._run, name="pagestore-sweep", daemon=True)

    def need_orphans(self, i: int) -> None:
        """Dir i's page files must be walked too (its index was found unreadable); before start()."""
        self._orphans[i], self.swept[i] = True, False

    def start(self) -> None:
        self.started = True
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Ask the thread to stop and wait up to ``timeout`` s (an unfinished dir stays unswept)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)

    def _run(self) -> None:
        try:
            for d in self._dirs:
                self.tmp_removed += self._sweep_tmp(d)
            for i, d in enumerate(self._dirs):
                if self._orphans[i] and not self._stop.is_set():
                    self.orphans_removed += self._sweep_pages(d)
                    self.swept[i] = not self._stop.is_set()
            if self.tmp_removed or self.orphans_removed:
                log.info("page store: removed %d tmp and %d orphan files in the background",
                         self.tmp_removed, self.orphans_removed)
        except Exception:  # debris only costs disk space: never let it take the store down
            log.exception("page store debris sweep failed")
        finally:
            self.done.set()

    def _sweep_tmp(self, d: DirHandle) -> int:
        mine = f".{os.getpid()}-"
        removed = 0
        try:
            names = os.listdir(d.tmp)
        except OSError as exc:
            log.warning("cannot list %s: %s", d.tmp, exc)
            return 0
        for name in names:
            if mine not in name:  # this process's are writes under way
                remove_path(os.path.join(d.tmp, name))
                removed += 1
        return removed

    def _sweep_pages(self, d: DirHandle) -> int:
        removed = 0
        for fan in sorted(os.listdir(d.pages)):
            if self._stop.is_set():
                break
            fan_path = os.path.join(d.pages, fan)
            if len(fan) != 2 or not os.path.isdir(fan_path) or os.path.islink(fan_path):
                continue  # DirHandle repairs the 256 fan-out dirs at open; anything else is not ours
            try:
                with os.scandir(fan_path) as it:
                    names = [e.name for e in it]
            except OSError as exc:
                log.warning("cannot list %s: %s", fan_path, exc)
                continue
            stray = [n for n in names if n[:2] != fan]  # never a page's path: no put writes there
            for name in stray:
                remove_path(os.path.join(fan_path, name))
            removed += len(stray)
            names = [n for n in names if n[:2] == fan]
            for i in range(0, len(names), SLICE):
                claimed = self._claim(d, names[i:i + SLICE])
                try:
                    for name in claimed:
                        remove_path(os.path.join(fan_path, name))
                finally:
                    self._release(claimed)
                removed += len(claimed)
            if names:
                self._stop.wait(PAUSE_S)
        return removed
