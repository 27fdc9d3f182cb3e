"""Running daemons as child processes on this machine (the demo, tests, ``cachefs local`` and its
Supervisor, which restarts a daemon that exits)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachefs.addresses import split_address
from cachefs.tls import PLAINTEXT, TLSConfig, open_channel


class DaemonProcess:
    """A ``cachefs`` daemon in a child process; ``start()`` returns once it reports its ports."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: str | None = None) -> None:
        self.args = args
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return self.ready["address"]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        if self.log_path:
            os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        stderr = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cachefs.cli", *self.args],
                stdout=subprocess.PIPE, stderr=stderr, text=True, env=self.env,
            )
        finally:
            if self.log_path:
                stderr.close()  # type: ignore[union-attr]
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                while time.monotonic() < deadline:
                    if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                        break
                    line = self.proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"{self.args[0]} exited with {self.proc.wait(timeout=5)} before it was ready"
                                           + (f"; see {self.log_path}" if self.log_path else ""))
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("event") == "ready":
                        self.ready = event
                        return self
            raise TimeoutError(f"{self.args[0]} was not ready within {timeout}s")
        except BaseException:
            self.kill()  # a failed start leaves no process and no open pipe behind (a supervisor retries)
            raise

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.kill()


def worker_process(
    mounts: dict[str, str], cache_dir: str, quota: str = "1GiB", extra: list[str] | None = None,
    log_path: str | None = None, env: dict[str, str] | None = None,
) -> DaemonProcess:
    """A worker on a free loopback port with metrics on a free port."""
    args = ["worker", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--cache-dir", f"{cache_dir}:{quota}"]
    for name, url in mounts.items():
        args += ["--mount", f"{name}={url}"]
    return DaemonProcess(args + list(extra or []), env=env if env is not None else dict(os.environ), log_path=log_path)


def master_process(state_dir: str, extra: list[str] | None = None, log_path: str | None = None,
                   env: dict[str, str] | None = None) -> DaemonProcess:
    """A master on a free loopback port."""
    args = ["master", "--host", "127.0.0.1", "--port", "0", "--state-dir", state_dir]
    return DaemonProcess(args + list(extra or []), env=env if env is not None else dict(os.environ),
                         log_path=log_path)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _mounts_toml(mounts: dict[str, Any]) -> str:
    """``{name: url}`` or ``{name: {"url":..., "options":..., "read_only":...}}`` as TOML tables."""
    lines = []
    for name, spec in mounts.items():
        spec = {"url": spec} if isinstance(spec, str) else dict(spec)
        lines.append(f"[mounts.{json.dumps(name)}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in spec.items()]
        lines.append("")
    return "\n".join(lines)


def _stop_all(daemons: list[DaemonProcess], timeout: float) -> None:
    running = [d for d in daemons if d.proc is not None and d.proc.poll() is None]
    for d in running:
        d.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    for d in running:
        try:
            d.proc.wait(timeout=max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            pass
    for d in daemons:
        d.kill()  # SIGKILL what is left; closes every pipe


class LocalCluster:
    """A master and N workers as child processes on this machine (``cachefs local``, demo, tests)."""

    def __init__(self, workdir: str, workers: int = 2, mounts: dict[str, Any] | None = None,
                 quota: str = "2GiB", worker_args: list[str] | None = None, master_args: list[str] | None = None,
                 env: dict[str, str] | None = None, master_port: int = 0, tls: TLSConfig | None = None,
                 access_token: str = "", cluster_token: str = "",
                 allowed_local_roots: list[str] | tuple[str, ...] = ()) -> None:
        if workers < 1:
            raise ValueError("a local cluster needs at least one worker")
        self.workdir = workdir
        self.n_workers = workers
        self.mounts = dict(mounts or {})
        # Directories the master lets `cachefs mount` add local mounts under, besides the
        # directories of ``mounts`` (MasterConfig.allowed_local_roots; cachefs/mountpolicy.py).
        self.allowed_local_roots = [str(r) for r in allowed_local_roots]
        self.quota = quota
        self.worker_args = list(worker_args or [])
        self.master_args = list(master_args or [])
        self.env = env
        self.master_port = master_port  # 0: a free one; a fixed one lets a restarted master keep its address
        self.tls = tls or PLAINTEXT  # one certificate for every daemon (it serves and dials with it)
        self.access_token = access_token
        self.cluster_token = cluster_token
        if tls is not None or access_token or cluster_token:
            # Secrets go to the children in their environment, never on a command line (ps shows those).
            self.env = dict(os.environ if env is None else env)
            for section in ("MASTER", "WORKER"):
                prefix = f"CACHEFS_{section}_"
                settings = {"ACCESS_TOKEN": access_token, "CLUSTER_TOKEN": cluster_token,
                            "TLS_CA_FILE": self.tls.ca_file, "TLS_CERT_FILE": self.tls.cert_file,
                            "TLS_KEY_FILE": self.tls.key_file,
                            "TLS_REQUIRE_CLIENT_CERT": "true" if self.tls.require_client_cert else ""}
                self.env.update({prefix + k: v for k, v in settings.items() if v})
        self.master: DaemonProcess | None = None
        self.workers: list[DaemonProcess] = []

    @property
    def master_address(self) -> str:
        assert self.master is not None
        return self.master.address

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        os.makedirs(self.workdir, exist_ok=True)
        master_args = list(self.master_args)
        if self.mounts or self.allowed_local_roots:
            # Mounts with options (credentials) go in a config file, never on a command line.
            path = os.path.join(self.workdir, "master.toml")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                if self.allowed_local_roots:
                    f.write(f"allowed_local_roots = {toml_value(self.allowed_local_roots)}\n\n")
                f.write(_mounts_toml(self.mounts))
            master_args += ["--config", path]
        self._master_args = master_args
        try:
            self.master = self.start_master(timeout)
            for i in range(self.n_workers):
                self.workers.append(self.start_worker(i, timeout))
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self, timeout: float = 60.0, port: int | None = None) -> DaemonProcess:
        """The master (again, after a stop: same state dir). ``port``: the gRPC port to bind; by default
        the port the previous master reported (so workers and clients find a restarted master where it
        was), else ``master_port`` (0: the kernel picks one, and the master reports it: no port is
        chosen up front, which would race with other processes on a busy machine)."""
        if port is None:
            port = self.master.ready.get("port", 0) if self.master is not None else 0
            port = port or self.master_port
        master = master_process(os.path.join(self.workdir, "master"), self._master_args,
                                log_path=os.path.join(self.workdir, "master.log"), env=self.env)
        master.args[master.args.index("--port") + 1] = str(port)
        return master.start(timeout)

    def start_worker(self, i: int, timeout: float = 60.0, port: int = 0) -> DaemonProcess:
        """Worker ``i`` (its cache dir is kept across restarts, so it rejoins with its pages);
        ``port``: the gRPC port to bind (a restarted worker keeps its address, and so its ring share)."""
        worker = worker_process({}, os.path.join(self.workdir, f"worker-{i}", "cache"), quota=self.quota,
                                extra=["--master", self.master_address, *self.worker_args],
                                log_path=os.path.join(self.workdir, f"worker-{i}.log"), env=self.env)
        if port:
            worker.args[worker.args.index("--port") + 1] = str(port)
        return worker.start(timeout)

    def wait_for_workers(self, count: int | None = None, timeout: float = 30.0) -> bool:
        """Until the master's view has ``count`` (default: all) live workers."""
        import grpc

        from cachefs.proto import master_pb2, master_pb2_grpc

        count = self.n_workers if count is None else count
        deadline = time.monotonic() + timeout
        token = self.cluster_token or self.access_token
        with open_channel(self.master_address, self.tls, token=token) as channel:
            stub = master_pb2_grpc.MasterServiceStub(channel)
            while time.monotonic() < deadline:
                try:
                    view = stub.GetView(master_pb2.GetViewRequest(), timeout=5)
                    if len(view.workers) == count:
                        return True
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every worker at once, wait (then SIGKILL the late), then the master likewise."""
        _stop_all(self.workers, timeout)
        if self.master is not None:
            _stop_all([self.master], timeout)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------- supervision (cachefs local)
@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a daemon that exited: exponential back-off with a cap, and a give-up rule that
    only a crash loop meets (many exits in a row, each soon after its start)."""

    initial: float = 0.5       # seconds before the first restart
    factor: float = 2.0
    cap: float = 30.0          # the longest wait between tries
    stable_after: float = 30.0  # a daemon that ran this long before it exited starts the back-off afresh
    give_up_after: int = 8     # quick exits in a row (about 90 s of trying with the defaults)


class Backoff:
    """One daemon's restart delays under a RestartPolicy, on an injectable clock (tests use a fake one)."""

    def __init__(self, policy: RestartPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.quick_exits = 0
        self.started_at = clock()

    def started(self) -> None:
        """A (re)start was tried now."""
        self.started_at = self.clock()

    def exited(self) -> float | None:
        """The daemon exited (or a restart failed): seconds to wait before the next try; None: give up."""
        if self.clock() - self.started_at >= self.policy.stable_after:
            self.quick_exits = 0
        self.quick_exits += 1
        if self.quick_exits > self.policy.give_up_after:
            return None
        return min(self.policy.cap, self.policy.initial * self.policy.factor ** (self.quick_exits - 1))


def port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (SO_REUSEADDR, as gRPC: a dead server's
    TIME_WAIT connections do not count as taken)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _split_address(address: str) -> tuple[str, int]:
    return split_address(address)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class _Member:
    name: str           # "master", "worker-0", ...
    index: int          # -1: the master
    backoff: Backoff
    port: int = 0       # the port it reported: a restart binds it again
    restarts: int = 0
    restart_at: float | None = None  # set while it is down and waiting for its next try
    given_up: bool = False


class Supervisor:
    """Keeps a started LocalCluster's daemons running (``cachefs local``).

    A daemon that exits is restarted with its same cache dir or state dir on the port it had, so a
    worker gets its ring share and its pages back and the master stays where workers and clients dial
    it; on a new port only if that one is taken (said in the log; after a master moves, the workers
    are restarted to follow it). Waits between tries follow RestartPolicy; a daemon that crash-loops is
    given up on (a worker: the others go on serving; the master: the cluster stops)."""

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] | None = None,
                 status_path: str | None = None, start_timeout: float = 30.0) -> None:
        self.cluster = cluster
        self.clock = clock
        self.log = log or (lambda line: print(f"cachefs local: {line}", file=sys.stderr, flush=True))
        self.status_path = status_path
        self.start_timeout = start_timeout
        self.members = [_Member("master", -1, Backoff(policy, clock))]
        self.members += [_Member(f"worker-{i}", i, Backoff(policy, clock)) for i in range(len(cluster.workers))]
        for m in self.members:
            m.port = self._daemon(m).ready.get("port", 0)
        self.write_status()

    def _daemon(self, m: _Member) -> DaemonProcess:
        daemon = self.cluster.master if m.index < 0 else self.cluster.workers[m.index]
        assert daemon is not None
        return daemon

    def _install(self, m: _Member, daemon: DaemonProcess) -> None:
        if m.index < 0:
            self.cluster.master = daemon
        else:
            self.cluster.workers[m.index] = daemon

    def run(self, stop: threading.Event, poll: float = 0.2) -> int:
        """Until ``stop`` is set: 0; 1 if the master was given up on. The caller stops the cluster."""
        while not stop.wait(poll):
            if not self.check(stop):
                return 1
        return 0

    def check(self, stop: threading.Event | None = None) -> bool:
        """One round: notice exits, restart those whose wait is over. False: the master was given up on."""
        changed = False
        for m in self.members:
            if m.given_up:
                continue
            daemon = self._daemon(m)
            if m.restart_at is None:
                if daemon.proc is None or daemon.proc.poll() is None:
                    continue
                code = daemon.proc.returncode
                daemon.kill()  # reaps it and closes its pipe
                changed = True
                delay = m.backoff.exited()
                if delay is None:
                    self._give_up(m, f"it exited ({_exit_reason(code)})")
                    continue
                self.log(f"{m.name} (pid {daemon.pid}, {daemon.address}) exited ({_exit_reason(code)}); "
                         f"restarting it in {delay:.1f}s on port {m.port}")
                m.restart_at = self.clock() + delay
            elif self.clock() >= m.restart_at and not (stop is not None and stop.is_set()):
                self._restart(m)
                changed = True
        if changed:
            self.write_status()
        return not self.members[0].given_up

    def _give_up(self, m: _Member, why: str) -> None:
        m.given_up, m.restart_at = True, None
        p = m.backoff.policy
        consequence = ("stopping the cluster" if m.index < 0 else
                       "leaving it down; the other workers go on serving (restart `cachefs local` to retry)")
        self.log(f"{m.name}: giving up: {why}, {p.give_up_after} times in a row within {p.stable_after:.0f}s "
                 f"of a start (crash loop; see its log {self._daemon(m).log_path}); {consequence}")

    def _restart(self, m: _Member) -> None:
        old = self._daemon(m)
        host, _ = _split_address(old.address)
        port, moved = m.port, False
        if port and not port_is_free(host, port):
            self.log(f"{m.name}: port {port} is taken by another process; restarting it on a new port")
            port, moved = 0, True
        m.backoff.started()
        try:
            if m.index < 0:
                daemon = self.cluster.start_master(self.start_timeout, port=port)
            else:
                daemon = self.cluster.start_worker(m.index, self.start_timeout, port=port)
        except (RuntimeError, TimeoutError, OSError) as exc:
            delay = m.backoff.exited()
            m.restart_at = None if delay is None else self.clock() + delay
            if delay is None:
                self._give_up(m, f"it did not start ({exc})")
            else:
                self.log(f"{m.name} did not start ({exc}); next try in {delay:.1f}s")
            return
        self._install(m, daemon)
        m.restart_at, m.restarts = None, m.restarts + 1
        m.port = daemon.ready.get("port", port)
        where = f"on a NEW port {daemon.address} (was port {old.address})" if moved else f"at {daemon.address}"
        self.log(f"{m.name} restarted (pid {daemon.pid}) {where}, restart {m.restarts}")
        if m.index < 0 and daemon.address != old.address:
            self.log(f"the master moved to {daemon.address}: clients must use CACHEFS_MASTER={daemon.address}; "
                     "restarting the workers to follow it")
            for w in self.members[1:]:
                if not w.given_up:
                    self._daemon(w).stop()
                    self._restart(w)  # same port and cache dir, --master at the new address

    def status(self) -> dict[str, Any]:
        """What is running where (also written to ``status_path`` for scripts: pids, addresses)."""
        def entry(m: _Member) -> dict[str, Any]:
            d = self._daemon(m)
            state = "given up" if m.given_up else "restarting" if m.restart_at is not None else "running"
            return {"name": m.name, "pid": d.proc.pid if d.proc else None, "address": d.address,
                    "state": state, "restarts": m.restarts, "log": d.log_path}

        return {"supervisor_pid": os.getpid(), "master": entry(self.members[0]),
                "workers": [entry(m) for m in self.members[1:]]}

    def write_status(self) -> None:
        if not self.status_path:
            return
        tmp = f"{self.status_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.status(), f, indent=1)
        os.replace(tmp, self.status_path)  # readers never see half a file
