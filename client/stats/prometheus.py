"""A training job's client counters for Prometheus: one port for all its processes, or a push.

The counters of every process that reads for a dataset (the training process and each
DataLoader worker) already meet in the dataset's shared counter block (jobstats.py), so the
training process alone can expose the whole job: a collector reads ``ds.stats()`` at scrape
time and a small HTTP server serves it. No prometheus-client multiprocess directory, no
environment variable to set before the workers start, and spawned workers are covered too.

    server = cachefs.client.stats.prometheus.serve(9400, datasets=[ds], timer=timer)   # scrape :9400
    ...
    cachefs.client.stats.prometheus.push("pushgateway:9091", "train", datasets=[ds])   # or push

Names and help texts are in docs/metrics.md ("Client"); ``tests/test_metrics_docs.py`` checks
them against a live job.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cachefs.client.stats.steptimer import StepTimer

#: Disjoint read paths, as the ``path`` label has them (held: part of short_circuit in ds.stats()).
PATHS = ("held", "short_circuit", "data_port", "grpc", "store")


def _by_path(stats: dict[str, Any], suffix: str) -> dict[str, float]:
    out = {p: float(stats.get(f"{p}_{suffix}", 0)) for p in PATHS}
    out["short_circuit"] -= out["held"]  # the rest of the short-circuit reads: each asked the worker
    return out


class JobCollector:
    """Collects the summed counters of ``datasets`` (and a ``StepTimer``'s totals) at scrape time."""

    def __init__(self, datasets: Sequence[Any] = (), timer: StepTimer | None = None) -> None:
        self.datasets, self.timer = list(datasets), timer

    def _stats(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for ds in self.datasets:
            for k, v in ds.stats().items():
                if k.startswith("max_"):
                    total[k] = max(total.get(k, 0), v)
                elif isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + v
        return total

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only (registering needs no scrape)

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if self.datasets:
            yield _counter("samples", "Samples the job's datasets handed out (all its processes).",
                           s.get("samples", 0))
            yield _counter("wait_seconds", "Time the datasets' calls spent reading through cachefs "
                           "(transform excluded), summed over processes.", s.get("wait_s", 0.0))
            for name, unit, help_text in (("reads", "reads", "Reads by path taken: held (page handles held "
                                           "here, no message), short_circuit, data_port, grpc, store (fallback)."),
                                          ("bytes", "bytes", "Bytes read by path taken.")):
                family = CounterMetricFamily(f"cachefs_client_{name}", help_text, labels=["path"])
                for path, value in _by_path(s, unit).items():
                    family.add_metric([path], value)
                yield family
            pages = CounterMetricFamily("cachefs_client_pages", "Pages read by path and by hit or miss as the "
                                        "worker knew them (miss: fetched from the store for this job's request).",
                                        labels=["path", "outcome"])
            held = {"hit": s.get("held_hits", 0), "miss": s.get("held_misses", 0)}
            for path, hit, miss in (("held", held["hit"], held["miss"]),
                                    ("short_circuit", s.get("short_circuit_hits", 0) - held["hit"],
                                     s.get("short_circuit_misses", 0) - held["miss"]),
                                    ("data_port", s.get("data_port_hits", 0), s.get("data_port_misses", 0)),
                                    ("grpc", s.get("grpc_hits", 0), s.get("grpc_misses", 0))):
                pages.add_metric([path, "hit"], float(hit))
                pages.add_metric([path, "miss"], float(miss))
            yield pages
            yield _counter("lean_fallbacks", "Reads a lean path (short-circuit, data port) sent to gRPC "
                           "(not cached there, or refused).", s.get("lean_fallbacks", 0))
            yield _counter("lean_errors", "Lean-path reads that failed and were read through gRPC.",
                           s.get("lean_errors", 0))
            yield _counter("failovers", "Worker faults that moved a call to the next worker (or the store).",
                           s.get("failovers", 0))
            yield _counter("errors", "Reads that failed for their caller.", s.get("errors", 0))
            hints = CounterMetricFamily("cachefs_client_hints", "Hints (Load requests of upcoming samples) "
                                        "by outcome: sent, answered, dropped (not sent: too many in flight), "
                                        "failed.", labels=["outcome"])
            for outcome, key in (("sent", "hints_sent"), ("answered", "hints_answered"),
                                 ("dropped", "hints_dropped"), ("failed", "hints_failed")):
                hints.add_metric([outcome], float(s.get(key, 0)))
            yield hints
            prefetch = CounterMetricFamily("cachefs_client_prefetch", "Samples (or blocks) asked for, by "
                                           "outcome: hit (prefetched), on_demand (read when asked).",
                                           labels=["outcome"])
            prefetch.add_metric(["hit"], float(s.get("prefetch_hits", 0)))
            prefetch.add_metric(["on_demand"], float(s.get("prefetch_on_demand", 0)))
            yield prefetch
            yield _gauge("prefetch_in_flight", "Prefetches queued, running or waiting to be asked for, "
                         "summed over processes (as each last published).", s.get("prefetch_in_flight", 0))
            yield _gauge("prefetch_in_flight_bytes", "Payload bytes of those prefetches.",
                         s.get("prefetch_in_flight_bytes", 0))
        if self.timer is not None:
            summary = self.timer.summary()
            yield _counter("steps", "Training steps timed by StepTimer (each pass's first batch apart).",
                           summary.steps)
            yield _counter("step_wait_seconds", "Time the loop waited for its next batch (first batches apart).",
                           summary.wait_s)
            yield _counter("step_compute_seconds", "Time the loop spent between batches (first batches apart).",
                           summary.compute_s)
            yield _gauge("step_wait_share", "Data-wait share of the steps so far (first batches apart).",
                         summary.wait_share)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"cachefs_client_{name}", help_text, value=float(value))


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"cachefs_client_{name}", help_text, value=float(value))


def registry(datasets: Iterable[Any] = (), timer: StepTimer | None = None) -> CollectorRegistry:
    """A registry of its own holding the job's collector (never the global default registry)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(JobCollector(list(datasets), timer))
    return reg


class MetricsServer:
    """The HTTP server of ``serve``: ``port`` it listens on, ``close()`` to stop it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(port: int = 0, *, datasets: Iterable[Any] = (), timer: StepTimer | None = None,
          addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the job's counters on ``addr:port`` (0: a free port) from this (the training)
    process; DataLoader workers' counters are included through each dataset's shared block."""
    server, thread = start_http_server(port, addr=addr, registry=registry(datasets, timer))
    return MetricsServer(server, thread)


def push(gateway: str, job: str, *, datasets: Iterable[Any] = (), timer: StepTimer | None = None,
         grouping_key: dict[str, str] | None = None, timeout: float = 10.0) -> None:
    """Push the job's counters to a Prometheus Pushgateway (e.g. at the end of each epoch)."""
    push_to_gateway(gateway, job=job, registry=registry(datasets, timer), grouping_key=grouping_key,
                    timeout=timeout)
