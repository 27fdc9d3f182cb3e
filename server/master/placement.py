"""Placement as the master computes it: the same ring every client builds from the view.

Clients route each stripe of an object to ``ring.nodes(stripe_key(path, offset))``; the master
must agree exactly, or a load job would fill workers that readers never ask.
"""

from __future__ import annotations

from collections.abc import Iterable

from cachefs.ring import HashRing, RingConfig, stripe_key
from cachefs.server.master.membership import Member


def ring_of(members: Iterable[Member], config: RingConfig) -> HashRing:
    """The ring over the live workers' addresses (what clients key the ring by)."""
    return HashRing(sorted({m.address for m in members}), config)


def stripe_count(size: int, stripe_size: int) -> int:
    """Placement stripes of an object (an empty object still has stripe 0)."""
    return max(1, -(-size // stripe_size))


def owners(ring: HashRing, path: str, size: int, replicas: int = 1) -> list[str]:
    """Distinct workers holding any stripe of ``path`` (its first ``replicas`` per stripe).

    Stripe 0's workers come first, in ring order; a small object has exactly ``replicas``.
    """
    stripe = ring.config.stripe_size
    found: list[str] = []
    seen: set[str] = set()
    for index in range(stripe_count(size, stripe)):
        for worker in ring.nodes(stripe_key(path, index * stripe, stripe), replicas):
            if worker not in seen:
                seen.add(worker)
                found.append(worker)
    return found


def next_node(ring: HashRing, path: str, exclude: Iterable[str]) -> str | None:
    """The first worker in ``path``'s ring order not in ``exclude`` (where a failed copy goes next)."""
    excluded = set(exclude)
    for worker in ring.nodes(path, len(ring)):
        if worker not in excluded:
            return worker
    return None
