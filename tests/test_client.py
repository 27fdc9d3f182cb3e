"""The fsspec client: the API users call, pickling, fork (DataLoader workers), configuration."""

from __future__ import annotations

import multiprocessing
import threading
import pickle

import fsspec
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.config import ClientConfig
from helpers import client, payload, wait_for

PAGE = 64 << 10


@pytest.fixture
def served(local_store, make_worker):
    for i in range(8):
        local_store.add(f"train/s{i:02d}.bin", payload(3000 + 1000 * i, i))
    local_store.add("train/nested/deep.bin", b"deep")
    local_store.add("val/v.bin", b"val")
    worker = make_worker(local_store.mount, page_size=PAGE)
    return local_store, worker


def test_listing_info_and_existence(served):
    store, worker = served
    fs = client(worker.address)
    assert fs.ls("") == ["data"]
    assert sorted(fs.ls("cachefs://data", detail=False)) == ["data/train", "data/val"]
    names = fs.ls("data/train", detail=False)
    assert "data/train/s00.bin" in names and "data/train/nested" in names
    found = fs.find("cachefs://data/train")
    assert found == sorted(f"data/{k}" for k in store.objects if k.startswith("train/"))
    assert fs.find("data/train/s03.bin") == ["data/train/s03.bin"]
    assert fs.find("data/nothing-here") == []
    assert fs.glob("data/train/s0[0-2].bin") == ["data/train/s00.bin", "data/train/s01.bin", "data/train/s02.bin"]
    assert fs.exists("data/train/s01.bin") and not fs.exists("data/train/zz.bin")
    assert fs.isdir("data/train") and fs.isfile("data/val/v.bin")
    info = fs.info("data/train/s01.bin")
    assert info["type"] == "file" and info["size"] == 4000 and info["version"]
    assert fs.du("data/train") == sum(len(v) for k, v in store.objects.items() if k.startswith("train/"))


def test_fsspec_open_with_storage_options(served):
    store, worker = served
    with fsspec.open("cachefs://data/train/s02.bin", "rb", workers=worker.address) as f:
        assert f.read() == store.objects["train/s02.bin"]
    with pytest.raises(NotImplementedError, match="'ab'"):  # objects are written whole (test_write_through.py)
        client(worker.address).open("data/new.bin", "ab")


def test_pickled_filesystem_reads(served):
    store, worker = served
    fs = client(worker.address)
    assert fs.cat_file("data/val/v.bin") == b"val"
    clone = pickle.loads(pickle.dumps(fs))
    assert clone.cat_file("data/train/s03.bin") == store.objects["train/s03.bin"]
    with fs.open("data/train/s04.bin") as f:
        f.seek(10)
        f2 = pickle.loads(pickle.dumps(f))  # reopens at the same position
        assert f2.tell() == 10
        assert f2.read(5) == store.objects["train/s04.bin"][10:15]


class _Samples(Dataset):
    """Holds one filesystem object, created and used in the parent before the fork."""

    def __init__(self, fs: CacheFileSystem, paths: list[str]) -> None:
        self.fs, self.paths = fs, paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        data = self.fs.cat_file(self.paths[i])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_through_an_inherited_filesystem(served, context):
    store, worker = served
    fs = client(worker.address)
    paths = [f"data/train/s{i:02d}.bin" for i in range(8)]
    assert fs.cat_file(paths[0]) == store.objects["train/s00.bin"]  # channels exist before the fork
    loader = DataLoader(_Samples(fs, paths), batch_size=None, num_workers=2,
                        multiprocessing_context=multiprocessing.get_context(context), timeout=120)
    got = [bytes(t.numpy()) for t in loader]
    assert got == [store.objects[p.split("/", 1)[1]] for p in paths]
    assert fs.cat_file(paths[1]) == store.objects["train/s01.bin"]  # the parent still works


def test_readinto_an_aligned_buffer(served):
    store, worker = served
    fs = client(worker.address)
    data = store.objects["train/s07.bin"]
    buf = np.empty(len(data), dtype=np.uint8)
    with fs.open("data/train/s07.bin") as f:
        assert f.readinto(memoryview(buf)) == len(data)
    assert buf.tobytes() == data


def test_client_configuration_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="HOST:PORT"):
        ClientConfig(workers=("localhost",))
    with pytest.raises(ValueError, match="no master or workers"):
        ClientConfig.from_options({}, environ={})
    with pytest.raises(ValueError, match="timeout"):
        ClientConfig(workers=("h:1",), timeout=0)
    cfg = ClientConfig.from_options({"block_size": "2MiB"}, environ={"CACHEFS_WORKERS": "a:1, b:2"})
    assert cfg.workers == ("a:1", "b:2") and cfg.block_size == 2 << 20
    # Storage options win over the environment.
    cfg = ClientConfig.from_options({"workers": "c:3"}, environ={"CACHEFS_WORKERS": "a:1"})
    assert cfg.workers == ("c:3",)


def test_reads_go_to_one_worker_per_path(local_store, make_worker):
    for i in range(20):
        local_store.add(f"k{i}.bin", payload(100, i))
    workers = [make_worker(local_store.mount, page_size=PAGE) for _ in range(3)]
    fs = client(*(w.address for w in workers))
    for _ in range(2):
        for key, data in local_store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
    served = [w.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") or 0 for w in workers]
    # Each object was fetched once, by the one worker its path maps to, and all workers got some.
    assert sum(served) == sum(len(d) for d in local_store.objects.values())
    assert all(s > 0 for s in served), served


def test_async_api_and_concurrent_cat(served):
    import asyncio

    store, worker = served
    paths = [f"data/train/s{i:02d}.bin" for i in range(8)]

    async def main() -> list[bytes]:
        fs = CacheFileSystem(workers=worker.address, asynchronous=True, skip_instance_cache=True)
        info = await fs._info(paths[0])
        assert info["size"] == len(store.objects["train/s00.bin"])
        return await asyncio.gather(*(fs._cat_file(p, start=1, end=101) for p in paths))

    assert asyncio.run(main()) == [store.objects[p.split("/", 1)[1]][1:101] for p in paths]
    fs = client(worker.address)
    assert fs.cat(paths) == {p: store.objects[p.split("/", 1)[1]] for p in paths}


def test_large_objects_are_striped_over_workers(local_store, make_worker):
    from cachefs.ring import HashRing, RingConfig, stripe_key

    stripe = 2 * PAGE
    data = payload(16 * stripe + 123, 31)
    local_store.add("big.bin", data)
    workers = [make_worker(local_store.mount, page_size=PAGE, readahead_pages=0) for _ in range(3)]
    fs = client(*(w.address for w in workers), stripe_size=stripe)
    assert fs.cat_file("data/big.bin") == data
    assert fs.cat_file("data/big.bin", stripe - 5, 3 * stripe + 7) == data[stripe - 5:3 * stripe + 7]
    # Each worker fetched exactly the stripes the ring places on it.
    ring = HashRing([w.address for w in workers], RingConfig(stripe_size=stripe))
    expected = {w.address: 0 for w in workers}
    for start in range(0, len(data), stripe):
        expected[ring.node(stripe_key("data/big.bin", start, stripe))] += min(stripe, len(data) - start)
    fetched = {w.address: w.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") or 0
               for w in workers}
    assert fetched == expected
    assert sum(1 for v in fetched.values() if v) >= 2
    with fs.open("data/big.bin", block_size=stripe // 2) as f:
        f.seek(5 * stripe - 3)
        assert f.read(stripe) == data[5 * stripe - 3:6 * stripe - 3]


def test_a_stopped_worker_fails_over_to_the_next_on_the_ring(local_store, make_worker):
    for i in range(12):
        local_store.add(f"k{i}.bin", payload(1000 + i, i))
    workers = [make_worker(local_store.mount, page_size=PAGE) for _ in range(3)]
    fs = client(*(w.address for w in workers), timeout=5)
    for key, data in local_store.objects.items():
        assert fs.cat_file(f"data/{key}") == data
    workers[0].stop(grace=0.5)
    for key, data in local_store.objects.items():  # no fallback: the ring's next worker serves
        assert fs.cat_file(f"data/{key}") == data


def test_fallback_reads_are_bounded_per_process(make_worker):
    from helpers import SlowMemoryFileSystem

    SlowMemoryFileSystem().pipe_file("/fb/obj.bin", b"z" * 1000)
    fs = client("127.0.0.1:1", fallback=True, fallback_concurrency=2, timeout=5,
                fallback_mounts={"mem": "slowmem:///fb"})
    SlowMemoryFileSystem.reset_counters()
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(fs.cat_file("mem/obj.bin"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [b"z" * 1000] * 8  # every read served by the store directly...
    assert SlowMemoryFileSystem.max_active <= 2  # ...but never more than 2 at once


def test_the_view_watch_is_closed_across_a_fork_and_reopened(tmp_path):
    """DataLoader workers fork: the watch stream must not be inside gRPC at that moment."""
    import os

    from cachefs.client.transport.view import ViewWatcher
    from cachefs.config import MasterConfig
    from cachefs.server.master import Master

    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "m"))).start()
    try:
        views = []

        def on_view(view) -> None:
            views.append(view)

        watcher = ViewWatcher(master.address, on_view, timeout=5, watch_seconds=30)
        assert watcher.fetch()
        watcher.start()
        assert wait_for(lambda: watcher._call is not None)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if watcher._outside.is_set() else 1)  # the child saw no call in flight
        assert os.waitpid(pid, 0)[1] == 0
        assert wait_for(lambda: watcher._call is not None and not watcher._outside.is_set())  # reopened
        watcher.stop()
    finally:
        master.stop()


def test_a_fork_does_not_wait_on_a_watcher_whose_master_is_gone(tmp_path, caplog):
    import os
    import time as _time

    from cachefs.client.transport.view import ViewWatcher
    from cachefs.config import MasterConfig
    from cachefs.server.master import Master

    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "m"))).start()
    address = master.address
    master.stop()

    def on_view(view) -> None:
        pass

    watcher = ViewWatcher(address, on_view, timeout=1, watch_seconds=30).start()
    try:
        # The stream has failed (the watcher warns once, then backs off, outside gRPC).
        assert wait_for(lambda: any("keeping view" in r.getMessage() for r in caplog.records))
        t0 = _time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert _time.monotonic() - t0 < 1.0
    finally:
        watcher.stop()
