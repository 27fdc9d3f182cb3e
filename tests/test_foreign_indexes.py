"""Foreign indexes: MosaicML streaming (MDS) and LitData data sets read through cachefs as they
were written (tests/data/foreign, made by the real writers: make_fixtures.py there), and map
data set manifests as JSON lines, text, JSON lists and Parquet. Through a real worker and real
DataLoader workers (fork)."""

from __future__ import annotations

import json
import re
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from cachefs.client.datasets.dataset import SampleReadError
from cachefs.client.datasets.foreign import flavour, leaf_keys
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.datasets.shards import ShardFormatError

FOREIGN = Path(__file__).parent / "data" / "foreign"
sys.path.insert(0, str(FOREIGN))
from make_fixtures import N, sample  # noqa: E402

PAGE = 64 << 10
TIMEOUT = 60


def _as_list(batch):
    return batch


def _mds_bytes(i: int) -> dict[str, bytes]:
    """What MDSWriter writes for each column of sample ``i`` (its encodings.py)."""
    s = sample(i)
    return {"id": np.int64(s["id"]).tobytes(), "name": s["name"].encode(), "blob": s["blob"],
            "score": np.float32(s["score"]).tobytes(), "meta": json.dumps(s["meta"]).encode(),
            "count": np.uint16(s["count"]).tobytes()}


def _arr(i: int) -> np.ndarray:
    return np.arange(i % 4 + 1, dtype=np.int32) * i


def _mat(i: int) -> np.ndarray:
    return np.full((2, i % 3 + 1), i, dtype=np.float32)


def _litdata_bytes(i: int) -> dict[str, bytes]:
    """What LitData's serializers write for each leaf of sample ``i`` (``numpy``: dtype number 9
    is float32 in its numbering, then ndim and the dims)."""
    s = sample(i)
    mat = _mat(i)
    return {"id": struct.pack("<q", s["id"]), "name": s["name"].encode(), "blob": s["blob"],
            "score": struct.pack("<d", s["score"]), "arr": _arr(i).tobytes(),
            "mat": struct.pack("<4I", 9, 2, *mat.shape) + mat.tobytes()}


def _tuple_bytes(i: int) -> dict[str, bytes]:
    s = sample(i)
    return {"0": struct.pack("<q", s["id"]), "1": s["blob"], "2": _arr(i).tobytes()}


EXPECTED = {"mds": _mds_bytes, "litdata": _litdata_bytes, "litdata_tuple": _tuple_bytes}


@pytest.fixture
def foreign(local_store, make_worker):
    """Every fixture data set copied into the store under data/<name>/, served by one worker;
    ``change(name, file, fn)`` replaces a file's bytes with ``fn(bytes)`` first."""
    for d in FOREIGN.iterdir():
        if d.is_dir() and not d.name.startswith("__"):
            for f in d.iterdir():
                local_store.add(f"{d.name}/{f.name}", f.read_bytes())
    worker = make_worker(local_store.mount, page_size=PAGE)
    opts = {"workers": worker.address}

    def change(name: str, file: str, fn) -> None:
        key = f"{name}/{file}"
        local_store.add(key, fn(local_store.objects[key]))
    return opts, change


def _columns(s: dict) -> dict[str, bytes]:
    return {k: bytes(v.numpy()) for k, v in s.items() if not k.startswith("__")}


def _read(ds: CacheIterableDataset, workers: int) -> list[dict]:
    loader = DataLoader(ds, batch_size=ds.block, num_workers=workers, collate_fn=_as_list,
                        timeout=TIMEOUT if workers else 0, multiprocessing_context="fork" if workers else None)
    return [s for batch in ds.track(loader) for s in batch]


# -- reading ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mds", "litdata", "litdata_tuple"])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_with_the_bytes_written(foreign, name, workers):
    opts, _ = foreign
    n, want = N[name], EXPECTED[name]
    seen = Counter()
    for rank in range(2):
        ds = CacheIterableDataset.from_prefix(f"cachefs://data/{name}", storage_options=opts, batch_size=4,
                                              rank=rank, world_size=2, seed=3)
        assert ds.shards.format == name.split("_")[0] and ds.shards.n_samples == n
        got = _read(ds, workers)
        assert ds.samples_seen == len(got) == len(ds.plan)
        for s in got:
            i = s["__index__"]
            assert _columns(s) == want(i), (name, i)
            seen[i] += 1
    assert sorted(seen) == list(range(n))
    assert set(seen.values()) == {1} or (n % 2 and sum(seen.values()) == n + 1)  # padding only


def test_from_index_reads_the_same_and_keys_name_the_shard(foreign):
    opts, _ = foreign
    ds = CacheIterableDataset.from_index("cachefs://data/mds/index.json", storage_options=opts, batch_size=5,
                                         shuffle=False, rank=0, world_size=1)
    got = list(ds)
    assert [s["__index__"] for s in got] == list(range(N["mds"]))
    assert got[0]["__key__"] == "shard.00000.mds/0" and all(_columns(s) == _mds_bytes(s["__index__"]) for s in got)
    assert [v.path for v in ds.shards][:2] == ["cachefs://data/mds/shard.00000.mds", "cachefs://data/mds/shard.00001.mds"]


@pytest.mark.parametrize("name", ["mds", "litdata"])
def test_decode_gives_the_values_written(foreign, name):
    opts, _ = foreign
    ds = CacheIterableDataset.from_prefix(f"cachefs://data/{name}", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, decode=True)
    got = _read(ds, 2)
    assert len(got) == N[name]
    for s in got:
        i, want = s["__index__"], sample(s["__index__"])
        assert s["id"] == want["id"] and s["name"] == want["name"] and s["blob"] == want["blob"]
        assert s["score"] == want["score"]
        if name == "mds":
            assert s["meta"] == want["meta"] and s["count"] == want["count"] and isinstance(s["count"], np.uint16)
        else:
            assert s["arr"].dtype == np.int32 and s["arr"].tolist() == _arr(i).tolist()
            assert s["mat"].dtype == np.float32 and s["mat"].tolist() == _mat(i).tolist()


def test_spawned_workers_get_the_columns_by_pickle(foreign):
    opts, _ = foreign
    ds = CacheIterableDataset.from_prefix("cachefs://data/litdata_tuple", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, decode=True)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_as_list, timeout=TIMEOUT,
                        multiprocessing_context="spawn")
    got = [s for batch in ds.track(loader) for s in batch]
    assert sorted(s["__index__"] for s in got) == list(range(N["litdata_tuple"]))
    for s in got:
        i = s["__index__"]
        assert (s["0"], s["1"], s["2"].tolist()) == (sample(i)["id"], sample(i)["blob"], _arr(i).tolist())


def test_decode_is_refused_for_tar(local_store, make_worker):
    from cachefs.client.datasets.shards import write_tar_shards
    write_tar_shards([("a/0", {"x": b"1"})], f"{local_store.mount.url}/tar")
    opts = {"workers": make_worker(local_store.mount, page_size=PAGE).address}
    with pytest.raises(ValueError, match="decode=True decodes MDS and LitData"):
        CacheIterableDataset.from_prefix("cachefs://data/tar", storage_options=opts, decode=True)


@pytest.mark.parametrize("name", ["mds", "litdata"])
def test_resume_mid_epoch_yields_exactly_the_rest(foreign, name):
    opts, _ = foreign
    make = lambda: CacheIterableDataset.from_prefix(f"cachefs://data/{name}", storage_options=opts,  # noqa: E731
                                                     batch_size=3, rank=0, world_size=1, seed=5)
    ds = make()
    ds.set_epoch(1)
    first, state = [], None
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=_as_list, timeout=TIMEOUT,
                        multiprocessing_context="fork")
    for k, batch in enumerate(ds.track(loader)):
        first.extend(s["__index__"] for s in batch)
        if k == 3:
            state = ds.state_dict()
            break
    assert state["samples_seen"] == 12
    again = make()
    again.load_state_dict(state)
    rest = [s["__index__"] for s in _read(again, 2)]
    assert sorted(first + rest) == list(range(N[name]))


# -- refused, precisely ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,words", [("mds_zstd", r"shard shard\.00000\.mds is compressed \(zstd\)"),
                                        ("litdata_zstd", r"chunk chunk-0-0\.bin and the rest are compressed \(zstd, batch level\)")])
def test_compressed_shards_are_refused(foreign, name, words):
    opts, _ = foreign
    with pytest.raises(ShardFormatError, match=f"data/{name}/index.json: {words}"):
        CacheIterableDataset.from_prefix(f"cachefs://data/{name}", storage_options=opts)


def test_litdata_arrow_footer_chunks_are_refused(foreign):
    opts, _ = foreign  # what litdata 0.2.7x writes for flat JSON-like rows: no pytree items
    with pytest.raises(ShardFormatError, match=r"data/litdata_arrow/chunk-0-\d\.bin: its rows are in LitData's "
                                               r"Arrow footer"):
        CacheIterableDataset.from_prefix("cachefs://data/litdata_arrow", storage_options=opts)


def test_a_truncated_shard_is_refused_naming_it(foreign):
    opts, change = foreign
    change("mds", "shard.00002.mds", lambda b: b[:-10])
    with pytest.raises(ShardFormatError, match=r"data/mds/shard\.00002\.mds: \d+ bytes, the index says \d+"):
        CacheIterableDataset.from_prefix("cachefs://data/mds", storage_options=opts)


def test_a_missing_shard_is_refused_naming_it(foreign, local_store):
    opts, _ = foreign
    local_store.delete("litdata/chunk-0-3.bin")
    with pytest.raises(ShardFormatError, match=r"shard chunk-0-3\.bin is not there"):
        CacheIterableDataset.from_index("cachefs://data/litdata/index.json", storage_options=opts)


def test_a_header_that_disagrees_with_the_index_is_refused(foreign):
    opts, change = foreign
    change("litdata", "chunk-0-1.bin", lambda b: struct.pack("<I", 6) + b[4:])
    with pytest.raises(ShardFormatError, match=r"chunk-0-1\.bin: its header says 6 samples, the index 5"):
        CacheIterableDataset.from_prefix("cachefs://data/litdata", storage_options=opts)


def test_a_shard_longer_than_its_offsets_say_is_refused(foreign):
    opts, change = foreign  # bytes appended and the index edited to match: the offsets say otherwise
    change("litdata", "chunk-0-1.bin", lambda b: struct.pack("<I", 5) + b[4:] + b"extra")
    change("litdata", "index.json", lambda b: b.replace(b'"chunk_bytes": 614', b'"chunk_bytes": 619'))
    with pytest.raises(ShardFormatError, match=r"chunk-0-1\.bin: its samples end at 614, the index says .* 619"):
        CacheIterableDataset.from_prefix("cachefs://data/litdata", storage_options=opts)


def test_a_sample_whose_column_sizes_disagree_fails_naming_it(foreign):
    opts, change = foreign

    def bad_prefix(b: bytes) -> bytes:  # sample 0's blob size (its first prefix) one too big
        first = struct.unpack_from("<I", b, 4)[0]
        return b[:first] + struct.pack("<I", struct.unpack_from("<I", b, first)[0] + 1) + b[first + 4:]
    change("mds", "shard.00000.mds", bad_prefix)
    ds = CacheIterableDataset.from_prefix("cachefs://data/mds", storage_options=opts, batch_size=4, shuffle=False,
                                          rank=0, world_size=1)
    with pytest.raises(SampleReadError, match=r"shard 'cachefs://data/mds/shard\.00000\.mds', sample 0: its "
                                              r"columns' sizes add up to \d+ bytes, the sample has \d+"):
        list(ds)


@pytest.mark.parametrize("doc,words", [
    ({"version": 2, "shards": [{"format": "mds", "raw_data": {"basename": "s.mds", "bytes": 10}, "samples": 1}]},
     "malformed mds index: KeyError: 'column_names'"),
    ({"version": 2, "shards": [{"format": "jsonl", "raw_data": {"basename": "s.jsonl", "bytes": 10}}]},
     "shard s.jsonl is 'jsonl'; only 'mds' shards are read"),
    ({"chunks": [{"filename": "c.bin", "chunk_size": 1, "chunk_bytes": 10}],
      "config": {"data_format": ["int"], "item_loader": "TokensLoader"}}, "chunks written by LitData's TokensLoader"),
    ({"shards": []}, "not a shard index this reads"),
])
def test_a_malformed_index_is_refused_naming_it(foreign, local_store, doc, words):
    opts, _ = foreign
    local_store.add("bad/index.json", json.dumps(doc).encode())
    with pytest.raises(ValueError, match=re.escape("data/bad/index.json: " + words)):
        CacheIterableDataset.from_prefix("cachefs://data/bad", storage_options=opts)


# -- the parts alone -------------------------------------------------------------------------------
def test_the_table_is_the_one_the_tar_builder_makes():
    from cachefs.client.datasets.foreign import SAMPLE, _table
    from cachefs.client.datasets.shardtable import TableBuilder

    rng = np.random.default_rng(4)
    shards = [(f"d\u00e9/s{k}.mds", n, 0) for k, n in enumerate([0, 1, 12, 130])]
    offsets = [np.cumsum(np.concatenate([[40], rng.integers(0, 90, n)])) for _, n, _ in shards]
    shards = [(name, n, int(o[-1])) for (name, n, _), o in zip(shards, offsets)]
    paths = [f"cachefs://data/{name}" for name, _, _ in shards]
    table = _table("mds", {"columns": ["a"]}, paths, shards, offsets)
    want = TableBuilder()
    for path, (name, n, size), o in zip(paths, shards, offsets):
        want.add_shard(path, size, [(f"{name}/{i}", [(SAMPLE, int(o[i]), int(o[i + 1] - o[i]))]) for i in range(n)])
    assert table == want.finish("mds") and table.meta == {"columns": ["a"]} and table.format == "mds"
    assert table.key(table.n_samples - 1) == "d\u00e9/s3.mds/129"


def test_flavour_and_leaf_keys():
    root = FOREIGN / "litdata" / "index.json"
    doc = json.loads(root.read_text())
    assert flavour(doc) == "litdata" and flavour(json.loads((FOREIGN / "mds" / "index.json").read_text())) == "mds"
    assert leaf_keys(doc["config"]["data_spec"], 6) == ["id", "name", "blob", "score", "arr", "mat"]
    leaf = {"type": None, "context": None, "children_spec": []}
    nested = [1, {"type": "builtins.dict", "context": json.dumps(["img", "labels"]), "children_spec": [
        leaf, {"type": "builtins.tuple", "context": "null", "children_spec": [leaf, leaf]}]}]
    assert leaf_keys(json.dumps(nested), 3) == ["img", "labels.0", "labels.1"]
    assert leaf_keys(json.dumps([1, leaf]), 1) == ["0"]
    with pytest.raises(ValueError, match="2 leaves for 3"):
        leaf_keys(json.dumps([1, {"type": "builtins.tuple", "context": "null", "children_spec": [leaf, leaf]}]), 3)


# -- manifests for the map data set ------------------------------------------------------------------
@pytest.fixture
def files(local_store, make_worker):
    names = [f"train/{i:05d}.bin" for i in (3, 1, 4, 0, 2)]
    for k, name in enumerate(names):
        local_store.add(name, f"sample {name}|".encode() + bytes(range(k * 40 % 256)) * (k + 1))
    opts = {"workers": make_worker(local_store.mount, page_size=PAGE).address}
    return local_store, opts, [f"cachefs://data/{n}" for n in names]


def _parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(columns), str(path), row_group_size=2)  # several row groups


def test_every_manifest_format_gives_the_same_dataset(files, tmp_path):
    from cachefs.client.datasets.dataset import CacheDataset

    store, opts, paths = files
    sizes = [len(store.objects[p[15:]]) for p in paths]
    made = {
        "list.json": json.dumps(paths),
        "sized.json": json.dumps([{"path": p, "size": s} for p, s in zip(paths, sizes)]),
        "objects.jsonl": "\n".join(json.dumps({"path": p, "size": s}) for p, s in zip(paths, sizes)) + "\n",
        "mixed.jsonl": "# sizes of some\n" + "\n".join(json.dumps({"path": p, "size": s} if k % 2 else p)
                                                        for k, (p, s) in enumerate(zip(paths, sizes))),
        "lines.txt": "# a manifest\n\n" + "\r\n".join(paths) + "\n\n",
    }
    for name, text in made.items():
        (tmp_path / name).write_text(text)
    _parquet(tmp_path / "sized.parquet", {"path": paths, "size": sizes})
    _parquet(tmp_path / "paths.parquet", {"path": paths, "other": list(range(len(paths)))})
    for name in [*made, "sized.parquet", "paths.parquet"]:
        ds = CacheDataset.from_manifest(str(tmp_path / name), storage_options=opts, shuffle=False)
        assert ds.paths == paths and ds.sizes.tolist() == sizes, name
        loader = DataLoader(ds, batch_size=None, sampler=ds.sampler(), num_workers=2, timeout=TIMEOUT,
                            multiprocessing_context="fork")
        assert [bytes(t.numpy()) for t in loader] == [store.objects[p[15:]] for p in paths], name


def test_a_cachefs_manifest_may_name_paths_relative_to_it(files):
    from cachefs.client.datasets.dataset import CacheDataset

    store, opts, paths = files
    store.add("lists/m.txt", "\n".join("../train/" + p.rsplit("/", 1)[1] for p in paths).encode())
    store.add("train/m.jsonl", "\n".join(json.dumps("./" + p.rsplit("/", 1)[1]) for p in paths).encode())
    for url in ("cachefs://data/lists/m.txt", "cachefs://data/train/m.jsonl"):
        ds = CacheDataset.from_manifest(url, storage_options=opts, shuffle=False)
        assert ds.paths == paths and bytes(ds[1].numpy()) == store.objects["train/00001.bin"]


def test_manifest_errors_name_the_line(files, tmp_path, monkeypatch):
    from cachefs.client.datasets.dataset import CacheDataset

    _, opts, paths = files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"path": paths[0]}) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2: not JSON"):
        CacheDataset.from_manifest(str(bad), storage_options=opts)
    bad.write_text(json.dumps({"name": paths[0]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1: neither a path nor an object with a \"path\""):
        CacheDataset.from_manifest(str(bad), storage_options=opts)
    rel = tmp_path / "rel.txt"
    rel.write_text("./a.bin\n")
    with pytest.raises(ValueError, match=r"rel\.txt line 1: './a.bin' is relative to the manifest, which is not"):
        CacheDataset.from_manifest(str(rel), storage_options=opts)
    _parquet(tmp_path / "nopath.parquet", {"name": paths})
    with pytest.raises(ValueError, match=r"nopath\.parquet: a Parquet manifest needs a 'path' column"):
        CacheDataset.from_manifest(str(tmp_path / "nopath.parquet"), storage_options=opts)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match=r"needs pyarrow \(pip install 'cachefs\[parquet\]'\)"):
        CacheDataset.from_manifest(str(tmp_path / "nopath.parquet"), storage_options=opts)
