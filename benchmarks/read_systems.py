"""The cases of bench_read.py: each a way to read the data set, with a fresh cache per workload.

    s3fs            s3fs.S3FileSystem.cat_file, no cache (one pass: direct)
    simplecache     fsspec simplecache::s3, fresh cache dir (first, second)
    blockcache      fsspec blockcache::s3, fresh cache dir (first, second)
    cachefs_local   a `cachefs worker` process, fresh cache, client short_circuit=True (cold, warm),
                    read_into the aligned slot (as the limits read)
    cachefs_remote  the same, client short_circuit=False: bytes come over the network path
    cachefs_cat     the same host through the plain fsspec API: cat_file -> bytes for every size
    cachefs_open    the same host through open(path).read() (what pandas, torch.load call)
    local           the local copy (page cache warm), readv into the aligned slot: the limit
    grpc_raw        a bare gRPC stream of the same bytes from another process (read_limits.py)
    tcp_raw         a bare loopback TCP stream (sendfile -> recv_into) from another process
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from cachefs.local import toml_value
from read_common import Dataset, ReadFn
from read_limits import GrpcRawClient, TcpRawClient, limit_server

MOUNT = "bench"
SYSTEMS = ("s3fs", "simplecache", "blockcache", "cachefs_local", "cachefs_remote", "cachefs_cat", "cachefs_open",
           "local", "grpc_raw", "tcp_raw")
LIMITS = ("local", "grpc_raw", "tcp_raw")


class System:
    """A way to read the data set; ``fresh()`` yields a reader with an empty cache."""

    name = ""
    passes: tuple[str, ...] = ("first", "second")

    def api(self, kind: str) -> str:
        """Which call reads an object of ``kind`` (small | large): recorded with every case."""
        raise NotImplementedError

    @contextlib.contextmanager
    def fresh(self, workload: str, kind: str) -> Iterator[ReadFn]:
        raise NotImplementedError
        yield

    def pass_extra(self) -> dict[str, Any]:
        """Counters for the pass just run (recorded in its case)."""
        return {}

    def after_passes(self, workload: str) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class S3fsDirect(System):
    name = "s3fs"
    passes = ("direct",)

    def __init__(self, ds: Dataset, storage_options: dict[str, Any]) -> None:
        self.ds, self.so = ds, storage_options

    def api(self, kind: str) -> str:
        return "s3fs.S3FileSystem.cat_file -> bytes"

    @contextlib.contextmanager
    def fresh(self, workload: str, kind: str) -> Iterator[ReadFn]:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.so)
        yield lambda key, out: fs.cat_file(f"{self.ds.bucket}/{key}")


class FsspecCache(System):
    passes = ("first", "second")

    def __init__(self, kind: str, ds: Dataset, storage_options: dict[str, Any], tmp: str) -> None:
        self.name, self.kind, self.ds, self.so, self.tmp = kind, kind, ds, storage_options, tmp
        self._count = 0

    def api(self, kind: str) -> str:
        return f"fsspec {self.kind}::s3 cat_file -> bytes"

    @contextlib.contextmanager
    def fresh(self, workload: str, kind: str) -> Iterator[ReadFn]:
        import fsspec

        self._count += 1
        cache_dir = os.path.join(self.tmp, f"{self.kind}-{workload}-{self._count}")
        os.makedirs(cache_dir)
        fs = fsspec.filesystem(self.kind, target_protocol="s3",
                               target_options={**self.so, "skip_instance_cache": True},
                               cache_storage=cache_dir, skip_instance_cache=True)
        try:
            yield lambda key, out: fs.cat_file(f"{self.ds.bucket}/{key}")
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)


class Cachefs(System):
    """A `cachefs worker` process with an empty cache per workload; same host or network path."""

    passes = ("cold", "warm")

    def __init__(self, ds: Dataset, storage_options: dict[str, Any], tmp: str, quota: str, worker_args: list[str],
                 keep_logs: str | None, log_level: str = "INFO", short_circuit: bool = True,
                 plain: str = "") -> None:
        if plain not in ("", "cat", "open"):
            raise ValueError(f"plain must be '', 'cat' or 'open', not {plain!r}")
        self.name = f"cachefs_{plain}" if plain else "cachefs_local" if short_circuit else "cachefs_remote"
        self.short_circuit, self.plain = short_circuit, plain
        self.ds, self.so, self.tmp, self.quota = ds, storage_options, tmp, quota
        self.log_level, self.worker_args, self.keep_logs = log_level, worker_args, keep_logs
        self._count = 0
        self._status: dict[str, Any] = {}
        self._fs: Any = None
        self._last_stats: dict[str, Any] = {}
        self.config_path = os.path.join(tmp, "worker.toml")
        # The mount goes in a config file: its options (endpoint, credentials) cannot be flags.
        with open(self.config_path, "w") as f:
            f.write("[worker]\n\n")
            f.write(f"[mounts.{MOUNT}]\nurl = {toml_value('s3://' + ds.bucket)}\n"
                    f"options = {toml_value(storage_options)}\n")
        self.log_path = ""

    def api(self, kind: str) -> str:
        how = "short_circuit=True" if self.short_circuit else "short_circuit=False"
        if self.plain == "open":
            return f"CacheFileSystem.open(path).read() -> bytes ({how})"
        if self.plain == "cat":
            return f"CacheFileSystem.cat_file -> bytes ({how})"
        return f"CacheFileSystem.read_into(path, slot, 0) ({how})"

    def _bulk_stats(self) -> dict[str, Any] | None:
        """The client's lean-path counters (short-circuit / data port), where it has them."""
        session = getattr(self._fs, "session", None)
        stats = getattr(session, "bulk_stats", None)
        return copy.deepcopy(stats) if isinstance(stats, dict) else None

    def pass_extra(self) -> dict[str, Any]:
        now = self._bulk_stats()
        if now is None:
            return {}
        before, self._last_stats = self._last_stats, now
        delta: dict[str, Any] = {}
        for path, counters in now.items():
            if isinstance(counters, dict):
                old = before.get(path, {}) if isinstance(before.get(path), dict) else {}
                delta[path] = {k: v - old.get(k, 0) if isinstance(v, (int, float)) else v for k, v in counters.items()}
            else:
                delta[path] = counters
        return {"client_paths": delta}

    @contextlib.contextmanager
    def fresh(self, workload: str, kind: str) -> Iterator[ReadFn]:
        import fsspec

        from cachefs.local import worker_process

        self._count += 1
        cache_dir = os.path.join(self.tmp, f"{self.name}-cache-{workload}-{self._count}")
        self.log_path = os.path.join(self.keep_logs or self.tmp, f"{self.name}-{workload}-{self._count}.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        worker = worker_process({}, cache_dir, quota=self.quota, log_path=self.log_path, env=env,
                                extra=["--config", self.config_path, *self.worker_args])
        worker.args = ["--log-level", self.log_level, *worker.args]  # a flag of `cachefs`, before `worker`
        fs = None
        try:
            worker.start(timeout=60)
            fs = fsspec.filesystem("cachefs", workers=worker.address, short_circuit=self.short_circuit,
                                   skip_instance_cache=True)
            self._fs, self._last_stats = fs, self._bulk_stats() or {}
            if self.plain == "open":
                def read_open(key: str, out: np.ndarray) -> bytes:
                    with fs.open(f"cachefs://{MOUNT}/{key}") as f:
                        return f.read()
                yield read_open
            elif self.plain == "cat":
                yield lambda key, out: fs.cat_file(f"cachefs://{MOUNT}/{key}")
            else:
                # Into the reused slot, as the limits (local, tcp_raw) read: the lean path's own
                # figure; cachefs_cat and cachefs_open are the plain API returning new bytes.
                def read(key: str, out: np.ndarray) -> np.ndarray:
                    n, size = fs.read_into(f"cachefs://{MOUNT}/{key}", out, 0)
                    if n != size:
                        raise OSError(f"read_into of {key} returned {n} of {size} bytes")
                    return out[:n]
                yield read
            self._status[workload] = worker_status(worker.address)
        except BaseException:
            self._print_log_tail()
            raise
        finally:
            self._fs = None
            if fs is not None:
                with contextlib.suppress(Exception):
                    fs.close()
            worker.stop()
            worker.kill()
            shutil.rmtree(cache_dir, ignore_errors=True)

    def _print_log_tail(self) -> None:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            tail = f.read()[-3000:]
            if tail.strip():
                print(f"--- tail of {self.log_path} ---\n{tail}", file=sys.stderr)

    def after_passes(self, workload: str) -> dict[str, Any]:
        return {"worker_status": self._status.pop(workload, None)}


def worker_status(address: str) -> dict[str, Any]:
    import grpc

    from cachefs.proto import worker_pb2, worker_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            s = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    except grpc.RpcError as exc:
        return {"error": str(exc.code())}
    out = {"hits": s.hits, "misses": s.misses, "pages": s.pages, "used_bytes": s.used_bytes,
           "bytes_from_cache": s.bytes_from_cache, "bytes_from_store": s.bytes_from_store, "page_size": s.page_size}
    for name in ("data_port", "short_circuit_socket"):
        if hasattr(s, name):
            out[name] = getattr(s, name)
    return out


class LocalDisk(System):
    """The limit: the local copy (page cache warm), readv into the preallocated aligned slot."""

    name = "local"
    passes = ("limit",)

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def api(self, kind: str) -> str:
        return "os.open + os.readv into the aligned slot (page cache warm)"

    @contextlib.contextmanager
    def fresh(self, workload: str, kind: str) -> Iterator[ReadFn]:
        def read(key: str, out: np.ndarray) -> np.ndarray:
            fd = os.open(os.path.join(self.ds.root, key), os.O_RDONLY)
            try:
                view, got = memoryview(out), 0
                while got < len(view):
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break
                    got += n
                return out[:got]
            finally:
                os.close(fd)

        yield read


class RawLimit(System):
    """A transport's limit: its server process (started once, no cache) serves the local copy."""

    passes = ("limit",)

    def __init__(self, name: str, ds: Dataset) -> None:
        self.name, self.ds = name, ds
        self._stack = contextlib.ExitStack()
        address = self._stack.enter_context(limit_server("grpc" if name == "grpc_raw" else "tcp", ds.root))
        self.client = GrpcRawClient(address) if name == "grpc_raw" else TcpRawClient(address)
        self._stack.callback(self.client.close)

    def api(self, kind: str) -> str:
        return self.client.api

    @contextlib.contextmanager
    def fresh(self, workload: str, kind: str) -> Iterator[ReadFn]:
        yield self.client.read

    def close(self) -> None:
        self._stack.close()
