"""Training as the README shows it, run the way a user runs it.

The daemons are started as the README starts them (``cachefs local --workers 2 --mount
data=DIR``, a command of its own); the training script runs in a process of its own that imports
only what the README's example imports (``torch`` and ``cachefs``), with nothing of this test
suite loaded first (the suite imports grpc before the client, which once hid a hang at every
epoch start: DataLoader workers stuck in grpc's at-fork handler). Every epoch must finish within
the DataLoader's timeout with every sample's bytes right.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from helpers import local_master, stop_local

SAMPLES = 96
EPOCHS = 3

TRAIN = textwrap.dedent('''
    import json, sys, zlib
    import torch, cachefs

    master, kind, workers, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    grpc_seen = sys.argv[5]  # a process that has loaded gRPC by the time it reads a sample says so here
    options = {"master": master}

    def crc(sample):
        if "grpc" in sys.modules:
            with open(grpc_seen, "a") as f:
                f.write(f"{__import__('os').getpid()}\\n")
        return zlib.crc32(sample.numpy().tobytes() if hasattr(sample, "numpy") else bytes(sample))

    if kind == "map":
        ds = cachefs.CacheDataset.from_prefix("cachefs://data/train", storage_options=options,
                                              transform=crc, seed=0)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=ds.sampler(), num_workers=workers,
                                             timeout=30 if workers else 0)
    else:
        ds = cachefs.CacheIterableDataset.from_prefix("cachefs://data/shards", batch_size=8,
                                                      storage_options=options, transform=lambda s: crc(s["bin"]))
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=workers, timeout=30 if workers else 0)
    for epoch in range(epochs):
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        crcs = sorted(int(x) for batch in loader for x in batch)
        print(json.dumps({"epoch": epoch, "crcs": crcs}), flush=True)
    print(json.dumps({"grpc_loaded": "grpc" in sys.modules}), flush=True)
    from grpc._cython import cygrpc
    print(json.dumps({"grpc_fork_support": bool(cygrpc.is_fork_support_enabled()),
                      "env": __import__("os").environ.get("GRPC_ENABLE_FORK_SUPPORT")}), flush=True)
''')


def _user_environment() -> dict[str, str]:
    """The environment a user's shell would have: none of the suite's cachefs or gRPC settings."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("CACHEFS_") and not k.startswith("GRPC_") and k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    data = root / "data"
    (data / "train").mkdir(parents=True)
    blobs = {}
    for i in range(SAMPLES):
        blob = os.urandom(3000 + 37 * i)
        (data / "train" / f"s{i:04d}.bin").write_bytes(blob)
        blobs[f"s{i:04d}"] = blob
    import cachefs

    cachefs.write_tar_shards(((k, {"bin": v}) for k, v in blobs.items()), str(data / "shards"),
                             shard_bytes=64 << 10)
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "2", "--mount",
                             f"data={data}", "--dir", str(root / "cluster")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_user_environment())
    try:
        yield local_master(proc, timeout=90), sorted(zlib.crc32(b) for b in blobs.values()), root / "cluster"
    finally:
        stop_local(proc)


@pytest.mark.parametrize(("kind", "workers"), [("map", 2), ("map", 0), ("iter", 2), ("iter", 0)])
def test_the_readme_training_loop_runs_every_epoch(local_cluster, tmp_path: Path, kind: str, workers: int):
    """Every epoch, every byte; and neither the training process nor a DataLoader worker ever
    loads gRPC (the view from the master's client port, reads, listings, plans and hints over
    the workers' sockets), even with grpcio's fork support asked for in the environment."""
    master, want, _ = local_cluster
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    grpc_seen = tmp_path / "grpc-seen"
    # With DataLoader workers, grpcio's fork support asked for as a user's environment might.
    env = {**_user_environment(), **({"GRPC_ENABLE_FORK_SUPPORT": "1"} if workers else {})}
    done = subprocess.run([sys.executable, str(script), master, kind, str(workers), str(EPOCHS), str(grpc_seen)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"the training script failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    epochs = [line for line in lines if "epoch" in line]
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
    for e in epochs:
        assert e["crcs"] == want, f"epoch {e['epoch']}: wrong or missing samples"
    assert {"grpc_loaded": False} in lines, f"the training process loaded gRPC:\n{done.stderr[-3000:]}"
    assert not grpc_seen.exists(), f"processes that loaded gRPC while reading: {grpc_seen.read_text()}"
    # The client changed no gRPC setting: what the environment asked for, nothing more.
    assert lines[-1] == ({"grpc_fork_support": True, "env": "1"} if workers else
                         {"grpc_fork_support": False, "env": None})


READ_THROUGH_A_CRASH = textwrap.dedent('''
    import json, sys, zlib
    import cachefs, fsspec

    # The data port (another host's path): a dead worker is a refused connection, not page
    # files still readable by name on this host.
    fs = fsspec.filesystem("cachefs", master=sys.argv[1], short_circuit=False)
    paths = sorted(fs.ls("data/train", detail=False))
    crcs = sorted(zlib.crc32(fs.cat_file(p)) for p in paths)
    print(json.dumps({"warm": crcs}), flush=True)
    sys.stdin.readline()  # the test kills a worker now
    crcs = sorted(zlib.crc32(fs.cat_file(p)) for p in paths)
    print(json.dumps({"after": crcs, "grpc_loaded": "grpc" in sys.modules}), flush=True)
''')


def test_a_worker_killed_under_a_training_process_is_failed_over_without_loading_grpc(local_cluster, tmp_path):
    """Last in this file: it kills a worker of the shared cluster (its supervisor restarts it).
    The training process reads every sample again right after: the killed worker's samples come
    from the other worker's socket (filled there) or the restarted one; none fails, and the
    process still has not loaded gRPC (it keeps off it: client/forksafe.py grpc_avoided)."""
    master, want, cluster = local_cluster
    script = tmp_path / "crash.py"
    script.write_text(READ_THROUGH_A_CRASH)
    proc = subprocess.Popen([sys.executable, str(script), master], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_user_environment(), cwd=tmp_path)
    try:
        first = json.loads(proc.stdout.readline() or "{}")
        assert first.get("warm") == want, proc.stderr.read() if proc.poll() is not None else "wrong bytes"
        victim = json.loads((cluster / "local.json").read_text())["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-5000:]
    after = json.loads(out.strip().splitlines()[-1])
    assert after == {"after": want, "grpc_loaded": False}, err[-3000:]
