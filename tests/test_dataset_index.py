"""CacheDataset's sample index (#46): compact, shared with DataLoader workers, kept between starts.

Against a real in-process worker over a local mount; DataLoader workers are real processes,
forked and spawned.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import threading
import time
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachefs.client.datasets import prefixindex, sampleindex
from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.sampleindex import IndexBuilder, SampleIndex
from cachefs.server.worker import service
from helpers import client, payload

TIMEOUT = 120  # DataLoader timeout: a hang fails the test instead of stalling it


def _sample(i: int) -> bytes:
    head = f"s{i:05d}|".encode()
    return head + payload(40 + i % 50, i)


def _sample_id(t: torch.Tensor) -> int:
    return int(bytes(t[1:6].numpy()).decode())


def _as_list(batch):
    return batch


def _names(n: int) -> list[str]:
    # Nested and not in creation order, so the listing's order is the sort's doing.
    return [f"train/d{(i * 7) % 5}/{'x' if i % 3 else 'a'}{i:05d}.bin" for i in range(n)]


@pytest.fixture
def served(local_store, make_worker, monkeypatch):
    def make(n: int, page: int = 1000):
        monkeypatch.setattr(service, "LIST_BATCH", page)  # a listing in several pages
        for i, name in enumerate(_names(n)):
            local_store.add(name, _sample(i))
        worker = make_worker(local_store.mount, page_size=64 << 10)
        return local_store, {"workers": worker.address}
    return make


def _plain_listing(opts) -> list[tuple[str, int]]:
    """What from_prefix was before #46: every file of fs.find, sorted by name."""
    fs = client(opts["workers"])
    try:
        found = fs.find("cachefs://data/train", detail=True)
    finally:
        fs.close()
    return sorted((f"cachefs://{n}", int(i["size"])) for n, i in found.items() if i["type"] == "file")


def test_from_prefix_is_the_sorted_listing_held_as_one_index(served):
    store, opts = served(3000, page=700)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, shuffle=False, plan_ahead=False)
    expected = _plain_listing(opts)
    assert len(expected) == 3000
    assert isinstance(ds.paths, SampleIndex)  # no list of str, no dict per entry
    assert list(ds.paths) == [p for p, _ in expected] and ds.paths == [p for p, _ in expected]
    assert ds.sizes.tolist() == [s for _, s in expected] and ds.sizes.dtype == np.int64
    assert ds.paths[-1] == expected[-1][0] and ds.paths[1:3] == [expected[1][0], expected[2][0]]
    for i in (0, 1234, 2999):
        assert bytes(ds.read(i).numpy()) == store.objects[expected[i][0][len("cachefs://data/"):]]
    with pytest.raises(FileNotFoundError):
        CacheDataset.from_prefix("cachefs://data/nothing", storage_options=opts)
    with pytest.raises(ValueError):
        CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, kept_index="sometimes")


def test_builder_sorts_and_drops_duplicates_like_a_dict_of_a_listing():
    b = IndexBuilder()
    for p, s in [("cachefs://b/x", 1), ("cachefs://a/y", 2), ("cachefs://a/y", 3), ("cachefs://ä", 4), ("other", 5)]:
        b.add(p, s)
    ix = b.finish(sort=True)
    assert list(ix) == sorted({"cachefs://b/x", "cachefs://a/y", "cachefs://ä", "other"})
    assert dict(zip(ix, ix.sizes.tolist()))["cachefs://a/y"] == 3
    assert pickle.loads(pickle.dumps(ix)) == ix and ix.head == ""


def test_a_batch_of_paths_is_the_paths_one_by_one_less_what_is_dropped():
    """``paths_of`` (a batch's paths for reads by name, one gather of their bounds) says what
    indexing does, with non-ASCII names and the head's first characters dropped."""
    b = IndexBuilder()
    for i in range(50):
        b.add(f"cachefs://data/train/{i % 7}/é{i:03d}.bin", i + 1)
    ix = b.finish(sort=True)
    assert ix.head.startswith("cachefs://data/")
    samples = [49, 0, 7, 7, 23]
    assert ix.paths_of(samples) == [ix[s] for s in samples]
    assert ix.paths_of(samples, drop=len("cachefs://")) == [ix[s][len("cachefs://"):] for s in samples]
    assert ix.paths_of([]) == []


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_every_sample_once(served, monkeypatch, context):
    monkeypatch.setattr(sampleindex, "SMALL_BYTES", 0)  # shared memory even at this size: the path under test
    store, opts = served(300)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, seed=5, plan_ahead=False)
    assert ds.paths._fd >= 0  # a sealed memfd, which a spawned worker maps
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=8, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                            multiprocessing_context=multiprocessing.get_context(context), timeout=TIMEOUT)
        got = Counter(_sample_id(t) for batch in ds.track(loader) for t in batch)
        assert got == Counter(range(300)), epoch


@pytest.mark.parametrize("context,sampler", [("fork", "cachefs"), ("spawn", "cachefs"), ("fork", "default")])
def test_persistent_dataloader_workers_read_each_epochs_own_order(served, context, sampler):
    """With persistent_workers=True the workers keep the dataset copy they started with; each
    later epoch's order (set_epoch, main process only) reaches them: with the positions of
    ``ds.sampler()`` (tagged with their epoch), and through the dataset's epoch board with the
    DataLoader's own sequential sampler. A resumed state reaches them the same way."""
    _store, opts = served(120)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, seed=3, plan_ahead=False)
    by_id = {i: _sample_id(ds.read(i)) for i in range(len(ds))}
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_as_list, persistent_workers=True,
                        timeout=TIMEOUT, multiprocessing_context=multiprocessing.get_context(context),
                        **({"sampler": ds.sampler()} if sampler == "cachefs" else {}))
    orders = []
    for epoch in (0, 1, 2, 5):
        ds.set_epoch(epoch)
        got = [_sample_id(t) for batch in ds.track(loader) for t in batch]
        assert got == [by_id[int(i)] for i in ds.plan.order], epoch  # this epoch's order, not the first's
        orders.append(got)
    assert len({tuple(o) for o in orders}) == 4
    if sampler == "cachefs":  # the default sampler starts at 0 whatever the state: resume needs ds.sampler()
        ds.load_state_dict({**ds.state_dict(), "epoch": 7, "samples_seen": 40})
        got = [_sample_id(t) for batch in ds.track(loader) for t in batch]
        assert got == [by_id[int(i)] for i in ds.plan.order[40:]]
    # positions given by hand (no sampler) are the process's own plan's, as before
    assert _sample_id(ds[3]) == by_id[int(ds.plan.order[3])]


def test_a_path_read_by_name_as_listed_or_parsed_when_not_canonical(served):
    """A warm batch reads ``cachefs://`` paths by name as they stand; one the worker has no entry
    under as written (a trailing "/") is read the usual way, which parses it: the same bytes."""
    store, opts = served(40)
    names = _names(40)
    paths = [f"cachefs://data/{n}" + ("/" if i % 4 == 0 else "") for i, n in enumerate(names)]
    sizes = [len(store.objects[n]) for n in names]
    ds = CacheDataset(paths, sizes=sizes, storage_options=opts, shuffle=False, plan_ahead=False)
    for _warm in (0, 1):
        loader = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=_as_list, timeout=TIMEOUT)
        got = [bytes(t.numpy()) for batch in loader for t in batch]
        assert got == [store.objects[n] for n in names]
    assert ds.stats()["short_circuit_reads"] == 80  # this worker's own socket and page files, not gRPC


def _with_frozen_count(sample: torch.Tensor) -> tuple[torch.Tensor, int]:
    return sample, gc.get_freeze_count()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_forked_dataloader_worker_leaves_the_inherited_heap_to_the_parent(served, context):
    """A forked worker freezes what it inherited (forksafe.freeze_inherited_heap), so that its
    collections do not walk, and copy, the parent's heap; a spawned one inherits nothing to
    freeze, and the main process is left alone."""
    _store, opts = served(64)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, plan_ahead=False,
                                  transform=_with_frozen_count)
    frozen_here = gc.get_freeze_count()
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_as_list, timeout=TIMEOUT,
                        multiprocessing_context=multiprocessing.get_context(context))
    counts = [frozen for batch in loader for _sample, frozen in batch]
    assert len(counts) == 64
    if context == "fork":
        assert min(counts) > 1000  # torch's modules and this test's objects at least
    else:
        assert max(counts) == 0
    assert gc.get_freeze_count() == frozen_here
    assert ds.read(0)[1] == frozen_here  # read in this process: nothing frozen for it


def _child_reads(blob: bytes, out) -> None:
    index = pickle.loads(blob)
    out.put((len(index), index[0], index[len(index) - 1], int(index.sizes.sum()), index._fd >= 0))


def test_a_large_index_pickles_as_shared_memory_a_spawned_process_maps():
    n = 60_000
    b = IndexBuilder()
    for i in range(n):
        b.add(f"cachefs://data/train/{i:09d}.jpg", i)
    ix = b.finish()
    assert ix.nbytes > sampleindex.SMALL_BYTES and ix._fd >= 0
    blob = pickle.dumps(ix)
    assert len(blob) < 200  # a reference, not the index
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(blob, out))
    proc.start()
    try:
        got = out.get(timeout=60)
    finally:
        proc.join(timeout=60)
    assert got == (n, ix[0], ix[n - 1], n * (n - 1) // 2, True)


def _list_calls(monkeypatch) -> list[str]:
    """The threads that listed a prefix for from_prefix (the main one, or the recheck's)."""
    calls: list[str] = []
    real = prefixindex.list_prefix

    def counted(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)
    monkeypatch.setattr(prefixindex, "list_prefix", counted)
    return calls


def test_a_kept_index_starts_without_listing_and_notices_a_change(served, monkeypatch, tmp_path):
    store, opts = served(2000, page=500)
    calls = _list_calls(monkeypatch)
    kw = {"storage_options": opts, "shuffle": False, "plan_ahead": False, "index_cache": str(tmp_path / "kept")}
    first = CacheDataset.from_prefix("cachefs://data/train", kept_index="auto", **kw)  # none kept: lists, keeps
    assert len(first) == 2000  # shuffle=False: listed on a thread while the first epoch may start (liststream.py)
    assert calls == ["cachefs-prefix-listing"] and first.index_check is None
    kept = list((tmp_path / "kept").glob("*.cfsidx"))
    assert len(kept) == 1
    calls.clear()
    t0 = time.perf_counter()
    again = CacheDataset.from_prefix("cachefs://data/train", kept_index="auto", **kw)
    took = time.perf_counter() - t0
    assert threading.current_thread().name not in calls  # started from the kept file: no listing here
    assert again.paths.path == str(kept[0]) and again.paths == first.paths
    assert again.sizes.tolist() == first.sizes.tolist()
    assert took < 5  # mostly the dataset's own start; the map itself is milliseconds
    check = again.index_check.result(timeout=60)
    assert not check.stale and check.listed["count"] == 2000
    assert bytes(again.read(7).numpy()) == store.objects[again.paths[7][len("cachefs://data/"):]]

    # Another object in the store: the next start still uses the kept index at once, and its
    # recheck warns and keeps the new listing for the start after.
    store.add("train/zz-new.bin", _sample(99999))
    stale = CacheDataset.from_prefix("cachefs://data/train", kept_index="auto", **kw)
    assert len(stale.paths) == 2000
    check = stale.index_check.result(timeout=60)
    assert check.stale and check.kept["count"] == 2000 and check.listed["count"] == 2001
    fresh = CacheDataset.from_prefix("cachefs://data/train", kept_index="auto", **kw)
    assert len(fresh.paths) == 2001 and fresh.paths[-1] == "cachefs://data/train/zz-new.bin"
    fresh.index_check.result(timeout=60)
    calls.clear()
    refreshed = CacheDataset.from_prefix("cachefs://data/train", kept_index="refresh", **kw)
    assert len(refreshed.paths) == 2001 and calls == ["cachefs-prefix-listing"]
    # kept_index=None (the default) never looks at or writes a kept file
    calls.clear()
    plain = CacheDataset.from_prefix("cachefs://data/train", **{**kw, "index_cache": str(tmp_path / "none")})
    assert len(plain) == 2001 and calls == ["cachefs-prefix-listing"] and not (tmp_path / "none").exists()


def test_a_kept_index_loads_in_well_under_a_second(tmp_path):
    n = 200_000
    b = IndexBuilder()
    for i in range(n):
        b.add(f"cachefs://data/train/{i:09d}.jpg", 110_000)
    kept = prefixindex.KeptIndexes(str(tmp_path))
    key = kept.key("cachefs://data/train", {})
    kept.save(key, b.finish(meta={"url": "cachefs://data/train"}))
    t0 = time.perf_counter()
    loaded = kept.load(key, "cachefs://data/train")
    took = time.perf_counter() - t0
    assert loaded is not None and len(loaded) == n and loaded[n - 1] == f"cachefs://data/train/{n - 1:09d}.jpg"
    assert took < 0.5


def test_the_index_costs_tens_of_bytes_per_sample_not_a_python_object_each(make_worker, local_store):
    """At 200 k samples the dataset holds well under the list of str it held before (~85 B each
    for these ~34-byte paths; ~1.1 KB each after from_prefix's dicts)."""
    worker = make_worker(local_store.mount)
    n = 200_000
    sizes = np.full(n, 110_000, dtype=np.int64)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ds = CacheDataset((f"cachefs://data/train/{i:09d}.jpg" for i in range(n)), sizes=sizes,
                          storage_options={"workers": worker.address}, plan_ahead=False, stats=False)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The heap the dataset keeps, plus its index's buffer (a memfd map tracemalloc does not see).
    per_sample = (held + getattr(ds.paths, "nbytes", 0)) / n
    assert per_sample < 40, per_sample
    assert len(ds.paths) == n and ds.paths[n - 1] == f"cachefs://data/train/{n - 1:09d}.jpg"
    assert os.path.exists(f"/proc/self/fd/{ds.paths._fd}")


def test_a_worker_that_forgot_the_plan_index_is_sent_it_made_again():
    """The publisher drops each worker's part of the index once sent (it was ~65 B a sample held
    for the dataset's life); a worker that restarted is sent its part made again from the units."""
    from types import SimpleNamespace

    from cachefs.client.datasets.plans import PlanPublisher
    from cachefs.proto import worker_pb2
    from cachefs.server.worker.plans import PlanTable

    tables = {"now": PlanTable(1 << 20)}

    class Stub:
        def Plan(self, request, timeout=None):  # noqa: N802 - the RPC's name
            known, index_known, derived = tables["now"].take(request)
            return worker_pb2.PlanReply(known=known, index_known=index_known, derived=derived, policy="future")

    handle = SimpleNamespace(address="w", stub=Stub)
    session = SimpleNamespace(candidates=lambda key, offset=0, include_broken=True: [handle],
                              placed=lambda key, offset=0: handle,
                              plan=lambda handle, request, timeout: handle.stub().Plan(request, timeout=timeout))
    n = 500
    ds = CacheDataset([f"cachefs://data/train/{i:05d}.bin" for i in range(n)], sizes=[1000] * n,
                      storage_options={"workers": "127.0.0.1:1"}, plan_ahead=False, stats=False, seed=2)
    publisher = PlanPublisher(session, lambda: 0, prefetch=False)
    try:
        report = publisher.publish_derived(ds._plan_units, ds._plan_order_spec(), ds._plan_order)
        assert report.derived == 1
        (part,) = [p for _, p in publisher._index.parts.values()]
        assert part.released and not hasattr(part, "paths")
        first = tables["now"].describe()
        tables["now"] = PlanTable(1 << 20)  # the worker restarted: no plan, no index
        report = publisher.renew()
        assert report.resent == 1 and report.derived == 1
        again = tables["now"].describe()
        assert [p["derived"] for p in again] == [True] and again[0]["pages"] == first[0]["pages"]
    finally:
        publisher.close()
