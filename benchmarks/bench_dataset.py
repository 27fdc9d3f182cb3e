"""Training-loop benchmark: DataLoaders over the same samples, side by side, in one run.

    bash benchmarks/setup_peers.sh                       # once: a venv with the peers
    .venv-bench/bin/python benchmarks/bench_dataset.py   # full: 2,000 samples of 256 KiB
    .venv-bench/bin/python benchmarks/bench_dataset.py --quick
    .venv-bench/bin/python benchmarks/bench_dataset.py --quick --delay-ms 10   # store ~40 ms to first byte

One moto S3 server holds the samples three ways: one object per sample, tar shards (with
cachefs's index.json) and MosaicML MDS shards (64 MiB each); a local directory holds them as
files. Each loader reads a cold epoch, then all read warm ones in rounds (``--warm-epochs``, 5 by
default; each round every loader once, the order rotated, so that the machine's slow phases and
one loader's leftovers fall on all alike; the median kept: a warm epoch lasts tens of ms here),
with DataLoader workers 0 and 2, batch 32:

* ``local``: files on local disk, aligned ``readinto`` + ``torch.frombuffer`` (the limit);
* ``s3fs``: a map Dataset calling ``cat_file`` per sample;
* ``streaming``: MosaicML ``StreamingDataset`` over the MDS shards (its local cache dir is new
  for a cold epoch);
* ``s3torchconnector``: ``S3MapDataset.from_objects`` (no cache: cold and warm alike);
* ``cachefs-map``: ``CacheDataset`` over the per-sample objects through one worker process;
* ``cachefs-tar``: ``CacheIterableDataset`` over the tar shards through the same worker.
Cold cachefs epochs start from an empty cache (the worker's ``Free``). Every epoch checks that
each sample came exactly once, and records CPU seconds: the loader's own (this process, its
DataLoader workers, and for cachefs the worker process) and the store's (moto), also per GB read;
for cachefs the worker's store requests by kind and bytes fetched and the CPU its page-file writes took, and with workers 0 this
process's reads by the path they took (``client``: held descriptors, by name, the worker). During
each cold epoch an outside process writes a new 256 KiB file every 50 ms and times it
(``write_probe``): what new page-cache memory costs on the machine then (on this VM 0.07-0.1 ms
when little else is written, up to ~1 ms while an epoch writes its cache). Then the data-stall share: a warm epoch with a simulated step of
2x the sample's read time (``time.sleep``, as a GPU step leaves the CPU free) per batch.

``--delay-ms D`` puts moto D ms away each way (benchmarks/netem.py: a network namespace + veth +
``tc netem``, else a delay proxy; the endpoint's note and a measured GET time go into the JSON).
``--store-mbps M`` also bounds each store connection to M MB/s (the same proxy), as S3 bounds a
single stream: whole-shard GETs then pay for it, parallel ranged GETs do not. As per-object peers then crawl, ``--peer-samples`` bounds what s3fs and s3torchconnector read per
epoch (64 by default with ``--quick`` and a delay; their rows' ``items`` say how many).

Writes benchmarks/results/dataset-<timestamp>.json (and latest-dataset.json) and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import shutil
import sys
import subprocess
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from importlib.machinery import ModuleSpec
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from read_common import machine_info, process_cpu, process_cpu_split  # noqa: E402

from cachefs.local import toml_value  # noqa: E402

from netem import Endpoint, moto_endpoint  # noqa: E402

MOUNT = "bench"
PER_OBJECT_PEERS = ("s3fs", "s3torchconnector")  # --peer-samples bounds what these read
WORKER_COUNTERS = ("cachefs_worker_bytes_from_store_total", "cachefs_worker_bytes_from_cache_total",
                   "cachefs_worker_page_reads_total", "cachefs_worker_load_bytes_total",
                   "cachefs_worker_store_requests_total", "cachefs_worker_page_writes_dropped_total",
                   "cachefs_worker_cache_page_write_cpu_seconds_total")
HERE = os.path.dirname(os.path.abspath(__file__))
ID = 8  # every sample starts with its index as 8 ASCII digits


# -- samples -------------------------------------------------------------------------------------------
def sample_bytes(i: int, size: int, noise: bytes) -> bytes:
    return f"{i:08d}".encode() + noise[: size - ID]


def ids_of(batch: torch.Tensor) -> list[int]:
    return [int(bytes(row)) for row in batch[:, :ID].numpy()]


def _stub_torchvision() -> None:
    """MosaicML streaming imports torchvision, whose PyPI build does not load beside this torch."""
    if "torchvision" in sys.modules:
        return
    for name, attrs in {"torchvision": {}, "torchvision.datasets": {"VisionDataset": type("VisionDataset", (), {}),
                                                                   "CIFAR10": type("CIFAR10", (), {})},
                        "torchvision.transforms": {}, "torchvision.transforms.functional": {"to_tensor": lambda x: x}
                        }.items():
        mod = types.ModuleType(name)
        mod.__spec__ = ModuleSpec(name, None)
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__dict__.update(attrs)
        sys.modules[name] = mod


# -- the datasets (module level: DataLoader workers fork) --------------------------------------------------

def recycle_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of new memory and free it, so that the cold phase after starts on memory
    the kernel just had in use, whichever loader it is.

    On a VM whose balloon device reports free pages to the host (virtio_balloon free page
    reporting: this machine), memory free for a few seconds goes back to the host, and the first
    write into it costs a fault on the host: writing 500 MB of new files took 2.5 s of CPU here
    (0.21 GB/s), the same right after 500 MB were freed 0.1 s (5 GB/s). A cold phase writes its
    data set once (a cache's pages, streaming's shard files), so whichever loader happened to run
    right after memory was freed looked several times cheaper. Bare-metal hosts have no such cost.
    """
    if nbytes <= 0:
        return
    buf = bytearray(nbytes)
    buf[::4096] = b"\1" * len(range(0, nbytes, 4096))  # one write a page: each is faulted in
    del buf


class LocalFiles(Dataset):
    def __init__(self, paths: list[str], size: int) -> None:
        self.paths, self.size = paths, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        out = torch.empty(self.size, dtype=torch.uint8)  # aligned, owned by torch
        with open(self.paths[i], "rb", buffering=0) as f:
            f.readinto(out.numpy())
        return out


class S3fsMap(Dataset):
    def __init__(self, keys: list[str], so: dict[str, Any]) -> None:
        self.keys, self.so, self._fs = keys, so, None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._fs is None or self._pid != os.getpid():
            import s3fs
            self._fs, self._pid = s3fs.S3FileSystem(skip_instance_cache=True, **self.so), os.getpid()
        return torch.frombuffer(bytearray(self._fs.cat_file(self.keys[i])), dtype=torch.uint8)


def connector_transform(reader: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(reader.read()), dtype=torch.uint8)


def tar_sample(sample: dict[str, Any]) -> torch.Tensor:
    return sample["bin"]


def make_streaming(remote: str, local: str, batch_size: int) -> Dataset:
    _stub_torchvision()
    from streaming import StreamingDataset

    class Streaming(StreamingDataset):
        def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
            return torch.frombuffer(bytearray(super().__getitem__(i)["data"]), dtype=torch.uint8)

    return Streaming(remote=remote, local=local, shuffle=True, batch_size=batch_size, predownload=8 * batch_size)


# -- running epochs --------------------------------------------------------------------------------------
def epoch(loader: DataLoader, n: int, step: float = 0.0) -> dict[str, Any]:
    """One pass; every sample exactly once; wait = time spent waiting on the loader."""
    seen: Counter[int] = Counter()
    t0 = time.perf_counter()
    wait = first = 0.0
    it = iter(loader)
    while True:
        w0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited = time.perf_counter() - w0
        wait += waited
        first = first or waited  # the first batch also waits for the DataLoader's workers to start
        seen.update(ids_of(batch))
        if step:
            time.sleep(step)
    seconds = time.perf_counter() - t0
    if sorted(seen) != list(range(n)) or max(seen.values()) != 1:
        dup = sum(c - 1 for c in seen.values())
        raise AssertionError(f"epoch read {len(seen)} distinct of {n} samples ({dup} repeats)")
    steady = (wait - first) / (seconds - first) if step and seconds > first else None
    return {"items": n, "seconds": round(seconds, 4), "items_per_s": round(n / seconds, 1),
            "wait_s": round(wait, 4), "first_batch_s": round(first, 4),
            "stall_share": round(wait / seconds, 4) if step else None,
            "stall_share_after_first_batch": round(steady, 4) if steady is not None else None}


def own_cpu() -> float:
    """CPU seconds of this process and of its children that have exited (DataLoader workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(fields[:8])
    return (total - fields[3] - fields[4]) / tick, total / tick


def quiesce(deadline_s: float = 10.0, window_s: float = 0.2, busy: float = 0.1) -> float:
    """Wait until the whole machine uses under ``busy`` of one core over a ``window_s`` window,
    or ``deadline_s`` passed; returns the seconds waited. What a loader leaves running after its
    epoch (threads, a worker writing behind, the kernel writing back the files a cold epoch
    wrote) is not the next epoch's to pay for, nor are other users' bursts."""
    start = time.monotonic()
    while True:
        before = machine_busy()[0]
        time.sleep(window_s)
        if machine_busy()[0] - before <= busy * window_s or time.monotonic() - start >= deadline_s:
            return round(time.monotonic() - start, 2)


# An outside writer, in a process of its own (its CPU is nobody's loader CPU): every 50 ms it
# writes a new 256 KiB file (kept until it stops, as page files are) and times the write in
# thread CPU. What it pays is what writing new page-cache memory costs on the machine at that
# moment: 0.07-0.1 ms on this VM when little else is written, up to ~1 ms while an epoch writes
# its cache (docs/performance.md).
_PROBE = r"""
import json, os, sys, threading, time
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
buf = os.urandom(256 << 10); spent = []; stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.wait(0.05):
    fd = os.open(os.path.join(d, str(len(spent))), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    t = time.thread_time(); os.write(fd, buf); spent.append(time.thread_time() - t); os.close(fd)
for name in os.listdir(d):
    os.unlink(os.path.join(d, name))
spent.sort()
print(json.dumps({"writes": len(spent), "median_ms": round(spent[len(spent) // 2] * 1e3, 3) if spent else None,
                  "p90_ms": round(spent[len(spent) * 9 // 10] * 1e3, 3) if spent else None}))
"""


@contextlib.contextmanager
def write_probe(directory: str) -> Iterator[dict[str, Any]]:
    """Runs the outside writer (see _PROBE) while the block runs; its figures land in the dict."""
    out: dict[str, Any] = {}
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, directory], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield out
    finally:
        try:
            stdout, _ = proc.communicate("", timeout=60)
            out.update(json.loads(stdout))
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait()


def own_memory() -> dict[str, int]:
    """This process's resident memory (MB) and thread count: DataLoader workers are forked from
    it, and a larger parent costs each fork more (page tables, copy-on-write faults after)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) // 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: str) -> None:
        self.args, self.tmp = args, tmp
        self.store_pid = self.worker_pid = 0
        self.n, self.size, self.batch = args.samples, args.size, args.batch_size
        self.results: list[dict[str, Any]] = []

    # -- data -------------------------------------------------------------------------------------------
    def setup(self, moto: Endpoint) -> None:
        import s3fs

        self.so = moto.storage_options()
        self.bucket = moto.new_bucket("bench-dataset")
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.so)
        noise = np.random.default_rng(0).integers(0, 256, self.size, dtype=np.uint8).tobytes()
        samples = [sample_bytes(i, self.size, noise) for i in range(self.n)]
        local_root = os.path.join(self.tmp, "local")
        os.makedirs(local_root)
        self.local_paths = []
        for i, data in enumerate(samples):
            path = os.path.join(local_root, f"{i:06d}.bin")
            with open(path, "wb") as f:
                f.write(data)
            self.local_paths.append(path)
        self.fs.pipe({f"{self.bucket}/objs/{i:06d}.bin": d for i, d in enumerate(samples)}, batch_size=16)
        from cachefs.client.datasets.shards import write_tar_shards
        write_tar_shards(((f"s/{i:06d}", {"bin": d}) for i, d in enumerate(samples)), f"s3://{self.bucket}/tars",
                         shard_bytes=self.args.shard_bytes, storage_options=self.so)
        if "streaming" in self.args.loaders:
            _stub_torchvision()
            from streaming import MDSWriter
            mds = os.path.join(self.tmp, "mds")
            with MDSWriter(out=mds, columns={"data": "bytes"}, size_limit=self.args.shard_bytes) as w:
                for d in samples:
                    w.write({"data": d})
            self.fs.put(mds + "/", f"{self.bucket}/mds/", recursive=True)
        self.keys = [f"{self.bucket}/objs/{i:06d}.bin" for i in range(self.n)]
        self.peer_n = min(self.n, self.args.peer_samples or self.n)  # what per-object peers read per epoch

    # -- the cachefs worker -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def worker(self) -> Iterator[str]:
        from cachefs.local import worker_process

        config = os.path.join(self.tmp, "worker.toml")
        with open(config, "w") as f:
            f.write(f"[worker]\n\n[mounts.{MOUNT}]\nurl = {toml_value('s3://' + self.bucket)}\n"
                    f"options = {toml_value(self.so)}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        proc = worker_process({}, os.path.join(self.tmp, "cache"), quota="8GiB", env=env,
                              log_path=os.path.join(self.tmp, "worker.log"), extra=["--config", config])
        proc.start(timeout=60)
        self.worker_pid = proc.pid
        try:
            self.metrics_url = f"http://127.0.0.1:{proc.ready['metrics_port']}/metrics"
            yield proc.address
        finally:
            proc.stop()
            proc.kill()

    def counters(self) -> dict[str, float]:
        """The worker's store/cache counters now (a cachefs epoch's row gets their change)."""
        import urllib.request

        out: dict[str, float] = {}
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                name, _, value = line.rpartition(" ")
                if name.startswith(WORKER_COUNTERS):
                    out[name.removeprefix("cachefs_worker_").replace('"', "")] = float(value)
        return out

    def client_counters(self, loader: str) -> dict[str, int] | None:
        """This process's read counters of a cachefs loader (workers 0 read here): how many
        reads went through held descriptors, by name, or to the worker (session.counters)."""
        ds = {"cachefs-map": getattr(self, "map_ds", None), "cachefs-tar": getattr(self, "tar_ds", None)}.get(loader)
        if ds is None:
            return None
        return dict(ds._local.get().fs.session.counters())

    def cpu(self, loader: str) -> tuple[float, float, float, float]:
        """(this process tree's, the cachefs worker's, the store's, the cachefs worker's system)
        CPU seconds so far."""
        user, system = process_cpu_split(self.worker_pid) if loader.startswith("cachefs") else (0.0, 0.0)
        return own_cpu(), user + system, process_cpu(self.store_pid) if self.store_pid else 0.0, system

    def cpu_row(self, loader: str, before: tuple[float, float, float, float], n: int) -> dict[str, float]:
        """An epoch's CPU: the loader's own (client + DataLoader workers + the cachefs worker) and the
        store's (moto), in seconds and per GB read. The worker's system time is given apart: on a
        VM it includes first touches of page-cache memory the host had taken back (a cold epoch
        writes every page file into new memory; docs/performance.md)."""
        own, worker, store, worker_sys = (a - b for a, b in zip(self.cpu(loader), before))
        gb = n * self.size / 1e9
        return {"loader_s": round(own + worker, 3), "cachefs_worker_s": round(worker, 3),
                "cachefs_worker_sys_s": round(worker_sys, 3), "store_s": round(store, 3),
                "loader_s_per_gb": round((own + worker) / gb, 2), "store_s_per_gb": round(store / gb, 2)}

    @staticmethod
    def free(address: str, prefix: str) -> None:
        """Empty the worker's cache of one data set (only that one: the other stays warm)."""
        import grpc

        from cachefs.proto import worker_pb2, worker_pb2_grpc
        with grpc.insecure_channel(address) as ch:
            worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix=f"{MOUNT}/{prefix}/"),
                                                       timeout=60)

    # -- loaders: name -> (make a loader for num_workers, before a cold epoch) -----------------------------
    def loaders(self, address: str) -> dict[str, tuple[Callable[[int], DataLoader], Callable[[], None]]]:
        b, so, args = self.batch, {"workers": address, **dict(self.args.client_option)}, self.args
        kw = lambda w: dict(batch_size=b, num_workers=w, timeout=300 if w else 0)  # noqa: E731
        out: dict[str, tuple[Callable[[int], DataLoader], Callable[[], None]]] = {}
        nothing = lambda: None  # noqa: E731
        out["local"] = (lambda w: DataLoader(LocalFiles(self.local_paths, self.size), shuffle=True, **kw(w)),
                        lambda: os.system("sync"))  # the page cache stays: local is always warm-ish
        out["s3fs"] = (lambda w: DataLoader(S3fsMap(self.keys[:self.peer_n], self.so), shuffle=True, **kw(w)),
                       nothing)
        if "streaming" in args.loaders:
            state = {"local": ""}

            def cold_streaming() -> None:
                from streaming.base.util import clean_stale_shared_memory
                clean_stale_shared_memory()
                state["local"] = tempfile.mkdtemp(dir=self.tmp, prefix="streaming-")

            def streaming(w: int) -> DataLoader:
                from streaming.base.util import clean_stale_shared_memory
                clean_stale_shared_memory()
                ds = make_streaming(f"s3://{self.bucket}/mds", state["local"], b)
                return DataLoader(ds, **kw(w))
            out["streaming"] = (streaming, cold_streaming)
        if "s3torchconnector" in args.loaders:
            def connector(w: int) -> DataLoader:
                from s3torchconnector import S3ClientConfig, S3MapDataset
                ds = S3MapDataset.from_objects([f"s3://{k}" for k in self.keys[:self.peer_n]], region="us-east-1",
                                               endpoint=self.so["endpoint_url"], transform=connector_transform,
                                               s3client_config=S3ClientConfig(force_path_style=True))
                return DataLoader(ds, shuffle=True, **kw(w))
            out["s3torchconnector"] = (connector, nothing)
        from cachefs.client.datasets.dataset import CacheDataset
        from cachefs.client.datasets.iterable import CacheIterableDataset
        self.map_ds = CacheDataset.from_prefix(f"cachefs://{MOUNT}/objs", storage_options=so, rank=0, world_size=1,
                                               hint_samples=args.hint_samples)
        self.tar_ds = CacheIterableDataset.from_prefix(f"cachefs://{MOUNT}/tars", storage_options=so, batch_size=b,
                                                       rank=0, world_size=1, transform=tar_sample)
        out["cachefs-map"] = (lambda w: DataLoader(self.map_ds, sampler=self.map_ds.sampler(), **kw(w)),
                              lambda: self.free(address, "objs"))
        out["cachefs-tar"] = (lambda w: DataLoader(self.tar_ds, **kw(w)), lambda: self.free(address, "tars"))
        return {k: v for k, v in out.items() if k in args.loaders}

    def items(self, loader: str) -> int:
        return self.peer_n if loader in PER_OBJECT_PEERS else self.n

    def _one(self, name: str, w: int, probe: bool = False) -> dict[str, Any]:
        """One epoch, with the CPU and worker counters it moved (or its error); ``probe``: with
        the outside writer running (write_probe)."""
        make = self._loaders[name][0]
        try:
            waited = quiesce()
            before = self.counters() if name.startswith("cachefs") else None
            client = self.client_counters(name) if w == 0 else None
            with write_probe(os.path.join(self.tmp, "probe")) if probe else contextlib.nullcontext({}) as wrote:
                cpu = self.cpu(name)
                run = epoch(make(w), self.items(name))
                run["cpu"] = self.cpu_row(name, cpu, self.items(name))
            if wrote:
                run["write_probe"] = wrote
            run["quiesce_s"] = waited
            if before is not None:
                run["worker"] = {k: v - before.get(k, 0.0) for k, v in self.counters().items()
                                 if v != before.get(k, 0.0)}
                run["cpu"]["page_write_s"] = round(run["worker"].get("cache_page_write_cpu_seconds_total", 0.0), 3)
            if client is not None:
                run["client"] = {k: v - client.get(k, 0) for k, v in self.client_counters(name).items()
                                 if v != client.get(k, 0)}
            return run
        except Exception as exc:  # one loader failing must not lose the others' figures
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}

    def _record(self, name: str, w: int, phase: str, runs: list[dict[str, Any]]) -> None:
        """The row of a loader's epochs: the median epoch, every epoch's rate, CPU summed."""
        row: dict[str, Any] = {"loader": name, "num_workers": w, "phase": phase, "parent": own_memory()}
        ok = [r for r in runs if "error" not in r]
        if not ok:
            row["error"] = runs[0]["error"] if runs else "no epoch ran"
        else:
            median = sorted(ok, key=lambda r: r["items_per_s"])[len(ok) // 2]
            row.update({k: v for k, v in median.items() if k not in ("cpu", "worker", "quiesce_s", "write_probe")})
            if any("write_probe" in r for r in ok):
                row["write_probe"] = [r.get("write_probe") for r in ok]
            row["quiesce_s"] = [r["quiesce_s"] for r in ok]  # how long the machine took to go quiet before each
            if len(ok) > 1:
                row["items_per_s_all"] = [r["items_per_s"] for r in ok]
                if name.startswith("cachefs"):
                    row["cachefs_worker_s_all"] = [r["cpu"]["cachefs_worker_s"] for r in ok]
            gb = sum(r["items"] for r in ok) * self.size / 1e9
            total = {k: round(sum(r["cpu"].get(k, 0.0) for r in ok), 3)
                     for k in ("loader_s", "cachefs_worker_s", "cachefs_worker_sys_s", "store_s", "page_write_s")}
            total["loader_s_per_gb"] = round(total["loader_s"] / gb, 2)
            total["page_write_s_per_gb"] = round(total["page_write_s"] / gb, 2)
            total["store_s_per_gb"] = round(total["store_s"] / gb, 2)
            row["cpu"] = total
            for part in ("worker", "client"):
                if any(part in r for r in ok):
                    keys = {k for r in ok for k in r.get(part, {})}
                    row[part] = {k: sum(r.get(part, {}).get(k, 0.0) for r in ok) for k in sorted(keys)}
            if any("client" in r for r in ok):  # per epoch: held vs by-name reads tell the TTL's effect
                row["client_all"] = [r.get("client", {}) for r in ok]
        print(json.dumps(row), flush=True)
        self.results.append(row)

    def run(self, address: str) -> None:
        loaders = self._loaders = self.loaders(address)
        for w in self.args.workers:
            # Cold epochs, loader by loader; then the warm epochs in rounds, each round every
            # loader once, its order rotated: a warm epoch lasts tens of ms here, and this
            # shared machine has slow phases lasting seconds, and a loader's leftovers (threads
            # still finishing, a worker writing behind) weigh on whatever runs next. Run loader
            # after loader, each met a different phase (two runs an hour apart put cachefs-map's
            # workers-2 warm epochs at 0.67x and 0.85x of local files); in rounds, all meet the same.
            warm_runs: dict[str, list[dict[str, Any]]] = {}
            for name, (_make, make_cold) in loaders.items():
                make_cold()
                recycle_memory(self.args.recycle_mb << 20)
                self._record(name, w, "cold", [self._one(name, w, probe=True)])
            os.sync()  # the cold epochs' files (caches, downloads) written back before warm ones
            names = list(loaders)
            rounds = self.args.warm_epochs
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    if name in PER_OBJECT_PEERS and r > 0:  # no cache: warm is cold, measured once
                        continue
                    warm_runs.setdefault(name, []).append(self._one(name, w))
            for name in names:
                self._record(name, w, "warm", warm_runs.get(name, []))
        for name in self.args.stall:  # a warm epoch with a step of 2x the sample's warm read time
            if name not in loaders:
                continue
            w = max(self.args.workers)
            warm = [r for r in self.results if r["loader"] == name and r["num_workers"] == w
                    and r["phase"] == "warm" and "error" not in r]
            if not warm:
                continue
            step = 2 * self.batch / warm[0]["items_per_s"]
            row = {"loader": name, "num_workers": w, "phase": "warm+step", "step_s": round(step, 5)}
            try:
                row.update(epoch(loaders[name][0](w), self.items(name), step=step))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(json.dumps(row), flush=True)
            self.results.append(row)


def ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    get = {(r["loader"], r["num_workers"], r["phase"]): r.get("items_per_s") for r in results if "error" not in r}
    out: dict[str, Any] = {}
    for w in sorted({r["num_workers"] for r in results}):
        def ratio(a: tuple[str, str], b: tuple[str, str]) -> float | None:
            x, y = get.get((a[0], w, a[1])), get.get((b[0], w, b[1]))
            return round(x / y, 3) if x and y else None
        out[f"workers={w}"] = {
            "cachefs-map warm / local warm (target >= 0.9)": ratio(("cachefs-map", "warm"), ("local", "warm")),
            "cachefs-tar warm / local warm (target >= 0.9)": ratio(("cachefs-tar", "warm"), ("local", "warm")),
            "cachefs-map warm / streaming warm (target >= 1.5)": ratio(("cachefs-map", "warm"), ("streaming", "warm")),
            "cachefs-tar warm / streaming warm (target >= 1.5)": ratio(("cachefs-tar", "warm"), ("streaming", "warm")),
            "cachefs-tar cold / streaming cold (target >= 1.0)": ratio(("cachefs-tar", "cold"), ("streaming", "cold")),
            "cachefs-map cold / s3torchconnector cold (target >= 1.0)": ratio(("cachefs-map", "cold"),
                                                                              ("s3torchconnector", "cold")),
            "cachefs-map warm / s3fs warm (target >= 20 with delay)": ratio(("cachefs-map", "warm"), ("s3fs", "warm")),
            "cachefs-tar warm / s3fs warm (target >= 20 with delay)": ratio(("cachefs-tar", "warm"), ("s3fs", "warm")),
        }
    out["stall_share (target < 0.05)"] = {f"{r['loader']} workers={r['num_workers']}": r.get("stall_share")
                                          for r in results if r["phase"] == "warm+step"}
    out["stall_share after the first batch (DataLoader start-up excluded)"] = {
        f"{r['loader']} workers={r['num_workers']}": r.get("stall_share_after_first_batch")
        for r in results if r["phase"] == "warm+step"}
    out["CPU s per GB of a cold epoch, loader's own / store's (moto)"] = {
        f"{r['loader']} workers={r['num_workers']}": f"{r['cpu']['loader_s_per_gb']} / {r['cpu']['store_s_per_gb']}"
        for r in results if r["phase"] == "cold" and "cpu" in r}
    out["cachefs worker's page-file writes, CPU s per cold GB (in the loader's own)"] = {
        f"{r['loader']} workers={r['num_workers']}": r["cpu"]["page_write_s_per_gb"]
        for r in results if r["phase"] == "cold" and r["loader"].startswith("cachefs") and "cpu" in r}
    out["outside writer during the cold epoch, ms of CPU per new 256 KiB file (median; 0.07-0.1 quiet here)"] = {
        f"{r['loader']} workers={r['num_workers']}": (r.get("write_probe") or [{}])[0].get("median_ms")
        for r in results if r["phase"] == "cold"}
    return out


def plot(results: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot"
    workers = sorted({r["num_workers"] for r in results})
    fig, axes = plt.subplots(1, len(workers), figsize=(7 * len(workers), 5), squeeze=False)
    for ax, w in zip(axes[0], workers):
        rows = [r for r in results if r["num_workers"] == w and r["phase"] in ("cold", "warm") and "error" not in r]
        names = sorted({r["loader"] for r in rows}, key=[r["loader"] for r in rows].index)
        x = np.arange(len(names))
        for k, phase in enumerate(("cold", "warm")):
            vals = [next((r["items_per_s"] for r in rows if r["loader"] == n and r["phase"] == phase), 0)
                    for n in names]
            bars = ax.bar(x + (k - 0.5) * 0.4, vals, 0.4, label=phase)
            for bar, v in zip(bars, vals):
                ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, names, rotation=25, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("items/s (log)")
        ax.set_title(f"DataLoader num_workers={w}, batch 32, 256 KiB samples")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _option(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="400 samples, 16 MiB shards")
    p.add_argument("--samples", type=int)
    p.add_argument("--size", type=int, default=256 << 10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--shard-bytes", type=int)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--loaders", default="local,s3fs,streaming,s3torchconnector,cachefs-map,cachefs-tar")
    p.add_argument("--stall", default="cachefs-map,cachefs-tar,local",
                   help="loaders to measure the data-stall share for")
    p.add_argument("--client-option", action="append", default=[], type=_option, metavar="NAME=VALUE",
                   help="a cachefs client option for both cachefs loaders (e.g. short_circuit_by_name=false)")
    p.add_argument("--warm-epochs", type=int, default=None,
                   help="warm epochs per loader and DataLoader setting, the median kept (default 5; 1 with --quick)")
    p.add_argument("--hint-samples", type=int, default=256, help="CacheDataset's hint_samples (0: no hints)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way delay to moto in each direction (RTT 2x; moto closes every connection, so"
                        " ~4x to a request's first byte): netns + veth + tc netem, else a delay proxy")
    p.add_argument("--store-mbps", type=float, default=0.0,
                   help="each store connection's bandwidth per direction, MB/s (S3 serves one stream at"
                        " ~50-100 MB/s; moto on loopback far faster): through the delay proxy (0: unbounded)")
    p.add_argument("--peer-samples", type=int,
                   help="samples s3fs and s3torchconnector read per epoch (default all; 64 with --quick and a delay)")
    p.add_argument("--recycle-mb", type=int, default=None,
                   help="memory touched and freed before every cold phase (default: twice the data set; 0: off); "
                        "see recycle_memory")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tmp-dir", default=None,
                   help="where the local copies, streaming's cache and the cachefs worker's page store live "
                        "(default: the system's temp dir); one file system for all, e.g. a journaled ext4 or XFS "
                        "mount as an NVMe cache would be")
    args = p.parse_args(argv)
    args.samples = args.samples or (400 if args.quick else 2000)
    args.shard_bytes = args.shard_bytes or ((16 if args.quick else 64) << 20)
    if args.recycle_mb is None:
        args.recycle_mb = 2 * args.samples * args.size >> 20
    if args.warm_epochs is None:
        args.warm_epochs = 1 if args.quick else 5
    if args.warm_epochs < 1:
        p.error("--warm-epochs must be at least 1")
    if args.peer_samples is None and args.quick and args.delay_ms > 0:
        args.peer_samples = 64
    args.workers = [int(w) for w in args.workers.split(",")]
    args.loaders = args.loaders.split(",")
    args.stall = [s for s in args.stall.split(",") if s]
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-dataset-", dir=args.tmp_dir)
    tmp_fs = _file_system(tmp)
    started = dt.datetime.now(dt.timezone.utc)
    try:
        with moto_endpoint(args.delay_ms, env={"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(512 << 20)},
                           conn_mbps=args.store_mbps) as moto:
            endpoint = moto
            print(f"object store: {moto.note}", flush=True)
            for k, v in {"S3_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "testing",
                         "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
                os.environ[k] = v  # streaming's and the connector's own S3 clients read these
            bench = Bench(args, tmp)
            bench.store_pid = moto.store_pid
            bench.setup(moto)
            with bench.worker() as address:
                bench.run(address)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"benchmark": "dataset", "started": started.isoformat(), "args": {k: v for k, v in vars(args).items()},
           "machine": machine_info(), "endpoint": endpoint.as_dict(), "tmp_file_system": tmp_fs,
           "results": bench.results,
           "ratios": ratios(bench.results)}
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(args.out, f"dataset-{stamp}.json")
    for target in (path, os.path.join(args.out, "latest-dataset.json")):
        with open(target, "w") as f:
            json.dump(doc, f, indent=1)
    note = plot(bench.results, path[:-5] + ".png")
    print(json.dumps(doc["ratios"], indent=1))
    print(f"object store: {endpoint.note}")
    print(f"wrote {path}" + (f" ({note})" if note else f" and {path[:-5]}.png"))
    return 0


def _file_system(path: str) -> str:
    """The file system the benchmark's files are on (type, options, source), for the record: on
    ext4 without a journal creating files after mass deletes costs ~1 ms each (docs/performance.md)."""
    try:
        out = subprocess.run(["findmnt", "-no", "FSTYPE,OPTIONS,SOURCE", "--target", path],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
