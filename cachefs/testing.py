"""Helpers shared by the tests and the benchmarks: a real S3 endpoint (moto, server mode), and
a synthetic store of as many objects as asked for (``synthetic://``, :class:`SyntheticFileSystem`).

moto runs in its own process, as a real object store would, so that its CPU time (a few ms
per request) is not charged to the process under test. Needs the ``test`` extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

_MOTO_MAIN = r"""
import os, sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # runs until the parent closes our stdin (or dies)
server.stop()
"""

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def fake_s3_client(url: str) -> Any:
    """A boto3 S3 client for a moto endpoint, with its fake credentials."""
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def new_fake_bucket(url: str, prefix: str) -> str:
    """A fresh bucket at a moto endpoint (botocore: s3fs's mkdir of a bucket fails on moto)."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    fake_s3_client(url).create_bucket(Bucket=name)
    return name


class MotoServer:
    """``with MotoServer() as s3: s3.endpoint_url`` — a moto S3 server on a free loopback port."""

    def __init__(self, key_buffer_size: int = 256 << 20) -> None:
        self.key_buffer_size = key_buffer_size
        self.proc: subprocess.Popen[str] | None = None
        self.endpoint_url = ""

    def start(self, timeout: float = 60.0) -> "MotoServer":
        env = dict(os.environ, **FAKE_CREDENTIALS)
        # Keep objects in memory rather than spooled to temp files (moto's default is ~5 MiB).
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(self.key_buffer_size)
        self.proc = subprocess.Popen([sys.executable, "-c", _MOTO_MAIN], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise RuntimeError("moto server did not start (is the test extra installed?)")
        self.endpoint_url = f"http://127.0.0.1:{int(line)}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=5).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def reset(self) -> None:
        req = urllib.request.Request(self.endpoint_url + "/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def client(self) -> Any:
        return fake_s3_client(self.endpoint_url)

    def new_bucket(self, prefix: str = "cachefs-test") -> str:
        return new_fake_bucket(self.endpoint_url, prefix)

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint: what a worker's S3 mount holds (credentials included)."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint_url,
                "client_kwargs": {"region_name": "us-east-1"}}

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyntheticFileSystem(AbstractFileSystem):
    """``count`` objects that exist only as arithmetic: ``{root}/dNNNNN/NNNNNNNN.bin``, object
    ``i`` in directory ``i // per_dir``, each ``size`` bytes (a pattern made on read) with mtime
    ``mtime``. Lists and stats ten million objects with no file behind them (#47's scale checks:
    10 M page files would use most of a machine's free inodes). ``requests`` counts the calls a
    store would answer, by kind. Mount it as ``synthetic://data`` with options ``count``,
    ``per_dir``, ``size``, ``mtime``, ``trace`` (a file: each listing request appends a line
    ``<pid> <kind> <after>``, so a test can see what a master in another process asked) and
    ``latency`` (seconds each request takes: a slow store).

    Listings page as S3's do (``cachefs_list_after``: up to ``limit`` keys after a name, found by
    bisection, not by listing what comes before), so a load of ten million objects can stream."""

    protocol = "synthetic"
    cachable = False  # each mount its own counters
    root_marker = ""

    def __init__(self, count: int = 1000, per_dir: int = 1000, size: int = 0, mtime: float = 1.7e9,
                 root: str = "data", trace: str = "", latency: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.count, self.per_dir, self.size, self.mtime = int(count), int(per_dir), int(size), float(mtime)
        self.latency = float(latency)
        self.root = root
        self.trace = trace
        self.requests: Counter[str] = Counter()

    def _traced(self, kind: str, after: str = "") -> None:
        self._request(kind)
        if self.trace:
            # One write of one short line in append mode: lines of several processes do not mix.
            with open(self.trace, "a") as f:
                f.write(f"{os.getpid()} {kind} {after}\n")

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        path = path[len("synthetic://"):] if path.startswith("synthetic://") else path
        return path.strip("/")

    def key(self, i: int) -> str:
        """Object ``i``'s key below the root."""
        return f"d{i // self.per_dir:05d}/{i:08d}.bin"

    def _object(self, i: int) -> dict[str, Any]:
        return {"name": f"{self.root}/{self.key(i)}", "size": self.size, "type": "file", "mtime": self.mtime}

    def _dir(self, j: int) -> dict[str, Any]:
        return {"name": f"{self.root}/d{j:05d}", "size": 0, "type": "directory"}

    def _parse(self, path: str) -> tuple[str, int]:
        """("root", 0), ("dir", j) or ("object", i); FileNotFoundError for anything else."""
        path = self._strip_protocol(path)
        if path == self.root:
            return "root", 0
        rest = path[len(self.root) + 1:] if path.startswith(self.root + "/") else ""
        head, _, name = rest.partition("/")
        if head[:1] == "d" and head[1:].isdigit() and int(head[1:]) * self.per_dir < self.count:
            j = int(head[1:])
            if not name and head == f"d{j:05d}":
                return "dir", j
            if name.endswith(".bin") and name[:-4].isdigit():
                i = int(name[:-4])
                if i < self.count and self.key(i) == rest:
                    return "object", i
        raise FileNotFoundError(path)

    def _request(self, kind: str) -> None:
        self.requests[kind] += 1
        if self.latency:
            time.sleep(self.latency)

    def _children(self, kind: str, n: int) -> list[dict[str, Any]]:
        if kind == "root":
            return [self._dir(j) for j in range(-(-self.count // self.per_dir))]
        return [self._object(i) for i in range(n * self.per_dir, min(self.count, (n + 1) * self.per_dir))]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._request("info")
        kind, n = self._parse(path)
        if kind == "object":
            return self._object(n)
        return self._dir(n) if kind == "dir" else {"name": self.root, "size": 0, "type": "directory"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        self._traced("ls")
        kind, n = self._parse(path)
        found = [self._object(n)] if kind == "object" else self._children(kind, n)
        return found if detail else [f["name"] for f in found]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
             **kwargs: Any) -> Any:
        self._traced("find")
        kind, n = self._parse(path)
        if kind == "object":
            found = [self._object(n)]
        elif kind == "dir":
            found = self._children(kind, n)
        else:
            found = [self._object(i) for i in range(self.count)]
        return {f["name"]: f for f in found} if detail else [f["name"] for f in found]

    def cachefs_list_after(self, path: str, recursive: bool, after: str, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` entries below ``path`` (every object if ``recursive``, else its children)
        whose names below it sort after ``after``, in order, and whether they are the last: one
        store request, as a ListObjectsV2 page with StartAfter (``_Backend.list_after``)."""
        self._traced("list_after", after)
        kind, n = self._parse(path)
        if kind == "object":
            return ([self._object(n)] if not after else []), True
        if kind == "root" and not recursive:
            first, end = 0, -(-self.count // self.per_dir)
            name = lambda k: f"d{k:05d}"  # noqa: E731
            entry = self._dir
        else:
            first, end = (0, self.count) if kind == "root" else (n * self.per_dir, min(self.count, (n + 1) * self.per_dir))
            cut = len(f"d{n:05d}/") if kind == "dir" else 0
            name = lambda k: self.key(k)[cut:]  # noqa: E731
            entry = self._object
        lo, hi = first, end  # the first index whose name sorts after ``after`` (names grow with it)
        while lo < hi:
            mid = (lo + hi) // 2
            if name(mid) <= after:
                lo = mid + 1
            else:
                hi = mid
        stop = min(end, lo + limit)
        return [entry(k) for k in range(lo, stop)], stop >= end

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self._request("read")
        kind, i = self._parse(path)
        if kind != "object":
            raise IsADirectoryError(path)
        unit = f"{i:08d}\n".encode()  # each object's own bytes: a mixed-up read shows
        data = (unit * (self.size // len(unit) + 1))[:self.size]
        return data[start:end]


fsspec.register_implementation("synthetic", SyntheticFileSystem, clobber=True)
