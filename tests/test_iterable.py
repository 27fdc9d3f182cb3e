"""CacheIterableDataset over tar shards: the index, the block plan, real DataLoaders over a real worker."""

from __future__ import annotations

import os

import io
import tarfile
import time
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachefs.client.datasets.iterable import CacheIterableDataset, scan_shards
from cachefs.client.datasets.dataset import SampleReadError
from cachefs.client.datasets.sampling import BlockPlan
from cachefs.client.datasets.shards import (SampleSpan, ShardFormatError, TarFormat, group_members, index_from_json,
                                   index_to_json, split_key, write_tar_shards)
import grpc

from cachefs.proto import worker_pb2, worker_pb2_grpc
from helpers import payload, wait_for

PAGE = 64 << 10
TIMEOUT = 60


def _samples(n: int, size=lambda i: 3000 + 101 * (i % 17)):
    for i in range(n):
        yield f"train/{i:05d}", {"cls": str(i).encode(), "bin": payload(size(i), i)}


def _as_list(batch):
    return batch


def _ids(batches) -> list[int]:
    return [int(bytes(s["cls"].numpy())) for batch in batches for s in batch]


@pytest.fixture
def sharded(local_store, make_worker):
    """``n`` samples written as tar shards of ~``shard_bytes`` into the store, served by one worker."""
    def make(n: int, shard_bytes: int = 40_000, **kw):
        root = local_store.mount.url
        shards = write_tar_shards(_samples(n, **kw), f"{root}/shards", shard_bytes=shard_bytes)
        worker = make_worker(local_store.mount, page_size=PAGE)
        return shards, {"workers": worker.address}
    return make


# -- the format and the index ------------------------------------------------------------------------
def test_split_key_follows_the_webdataset_convention():
    assert split_key("train/0001.jpg") == ("train/0001", "jpg")
    assert split_key("a.b/0001.seg.png") == ("a.b/0001", "seg.png")
    assert split_key("noext") == ("noext", "")


def _tar(members: list[tuple[str, bytes]], fmt=tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        tar.addfile(_dir("somedir"))
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_scan_finds_every_member_at_its_offset(fmt):
    long = "d/" + "x" * 90 + "/" + "y" * 60 + "/0007"  # > 100 bytes: GNU long name / pax / ustar prefix
    members = [(f"k/{i:03d}.{ext}", payload(700 + i * 13, i)) for i in range(5) for ext in ("a", "b")]
    members.append((long + ".txt", b"long one"))
    data = _tar(members, fmt)
    found = list(TarFormat(window=1024).members(lambda off, n: data[off:off + n], len(data)))
    assert [name for name, _, _ in found] == [name for name, _ in members]
    for (name, off, size), (_, want) in zip(found, members):
        assert data[off:off + size] == want
    samples = group_members(found)
    assert [s.key for s in samples] == [f"k/{i:03d}" for i in range(5)] + [long]
    assert [f[0] for f in samples[0].fields] == ["a", "b"]


def test_tar_scan_refuses_a_corrupt_or_truncated_shard():
    data = bytearray(_tar([("k/1.a", b"x" * 2000)]))
    with pytest.raises(ShardFormatError, match="truncated|past the end"):
        list(TarFormat().members(lambda off, n: bytes(data[off:off + n]), 512 * 3))
    data[512 + 10] ^= 0xFF  # the member's header, not the directory's
    with pytest.raises(ShardFormatError, match="checksum"):
        list(TarFormat().members(lambda off, n: bytes(data[off:off + n]), len(data)))


def test_index_round_trips_with_relative_paths(tmp_path):
    shards = write_tar_shards(_samples(30), str(tmp_path / "ds"), shard_bytes=20_000)
    assert len(shards) > 2
    text = (tmp_path / "ds" / "index.json").read_text()
    assert str(tmp_path) not in text  # relative: the dataset can move
    fmt, again = index_from_json(text, base="cachefs://m/ds")
    assert fmt == "tar" and [s.path.rsplit("/", 1)[-1] for s in again] == [s.path.rsplit("/", 1)[-1] for s in shards]
    assert again[0].path.startswith("cachefs://m/ds/") and again[1].samples == shards[1].samples
    assert index_from_json(index_to_json(again, "cachefs://m/ds"), "cachefs://m/ds")[1] == again
    for shard in shards:  # the writer's offsets agree with a scan of the bytes it wrote
        data = open(shard.path, "rb").read()
        assert tuple(TarFormat().scan(lambda off, n: data[off:off + n], len(data))) == shard.samples


# -- the block plan ----------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [(10, 7, 13), (5,), (3, 3, 3, 3), (1, 0, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_block_plan_deals_every_sample_with_equal_counts(counts, drop_last, workers):
    n, ws, block = sum(counts), 2, 4
    plans = [BlockPlan(counts, block, r, ws, seed=3, epoch=1, drop_last=drop_last) for r in range(ws)]
    assert len({len(p) for p in plans}) == 1  # no DDP hang
    got = Counter()
    for p in plans:
        per_worker = [[int(s) for j in p.worker_blocks(w, workers) for s in p.block_samples(j)]
                      for w in range(workers)]
        assert sum(map(len, per_worker)) == len(p)
        got.update(s for part in per_worker for s in part)
    if drop_last:
        assert all(c == 1 for c in got.values()) and sum(got.values()) == n // ws * ws
    else:
        assert set(got) == set(range(n)) and sum(got.values()) - n == (-n) % ws


def test_block_plan_keeps_shards_together_and_varies_by_epoch():
    counts = (8, 8, 8, 8)
    plan = BlockPlan(counts, 8, 0, 1, seed=1, epoch=0)
    shard_of = lambda s: int(s) // 8  # noqa: E731
    for j in range(plan.n_blocks):  # a block is one shard: one range read
        assert len({shard_of(s) for s in plan.block_samples(j)}) == 1
    order = lambda e: [int(s) for j in range(4) for s in BlockPlan(counts, 8, 0, 1, 1, e).block_samples(j)]  # noqa
    assert order(0) == order(0) and order(0) != order(1)
    assert BlockPlan(counts, 8, 0, 1, shuffle=False).order.tolist() == list(range(32))


def test_block_plan_resume_with_another_world_size_deals_exactly_the_rest():
    counts = (9, 11, 6, 14)
    old = [BlockPlan(counts, 4, r, 2, seed=2, epoch=3) for r in range(2)]
    seen = 8  # two blocks each, in lock-step
    consumed = [int(s) for p in old for j in range(2) for s in p.block_samples(j)]
    new = [BlockPlan.resume(old[0].state(seen), counts=counts, block=4, rank=r, world_size=3, shuffle=True,
                            drop_last=False) for r in range(3)]
    rest = [int(s) for p, s0 in new for j in range(p.n_blocks) for s in p.block_samples(j)]
    assert all(s0 == 0 for _, s0 in new) and len({len(p) for p, _ in new}) == 1
    assert len(consumed) == 16 and not set(consumed) & set(rest)
    assert set(consumed) | set(rest) == set(range(40))
    assert len(rest) - len(set(rest)) == (-(40 - 16)) % 3  # only the new padding repeats
    with pytest.raises(ValueError, match="batch boundary"):
        BlockPlan.resume(old[0].state(5), counts=counts, block=4, rank=0, world_size=3, shuffle=True, drop_last=False)


# -- real DataLoaders over a real worker ---------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_sample_once_across_ranks_and_workers(sharded, num_workers):
    shards, opts = sharded(64)
    seen = Counter()
    counts = []
    for rank in range(2):
        ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                              rank=rank, world_size=2, seed=7)
        loader = DataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=_as_list,
                            timeout=TIMEOUT if num_workers else 0)
        ids = _ids(ds.track(loader))
        counts.append(len(ids))
        assert ds.samples_seen == len(ids) == len(ds.plan)
        seen.update(ids)
    assert counts == [32, 32] and sorted(seen) == list(range(64)) and set(seen.values()) == {1}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_dataloader_workers_read_each_epochs_own_order(sharded, context):
    """persistent_workers=True: the workers keep the dataset copy they started with; each epoch
    set in the main process reaches them (the board, epochboard.py), so an epoch reads what a fresh
    loader reads in it, and ``track`` counts it as usual."""
    import multiprocessing
    _shards, opts = sharded(48)

    def loader(ds, persistent):
        return DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_as_list, timeout=TIMEOUT,
                          persistent_workers=persistent, multiprocessing_context=multiprocessing.get_context(context))

    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4, seed=9)
    fresh = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4, seed=9)
    kept = loader(ds, True)
    seen = []
    for epoch in (0, 1, 3):
        ds.set_epoch(epoch)
        fresh.set_epoch(epoch)
        got = _ids(ds.track(kept))
        assert got == _ids(loader(fresh, False)), epoch
        assert sorted(got) == list(range(48)) and ds.samples_seen == 48
        seen.append(got)
    assert len({tuple(s) for s in seen}) == 3


def _board_reads(board, out) -> None:
    out.put((board.read(), _board_refuses(board)))


def _board_refuses(board) -> bool:
    try:
        board.post({"epoch": 99})
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_epoch_board_is_written_here_and_read_in_a_child(context):
    import multiprocessing
    import pickle
    from cachefs.client.datasets.epochboard import SIZE, EpochBoard
    board = EpochBoard()
    assert board.read() == (0, {})
    assert board.post({"epoch": 4}) == 1 and board.post({"state": {"epoch": 5, "seed": 2}}) == 2
    ctx = multiprocessing.get_context(context)
    out = ctx.Queue()
    child = ctx.Process(target=_board_reads, args=(pickle.loads(pickle.dumps(board)), out))
    child.start()
    try:
        assert out.get(timeout=TIMEOUT) == ((2, {"state": {"epoch": 5, "seed": 2}}), True)
    finally:
        child.join(TIMEOUT)
    with pytest.raises(ValueError, match="holds"):
        board.post({"x": "y" * SIZE})
    assert board.read() == (2, {"state": {"epoch": 5, "seed": 2}})  # a refused post leaves the last one


def test_fields_are_the_bytes_written_as_aligned_tensors(sharded):
    shards, opts = sharded(20)
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=3,
                                          rank=0, world_size=1)
    wanted = dict(_samples(20))
    got = list(ds)
    assert len(got) == 20
    for s in got:
        fields = wanted[s["__key__"]]
        assert bytes(s["bin"].numpy()) == fields["bin"] and bytes(s["cls"].numpy()) == fields["cls"]
        assert s["bin"].dtype == torch.uint8 and s["bin"].data_ptr() % 64 == 0
        s["bin"][0] = 1  # writable
    assert ds.prefetcher.stats["hits"] > 0


def test_run_buffers_are_reused_only_once_no_sample_refers_to_them(sharded):
    """Blocks are read into a few reused buffers (client/datasets/runbuffers.py): samples dropped as they
    are consumed free theirs for the next blocks; samples kept keep their bytes, whatever is
    read after them."""
    shards, opts = sharded(60)
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, prefetch_blocks=2)
    wanted = dict(_samples(60))
    for _ in range(2):  # consumed one at a time, as a DataLoader does
        n = 0
        for s in ds:
            assert bytes(s["bin"].numpy()) == wanted[s["__key__"]]["bin"]
            n += 1
        assert n == 60
    pool = ds._local.get().buffers
    assert pool.stats["reused"] > 0 and pool.nbytes <= pool.max_bytes
    kept = list(ds)  # all of an epoch kept alive, then another epoch read over the pool
    for s in ds:
        s["bin"][:] = 0  # scribble on what the pool hands out: never on a kept sample
    for s in kept:
        assert bytes(s["bin"].numpy()) == wanted[s["__key__"]]["bin"]


def test_run_buffer_pool_counts_views_and_keeps_to_its_bound():
    from cachefs.client.datasets.runbuffers import RunBuffers

    pool = RunBuffers(max_bytes=3 << 20)
    a = pool.take(1000)
    field = a[10:20]
    del a
    b = pool.take(1000)  # the first buffer still has a view alive: a second one
    assert pool.stats == {"reused": 0, "new": 2, "unpooled": 0, "shared": 0}
    assert b.data_ptr() % 64 == 0 and len(b) == 1000
    del field
    c = pool.take((1 << 20) - 5)  # the first buffer is free again
    assert pool.stats["reused"] == 1 and pool.nbytes == 2 << 20
    d = pool.take(1 << 20)
    e = pool.take(5)  # past the bound: a fresh tensor, not kept
    assert pool.stats["new"] == 3 and pool.stats["unpooled"] == 1 and pool.nbytes == 3 << 20
    assert len({t.data_ptr() for t in (b, c, d, e)}) == 4
    b.share_memory_()  # another process may read it now: out of the pool, room for a new one
    del b, c, d, e
    f = pool.take(100)
    assert pool.stats["shared"] == 1 and pool.stats["reused"] == 2 and pool.nbytes == 2 << 20
    del f
    with pytest.raises(ValueError):
        RunBuffers(max_bytes=-1)


def test_a_cached_epoch_is_read_in_the_calling_thread_and_anything_else_ahead(sharded, monkeypatch):
    """Workers 0: blocks whose pages are all on this host are read in the training process's own
    thread, with no prefetch thread and no hint; a block that is not (a cold epoch, a shard
    freed since) sends the rest of the epoch back to the prefetch threads; so does a block
    read as slowly as a disk reads. Every sample right, every way."""
    import cachefs.client.datasets.iterable as iterable_module

    shards, opts = sharded(60, shard_bytes=30_000)
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, prefetch_blocks=2)
    wanted = dict(_samples(60))
    # A loaded machine (CI with a core kept busy) may take more than the 2 ms allowed for a
    # tiny block: no read counts as slow until the end of the test asks for it.
    monkeypatch.setattr(iterable_module, "HERE_SLACK_NS", 60_000_000_000)

    def epoch() -> int:
        n = 0
        for s in ds:
            assert bytes(s["bin"].numpy()) == wanted[s["__key__"]]["bin"]
            n += 1
        return n

    assert epoch() == 60  # cold: through the prefetch threads
    stats = ds.prefetcher.stats
    paths = [sh.path.split("cachefs://", 1)[1] for sh in ds.shards]
    with grpc.insecure_channel(opts["workers"]) as ch:  # every page written and vouched for
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert wait_for(lambda: list(stub.GetCached(worker_pb2.GetCachedRequest(paths=paths), timeout=TIMEOUT)
                                     .cached_bytes) == [sh.size for sh in ds.shards], timeout=TIMEOUT)
    cold = stats["submitted"] + stats["on_demand"]
    assert cold > 0
    hints = ds.hinter.stats["sent"]
    assert epoch() == 60  # cached: every block here
    assert stats["submitted"] + stats["on_demand"] == cold and ds.hinter.stats["sent"] == hints

    worker = opts["workers"]
    with grpc.insecure_channel(worker) as ch:  # one shard's pages leave the cache
        freed = worker_pb2_grpc.WorkerServiceStub(ch).Free(
            worker_pb2.FreeRequest(prefix=ds.shards[-1].path.split("cachefs://", 1)[1]), timeout=TIMEOUT)
    assert freed.pages_freed > 0
    assert epoch() == 60
    assert stats["submitted"] + stats["on_demand"] > cold

    assert epoch() == 60  # all cached again
    before = stats["submitted"] + stats["on_demand"]
    monkeypatch.setattr(iterable_module, "HERE_SLACK_NS", 0)  # any read looks slow
    monkeypatch.setattr(iterable_module, "HERE_MIN_BYTES_PER_NS", 1e9)
    assert epoch() == 60
    assert stats["submitted"] + stats["on_demand"] > before


def test_uneven_count_gives_equal_ranks_and_a_seeded_order(sharded):
    shards, opts = sharded(45)

    def run(rank, epoch, seed=1):
        ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                              rank=rank, world_size=2, seed=seed)
        ds.set_epoch(epoch)
        return _ids(DataLoader(ds, batch_size=4, num_workers=0, collate_fn=_as_list))

    r0, r1 = run(0, 0), run(1, 0)
    assert len(r0) == len(r1) == 23 and set(r0) | set(r1) == set(range(45))
    assert run(0, 0) == r0 and run(0, 1) != r0 and run(0, 0, seed=2) != r0


@pytest.mark.parametrize("workers_before,workers_after", [(2, 2), (2, 0), (0, 2)])
def test_resume_mid_epoch_yields_exactly_the_rest(sharded, workers_before, workers_after):
    shards, opts = sharded(50)
    make = lambda: CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts,  # noqa
                                                     batch_size=4, rank=0, world_size=1, seed=5)
    ds = make()
    ds.set_epoch(2)
    first, state = [], None
    loader = DataLoader(ds, batch_size=4, num_workers=workers_before, collate_fn=_as_list,
                        timeout=TIMEOUT if workers_before else 0)
    for k, batch in enumerate(ds.track(loader)):
        first.extend(int(bytes(s["cls"].numpy())) for s in batch)
        if k == 4:
            state = ds.state_dict()
            break
    assert state["samples_seen"] == 20
    again = make()
    again.load_state_dict(state)
    loader = DataLoader(again, batch_size=4, num_workers=workers_after, collate_fn=_as_list,
                        timeout=TIMEOUT if workers_after else 0)
    rest = _ids(again.track(loader))
    assert sorted(first + rest) == list(range(50)) and len(first + rest) == 50
    assert again.samples_seen == len(again.plan)


def test_resume_with_another_world_size(sharded):
    shards, opts = sharded(40)
    make = lambda r, ws: CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts,  # noqa
                                                          batch_size=4, rank=r, world_size=ws, seed=9)
    consumed = []
    for rank in range(2):
        ds = make(rank, 2)
        for k, batch in enumerate(ds.track(DataLoader(ds, batch_size=4, collate_fn=_as_list))):
            consumed.extend(int(bytes(s["cls"].numpy())) for s in batch)
            if k == 1:
                state = ds.state_dict()
                break
    rest = []
    for rank in range(4):
        ds = make(rank, 4)
        ds.load_state_dict(state)
        rest.extend(_ids(DataLoader(ds, batch_size=4, collate_fn=_as_list)))
    assert set(consumed) | set(rest) == set(range(40)) and not set(consumed) & set(rest)


def test_prefetch_stays_within_its_byte_bound_with_mixed_sizes(sharded):
    sizes = lambda i: 50_000 if i % 9 == 0 else 1_000  # noqa: E731
    shards, opts = sharded(60, shard_bytes=120_000, size=sizes)
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=2,
                                          rank=0, world_size=1, prefetch_bytes=60_000, prefetch_blocks=8)
    assert len(list(ds)) == 60
    stats = ds.prefetcher.stats
    assert 0 < stats["max_in_flight_bytes"] <= 60_000 and stats["hits"] > 0


def test_a_missing_shard_names_it_without_a_hang(sharded, local_store):
    shards, opts = sharded(30)
    # No prefetch: the plan's would cache the shard before it is removed below, and it would be read.
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, shuffle=False, hint_shards=0)
    victim = shards[1].path
    import os
    os.remove(victim)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_as_list, timeout=TIMEOUT)
    started = time.monotonic()
    with pytest.raises(SampleReadError, match=victim.rsplit("/", 1)[-1]):
        list(loader)
    # The worker answers that it cannot be filled at all (FAILED): the DataLoader workers, which
    # keep to the short-circuit socket, raise it at once rather than ask again for their read's
    # whole budget (30 s by default).
    assert time.monotonic() - started < 7.5


def test_without_an_index_the_shards_are_scanned(sharded, local_store):
    shards, opts = sharded(25)
    import os
    os.remove(local_store.mount.url + "/shards/index.json")
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=5,
                                          rank=0, world_size=1)
    assert [len(s) for s in ds.shards] == [len(s) for s in shards]
    assert sorted(int(bytes(s["cls"].numpy())) for s in ds) == list(range(25))
    assert scan_shards([(s.path, s.size) for s in ds.shards], opts)[0].samples == shards[0].samples


def test_hints_bring_upcoming_shards_into_the_cache(sharded):
    shards, opts = sharded(80, shard_bytes=30_000)
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=2,
                                          rank=0, world_size=1, prefetch_blocks=2, hint_shards=2, shuffle=False,
                                          plan_ahead=False)  # with a plan the workers prefetch instead
    assert len(list(ds)) == 80
    stats = ds.hinter.stats
    assert stats["sent"] > 0 and stats["failed"] == 0


def test_a_hint_caches_a_shard_before_anyone_reads_it(sharded):
    shards, opts = sharded(40, shard_bytes=30_000)
    ds = CacheIterableDataset.from_index("cachefs://data/shards/index.json", storage_options=opts, batch_size=2,
                                         rank=0, world_size=1, plan_ahead=False)  # no plan-driven prefetch
    shards = ds.shards  # cachefs:// paths
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(opts["workers"]))
    path = lambda s: s.path.removeprefix("cachefs://")  # noqa: E731
    cached = lambda: stub.GetCached(worker_pb2.GetCachedRequest(paths=[path(s) for s in shards]),  # noqa
                                    timeout=10).cached_bytes
    assert list(cached()) == [0] * len(shards)
    assert ds.hinter.hint([shards[-1].path, shards[-2].path]) == 2
    assert wait_for(lambda: cached()[-1] == shards[-1].size and cached()[-2] == shards[-2].size)
    assert list(cached())[:-2] == [0] * (len(shards) - 2)
    assert ds.hinter.hint([shards[-1].path]) == 0  # once per epoch


def test_a_scanned_index_is_kept_and_used_until_a_shard_changes(sharded, local_store, make_worker, tmp_path,
                                                                 monkeypatch):
    """Shards without index.json are scanned once; the next start over the same shards (same
    paths, sizes and versions) reads the kept index, and a changed shard is scanned again."""
    import cachefs.client.datasets.iterable as iterable_module

    shards, opts = sharded(30)
    os.remove(os.path.join(local_store.mount.url, "shards", "index.json"))
    scans: list[str] = []  # shards indexed, one by one (on the way or all first: the same indexer)
    real_index = iterable_module._ShardIndexer.__call__

    def counting_index(self, path, size):
        scans.append(path)
        return real_index(self, path, size)

    monkeypatch.setattr(iterable_module._ShardIndexer, "__call__", counting_index)
    kept = str(tmp_path / "kept")

    def make(options=opts):
        return CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=options, batch_size=4,
                                                rank=0, world_size=1, index_cache=kept)

    def kept_indexes() -> list[str]:
        return [f for f in os.listdir(kept) if f.endswith(".shards")]

    first = make()
    assert len(first.shards) == len(shards)  # waits for the scan under way
    assert len(scans) == len(shards) and wait_for(lambda: len(kept_indexes()) == 1, timeout=30)
    again = make()
    assert len(scans) == len(shards)  # no second scan
    assert os.listdir(kept) == kept_indexes()  # the first scan's per-shard files are gone
    assert [s.samples for s in again.shards] == [s.samples for s in first.shards]
    assert sorted(int(bytes(s["cls"].numpy())) for s in again) == list(range(30))
    # One shard rewritten with other samples: a new version, so a new key and a new scan.
    last = os.path.join(local_store.mount.url, "shards", os.path.basename(shards[-1].path))
    n_last = len(shards[-1].samples)
    write_tar_shards(_samples(n_last + 2), str(tmp_path / "other"), shard_bytes=10 << 20)
    os.replace(str(tmp_path / "other" / "shard-000000.tar"), last)
    fresh = {"workers": make_worker(local_store.mount, page_size=PAGE).address}  # no metadata cached yet
    assert len(make(fresh).shards[-1].samples) == n_last + 2
    assert len(scans) == 2 * len(shards) and wait_for(lambda: len(kept_indexes()) == 2, timeout=30)
    # Keeping can be turned off (and then every shard is indexed before the dataset is made).
    make_off = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                                rank=0, world_size=1, index_cache="")
    assert len(make_off.shards) == len(shards)
