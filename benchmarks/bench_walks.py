"""Per-object walks on the client, bounded (#46): scan-ahead's listing and ``cachefs ls``.

    .venv/bin/python benchmarks/bench_walks.py                     # directories of 1,000,000 objects
    .venv/bin/python benchmarks/bench_walks.py --objects 200000 --only ls

Over cachefs.testing's synthetic store (objects that are only arithmetic, paged listings, its
requests counted), one directory of ``--objects`` objects:

* ``scan_ahead``: a worker in this process and a client with its defaults; two reads in name
  order start scan-ahead's listing; measured: the time until it was in or given up at the cap
  (``too_large``) and the store listing requests it cost; ``whole_list``: the same directory
  listed whole through the session (``ClientSession.list``, what scan-ahead did before #46);
* ``ls``: a master and a worker as processes, ``cachefs ls DIR`` as a child: seconds to its
  first line and to its last, its peak RSS, and the first batch of the non-paged List (what
  ``cachefs ls`` asked before #46: the whole listing before a first message).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def scan_ahead(objects: int, tmp: str) -> dict:
    import cachefs.testing  # noqa: F401 - registers synthetic://
    from cachefs.client.fs.filesystem import CacheFileSystem
    from cachefs.config import CacheDirSpec, MountSpec, WorkerConfig
    from cachefs.paths import CachePath
    from cachefs.server.worker.daemon import Worker

    mount = MountSpec("data", "synthetic://data", {"count": objects, "per_dir": objects, "size": 16})
    worker = Worker(WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(tmp, 1 << 30),),
                                 mounts=(mount,))).start()
    try:
        store = worker.objects.mounts.resolve(CachePath("data", "")).fs
        fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, scan_ahead=True)
        start = time.perf_counter()
        for i in range(2):
            fs.cat_file(f"cachefs://data/d00000/{i:08d}.bin")
        while fs._scan.stats["too_large"] + fs._scan.stats["listed"] == 0:
            time.sleep(0.005)
        out = {"settled_s": round(time.perf_counter() - start, 3), "list_requests": store.requests["list_after"],
               "stats": dict(fs._scan.stats)}
        before = store.requests["list_after"]
        start = time.perf_counter()
        n = len(fs.session.list(CachePath("data", "d00000"), recursive=False, refresh=True))
        out["whole_list"] = {"entries": n, "seconds": round(time.perf_counter() - start, 3),
                             "list_requests": store.requests["list_after"] - before}
        fs.close()
        return out
    finally:
        worker.stop(grace=1.0)


# `cachefs ...` that writes its peak RSS to stderr at exit: VmHWM is the exec'd process's own
# (ru_maxrss would count the forking parent's pages too).
_LS = ("import atexit, runpy, sys\n"
       "atexit.register(lambda: sys.stderr.write([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]))\n"
       "sys.argv[0] = 'cachefs'\n"
       "runpy.run_module('cachefs.cli', run_name='__main__')\n")


def ls(objects: int, tmp: str) -> dict:
    import grpc

    from cachefs.local import LocalCluster
    from cachefs.proto import master_pb2_grpc, worker_pb2

    site = Path(tmp) / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import cachefs.testing\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    mounts = {"data": {"url": "synthetic://data", "options": {"count": objects, "per_dir": objects, "size": 64}}}
    with LocalCluster(str(Path(tmp) / "c"), workers=1, mounts=mounts, env=env) as cluster:
        out = {}
        for run in ("cold", "warm"):  # warm: the master's listing cache holds the chunks
            start = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-c", _LS, "ls", "--master", cluster.master_address,
                                     "--timeout", "120", "data/d00000"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, text=True)
            proc.stdout.readline()
            first = time.perf_counter() - start
            lines = 1 + sum(1 for _ in proc.stdout)
            err = proc.stderr.read()
            out[run] = {"first_line_s": round(first, 3), "last_line_s": round(time.perf_counter() - start, 3),
                        "lines": lines, "exit": proc.wait(),
                        "ls_peak_rss_mib": round(int(err.split("VmHWM:")[-1].split()[0]) / 1024, 1)}
        with grpc.insecure_channel(cluster.master_address) as channel:  # before #46: one whole List
            stub = master_pb2_grpc.MasterServiceStub(channel)
            start = time.perf_counter()
            stream = stub.List(worker_pb2.ListRequest(path="data/d00000", refresh=True), timeout=300)
            next(stream)
            first = time.perf_counter() - start
            n = sum(1 for _ in stream)
            out["whole_list_rpc"] = {"first_message_s": round(first, 3),
                                     "all_s": round(time.perf_counter() - start, 3), "messages": n + 1}
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--only", choices=("scan_ahead", "ls"), help="one of the two")
    args = parser.parse_args()
    result: dict = {"objects": args.objects}
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(f"{tmp}/cache")
        if args.only != "ls":
            result["scan_ahead"] = scan_ahead(args.objects, f"{tmp}/cache")
        if args.only != "scan_ahead":
            result["ls"] = ls(args.objects, tmp)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
