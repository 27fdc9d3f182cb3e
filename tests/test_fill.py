"""Cold ranges filled over the short-circuit socket (server/worker/fill.py): the worker fetches
them into its page store and hands out the page files; what it cannot fill now (too many fills
at once, too late) is answered NOT_CACHED and the read goes through gRPC; what it cannot fill at
all (an object missing from the store) is answered FAILED with its errno, which a process that
keeps to the socket (a DataLoader worker) raises at once, and gRPC reports as usual elsewhere."""

from __future__ import annotations

import errno

import pytest

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.proto import shortcircuit_pb2
from helpers import payload, store_requests

PAGE = 64 << 10
RangeReply = shortcircuit_pb2.RangeReply


def _fs(worker, **kw) -> CacheFileSystem:
    return CacheFileSystem(workers=worker.address, skip_instance_cache=True, **kw)


def _fills(worker) -> dict[str, float]:
    """cachefs_worker_fill_ranges_total by outcome."""
    return {sample.labels["outcome"]: sample.value for family in worker.metrics.fill_ranges.collect()
            for sample in family.samples if sample.name.endswith("_total")}


def test_a_batch_of_cold_objects_is_filled_in_one_message(store, make_worker):
    objects = {f"b/{i}": payload(PAGE + 100 * i, 50 + i) for i in range(12)}
    for key, data in objects.items():
        store.add(key, data)
    worker = make_worker(store.mount, page_size=PAGE)
    fs = _fs(worker)
    paths = [f"cachefs://data/{k}" for k in objects]
    fs.info(paths[0])  # probe: the worker is on this host
    reader = fs.session._state.get().bulk._readers[worker.address][0]
    sent = []
    inner = reader._exchange
    reader._exchange = lambda request, *more: sent.append(request) or inner(request, *more)
    assert fs.prepare([(p, 0, None) for p in paths]) == len(paths)
    # One message for the batch (a new process may send its hello alone before it: with the name
    # index, a warm batch needs no descriptors at all).
    with_ranges = [r for r in sent if r.ranges]
    assert len(with_ranges) == 1 and len(with_ranges[0].ranges) == len(paths)
    assert all(r.fill for r in with_ranges[0].ranges)
    assert all(r.hello for r in sent if not r.ranges) and len(sent) <= 2
    assert _fills(worker)["filled"] == len(paths)
    asked = len(sent)
    got = fs.cat(paths)
    assert len(got) == len(paths) and sorted(got.values()) == sorted(objects.values())
    assert len(sent) == asked  # every read through the descriptors the fill handed out (or by name)
    assert worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") \
        == sum(map(len, objects.values()))  # each fetched once


def test_too_many_fills_at_once_read_through_grpc(store, make_worker):
    data = payload(3 * PAGE, 60)
    store.add("busy", data)
    worker = make_worker(store.mount, page_size=PAGE)
    filler = worker.short_circuit.filler
    taken = 0
    while filler._slots.acquire(blocking=False):  # every fill slot busy
        taken += 1
    try:
        fs = _fs(worker)
        assert fs.cat_file("cachefs://data/busy") == data  # NOT_CACHED, then gRPC
        assert fs.session.bulk_stats["short_circuit"]["fallbacks"] == 1
        assert _fills(worker)["busy"] >= 1 and _fills(worker).get("filled", 0) == 0
    finally:
        for _ in range(taken):
            filler._slots.release()


def test_a_range_that_cannot_be_filled_gets_grpcs_error(store, make_worker):
    worker = make_worker(store.mount, page_size=PAGE)
    fs = _fs(worker)
    with pytest.raises(FileNotFoundError):
        fs.cat_file("cachefs://data/nothing-here")
    assert _fills(worker)["failed"] == 1


def test_a_missing_object_is_failed_for_good_and_a_forked_reader_raises_at_once(store, make_worker, monkeypatch):
    """A DataLoader worker (gRPC inherited over a fork: it keeps to the socket) used to ask again
    for 15 s before giving up on an object that is not in the store; now the first answer says
    why, and the read raises it."""
    from cachefs.client import forksafe

    store.add("probe", payload(100, 81))
    worker = make_worker(store.mount, page_size=PAGE)
    fs = _fs(worker)
    fs.info("cachefs://data/probe")  # probe: the worker is on this host
    reader = fs.session._state.get().bulk._readers[worker.address][0]
    replies = []
    inner = reader._exchange

    def exchange(request, *more):
        message, fds = inner(request, *more)
        replies.append(shortcircuit_pb2.ShortCircuitReply.FromString(message))
        return message, fds

    reader._exchange = exchange
    assert reader.request([("data/nothing-here", 0, -1, "")]) == [None]
    got = replies[-1].ranges[0]
    assert got.code == RangeReply.FAILED and got.errno == errno.ENOENT and "nothing-here" in got.message
    monkeypatch.setattr(forksafe, "grpc_inherited", lambda: True)
    asked = len(replies)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        reader.read("data/nothing-here", 0, -1, "")
    assert len(replies) == asked + 1  # one request, no asking again (it used to for 15 s)
    # The verdict is the latest reply's, not remembered against the path: once the object is
    # there, it reads.
    store.add("nothing-here", payload(PAGE, 80))
    assert reader.read("data/nothing-here", 0, -1, "")[0] == store.objects["nothing-here"]


def test_held_pages_stay_within_their_share_of_the_quota(local_store, make_worker):
    """Held pages cannot be evicted for room: past max_held_fraction of the quota, pages are
    handed out for one read, so cold reads of more than the quota still cache and evict."""
    quota = 8 * (PAGE + 32)
    for i in range(12):
        local_store.add(f"q/{i}", payload(PAGE, 70 + i))
    worker = make_worker(local_store.mount, page_size=PAGE, quota=quota, max_held_fraction=0.25)
    fs = _fs(worker)
    for i in range(12):
        assert fs.cat_file(f"cachefs://data/q/{i}") == local_store.objects[f"q/{i}"]
        assert worker.pages.held_bytes() <= quota * 0.25
    stats = worker.pages.stats()
    assert stats.evictions > 0 and stats.put_failures == 0 and stats.used_bytes <= quota
    assert _fills(worker)["filled"] == 12


def test_a_cold_range_of_many_pages_is_one_store_request(store, make_worker):
    """Not runs of fetch_group_pages fetched in parallel: a store that reads the whole object for
    each ranged GET (moto, and any store billing per request) would do that work once per run."""
    data = payload(20 * PAGE + 5, 77)
    store.add("big", data)
    worker = make_worker(store.mount, page_size=PAGE, fetch_group_pages=4)
    fs = _fs(worker)
    assert fs.cat_file("cachefs://data/big") == data
    requests = store_requests(worker)
    # the cold open's GET brings the metadata and the first pages, one more request the rest
    assert sum(requests.values()) <= 2, requests
    assert worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") == len(data)


def test_a_cold_read_through_grpc_asks_the_store_for_the_rest_at_once(store, make_worker):
    """A reader on another host (gRPC blocks): the first block's GET brings the metadata, the
    rest of the read is one more request (the block's ``then``), not one per block or run."""
    data = payload(100 * PAGE + 9, 78)  # more than one block (MAX_BLOCK, 4 MiB)
    store.add("remote", data)
    worker = make_worker(store.mount, page_size=PAGE, fetch_group_pages=4, parallel_pages=4)
    fs = _fs(worker, short_circuit=False, data_port=False)
    assert fs.cat_file("cachefs://data/remote") == data
    requests = store_requests(worker)
    assert sum(requests.values()) <= 3, requests  # the open, the first block's run, the rest
    assert worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") == len(data)


def test_known_objects_are_filled_in_groups_and_cold_ones_written_where_fetched(
        store, make_worker, monkeypatch):
    """A fill resolves objects whose metadata is not known (a GET each, side by side on the fill
    pool); small ranges of known objects go to the pool in groups (one task for up to
    GROUP_RANGES of them, #47), never fetched on the request's own thread. The pages a fill's GET
    brings with the metadata (S3: one GET for both) are written on that thread, not queued to a
    writer: the fill waits for them to be cached anyway; so are a small range's pages fetched
    after its metadata (a local file: a stat, then the read): no fetch pool, no writer (#47)."""
    import threading

    from cachefs.paths import parse_path

    objects = {f"k/{i}": payload(PAGE // 2, 70 + i) for i in range(8)}
    for key, data in objects.items():
        store.add(key, data)
    worker = make_worker(store.mount, page_size=PAGE)
    for key in list(objects)[:4]:  # metadata known, nothing cached
        worker.objects.info(parse_path(f"data/{key}"))
    ran: list[tuple[str, str]] = []
    fill_one = worker.filler._fill_one
    monkeypatch.setattr(worker.filler, "_fill_one", lambda wanted, *a: (
        ran.append((wanted.path, threading.current_thread().name)), fill_one(wanted, *a))[1])
    queued: list = []
    queue_write = worker.reader._queue_write
    monkeypatch.setattr(worker.reader, "_queue_write", lambda pid, *a: (queued.append(pid), queue_write(pid, *a))[1])
    ranges = [shortcircuit_pb2.RangeRequest(path=f"data/{key}", offset=0, length=len(data), fill=True)
              for key, data in objects.items()]
    caller = threading.current_thread().name
    assert worker.filler.fill(ranges)
    assert _fills(worker)["filled"] == len(objects)
    where = dict(ran)
    assert all(where[f"data/{k}"].startswith("cachefs-fill") for k in objects)
    assert len({where[f"data/{k}"] for k in list(objects)[:4]}) == 1  # the known four: one task
    assert caller not in where.values()
    assert not queued  # every page written where it was fetched, known objects' and cold ones'
    fs = _fs(worker)
    assert fs.cat([f"cachefs://data/{k}" for k in objects]) == {f"data/{k}": d for k, d in objects.items()}
    assert worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") \
        == sum(map(len, objects.values()))  # each fetched once


def test_a_hinted_load_writes_small_listed_objects_where_it_resolves_them(store, make_worker, monkeypatch):
    """#47: a hinted load of small objects whose metadata a listing brought fetches and writes each
    on the thread that resolves it (no fetch pool, no writer), and reports them loaded, fetched by
    this load; a second load finds them cached (skipped, nothing fetched)."""
    import time

    from cachefs.paths import parse_path

    objects = {f"h/{i}": payload(PAGE // 4 + i, 90 + i) for i in range(6)}
    for key, data in objects.items():
        store.add(key, data)
    worker = make_worker(store.mount, page_size=PAGE)
    assert len(worker.objects.list(parse_path("data/h"))) == len(objects)  # metadata known, nothing cached
    queued: list = []
    queue_write = worker.reader._queue_write
    monkeypatch.setattr(worker.reader, "_queue_write", lambda pid, *a: (queued.append(pid), queue_write(pid, *a))[1])
    paths = [f"data/{k}" for k in objects]
    got = worker.servicer.load_objects(paths, time.monotonic() + 30, True)
    assert (got.objects_loaded, list(got.failed)) == (len(objects), [])
    assert got.bytes_loaded == sum(map(len, objects.values())) and got.bytes_skipped == 0
    assert not queued
    again = worker.servicer.load_objects(paths, time.monotonic() + 30, True)
    assert (again.objects_loaded, again.bytes_loaded, again.bytes_skipped) == \
        (len(objects), 0, sum(map(len, objects.values())))
    assert _fs(worker).cat([f"cachefs://{p}" for p in paths]) == {p: objects[p[5:]] for p in paths}
    assert worker.metrics.registry.get_sample_value("cachefs_worker_bytes_from_store_total") \
        == sum(map(len, objects.values()))  # each fetched once


def test_pages_a_cold_open_brings_are_counted_as_misses(store, make_worker):
    """An object whose metadata the worker does not have is opened with one GET that brings its
    first pages too: those pages were fetched for this read, and the client's counters say so (a
    cold epoch of a data set whose listing the worker did not remember reported every read a hit)."""
    objects = {f"m/{i}": payload(1000 + i, 70 + i) for i in range(6)}
    for key, data in objects.items():
        store.add(key, data)
    worker = make_worker(store.mount, page_size=PAGE)
    fs = _fs(worker)
    paths = [f"cachefs://data/{k}" for k in objects]
    got = fs.cat(paths)
    assert sorted(got.values()) == sorted(objects.values())
    stats = fs.session.counters()
    assert stats["short_circuit_misses"] == len(paths) and stats["short_circuit_hits"] == 0, stats
    fs.cat(paths)  # warm: hits now
    assert fs.session.counters()["short_circuit_hits"] + fs.session.counters()["named_hits"] >= len(paths)
