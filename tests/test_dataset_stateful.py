"""Resume through torchdata's StatefulDataLoader (where installed): its state_dict alone, with no
``track()``, resumes both datasets exactly, also with another number of workers."""

from __future__ import annotations

import pytest

from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.datasets.shards import write_tar_shards

stateful = pytest.importorskip("torchdata.stateful_dataloader")
N = 60


def _as_list(batch):
    return batch


@pytest.fixture
def opts(local_store, make_worker, tmp_path):
    for i in range(N):
        local_store.add(f"train/{i:05d}.bin", f"{i:08d}".encode() + bytes(500 + i))
    samples = ((f"s/{i:05d}", {"id": f"{i:08d}".encode(), "bin": bytes(900 + i)}) for i in range(N))
    write_tar_shards(samples, local_store.mount.url + "/shards", shard_bytes=20_000)
    return {"workers": make_worker(local_store.mount, page_size=64 << 10).address}


def _make(kind, opts):
    if kind == "map":
        ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, rank=0, world_size=1, seed=3)
        return ds, dict(sampler=ds.sampler()), lambda t: int(bytes(t[:8].numpy()))
    ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4,
                                          rank=0, world_size=1, seed=3)
    return ds, {}, lambda s: int(bytes(s["id"].numpy()))


@pytest.mark.parametrize("kind", ["map", "iter"])
@pytest.mark.parametrize("before,after", [(2, 2), (0, 0)])  # torchdata keeps the worker count
def test_stateful_dataloader_resumes_exactly(opts, kind, before, after):
    ds, kw, key = _make(kind, opts)
    ds.set_epoch(1)
    loader = stateful.StatefulDataLoader(ds, batch_size=4, num_workers=before, collate_fn=_as_list,
                                         timeout=60 if before else 0, **kw)
    first, state = [], None
    for k, batch in enumerate(loader):
        first += [key(x) for x in batch]
        if k == 5:
            state = loader.state_dict()
            break
    del loader
    ds2, kw2, _ = _make(kind, opts)
    ds2.set_epoch(1)
    loader2 = stateful.StatefulDataLoader(ds2, batch_size=4, num_workers=after, collate_fn=_as_list,
                                          timeout=60 if after else 0, **kw2)
    loader2.load_state_dict(state)
    rest = [key(x) for batch in loader2 for x in batch]
    assert len(first) == 24
    assert sorted(first + rest) == list(range(N)), (first, rest)
