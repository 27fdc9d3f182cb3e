"""Planning a load job, one listing page at a time: which workers get which objects, in batches.

Each object goes to the first ``replicas`` workers of its placement. ``Load`` takes whole
objects, so an object larger than a stripe goes (whole) to every worker that owns any of its
stripes; loading only each worker's own stripes is future work (it needs ranges in Load).
A page is planned when the run has room for it (``loadrun.py``), so the leader holds the plan
of a few pages, never of the whole prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cachefs.ring import HashRing
from cachefs.server.master.placement import owners


@dataclass(frozen=True)
class Batch:
    """Objects for one ``Load`` call on one worker, all from listing page ``page``.
    ``attempt`` 1 is the one retry elsewhere."""

    worker: str
    paths: tuple[str, ...]
    nbytes: int
    attempt: int = 0
    page: int = 0


@dataclass(frozen=True)
class Page:
    """One listing request's objects (path, size) in key order, and the name the listing goes
    on after (the job's cursor once every object of this page and those before it is done)."""

    objects: list[tuple[str, int]]
    last: str


def make_batches(worker: str, items: Iterable[tuple[str, int]], max_objects: int, max_bytes: int,
                 attempt: int = 0, page: int = 0) -> list[Batch]:
    """Consecutive batches of at most ``max_objects`` paths and (unless one object is bigger) ``max_bytes``."""
    batches: list[Batch] = []
    paths: list[str] = []
    nbytes = 0
    for path, size in items:
        if paths and (len(paths) >= max_objects or nbytes + size > max_bytes):
            batches.append(Batch(worker, tuple(paths), nbytes, attempt, page))
            paths, nbytes = [], 0
        paths.append(path)
        nbytes += size
    if paths:
        batches.append(Batch(worker, tuple(paths), nbytes, attempt, page))
    return batches


def plan_page(ring: HashRing, objects: Iterable[tuple[str, int]], replicas: int, max_objects: int,
              max_bytes: int, page: int = 0) -> tuple[dict[str, list[str]], dict[str, list[Batch]]]:
    """(each object's target workers, each worker's batches of this page in path order)."""
    targets: dict[str, list[str]] = {}
    per_worker: dict[str, list[tuple[str, int]]] = {}
    for path, size in objects:
        targets[path] = owners(ring, path, size, replicas)
        for worker in targets[path]:
            per_worker.setdefault(worker, []).append((path, size))
    batches = {worker: make_batches(worker, items, max_objects, max_bytes, page=page)
               for worker, items in sorted(per_worker.items())}
    return targets, batches
