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
