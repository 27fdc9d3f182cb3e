"""The clients people already use, through ``cachefs://`` URLs and ``storage_options``, as on ``s3://``.

Every test runs a real worker over a moto S3 bucket and checks what the library reads or
writes through cachefs against the same bytes read through s3fs directly.
"""

from __future__ import annotations

import io
import tarfile
import zipfile

import fsspec
import pytest

from cachefs.errors import UnknownMountError
from helpers import client, payload

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
torch = pytest.importorskip("torch")


@pytest.fixture
def cluster(s3_store, make_worker, moto_server):
    """(worker, cachefs storage options, s3 storage options, s3 URL of the mount's root)."""
    worker = make_worker(s3_store.mount, page_size=64 << 10)
    s3_options = dict(s3_store.mount.options)
    return worker, {"workers": worker.address, "skip_instance_cache": True}, s3_options, s3_store.mount.url


def _served(worker) -> float:
    """Bytes the worker served, and those it handed out as page files ahead of their reads (on this
    host a file's first block comes with its info, and is read through the descriptors held)."""
    served = worker.metrics.registry.get_sample_value("cachefs_worker_bytes_served_total") or 0.0
    return served + worker.metrics.registry.get_sample_value("cachefs_worker_handed_out_bytes_total")


def test_pandas_csv_and_parquet_round_trip(cluster):
    worker, opts, s3_opts, s3_root = cluster
    df = pd.DataFrame({"x": range(1000), "y": [f"row{i}" for i in range(1000)]})
    df.to_csv("cachefs://data/tables/t.csv", index=False, storage_options=opts)
    df.to_parquet("cachefs://data/tables/t.parquet", storage_options=opts)
    # Written through cachefs, the objects are in the bucket, readable with s3fs as usual ...
    pd.testing.assert_frame_equal(pd.read_csv(f"{s3_root}/tables/t.csv", storage_options=s3_opts), df)
    pd.testing.assert_frame_equal(pd.read_parquet(f"{s3_root}/tables/t.parquet", storage_options=s3_opts), df)
    # ... and read back through the cache.
    before = _served(worker)
    pd.testing.assert_frame_equal(pd.read_csv("cachefs://data/tables/t.csv", storage_options=opts), df)
    pd.testing.assert_frame_equal(pd.read_parquet("cachefs://data/tables/t.parquet", storage_options=opts), df)
    assert _served(worker) > before


def test_pyarrow_parquet_through_the_fsspec_filesystem(cluster):
    worker, opts, _, _ = cluster
    fs = client(worker.address)
    table = pa.table({"a": list(range(5000)), "b": [float(i) / 3 for i in range(5000)]})
    with fs.open("cachefs://data/pa/t.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=1000)
    assert pq.read_table("data/pa/t.parquet", filesystem=fs).equals(table)
    with fs.open("cachefs://data/pa/t.parquet") as f:  # random access: footer, then row groups
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_row_groups == 5
        assert pf.read_row_group(3).column("a").to_pylist() == list(range(3000, 4000))
    dataset_table = pq.ParquetDataset("data/pa", filesystem=fs).read()
    assert dataset_table.num_rows == 5000


def test_zip_and_tar_by_chaining_and_over_a_file(cluster, s3_store):
    worker, opts, _, _ = cluster
    members = {f"m{i}.bin": payload(20_000 + i, seed=i) for i in range(4)}
    zbuf, tbuf = io.BytesIO(), io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    with tarfile.open(fileobj=tbuf, mode="w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    s3_store.add("arch/a.zip", zbuf.getvalue())
    s3_store.add("arch/a.tar", tbuf.getvalue())

    with fsspec.open("zip://m2.bin::cachefs://data/arch/a.zip", "rb", cachefs=opts) as f:
        assert f.read() == members["m2.bin"]
    with fsspec.open("tar://m3.bin::cachefs://data/arch/a.tar", "rb", cachefs=opts) as f:
        assert f.read() == members["m3.bin"]
    zfs = fsspec.filesystem("zip", fo="cachefs://data/arch/a.zip", target_options=opts)
    assert sorted(zfs.ls("", detail=False)) == sorted(members)
    fs = client(worker.address)
    with fs.open("cachefs://data/arch/a.zip") as f, zipfile.ZipFile(f) as z:
        assert {n: z.read(n) for n in z.namelist()} == members


def test_torch_checkpoint_save_and_load(cluster):
    worker, opts, s3_opts, s3_root = cluster
    state = {"w": torch.arange(300_000, dtype=torch.float32).reshape(300, 1000), "step": 7}
    with fsspec.open("cachefs://data/ckpt/model.pt", "wb", **opts) as f:
        torch.save(state, f)
    with fsspec.open("cachefs://data/ckpt/model.pt", "rb", **opts) as f:
        loaded = torch.load(f, weights_only=True)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], state["w"])
    with fsspec.open(f"{s3_root}/ckpt/model.pt", "rb", **s3_opts) as f:  # the same object in the bucket
        assert torch.equal(torch.load(f, weights_only=True)["w"], state["w"])


def test_open_files_glob_and_get_mapper(cluster, s3_store):
    worker, opts, _, _ = cluster
    for i in range(5):
        s3_store.add(f"shards/s{i}.bin", payload(1000 + i, seed=i))
    s3_store.add("shards/other.txt", b"no")
    files = fsspec.open_files("cachefs://data/shards/s*.bin", "rb", **opts)
    assert [f.path for f in files] == [f"data/shards/s{i}.bin" for i in range(5)]
    for i, of in enumerate(files):
        with of as f:
            assert f.read() == s3_store.objects[f"shards/s{i}.bin"]

    m = fsspec.get_mapper("cachefs://data/kv", **opts)
    m["a/1"] = b"one"
    m["b"] = b"two"
    assert m["a/1"] == b"one" and sorted(m) == ["a/1", "b"]
    del m["a/1"]
    assert "a/1" not in m and list(m) == ["b"]
    assert m.getitems(["b"]) == {"b": b"two"}


def test_chained_s3_url_reaches_the_cached_mount(cluster, s3_store):
    worker, opts, s3_opts, s3_root = cluster  # s3_root is s3://<bucket>/root, mounted as "data"
    s3_store.add("chain/x.bin", payload(300_000, seed=9))
    url = f"cachefs::{s3_root}/chain/x.bin"
    before = _served(worker)
    with fsspec.open(url, "rb", cachefs=opts, s3=s3_opts) as f:
        assert f.read() == s3_store.objects["chain/x.bin"]
    assert _served(worker) - before >= 300_000  # through the worker, not around it
    fs, path = fsspec.core.url_to_fs(url, cachefs=opts, s3=s3_opts)
    assert fs.info(path)["name"] == path  # names come back as the caller spelled them
    # Same pages as the mount path: the worker fetched the object from the store only once.
    fetched = worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total")
    assert client(worker.address).cat_file("cachefs://data/chain/x.bin") == s3_store.objects["chain/x.bin"]
    assert worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") == fetched
    # Writes through a chained URL go through the worker too.
    with fsspec.open(f"cachefs::{s3_root}/chain/new.bin", "wb", cachefs=opts, s3=s3_opts) as f:
        f.write(b"written via chain")
    assert client(worker.address).cat_file("cachefs://data/chain/new.bin") == b"written via chain"


def test_chained_url_under_no_mount(cluster, moto_server):
    worker, opts, s3_opts, _ = cluster
    other = moto_server.new_bucket()
    moto_server.client().put_object(Bucket=other, Key="k", Body=b"outside")
    with pytest.raises(UnknownMountError, match="under no cachefs mount"):
        with fsspec.open(f"cachefs::s3://{other}/k", "rb", cachefs=opts, s3=s3_opts) as f:
            f.read()
    # Only if asked: read it from the store directly, without the cache.
    with fsspec.open(f"cachefs::s3://{other}/k", "rb", cachefs={**opts, "unmounted": "direct"}, s3=s3_opts) as f:
        assert f.read() == b"outside"
    with pytest.raises(UnknownMountError):  # never write around the cache
        with fsspec.open(f"cachefs::s3://{other}/k2", "wb", cachefs={**opts, "unmounted": "direct"},
                         s3=s3_opts) as f:
            f.write(b"x")


def test_read_into_takes_chained_urls_as_cat_file_does(cluster, s3_store, moto_server):
    """read_into and cat_file share one path parser: a chained store URL reaches its mount in both."""
    import numpy as np

    worker, opts, s3_opts, s3_root = cluster
    data = payload(200_000, seed=11)
    s3_store.add("chain/into.bin", data)
    fs, path = fsspec.core.url_to_fs(f"cachefs::{s3_root}/chain/into.bin", cachefs=opts, s3=s3_opts)
    buf = np.zeros(len(data) + 100, dtype=np.uint8)
    assert fs.read_into(path, buf) == (len(data), len(data))
    assert buf[:len(data)].tobytes() == data == fs.cat_file(path)
    assert fs.read_into(path, buf[:1000], offset=5000) == (1000, len(data))
    assert buf[:1000].tobytes() == data[5000:6000]
    other = moto_server.new_bucket()
    moto_server.client().put_object(Bucket=other, Key="k", Body=b"outside")
    fs_error, outside = fsspec.core.url_to_fs(f"cachefs::s3://{other}/k", cachefs=opts, s3=s3_opts)
    with pytest.raises(UnknownMountError, match="under no cachefs mount"):
        fs_error.read_into(outside, buf)
    fs_direct, outside = fsspec.core.url_to_fs(f"cachefs::s3://{other}/k", cachefs={**opts, "unmounted": "direct"},
                                               s3=s3_opts)
    assert fs_direct.read_into(outside, buf) == (7, 7) and buf[:7].tobytes() == b"outside"
