"""s3fs's public methods on ``cachefs://``: each answers as s3fs (or fsspec's local filesystem)
answers for the same objects, or raises NotImplementedError saying why (docs/compatibility.md).

One real worker per store (a local directory, a moto S3 bucket) serves the module; every answer
is compared with the store's own filesystem (s3fs, fsspec's local) reading the same objects.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
from fsspec.implementations.local import LocalFileSystem

from cachefs.client.fs.fscompat import S3_ONLY
from cachefs.config import CacheDirSpec, WorkerConfig
from cachefs.mounts import MountSpec
from cachefs.server.worker import Worker
from cachefs.testing import MotoServer
from helpers import client, payload

ROOT = Path(__file__).resolve().parent.parent
TREE = {
    "tree/a.bin": payload(70_000, 1),
    "tree/b.txt": b"hello\nworld\n" * 100,
    "tree/dir1/c.bin": payload(5_000, 2),
    "tree/dir1/sub/d.bin": payload(3_000, 3),
    "tree/dir2/e.csv": b"x,y\n1,2\n",
}


@dataclass
class Pair:
    """cachefs (``fs``, paths ``data/...``) and the store's own filesystem (``direct``, ``base/...``)."""

    kind: str
    fs: Any
    direct: Any
    base: str
    worker: Worker

    def d(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def rel_direct(self, paths: Any) -> Any:
        strip = lambda p: self.direct._strip_protocol(p)[len(self.direct._strip_protocol(self.base)) + 1:]  # noqa: E731
        return sorted(strip(p) for p in paths)

    @staticmethod
    def rel_cache(paths: Any) -> Any:
        return sorted(p[len("data/"):] for p in paths)


@pytest.fixture(scope="module", params=["local", "s3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    base_dir = tmp_path_factory.mktemp(f"surface-{request.param}")
    if request.param == "local":
        root = base_dir / "store"
        for key, data in TREE.items():
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(data)
        mount, direct, base = MountSpec("data", str(root)), LocalFileSystem(), str(root)
    else:
        server: MotoServer = request.getfixturevalue("moto_server")
        bucket = server.new_bucket("surface")
        for key, data in TREE.items():
            server.client().put_object(Bucket=bucket, Key=f"root/{key}", Body=data)
        mount = MountSpec("data", f"s3://{bucket}/root", server.storage_options())
        direct = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        base = f"{bucket}/root"
    config = WorkerConfig(host="127.0.0.1", port=0, cache_dirs=(CacheDirSpec(str(base_dir / "cache"), 1 << 30),),
                          mounts=(mount,), page_size=16 << 10)
    worker = Worker(config).start()
    try:
        yield Pair(request.param, client(worker.address), direct, base, worker)
    finally:
        worker.stop(grace=1.0)


def _fresh(name: str) -> str:
    return f"w/{name}-{uuid.uuid4().hex[:8]}"


# -- identity and time -------------------------------------------------------------------------------
def test_info_has_s3fs_fields_and_modified_is_a_datetime(pair: Pair) -> None:
    info = pair.fs.info("cachefs://data/tree/a.bin")
    direct = pair.direct.info(pair.d("tree/a.bin"))
    assert (info["name"], info["size"], info["type"]) == ("data/tree/a.bin", 70_000, "file")
    assert isinstance(info["mtime"], float)  # seconds, as pyarrow and the local filesystem take it
    modified = pair.fs.modified("data/tree/a.bin")
    assert modified.tzinfo is not None and modified == info["LastModified"]
    expected = pair.direct.modified(pair.d("tree/a.bin"))
    assert abs((modified - expected.astimezone(datetime.timezone.utc)).total_seconds()) < 1.0
    if pair.kind == "s3":
        assert info["ETag"] == direct["ETag"]  # quoted, as S3 sends it
        assert [e["ETag"] for e in pair.fs.ls("data/tree", detail=True) if e["type"] == "file"] \
            == [e["ETag"] for e in pair.direct.ls(pair.d("tree"), detail=True) if e["type"] == "file"]
    else:
        assert "ETag" not in info  # a local file's version is size + mtime, not an ETag
    with pytest.raises(IsADirectoryError):
        pair.fs.modified("data/tree/dir1")
    with pytest.raises(NotImplementedError, match="no creation time"):
        pair.fs.created("data/tree/a.bin")
    with pytest.raises(FileNotFoundError):
        pair.fs.modified("data/tree/missing.bin")
    for method in (pair.fs.info, pair.fs.modified):
        with pytest.raises(NotImplementedError, match="version_id"):
            method("data/tree/a.bin", version_id="v1")


def test_checksum_and_ukey_follow_the_object(pair: Pair) -> None:
    path = f"data/{_fresh('ident')}.bin"
    pair.fs.pipe_file(path, b"one")
    first = (pair.fs.checksum(path), pair.fs.ukey(path))
    assert first == (pair.fs.checksum(path), pair.fs.ukey(path))
    if pair.kind == "s3":  # the same number s3fs gives for the object
        assert first[0] == pair.direct.checksum(pair.d(path[len("data/"):]), refresh=True)
    pair.fs.pipe_file(path, b"two, longer")
    second = (pair.fs.checksum(path), pair.fs.ukey(path))
    assert second[0] != first[0] and second[1] != first[1]
    assert isinstance(pair.fs.checksum("data/tree/dir1"), int)


def test_s3_only_methods_are_refused_with_the_reason(pair: Pair) -> None:
    for name, reason in S3_ONLY.items():
        with pytest.raises(NotImplementedError, match=re.escape(f"{name}() is not supported")) as err:
            getattr(pair.fs, name)("data/tree/a.bin")
        assert reason in str(err.value)


def test_transactions_are_refused_before_anything_is_written(pair: Pair) -> None:
    path = f"data/{_fresh('txn')}.bin"
    with pytest.raises(NotImplementedError, match="transactions"):
        with pair.fs.transaction:
            pair.fs.open(path, "wb")
    assert not pair.fs.exists(path)


# -- reads -----------------------------------------------------------------------------------------
def test_cat_ranges_as_s3fs(pair: Pair) -> None:
    rels = ["tree/a.bin", "tree/a.bin", "tree/b.txt", "tree/a.bin", "tree/dir1/c.bin", "tree/missing"]
    starts = [0, 65_000, 5, -100, 4_990, 0]
    ends = [10, None, 20, None, 9_000, 5]
    got = pair.fs.cat_ranges([f"data/{r}" for r in rels], starts, ends)
    want = pair.direct.cat_ranges([pair.d(r) for r in rels], starts, ends)
    assert got[:-1] == want[:-1]
    assert isinstance(got[-1], FileNotFoundError) and isinstance(want[-1], FileNotFoundError)
    assert pair.fs.cat_ranges(["data/tree/a.bin"] * 2, 10, 20) == [TREE["tree/a.bin"][10:20]] * 2
    with pytest.raises(FileNotFoundError):
        pair.fs.cat_ranges(["data/tree/missing"], [0], [1], on_error="raise")
    for fs, path in ((pair.fs, "data/tree/a.bin"), (pair.direct, pair.d("tree/a.bin"))):
        with pytest.raises(NotImplementedError):  # fsspec's (and so s3fs's) cat_ranges refuses it too
            fs.cat_ranges([path], [0], [1], max_gap=10)


def test_pipe_of_many_then_cat_of_many(pair: Pair) -> None:
    prefix = _fresh("pipe")
    values = {f"data/{prefix}/{i}.bin": payload(1000 + i, i) for i in range(5)}
    pair.fs.pipe(values)
    assert pair.fs.cat(list(values)) == values
    assert [pair.direct.cat_file(pair.d(p[len("data/"):])) for p in values] == list(values.values())
    assert pair.fs.cat(f"data/{prefix}/*.bin") == values  # a glob: a dict, as s3fs


# "parts" is not a read cache: it serves parts handed in through cache_options (fsspec's reference
# filesystem uses it), on s3fs as here.
@pytest.mark.parametrize("cache_type", sorted(k for k in fsspec.caching.caches if k and k != "parts"))
def test_open_with_every_cache_type(pair: Pair, cache_type: str) -> None:
    data = TREE["tree/a.bin"]
    with pair.fs.open("data/tree/a.bin", cache_type=cache_type, block_size=8192,
                      cache_options={"maxblocks": 4} if cache_type == "blockcache" else None) as f:
        assert f.read(100) == data[:100]
        f.seek(50_000)
        assert f.read(9000) == data[50_000:59_000]
        f.seek(-10, 2)
        assert f.read() == data[-10:]
        f.seek(1)
        assert f.read() == data[1:]


# -- listing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("maxdepth,withdirs", [(None, False), (None, True), (1, False), (1, True), (2, True)])
def test_find_maxdepth_withdirs_as_the_store(pair: Pair, maxdepth: int | None, withdirs: bool) -> None:
    got = pair.fs.find("data/tree", maxdepth=maxdepth, withdirs=withdirs)
    want = pair.direct.find(pair.d("tree"), maxdepth=maxdepth, withdirs=withdirs)
    assert pair.rel_cache(got) == pair.rel_direct(want)
    detail = pair.fs.find("cachefs://data/tree", maxdepth=maxdepth, withdirs=withdirs, detail=True)
    assert sorted(detail) == sorted(got) and all(detail[k]["name"] == k for k in detail)


GLOBS = ["tree/*", "tree/**", "tree/**/*.bin", "tree/dir?/*", "tree/dir[12]/c.bin", "tree/nothing*",
         "tree/a.bin", "tree/*/", "tree/**/sub/*", "tree/dir1/**"]


@pytest.mark.parametrize("pattern", GLOBS)
def test_glob_as_the_store(pair: Pair, pattern: str) -> None:
    got = pair.fs.glob(f"cachefs://data/{pattern}")
    want = pair.direct.glob(pair.d(pattern))
    assert pair.rel_cache(got) == pair.rel_direct(want), pattern
    if "**" in pattern:
        assert pair.rel_cache(pair.fs.glob(f"data/{pattern}", maxdepth=1)) \
            == pair.rel_direct(pair.direct.glob(pair.d(pattern), maxdepth=1))


def test_the_generic_methods(pair: Pair, tmp_path: Path) -> None:
    fs, data = pair.fs, TREE["tree/a.bin"]
    assert fs.exists("data/tree/a.bin") and fs.lexists("data/tree/a.bin") and not fs.exists("data/tree/nope")
    assert fs.isdir("data/tree/dir1") and not fs.isdir("data/tree/a.bin") and fs.isfile("data/tree/a.bin")
    assert fs.size("data/tree/a.bin") == len(data) and fs.sizes(["data/tree/a.bin", "data/tree/b.txt"]) == [
        len(data), len(TREE["tree/b.txt"])]
    assert fs.du("data/tree") == sum(len(v) for v in TREE.values()) == fs.disk_usage("data/tree")
    assert fs.du("data/tree", total=False) == {f"data/{k}": len(v) for k, v in TREE.items()}
    assert fs.head("data/tree/a.bin", 7) == data[:7] and fs.tail("data/tree/a.bin", 7) == data[-7:]
    assert fs.read_block("data/tree/b.txt", 3, 20, delimiter=b"\n") \
        == pair.direct.read_block(pair.d("tree/b.txt"), 3, 20, delimiter=b"\n")
    assert fs.read_bytes("data/tree/a.bin", 5, 9) == data[5:9]
    assert fs.read_text("data/tree/b.txt") == TREE["tree/b.txt"].decode()
    assert fs.stat("data/tree/a.bin")["size"] == len(data) and fs.listdir("data/tree") == fs.ls("data/tree", True)
    assert pair.rel_cache(fs.expand_path("data/tree/dir1", recursive=True)) \
        == pair.rel_direct(pair.direct.expand_path(pair.d("tree/dir1"), recursive=True))
    walked = {root: (sorted(dirs), sorted(files)) for root, dirs, files in fs.walk("data/tree")}
    assert walked["data/tree"] == (["dir1", "dir2"], ["a.bin", "b.txt"]) and walked["data/tree/dir1/sub"][1] == ["d.bin"]
    assert "sub" in fs.tree("data/tree") and "d.bin" in fs.tree("data/tree", recursion_limit=3)
    assert fs.unstrip_protocol("data/tree/a.bin") == "cachefs://data/tree/a.bin"
    assert fsspec.AbstractFileSystem.from_json(fs.to_json()).cat_file("data/tree/b.txt") == TREE["tree/b.txt"]
    assert fsspec.AbstractFileSystem.from_dict(fs.to_dict()).size("data/tree/a.bin") == len(data)
    fs.invalidate_cache("data/tree")  # nothing cached in the client; accepted
    # writes through: write_text/bytes, put/upload, get/download, copy, mv, touch, mkdir, rm
    w = f"data/{_fresh('gen')}"
    fs.write_text(f"{w}/t.txt", "text")
    fs.write_bytes(f"{w}/b.bin", b"bytes")
    (tmp_path / "up.bin").write_bytes(b"up")
    fs.put(str(tmp_path / "up.bin"), f"{w}/up.bin")
    fs.upload(str(tmp_path / "up.bin"), f"{w}/up2.bin")
    fs.get(f"{w}/t.txt", str(tmp_path / "t.txt"))
    fs.download(f"{w}/b.bin", str(tmp_path / "b.bin"))
    assert (tmp_path / "t.txt").read_bytes() == b"text" and (tmp_path / "b.bin").read_bytes() == b"bytes"
    fs.copy(f"{w}/t.txt", f"{w}/t2.txt")
    fs.cp(f"{w}/t.txt", f"{w}/t3.txt")
    fs.mv(f"{w}/t3.txt", f"{w}/t4.txt")
    fs.rename(f"{w}/t4.txt", f"{w}/t5.txt")
    fs.move(f"{w}/t5.txt", f"{w}/t6.txt")
    fs.touch(f"{w}/empty")
    fs.makedirs(f"{w}/d1/d2", exist_ok=True)
    fs.mkdirs(f"{w}/d3", exist_ok=True)
    fs.makedir(f"{w}/d4")
    assert sorted(n.rsplit("/", 1)[1] for n in fs.find(w)) == ["b.bin", "empty", "t.txt", "t2.txt", "t6.txt",
                                                              "up.bin", "up2.bin"]
    assert pair.direct.cat_file(pair.d(f"{w[5:]}/t6.txt")) == b"text"
    fs.delete(f"{w}/t2.txt")
    fs.rm(w, recursive=True)
    assert fs.find(w) == [] and pair.direct.find(pair.d(w[5:])) == []
    mapper = fs.get_mapper(f"data/{_fresh('map')}")
    mapper["k"] = b"v"
    assert dict(mapper) == {"k": b"v"}


def test_async_variants(pair: Pair) -> None:
    address, data = pair.worker.address, TREE["tree/a.bin"]

    async def main() -> None:
        fs = fsspec.filesystem("cachefs", workers=address, asynchronous=True, skip_instance_cache=True)
        assert (await fs._info("data/tree/a.bin"))["size"] == len(data)
        assert await fs._cat_file("data/tree/a.bin", 3, 9) == data[3:9]
        assert await fs._cat_ranges(["data/tree/a.bin", "data/tree/b.txt"], [0, 0], [4, 5]) \
            == [data[:4], TREE["tree/b.txt"][:5]]
        assert await fs._exists("data/tree/a.bin") and await fs._isdir("data/tree/dir1")
        assert await fs._isfile("data/tree/a.bin") and await fs._size("data/tree/a.bin") == len(data)
        assert sorted(await fs._find("data/tree", maxdepth=1)) == ["data/tree/a.bin", "data/tree/b.txt"]
        assert sorted(await fs._glob("data/tree/*.bin")) == ["data/tree/a.bin"]
        assert await fs._checksum("data/tree/a.bin") == pair.fs.checksum("data/tree/a.bin")
        assert await fs._modified("data/tree/a.bin") == pair.fs.modified("data/tree/a.bin")
        assert await fs._du("data/tree") == sum(len(v) for v in TREE.values())
        w = f"data/{_fresh('async')}"
        await fs._pipe({f"{w}/1": b"1", f"{w}/2": b"22"})
        assert await fs._cat([f"{w}/1", f"{w}/2"]) == {f"{w}/1": b"1", f"{w}/2": b"22"}
        f = await fs.open_async("data/tree/a.bin")
        async with f:
            assert await f.read(10) == data[:10]
            f.seek(60_000)
            assert await f.read() == data[60_000:]
        with pytest.raises(NotImplementedError, match="reads only"):
            await fs.open_async(f"{w}/x", "wb")
        await fs._rm(w, recursive=True)
        assert not await fs._exists(f"{w}/1")

    asyncio.run(main())


# -- the method table --------------------------------------------------------------------------------
def test_the_compatibility_table_names_every_public_s3fs_method() -> None:
    """docs/compatibility.md keeps a row per public s3fs method; a new s3fs release that adds one
    fails here until the table says what cachefs does with it."""
    text = (ROOT / "docs" / "compatibility.md").read_text()
    section = text.split("## s3fs's methods on cachefs://", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in re.findall(r"^\| ([^|]+) \|", section, re.M):
        named |= set(re.findall(r"`(\w+)`", row))
    public = {n for n, v in inspect.getmembers(s3fs.S3FileSystem) if not n.startswith("_") and callable(v)}
    assert public - named == set(), "s3fs methods missing from the table"
    assert named - public == set(), "methods in the table that s3fs does not have"
    for name in S3_ONLY:
        assert name in public, name
