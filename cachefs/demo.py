"""The main job for now: a local worker over a generated dataset, read twice (cold, then warm)."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from cachefs.config import parse_size
from cachefs.local import worker_process


def _generate(root: str, objects: int, size: int) -> int:
    os.makedirs(root, exist_ok=True)
    total = 0
    for i in range(objects):
        path = os.path.join(root, f"sample-{i:06d}.bin")
        if not os.path.exists(path) or os.path.getsize(path) != size:
            with open(path, "wb") as f:
                f.write(os.urandom(size))
        total += size
    return total


def run_demo(objects: int = 400, object_size: str | int = "256KiB", workdir: str | None = None,
             threads: int = 8) -> int:
    import fsspec

    from cachefs.proto import worker_pb2, worker_pb2_grpc
    import grpc

    size = parse_size(object_size)
    workdir = workdir or tempfile.mkdtemp(prefix="cachefs-demo-")
    data_dir = os.path.join(workdir, "dataset")
    total = _generate(data_dir, objects, size)
    print(f"dataset: {objects} objects x {size} bytes in {data_dir}")
    with worker_process({"sample": data_dir}, os.path.join(workdir, "cache"), quota="4GiB",
                        log_path=os.path.join(workdir, "worker.log")) as worker:
        print(f"worker {worker.ready['worker_id']} on {worker.address}, metrics on :{worker.ready['metrics_port']}")
        fs = fsspec.filesystem("cachefs", workers=worker.address, skip_instance_cache=True)
        paths = fs.find("cachefs://sample/")
        expected = {p: open(os.path.join(data_dir, p.rsplit("/", 1)[1]), "rb").read() for p in paths}
        for label in ("cold", "warm"):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                results = list(pool.map(fs.cat_file, paths))
            elapsed = time.perf_counter() - t0
            bad = sum(1 for p, data in zip(paths, results) if data != expected[p])
            print(f"{label} read: {len(paths)} objects, {total / elapsed / 1e6:8.1f} MB/s, "
                  f"{len(paths) / elapsed:8.1f} objects/s, wrong bytes in {bad} objects")
            if bad:
                return 1
        with grpc.insecure_channel(worker.address) as channel:
            status = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        lookups = status.hits + status.misses
        print(f"page hit ratio: {status.hits / lookups if lookups else 0:.3f} ({status.hits} hits, {status.misses} misses); "
              f"cache holds {status.pages} pages, {status.used_bytes / 1e6:.1f} MB of {status.capacity_bytes / 1e9:.1f} GB")
        fs.close()
    return 0
