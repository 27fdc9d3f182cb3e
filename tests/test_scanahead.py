"""Read-ahead across objects (client/fs/scanahead.py): objects read in their directory's order get the
next ones hinted; reads out of order get nothing, and cost no listing."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.client.fs.scanahead import ScanAhead
from cachefs.paths import CachePath
from cachefs.proto import worker_pb2, worker_pb2_grpc
from helpers import payload, wait_for

PAGE = 64 << 10


class _Fake:
    """A directory listing and a hint sink, both recorded."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.listed: list[CachePath] = []
        self.hints: list[list[str]] = []
        self.listing_done = threading.Event()

    def list_dir(self, directory: CachePath) -> list[list[str]]:
        """The listing in pages of 1,000, as ClientSession.list_pages hands them."""
        self.listed.append(directory)
        self.listing_done.set()
        return [self.names[i:i + 1000] for i in range(0, len(self.names), 1000)]

    def hint(self, keys: list[str]) -> int:
        self.hints.append(keys)
        return len(keys)


def _scan(names: list[str], **kw) -> tuple[ScanAhead, _Fake]:
    fake = _Fake(names)
    return ScanAhead(fake.list_dir, fake.hint, **kw), fake


def _started(scan: ScanAhead, directory: str, first: str, second: str) -> None:
    """Two reads going up in ``directory``: its listing is asked for; wait until it is in."""
    scan.note(CachePath("m", f"{directory}/{first}"))
    scan.note(CachePath("m", f"{directory}/{second}"))
    assert _listed(scan)


def _listed(scan: ScanAhead) -> bool:
    return wait_for(lambda: scan.stats["listed"] + scan.stats["too_large"] + scan.stats["list_failed"] > 0,
                    timeout=30)


def test_reads_in_order_hint_what_follows_in_growing_windows():
    names = [f"{i:04d}.bin" for i in range(400)]
    scan, fake = _scan(list(reversed(names)))  # the listing's own order does not matter
    read = [CachePath("m", f"val/{n}") for n in names]
    scan.note(read[0])
    scan.note(read[1])  # two reads going up: the directory is listed (once, in the background)
    assert _listed(scan) and fake.listed == [CachePath("m", "val")]
    assert fake.hints == []  # nothing hinted before the listing and two adjacent reads
    for cp in read[2:200]:
        scan.note(cp)
    hinted = [k for keys in fake.hints for k in keys]
    assert hinted == [f"m/val/{n}" for n in names[4:4 + len(hinted)]]  # in order, each once
    assert 200 + 16 <= 4 + len(hinted) <= 200 + 64  # ahead of the reader, never past the window
    assert all(len(keys) <= 64 for keys in fake.hints)
    assert len(fake.hints) <= 200 // 16  # a stretch at a time, not a message per read
    assert fake.listed == [CachePath("m", "val")]


def test_reads_out_of_order_hint_nothing_and_reads_going_down_list_nothing():
    names = [f"{i:04d}.bin" for i in range(300)]
    scan, fake = _scan(names)
    for n in names[::3]:  # going up, never adjacent: listed once, nothing hinted
        scan.note(CachePath("m", f"a/{n}"))
    assert _listed(scan)
    for n in names[::3]:
        scan.note(CachePath("m", f"a/{n}"))
    assert fake.listed == [CachePath("m", "a")] and fake.hints == []
    for n in reversed(names):  # going down: not even a listing
        scan.note(CachePath("m", f"b/{n}"))
    assert fake.listed == [CachePath("m", "a")] and fake.hints == []


def test_a_jump_starts_the_window_over_and_hints_nothing_twice():
    names = [f"{i:04d}" for i in range(500)]
    scan, fake = _scan(names, first_window=4, max_window=16)
    _started(scan, "d", "0000", "0001")
    for i in range(0, 40):
        scan.note(CachePath("m", f"d/{i:04d}"))
    first = [k for keys in fake.hints for k in keys]
    assert first and len(set(first)) == len(first)
    before = len(fake.hints)
    scan.note(CachePath("m", "d/0300"))  # a jump: no hint for it alone
    assert len(fake.hints) == before
    scan.note(CachePath("m", "d/0301"))  # in order again: the window starts small
    assert fake.hints[-1] == [f"m/d/{i:04d}" for i in range(302, 306)]
    hinted = [k for keys in fake.hints for k in keys]
    assert len(set(hinted)) == len(hinted)


def test_a_directory_too_large_to_list_is_left_alone_and_bad_windows_are_refused():
    scan, fake = _scan([f"{i}" for i in range(50)], max_listing=10)
    for i in range(30):
        scan.note(CachePath("m", f"big/{i:02d}"))
    assert _listed(scan) and scan.stats["too_large"] == 1
    assert fake.hints == []
    with pytest.raises(ValueError):
        ScanAhead(fake.list_dir, fake.hint, first_window=0)
    with pytest.raises(ValueError):
        ScanAhead(fake.list_dir, fake.hint, first_window=32, max_window=8)


def _cached(worker, keys: list[str]) -> bool:
    return all(worker.pages.holds_object("data", k) for k in keys)


def test_a_plain_loop_over_a_directory_finds_the_objects_ahead_of_it_cached(local_store, make_worker):
    """cat_file in name order, one object at a time (a Dataset with shuffle=False): after the
    first reads, objects it has not read yet are in the worker's cache, fetched by hints."""
    data = {f"val/{i:03d}.bin": payload(PAGE // 2 + i, 500 + i) for i in range(60)}
    for key, d in data.items():
        local_store.add(key, d)
    local_store.add("other/x.bin", payload(100, 1))
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, scan_ahead=True)
    keys = sorted(data)
    for key in keys[:3]:
        assert fs.cat_file(f"cachefs://data/{key}") == data[key]
    assert wait_for(lambda: fs._scan.stats["listed"] == 1, timeout=30)
    assert fs.cat_file(f"cachefs://data/{keys[3]}") == data[keys[3]]
    assert fs.cat_file(f"cachefs://data/{keys[4]}") == data[keys[4]]
    ahead = keys[5:13]  # never read: hinted
    assert wait_for(lambda: _cached(worker, ahead), timeout=30)
    assert not worker.pages.holds_object("data", keys[-1])  # the window, not the directory
    for key in keys[5:]:  # and what it reads is right
        assert fs.cat_file(f"cachefs://data/{key}") == data[key]
    assert fs._scan_hinter.stats["paths"] > 0
    fs.close()
    assert wait_for(lambda: _cached(worker, keys), timeout=30)
    # A warm pass in a new process (a DataLoader worker's next epoch): the worker here vouches for
    # every object, so nothing is hinted, though the reads keep to the order.
    again = CacheFileSystem(workers=worker.address, skip_instance_cache=True, scan_ahead=True)
    assert again.cat_file(f"cachefs://data/{keys[0]}") == data[keys[0]]
    assert wait_for(lambda: again.session.vouched(f"data/{keys[1]}"), timeout=30)  # its hello: the index
    assert again.cat_file(f"cachefs://data/{keys[1]}") == data[keys[1]]
    assert wait_for(lambda: again._scan.stats["listed"] == 1, timeout=30)  # in order: listed
    for key in keys[2:]:
        assert again.cat_file(f"cachefs://data/{key}") == data[key]
    assert again._scan_hinter is not None and again._scan_hinter.stats["paths"] == 0
    again.close()


def test_shuffled_reads_send_no_hints_and_the_option_turns_it_off(local_store, make_worker):
    data = {f"train/{i:03d}.bin": payload(300 + i, 700 + i) for i in range(40)}
    for key, d in data.items():
        local_store.add(key, d)
    worker = make_worker(local_store.mount, page_size=PAGE)
    off = CacheFileSystem(workers=worker.address, skip_instance_cache=True, scan_ahead=False)
    for key in sorted(data)[:10]:
        assert off.cat_file(f"cachefs://data/{key}") == data[key]
    assert off._scan is None  # off: no listing, no hints
    with grpc.insecure_channel(worker.address) as ch:  # cold again
        worker_pb2_grpc.WorkerServiceStub(ch).Free(worker_pb2.FreeRequest(prefix="data/train/"), timeout=30)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, scan_ahead=True)
    order = sorted(data)
    random.Random(3).shuffle(order)
    order = [k for i, k in enumerate(order) if i == 0 or int(k[6:9]) != int(order[i - 1][6:9]) + 1]
    for key in order:
        with fs.open(f"cachefs://data/{key}") as f:
            assert f.read() == data[key]
    assert fs._scan.stats["hinted"] == 0
    off.close()
    fs.close()


def test_what_the_cache_refuses_is_offered_again_with_the_next_read():
    names = [f"{i:03d}" for i in range(100)]
    fake = _Fake(names)
    answers = iter([0, 0])  # busy twice (a worker's hint slots full), then taken

    def busy_then_taken(keys: list[str]) -> int:
        fake.hints.append(keys)
        return next(answers, len(keys))

    scan = ScanAhead(fake.list_dir, busy_then_taken, first_window=4, max_window=16)
    _started(scan, "d", "000", "001")
    for i in range(2, 6):
        scan.note(CachePath("m", f"d/{i:03d}"))
    assert fake.hints[0][0] == "m/d/004" and fake.hints[1][0] == "m/d/005"  # refused: offered again
    assert fake.hints[2][0] == "m/d/006"  # taken from here on
    assert scan.stats["hinted"] == len(fake.hints[2]) + sum(len(k) for k in fake.hints[3:])


def test_a_jump_into_what_was_hinted_keeps_the_window_as_interleaved_dataloader_workers_need():
    names = [f"{i:04d}" for i in range(400)]
    scan, fake = _scan(names, first_window=4, max_window=32)
    _started(scan, "d", "0000", "0001")
    for i in range(0, 8):  # a batch of 8 (this process's)
        scan.note(CachePath("m", f"d/{i:04d}"))
    hinted_to = 2 + sum(len(k) for k in fake.hints)
    assert hinted_to > 16
    for i in range(16, 24):  # the next batch of its own: the other process read 8..15
        scan.note(CachePath("m", f"d/{i:04d}"))
    hinted = [k for keys in fake.hints for k in keys]
    assert len(set(hinted)) == len(hinted)
    assert 2 + len(hinted) >= 24 + 16  # kept ahead by more than a first window


def test_on_by_default_and_off_by_option_or_environment(monkeypatch):
    from cachefs.config import ClientConfig

    monkeypatch.delenv("CACHEFS_SCAN_AHEAD")  # the suite turns it off for the other tests (conftest.py)
    assert ClientConfig.from_options({"workers": "127.0.0.1:1"}).scan_ahead is True
    assert ClientConfig.from_options({"workers": "127.0.0.1:1", "scan_ahead": False}).scan_ahead is False
    monkeypatch.setenv("CACHEFS_SCAN_AHEAD", "false")
    assert ClientConfig.from_options({"workers": "127.0.0.1:1"}).scan_ahead is False


def test_a_child_forked_while_a_parent_thread_holds_the_lock_reads_on():
    """A DataLoader worker forked while a parent thread is inside ScanAhead (its listing landing,
    a hint answered) takes the lock on its first read: it must be the child's own, not the
    parent's held copy (which blocked the child forever)."""
    import multiprocessing

    scan = ScanAhead(lambda cp: [], lambda paths: len(paths))
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)

    def child() -> None:
        scan.note(CachePath("data", "a/x0"))
        scan.note(CachePath("data", "a/x1"))
        child_end.send("read on")

    with scan._lock:  # a parent thread inside it at the fork
        proc = ctx.Process(target=child)
        proc.start()
    child_end.close()
    try:
        assert parent_end.poll(20), "the forked child blocked on the parent's scan-ahead lock"
        assert parent_end.recv() == "read on"
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def _synthetic_pages(count: int, pulled: list[int]):
    """``list_pages`` over a synthetic directory of ``count`` objects, generated a page at a time
    as taken (cachefs.testing's paging), each page taken counted in ``pulled``."""
    from cachefs.testing import SyntheticFileSystem

    fs = SyntheticFileSystem(count=count, per_dir=count)

    def list_pages(directory: CachePath):
        after = ""
        while True:
            entries, last = fs.cachefs_list_after("data/d00000", False, after, 1000)
            pulled.append(1)
            yield [e["name"].rsplit("/", 1)[-1] for e in entries]
            if last:
                return
            after = entries[-1]["name"].rsplit("/", 1)[-1]

    return list_pages


@pytest.mark.parametrize("count", [30_000, 2_000_000])
def test_a_directory_past_the_cap_costs_the_cap_in_pages_and_memory_whatever_its_size(count):
    """#46: the listing is given up at the cap, a page at a time: a directory of two million
    objects costs what one of thirty thousand does (pages asked for, names held)."""
    import tracemalloc

    pulled: list[int] = []
    scan = ScanAhead(_synthetic_pages(count, pulled), lambda keys: len(keys), max_listing=20_000)
    tracemalloc.start()
    try:
        scan._list(("m", "d00000"))  # the listing thread's work, here on this thread
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert scan.stats["too_large"] == 1 and scan.stats["listed"] == 0
    assert len(pulled) == 20_000 // 1000 + 1  # the page that went past the cap is the last asked for
    assert peak < 8 << 20  # ~21,000 names and a page: a few MB, not the directory's ~150 MB


def test_a_directory_within_the_cap_is_listed_over_several_pages():
    pulled: list[int] = []
    scan = ScanAhead(_synthetic_pages(4_500, pulled), lambda keys: len(keys), max_listing=20_000)
    scan.note(CachePath("m", "d00000/00000000.bin"))
    scan.note(CachePath("m", "d00000/00000001.bin"))
    assert _listed(scan) and scan.stats["listed"] == 1 and len(pulled) == 5
    scan.note(CachePath("m", "d00000/00000002.bin"))
    scan.note(CachePath("m", "d00000/00000003.bin"))
    assert scan.stats["hinted"] > 0


@pytest.mark.parametrize("count", [20_000, 1_000_000])
def test_a_huge_directory_read_in_order_lists_only_the_cap_through_a_worker(make_worker, monkeypatch, count):
    """Through a worker and the session's paged listing: the store is asked for about cap/1,000
    listing pages whether the directory holds twenty thousand objects or a million."""
    import cachefs.client.fs.scanahead as scanahead
    import cachefs.testing  # noqa: F401 - registers synthetic://
    from cachefs.config import MountSpec

    monkeypatch.setattr(scanahead, "MAX_LISTING", 5_000)
    worker = make_worker(MountSpec("data", "synthetic://data", {"count": count, "per_dir": count, "size": 16}))
    store_fs = worker.objects.mounts.resolve(CachePath("data", "")).fs
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, scan_ahead=True)
    try:
        for i in range(3):
            assert len(fs.cat_file(f"cachefs://data/d00000/{i:08d}.bin")) == 16
        assert wait_for(lambda: fs._scan.stats["too_large"] == 1, timeout=60)
        assert fs._scan.stats["listed"] == 0
        assert 5 <= store_fs.requests["list_after"] <= 5_000 // 1000 + 2, dict(store_fs.requests)
        assert store_fs.requests["ls"] == store_fs.requests["find"] == 0  # never listed whole
    finally:
        fs.close()
