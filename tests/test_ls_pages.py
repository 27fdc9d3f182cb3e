"""#46: ``cachefs ls`` of a large directory prints as the master's pages arrive (paged List),
instead of after one reply holding the whole listing; ``--json`` is one array, an entry a line.

A real master over cachefs.testing's synthetic store (registered in the children by a
``sitecustomize`` on their PYTHONPATH), slowed to 50 ms a store request; the store appends each
listing request to a trace file with the asking process's pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cachefs.local import LocalCluster

FAST = ["--lease-seconds", "1.5", "--heartbeat-seconds", "0.3"]
COUNT = 20_000  # one directory: 20 store listing requests of 1,000


@pytest.fixture(scope="module")
def slow_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ls")
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import cachefs.testing  # registers synthetic://\n")
    trace = tmp / "trace.log"
    trace.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    mounts = {"data": {"url": "synthetic://data", "options": {
        "count": COUNT, "per_dir": COUNT, "size": 64, "trace": str(trace), "latency": 0.05}}}
    with LocalCluster(str(tmp / "c"), workers=1, mounts=mounts, master_args=FAST, env=env) as cluster:
        yield cluster, trace


def _master_listings(trace, pid: int) -> list[str]:
    """(kind, after) of every listing request the master sent to the store."""
    lines = [line.split(" ", 2) + [""] for line in trace.read_text().splitlines()]
    return [(kind, after.strip()) for who, kind, after, *_ in lines if who == str(pid)]


def _ls(cluster, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cachefs.cli", "ls", "--master", cluster.master_address, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ls_prints_its_first_page_before_the_listing_ends_and_never_lists_whole(slow_cluster):
    cluster, trace = slow_cluster
    pid = cluster.master.pid
    proc = _ls(cluster, "data/d00000", "--refresh")
    start = time.monotonic()
    first = proc.stdout.readline()
    first_at = time.monotonic() - start
    asked_then = _master_listings(trace, pid)
    rest = proc.stdout.read()
    assert proc.wait(60) == 0, proc.stderr.read()
    total = time.monotonic() - start
    lines = [first, *rest.splitlines(keepends=True)]
    assert len(lines) == COUNT and first.split()[-1] == "data/d00000/00000000.bin"
    assert [line.split()[-1] for line in lines] == [f"data/d00000/{i:08d}.bin" for i in range(COUNT)]
    # The first line came after a few of the ~20 store requests (each 50 ms), not after all.
    asked = _master_listings(trace, pid)
    assert len(asked_then) <= 5 and len(asked) >= COUNT // 1000, (first_at, total, len(asked_then), len(asked))
    assert {k for k, _ in asked} == {"list_after"}  # never one whole `ls` of the directory
    assert len(asked) <= COUNT // 1000 + 2


def test_ls_json_is_one_array_an_entry_a_line_and_a_closed_pipe_is_no_error(slow_cluster):
    cluster, _ = slow_cluster
    proc = _ls(cluster, "data/d00000", "--json")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    entries = json.loads(out)
    assert len(entries) == COUNT and entries[0]["path"] == "data/d00000/00000000.bin"
    assert entries[-1] == {"path": f"data/d00000/{COUNT - 1:08d}.bin", "type": "file", "size": 64,
                           "version": entries[-1]["version"], "mtime": 1.7e9}
    assert out.count("\n") == COUNT + 2  # "[", an entry a line, "]"
    everything = _ls(cluster, "-r", "data", "--json")  # recursive: the same pages, below the root
    assert [e["path"] for e in json.loads(everything.communicate(timeout=60)[0])] == [e["path"] for e in entries]
    empty = _ls(cluster, "data/d00000/00000007.bin", "--json")  # an object's own path: itself
    assert json.loads(empty.communicate(timeout=60)[0])[0]["path"] == "data/d00000/00000007.bin"

    head = _ls(cluster, "data/d00000", "--refresh")  # `cachefs ls | head -1`
    assert head.stdout.readline()
    head.stdout.close()
    assert head.wait(60) == 0
    assert "Traceback" not in head.stderr.read()
