"""The master daemon: wires config -> durable state, membership, view version, metadata cache,
jobs, gRPC, metrics."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from cachefs.auth import outgoing_token
from cachefs.config import MasterConfig
from cachefs.mountpolicy import MountPolicy, PolicedState
from cachefs.proto import master_pb2_grpc
from cachefs.ring import RingConfig
from cachefs.server.httpd import HttpEndpoints, HttpServer
from cachefs.store.s3config import pin_mount
from cachefs.server.connections import token_checker
from cachefs.server.master.catalog import Catalog
from cachefs.addresses import CLIENT_PORT_OFFSET
from cachefs.server.master.clientport import MasterClientPort
from cachefs.server.master.jobs import JobManager, JobRecord, JobSettings
from cachefs.server.master.loadrun import LoadProgress
from cachefs.server.master.metrics import MasterFigures, MasterMetrics
from cachefs.server.master.service import MasterServicer
from cachefs.server.master.state import MasterState
from cachefs.server.master.membership import Membership
from cachefs.server.master.stat import CacheStat
from cachefs.server.master.statuspage import StatusPage
from cachefs.server.lifecycle import liveness, serve_until_signalled
from cachefs.server.rpc import server_interceptors
from cachefs.server.master.viewversion import BOOT_SHIFT, ViewVersion
from cachefs.server.master.workerstubs import WorkerStubs
from cachefs.tls import bind_port, server_context

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.so_reuseport", 0)]
# Open WatchView streams each hold a server thread; they get their own share of the pool
# (threads start lazily) so unary calls (heartbeats above all) always find a free one.
MAX_WATCHERS = 256
# Calls that answer without the access token when ``open_status`` is set: the view is what
# `cachefs status` shows (workers, their stats, mount names and URLs; never credentials).
MASTER_OPEN_METHODS = ("GetView",)
#: Free ports picked for the client port before its gRPC neighbour is found free too (port 0).
PORT_PAIR_TRIES = 32


class Master:
    """One master. ``start()`` binds its ports (port 0 = pick one) and reports them as attributes."""

    def __init__(
        self,
        config: MasterConfig,
        clock: Callable[[], float] = time.monotonic,
        max_watchers: int = MAX_WATCHERS,
        watch_poll_seconds: float = 1.0,
    ) -> None:
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.Server | None = None
        self._metrics_http: HttpServer | None = None
        self.client_port: MasterClientPort | None = None  # the view for training processes (clientport.py)
        self._stopping = threading.Event()
        self.control = None  # several masters on etcd: the election and the state there
        if config.etcd:
            # Imported here: a master on SQLite (and every other process) never loads the etcd client.
            from cachefs.server.master.ha import ControlPlane

            self.versions = ViewVersion()
            self.control = ControlPlane(config, self.versions, self._lead, self._follow)
            self.state = self.control.state
            self.membership = self.control.membership
            self.master_id = self.control.master_id
        else:
            self.state = MasterState(config.state_dir)
            self.master_id = self.state.master_id
            added = self.state.ensure_mounts([pin_mount(m) for m in config.mounts])  # #49
            if added:
                log.info("added configured mounts %s", ", ".join(added))
            self.versions = ViewVersion(base=self.state.boot << BOOT_SHIFT)
            self.membership = Membership(config.lease_seconds, self.versions, clock=clock)
        # What the rest of the master sees: the state without the mounts the policy refuses
        # (cachefs/mountpolicy.py); AddMount checks the policy before it writes.
        self.policy = MountPolicy.from_config(config)
        self.served = PolicedState(self.state, self.policy)
        self.metrics = MasterMetrics()
        self._max_watchers = max_watchers
        self.catalog = Catalog(self.served, config.metadata_ttl, config.list_ttl)
        self.worker_stubs = WorkerStubs(outgoing_token(config.access_token, config.cluster_token), config.tls)
        self._ring = RingConfig(vnodes=config.vnodes, stripe_size=config.stripe_size)
        self.jobs = self._job_manager()
        self.metrics.watch(self._figures)
        self.servicer = MasterServicer(
            config, self.master_id, self.served, self.membership, self.versions, self.metrics, self._stopping,
            max_watchers=max_watchers, watch_poll_seconds=watch_poll_seconds,
            catalog=self.catalog, jobs=self.jobs, cache_stat=CacheStat(self.catalog, self.worker_stubs),
            control=self.control,
        )

    def _job_manager(self, epoch: int = 0) -> JobManager:
        """The jobs of a single master, or of one term as leader (``epoch``) among several."""
        config, ring = self.config, self._ring
        settle = 2 * config.heartbeat_seconds + 0.5  # every live worker has re-registered by then
        leading = None
        if self.control is not None:
            control = self.control
            leading = lambda: epoch != 0 and control.epoch == epoch  # noqa: E731
        return JobManager(
            self.served, self.catalog, self.membership.live, self.worker_stubs, lambda: ring,
            JobSettings(threads=config.job_threads, settle_seconds=settle,
                        settle_max_seconds=max(settle, 2 * config.lease_seconds, 15.0)),
            on_finish=self._job_finished, epoch=epoch, leading=leading,
        )

    def _lead(self, epoch: int) -> None:
        """This master was elected (etcd): configured mounts, then the jobs the last leader left."""
        try:
            added = self.state.ensure_mounts([pin_mount(m) for m in self.config.mounts])  # #49
            if added:
                log.info("added configured mounts %s", ", ".join(added))
        except OSError as exc:
            log.warning("could not add the configured mounts: %s", exc)
        jobs = self._job_manager(epoch)
        self.jobs = self.servicer.jobs = jobs
        resumed = jobs.start()
        log.info("master %s took over as leader (epoch %d); %d job(s) resumed", self.master_id, epoch, len(resumed))

    def _follow(self, epoch: int) -> None:
        """This master's term ended: stop dispatching at once; the records stay for the next leader."""
        self.jobs.stop(timeout=0.0)

    def _figures(self) -> MasterFigures:
        version, mounts = self.served.mounts()
        return MasterFigures(self.membership.stats(), self.versions.value, len(mounts), version,
                             jobs=self.jobs.counts(), worker_stats=[m.stats for m in self.membership.live()],
                             active_jobs=self.jobs.list(active_only=True),
                             leading=self.control is None or self.control.is_leader(),
                             leader_epoch=int(self.control.leader().get("epoch", 0)) if self.control else 0)

    def _job_finished(self, record: JobRecord, progress: LoadProgress | None) -> None:
        if progress is not None:
            self.metrics.job_bytes_loaded.inc(progress.bytes_loaded)
            self.metrics.job_bytes_skipped.inc(progress.bytes_skipped)
            self.metrics.job_objects.labels("done").inc(progress.objects_done)
            self.metrics.job_objects.labels("failed").inc(progress.objects_failed)

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("master is not started")
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def advertise(self) -> str:
        """What workers and the other masters dial to reach this one."""
        return self.config.advertise_address or self.address

    def _grpc_server(self) -> grpc.Server:
        threads = self.config.rpc_threads + self._max_watchers
        server = grpc.server(
            ThreadPoolExecutor(threads, thread_name_prefix="cachefs-master-rpc"),
            options=GRPC_OPTIONS,
            maximum_concurrent_rpcs=threads,
            interceptors=server_interceptors(self.config.access_token, self.config.cluster_token,
                                             MASTER_OPEN_METHODS if self.config.open_status else ()),
        )
        master_pb2_grpc.add_MasterServiceServicer_to_server(self.servicer, server)
        return server

    def _client_port(self, port: int) -> MasterClientPort:
        config = self.config
        return MasterClientPort(
            config.host, port, self.servicer.build_view, lambda: self.versions.value,
            token_checker([config.access_token, config.cluster_token]) if config.access_token else None,
            open_view=config.open_status, on_view_sent=self.metrics.views_sent.inc,
            tls_context=server_context(config.tls) if config.tls.cert_file else None).start()

    def _bind(self) -> tuple[grpc.Server, int]:
        """The gRPC server bound to its port, and the client port on the next one (clientport.py).
        With port 0 both are picked together; a fixed port whose neighbour is taken leaves the
        client port off (training processes then use gRPC), with a warning."""
        config, address = self.config, f"{self.config.host}:{{}}"
        if not config.client_port:
            server = self._grpc_server()
            return server, bind_port(server, address.format(config.port), config.tls)
        if config.port:
            server = self._grpc_server()
            port = bind_port(server, address.format(config.port), config.tls)
            try:
                self.client_port = self._client_port(port + CLIENT_PORT_OFFSET)
            except OSError as exc:
                log.warning("client port %d not served (%s): training processes will follow the view "
                            "through gRPC", port + CLIENT_PORT_OFFSET, exc)
            return server, port
        for _ in range(PORT_PAIR_TRIES):
            client = self._client_port(0)
            if client.port - CLIENT_PORT_OFFSET >= 1024:
                server = self._grpc_server()
                try:
                    port = bind_port(server, address.format(client.port - CLIENT_PORT_OFFSET), config.tls)
                except (OSError, RuntimeError):  # that neighbour is taken: another pair
                    port = 0
                if port:
                    self.client_port = client
                    return server, port
                server.stop(0)
            client.stop()
        raise OSError(f"no two free ports in a row on {config.host} after {PORT_PAIR_TRIES} tries")

    def start(self) -> "Master":
        server, port = self._bind()
        server.start()
        self._server, self.port = server, port
        if self.control is not None:
            self.control.start(self.advertise)
        self.membership.start_reaper()
        if self.control is None:
            self.jobs.start()  # on etcd, a master resumes jobs when it is elected
        if self.config.metrics_port >= 0:
            page = StatusPage(self.master_id, self.membership, self.versions, self.served, _CurrentJobs(self),
                              self.worker_stubs)
            self._metrics_http = HttpServer(self.config.host, self.config.metrics_port, HttpEndpoints(
                self.metrics.registry, live=self._live, ready=self._ready,
                pages={"/status": page.html}, redirects={"/": "/status"})).start()
            self.metrics_port = self._metrics_http.port
        log.info("master %s serving on %s (client port %s, metrics port %s)", self.master_id, self.address,
                 self.client_port.port if self.client_port is not None else "off", self.metrics_port)
        if not self.config.cluster_token and self.config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("no cluster token: anyone who reaches %s may register workers, change mounts "
                        "and read mount credentials", self.address)
        return self

    def stop(self, grace: float | None = None) -> None:
        """Graceful: end watch streams, refuse new RPCs, let running ones finish within ``grace``."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.versions.wake_all()
        grace = self.config.shutdown_grace if grace is None else grace
        if self.client_port is not None:
            self.client_port.stop()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1)
        self.jobs.stop(timeout=grace + 2)
        self.worker_stubs.close()
        if self.servicer.forwarder is not None:
            self.servicer.forwarder.close()
        self.membership.stop()
        if self.control is not None:
            self.control.stop()
        if self._metrics_http is not None:
            self._metrics_http.stop()
        self.state.close()
        log.info("master %s stopped", self.master_id)

    def _live(self) -> tuple[bool, str]:
        """/healthz: serving and not stopping."""
        return liveness(self._stopping, self._server)

    def _ready(self) -> tuple[bool, str]:
        """/readyz: live, and the durable state answers a query (a wedged disk makes the probe fail)."""
        live, why = self._live()
        if not live:
            return False, why
        if self.control is not None:
            # On etcd: ready once the state was loaded. A standby, or every master while etcd is
            # down, still serves the last view (the point of several masters): not a reason to drop it.
            return (True, "ok") if self.control.state.revision > 0 else (False, "state not loaded from etcd yet")
        try:
            self.state.jobs()  # a real query: a closed or broken SQLite state fails the probe
        except Exception as exc:
            return False, f"state unreadable: {type(exc).__name__}: {exc}"
        return True, "ok"

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopping.wait(timeout)

    def __enter__(self) -> "Master":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _CurrentJobs:
    """The jobs of the current term (each term as leader has its own manager)."""

    def __init__(self, master: Master) -> None:
        self._master = master

    def list(self, active_only: bool = False) -> list:
        return self._master.jobs.list(active_only=active_only)


def serve(config: MasterConfig) -> int:
    """Run a master until SIGTERM/SIGINT; prints one JSON line with its ports when ready."""
    master = Master(config).start()
    return serve_until_signalled(
        master.stop,
        ready={"master_id": master.master_id, "address": master.address, "port": master.port,
               "client_port": master.client_port.port if master.client_port is not None else None,
               "metrics_port": master.metrics_port},
        stopped={"master_id": master.master_id},
    )
