"""#46: CacheDataset.from_prefix's first epoch before the listing ends (client/datasets/liststream.py),
and one lister per job (rank 0 lists, the other ranks map what it kept: prefixindex.JobHandoff).

A real in-process worker over cachefs.testing's synthetic store whose listing requests (a page of
1,000 objects each) take LATENCY seconds and reads none (``slowlist://``, below), so a listing of
COUNT objects takes COUNT / 1000 * LATENCY seconds; DataLoader workers are real forked processes;
ranks are real processes, and the store's trace file says which process's listing it answered.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import fsspec
import pytest
import torch
from torch.utils.data import DataLoader

from cachefs.testing import SyntheticFileSystem
from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.liststream import GrowingIndex, ListingFailed
from cachefs.client.datasets.sampleindex import SampleIndex
from cachefs.mounts import MountSpec

HERE = Path(__file__).parent
COUNT = 8_000  # 8 listing requests
LATENCY = 0.4  # seconds a listing request: the listing takes ~3.2 s
URL = "cachefs://data/d00000"
TIMEOUT = 120


class SlowListing(SyntheticFileSystem):
    """The synthetic store with slow listings only (its ``latency`` slows every request)."""

    protocol = "slowlist"

    def __init__(self, list_latency: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.list_latency = float(list_latency)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path[len("slowlist://"):] if path.startswith("slowlist://") else path)

    def cachefs_list_after(self, *args, **kwargs):
        time.sleep(self.list_latency)
        return super().cachefs_list_after(*args, **kwargs)


fsspec.register_implementation("slowlist", SlowListing, clobber=True)


def _id(t: torch.Tensor) -> int:
    return int(bytes(t[:8].numpy()).decode())  # a synthetic object is its index, repeated


def _as_list(batch):
    return batch


@pytest.fixture
def slow(make_worker, tmp_path):
    trace = tmp_path / "trace.log"
    trace.touch()

    def make(count: int = COUNT, latency: float = LATENCY):
        mount = MountSpec("data", "slowlist://data", {"count": count, "per_dir": count, "size": 16,
                                                     "list_latency": latency, "trace": str(trace)})
        worker = make_worker(mount, page_size=64 << 10)
        return {"workers": worker.address}, trace
    return make


def _listings(trace: Path) -> list[str]:
    return [line.split()[0] for line in trace.read_text().splitlines() if line.split()[1] == "list_after"]


def _epoch(ds, loader) -> list[int]:
    return [_id(t) for batch in ds.track(loader) for t in batch]


def test_first_batch_comes_before_the_listing_ends_and_the_epoch_reads_each_sample_once(slow, tmp_path):
    opts, trace = slow()
    t0 = time.monotonic()
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, seed=3, plan_ahead=False,
                                  index_cache=str(tmp_path / "kept"))
    made = time.monotonic() - t0
    loader = DataLoader(ds, batch_size=32, sampler=ds.sampler(), collate_fn=_as_list)
    it = ds.track(loader)
    first = next(it)
    first_at = time.monotonic() - t0
    listed_then = len(_listings(trace))
    # Still listing: the first batch came after a few of the listing's requests, not after all.
    assert isinstance(ds._index, GrowingIndex) and ds._listing is not None, (made, first_at)
    assert listed_then <= COUNT // 2000, (made, first_at, listed_then)
    assert [_id(t) for t in first] == list(range(32))  # listing order
    ids = [_id(t) for t in first] + [_id(t) for batch in it for t in batch]
    assert ids == list(range(COUNT))  # every sample once, in order
    assert len(ds) == COUNT and ds.samples_seen == COUNT and isinstance(ds.paths, SampleIndex)
    assert ds.paths[5] == "cachefs://data/d00000/00000005.bin" and ds.sizes.tolist() == [16] * COUNT
    assert len(_listings(trace)) == COUNT // 1000  # listed once
    ds.set_epoch(1)  # later epochs: the whole index, as before
    assert _epoch(ds, DataLoader(ds, batch_size=32, sampler=ds.sampler(), collate_fn=_as_list)) == list(range(COUNT))


def test_a_shuffled_first_epoch_and_stream_false_wait_for_the_listing(slow):
    opts, trace = slow(count=3000, latency=0.2)
    # "refresh": the store's listing, not one the worker cached
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=True, plan_ahead=False, kept_index="refresh",
                                  index_cache="")
    assert isinstance(ds._index, SampleIndex) and len(_listings(trace)) == 3
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, stream=False, plan_ahead=False,
                                  kept_index="refresh", index_cache="")
    assert isinstance(ds._index, SampleIndex) and len(_listings(trace)) == 6


def test_forked_dataloader_workers_read_a_streaming_epoch_exactly_once_over_two_ranks(slow):
    opts, trace = slow()
    seen = []
    for rank in range(2):  # ranks in turn, each listing (no job token): the order is the listing's either way
        ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, rank=rank, world_size=2,
                                      plan_ahead=False, kept_index="refresh", index_cache="")
        loader = DataLoader(ds, batch_size=16, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                            multiprocessing_context="fork", timeout=TIMEOUT)
        t0 = time.monotonic()
        ids = []
        for batch in ds.track(loader):
            if not ids:
                assert ds._listing is not None, time.monotonic() - t0  # the first batch came while listing
            ids += [_id(t) for t in batch]
        assert ids == list(range(rank, COUNT, 2)) and len(ds) == COUNT // 2
        seen += ids
    assert Counter(seen) == Counter(range(COUNT))


def test_a_pickled_streaming_dataset_maps_the_same_listing_and_waits_for_its_end(slow):
    opts, _ = slow()
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, index_cache="")
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker gets: the log's memfd, mapped
    assert isinstance(copy._index, GrowingIndex) and copy._listing is None and len(pickle.dumps(ds)) < 20_000
    assert [_id(t) for t in copy.__getitems__(list(range(10)))] == list(range(10))
    assert copy.plan.has(COUNT - 1) and not copy.plan.has(COUNT)  # the end, seen through the log
    assert copy.paths[COUNT - 1] == ds.paths[COUNT - 1] == f"cachefs://data/d00000/{COUNT - 1:08d}.bin"


def test_spawned_dataloader_workers_map_the_log_of_a_listing_still_going_on(slow):
    opts, _ = slow(count=4000, latency=1.5)  # 6 s of listing: the workers are spawned while it goes on
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, index_cache="")
    loader = DataLoader(ds, batch_size=50, sampler=ds.sampler(), num_workers=2, collate_fn=_as_list,
                        multiprocessing_context="spawn", timeout=TIMEOUT)
    it = iter(loader)  # the dataset is pickled for the workers now: a GrowingIndex over the log
    assert ds._listing is not None
    ids = [_id(t) for batch in it for t in batch]
    assert ids == list(range(4000)) and len(ds) == 4000


def test_padding_and_drop_last_match_the_whole_listings_plan(slow):
    opts, _ = slow(count=2003, latency=0.05)
    for drop_last in (False, True):
        per_rank = []
        for rank in range(3):
            ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, rank=rank, world_size=3,
                                          drop_last=drop_last, plan_ahead=False, index_cache="")
            per_rank.append(_epoch(ds, DataLoader(ds, batch_size=50, sampler=ds.sampler(), collate_fn=_as_list)))
            assert len(per_rank[-1]) == len(ds) == (667 if drop_last else 668)
        everything = [i for ids in per_rank for i in ids]
        if drop_last:
            assert sorted(everything) == list(range(2001))
        else:  # one sample padded, from the start of the listing
            assert Counter(everything) == Counter(list(range(2003)) + [0])


def test_resume_mid_epoch_from_a_state_saved_while_listing_is_exact(slow):
    opts, _ = slow()
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, index_cache="")
    got = []
    for batch in ds.track(DataLoader(ds, batch_size=32, sampler=ds.sampler(), collate_fn=_as_list)):
        got += [_id(t) for t in batch]
        if len(got) == 320:
            state = ds.state_dict()
            break
    assert ds._listing is not None and state["n_samples"] == -1 and state["samples_seen"] == 320
    again = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, index_cache="")
    again.load_state_dict(state)  # waits for the listing (the count is checked from then on)
    assert again._listing is None and again.samples_seen == 320
    rest = _epoch(again, DataLoader(again, batch_size=32, sampler=again.sampler(), num_workers=2,
                                    collate_fn=_as_list, multiprocessing_context="fork", timeout=TIMEOUT))
    assert got + rest == list(range(COUNT))
    assert again.state_dict()["n_samples"] == COUNT


def test_kept_index_starts_at_once_and_is_written_by_a_streamed_listing(slow, tmp_path):
    opts, trace = slow(count=4000, latency=0.2)
    kept = str(tmp_path / "kept")
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, kept_index="auto",
                                  index_cache=kept)
    assert len(ds) == 4000  # waits for the end; the index is then kept
    assert [f for f in os.listdir(kept) if f.endswith(".cfsidx")]
    listed = len(_listings(trace))
    t0 = time.monotonic()
    again = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, kept_index="auto",
                                     index_cache=kept)
    assert time.monotonic() - t0 < 1.0 and isinstance(again._index, SampleIndex) and len(again) == 4000
    again.index_check.result(60)
    assert len(_listings(trace)) == 2 * listed  # the background recheck only


def test_a_failed_listing_fails_the_reads_waiting_on_it_by_name(make_worker, monkeypatch):
    from cachefs.client.datasets import prefixindex

    real = prefixindex.IndexBuilder

    class Failing(real):  # the third page's first entry breaks the listing
        def add(self, path, size):
            if path.endswith("00002000.bin"):
                raise OSError("the store went away")
            super().add(path, size)

    monkeypatch.setattr(prefixindex, "IndexBuilder", Failing)
    mount = MountSpec("data", "slowlist://data", {"count": 5000, "per_dir": 5000, "size": 16, "list_latency": 0.05})
    opts = {"workers": make_worker(mount, page_size=64 << 10).address}
    ds = CacheDataset.from_prefix(URL, storage_options=opts, shuffle=False, plan_ahead=False, index_cache="",
                                  timeout=30)
    with pytest.raises(ListingFailed, match="the store went away"):
        _epoch(ds, DataLoader(ds, batch_size=100, sampler=ds.sampler(), collate_fn=_as_list))
    with pytest.raises(OSError, match="the store went away"):
        len(ds)


def _ranks(opts, tmp_path, world: int, job: str, extra: dict | None = None) -> list[dict]:
    env = dict(os.environ, CACHEFS_JOB_ID=job, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    args = {"url": URL, "workers": opts["workers"], "world": world, "cache": str(tmp_path / "kept"), **(extra or {})}
    procs = [subprocess.Popen([sys.executable, str(HERE / "dataset_stream_rank.py"), json.dumps({**args, "rank": r})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout))
    return out


def test_one_lister_per_job_rank_0_lists_the_others_map_its_index(slow, tmp_path):
    opts, trace = slow(count=6000, latency=0.1)
    out = _ranks(opts, tmp_path, 3, "job-a")
    # Each rank asks for the store's listing (kept_index="refresh": none the worker cached), yet the
    # store answered one listing: rank 0's six requests.
    assert len(_listings(trace)) == 6
    assert Counter(i for r in out for i in r["ids"]) == Counter(range(6000))
    assert [r["len"] for r in out] == [2000] * 3
    again = _ranks(opts, tmp_path, 3, "job-b", {"shuffle": True})  # another run lists again, once
    assert len(_listings(trace)) == 12
    assert Counter(i for r in again for i in r["ids"]) == Counter(range(6000))
    # kept_index="auto": rank 0 maps the kept index and hands that very file over (a hard link);
    # only its background recheck (at most one listing, cut short when rank 0 exits) asks the store.
    kept = _ranks(opts, tmp_path, 3, "job-c", {"kept": "auto"})
    assert len(_listings(trace)) <= 18
    assert Counter(i for r in kept for i in r["ids"]) == Counter(range(6000))
    files = os.listdir(tmp_path / "kept")
    [kept_file] = [f for f in files if f.endswith(".cfsidx") and ".job-" not in f]
    tag = hashlib.sha256(b"cachefs:job-c").hexdigest()[:16]
    assert os.path.samefile(tmp_path / "kept" / kept_file,
                            tmp_path / "kept" / kept_file.replace(".cfsidx", f".job-{tag}.cfsidx"))
    assert len([f for f in files if ".job-" in f]) == 3  # one a run


def test_a_rank_waiting_for_rank_0_fails_by_deadline_with_what_is_missing(slow, tmp_path, monkeypatch):
    opts, trace = slow(count=100, latency=0.0)
    monkeypatch.setenv("CACHEFS_JOB_ID", "lonely")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 waited .* for rank 0's index of cachefs://data/d00000"):
        CacheDataset.from_prefix(URL, storage_options=opts, rank=1, world_size=2, index_cache=str(tmp_path),
                                 index_timeout=1.0, shuffle=False, plan_ahead=False)
    assert 1.0 <= time.monotonic() - t0 < 10 and not _listings(trace)
