"""#47: a cold epoch of small objects from a local-directory mount (``bench_scale.py --cold-small``).

``objects`` files of ``size`` bytes (4 KiB) in a local directory, 1,000 a directory; a real
cluster as ``cachefs local`` starts it (a master and one worker, processes; the mount the local
directory); one cold epoch of ``CacheDataset.from_prefix`` under ``DataLoader(num_workers=2)``
(batch 64, the dataset's sampler: a shuffled order). Against it, the physical cost of a fill:
a loop that reads each file and writes it to a new file on the cache's disk (the same
filesystem as the worker's cache dir), in one process. Reported:

* ``cachefs_samples_per_s`` (the epoch, the listing before it not counted), ``copy_samples_per_s``
  and ``ratio`` (cachefs / copy; the target is >= 0.33);
* ``worker_cpu_us_per_object``: the worker process's user + system CPU during the epoch
  (``/proc/PID/stat``) / objects (the target is <= 100 us); ``worker_cpu_s`` its total, and
  ``worker_cpu_listing_s`` the listing's (before the epoch);
  ``worker_user_us_per_object`` and ``worker_sys_us_per_object`` split it;
  ``worker_switches_per_object``: its threads' context switches (voluntary and not) / objects;
* ``loader_cpu_us_per_object``: the training process's own CPU, its DataLoader workers included
  (children reaped), for scale;
* ``wrong``: samples whose bytes differ from the file's (must be 0).

``COLD_SMALL_PYSPY=FILE`` records the worker's stacks during the epoch with py-spy (on PATH, or
``PYSPY``), collapsed, into FILE.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
import zlib

from torch.utils.data import DataLoader

PER_DIR = 1000


def _cpu(pid: int) -> tuple[float, float, int]:
    """User and system CPU seconds of the process, and its threads' context switches."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    switches = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                switches += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:  # a thread that ended meanwhile
            pass
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick, switches


def _make(data: str, objects: int, size: int) -> list[int]:
    crcs = []
    for i in range(objects):
        d = os.path.join(data, "train", f"d{i // PER_DIR:05d}")
        if i % PER_DIR == 0:
            os.makedirs(d, exist_ok=True)
        blob = os.urandom(size)
        with open(os.path.join(d, f"{i % PER_DIR:08d}.bin"), "wb") as f:
            f.write(blob)
        crcs.append(zlib.crc32(blob))
    return crcs


def copy_loop(data: str, out: str, objects: int) -> float:
    """Seconds to read each file and write it to a new file under ``out`` (the physical fill)."""
    t0 = time.perf_counter()
    for i in range(objects):
        d = f"d{i // PER_DIR:05d}"
        if i % PER_DIR == 0:
            os.makedirs(os.path.join(out, d), exist_ok=True)
        name = os.path.join(d, f"{i % PER_DIR:08d}.bin")
        with open(os.path.join(data, "train", name), "rb") as f:
            blob = f.read()
        with open(os.path.join(out, name), "wb") as f:
            f.write(blob)
    return time.perf_counter() - t0


def _crc(sample: object) -> int:
    return zlib.crc32(sample.numpy().tobytes() if hasattr(sample, "numpy") else bytes(sample))  # type: ignore


def measure(objects: int, size: int = 4096, base: str | None = None, loader_workers: int = 2,
            batch: int = 64) -> dict[str, object]:
    import cachefs
    from cachefs.local import LocalCluster

    tmp = tempfile.mkdtemp(prefix="cachefs-coldsmall-", dir=base)
    try:
        data = os.path.join(tmp, "data")
        want = _make(data, objects, size)
        copy_s = copy_loop(data, os.path.join(tmp, "copy"), objects)
        shutil.rmtree(os.path.join(tmp, "copy"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_"))}
        with LocalCluster(os.path.join(tmp, "cluster"), workers=1, mounts={"bench": data}, env=env,
                          quota="8GiB") as cluster:
            cluster.wait_for_workers(1, timeout=60)
            pid = cluster.workers[0].pid
            cpu0 = sum(_cpu(pid)[:2])
            ds = cachefs.CacheDataset.from_prefix("cachefs://bench/train",
                                                  storage_options={"master": cluster.master_address},
                                                  transform=_crc, seed=0)
            assert len(ds) == objects, len(ds)
            time.sleep(0.5)  # the listing's bookkeeping behind it
            user1, sys1, switches1 = _cpu(pid)
            cpu1 = user1 + sys1
            loader = DataLoader(ds, batch_size=batch, sampler=ds.sampler(), num_workers=loader_workers)
            spy = None
            if os.environ.get("COLD_SMALL_PYSPY"):
                spy = subprocess.Popen([os.environ.get("PYSPY", "py-spy"), "record", "-p", str(pid), "-r", "250",
                                        "--format", "raw", "--nonblocking", *os.environ.get("COLD_SMALL_PYSPY_ARGS", "").split(),
                                        "-o", os.environ["COLD_SMALL_PYSPY"]],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            me0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            got = []
            for b in loader:
                got.extend(int(x) for x in b)
            epoch_s = time.perf_counter() - t0
            user2, sys2, switches2 = _cpu(pid)
            cpu2 = user2 + sys2
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            me1 = resource.getrusage(resource.RUSAGE_SELF)
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the DataLoader workers, reaped (and none else yet)
            wrong = sum(1 for a, b in zip(sorted(got), sorted(want)) if a != b) + abs(len(got) - len(want))
            del loader, ds
        worker_s = cpu2 - cpu1
        loader_s = (me1.ru_utime + me1.ru_stime - me0.ru_utime - me0.ru_stime) + kids.ru_utime + kids.ru_stime
        return {"mode": "cold-small", "objects": objects, "object_bytes": size, "loader_workers": loader_workers,
                "batch": batch, "cachefs_epoch_s": round(epoch_s, 3),
                "cachefs_samples_per_s": round(objects / epoch_s, 1), "copy_s": round(copy_s, 3),
                "copy_samples_per_s": round(objects / copy_s, 1), "ratio": round(copy_s / epoch_s, 3),
                "worker_cpu_s": round(worker_s, 3), "worker_cpu_listing_s": round(cpu1 - cpu0, 3),
                "worker_cpu_us_per_object": round(worker_s / objects * 1e6, 1),
                "worker_user_us_per_object": round((user2 - user1) / objects * 1e6, 1),
                "worker_sys_us_per_object": round((sys2 - sys1) / objects * 1e6, 1),
                "worker_switches_per_object": round((switches2 - switches1) / objects, 2),
                "loader_cpu_us_per_object": round(loader_s / objects * 1e6, 1),
                "loadavg": os.getloadavg()[0], "wrong": wrong}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
