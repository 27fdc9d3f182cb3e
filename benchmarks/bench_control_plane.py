"""The control plane on etcd: failover, view propagation, etcd footprint, a new leader's cold caches.

    .venv/bin/python benchmarks/bench_control_plane.py [--kills 10] [--lease 5] [--workers 100] [--quick]

Everything is real processes on this machine: a 3-member etcd on loopback (Debian's etcd-server),
two masters (``cachefs master --etcd``), one worker for the after-failover figures.

- failover: kill -9 the leader ``--kills`` times (the killed master restarted as a standby each
  time); seconds from the kill until the survivor reports itself leader, and until a leader-only
  call (ListJobs) through the list of masters succeeds. Median and p99 (nearest rank).
- view propagation with ``--workers`` simulated workers registered (and heartbeating): from a
  RegisterWorker (or AddMount) call until a WatchView stream on the leader and one on the standby
  deliver a view that has it.
- etcd footprint: keys and bytes (key + value) per worker, mount and job under the prefix, and
  etcd's database size per worker (Status dbSize before/after registering them).
- right after a failover the new leader's metadata and listing caches are cold: ``ls`` (List),
  ``stat`` and batched lookups (GetInfos, 1,000 paths per call) on the new leader, first call and
  again, beside the same on the old leader before it was killed; a load job on the new leader.
Writes benchmarks/baselines/control-plane-<date>.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from cachefs.local import DaemonProcess, master_process, worker_process
from cachefs.masters import MasterList
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2
from cachefs.server.etcd import api
from cachefs.server.etcd.client import EtcdClient, EtcdSettings
from cachefs.server.etcd.localcluster import EtcdCluster

BASELINES = Path(__file__).resolve().parent / "baselines"


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 1)) - 1))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "median": round(statistics.median(values), 4), "p99": round(nearest_rank(values, 0.99), 4),
            "max": round(max(values), 4), "min": round(min(values), 4)}


class Masters:
    def __init__(self, tmp: Path, etcd: EtcdCluster, lease: float, store: Path) -> None:
        self.tmp, self.etcd, self.lease, self.store = tmp, etcd, lease, store
        self.procs: list[DaemonProcess] = []
        self.ports: list[int] = []
        self._one: dict[int, MasterList] = {}

    def _spawn(self, i: int, port: int = 0) -> DaemonProcess:
        daemon = master_process(str(self.tmp / f"m{i}"), [
            "--etcd", ",".join(self.etcd.endpoints), "--election-lease-seconds", str(self.lease),
            "--mount", f"data={self.store}"], log_path=str(self.tmp / f"m{i}.log"))
        if port:
            daemon.args[daemon.args.index("--port") + 1] = str(port)
        return daemon.start()

    def start(self) -> "Masters":
        for i in range(2):
            self.procs.append(self._spawn(i))
            self.ports.append(int(self.procs[-1].ready["port"]))
        self.list = MasterList(self.addresses)
        wait(lambda: self.view().leader_id, 30)
        return self

    @property
    def addresses(self) -> str:
        return ",".join(self.address(i) for i in range(len(self.ports)))

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def stub(self, i: int) -> master_pb2_grpc.MasterServiceStub:
        if i not in self._one:
            self._one[i] = MasterList(self.address(i))
        return self._one[i].stub()

    def view(self, i: int | None = None) -> master_pb2.ClusterView:
        try:
            if i is None:
                return self.list.call("GetView", master_pb2.GetViewRequest(), timeout=2)
            return self.stub(i).GetView(master_pb2.GetViewRequest(), timeout=2)
        except grpc.RpcError:
            return master_pb2.ClusterView()

    def leader(self) -> int:
        wait(lambda: self.view().leader_id, 30)
        leader = self.view().leader_id
        return next(i for i, p in enumerate(self.procs) if p.ready["master_id"] == leader)

    def restart(self, i: int) -> None:
        self.procs[i] = self._spawn(i, self.ports[i])

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        self.list.close()


def wait(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    raise TimeoutError("condition not met")


def failover(masters: Masters, kills: int) -> dict:
    lead, serve = [], []
    for _ in range(kills):
        old = masters.leader()
        new = 1 - old
        new_id = masters.procs[new].ready["master_id"]
        masters.procs[old].kill()
        t0 = time.monotonic()
        wait(lambda: masters.view(new).leader_id == new_id, 60)
        lead.append(time.monotonic() - t0)

        def serves() -> bool:
            try:
                masters.list.call("ListJobs", master_pb2.ListJobsRequest(), timeout=2)
                return True
            except grpc.RpcError:
                return False

        wait(serves, 60)
        serve.append(time.monotonic() - t0)
        masters.restart(old)
        wait(lambda: len(masters.view(new).masters) == 2, 30)
    return {"kills": kills, "lease_seconds": masters.lease, "seconds_to_new_leader": summary(lead),
            "seconds_to_leader_only_call": summary(serve), "target_seconds": 2 * masters.lease,
            "samples_to_new_leader": [round(x, 3) for x in lead]}


class Watcher:
    """A WatchView stream on one master, noting when each worker and mount first appears."""

    def __init__(self, stub: master_pb2_grpc.MasterServiceStub) -> None:
        self.seen: dict[str, float] = {}
        self._call = stub.WatchView(master_pb2.GetViewRequest())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for view in self._call:
                now = time.monotonic()
                for name in [w.worker_id for w in view.workers] + ["mount:" + m.name for m in view.mounts]:
                    self.seen.setdefault(name, now)
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        self._call.cancel()


def propagation(masters: Masters, workers: int, samples: int) -> dict:
    reg = lambda wid: masters.list.call("RegisterWorker", master_pb2.RegisterWorkerRequest(  # noqa: E731
        worker=master_pb2.WorkerInfo(worker_id=wid, address=f"10.0.{len(wid) % 250}.{abs(hash(wid)) % 250}:29999")),
        timeout=10)
    ids = [f"sim-{i:04d}" for i in range(workers)]
    for wid in ids:
        reg(wid)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(2.0):
            for wid in list(ids):
                try:
                    masters.list.call("Heartbeat", master_pb2.HeartbeatRequest(worker_id=wid), timeout=5)
                except grpc.RpcError:
                    pass

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    leader = masters.leader()
    watchers = {"leader": Watcher(masters.stub(leader)), "standby": Watcher(masters.stub(1 - leader))}
    wait(lambda: all(len(w.seen) >= workers for w in watchers.values()), 30)
    joins = {k: [] for k in watchers}
    mounts = {k: [] for k in watchers}
    try:
        for i in range(samples):
            wid = f"join-{i:04d}"
            t0 = time.monotonic()
            reg(wid)
            ids.append(wid)
            wait(lambda: all(wid in w.seen for w in watchers.values()), 30, interval=0.001)
            for k, w in watchers.items():
                joins[k].append(w.seen[wid] - t0)
        for i in range(max(5, samples // 3)):
            name = f"m{i}"
            t0 = time.monotonic()
            masters.list.call("AddMount", master_pb2.AddMountRequest(name=name, url=str(masters.store)), timeout=10)
            wait(lambda: all(f"mount:{name}" in w.seen for w in watchers.values()), 30, interval=0.001)
            for k, w in watchers.items():
                mounts[k].append(w.seen[f"mount:{name}"] - t0)
    finally:
        stop.set()
        for w in watchers.values():
            w.stop()
    return {"workers_registered": workers, "samples": samples,
            "worker_join_seconds": {k: summary(v) for k, v in joins.items()},
            "mount_add_seconds": {k: summary(v) for k, v in mounts.items()}}


def footprint(etcd: EtcdCluster, prefix: bytes, db_before: int, db_after: int, workers: int) -> dict:
    client = EtcdClient(EtcdSettings(tuple(etcd.endpoints)))
    try:
        out = {}
        for kind in ("members", "mounts", "jobs", "masters"):
            resp = client.get_prefix(prefix + kind.encode() + b"/")
            n = len(resp.kvs)
            key_bytes = sum(len(kv.key) for kv in resp.kvs)
            value_bytes = sum(len(kv.value) for kv in resp.kvs)
            out[kind] = {"keys": n, "bytes_per_item": round((key_bytes + value_bytes) / n, 1) if n else 0,
                         "leases": len({kv.lease for kv in resp.kvs if kv.lease})}
        out["etcd_db_bytes_per_worker_registered"] = round((db_after - db_before) / workers, 1)
        return out
    finally:
        client.close()


def db_size(etcd: EtcdCluster) -> int:
    client = EtcdClient(EtcdSettings(tuple(etcd.endpoints)))
    try:
        return int(client.unary("Status", api.StatusRequest()).dbSize)
    finally:
        client.close()


def cold_caches(masters: Masters, store: Path, objects: int, tmp: Path) -> dict:
    worker = worker_process({}, str(tmp / "cache"), extra=["--master", masters.addresses],
                            log_path=str(tmp / "worker.log")).start()
    try:
        # Only the real worker: the simulated ones' leases have run out (10 s after their last beat).
        wait(lambda: [w.address for w in masters.view().workers] == [worker.address], 60, interval=0.1)
        paths = [f"data/d/o{i:05d}.bin" for i in range(objects)]

        def figures(i: int) -> dict:
            stub = masters.stub(i)
            out = {}
            for label in ("first", "again"):
                # Lookups first: a listing fills the metadata cache, so they would never be cold after it.
                t0 = time.perf_counter()
                for s in range(0, objects, 1000):
                    stub.GetInfos(master_pb2.GetInfosRequest(paths=paths[s:s + 1000]), timeout=60)
                out[f"lookups_per_s_{label}"] = round(objects / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                n = sum(len(b.entries) for b in stub.List(worker_pb2.ListRequest(path="data/d", recursive=True), timeout=60))
                out[f"ls_{label}_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
                t0 = time.perf_counter()
                stub.Stat(master_pb2.StatRequest(path="data/d"), timeout=60)
                out[f"stat_{label}_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            out["entries"] = n
            return out

        old = masters.leader()
        before = figures(old)
        new = 1 - old
        new_id = masters.procs[new].ready["master_id"]
        masters.procs[old].kill()
        wait(lambda: masters.view(new).leader_id == new_id, 60)
        after = figures(new)
        def run_job(kind: int) -> tuple[float, master_pb2.Job]:
            t0 = time.monotonic()
            job = None
            while job is None:
                try:
                    job = masters.list.call("SubmitJob", master_pb2.SubmitJobRequest(kind=kind, path="data/d"), timeout=10)
                except grpc.RpcError:
                    time.sleep(0.05)  # no leader yet

            def finished() -> bool:
                state = masters.list.call("GetJob", master_pb2.GetJobRequest(job_id=job.job_id), timeout=10)
                return state.state not in (master_pb2.PENDING, master_pb2.RUNNING)

            wait(finished, 300, interval=0.05)
            return time.monotonic() - t0, masters.list.call("GetJob", master_pb2.GetJobRequest(job_id=job.job_id), timeout=10)

        load_s, done = run_job(master_pb2.LOAD)  # the new leader's first: its listing cache is cold
        run_job(master_pb2.FREE)
        again_s, _ = run_job(master_pb2.LOAD)  # the same load on the same leader, caches warm
        masters.restart(old)
        return {"objects": objects, "old_leader_before_kill": before, "new_leader_after_failover": after,
                "load_job_after_failover": {"seconds": round(load_s, 2), "same_load_again_seconds": round(again_s, 2), "state": master_pb2.JobState.Name(done.state),
                                            "objects_done": done.objects_done, "bytes_done": done.bytes_done,
                                            "error": done.error[:300]}}
    finally:
        worker.stop()


def plot(result: dict, path: Path) -> None:
    """Failover per kill against 2x the lease; view propagation on leader and standby."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    f = result["failover"]
    samples = f["samples_to_new_leader"]
    a.bar(range(1, len(samples) + 1), samples, color="#4c72b0")
    a.axhline(f["target_seconds"], color="#c44e52", linestyle="--", label=f"2x lease ({f['target_seconds']:g} s)")
    a.axhline(f["lease_seconds"], color="#999999", linestyle=":", label=f"lease ({f['lease_seconds']:g} s)")
    a.set_xlabel("leader kill (-9)")
    a.set_ylabel("seconds until the standby leads")
    a.set_title(f"failover: median {f['seconds_to_new_leader']['median']:.1f} s, p99 {f['seconds_to_new_leader']['p99']:.1f} s")
    a.legend(loc="lower right", fontsize=8)
    v = result["view_propagation"]
    labels, medians, p99s = [], [], []
    for what in ("worker_join_seconds", "mount_add_seconds"):
        for where in ("leader", "standby"):
            labels.append(f"{what.split('_')[0]}\n{where}")
            medians.append(v[what][where]["median"] * 1e3)
            p99s.append(v[what][where]["p99"] * 1e3)
    x = range(len(labels))
    b.bar([i - 0.2 for i in x], medians, width=0.4, label="median", color="#55a868")
    b.bar([i + 0.2 for i in x], p99s, width=0.4, label="p99", color="#8172b2")
    b.set_xticks(list(x), labels, fontsize=8)
    b.set_ylabel("ms until a watcher has it")
    b.set_title(f"view propagation, {v['workers_registered']} workers registered")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--objects", type=int, default=5000)
    parser.add_argument("--quick", action="store_true", help="3 kills, 20 workers, 10 samples, 1,000 objects")
    parser.add_argument("--out", default="")
    parser.add_argument("--plot-only", metavar="JSON", help="only draw the PNG of an earlier result")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return 0
    if args.quick:
        args.kills, args.workers, args.samples, args.objects = 3, 20, 10, 1000
    result: dict = {"benchmark": "control-plane", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "nproc": os.cpu_count(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="cachefs-bench-cp-") as tmp_name:
        tmp = Path(tmp_name)
        store = tmp / "store"
        (store / "d").mkdir(parents=True)
        for i in range(args.objects):
            (store / "d" / f"o{i:05d}.bin").write_bytes(os.urandom(4096))
        with EtcdCluster(3, base_dir=tmp / "etcd") as etcd:
            result["etcd"] = {"members": 3, "binary": etcd.binary}
            masters = Masters(tmp, etcd, args.lease, store).start()
            try:
                db0 = db_size(etcd)
                result["view_propagation"] = propagation(masters, args.workers, args.samples)
                db1 = db_size(etcd)
                masters.list.call("SubmitJob", master_pb2.SubmitJobRequest(kind=master_pb2.FREE, path="data/d"), timeout=10)
                result["etcd_footprint"] = footprint(etcd, b"/cachefs/default/", db0, db1,
                                                     args.workers + args.samples)
                result["failover"] = failover(masters, args.kills)
                result["after_failover"] = cold_caches(masters, store, args.objects, tmp)
            finally:
                masters.stop()
    out = Path(args.out) if args.out else BASELINES / f"control-plane-{time.strftime('%Y-%m-%d')}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
