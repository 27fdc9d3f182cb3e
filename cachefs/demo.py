"""The main job: a local cluster (master + workers) over a generated dataset, read twice."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from cachefs.config import parse_size
from cachefs.local import LocalCluster
from cachefs.tls import open_channel


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
             threads: int = 8, workers: int = 2) -> int:
    import fsspec

    from cachefs.proto import worker_pb2, worker_pb2_grpc

    size = parse_size(object_size)
    workdir = workdir or tempfile.mkdtemp(prefix="cachefs-demo-")
    data_dir = os.path.join(workdir, "dataset")
    total = _generate(data_dir, objects, size)
    print(f"dataset: {objects} objects x {size} bytes in {data_dir}")
    with LocalCluster(os.path.join(workdir, "cluster"), workers=workers, mounts={"sample": data_dir},
                      quota="4GiB") as cluster:
        if not cluster.wait_for_workers():
            print("workers did not join the master in time")
            return 1
        print(f"cluster: master {cluster.master_address}, workers "
              + ", ".join(w.address for w in cluster.workers))
        fs = fsspec.filesystem("cachefs", master=cluster.master_address, skip_instance_cache=True)
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
        hits = misses = pages = used = 0
        for worker in cluster.workers:
            with open_channel(worker.address) as channel:
                status = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(),
                                                                              timeout=10)
            hits, misses, pages, used = hits + status.hits, misses + status.misses, pages + status.pages, \
                used + status.used_bytes
            print(f"  worker {status.worker_id}: {status.pages} pages, {status.hits} hits, {status.misses} misses")
        lookups = hits + misses
        print(f"page hit ratio: {hits / lookups if lookups else 0:.3f} ({hits} hits, {misses} misses); "
              f"the cluster caches {pages} pages, {used / 1e6:.1f} MB")
        fs.close()
    return 0
