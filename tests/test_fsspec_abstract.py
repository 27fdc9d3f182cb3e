"""fsspec's own conformance suite (``fsspec.tests.abstract``) against ``cachefs://``.

As s3fs's ``tests/derived/`` does: fixture classes supply ``fs``, ``fs_path``, ``fs_join``
and ``supports_empty_directories``; the suite's copy/get/put/open/pipe tests run unchanged.
One real worker per store (a local directory, a moto S3 bucket) serves every test of a
class; each test works under its own fresh prefix. Known differences are listed, with
their reasons, in docs/compatibility.md.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec.tests.abstract as abstract
import pytest

from cachefs.config import CacheDirSpec, WorkerConfig
from cachefs.mounts import MountSpec
from cachefs.server.worker import Worker
from cachefs.testing import MotoServer
from helpers import client


def _start_worker(mount: MountSpec, cache: Path) -> Worker:
    config = WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(str(cache), 1 << 30),),
                          mounts=(mount,), page_size=64 << 10)
    return Worker(config).start()


class CacheFixtures(abstract.AbstractFixtures):
    store_kind = ""

    @pytest.fixture(scope="class")
    @classmethod
    def _worker(cls, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Worker]:
        base = tmp_path_factory.mktemp(f"abstract-{cls.store_kind}")
        if cls.store_kind == "local":
            (base / "store").mkdir()
            mount = MountSpec("data", str(base / "store"))
        else:
            moto: MotoServer = request.getfixturevalue("moto_server")
            mount = MountSpec("data", f"s3://{moto.new_bucket()}/root", moto.storage_options())
        worker = _start_worker(mount, base / "cache")
        yield worker
        worker.stop(grace=1.0)

    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls, _worker: Worker):  # noqa: ANN201 - fixture
        fs = client(_worker.address)
        yield fs
        fs.close()

    @pytest.fixture
    def fs_join(self):  # noqa: ANN201 - fixture
        return posixpath.join

    @pytest.fixture
    def fs_path(self) -> str:
        return f"data/{uuid.uuid4().hex[:10]}"

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return self.store_kind == "local"


class LocalFixtures(CacheFixtures):
    store_kind = "local"


class S3Fixtures(CacheFixtures):
    store_kind = "s3"


class TestLocalCopy(abstract.AbstractCopyTests, LocalFixtures):
    pass


class TestLocalGet(abstract.AbstractGetTests, LocalFixtures):
    pass


class TestLocalPut(abstract.AbstractPutTests, LocalFixtures):
    pass


class TestLocalOpen(abstract.AbstractOpenTests, LocalFixtures):
    pass


class TestLocalPipe(abstract.AbstractPipeTests, LocalFixtures):
    pass


class TestS3Copy(abstract.AbstractCopyTests, S3Fixtures):
    pass


class TestS3Get(abstract.AbstractGetTests, S3Fixtures):
    pass


class TestS3Put(abstract.AbstractPutTests, S3Fixtures):
    pass


class TestS3Open(abstract.AbstractOpenTests, S3Fixtures):
    pass


class TestS3Pipe(abstract.AbstractPipeTests, S3Fixtures):
    pass
