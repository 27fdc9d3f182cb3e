"""The worker's Prometheus metrics, in a registry of its own (no process-global state).

Counters that the page store already keeps (pages, bytes, evictions, corrupt pages) are
read from it at scrape time by a collector rather than mirrored on every operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cachefs.server.pagestore import PageStoreStats

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _PageStoreCollector(Collector):
    def __init__(self, stats: Callable[[], PageStoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("cachefs_worker_cache_pages", "Pages held in the page store.", value=s.pages)
        yield GaugeMetricFamily("cachefs_worker_cache_used_bytes", "Bytes of page files on disk.", value=s.used_bytes)
        yield GaugeMetricFamily(
            "cachefs_worker_cache_capacity_bytes", "Sum of the cache directories' quotas.", value=s.capacity_bytes
        )
        yield CounterMetricFamily(
            "cachefs_worker_cache_evictions", "Pages evicted to stay within quota.", value=s.evictions
        )
        yield CounterMetricFamily(
            "cachefs_worker_cache_corrupt_pages", "Pages dropped because their checksum failed.", value=s.corrupt_pages
        )
        yield CounterMetricFamily(
            "cachefs_worker_cache_put_failures", "Pages that could not be written (full or failing disk).",
            value=s.put_failures,
        )
        yield CounterMetricFamily(
            "cachefs_worker_cache_disk_errors",
            "Cache disk errors: failed page writes (ENOSPC, EIO, ...) and page reads failing with a disk errno.",
            value=s.disk_errors,
        )
        yield GaugeMetricFamily(
            "cachefs_worker_degraded",
            "1 while the cache disk is full or failing (reads pass through to the store, uncached).",
            value=int(s.degraded),
        )
        yield GaugeMetricFamily(
            "cachefs_worker_held_unlinked_bytes",
            "Bytes of evicted or freed page files that local clients may still read through held "
            "descriptors (counted in used bytes, so within the quota, for 5 s after they leave or "
            "until their hold ends if sooner).",
            value=s.held_unlinked_bytes,
        )
        policy = GaugeMetricFamily(
            "cachefs_worker_eviction_policy",
            "1 for the page store's eviction policy: future (next use in registered plans) or lru.",
            labels=["policy"],
        )
        policy.add_metric([s.policy], 1)
        yield policy
        yield CounterMetricFamily(
            "cachefs_worker_cache_bypassed_admissions",
            "Pages that registered plans read later than every cached page: served, and cached only "
            "until the next page needs room.",
            value=s.bypassed,
        )
        yield CounterMetricFamily(
            "cachefs_worker_cache_passing_dropped",
            "Pages served but not admitted that left memory before their reader took them "
            "(a later read fetches them again).",
            value=s.passing_dropped,
        )
        yield CounterMetricFamily(
            "cachefs_worker_cache_page_write_cpu_seconds",
            "CPU seconds spent writing page files (the payload copied into the page cache, its "
            "trailer, the rename): what caching cold bytes costs beyond fetching them.",
            value=s.write_cpu_s,
        )
        yield GaugeMetricFamily(
            "cachefs_worker_cache_index_pending",
            "Page index rows and deletions queued, not yet written (a crash now loses those pages; "
            "written within 0.1 s).",
            value=s.index_pending,
        )


class _RawServersCollector(Collector):
    """Connections of the short-circuit socket and the data port (server/connections.py)."""

    def __init__(self, servers: Callable[[], dict[str, Any]]) -> None:
        self._servers = servers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        conns = GaugeMetricFamily("cachefs_worker_raw_connections",
                                  "Open connections of the raw servers (short-circuit socket, data port).",
                                  labels=["server"])
        threads = GaugeMetricFamily("cachefs_worker_raw_threads",
                                    "Serving threads of the raw servers (bounded, whatever the connections).",
                                    labels=["server"])
        closed = CounterMetricFamily("cachefs_worker_raw_connections_closed",
                                     "Raw-server connections refused (over a limit) or closed for a timeout "
                                     "(idle, or a request not whole in time).", labels=["server", "why"])
        for name, server in self._servers().items():
            if server is None:
                continue
            st = server.stats()
            conns.add_metric([name], st["connections"])
            threads.add_metric([name], st["threads"])
            for why in ("refused", "closed_idle", "closed_frame"):
                closed.add_metric([name, why.removeprefix("closed_")], st[why])
        yield conns
        yield threads
        yield closed


class _HitRatioCollector(Collector):
    """The lifetime hit ratio, for people and dashboards without PromQL at hand.

    Reads the page-read counter's own samples (not the registry: a collector that scraped its
    registry would recurse).
    """

    def __init__(self, page_reads: Counter) -> None:
        self._page_reads = page_reads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts: dict[str, float] = {}
        for family in self._page_reads.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels.get("outcome", "")] = sample.value
        hits = counts.get("hit", 0.0)
        lookups = hits + counts.get("miss", 0.0) + counts.get("joined", 0.0)
        yield GaugeMetricFamily(
            "cachefs_worker_cache_hit_ratio",
            "Page lookups served from the page store / all client page lookups, since start (0 before any).",
            value=hits / lookups if lookups else 0.0,
        )


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.bytes_from_cache = Counter(
            "cachefs_worker_bytes_from_cache", "Bytes served to clients out of the page store.", registry=r
        )
        self.bytes_from_store = Counter(
            "cachefs_worker_bytes_from_store", "Bytes fetched from the object store.", registry=r
        )
        self.bytes_served = Counter("cachefs_worker_bytes_served", "Bytes sent to clients.", registry=r)
        self.short_circuit_bytes = Counter(
            "cachefs_worker_short_circuit_bytes",
            "Bytes of cached pages handed to clients on this host as file descriptors (short-circuit reads).",
            registry=r)
        self.handed_out_bytes = Counter(
            "cachefs_worker_handed_out_bytes",
            "Bytes of page files handed to clients on this host ahead of their reads (a batch's or an "
            "open's pages); the reads through them are counted when the client reports them.",
            registry=r)
        self.fill_ranges = Counter(
            "cachefs_worker_fill_ranges",
            "Cold ranges local clients asked to have fetched into the page store and handed out, by "
            "outcome: filled, busy (too many fills at once: read through gRPC), failed, late (not "
            "cached within the fill deadline).",
            ["outcome"],
            registry=r)
        self.data_port_bytes = Counter(
            "cachefs_worker_data_port_bytes",
            "Bytes of cached pages sent through the data port (TCP, sendfile) instead of gRPC.",
            registry=r)
        self.page_reads = Counter(
            "cachefs_worker_page_reads",
            "Page lookups by outcome: hit (page store), miss (fetched), joined (shared a fetch "
            "already in flight), prefetch (read-ahead or load fetch).",
            ["outcome"],
            registry=r,
        )
        self.writes_dropped = Counter(
            "cachefs_worker_page_writes_dropped",
            "Fetched pages served but not cached because too many bytes were waiting for the disk.",
            registry=r,
        )
        self.store_requests = Counter(
            "cachefs_worker_store_requests",
            "Requests sent to the object store by kind: info (HEAD), open (one GET bringing the metadata and the "
            "first pages of a cold object, shared by callers opening it at once), read (a ranged GET of a page "
            "run), list.",
            ["kind"], registry=r)
        self.store_errors = Counter("cachefs_worker_store_errors", "Failed object-store fetches.", registry=r)
        self.store_unavailable = Counter(
            "cachefs_worker_store_unavailable",
            "Object-store fetches failed because the store could not be reached (or its breaker was open).",
            registry=r,
        )
        self.store_fetch_seconds = Histogram(
            "cachefs_worker_store_fetch_seconds", "Time to fetch one page from the object store.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.request_seconds = Histogram(
            "cachefs_worker_request_seconds", "RPC latency by method (streams: until the last chunk).",
            ["method"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "cachefs_worker_requests", "RPCs by method and status code.", ["method", "code"], registry=r
        )
        self.socket_operations = Counter(
            "cachefs_worker_socket_operations",
            "Operations other than reads answered on the worker's sockets (short-circuit socket, data port), "
            "by operation (info, list, view, status, plan, load, hello, remove, mkdir, copy, free, write: a "
            "write counted once, at its commit or its failure) and outcome (ok, error).",
            ["op", "outcome"], registry=r,
        )
        self.plans = Gauge("cachefs_worker_plans", "Training jobs' read plans registered (eviction follows them).",
                           registry=r)
        self.load_not_admitted = Counter(
            "cachefs_worker_load_not_admitted",
            "Objects of Load requests (hints included) not fetched: registered plans read them later "
            "than every cached page.", registry=r,
        )
        self.load_bytes = Counter(
            "cachefs_worker_load_bytes",
            "Bytes of objects named in Load requests, by outcome: fetched (from the store by a load, "
            "re-fetches included), skipped (already cached), failed (size of objects a load reported failed).",
            ["outcome"],
            registry=r,
        )
        self.pages_freed = Counter(
            "cachefs_worker_pages_freed", "Pages dropped from the page store by Free requests.", registry=r
        )
        self.stale_leader_commands = Counter(
            "cachefs_worker_stale_leader_commands",
            "Load/Free commands refused because they came from a master whose leadership had ended.",
            registry=r,
        )
        self.named_page_reads = Counter(
            "cachefs_worker_named_page_reads",
            "Page reads local clients made by opening page files by name (reported afterwards; "
            "also counted as page-store hits).", registry=r)
        self.held_page_reads = Counter(
            "cachefs_worker_held_page_reads",
            "Page reads local clients made through descriptors they held (reported afterwards; "
            "also counted as page-store hits).", registry=r)
        self.held_handles = Gauge(
            "cachefs_worker_held_handles", "Pages with a slot in the held-handle table (handed out, still cached).",
            registry=r)
        for outcome in ("hit", "miss", "joined", "prefetch"):
            self.page_reads.labels(outcome)
        for outcome in ("fetched", "skipped", "failed"):
            self.load_bytes.labels(outcome)
        r.register(_HitRatioCollector(self.page_reads))

    def watch_page_store(self, stats: Callable[[], PageStoreStats]) -> None:
        self.registry.register(_PageStoreCollector(stats))

    def served_short_circuit(self, pages: int, nbytes: int, misses: int = 0) -> None:
        """A short-circuit read (page file descriptors over the Unix socket); ``misses``: of the
        pages, those fetched for this request (a fill)."""
        self._served_bulk(self.short_circuit_bytes, pages, nbytes, misses)

    def read_by_name(self, pages: int, nbytes: int) -> None:
        """Pages a local client read by opening the page files itself (server/worker/names.py)."""
        self.named_page_reads.inc(pages)
        self._served_bulk(self.short_circuit_bytes, pages, nbytes)

    def read_through_held(self, pages: int, nbytes: int) -> None:
        """Pages a local client read through held descriptors (the worker learns of them later):
        counted as cached short-circuit reads."""
        self.held_page_reads.inc(pages)
        self._served_bulk(self.short_circuit_bytes, pages, nbytes)

    def watch_raw_servers(self, servers: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_RawServersCollector(servers))

    def watch_handles(self, in_use: Callable[[], int]) -> None:
        self.held_handles.set_function(in_use)

    def socket_operation(self, op: str, ok: bool) -> None:
        self.socket_operations.labels(op, "ok" if ok else "error").inc()

    def served_data_port(self, pages: int, nbytes: int, misses: int = 0) -> None:
        """A read through the data port (page files sent with sendfile); ``misses`` as above."""
        self._served_bulk(self.data_port_bytes, pages, nbytes, misses)

    def _served_bulk(self, path_bytes: Counter, pages: int, nbytes: int, misses: int = 0) -> None:
        """Page lookups (a page filled for the request a miss, the rest hits) and bytes from cache
        like any other cached read, plus the path's own count."""
        if pages > misses:
            self.page_reads.labels("hit").inc(pages - misses)
        if misses:
            self.page_reads.labels("miss").inc(misses)
        self.bytes_from_cache.inc(nbytes)
        self.bytes_served.inc(nbytes)
        path_bytes.inc(nbytes)

    def totals(self) -> dict[str, int]:
        """Running totals that the status RPC and the master's view report."""
        sample = self.registry.get_sample_value

        def reads(outcome: str) -> int:
            return int(sample("cachefs_worker_page_reads_total", {"outcome": outcome}) or 0)

        return {
            "hits": reads("hit"),
            "misses": reads("miss") + reads("joined"),
            "bytes_from_cache": int(sample("cachefs_worker_bytes_from_cache_total") or 0),
            "bytes_from_store": int(sample("cachefs_worker_bytes_from_store_total") or 0),
        }

    def hit_ratio(self) -> float:
        t = self.totals()
        lookups = t["hits"] + t["misses"]
        return t["hits"] / lookups if lookups else 0.0
