"""How much of a path is cached, and where: ``cachefs stat``.

For every object below the path, the workers that placement puts its stripes on (first
replica) are asked with ``GetCached``: one batch of paths per worker at a time, a few workers
at once, each call with a deadline. A worker that fails or times out counts 0 bytes; it does
not fail the stat (it is a report, and a dead worker really has nothing to offer).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from cachefs.paths import CachePath
from cachefs.proto import worker_pb2
from cachefs.ring import RingConfig
from cachefs.server.master.catalog import Catalog
from cachefs.server.master.membership import Member
from cachefs.server.master.placement import owners, ring_of
from cachefs.store.meta import ObjectMeta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatResult:
    root: ObjectMeta
    objects: int
    total_bytes: int
    cached_bytes: int
    shares: dict[str, int] = field(default_factory=dict)  # worker address -> bytes it holds of the path
    truncated: bool = False
    unreachable: tuple[str, ...] = ()  # workers that did not answer (counted 0)


class CacheStat:
    """Computes :class:`StatResult` from the catalog, the live workers and their ``GetCached``."""

    def __init__(
        self,
        catalog: Catalog,
        stubs: Callable[[str], Any],
        max_objects: int = 100_000,
        batch: int = 1000,
        concurrency: int = 8,
        timeout: float = 10.0,
    ) -> None:
        self.catalog = catalog
        self.stubs = stubs
        self.max_objects = max_objects
        self.batch = batch
        self.concurrency = concurrency
        self.timeout = timeout

    def stat(self, path: CachePath, members: Sequence[Member], ring_config: RingConfig,
             refresh: bool = False) -> StatResult:
        root, objects, truncated = self.catalog.objects_under(path, refresh=refresh, limit=self.max_objects)
        placed: dict[str, list[str]] = defaultdict(list)  # worker -> paths it should hold
        where: dict[str, list[str]] = {}
        if members:
            ring = ring_of(members, ring_config)
            for meta in objects:
                key = str(meta.path)
                where[key] = owners(ring, key, meta.size, 1)
                for worker in where[key]:
                    placed[worker].append(key)
        reported, unreachable = self._ask(placed)
        shares: dict[str, int] = defaultdict(int)
        cached = 0
        for meta in objects:
            key = str(meta.path)
            held = 0
            for worker in where.get(key, ()):
                part = min(meta.size, reported.get((worker, key), 0))
                shares[worker] += part
                held += part
            # Load puts whole objects on every stripe owner: never count more than the object.
            cached += min(meta.size, held)
        return StatResult(root, len(objects), sum(m.size for m in objects), cached, dict(shares), truncated,
                          tuple(sorted(unreachable)))

    def _ask(self, placed: dict[str, list[str]]) -> tuple[dict[tuple[str, str], int], set[str]]:
        calls = [(worker, paths[i:i + self.batch]) for worker, paths in placed.items()
                 for i in range(0, len(paths), self.batch)]
        reported: dict[tuple[str, str], int] = {}
        unreachable: set[str] = set()
        if not calls:
            return reported, unreachable
        with ThreadPoolExecutor(min(self.concurrency, len(calls)), thread_name_prefix="cachefs-stat") as pool:
            results = pool.map(lambda call: self._get_cached(*call), calls)
            for (worker, paths), sizes in zip(calls, results):
                if sizes is None:
                    unreachable.add(worker)
                    continue
                reported.update(((worker, p), int(n)) for p, n in zip(paths, sizes))
        return reported, unreachable

    def _get_cached(self, worker: str, paths: list[str]) -> list[int] | None:
        try:
            resp = self.stubs(worker).GetCached(worker_pb2.GetCachedRequest(paths=paths), timeout=self.timeout)
        except (grpc.RpcError, ConnectionError) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            log.info("stat: GetCached on %s failed (%s); counting 0", worker, getattr(code, "name", exc))
            return None
        sizes = list(resp.cached_bytes)
        if len(sizes) != len(paths):
            log.warning("stat: %s answered %d sizes for %d paths; counting 0", worker, len(sizes), len(paths))
            return None
        return sizes
