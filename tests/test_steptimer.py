"""StepTimer: an input-bound loop is flagged, a compute-bound one is not (sleeps are simulated work)."""

from __future__ import annotations

import time

import pytest
from torch.utils.data import DataLoader, Dataset

from cachefs import StepTimer


class SlowDataset(Dataset):
    """Each sample takes ``read_s`` to read (standing in for a slow store)."""

    def __init__(self, n: int, read_s: float) -> None:
        self.n, self.read_s = n, read_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.read_s)
        return i


def _run(timer: StepTimer, loader, compute_s: float) -> list:
    seen = []
    for batch in timer(loader):
        seen.extend(batch)
        time.sleep(compute_s)
    return seen


def test_input_bound_loop_is_flagged_with_advice():
    loader = DataLoader(SlowDataset(24, 0.01), batch_size=2, num_workers=0, pin_memory=False)
    timer = StepTimer(threshold=0.2)
    assert _run(timer, loader, compute_s=0.001) == list(range(24))
    s = timer.summary()
    assert s.steps == 11  # 12 batches, the first one only as start-up
    assert s.startup_s > 0 and s.wait_s >= 11 * 2 * 0.01 * 0.9
    assert s.wait_share > 0.5 and s.input_bound
    report = timer.report()
    assert "INPUT-BOUND" in report and "num_workers is 0" in report and "pin_memory=True" in report
    assert "cachefs load" in report and "shards" in report


def test_compute_bound_loop_is_not_flagged():
    loader = DataLoader(SlowDataset(12, 0.001), batch_size=2, num_workers=0)
    timer = StepTimer(threshold=0.2)
    # a step far longer than a batch's 2 ms read: a 1 ms sleep that wakes several ms late on a
    # loaded machine (seen at a load of 20: a 30 ms step gave a 22% share) still stays under 20%
    _run(timer, loader, compute_s=0.08)
    s = timer.summary()
    assert s.steps == 5 and s.compute_s >= 5 * 0.08 * 0.9
    assert s.wait_share < 0.2 and not s.input_bound
    assert "not input-bound" in timer.report() and "INPUT-BOUND" not in timer.report()


def test_passes_accumulate_and_first_batch_of_each_is_startup():
    timer = StepTimer(window=3)
    for _ in range(2):
        for _ in timer(range(5)):
            pass
    s = timer.summary()
    assert timer.passes == 2 and s.steps == 8 and len(timer.recent) == 3
    assert set(s.scalars()) >= {"wait_share", "wait_s", "compute_s", "startup_s", "steps"}


def test_a_loop_left_by_break_records_only_finished_steps():
    timer = StepTimer()
    for i, _ in enumerate(timer(range(10))):
        if i == 3:
            break
    # batch 0 is start-up; batches 1 and 2 were computed; batch 3's compute never ended
    assert timer.summary().steps == 2
    assert StepTimer().report().startswith("StepTimer: no steps")


@pytest.mark.parametrize("kw", [{"threshold": 0}, {"threshold": 1.5}, {"window": 0}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        StepTimer(**kw)


def test_real_dataset_over_a_slow_store_is_flagged_then_a_slow_step_is_not(make_worker, monkeypatch):
    from cachefs.client.datasets.dataset import CacheDataset
    from cachefs.mounts import MountSpec
    from helpers import SlowMemoryFileSystem, payload

    monkeypatch.setattr(SlowMemoryFileSystem, "delay", 0.03)  # every store read: 30 ms
    mem = SlowMemoryFileSystem()
    for i in range(16):
        mem.pipe_file(f"/steptimer/train/{i:03d}.bin", payload(2000 + i, i))
    worker = make_worker(MountSpec("mem", "slowmem:///steptimer"), page_size=64 << 10)
    ds = CacheDataset.from_prefix("cachefs://mem/train", storage_options={"workers": worker.address},
                                  rank=0, world_size=1, hint_samples=0)
    loader = DataLoader(ds, batch_size=2, sampler=ds.sampler(), num_workers=0, collate_fn=lambda b: b)
    cold = StepTimer(threshold=0.2)
    assert len(_run(cold, ds.track(loader), compute_s=0.001)) == 16  # cold: every sample from the store
    print(cold.report())
    assert cold.summary().input_bound and "INPUT-BOUND" in cold.report()
    ds.set_epoch(1)
    warm = StepTimer(threshold=0.2)
    assert len(_run(warm, ds.track(loader), compute_s=0.03)) == 16  # warm, and the step is the slow part
    assert not warm.summary().input_bound, warm.report()
    assert ds.stats()["samples"] == 32


def test_a_store_behind_the_delay_proxy_makes_a_cold_loop_input_bound_and_a_warm_one_not(make_worker):
    """The object store is moto behind cachefs/netem.py's userspace delay proxy (20 ms each way,
    so ~80 ms to a cold GET's first byte): a cold epoch with a short step is flagged input-bound;
    the same samples warm, with a step longer than their reads, are not."""
    import s3fs

    from cachefs import netem
    from cachefs.client.datasets.dataset import CacheDataset
    from cachefs.mounts import MountSpec
    from helpers import payload

    with netem.moto_endpoint(20, netem=False) as ep:  # the proxy: never touches the host's network
        assert ep.mode == "proxy", ep.note
        bucket = ep.new_bucket("steptimer")
        store = s3fs.S3FileSystem(skip_instance_cache=True, **ep.storage_options())
        store.pipe({f"{bucket}/train/{i:03d}.bin": payload(2000 + i, i) for i in range(12)})
        worker = make_worker(MountSpec("s3", f"s3://{bucket}", ep.storage_options()), page_size=64 << 10)
        ds = CacheDataset.from_prefix("cachefs://s3/train", storage_options={"workers": worker.address},
                                      rank=0, world_size=1, hint_samples=0, prefetch_depth=0)
        loader = DataLoader(ds, batch_size=2, sampler=ds.sampler(), num_workers=0, collate_fn=lambda b: b)
        cold = StepTimer(threshold=0.2)
        assert len(_run(cold, ds.track(loader), compute_s=0.005)) == 12
        print(cold.report())
        assert cold.summary().input_bound and "INPUT-BOUND" in cold.report()
        assert ds.stats()["misses"] == 12  # every sample fetched through the proxy
        ds.set_epoch(1)
        warm = StepTimer(threshold=0.2)
        assert len(_run(warm, ds.track(loader), compute_s=0.03)) == 12
        print(warm.report())
        assert not warm.summary().input_bound, warm.report()
        assert ds.stats()["hits"] == 12  # and none of them went to the store


def test_per_epoch_summary_since_a_mark():
    timer = StepTimer()
    list(timer(range(5)))
    mark = timer.mark()
    list(timer(range(3)))
    since = timer.summary(since=mark)
    assert since.steps == 2 and timer.summary().steps == 6  # each pass's first batch is start-up
    assert 0 <= since.wait_share <= 1 and since.startup_s <= timer.summary().startup_s


def test_batches_that_were_ready_are_told_apart_as_the_dataloaders_hand_off():
    import types

    def ready_batches():
        for i in range(12):
            time.sleep(0.0005)  # each batch waits well under HANDOFF_S: it was ready
            yield i

    timer = StepTimer(threshold=0.01)
    for _ in timer(ready_batches(), loader=types.SimpleNamespace(num_workers=2, pin_memory=False)):
        time.sleep(0.002)
    assert timer.summary().input_bound
    assert "set_sharing_strategy('file_system')" in timer.report()
    slow = StepTimer(threshold=0.01)
    slow_ds = SlowDataset(6, 0.01)
    list(slow((slow_ds[i] for i in range(len(slow_ds))), loader=types.SimpleNamespace(num_workers=2)))
    assert "set_sharing_strategy" not in slow.report()  # waits of 10 ms are reads, not the hand-off
