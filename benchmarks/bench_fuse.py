"""`cachefs fuse` against local files, fsspec simplecache and s3fs: one run, same bytes, ratios.

    .venv/bin/python benchmarks/bench_fuse.py [--small N] [--out benchmarks/baselines/fuse-DATE.json]

One moto S3 bucket (benchmarks/read_common.py) holds one 64 MiB object and N 256 KiB objects,
also written as local files. A `cachefs worker` process caches them and a `cachefs fuse` process
mounts it (both real processes, as deployed on one host: the mount reads by short-circuit).
Every case reads through the same loop: `readinto` 1 MiB at a time into one aligned buffer
(`open(path, "rb", buffering=0)`), or one `readinto` of the whole 256 KiB file; every read is
compared with the source bytes afterwards. Cases (wall time of one pass; for the warm ones the
median of --repeat passes, the cases interleaved round by round so that the machine's other load
falls on all of them alike):

- 64 MiB cold: the mount with an empty worker cache vs s3fs `cat_file` (a fresh filesystem).
- 64 MiB warm, kernel page cache warm: the mount's second read vs the local file (page cache warm).
- 64 MiB cachefs warm, kernel cache dropped: the mount after `posix_fadvise(DONTNEED)` of that
  file (the kernel's copy only; the worker's pages stay cached) vs fsspec simplecache's second
  read (its local copy in the page cache). Not `drop_caches`: that would drop the worker's pages
  and every other process's too.
- 256 KiB files, open+read+close: cold (mount, empty cache) vs s3fs; warm (second pass) vs local
  files; and through the mount with the kernel's copies dropped (each read reaches cachefs).
- The warm cases again through a second mount with ``--no-revalidate-open`` (the kernel opens
  files without asking it), and the 64 MiB file on tmpfs (4 KiB pages, as FUSE's page cache).
  "Warm" is the same process re-reading a file it read before; the kernel's page cache is the
  inode's, so a first open in another process (a DataLoader worker) should read at the same
  speed: the 256 KiB files are also read by a fresh Python process per pass (3 interleaved
  rounds, its start-up not counted, its bytes checked by hash) through each mount and locally. The
  FUSE processes' CPU time per pass of each case is recorded: ~0 where the page cache served
  (``keep_cache`` in effect), the requests' cost otherwise.
- 64 MiB written (1 MiB writes, median of 3 interleaved rounds, checked in the bucket after): through a third,
  ``--writable`` mount vs ``cachefs://``'s ``open("wb")`` vs s3fs's ``open("wb")``.
- DataLoader epochs (benchmarks/fuse_epochs.py, ``--epoch-samples`` per loader): a map-style
  Dataset over the mounts' paths vs the same over local files vs ``CacheDataset``, workers 0 and
  2, cold and warm.

Needs /dev/fuse, libfuse 3 and root (as the tests do). Prints the ratios and writes JSON and PNGs
(``<out>.png``: the ratios; ``<out>-dataloader.png``: the epochs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from read_common import aligned_empty, machine_info, make_dataset, store_endpoint  # noqa: E402

MOUNT = "bench"
CHUNK = 1 << 20


def read_file(path: str, buf: np.ndarray) -> int:
    """The one read loop of every case: readinto 1 MiB at a time into ``buf``; bytes read."""
    view = memoryview(buf)
    pos = 0
    with open(path, "rb", buffering=0) as f:
        while pos < len(view):
            n = f.readinto(view[pos:pos + CHUNK])
            if not n:
                break
            pos += n
    return pos


def process_cpu(pid: int) -> float:
    """CPU seconds a live process's threads have run (schedstat, ns): what a case cost a FUSE process."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except OSError:
        return 0.0
    return total / 1e9


def free(address: str, prefix: str) -> None:
    """Empty the worker's cache below ``prefix`` (a cold epoch starts from nothing cached)."""
    import grpc

    from cachefs.proto import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix=f"{MOUNT}/{prefix}/"), timeout=60)


_NEW_PROCESS = """
import hashlib, json, os, sys, time
paths, size = json.loads(sys.argv[1]), int(sys.argv[2])
bufs = [bytearray(size) for _ in paths]
start = time.perf_counter()
for path, buf in zip(paths, bufs):
    with open(path, "rb", buffering=0) as f:
        f.readinto(buf)
took = time.perf_counter() - start
print(json.dumps({"seconds": took, "sha256": hashlib.sha256(b"".join(bufs)).hexdigest()}))
"""


def new_process_pass(paths: list[str], size: int, expected: str) -> float:
    """Seconds a fresh Python process takes to open+read+close ``paths`` (its start not counted)."""
    out = subprocess.run([sys.executable, "-c", _NEW_PROCESS, json.dumps(paths), str(size)], capture_output=True,
                         text=True, timeout=300, check=True)
    got = json.loads(out.stdout)
    if got["sha256"] != expected:
        raise AssertionError("a fresh process read wrong bytes")
    return float(got["seconds"])


def write_cases(mount_root: str, address: str, so: dict[str, Any], bucket: str, data: bytes) -> dict[str, float]:
    """64 MiB written (published, then checked in the bucket) through the writable mount (1 MiB
    writes), through ``cachefs://``'s ``open("wb")`` and through s3fs: median seconds of 3 rounds."""
    import fsspec

    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **so)
    fs = fsspec.filesystem("cachefs", workers=address, skip_instance_cache=True)
    view = memoryview(data)

    def through(open_file: Any) -> None:
        with open_file as f:
            for start in range(0, len(view), CHUNK):
                f.write(view[start:start + CHUNK])

    cases = {
        "large_write_fuse_s": lambda: through(open(os.path.join(mount_root, "written", "fuse.bin"), "wb")),
        "large_write_cachefs_open_s": lambda: through(fs.open(f"cachefs://{MOUNT}/written/cachefs.bin", "wb")),
        "large_write_s3fs_s": lambda: through(s3.open(f"{bucket}/written/s3fs.bin", "wb")),
    }
    os.makedirs(os.path.join(mount_root, "written"), exist_ok=True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(3):  # interleaved rounds, the median kept
        for name, write in cases.items():
            times[name].append(timed(write))
    out = {name: statistics.median(values) for name, values in times.items()}
    for key in ("fuse.bin", "cachefs.bin", "s3fs.bin"):
        if s3.cat_file(f"{bucket}/written/{key}") != data:
            raise AssertionError(f"written/{key}: wrong bytes in the bucket")
    return out


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_kernel_copy(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def cachefs_worker(tmp: str, storage_options: dict[str, Any], bucket: str) -> Iterator[Any]:
    """A `cachefs worker` process over the bucket; yields it (``.address``)."""
    from cachefs.local import toml_value, worker_process

    config = os.path.join(tmp, "worker.toml")
    with open(config, "w") as f:
        f.write(f"[worker]\n\n[mounts.{MOUNT}]\nurl = {toml_value('s3://' + bucket)}\n"
                f"options = {toml_value(storage_options)}\n")
    worker = worker_process({}, os.path.join(tmp, "cache"), quota="4GiB", env=_env(),
                            log_path=os.path.join(tmp, "worker.log"), extra=["--config", config])
    try:
        worker.start(timeout=60)
        yield worker
    finally:
        worker.stop()
        worker.kill()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}


@contextlib.contextmanager
def cachefs_mount(tmp: str, address: str, name: str, *args: str) -> Iterator[tuple[str, int]]:
    """A `cachefs fuse` process over the worker; yields (the mount's folder, the process id)."""
    mountpoint = os.path.join(tmp, name)
    os.mkdir(mountpoint)
    fuse = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "fuse", mountpoint, "--workers", address, *args],
                            stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, f"{name}.log"), "w"), text=True,
                            env=_env())
    try:
        mounted = threading.Event()
        threading.Thread(target=lambda: [mounted.set() for line in fuse.stdout if '"mounted"' in line],
                         daemon=True).start()
        if not mounted.wait(60):
            raise RuntimeError(f"cachefs fuse did not mount: see {tmp}/{name}.log")
        yield os.path.join(mountpoint, MOUNT), fuse.pid
    finally:
        fuse.terminate()
        try:
            fuse.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fuse.kill()
            fuse.wait(timeout=10)
            subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=30)


def plot(ratios: dict[str, float], path: str) -> None:
    """One bar per ratio (the mount against its peer; > 1: the mount is faster), targets marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name.split(" (")[0] for name in ratios]
    targets = [float(name.split(">= ")[1].rstrip(")")) if ">= " in name else None for name in ratios]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.barh(names, list(ratios.values()), color="#4878a8")
    for i, target in enumerate(targets):
        if target is not None:
            ax.plot([target, target], [i - 0.4, i + 0.4], color="#c03030", linewidth=2)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("throughput ratio, cachefs fuse / peer (red: the issue's target)")
    ax.set_title("cachefs fuse, one run (benchmarks/bench_fuse.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--small", type=int, default=200, help="number of 256 KiB objects")
    parser.add_argument("--repeat", type=int, default=7, help="passes of each warm case, interleaved (median)")
    parser.add_argument("--epoch-samples", type=int, default=500,
                        help="256 KiB samples of the DataLoader epochs, per loader (0: no epochs)")
    parser.add_argument("--out", help="JSON result (default benchmarks/baselines/fuse-<date>.json)")
    args = parser.parse_args(argv)

    from cachefs.client.fuse.fusemount import fuse_available

    reason = fuse_available()
    if reason:
        print(f"bench_fuse: cannot mount here: {reason}", file=sys.stderr)
        return 2
    import fsspec

    big, small = 64 << 20, 256 << 10
    results: dict[str, float] = {}
    tmp = tempfile.mkdtemp(prefix="cachefs-bench-fuse-")
    epochs: list[dict[str, Any]] = []
    shm = ""
    try:
        with store_endpoint(0.0) as store:
            ds = make_dataset(store, os.path.join(tmp, "local"), args.small, small, 1, big, seed=7)
            so = store.storage_options()
            large_key, small_keys = ds.large_keys[0], ds.small_keys
            buf = aligned_empty(big)
            slots = [aligned_empty(small) for _ in small_keys]

            def seq(root: str) -> int:
                return read_file(os.path.join(root, large_key), buf)

            def files(root: str) -> list[int]:
                return [read_file(os.path.join(root, key), out) for key, out in zip(small_keys, slots)]

            def verify(fn: Callable[[], Any]) -> None:  # after each timed pass: every byte it read is right
                if fn is simplecache_pass:
                    if got_bytes.pop("large", b"") != ds.data[large_key]:
                        raise AssertionError(f"wrong bytes for {large_key} (simplecache)")
                    return
                pairs = [(large_key, buf)] if fn is seq_pass else list(zip(small_keys, slots))
                for key, out in pairs:
                    if out.tobytes() != ds.data[key]:
                        raise AssertionError(f"wrong bytes for {key}")

            def clear() -> None:
                buf[:] = 0
                for out in slots:
                    out[:] = 0

            fuse_pids: list[int] = []
            fuse_cpu: dict[str, float] = {}

            def measure(cases: dict[str, tuple[Callable[[str], Any], str, Callable[[], None] | None]]) -> None:
                """Each case ``name: (fn, root, before)`` run --repeat times, the cases interleaved
                (round after round: the machine's other load falls on all of them alike); the
                median pass of each into results; every pass checked after it."""
                times: dict[str, list[float]] = {name: [] for name in cases}
                cpu = dict.fromkeys(cases, 0.0)
                for _ in range(args.repeat):
                    for name, (fn, root, before) in cases.items():
                        clear()
                        if before is not None:
                            before()
                        cpu0 = sum(process_cpu(p) for p in fuse_pids)
                        times[name].append(timed(lambda: fn(root)))
                        cpu[name] += sum(process_cpu(p) for p in fuse_pids) - cpu0
                        verify(fn)
                for name, values in times.items():
                    results[name] = statistics.median(values)
                    fuse_cpu[name] = cpu[name] / args.repeat

            def s3fs_pass(keys: list[str]) -> float:
                fs = fsspec.filesystem("s3", skip_instance_cache=True, **so)
                got = {}
                took = timed(lambda: got.update((k, fs.cat_file(f"{ds.bucket}/{k}")) for k in keys))
                if any(got[k] != ds.data[k] for k in keys):
                    raise AssertionError("wrong bytes from s3fs")
                return took

            results["large_cold_s3fs_s"] = s3fs_pass([large_key])
            results["small_cold_s3fs_s"] = s3fs_pass(small_keys)
            seq_pass = seq
            local = ds.root
            seq(local), files(local)  # the local copies' page cache warm
            # The same 64 MiB on tmpfs: a page cache of 4 KiB pages, as FUSE's (ext4 has large
            # folios): what the kernel's own copy path allows a warm read through the mount.
            shm = tempfile.mkdtemp(prefix="cachefs-bench-fuse-", dir="/dev/shm")
            shm_root = os.path.join(shm, "root")
            os.makedirs(os.path.dirname(os.path.join(shm_root, large_key)))
            shutil.copyfile(os.path.join(local, large_key), os.path.join(shm_root, large_key))
            cache_dir = os.path.join(tmp, "simplecache")
            sc = fsspec.filesystem("simplecache", target_protocol="s3", target_options=so,
                                   cache_storage=cache_dir, skip_instance_cache=True)
            sc.cat_file(f"{ds.bucket}/{large_key}")

            got_bytes: dict[str, bytes] = {}

            def simplecache(root: str) -> int:  # its natural API: bytes, checked after the pass
                got_bytes["large"] = sc.cat_file(f"{ds.bucket}/{large_key}")
                return len(got_bytes["large"])

            simplecache_pass = simplecache
            with cachefs_worker(tmp, so, ds.bucket) as worker, \
                    cachefs_mount(tmp, worker.address, "mnt") as (root, pid), \
                    cachefs_mount(tmp, worker.address, "mnt-kopen", "--no-revalidate-open") as (kroot, kpid):
                fuse_pids[:] = [pid, kpid]
                clear()
                results["large_cold_fuse_s"] = timed(lambda: seq(root))
                results["small_cold_fuse_s"] = timed(lambda: files(root))
                verify(seq)
                verify(files)
                seq(root), files(root), seq(kroot), files(kroot)  # warm: the worker's cache and the kernel's
                measure({
                    "large_warm_local_s": (seq, local, None),
                    "large_warm_fuse_s": (seq, root, None),
                    "large_warm_fuse_kernel_opens_s": (seq, kroot, None),
                    "large_warm_tmpfs_s": (seq, shm_root, None),
                    "small_warm_local_s": (files, local, None),
                    "small_warm_fuse_s": (files, root, None),
                    "small_warm_fuse_kernel_opens_s": (files, kroot, None),
                    "large_simplecache_second_s": (simplecache, "", None),
                    "large_fuse_kernel_dropped_s": (
                        seq, root, lambda: drop_kernel_copy(os.path.join(root, large_key))),
                    "small_fuse_kernel_dropped_s": (
                        files, root, lambda: [drop_kernel_copy(os.path.join(root, k)) for k in small_keys]),
                    "small_fuse_kernel_opens_kernel_dropped_s": (
                        files, kroot, lambda: [drop_kernel_copy(os.path.join(kroot, k)) for k in small_keys]),
                })
                # A first open in another process (as a DataLoader worker's): the page cache is the
                # inode's, so it should read as fast as the re-reads above.
                expected = hashlib.sha256(b"".join(ds.data[k] for k in small_keys)).hexdigest()
                fresh = {"small_warm_local_new_process_s": local, "small_warm_fuse_new_process_s": root,
                         "small_warm_fuse_kernel_opens_new_process_s": kroot}
                spent: dict[str, list[float]] = {name: [] for name in fresh}
                for _ in range(3):
                    for name, where in fresh.items():
                        spent[name].append(new_process_pass([os.path.join(where, k) for k in small_keys],
                                                            small, expected))
                results.update({name: statistics.median(values) for name, values in spent.items()})
                with cachefs_mount(tmp, worker.address, "mnt-w", "--writable") as (wroot, _wpid):
                    results.update(write_cases(wroot, worker.address, so, ds.bucket, ds.data[large_key]))
                if args.epoch_samples:
                    import fuse_epochs

                    mounts = {"fuse mount": root, "fuse mount, revalidate_open off": kroot}
                    keys = fuse_epochs.put_samples(store.client(), ds.bucket, local, args.epoch_samples, small,
                                                   [c for c in fuse_epochs.copies_for(mounts).values() if c != "local"])
                    epochs = fuse_epochs.run_epochs(keys, small, local, mounts, worker.address, MOUNT,
                                                    lambda prefix: free(worker.address, prefix))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)

    mib = big / (1 << 20)
    n = len(small_keys)
    figures = {
        "large_cold_fuse_MBps": big / results["large_cold_fuse_s"] / 1e6,
        "large_cold_s3fs_MBps": big / results["large_cold_s3fs_s"] / 1e6,
        "large_warm_fuse_MBps": big / results["large_warm_fuse_s"] / 1e6,
        "large_warm_local_MBps": big / results["large_warm_local_s"] / 1e6,
        "large_fuse_kernel_dropped_MBps": big / results["large_fuse_kernel_dropped_s"] / 1e6,
        "large_simplecache_second_MBps": big / results["large_simplecache_second_s"] / 1e6,
        "small_cold_fuse_files_per_s": n / results["small_cold_fuse_s"],
        "small_cold_s3fs_files_per_s": n / results["small_cold_s3fs_s"],
        "small_warm_fuse_files_per_s": n / results["small_warm_fuse_s"],
        "small_warm_local_files_per_s": n / results["small_warm_local_s"],
        "small_fuse_kernel_dropped_files_per_s": n / results["small_fuse_kernel_dropped_s"],
        "large_warm_fuse_kernel_opens_MBps": big / results["large_warm_fuse_kernel_opens_s"] / 1e6,
        "large_warm_tmpfs_MBps": big / results["large_warm_tmpfs_s"] / 1e6,
        "small_warm_local_new_process_files_per_s": n / results["small_warm_local_new_process_s"],
        "small_warm_fuse_new_process_files_per_s": n / results["small_warm_fuse_new_process_s"],
        "small_warm_fuse_kernel_opens_new_process_files_per_s": n / results["small_warm_fuse_kernel_opens_new_process_s"],
        "large_write_fuse_MBps": big / results["large_write_fuse_s"] / 1e6,
        "large_write_cachefs_open_MBps": big / results["large_write_cachefs_open_s"] / 1e6,
        "large_write_s3fs_MBps": big / results["large_write_s3fs_s"] / 1e6,
        "small_warm_fuse_kernel_opens_files_per_s": n / results["small_warm_fuse_kernel_opens_s"],
        "small_fuse_kernel_opens_kernel_dropped_files_per_s": n / results["small_fuse_kernel_opens_kernel_dropped_s"],
    }
    ratios = {  # >1 is better for the mount in every line; the target beside each
        "large_warm_fuse_vs_local (target >= 0.8)": results["large_warm_local_s"] / results["large_warm_fuse_s"],
        "large_kernel_dropped_fuse_vs_simplecache_second (target >= 0.5)":
            results["large_simplecache_second_s"] / results["large_fuse_kernel_dropped_s"],
        "large_cold_fuse_vs_s3fs (target: wall <= 1.2x, i.e. ratio >= 0.83)":
            results["large_cold_s3fs_s"] / results["large_cold_fuse_s"],
        "small_warm_fuse_vs_local (target >= 0.5)": results["small_warm_local_s"] / results["small_warm_fuse_s"],
        "small_cold_fuse_vs_s3fs": results["small_cold_s3fs_s"] / results["small_cold_fuse_s"],
        "large_warm_fuse_vs_tmpfs (the kernel's 4 KiB-page copy)":
            results["large_warm_tmpfs_s"] / results["large_warm_fuse_s"],
        "small_warm_new_process_fuse_vs_local": results["small_warm_local_new_process_s"] /
            results["small_warm_fuse_new_process_s"],
        "small_warm_new_process_fuse_kernel_opens_vs_local": results["small_warm_local_new_process_s"] /
            results["small_warm_fuse_kernel_opens_new_process_s"],
        "large_write_fuse_vs_cachefs_open_wb": results["large_write_cachefs_open_s"] / results["large_write_fuse_s"],
        "large_write_fuse_vs_s3fs": results["large_write_s3fs_s"] / results["large_write_fuse_s"],
        "large_warm_fuse_kernel_opens_vs_local (target >= 0.8)":
            results["large_warm_local_s"] / results["large_warm_fuse_kernel_opens_s"],
        "small_warm_fuse_kernel_opens_vs_local (target >= 0.5)":
            results["small_warm_local_s"] / results["small_warm_fuse_kernel_opens_s"],
    }
    out = {"benchmark": "bench_fuse", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "parameters": {"large_bytes": big, "small_bytes": small, "small_files": n, "repeat": args.repeat,
                          "read_chunk": CHUNK},
           "store": store.note, "seconds": results, "figures": figures, "ratios": ratios,
           # CPU seconds the two FUSE processes used per pass of each warm case: ~0 where the kernel's
           # page cache served the reads (keep_cache in effect), the requests' cost otherwise.
           "fuse_cpu_s_per_pass": {k: round(v, 4) for k, v in fuse_cpu.items()},
           "machine": machine_info()}
    if epochs:
        import fuse_epochs

        out["dataloader"] = {"samples": args.epoch_samples, "sample_bytes": small, "batch": fuse_epochs.BATCH,
                             "epochs": epochs, "ratios": fuse_epochs.ratios(epochs)}
    path = args.out or os.path.join(HERE, "baselines", f"fuse-{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    plot(ratios, os.path.splitext(path)[0] + ".png")
    if epochs:
        fuse_epochs.plot(epochs, os.path.splitext(path)[0] + "-dataloader.png")
    print(f"{mib:.0f} MiB and {n} x 256 KiB files through `cachefs fuse` (short-circuit, same host):")
    for name, value in figures.items():
        print(f"  {name:36} {value:10.1f}")
    for name, value in ratios.items():
        print(f"  {name:70} {value:6.2f}x")
    for name, value in fuse_cpu.items():
        print(f"  FUSE processes' CPU per pass, {name:45} {value * 1e3:8.1f} ms")
    for name, value in (out.get("dataloader", {}).get("ratios") or {}).items():
        print(f"  {name:70} {value:6.2f}x")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
