"""Data libraries that take fsspec filesystems or URLs, reading (and writing) ``cachefs://`` as they
read ``s3://``: pyarrow.dataset, polars (file objects), zarr (``get_mapper`` and its fsspec store),
Hugging Face ``datasets`` (parquet, streaming and not), webdataset (a registered handler and
``pipe:cachefs cat``), pandas (partitioned parquet, JSON lines, chunked CSV; more in
tests/test_ecosystem.py).

One real worker over a moto bucket per test; each library's result is compared with the data
written, and the bytes in the bucket with s3fs's view of them.
"""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import tarfile

import pytest

from helpers import client, payload

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pads = pytest.importorskip("pyarrow.dataset")


@pytest.fixture
def cluster(s3_store, make_worker):
    """(cachefs filesystem, its storage options, s3fs filesystem, the mount root as s3fs paths)."""
    import s3fs

    worker = make_worker(s3_store.mount, page_size=64 << 10)
    s3 = s3fs.S3FileSystem(skip_instance_cache=True, **s3_store.mount.options)
    return client(worker.address), {"workers": worker.address}, s3, s3_store.mount.url[len("s3://"):]


def _table(n: int = 3000):
    return pa.table({"id": list(range(n)), "part": [i % 3 for i in range(n)], "x": [i / 7 for i in range(n)]})


def test_pyarrow_dataset_with_fs(cluster):
    fs, _, s3, root = cluster
    table = _table()
    pads.write_dataset(table, "data/pads", filesystem=fs, format="parquet", partitioning=["part"],
                       existing_data_behavior="overwrite_or_ignore")
    assert sorted(p.rsplit("/", 1)[0].rsplit("/", 1)[1] for p in s3.find(f"{root}/pads")) == ["0", "1", "2"]
    dataset = pads.dataset("data/pads", filesystem=fs, format="parquet", partitioning=["part"])
    got = dataset.to_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(3000)) and got.column("part").to_pylist() == table.column(
        "part").to_pylist()
    assert dataset.to_table(filter=pads.field("part") == 1).num_rows == 1000  # a partition filter
    assert sorted(dataset.to_table(columns=["x"], filter=pads.field("id") < 10).column("x").to_pylist()) == [
        i / 7 for i in range(10)]


def test_polars_through_file_objects(cluster):
    pl = pytest.importorskip("polars")
    fs, _, s3, root = cluster
    df = pl.DataFrame({"a": list(range(2000)), "b": [f"s{i}" for i in range(2000)]})
    with fs.open("data/pl/t.parquet", "wb") as f:
        df.write_parquet(f)
    with fs.open("data/pl/t.csv", "wb") as f:
        df.write_csv(f)
    assert pl.read_parquet(s3.open(f"{root}/pl/t.parquet")).equals(df)  # written through: in the bucket
    with fs.open("data/pl/t.parquet") as f:
        assert pl.read_parquet(f).equals(df)
    with fs.open("data/pl/t.parquet") as f:
        assert pl.read_parquet(f, columns=["b"], n_rows=3)["b"].to_list() == ["s0", "s1", "s2"]
    with fs.open("data/pl/t.csv") as f:
        assert pl.read_csv(f).equals(df)
    with fs.open("data/pl/t.parquet") as f:
        assert pl.scan_parquet(f).filter(pl.col("a") >= 1990).collect()["a"].to_list() == list(range(1990, 2000))


def test_zarr_through_get_mapper_and_its_fsspec_store(cluster):
    zarr = pytest.importorskip("zarr")
    np = pytest.importorskip("numpy")
    fs, opts, s3, root = cluster
    data = np.arange(40_000, dtype="float32").reshape(200, 200)
    group = zarr.open_group(fs.get_mapper("data/z/g.zarr"), mode="w")
    arr = group.create_array("a", shape=data.shape, chunks=(50, 50), dtype="float32")
    arr[:] = data
    assert any(p.endswith("zarr.json") for p in s3.find(f"{root}/z/g.zarr"))
    again = zarr.open_group(fs.get_mapper("data/z/g.zarr"), mode="r")
    np.testing.assert_array_equal(again["a"][:], data)
    np.testing.assert_array_equal(again["a"][60:70, 110:130], data[60:70, 110:130])
    # by URL, as zarr opens s3:// (its FsspecStore over the async filesystem)
    by_url = zarr.open_array("cachefs://data/z/g.zarr/a", mode="r", storage_options=opts)
    np.testing.assert_array_equal(by_url[199], data[199])


@pytest.mark.parametrize("streaming", [False, True])
def test_hugging_face_datasets_parquet(cluster, tmp_path, monkeypatch, streaming):
    hf = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing from the hub: the files are ours
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    fs, opts, _, _ = cluster
    for i in range(2):
        with fs.open(f"data/hf/train-{i}.parquet", "wb") as f:
            pq.write_table(pa.table({"text": [f"t{i}-{j}" for j in range(50)], "label": [j % 2 for j in range(50)]}), f)
    ds = hf.load_dataset("parquet", data_files={"train": "cachefs://data/hf/train-*.parquet"}, split="train",
                         storage_options=opts, streaming=streaming, cache_dir=str(tmp_path / "hf-cache"))
    rows = list(ds)
    assert sorted(r["text"] for r in rows) == sorted(f"t{i}-{j}" for i in range(2) for j in range(50))
    assert sum(r["label"] for r in rows) == 50


def _shards(fs, n_shards: int = 2, per_shard: int = 5) -> dict[str, bytes]:
    samples = {}
    for s in range(n_shards):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(per_shard):
                key = f"s{s}-{i:03d}"
                for ext, data in (("bin", payload(3000 + i, s * 100 + i)), ("cls", str(i % 2).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                samples[key] = payload(3000 + i, s * 100 + i)
        fs.pipe_file(f"data/wds/shard-{s:03d}.tar", buf.getvalue())
    return samples


def test_webdataset_with_the_registered_handler(cluster, monkeypatch):
    wds = pytest.importorskip("webdataset")
    import cachefs

    gopen = importlib.import_module("webdataset.gopen")  # the package exports a function of that name

    fs, opts, _, _ = cluster
    samples = _shards(fs)
    monkeypatch.setitem(gopen.gopen_schemes, "cachefs", gopen.gopen_schemes["__default__"])
    with pytest.raises(ValueError, match="no gopen handler"):  # what users met before
        next(iter(wds.WebDataset("cachefs://data/wds/shard-000.tar", shardshuffle=False)))
    cachefs.register_webdataset(opts)  # the documented one line (monkeypatch restores the table)
    got = {s["__key__"]: s["bin"] for s in wds.WebDataset("cachefs://data/wds/shard-{000..001}.tar",
                                                         shardshuffle=False)}
    assert got == samples
    # webdataset's writer through the same handler
    with wds.TarWriter("cachefs://data/wds/out.tar") as sink:
        sink.write({"__key__": "k1", "txt": "hello"})
    assert [s["txt"] for s in wds.WebDataset("cachefs://data/wds/out.tar", shardshuffle=False)] == [b"hello"]


def _cat(*args: str) -> list[str]:
    return [sys.executable, "-m", "cachefs.cli", "--log-level", "WARNING", "cat", *args]


def test_webdataset_pipe_urls_through_cachefs_cat(cluster):
    wds = pytest.importorskip("webdataset")
    fs, opts, _, _ = cluster
    samples = _shards(fs)
    cmd = " ".join(_cat("--workers", opts["workers"], "cachefs://data/wds/shard-001.tar"))
    got = {s["__key__"]: s["bin"] for s in wds.WebDataset(f"pipe:{cmd}", shardshuffle=False)}
    assert got == {k: v for k, v in samples.items() if k.startswith("s1-")}


def test_cachefs_cat_concatenates_and_fails_clearly(cluster):
    fs, opts, _, _ = cluster
    fs.pipe({"data/c/1": b"one,", "data/c/2": b"two"})
    done = subprocess.run(_cat("--workers", opts["workers"], "cachefs://data/c/1", "cachefs://data/c/2"),
                          capture_output=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, b"one,two"), done.stderr
    missing = subprocess.run(_cat("--workers", opts["workers"], "cachefs://data/c/1", "cachefs://data/c/nope"),
                             capture_output=True, timeout=60)
    assert missing.returncode == 1 and missing.stdout == b"one,"
    assert b"cachefs cat:" in missing.stderr and b"data/c/nope" in missing.stderr and b"Traceback" not in missing.stderr
    # a reader that stops early (head -c): the pipe's status 141, as webdataset's pipes expect; no traceback
    fs.pipe_file("data/c/big", payload(12 << 20, 1))
    proc = subprocess.Popen(_cat("--workers", opts["workers"], "cachefs://data/c/big"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.read(1000) == payload(12 << 20, 1)[:1000]
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and b"Traceback" not in err, err


def test_pandas_partitioned_parquet_and_json_lines(cluster):
    pd = pytest.importorskip("pandas")
    fs, opts, s3, root = cluster
    df = pd.DataFrame({"id": range(300), "part": [i % 3 for i in range(300)], "s": [f"v{i}" for i in range(300)]})
    df.to_parquet("cachefs://data/pd/t", partition_cols=["part"], storage_options=opts)
    assert sorted(p.split("/")[-2] for p in s3.find(f"{root}/pd/t")) == ["part=0", "part=1", "part=2"]
    back = pd.read_parquet("cachefs://data/pd/t", storage_options=opts).sort_values("id").reset_index(drop=True)
    assert back["id"].tolist() == list(range(300)) and back["part"].astype(int).tolist() == df["part"].tolist()
    df.to_json("cachefs://data/pd/t.jsonl", orient="records", lines=True, storage_options=opts)
    pd.testing.assert_frame_equal(pd.read_json("cachefs://data/pd/t.jsonl", lines=True, storage_options=opts), df)
    fs.pipe_file("data/pd/t.csv", df.to_csv(index=False).encode())
    chunks = list(pd.read_csv("cachefs://data/pd/t.csv", storage_options=opts, chunksize=100))
    assert len(chunks) == 3
    pd.testing.assert_frame_equal(pd.concat(chunks), df)
