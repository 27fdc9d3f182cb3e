"""The command line a shell user relies on: output, exit codes, clean stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from cachefs.local import LocalCluster
from helpers import client, local_master


def _cachefs(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_admin_commands_against_a_live_cluster(local_store, tmp_path):
    local_store.add("a.txt", b"hello")
    other = tmp_path / "other"  # mounted at run time below: the master must allow it
    with LocalCluster(str(tmp_path / "c"), workers=2, mounts={"data": local_store.mount.url},
                      allowed_local_roots=[str(other)]) as cluster:
        assert cluster.wait_for_workers()
        m = ["--master", cluster.master_address]
        status = json.loads(_cachefs("status", *m, "--json").stdout)
        assert len(status["workers"]) == 2 and status["mounts"] == ["data"]
        assert {w["address"] for w in status["workers"]} == {w.address for w in cluster.workers}
        assert [w["eviction"] for w in status["workers"]] == ["future", "future"]  # the default policy
        text = _cachefs("status", *m).stdout
        assert "2 live worker(s)" in text and "future (0 plans)" in text

        out = _cachefs("mount", *m, "s3x", "s3://bucket/p", "-o", "secret=TOPSECRET", "-o",
                       "endpoint_url=http://127.0.0.1:9", "--read-only")
        assert out.returncode == 0, out.stderr
        listed = _cachefs("mounts", *m, "--json")
        assert "TOPSECRET" not in listed.stdout
        mounts = {r["name"]: r for r in json.loads(listed.stdout)}
        assert mounts["s3x"]["read_only"] and mounts["s3x"]["options"]["endpoint_url"] == "http://127.0.0.1:9"
        assert set(mounts["s3x"]["options"]) == {"endpoint_url", "client_kwargs", "config_kwargs"}  # pinned (#49)
        again = _cachefs("mount", *m, "s3x", "s3://other")
        assert again.returncode == 1 and "exists" in again.stderr.lower()

        # A mount added through the master reaches the workers and the clients.
        other.mkdir()
        (other / "b.txt").write_bytes(b"via the master")
        assert _cachefs("mount", *m, "more", str(other)).returncode == 0
        fs = client(master=cluster.master_address)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert fs.cat_file("more/b.txt") == b"via the master"
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

        assert _cachefs("unmount", *m, "s3x").returncode == 0
        missing = _cachefs("unmount", *m, "s3x")
        assert missing.returncode == 1 and "s3x" in missing.stderr
        assert _cachefs("mount", *m, "bad", "s3://b", "-o", "novalue").returncode == 2
    unreachable = _cachefs("status", "--master", "127.0.0.1:1", "--timeout", "2")
    assert unreachable.returncode == 3 and "cannot reach the master" in unreachable.stderr


def test_cachefs_local_runs_until_interrupted(local_store, tmp_path):
    local_store.add("a.txt", b"hello")
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "2", "--dir",
                             str(tmp_path / "c"), "--mount", f"data={local_store.mount.url}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        master = local_master(proc)
        env = dict(os.environ, CACHEFS_MASTER=master)
        status = json.loads(_cachefs("status", "--json", env=env).stdout)
        assert len(status["workers"]) == 2
        assert client(master=master).cat_file("data/a.txt") == b"hello"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stdout.read()
        assert _cachefs("status", "--json", "--timeout", "2", env=env).returncode == 3  # nothing left running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
