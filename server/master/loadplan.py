"""Planning a load job: which workers get which objects, in batches.

Each object goes to the first ``replicas`` workers of its placement. ``Load`` takes whole
objects, so an object larger than a stripe goes (whole) to every worker that owns any of its
stripes; loading only each worker's own stripes is future work (it needs ranges in Load).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cachefs.ring import HashRing
from cachefs.server.master.placement import owners
from cachefs.store.meta import ObjectMeta


@dataclass(frozen=True)
class Batch:
    """Objects for one ``Load`` call on one worker. ``attempt`` 1 is the one retry elsewhere."""

    worker: str
    paths: tuple[str, ...]
    nbytes: int
    attempt: int = 0


@dataclass
class LoadPlan:
    sizes: dict[str, int]  # path -> size
    targets: dict[str, list[str]]  # path -> workers it goes to
    queues: dict[str, deque[Batch]] = field(default_factory=dict)  # worker -> its batches

    @property
    def objects_total(self) -> int:
        return len(self.sizes)

    @property
    def bytes_total(self) -> int:
        """Bytes to place: each object's size once per worker it goes to."""
        return sum(self.sizes[p] * len(ws) for p, ws in self.targets.items())


def make_batches(worker: str, items: Iterable[tuple[str, int]], max_objects: int, max_bytes: int,
                 attempt: int = 0) -> list[Batch]:
    """Consecutive batches of at most ``max_objects`` paths and (unless one object is bigger) ``max_bytes``."""
    batches: list[Batch] = []
    paths: list[str] = []
    nbytes = 0
    for path, size in items:
        if paths and (len(paths) >= max_objects or nbytes + size > max_bytes):
            batches.append(Batch(worker, tuple(paths), nbytes, attempt))
            paths, nbytes = [], 0
        paths.append(path)
        nbytes += size
    if paths:
        batches.append(Batch(worker, tuple(paths), nbytes, attempt))
    return batches


def plan_load(ring: HashRing, objects: Iterable[ObjectMeta], replicas: int, max_objects: int,
              max_bytes: int) -> LoadPlan:
    """Placement of every object, then each worker's share cut into batches (in path order)."""
    sizes: dict[str, int] = {}
    targets: dict[str, list[str]] = {}
    per_worker: dict[str, list[tuple[str, int]]] = {}
    for meta in objects:
        path = str(meta.path)
        sizes[path] = meta.size
        targets[path] = owners(ring, path, meta.size, replicas)
        for worker in targets[path]:
            per_worker.setdefault(worker, []).append((path, meta.size))
    plan = LoadPlan(sizes, targets)
    for worker in sorted(per_worker):
        plan.queues[worker] = deque(make_batches(worker, per_worker[worker], max_objects, max_bytes))
    return plan
