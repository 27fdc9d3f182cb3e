"""The worker daemon: wires config -> mounts, object store, page store, reader, gRPC, metrics."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from prometheus_client import start_http_server

from cachefs.config import WorkerConfig
from cachefs.mounts import MountTable
from cachefs.proto import worker_pb2_grpc
from cachefs.server.worker.metrics import WorkerMetrics
from cachefs.server.lifecycle import serve_until_signalled
from cachefs.server.objectstore import ObjectStore
from cachefs.server.pagestore import CacheDir, PageStore
from cachefs.server.worker.reader import PageReader, ReaderOptions
from cachefs.server.worker.registration import Registrar, worker_stats
from cachefs.server.worker.service import WorkerServicer

log = logging.getLogger(__name__)

# gRPC channel options shared by the worker and its clients: pages may exceed the 4 MiB default.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 80 << 20),
    ("grpc.max_receive_message_length", 80 << 20),
    ("grpc.so_reuseport", 0),
]


def _worker_id(first_cache_dir: str) -> str:
    """Stable across restarts: kept next to the pages it describes."""
    path = Path(first_cache_dir) / "worker-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        wid = uuid.uuid4().hex[:16]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(wid)
        os.replace(tmp, path)
        return wid


class Worker:
    """One worker. ``start()`` binds its ports (port 0 = pick one) and reports them as attributes."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.Server | None = None
        self._metrics_http = None
        self._stopped = threading.Event()
        self.metrics = WorkerMetrics()
        self.mounts = MountTable(config.mounts)
        self.objects = ObjectStore(self.mounts, config.metadata_ttl, config.list_ttl)
        self.pages = PageStore([CacheDir(d.path, d.quota_bytes) for d in config.cache_dirs], config.page_size)
        self.metrics.watch_page_store(self.pages.stats)
        self.reader = PageReader(
            self.pages,
            self.objects,
            self.metrics,
            ReaderOptions(
                fetch_threads=config.fetch_threads,
                write_threads=config.write_threads,
                parallel_pages=config.parallel_pages,
                fetch_group_pages=config.fetch_group_pages,
                readahead_pages=config.readahead_pages,
                store_timeout=config.store_timeout,
                max_pending_write_bytes=config.max_pending_write_bytes,
            ),
        )
        self.worker_id = _worker_id(config.cache_dirs[0].path)
        self.registrar: Registrar | None = None

    @property
    def address(self) -> str:
        """What clients dial: the advertised address, else the bound host and port."""
        if self.port is None:
            raise RuntimeError("worker is not started")
        if self.config.advertise_address:
            return self.config.advertise_address
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _on_mounts_changed(self, names: set[str]) -> None:
        for name in names:
            self.objects.forget_mount(name)

    def start(self) -> "Worker":
        server = grpc.server(
            ThreadPoolExecutor(self.config.rpc_threads, thread_name_prefix="cachefs-rpc"),
            options=GRPC_OPTIONS,
            maximum_concurrent_rpcs=self.config.rpc_threads * 4,
        )
        servicer = WorkerServicer(
            self.worker_id, self.mounts, self.objects, self.pages, self.reader, self.metrics,
            max_rpc_seconds=max(self.config.store_timeout * 4, 60.0),
        )
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        server.start()
        self._server, self.port = server, port
        if self.config.metrics_port >= 0:
            self._metrics_http, _ = start_http_server(
                self.config.metrics_port, addr=self.config.host, registry=self.metrics.registry
            )
            self.metrics_port = self._metrics_http.server_port
        if self.config.master:
            self.registrar = Registrar(
                self.config.master, self.worker_id, self.address, self.mounts,
                stats=lambda: worker_stats(self.pages.stats(), self.metrics.totals()),
                token=self.config.cluster_token, on_mounts_changed=self._on_mounts_changed,
            ).start()
        log.info("worker %s serving on %s (metrics port %s)", self.worker_id, self.address, self.metrics_port)
        return self

    def stop(self, grace: float | None = None) -> None:
        """Graceful: refuse new RPCs, let running ones finish within ``grace``, flush the page index."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.shutdown_grace if grace is None else grace
        if self.registrar is not None:
            self.registrar.stop()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self.reader.close(timeout=grace)
        self.pages.close()
        log.info("worker %s stopped", self.worker_id)

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(config: WorkerConfig) -> int:
    """Run a worker until SIGTERM/SIGINT; prints one JSON line with its ports when ready."""
    worker = Worker(config).start()
    return serve_until_signalled(
        worker.stop,
        ready={"worker_id": worker.worker_id, "address": worker.address, "port": worker.port,
               "metrics_port": worker.metrics_port},
        stopped={"worker_id": worker.worker_id},
    )
