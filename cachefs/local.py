"""Running daemons as child processes on this machine (the demo, tests, later `cachefs local`)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

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
        self.kill()
        raise TimeoutError(f"{self.args[0]} was not ready within {timeout}s")

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


class LocalCluster:
    """A master and N workers as child processes on this machine (``cachefs local``, demo, tests)."""

    def __init__(self, workdir: str, workers: int = 2, mounts: dict[str, Any] | None = None,
                 quota: str = "2GiB", worker_args: list[str] | None = None, master_args: list[str] | None = None,
                 env: dict[str, str] | None = None, master_port: int = 0, tls: TLSConfig | None = None,
                 access_token: str = "", cluster_token: str = "") -> None:
        if workers < 1:
            raise ValueError("a local cluster needs at least one worker")
        self.workdir = workdir
        self.n_workers = workers
        self.mounts = dict(mounts or {})
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
        if self.mounts:
            # Mounts with options (credentials) go in a config file, never on a command line.
            path = os.path.join(self.workdir, "master.toml")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
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

    def start_master(self, timeout: float = 60.0) -> DaemonProcess:
        """The master (again, after a stop: same state dir, same port if one was chosen)."""
        master = master_process(os.path.join(self.workdir, "master"), self._master_args,
                                log_path=os.path.join(self.workdir, "master.log"), env=self.env)
        master.args[master.args.index("--port") + 1] = str(self.master_port)
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

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
            worker.kill()
        if self.master is not None:
            self.master.stop()
            self.master.kill()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
