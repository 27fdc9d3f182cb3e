"""A real etcd cluster of child processes on loopback, for tests and benchmarks.

Ports are picked free (bound to port 0, then handed to etcd); a member that loses the race
for its port makes the whole start retry with new ports. Members can be killed (SIGKILL),
frozen and started again on their data dirs, which is what the failover tests do to them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cachefs.server.etcd.client import EtcdClient, EtcdSettings, EtcdUnavailableError


def etcd_binary() -> str | None:
    """The etcd server binary (Debian's etcd-server installs /usr/bin/etcd), or None."""
    return os.environ.get("CACHEFS_ETCD_BINARY") or shutil.which("etcd") or (
        "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen | None = None

    tls: bool = False

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"


class EtcdCluster:
    """``with EtcdCluster(3) as cluster: cluster.endpoints``; removed (processes and dirs) on exit."""

    def __init__(self, size: int = 3, base_dir: str | os.PathLike[str] | None = None,
                 start_timeout: float = 60.0, tls: EtcdSettings | None = None,
                 server_cert: tuple[str, str] | None = None) -> None:
        """``tls``: the client side of mutual TLS (CA, client cert and key); ``server_cert``: the
        members' (cert, key) for 127.0.0.1. With both, clients must present a certificate."""
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.size = size
        self._own_dir = base_dir is None
        self.base_dir = Path(tempfile.mkdtemp(prefix="cachefs-etcd-") if base_dir is None else base_dir)
        self.start_timeout = start_timeout
        self.members: list[_Member] = []
        self.tls = tls
        self.server_cert = server_cert

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    def _spawn(self, member: _Member, state: str) -> None:
        member.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.base_dir / f"{member.name}.log", "ab")
        tls_args: list[str] = []
        if self.tls is not None and self.server_cert is not None:
            tls_args = ["--cert-file", self.server_cert[0], "--key-file", self.server_cert[1],
                        "--trusted-ca-file", self.tls.ca_file, "--client-cert-auth"]
        try:
            member.proc = subprocess.Popen(
                [self.binary, "--name", member.name, "--data-dir", str(member.data_dir),
                 "--listen-client-urls", member.endpoint, "--advertise-client-urls", member.endpoint,
                 "--listen-peer-urls", f"http://127.0.0.1:{member.peer_port}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{member.peer_port}",
                 "--initial-cluster", self._initial_cluster(), "--initial-cluster-state", state,
                 "--initial-cluster-token", self.base_dir.name,
                 "--heartbeat-interval", "100", "--election-timeout", "1000",
                 "--logger", "zap", "--log-level", "warn", *tls_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def start(self) -> "EtcdCluster":
        for attempt in range(3):
            ports = _free_ports(2 * self.size)
            self.members = [_Member(f"m{i}", ports[2 * i], ports[2 * i + 1], self.base_dir / f"m{i}",
                                    tls=self.tls is not None) for i in range(self.size)]
            for member in self.members:
                self._spawn(member, "new")
            try:
                self.wait_healthy()
                return self
            except (TimeoutError, RuntimeError):
                self.stop()
                for member in self.members:
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                if attempt == 2:
                    raise
        return self

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Until a write through every live member's endpoint is committed (a leader exists)."""
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        live = [m for m in self.members if m.proc is not None and m.proc.poll() is None]
        if len(live) < len(self.members):
            dead = [m.name for m in self.members if m.proc is None or m.proc.poll() is not None]
            if any(m.proc is not None and m.proc.poll() is not None for m in self.members):
                raise RuntimeError(f"etcd member(s) {dead} exited; see {self.base_dir}")
        for member in live:
            settings = EtcdSettings((member.endpoint,), timeout=2.0)
            if self.tls is not None:
                settings = EtcdSettings((member.endpoint,), ca_file=self.tls.ca_file, cert_file=self.tls.cert_file,
                                        key_file=self.tls.key_file, timeout=2.0)
            client = EtcdClient(settings)
            try:
                while True:
                    try:
                        client.put(b"/cachefs-etcd-health", b"ok")
                        break
                    except (EtcdUnavailableError, OSError):
                        if member.proc.poll() is not None:
                            raise RuntimeError(f"etcd member {member.name} exited; see {self.base_dir}") from None
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"etcd member {member.name} not healthy; see {self.base_dir}") from None
                        time.sleep(0.1)
            finally:
                client.close()

    def kill(self, index: int) -> None:
        member = self.members[index]
        if member.proc is not None and member.proc.poll() is None:
            member.proc.kill()
            member.proc.wait(10)
        member.proc = None

    def restart(self, index: int) -> None:
        """Start a killed member again on its data dir (it rejoins the cluster)."""
        member = self.members[index]
        if member.proc is None or member.proc.poll() is not None:
            self._spawn(member, "existing")

    def stop(self) -> None:
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.send_signal(signal.SIGKILL)
                member.proc.wait(10)
            member.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
