"""Fork storm: many DataLoader worker starts while the parent's client is busy (issue #45).

A local cluster (a master and 2 workers as processes, as ``cachefs local`` starts them) serves a
directory of small samples. The training process reads them with ``CacheDataset`` under a
``DataLoader`` (``timeout``: a hung worker start is an error, not a wait), epoch after epoch, so
every epoch forks (or spawns) its workers afresh, while threads of the same process keep
reading, listing, renewing the dataset's read plan and changing the cluster view (a mount added
and removed through the master) at the moment of each fork. Every sample's bytes are checked.

    python benchmarks/fork_storm.py --epochs 500 --workers 4 --spawn-epochs 100 --json out.json
    python benchmarks/fork_storm.py --epochs 25 --workers 4 --spawn-epochs 0   # the CI size

``--grpc-fork-support`` runs the training process with ``GRPC_ENABLE_FORK_SUPPORT=1`` (as a user's
environment might have it). ``--view-changer thread`` moves the view from a thread of the training
process through gRPC (a training process that has loaded gRPC itself; its forked workers then
keep off gRPC); by default another process does it and the training process never loads gRPC. Prints one JSON report (starts, hangs, wrong samples, errors, epoch
times); exits 1 if any start hung or any byte was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

TRAINING = r'''
import json, os, sys, textwrap, threading, time, zlib
import torch, cachefs
import fsspec


def crc(sample):
    return zlib.crc32(sample.numpy().tobytes() if hasattr(sample, "numpy") else bytes(sample))

# Spawned DataLoader workers run this file again as __mp_main__ (to find crc): only the
# definitions above run there, never the storm below.
if __name__ == "__main__":
    master, data_dir, epochs, spawn_epochs, workers, timeout = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    want = json.loads(sys.argv[7])
    view_changer = sys.argv[8]
    ds = cachefs.CacheDataset.from_prefix("cachefs://storm/train", storage_options={"master": master}, transform=crc, seed=0)
    fs = fsspec.filesystem("cachefs", master=master, skip_instance_cache=True)
    names = sorted(fs.ls("cachefs://storm/train", detail=False))
    stop = threading.Event()
    busy = {"reads": 0, "lists": 0, "view_changes": 0, "errors": []}

    def reads():
        while not stop.is_set():
            for name in names[:16]:
                fs.cat_file(name)
                busy["reads"] += 1
            time.sleep(0.005)  # busy, not a spin that takes a core from the DataLoader workers

    def lists():
        while not stop.is_set():
            fs.ls("cachefs://storm/train")
            busy["lists"] += 1
            time.sleep(0.05)

    CHANGE_VIEW = """
    import sys, time, grpc
    from cachefs.proto import master_pb2, master_pb2_grpc
    stub = master_pb2_grpc.MasterServiceStub(grpc.insecure_channel(sys.argv[1]))
    n = 0
    while True:
        stub.AddMount(master_pb2.AddMountRequest(name="storm2", url=sys.argv[2], replace=True), timeout=10)
        try:
            stub.RemoveMount(master_pb2.RemoveMountRequest(name="storm2"), timeout=10)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
        n += 1
        print(n, flush=True)
        time.sleep(0.2)
    """

    def view_changes():
        # A mount added and removed through the master moves the cluster view (version) under the
        # forks: from another process, as an admin would ("process": this process stays off gRPC),
        # or from a thread of this one ("thread": a training process that has loaded gRPC itself).
        if view_changer == "process":
            import subprocess
            proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHANGE_VIEW), master, data_dir], stdout=subprocess.PIPE, text=True)
            try:
                for line in proc.stdout:
                    busy["view_changes"] = int(line)
                    if stop.is_set():
                        break
            finally:
                proc.kill()
                proc.wait(10)
            return
        import grpc
        from cachefs.proto import master_pb2, master_pb2_grpc
        stub = master_pb2_grpc.MasterServiceStub(grpc.insecure_channel(master))
        while not stop.is_set():
            stub.AddMount(master_pb2.AddMountRequest(name="storm2", url=data_dir, replace=True), timeout=10)
            try:
                stub.RemoveMount(master_pb2.RemoveMountRequest(name="storm2"), timeout=10)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            busy["view_changes"] += 1
            time.sleep(0.2)

    def guard(fn):
        def run():
            try:
                fn()
            except Exception as exc:  # reported; the storm goes on
                busy["errors"].append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
        return run

    threads = [threading.Thread(target=guard(f), daemon=True) for f in (reads, lists, view_changes)]
    for t in threads:
        t.start()
    report = {"starts": 0, "hangs": 0, "wrong_samples": 0, "errors": [], "epoch_seconds": []}
    for epoch in range(epochs + spawn_epochs):
        context = "spawn" if epoch >= epochs else "fork"
        ds.set_epoch(epoch)  # a new read plan each epoch (renewed with the workers)
        loader = torch.utils.data.DataLoader(ds, batch_size=16, sampler=ds.sampler(), num_workers=workers,
                                             timeout=timeout, multiprocessing_context=context)
        t0 = time.monotonic()
        try:
            got = sorted(int(x) for batch in loader for x in batch)
            report["wrong_samples"] += sum(1 for a, b in zip(got, want) if a != b) + abs(len(got) - len(want))
        except RuntimeError as exc:
            if "timed out" in str(exc):
                report["hangs"] += 1
            report["errors"].append(f"epoch {epoch} ({context}): {exc}")
        except Exception as exc:
            report["errors"].append(f"epoch {epoch} ({context}): {type(exc).__name__}: {exc}")
        report["starts"] += workers
        report["epoch_seconds"].append([round(time.monotonic() - t0, 3), context])
    stop.set()
    report["parent"] = {k: v for k, v in busy.items() if k != "errors"}
    report["parent"]["grpc_loaded"] = "grpc" in sys.modules
    report["errors"] += busy["errors"]
    print("REPORT " + json.dumps(report), flush=True)
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=500, help="epochs with forked DataLoader workers")
    parser.add_argument("--spawn-epochs", type=int, default=100, help="then epochs with spawned ones")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers per epoch")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=30, help="DataLoader timeout (s): a hang's deadline")
    parser.add_argument("--grpc-fork-support", action="store_true",
                        help="GRPC_ENABLE_FORK_SUPPORT=1 in the training process's environment")
    parser.add_argument("--view-changer", choices=("process", "thread"), default="process",
                        help="who moves the view under the forks: another process (an admin; the training "
                             "process stays off gRPC) or a thread of the training process (it loads gRPC)")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args(argv)

    from cachefs.local import LocalCluster

    with tempfile.TemporaryDirectory(prefix="cachefs-storm-") as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(os.path.join(data, "train"))
        want = []
        for i in range(args.samples):
            blob = os.urandom(2048 + 61 * i)
            with open(os.path.join(data, "train", f"s{i:05d}.bin"), "wb") as f:
                f.write(blob)
            want.append(zlib.crc32(blob))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_"))}
        with LocalCluster(os.path.join(tmp, "cluster"), workers=2, mounts={"storm": data}, env=env) as cluster:
            cluster.wait_for_workers(2, timeout=60)
            script = os.path.join(tmp, "train.py")
            with open(script, "w") as f:
                f.write(TRAINING)
            if args.grpc_fork_support:
                env = {**env, "GRPC_ENABLE_FORK_SUPPORT": "1"}
            budget = (args.epochs + args.spawn_epochs) * (args.timeout + 30) + 120
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, script, cluster.master_address, data, str(args.epochs),
                                   str(args.spawn_epochs), str(args.workers), str(args.timeout),
                                   json.dumps(sorted(want)), args.view_changer],
                                  capture_output=True, text=True, env=env, timeout=budget, cwd=tmp)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-4000:], done.stderr[-8000:], file=sys.stderr)
        return 2
    report = json.loads(lines[-1][len("REPORT "):])
    epochs = report.pop("epoch_seconds")
    for context in ("fork", "spawn"):
        times = sorted(t for t, c in epochs if c == context)
        if times:
            report[f"{context}_epoch_seconds"] = {"p50": times[len(times) // 2], "max": times[-1], "n": len(times)}
    report.update(grpc_fork_support=args.grpc_fork_support, view_changer=args.view_changer,
                  seconds=round(time.monotonic() - t0, 1))
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["hangs"] == 0 and report["wrong_samples"] == 0 and not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
