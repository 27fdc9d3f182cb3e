"""The tar-shard index as one read-only buffer (client/datasets/shardtable.py), kept in binary form
(client/datasets/indexcache.py), and CacheIterableDataset over it with DataLoader workers."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle

import pytest
from torch.utils.data import DataLoader

from cachefs.client.datasets import iterable as iterable_module
from cachefs.client.datasets import sampleindex
from cachefs.client.datasets.indexcache import IndexCache
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.datasets.shards import SampleSpan, ShardIndex, index_from_json, index_to_json, write_tar_shards
from cachefs.client.datasets.shardtable import ShardTable, ShardTableError, TableBuilder, table_from_json
from helpers import payload, wait_for

PAGE = 64 << 10
TIMEOUT = 60


def _shards() -> list[ShardIndex]:
    out = [ShardIndex(f"cachefs://m/d/s{k}.tar", 100_000 + k,
                      tuple(SampleSpan(f"d/{k}_{i}", (("jpg", 512 + 2048 * i, 100 + i), ("cls", 1536 + 2048 * i, 3)))
                            for i in range(7)))
           for k in range(3)]
    # fields out of file order, an empty sample, a non-ASCII key, a shard of no samples
    out.append(ShardIndex("/abs/x.tar", 5000, (SampleSpan("zä", (("b", 900, 10), ("a", 100, 5))), SampleSpan("e", ()))))
    out.append(ShardIndex("cachefs://m/d/empty.tar", 1024, ()))
    return out


def test_a_table_reads_as_the_shards_it_was_made_from():
    shards = _shards()
    table = ShardTable.from_shards(shards)
    assert table == shards and [len(s) for s in table] == [len(s) for s in shards]
    assert table[3].samples[0] == shards[3].samples[0] and table[3].samples[1].fields == ()
    assert table.lo is not None  # spans kept: one sample's fields are not in file order
    lo, hi = table.bounds([0, 21, 22])
    assert lo.tolist() == [512, 100, 0] and hi.tolist() == [1539, 910, 0]
    assert table.units()[21] == ("/abs/x.tar", 100, 810)
    ordered = ShardTable.from_shards(shards[:3])
    assert ordered.lo is None and ordered.off.dtype.itemsize == 4  # spans follow from the fields
    assert ordered.bounds([8])[0].tolist() == [512 + 2048]
    # index.json as before, in and out
    assert index_from_json(index_to_json(table, "cachefs://m/d"), "cachefs://m/d")[1] == shards
    assert table_from_json(index_to_json(shards, "cachefs://m/d"), "cachefs://m/d") == shards


def test_offsets_past_4_gib_are_kept_as_int64():
    big = [ShardIndex("s.tar", 10 << 30, (SampleSpan("a", (("x", 5 << 30, 7),)),))]
    table = ShardTable.from_shards(big)
    assert table.off.dtype.itemsize == 8 and table == big


def test_the_kept_index_round_trips_in_binary_form(tmp_path):
    shards = _shards()
    kept = IndexCache(str(tmp_path))
    assert kept.save("k", shards, "tar")
    assert os.listdir(tmp_path) == ["k.shards"]
    with open(tmp_path / "k.shards", "rb") as f:
        assert f.read(8) == b"CFSSHD01"  # not JSON
    again = kept.load("k")
    assert isinstance(again, ShardTable) and again.path.endswith("k.shards") and again._fd >= 0
    assert again == shards and again.format == "tar"


def test_an_old_json_kept_index_is_read_and_kept_again_as_a_table(tmp_path):
    shards = _shards()
    (tmp_path / "k.json").write_text(index_to_json(shards))
    got = IndexCache(str(tmp_path)).load("k")
    assert got == shards
    assert os.listdir(tmp_path) == ["k.shards"]
    assert IndexCache(str(tmp_path)).load("k") == shards


@pytest.mark.parametrize("damage", ["truncate", "magic", "header", "counts"])
def test_a_damaged_kept_index_is_refused_with_what_is_wrong(tmp_path, caplog, damage):
    kept = IndexCache(str(tmp_path))
    kept.save("k", _shards(), "tar")
    path = tmp_path / "k.shards"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-40]
        want = r"truncated: section 'keys' needs bytes \d+-\d+, the file has \d+"
    elif damage == "magic":
        data[:8] = b"CFSIDX01"
        want = "not a cachefs shard table"
    elif damage == "header":
        data[20:24] = b"\xff\xff\xff\xff"
        want = "damaged header"
    else:  # the last shard's sample count: the counts no longer add up
        text = bytes(data[16:16 + int.from_bytes(data[8:16], "little")])
        at = int(__import__("json").loads(text)["sections"]["shard_at"][2])
        data[at + 8 * 5:at + 8 * 6] = (999).to_bytes(8, "little")
        want = "shard sample counts do not add up"
    path.write_bytes(bytes(data))
    with pytest.raises(ShardTableError, match=want):
        ShardTable.open(str(path))
    with caplog.at_level(logging.WARNING):
        assert kept.load("k") is None  # the caller scans again
    assert "scanned again" in caplog.text and not path.exists()


def test_memory_per_sample_is_bounded_at_200k_samples():
    n, per = 200_000, 10_000
    builder = TableBuilder()
    for k in range(n // per):
        builder.add_shard(f"cachefs://data/shards/shard-{k:06d}.tar", per * 112_640,
                          ((f"{k * per + i:09d}", (("jpg", 512 + 112_640 * i, 110_000), ("cls", 111_104 + 112_640 * i, 3)))
                           for i in range(per)))
    table = builder.finish()
    assert table.nbytes / n <= 40 and table._fd >= 0  # ~35 bytes a sample, in a sealed memfd
    gc.collect()
    before = len(gc.get_objects())
    ds = CacheIterableDataset(table, storage_options={"workers": "127.0.0.1:9", "bootstrap": None}, batch_size=256,
                              rank=0, world_size=2, plan_ahead=False, stats=False, hint_shards=0)
    ds.set_epoch(1)
    assert len(ds) == n // 2 and sum(len(b) for b in [ds.plan.block_samples(0)]) == 256
    gc.collect()
    assert len(gc.get_objects()) - before < 2_000  # no object per sample (a ShardIndex's were ~4)
    blob = pickle.dumps(ds)  # what a spawned DataLoader worker gets: the table mapped, no order array
    assert len(blob) < 64 << 10, len(blob)
    clone = pickle.loads(blob)
    assert clone._shards._fd >= 0 and clone._shards[19] == table[19]
    assert clone.plan.block_samples(7).tolist() == ds.plan.block_samples(7).tolist()


# -- real DataLoaders over a real worker ---------------------------------------------------------------
def _samples(n: int):
    for i in range(n):
        yield f"train/{i:05d}", {"cls": str(i).encode(), "bin": payload(2000 + 37 * (i % 11), i)}


def _as_list(batch):
    return batch


def _read(ds, workers: int, context: str | None = None) -> list[tuple[str, bytes, bytes]]:
    loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=_as_list, timeout=TIMEOUT if workers else 0,
                        multiprocessing_context=multiprocessing.get_context(context) if context else None)
    return sorted((s["__key__"], bytes(s["cls"].numpy()), bytes(s["bin"].numpy())) for b in ds.track(loader) for s in b)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_the_samples_through_the_shared_table(local_store, make_worker, monkeypatch, context):
    monkeypatch.setattr(sampleindex, "SMALL_BYTES", 0)  # shared memory even at this size: the path under test
    write_tar_shards(_samples(60), f"{local_store.mount.url}/shards", shard_bytes=30_000)
    opts = {"workers": make_worker(local_store.mount, page_size=PAGE).address}
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4, rank=0,
                                          world_size=1, seed=3)
    assert isinstance(ds.shards, ShardTable) and ds.shards._fd >= 0
    assert len(pickle.dumps(ds.shards)) < 200  # a reference to the memfd, not the index
    want = sorted((k, f["cls"], f["bin"]) for k, f in _samples(60))
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        got = _read(ds, 2, context)
        assert got == want, (epoch, len(got))
    ds.set_epoch(2)
    assert _read(ds, 0) == want


def test_a_truncated_kept_index_is_scanned_again(local_store, make_worker, tmp_path, monkeypatch):
    write_tar_shards(_samples(30), f"{local_store.mount.url}/shards", shard_bytes=20_000)
    os.remove(os.path.join(local_store.mount.url, "shards", "index.json"))
    opts = {"workers": make_worker(local_store.mount, page_size=PAGE).address}
    kept = str(tmp_path / "kept")
    scans: list[str] = []
    real = iterable_module._ShardIndexer.__call__

    def counting(self, path, size):
        scans.append(path)
        return real(self, path, size)
    monkeypatch.setattr(iterable_module._ShardIndexer, "__call__", counting)

    def make():
        return CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                                index_cache=kept, rank=0, world_size=1)
    want = sorted((k, f["cls"], f["bin"]) for k, f in _samples(30))
    first = make()
    assert _read(first, 0) == want
    n = len(scans)
    files = lambda: [f for f in os.listdir(kept) if f.endswith(".shards")]  # noqa: E731
    assert n >= 2 and wait_for(lambda: len(files()) == 1, timeout=30)
    assert isinstance(make()._shards, ShardTable) and len(scans) == n  # mapped, not scanned
    path = os.path.join(kept, files()[0])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    again = make()  # refused, scanned again on the way, and kept whole again
    assert _read(again, 0) == want and len(scans) == 2 * n

    def whole() -> bool:
        try:
            return ShardTable.open(os.path.join(kept, files()[0])) == first.shards
        except (IndexError, OSError, ShardTableError):
            return False
    assert wait_for(whole, timeout=30)


def test_shards_indexed_on_the_way_are_held_compact(tmp_path, monkeypatch):
    from cachefs.client.datasets.shardscan import ShardScan
    from cachefs.client.datasets.shardtable import ShardView
    monkeypatch.setattr(sampleindex, "SMALL_BYTES", 0)  # even so: a shard's own table is private memory
    shards = {s.path: s for s in _shards()}
    scan = ShardScan([(p, s.size) for p, s in shards.items()], lambda path, size: shards[path], str(tmp_path)).start()
    known = scan.wait_all(30)
    assert known == list(shards.values())
    assert all(isinstance(s, ShardView) and s.table._fd < 0 for s in known)  # no object per sample, no memfd each
    other = pickle.loads(pickle.dumps(scan))  # another process: reads the per-shard files
    other._owner, other._known, other._prefix, other._samples = False, [None] * len(known), 0, 0
    got = other.wait_all(30)
    assert got == known and all(isinstance(s, ShardView) and s.table._fd < 0 for s in got)
