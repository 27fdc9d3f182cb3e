"""Shared fixtures: a real S3 endpoint (moto server in its own process), stores, workers.

grpc is imported before any cachefs.client module: this process hosts gRPC servers and forks,
so gRPC's fork support stays off here (client/__init__.py turns it on only where the client
comes first); training processes that tests start as subprocesses get it on, as users' do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc  # noqa: F401 - first: see below
import pytest

from cachefs.config import CacheDirSpec, WorkerConfig
from cachefs.mounts import MountSpec
from cachefs.server.worker import Worker
from cachefs.testing import FAKE_CREDENTIALS, MotoServer
from helpers import refused_port

if TYPE_CHECKING:
    from cachefs.server.etcd.localcluster import EtcdCluster


@pytest.fixture(autouse=True)
def _no_cachefs_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts without CACHEFS_* variables (restored after it).

    The client and daemons read them as defaults (ClientConfig, load_worker_config) and
    subprocesses inherit them: one left in a developer's shell, or set by another test and not
    restored, would change what a test runs. A test that needs one sets it with monkeypatch.
    """
    for name in [n for n in os.environ if n.startswith("CACHEFS_")]:
        monkeypatch.delenv(name)
    # Scanned shard indexes are kept per test (client/datasets/indexcache.py), never in the user's ~/.cache.
    index_cache = tempfile.mkdtemp(prefix="cachefs-index-")
    monkeypatch.setenv("CACHEFS_INDEX_CACHE", index_cache)
    # Read-ahead across objects (client/fs/scanahead.py) hints what follows reads in name order, in
    # the background: tests of other mechanisms count exact fetches, fills and hits, so it is off
    # unless a test asks for it (tests/test_scanahead.py, the demo's end-to-end test).
    monkeypatch.setenv("CACHEFS_SCAN_AHEAD", "false")
    yield
    shutil.rmtree(index_cache, ignore_errors=True)


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port that refuses connections for the whole test (helpers.refused_port)."""
    with refused_port() as port:
        yield port


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials for anything that reads them from the environment (restored after)."""
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)


@dataclass
class Store:
    """An object store under test: put objects, change them, and the mount a worker needs."""

    kind: str
    mount: MountSpec
    put: Callable[[str, bytes], None]
    delete: Callable[[str], None]
    objects: dict[str, bytes] = field(default_factory=dict)

    def add(self, key: str, data: bytes) -> None:
        self.put(key, data)
        self.objects[key] = data


def _local_store(root: Path) -> Store:
    root.mkdir(parents=True, exist_ok=True)

    def put(key: str, data: bytes) -> None:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            old_mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            old_mtime = None
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        # A local file's version is size + mtime: a rewrite of the same size within the file
        # system's timestamp granularity would keep the version. Move the mtime on instead of
        # making every test sleep between writes.
        if old_mtime is not None and path.stat().st_mtime_ns <= old_mtime:
            os.utime(path, ns=(old_mtime + 1_000_000, old_mtime + 1_000_000))

    def delete(key: str) -> None:
        (root / key).unlink()

    return Store("local", MountSpec("data", str(root)), put, delete)


def _s3_store(server: MotoServer) -> Store:
    bucket = server.new_bucket()
    client = server.client()

    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"root/{key}", Body=data)

    def delete(key: str) -> None:
        client.delete_object(Bucket=bucket, Key=f"root/{key}")

    return Store("s3", MountSpec("data", f"s3://{bucket}/root", server.storage_options()), put, delete)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """Each test using it runs against a local directory and against moto S3."""
    if request.param == "local":
        return _local_store(tmp_path / "store")
    return _s3_store(request.getfixturevalue("moto_server"))


@pytest.fixture
def local_store(tmp_path: Path) -> Store:
    return _local_store(tmp_path / "store")


@pytest.fixture
def s3_store(moto_server: MotoServer) -> Store:
    return _s3_store(moto_server)


@pytest.fixture
def make_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """In-process workers on free loopback ports, stopped at the end of the test."""
    workers: list[Worker] = []

    def make(*mounts: MountSpec, cache_dir: Path | None = None, quota: int = 1 << 30, **settings) -> Worker:
        cache = cache_dir or Path(tempfile.mkdtemp(dir=tmp_path, prefix="cache-"))
        config = WorkerConfig(host="127.0.0.1", cache_dirs=(CacheDirSpec(str(cache), quota),),
                              mounts=tuple(mounts), **{"port": 0, **settings})
        worker = Worker(config).start()
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop(grace=1.0)


@pytest.fixture
def etcd_cluster() -> Iterator["EtcdCluster"]:
    """A real 3-member etcd on loopback (free ports, a temp dir), removed after the test.

    Skips, saying why, only when the etcd binary is missing (.ci/setup installs Debian's etcd-server).
    """
    from cachefs.server.etcd.localcluster import EtcdCluster, etcd_binary

    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian's etcd-server; .ci/setup installs it as root)")
    with EtcdCluster(3) as cluster:
        yield cluster
