"""The master's Prometheus metrics, in a registry of its own (no process-global state).

Figures that membership and the state already keep (live workers, registrations,
expirations, versions, mounts) are read from them at scrape time by a collector rather
than mirrored on every change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cachefs.server.master.membership import MembershipStats

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)


@dataclass(frozen=True)
class MasterFigures:
    membership: MembershipStats
    view_version: int
    mounts: int
    mounts_version: int
    jobs: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (kind, state) -> jobs
    # The live workers' last heartbeat stats (master_pb2.WorkerStats; None before the first).
    worker_stats: Sequence[Any] = ()
    # Jobs pending or running (master_pb2.Job): their progress, summed.
    active_jobs: Sequence[Any] = ()
    leading: bool = True  # a single master always; on etcd, while this master leads
    leader_epoch: int = 0  # on etcd: the epoch of the leader this master knows (0: none, or SQLite)


class _MasterCollector(Collector):
    def __init__(self, figures: Callable[[], MasterFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        f = self._figures()
        m = f.membership
        yield GaugeMetricFamily("cachefs_master_workers_live", "Workers whose lease holds.", value=m.live)
        yield GaugeMetricFamily("cachefs_master_view_version", "Version of the cluster view.", value=f.view_version)
        yield GaugeMetricFamily("cachefs_master_mounts", "Mounts in the mount table.", value=f.mounts)
        yield GaugeMetricFamily(
            "cachefs_master_mounts_version", "Version of the durable mount table.", value=f.mounts_version
        )
        yield GaugeMetricFamily("cachefs_master_leader", "1 while this master leads (always, for a single master).",
                                value=int(f.leading))
        yield GaugeMetricFamily("cachefs_master_leader_epoch",
                                "Epoch of the leading master as this one knows it (0: single master, or none).",
                                value=f.leader_epoch)
        yield CounterMetricFamily(
            "cachefs_master_registrations", "Worker registrations (joins and re-joins).", value=m.registrations
        )
        yield CounterMetricFamily("cachefs_master_heartbeats", "Accepted worker heartbeats.", value=m.heartbeats)
        yield CounterMetricFamily(
            "cachefs_master_expirations", "Workers removed from the view because their lease ran out.",
            value=m.expirations,
        )
        jobs = GaugeMetricFamily("cachefs_master_jobs", "Jobs the master knows, by kind and state.",
                                 labels=["kind", "state"])
        for (kind, state), count in sorted(f.jobs.items()):
            jobs.add_metric([kind, state], count)
        yield jobs
        yield from _cluster_families(f.worker_stats)
        yield from _job_progress_families(f.active_jobs)


def _cluster_families(stats: Sequence[Any]) -> Iterator[GaugeMetricFamily]:
    """The cluster's cache as the workers' heartbeats last reported it (one scrape for a whole cluster)."""
    known = [s for s in stats if s is not None]

    def total(name: str) -> int:
        return sum(int(getattr(s, name)) for s in known)

    yield GaugeMetricFamily("cachefs_master_cluster_capacity_bytes",
                            "Sum of the live workers' page-store quotas (last heartbeats).",
                            value=total("capacity_bytes"))
    yield GaugeMetricFamily("cachefs_master_cluster_used_bytes",
                            "Sum of the live workers' page-store usage (last heartbeats).", value=total("used_bytes"))
    yield GaugeMetricFamily("cachefs_master_cluster_pages", "Pages held by the live workers (last heartbeats).",
                            value=total("pages"))
    hits, lookups = total("hits"), total("hits") + total("misses")
    yield GaugeMetricFamily("cachefs_master_cluster_hit_ratio",
                            "Live workers' page hits / lookups since each started (last heartbeats).",
                            value=hits / lookups if lookups else 0.0)


def _job_progress_families(active: Sequence[Any]) -> Iterator[GaugeMetricFamily]:
    """How far the pending and running jobs are, summed (a job's own figures: `cachefs jobs`)."""
    objects = GaugeMetricFamily("cachefs_master_active_job_objects",
                                "Objects of pending/running jobs: planned (total), finished (done), failed.",
                                labels=["part"])
    for part, name in (("total", "objects_total"), ("done", "objects_done"), ("failed", "objects_failed")):
        objects.add_metric([part], sum(getattr(j, name) for j in active))
    yield objects
    size = GaugeMetricFamily("cachefs_master_active_job_bytes",
                             "Bytes of pending/running jobs: planned (total), loaded or found cached (done), "
                             "of which already cached (skipped).", labels=["part"])
    for part, name in (("total", "bytes_total"), ("done", "bytes_done"), ("skipped", "bytes_skipped")):
        size.add_metric([part], sum(getattr(j, name) for j in active))
    yield size


class MasterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_seconds = Histogram(
            "cachefs_master_request_seconds", "Unary RPC latency by method (watch streams are not timed).",
            ["method"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "cachefs_master_requests", "RPCs by method and status code.", ["method", "code"], registry=r
        )
        self.watchers = Gauge("cachefs_master_watchers", "Open WatchView streams.", registry=r)
        self.views_sent = Counter("cachefs_master_views_sent", "Views sent on WatchView streams and the client "
                                  "port (a poll with an unchanged view sends none).", registry=r)
        self.job_bytes_loaded = Counter(
            "cachefs_master_job_bytes_loaded", "Bytes load jobs made workers fetch from the store.", registry=r
        )
        self.job_bytes_skipped = Counter(
            "cachefs_master_job_bytes_skipped", "Bytes load jobs found already cached.", registry=r
        )
        self.job_objects = Counter(
            "cachefs_master_job_objects", "Objects finished by load jobs, by outcome.", ["outcome"], registry=r
        )

    def watch(self, figures: Callable[[], MasterFigures]) -> None:
        self.registry.register(_MasterCollector(figures))
