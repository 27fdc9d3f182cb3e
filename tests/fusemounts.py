"""A real `cachefs fuse` process for the FUSE tests: started, waited for, stopped and detached.

Tests need /dev/fuse, libfuse 3 and the binding; without them they skip with the reason (under
CI=true a machine with /dev/fuse but no libfuse fails instead: .ci/setup installs it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cachefs.client.fuse.fusemount import fuse_available, mount_entry
from helpers import wait_for

REASON = fuse_available()
if REASON and os.environ.get("CI") == "true" and os.path.exists("/dev/fuse"):
    raise RuntimeError(f"CI=true with /dev/fuse, but the FUSE mount cannot run: {REASON} (.ci/setup installs fuse3)")
needs_fuse = pytest.mark.skipif(REASON is not None, reason=f"no FUSE here: {REASON}")


class Mount:
    """A `cachefs fuse` process and its mount point; its output is collected as it comes."""

    def __init__(self, mountpoint: Path, *args: str) -> None:
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "fuse", str(mountpoint), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(s, o), daemon=True)
                         for s, o in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _drain(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_mounted(self) -> "Mount":
        ok = wait_for(lambda: self.proc.poll() is not None or any('"mounted"' in line for line in self.out), 30)
        assert ok and self.proc.poll() is None, f"no mount: rc={self.proc.poll()} stderr={''.join(self.err)}"
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for t in self._readers:
            t.join(timeout=5)
        return self.proc.returncode

    def detach_if_left(self) -> None:
        if mount_entry(str(self.mountpoint)) is not None:
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, timeout=30)


@pytest.fixture
def mount_fuse(tmp_path):
    """Start `cachefs fuse` on a fresh directory; every mount is stopped and gone after the test."""
    mounts: list[Mount] = []

    def start(*args: str, mountpoint: Path | None = None) -> Mount:
        mp = mountpoint
        if mp is None:
            mp = tmp_path / f"mnt{len(mounts)}"
            mp.mkdir()
        m = Mount(mp, *args)
        mounts.append(m)
        return m.wait_mounted()

    yield start
    for m in mounts:
        m.stop()
        m.detach_if_left()
