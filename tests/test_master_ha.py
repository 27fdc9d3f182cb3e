"""Several masters on a real 3-member etcd, as processes: kill -9 and freeze the leader, lose etcd.

Masters run with a 3 s election lease (a standby must lead within 2x that), the worker with
the list of masters; reads go on in threads through a client given the same list.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from cachefs.local import DaemonProcess, master_process, worker_process
from cachefs.masters import MasterList
from cachefs.proto import master_pb2
from helpers import ReadLoop, client, payload, wait_for

LEASE = 3.0
OBJECTS = 40


class HA:
    """Two masters and a worker on etcd; ``masters[i]`` restartable on its port and state dir."""

    def __init__(self, tmp: Path, etcd, root: Path) -> None:
        self.tmp, self.etcd, self.root = tmp, etcd, root
        self.masters: list[DaemonProcess] = []
        self.ports: list[int] = []
        self.worker: DaemonProcess | None = None

    def _master_args(self, i: int, port: int = 0) -> DaemonProcess:
        args = ["--etcd", ",".join(self.etcd.endpoints), "--election-lease-seconds", str(LEASE),
                "--mount", f"data={self.root}", "--lease-seconds", "6", "--heartbeat-seconds", "0.5"]
        daemon = master_process(str(self.tmp / f"m{i}"), args, log_path=str(self.tmp / f"m{i}.log"))
        if port:
            daemon.args[daemon.args.index("--port") + 1] = str(port)
        return daemon

    def start(self) -> "HA":
        for i in range(2):
            self.masters.append(self._master_args(i).start())
            self.ports.append(int(self.masters[-1].ready["port"]))
        self.worker = worker_process({}, str(self.tmp / "cache"), extra=["--master", self.addresses],
                                     log_path=str(self.tmp / "worker.log")).start()
        self.list = MasterList(self.addresses)
        assert wait_for(lambda: len(self.view().workers) == 1 and self.view().leader_id, timeout=30)
        return self

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def view(self, address: str | None = None) -> master_pb2.ClusterView:
        one = MasterList(address) if address else None
        try:
            return (one or self.list).call("GetView", master_pb2.GetViewRequest(), timeout=3)
        except grpc.RpcError:
            return master_pb2.ClusterView()
        finally:
            if one is not None:
                one.close()  # no channel left for the garbage collector to close during a later test

    def leader_index(self) -> int:
        leader = self.view().leader_id
        return next(i for i, m in enumerate(self.masters) if m.ready["master_id"] == leader)

    def restart(self, i: int) -> None:
        self.masters[i] = self._master_args(i, self.ports[i]).start()

    def job(self, job_id: str) -> master_pb2.Job:
        return self.list.call("GetJob", master_pb2.GetJobRequest(job_id=job_id), timeout=10)

    def stop(self) -> None:
        for daemon in [self.worker, *self.masters]:
            if daemon is not None:
                with contextlib.suppress(Exception):
                    os.kill(daemon.pid, signal.SIGCONT)
                daemon.kill()
        self.list.close()


@contextlib.contextmanager
def ha_cluster(tmp_path: Path, etcd) -> Iterator[tuple[HA, dict[str, bytes]]]:
    root = tmp_path / "store"
    objects = {}
    for i in range(OBJECTS):
        data = payload(40_000 + 113 * i, i)
        (root / "d").mkdir(parents=True, exist_ok=True)
        (root / "d" / f"o{i:02d}.bin").write_bytes(data)
        objects[f"d/o{i:02d}.bin"] = data
    ha = HA(tmp_path, etcd, root)
    try:
        yield ha.start(), objects
    finally:
        ha.stop()


def _wait_job(ha: HA, job_id: str, timeout: float = 60) -> master_pb2.Job:
    done: list[master_pb2.Job] = []

    def finished() -> bool:
        try:
            job = ha.job(job_id)
        except grpc.RpcError:
            return False  # no leader yet: asked again
        if job.state in (master_pb2.SUCCEEDED, master_pb2.FAILED, master_pb2.CANCELLED):
            done.append(job)
            return True
        return False

    assert wait_for(finished, timeout=timeout, interval=0.2), "the job did not finish"
    return done[0]


def test_leader_killed_under_reads_and_during_a_load_job(tmp_path, etcd_cluster):
    with ha_cluster(tmp_path, etcd_cluster) as (ha, objects):
        fs = client(master=ha.addresses, timeout=5)
        with ReadLoop(fs, objects) as loop:
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
            old = ha.leader_index()
            survivor = 1 - old
            # The standby passes leader-only calls on (the caller's token with them), serves the view itself.
            standby = MasterList(f"127.0.0.1:{ha.ports[survivor]}")
            try:
                standby.call("AddMount", master_pb2.AddMountRequest(name="via-standby", url=str(ha.root)), timeout=10)
                assert wait_for(lambda: "via-standby" in [m.name for m in ha.view(standby.current).mounts], timeout=10)
                assert standby.call("ListJobs", master_pb2.ListJobsRequest(), timeout=10).jobs == []
            finally:
                standby.close()
            job = ha.list.call("SubmitJob", master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/d"),
                               timeout=10)
            ha.masters[old].kill()  # kill -9, the job just submitted (pending or running there)
            killed = time.monotonic()
            new_id = ha.masters[survivor].ready["master_id"]
            survivor_address = f"127.0.0.1:{ha.ports[survivor]}"
            assert wait_for(lambda: ha.view(survivor_address).leader_id == new_id, timeout=4 * LEASE,
                            interval=0.05)
            failover = time.monotonic() - killed
            assert failover < 2 * LEASE, f"standby led only after {failover:.1f}s"
            done = _wait_job(ha, job.job_id)
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
        assert not loop.errors, loop.errors[:3]
        assert done.state == master_pb2.SUCCEEDED, done.error
        assert done.objects_done == OBJECTS and done.objects_failed == 0
        jobs = ha.list.call("ListJobs", master_pb2.ListJobsRequest(), timeout=10).jobs
        assert [j.job_id for j in jobs] == [job.job_id]  # one job, finished once
        # ... by the new leader, which resumed it from the record the dead one left in etcd; or,
        # where the dead one finished it in the moment between the submit and the kill (its
        # objects are cached by the read loop: a job of milliseconds), by the dead one, once.
        survivor_log = (ha.tmp / f"m{survivor}.log").read_text()
        if f"job {job.job_id} resumes" not in survivor_log:
            assert f"job {job.job_id} SUCCEEDED" in (ha.tmp / f"m{old}.log").read_text(), survivor_log[-2000:]
        else:
            assert f"job {job.job_id} SUCCEEDED" in survivor_log
        assert [m.name for m in ha.view().mounts] == ["data", "via-standby"]
        # `cachefs status` through the list, the dead master first in it.
        out = subprocess.run([sys.executable, "-m", "cachefs.cli", "status", "--master", ha.addresses],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"leader {survivor_address}" in out.stdout and "1 live worker" in out.stdout
        # The old leader comes back as a standby; the leader stays.
        ha.restart(old)
        old_address = f"127.0.0.1:{ha.ports[old]}"
        assert wait_for(lambda: ha.view(old_address).leader_id == new_id, timeout=20)
        view = ha.view(old_address)
        assert view.master_id == ha.masters[old].ready["master_id"] and len(view.workers) == 1
        assert sorted(view.masters) == sorted(ha.addresses.split(","))


def test_cachefs_load_right_after_the_leader_is_killed_waits_for_the_new_one(tmp_path, etcd_cluster):
    """The admin CLI gives a call one budget (--timeout): while no master can carry it out (the
    standby still names the dead leader) it asks again until one can, instead of failing at once."""
    with ha_cluster(tmp_path, etcd_cluster) as (ha, objects):
        old = ha.leader_index()
        dead_first = ",".join([f"127.0.0.1:{ha.ports[old]}", f"127.0.0.1:{ha.ports[1 - old]}"])
        ha.masters[old].kill()
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "cachefs.cli", "load", "data/d", "--quiet", "--master", dead_first,
                              "--timeout", str(6 * LEASE)], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert "SUCCEEDED" in out.stdout or "succeeded" in out.stdout.lower(), out.stdout
        assert took < 6 * LEASE + 30, took
        jobs = ha.list.call("ListJobs", master_pb2.ListJobsRequest(), budget=10, timeout=10).jobs
        assert len(jobs) == 1, jobs  # submitted once, whatever the retries


def test_frozen_leader_never_acts_alongside_the_new_one(tmp_path, etcd_cluster):
    with ha_cluster(tmp_path, etcd_cluster) as (ha, objects):
        old = ha.leader_index()
        survivor = 1 - old
        new_id = ha.masters[survivor].ready["master_id"]
        job = ha.list.call("SubmitJob", master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/d"), timeout=10)
        os.kill(ha.masters[old].pid, signal.SIGSTOP)
        try:
            survivor_address = f"127.0.0.1:{ha.ports[survivor]}"
            assert wait_for(lambda: ha.view(survivor_address).leader_id == new_id, timeout=4 * LEASE)
        finally:
            os.kill(ha.masters[old].pid, signal.SIGCONT)
        done = _wait_job(ha, job.job_id)
        assert done.state == master_pb2.SUCCEEDED, done.error
        old_address = f"127.0.0.1:{ha.ports[old]}"
        # Woken, it knows it no longer leads and serves as a standby.
        assert wait_for(lambda: ha.view(old_address).leader_id == new_id, timeout=10)
        log = (ha.tmp / f"m{old}.log").read_text()
        assert "stops leading" in log
        # It finished no job and sent no batch that a worker took after the new leader's.
        assert f"job {job.job_id} SUCCEEDED" not in log
        assert f"job {job.job_id} SUCCEEDED" in (ha.tmp / f"m{survivor}.log").read_text()
        worker_log = (ha.tmp / "worker.log").read_text()
        assert "Traceback" not in worker_log
        assert ha.view().leader_id == new_id


def test_etcd_down_reads_go_on_admin_fails_fast_and_all_recovers(tmp_path, etcd_cluster):
    with ha_cluster(tmp_path, etcd_cluster) as (ha, objects):
        fs = client(master=ha.addresses, timeout=5)
        cli = [sys.executable, "-m", "cachefs.cli", "mount", "--master", ha.addresses]
        with ReadLoop(fs, objects) as loop:
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
            # One etcd member killed: nothing to see. A change goes through, at once or, where the member
            # was etcd's raft leader and its election outlasted the master's lease, once a master leads again.
            leader_id = ha.view().leader_id
            etcd_cluster.kill(0)
            out = subprocess.run(cli + ["one", str(ha.root)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            # The same leader (a GetView that timed out at this load reads as an empty view: ask again).
            assert wait_for(lambda: (v := ha.view()).leader_id == leader_id and len(v.workers) == 1, timeout=15)
            for i in range(1, 3):
                etcd_cluster.kill(i)
            # Past the leader's lease: no master leads, every master still serves the last view.
            assert wait_for(lambda: not ha.view().leader_id and len(ha.view().workers) == 1, timeout=4 * LEASE)
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
            # Etcd down for a lease or more reads as down, not as an election: the call gives up well
            # within its budget instead of waiting for a leader that cannot come.
            t0 = time.monotonic()
            out = subprocess.run(cli + ["more", str(ha.root), "--timeout", "40"], capture_output=True, text=True,
                                 timeout=60)
            took = time.monotonic() - t0
            assert out.returncode == 3, (out.stdout, out.stderr)
            assert "etcd" in out.stderr or "lead" in out.stderr, out.stderr
            assert took < 20, f"the admin command took {took:.1f}s of its 40 s with etcd down"
            for i in range(3):
                etcd_cluster.restart(i)
            # No restarts: a leader again, the change goes through, the worker is still in the view.
            assert wait_for(lambda: subprocess.run(cli + ["more", str(ha.root)], capture_output=True,
                                                   timeout=60).returncode == 0, timeout=45, interval=1.0)
            assert loop.wait_reads(), (loop.reads, loop.errors[:3])
        assert not loop.errors, loop.errors[:3]
        assert wait_for(lambda: sorted(m.name for m in ha.view().mounts) == ["data", "more", "one"], timeout=10)
        assert wait_for(lambda: len(ha.view().workers) == 1, timeout=20)
