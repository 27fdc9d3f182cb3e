"""A load job over millions of objects (#47): the leader's memory, and a resume after kill -9.

    .venv/bin/python benchmarks/bench_load_scale.py --objects 1000000
    .venv/bin/python benchmarks/bench_load_scale.py --objects 10000000

A real master (its own process, SQLite state) with a mount of cachefs.testing's synthetic store
(``--objects`` objects of 4 KiB, 1,000 a directory: nothing behind them, so ten million cost no
disk; registered in the master by a ``sitecustomize`` on its PYTHONPATH), and ``--workers`` null
workers in one other process: each registers, heartbeats and answers ``Load`` at once as if every
object were loaded (a real worker would write 10 M page files: the leader's side is measured
here, not the workers'). Runs ``cachefs load``'s job on the mount's root, kills the master with
SIGKILL once ``--kill-at`` of the objects are done, starts it again on the same port and state,
and waits for the job to succeed. Measured:

* ``rss_peak_mb_first`` / ``rss_peak_mb_resumed``: each master's peak resident set (VmHWM, read
  just before the kill and at the end);
* ``record_bytes``: the job's record as the killed master last saved it (JSON), its ``cursor``
  and ``committed`` figures;
* ``listings_first`` / ``listings_resumed``: store listing requests each master made (the
  synthetic store's trace, one line per request with the asking pid), ``listings_expected``:
  pages of what was listed after the cursor at the kill (ceil((objects - committed) / 1000));
  ``resumed_first_after`` / ``resumed_min_after``: where the resumed master's listing started
  and the lowest name it asked after (both the cursor: nothing done is listed again);
* ``objects_per_s_first`` / ``_resumed``: objects done per second by each master.

Writes benchmarks/results/load-scale-<timestamp>.json and prints it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = ["--lease-seconds", "5", "--heartbeat-seconds", "1"]
SIZE = 4096


def _rss_peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def null_workers(master: str, count: int) -> None:
    """``count`` workers that answer Load at once, registered with ``master``; runs until killed."""
    from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc

    class Null(worker_pb2_grpc.WorkerServiceServicer):
        def Load(self, request, context):
            return worker_pb2.LoadResponse(objects_loaded=len(request.paths), bytes_loaded=SIZE * len(request.paths))

    infos, servers = [], []  # the servers kept referenced: a collected grpc.Server stops
    for i in range(count):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(Null(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        infos.append(master_pb2.WorkerInfo(worker_id=f"null-{i}", address=f"127.0.0.1:{port}"))
    stub = master_pb2_grpc.MasterServiceStub(grpc.insecure_channel(master))
    registered = [False] * count
    while True:  # heartbeat; register again whenever the master does not know us (a restart)
        for i, info in enumerate(infos):
            try:
                if registered[i]:
                    registered[i] = stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id=info.worker_id),
                                                   timeout=2).registered
                if not registered[i]:
                    stub.RegisterWorker(master_pb2.RegisterWorkerRequest(worker=info), timeout=2)
                    registered[i] = True
            except grpc.RpcError:
                registered[i] = False
        time.sleep(0.5)


def _job(stub, job_id: str):
    from cachefs.proto import master_pb2

    try:
        return stub.GetJob(master_pb2.GetJobRequest(job_id=job_id), timeout=5)
    except grpc.RpcError:
        return None


def _listings(trace: Path, pid: int) -> list[str]:
    out = []
    with open(trace) as f:
        for line in f:
            who, kind, after = (line.rstrip("\n").split(" ", 2) + ["", ""])[:3]
            if who == str(pid) and kind == "list_after":
                out.append(after)
    return out


def run(objects: int, workers: int, kill_at: float, timeout: float) -> dict:
    import subprocess

    from cachefs.local import _mounts_toml, master_process
    from cachefs.proto import master_pb2, master_pb2_grpc
    from cachefs.server.master.state import MasterState

    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text("import cachefs.testing\n")
    trace = tmp / "trace.log"
    trace.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp / "site"), *sys.path]))
    config = tmp / "master.toml"
    config.write_text(_mounts_toml({"data": {"url": "synthetic://data", "options": {
        "count": objects, "per_dir": 1000, "size": SIZE, "trace": str(trace)}}}))
    args = ["--config", str(config), *FAST]
    master = master_process(str(tmp / "state"), args, log_path=str(tmp / "master.log"), env=env).start()
    port = master.ready["port"]
    address = f"127.0.0.1:{port}"
    nulls = subprocess.Popen([sys.executable, __file__, "--null-workers", str(workers), "--master", address])
    row: dict = {"objects": objects, "workers": workers, "kill_at": kill_at}
    try:
        stub = master_pb2_grpc.MasterServiceStub(grpc.insecure_channel(address))
        deadline = time.monotonic() + 60
        while len(stub.GetView(master_pb2.GetViewRequest(), timeout=5).workers) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError("the null workers did not register")
            time.sleep(0.2)
        t0 = time.monotonic()
        job_id = stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data"), timeout=10).job_id
        deadline = t0 + timeout
        while True:
            job = _job(stub, job_id)
            if job is not None and job.objects_done >= kill_at * objects:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not {kill_at:.0%} done in {timeout} s: {job}")
            time.sleep(0.2)
        row["rss_peak_mb_first"] = round(_rss_peak_mb(master.pid), 1)
        first_pid = master.pid
        os.kill(master.pid, signal.SIGKILL)
        master.proc.wait(timeout=30)
        first_s = time.monotonic() - t0
        state = MasterState(tmp / "state")
        try:
            record = {r["job_id"]: r for r in state.jobs()}[job_id]
        finally:
            state.close()
        committed = record["committed"].get("objects_total", 0)  # listed up to the cursor (done or failed)
        row.update(first_s=round(first_s, 1), done_at_kill=job.objects_done, committed_at_kill=committed,
                   objects_per_s_first=round(job.objects_done / first_s), record_bytes=len(json.dumps(record)),
                   record=record)
        row["listings_first"] = len(_listings(trace, first_pid))

        master = master_process(str(tmp / "state"), args, log_path=str(tmp / "master.log"), env=env)
        master.args[master.args.index("--port") + 1] = str(port)
        master.start()
        t1 = time.monotonic()
        deadline = t1 + timeout
        while True:
            job = _job(stub, job_id)
            if job is not None and job.state not in (master_pb2.PENDING, master_pb2.RUNNING):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the resumed job did not finish in {timeout} s: {job}")
            time.sleep(0.5)
        resumed_s = time.monotonic() - t1
        row["rss_peak_mb_resumed"] = round(_rss_peak_mb(master.pid), 1)
        after = _listings(trace, master.pid)
        row.update(state=master_pb2.JobState.Name(job.state), error=job.error, objects_done=job.objects_done,
                   objects_total=job.objects_total, resumed_s=round(resumed_s, 1),
                   objects_per_s_resumed=round((objects - committed) / resumed_s),
                   listings_resumed=len(after), listings_expected=-(-(objects - committed) // 1000),
                   cursor=record["cursor"], resumed_first_after=after[0] if after else None,
                   resumed_min_after=min(after) if after else None)
    finally:
        nulls.kill()
        nulls.wait(timeout=30)
        master.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-at", type=float, default=0.5, help="fraction of the objects done at the kill")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for each master's part")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--null-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.null_workers:
        threading.current_thread().name = "null-workers"
        null_workers(args.master, args.null_workers)
        return
    row = run(args.objects, args.workers, args.kill_at, args.timeout)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"load-scale-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    with open(path, "w") as f:
        json.dump(row, f, indent=2)
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
