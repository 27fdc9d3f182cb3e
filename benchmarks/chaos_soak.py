"""Chaos soak: epochs of training reads while workers and the master are killed, frozen and restarted.

A local cluster (a master and 2 workers as processes) serves a directory of samples; a training
process reads them epoch after epoch through a map-style Dataset (``fs.cat_file`` per sample)
under a ``DataLoader`` (2 workers, ``timeout=30``), timing every read and checking its bytes. An
injector meanwhile picks a fault at random every ``--interval`` seconds: kill -9 a worker and
restart it on its port (its cache kept), SIGSTOP a worker for 10 s then SIGCONT it, or kill -9
the master and restart it. The report: DataLoader timeouts, wrong bytes, failed reads (and the
longest time one took to fail, against its budget), read latency p50/p99/max, and per fault the
time until reads were served at normal speed again.

    python benchmarks/chaos_soak.py --minutes 10 --json benchmarks/results/chaos.json --png chaos.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib

TRAINING = r'''
import json, logging, os, sys, time, zlib
import torch, fsspec
logging.basicConfig(level=os.environ.get("SOAK_LOG_LEVEL", "WARNING"),
                    format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")

def emit(kind, value):
    # One write(2) a line: DataLoader workers and the main process share stdout (atomic below PIPE_BUF).
    os.write(1, (kind + " " + json.dumps(value) + "\n").encode())

master, seconds, samples = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
want = json.loads(sys.argv[4])
fs = fsspec.filesystem("cachefs", master=master, skip_instance_cache=True)
names = sorted(fs.ls("cachefs://soak/train", detail=False))
assert len(names) == samples, len(names)

class Reads(torch.utils.data.Dataset):
    def __len__(self):
        return len(names)
    def __getitem__(self, i):
        t0 = time.time()
        try:
            data = fs.cat_file(names[i])
            ok = 1.0 if zlib.crc32(data) == want[i] else -1.0  # -1: wrong bytes
        except Exception as exc:
            ok = 0.0
            emit("READ-ERROR", {"t": t0, "seconds": time.time() - t0, "error": f"{type(exc).__name__}: {exc}"[:300]})
        return torch.tensor([t0, time.time() - t0, ok], dtype=torch.float64)

loader = torch.utils.data.DataLoader(Reads(), batch_size=8, shuffle=True, num_workers=2, timeout=30)
end = time.time() + seconds
epoch = 0
while time.time() < end:
    try:
        for batch in loader:
            for row in batch.tolist():
                emit("READ", row)
    except RuntimeError as exc:
        emit("EPOCH-ERROR", {"t": time.time(), "epoch": epoch, "error": str(exc)[:300]})
    epoch += 1
emit("EPOCHS", epoch)
emit("GRPC", "grpc" in sys.modules)  # the training process loaded gRPC (it should not: client/forksafe.py)
'''


def _outputs(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The training process's stdout and stderr once it ends (or ``timeout`` passes): then
    whatever is left of its process group is killed, so its pipes close."""
    got: dict[str, str] = {}
    reader = threading.Thread(target=lambda: got.update(zip(("out", "err"), proc.communicate())), daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    reader.join(60)
    return got.get("out", ""), got.get("err", "")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between faults (on average)")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--sample-size", type=int, default=64 << 10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default="kill_worker,stop_worker,restart_master",
                        help="the kinds of fault to pick from")
    parser.add_argument("--keep", help="copy the cluster's logs here at the end")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--png", help="draw read latency over time, with the faults, here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]

    from cachefs.local import LocalCluster

    faults: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cachefs-soak-") as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(os.path.join(data, "train"))
        want = []
        for i in range(args.samples):
            blob = os.urandom(args.sample_size)
            with open(os.path.join(data, "train", f"s{i:05d}.bin"), "wb") as f:
                f.write(blob)
            want.append(zlib.crc32(blob))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_"))}
        cluster = LocalCluster(os.path.join(tmp, "cluster"), workers=2, mounts={"soak": data}, env=env).start()
        try:
            assert cluster.wait_for_workers(2, timeout=60), "the workers did not join"
            script = os.path.join(tmp, "train.py")
            with open(script, "w") as f:
                f.write(TRAINING)
            seconds = args.minutes * 60
            # Its own process group: if it dies, its DataLoader workers (which hold its pipes) go
            # with it instead of keeping the report waiting; a crash prints where (faulthandler).
            proc = subprocess.Popen([sys.executable, script, cluster.master_address, str(seconds),
                                     str(args.samples), json.dumps(want)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**env, "PYTHONFAULTHANDLER": "1"},
                                    cwd=tmp, start_new_session=True)
            stop = threading.Event()

            def inject() -> None:
                stop.wait(rng.uniform(0.5, 1.0) * args.interval)
                while not stop.is_set():
                    kind = rng.choice(kinds)
                    t0 = time.time()
                    try:
                        if kind == "kill_worker":
                            i = rng.randrange(len(cluster.workers))
                            old = cluster.workers[i]
                            port = old.ready.get("port", 0)
                            os.kill(old.pid, signal.SIGKILL)
                            old.proc.wait(10)
                            cluster.workers[i] = cluster.start_worker(i, port=port)
                        elif kind == "stop_worker":
                            i = rng.randrange(len(cluster.workers))
                            os.kill(cluster.workers[i].pid, signal.SIGSTOP)
                            stop.wait(10)
                            os.kill(cluster.workers[i].pid, signal.SIGCONT)
                        else:
                            os.kill(cluster.master.pid, signal.SIGKILL)
                            cluster.master.proc.wait(10)
                            cluster.master = cluster.start_master()
                        faults.append({"t": t0, "kind": kind, "done": time.time()})
                    except Exception as exc:  # noqa: BLE001 - the soak reports it
                        faults.append({"t": t0, "kind": kind, "error": f"{type(exc).__name__}: {exc}"})
                    stop.wait(rng.uniform(0.5, 1.5) * args.interval)

            injector = threading.Thread(target=inject, daemon=True)
            injector.start()
            out, err = _outputs(proc, seconds + 300)
            stop.set()
            injector.join(60)
        finally:
            cluster.stop()
            if args.keep:
                import shutil

                os.makedirs(args.keep, exist_ok=True)
                with open(os.path.join(args.keep, "training.stderr"), "w") as f:
                    f.write(err if "err" in locals() else "")
                shutil.copytree(os.path.join(tmp, "cluster"), args.keep, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("pages", "*.sock", "cache"))
    reads, read_errors, epoch_errors, epochs, garbled = [], [], [], 0, 0
    grpc_loaded = None
    for line in out.splitlines():
        kind, _, body = line.partition(" ")
        try:
            json.loads(body)
        except ValueError:
            garbled += 1
            continue
        if kind == "READ":
            reads.append(json.loads(body))
        elif kind == "READ-ERROR":
            read_errors.append(json.loads(body))
        elif kind == "EPOCH-ERROR":
            epoch_errors.append(json.loads(body))
        elif kind == "EPOCHS":
            epochs = json.loads(body)
        elif kind == "GRPC":
            grpc_loaded = json.loads(body)
    ok = [r for r in reads if r[2] == 1.0]
    latencies = [r[1] for r in ok]
    normal = _pct(latencies, 0.99) or 0.0
    slow = max(normal, 0.05)
    for fault in faults:
        # The fault's reach: reads started from the fault until 30 s after it was over; recovered
        # when the last of them that was slow (over p99 and 50 ms) or failed had ended.
        until = fault.get("done", fault["t"]) + 30
        hit = [r for r in reads if fault["t"] <= r[0] <= until and (r[2] != 1.0 or r[1] > slow)]
        fault["slow_or_failed_reads"] = len(hit)
        fault["max_latency_s"] = round(max((r[1] for r in hit), default=0.0), 3)
        fault["recovered_after_s"] = round(max((r[0] + r[1] for r in hit), default=fault["t"]) - fault["t"], 2)
    report = {
        "minutes": args.minutes, "epochs": epochs, "reads": len(reads), "faults": len(faults),
        "garbled_lines": garbled,
        "dataloader_timeouts": sum(1 for e in epoch_errors if "timed out" in e["error"]),
        "epoch_errors": epoch_errors[:20], "wrong_bytes_reads": sum(1 for r in reads if r[2] == -1.0),
        "failed_reads": len(read_errors), "failed_read_max_seconds": max((e["seconds"] for e in read_errors), default=0),
        "failed_read_examples": read_errors[:10],
        "read_latency_s": {"p50": _pct(latencies, 0.5), "p99": _pct(latencies, 0.99),
                           "max": round(max(latencies), 4) if latencies else None},
        "training_exit": proc.returncode, "training_loaded_grpc": grpc_loaded,
        "fault_log": faults, "training_stderr_tail": err[-2000:] if proc.returncode else "",
    }
    print(json.dumps({k: v for k, v in report.items() if k not in ("fault_log",)}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png and reads:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t_start = min(r[0] for r in reads)
        fig, ax = plt.subplots(figsize=(11, 4))
        ax.scatter([r[0] - t_start for r in ok], [r[1] for r in ok], s=2, label="read (ok)")
        bad = [r for r in reads if r[2] != 1.0]
        if bad:
            ax.scatter([r[0] - t_start for r in bad], [r[1] for r in bad], s=8, c="red", label="read failed / wrong")
        colors = {"kill_worker": "tab:red", "stop_worker": "tab:orange", "restart_master": "tab:purple"}
        for fault in faults:
            ax.axvline(fault["t"] - t_start, color=colors.get(fault["kind"], "gray"), alpha=0.6, lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("seconds")
        ax.set_ylabel("read latency (s)")
        ax.set_title("chaos soak: read latency; lines: kill -9 worker (red), SIGSTOP 10 s (orange), master restart (purple)")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    bad = report["dataloader_timeouts"] or report["wrong_bytes_reads"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
