"""The client session (client/transport/session.py): what every interface reads through; options listed
once; no network I/O until first use; lean-path failures that never fail a read."""

from __future__ import annotations

import time

import logging
import socket

import pytest

from cachefs.client.transport import bulkpaths
from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.client.datasets.iterable import CacheIterableDataset
from cachefs.client.transport.shortcircuit import ShortCircuitReader
from cachefs.config import ClientConfig, client_option_names
from helpers import client, payload, wait_for

PAGE = 64 << 10


def test_constructing_a_filesystem_connects_to_nothing():
    """As s3fs: the first call connects. A listening socket sees no connection until then."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(30)
        address = "127.0.0.1:%d" % listener.getsockname()[1]
        fs = CacheFileSystem(master=address, skip_instance_cache=True, timeout=2)
        assert fs.session._state.peek() is None  # no channel, watcher or socket was made
        with pytest.raises(OSError):
            fs.info("cachefs://data/x")  # the first call: it dials the master (which never answers gRPC)
        conn, _ = listener.accept()  # and now a connection did arrive
        conn.close()
        fs.close()


def test_unknown_options_are_refused_and_known_ones_come_from_one_list(monkeypatch):
    with pytest.raises(TypeError, match="unknown cachefs client option.*'mastre'"):
        CacheFileSystem(mastre="h:1", skip_instance_cache=True)
    with pytest.raises(TypeError, match="keyword options only"):
        CacheFileSystem("h:1", skip_instance_cache=True)
    # Every ClientConfig field is a storage option and a CACHEFS_<NAME> variable.
    assert {"master", "workers", "timeout", "fallback", "short_circuit", "data_port"} <= client_option_names()
    monkeypatch.setenv("CACHEFS_WORKERS", "a:1,b:2")
    monkeypatch.setenv("CACHEFS_TIMEOUT", "7.5")
    monkeypatch.setenv("CACHEFS_BLOCK_SIZE", "1MiB")
    fs = CacheFileSystem(skip_instance_cache=True, min_throughput="1MB")
    assert fs.config.workers == ("a:1", "b:2") and fs.config.timeout == 7.5
    assert fs.config.block_size == 1 << 20 and fs.config.min_throughput == 10**6
    assert CacheFileSystem(skip_instance_cache=True, timeout=3).config.timeout == 3  # options win over env
    with pytest.raises(ValueError, match="timeout"):
        CacheFileSystem(skip_instance_cache=True, timeout="soon")
    assert ClientConfig.from_options({"fallback_mounts": '{"d": "memory://x"}'}, environ={"CACHEFS_WORKERS": "h:1"}
                                     ).fallback_mounts == {"d": "memory://x"}


def test_datasets_take_fsspec_style_keywords(local_store, make_worker):
    for i in range(4):
        local_store.add(f"train/{i}.bin", payload(100 + i, i))
    worker = make_worker(local_store.mount, page_size=PAGE)
    ds = CacheDataset.from_prefix("cachefs://data/train", workers=worker.address, shuffle=False, timeout=60)
    assert len(ds) == 4 and ds.storage_options == {"workers": worker.address} and ds.timeout == 60
    assert bytes(ds.read(2).numpy()) == local_store.objects["train/2.bin"]
    with pytest.raises(TypeError, match="both"):
        CacheDataset.from_prefix("cachefs://data/train", workers=worker.address,
                                 storage_options={"workers": worker.address})
    with pytest.raises(TypeError, match="frobnicate"):
        CacheDataset.from_prefix("cachefs://data/train", workers=worker.address, frobnicate=1)
    with pytest.raises(TypeError):
        CacheIterableDataset.from_prefix("cachefs://data/train", workers=worker.address, frobnicate=1)


class _Broken(Exception):
    pass


@pytest.mark.parametrize("failure", [_Broken("a bug"), ValueError("undecodable reply"), ConnectionResetError()])
def test_any_lean_path_failure_reads_through_grpc_counted_and_warned_once(local_store, make_worker, monkeypatch,
                                                                            caplog, failure):
    data = payload(3 * PAGE + 5, 4)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = client(worker.address, data_port=False)
    assert fs.cat_file("cachefs://data/obj") == data
    assert wait_for(lambda: fs.cat_file("cachefs://data/obj") == data
                    and fs.session.bulk_stats["short_circuit"]["reads"] >= 1, timeout=30)

    def fail(self, *args, **kwargs):
        raise failure

    monkeypatch.setattr(ShortCircuitReader, "read", fail)
    monkeypatch.setattr(bulkpaths, "PROBE_RETRY", 0.0)  # ask again at once, so every read meets the failure
    monkeypatch.setattr(bulkpaths, "AWAY_RETRY", 0.0)  # also after a reset connection (a worker away)
    caplog.set_level(logging.DEBUG, logger="cachefs.client.transport.bulkpaths")
    for _ in range(3):
        assert fs.cat_file("cachefs://data/obj") == data
    stats = fs.session.bulk_stats["short_circuit"]
    assert stats["errors"] == 3 and stats["fallbacks"] >= 3
    # This worker's only (a dataset of an earlier test in this process may still renew its plan
    # with a worker stopped since, and say so).
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.getMessage()
                and worker.address in r.getMessage()]
    assert len(warnings) == 1
    assert type(failure).__name__ in warnings[0].getMessage()


@pytest.mark.parametrize("fallback", [False, True])
def test_a_store_outage_reaches_the_caller_and_opens_no_workers_breaker(make_worker, fallback):
    """The worker is fine, the store behind it is not: a store error (told by the error detail,
    not its text), raised at the first worker, with every worker's breaker still closed."""
    from cachefs.errors import StoreUnavailableError, fault_of
    from cachefs.mounts import MountSpec

    with socket.socket() as dead:  # bound, never listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://127.0.0.1:{dead.getsockname()[1]}",
                   "client_kwargs": {"region_name": "us-east-1"}, "config_kwargs": {"retries": {"max_attempts": 1}}}
        mount = MountSpec("data", "s3://bucket", options)
        workers = [make_worker(mount, page_size=PAGE) for _ in range(3)]
        fs = client(*(w.address for w in workers), fallback=fallback, fallback_mounts={"data": "memory://unused"},
                    timeout=20)
        for i in range(3):
            with pytest.raises(StoreUnavailableError) as caught:
                fs.cat_file(f"cachefs://data/obj{i}")
            assert fault_of(caught.value) == "store" and caught.value.grpc_code.name == "UNAVAILABLE"
        handles = [h for key in ("data/obj0", "data/obj1", "data/obj2") for h in fs.session.candidates(key)]
        assert handles and all(h.breaker.failures == 0 and h.breaker.available() for h in handles)


def test_remembered_placement_follows_the_ring_and_its_changes():
    """WorkerSet remembers each stripe's ring order per view: the same order as the ring, and a
    new view (a worker gone) is never answered from the old view's memo."""
    from cachefs.client.transport.workers import WorkerSet
    from cachefs.ring import RingConfig

    config = RingConfig(stripe_size=1 << 20)
    workers = WorkerSet([f"127.0.0.1:{p}" for p in (1001, 1002, 1003)], config,
                        connect=lambda address: None)  # never dialled here
    keys = [f"m/obj{i}" for i in range(50)]
    for key in keys * 2:  # the second pass is answered from the memo
        for offset in (0, 5 << 20):
            assert [h.address for h in workers.candidates(key, offset)] == \
                workers.ring.nodes_for_offset(key, offset, 3)
    gone = workers.candidates(keys[0])[0].address
    workers.update([a for a in workers.addresses if a != gone], config)
    for key in keys:
        ranked = [h.address for h in workers.candidates(key)]
        assert gone not in ranked and ranked == workers.ring.nodes_for_offset(key, 0, 2)
    workers.update([workers.addresses[0]], config)
    assert [h.address for h in workers.candidates(keys[3], 7 << 20)] == workers.addresses


def test_first_healthy_answers_a_batch_as_candidates_does_one_read_at_a_time():
    from cachefs.client.transport.workers import WorkerSet
    from cachefs.ring import RingConfig

    config = RingConfig(stripe_size=1 << 20)
    workers = WorkerSet([f"127.0.0.1:{p}" for p in (1001, 1002, 1003)], config, connect=lambda address: None)
    reads = [(f"m/obj{i}", offset) for i in range(40) for offset in (0, 3 << 20)]

    def expected():
        return [(workers.candidates(k, o, include_broken=False) or [None])[0] for k, o in reads]

    assert workers.first_healthy(reads) == expected()
    broken = workers.candidates("m/obj0")[0]
    for _ in range(10):
        broken.breaker.record_failure()
    assert not broken.breaker.available(time.monotonic())
    got = workers.first_healthy(reads)
    assert got == expected() and broken not in got and None not in got
    workers.update([broken.address], config)  # the only worker left is the broken one
    assert workers.first_healthy(reads[:3]) == [None, None, None]


def test_a_busy_worker_is_back_on_the_lean_path_within_a_second(local_store, make_worker, monkeypatch):
    """A connection refused because the worker is busy (a full backlog: BlockingIOError; its
    connection limit) or a request that timed out once is not a wedged worker: its lean path is
    asked again after LEAN_RETRY_FIRST (doubling while it keeps failing), not after a minute on gRPC."""
    data = payload(3 * PAGE + 5, 5)
    local_store.add("obj", data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = client(worker.address, data_port=False, short_circuit_handles=0, short_circuit_by_name=False)
    assert fs.cat_file("cachefs://data/obj") == data
    assert wait_for(lambda: fs.cat_file("cachefs://data/obj") == data
                    and fs.session.bulk_stats["short_circuit"]["reads"] >= 1, timeout=30)
    real_read = ShortCircuitReader.read
    busy = [BlockingIOError(11, "Resource temporarily unavailable"), TimeoutError("timed out")]

    def busy_once(self, *args, **kwargs):
        if busy:
            raise busy.pop(0)
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(ShortCircuitReader, "read", busy_once)
    for _ in range(2):
        before = fs.session.bulk_stats["short_circuit"]["reads"]
        assert fs.cat_file("cachefs://data/obj") == data  # through gRPC: the lean path just failed
        assert fs.session.bulk_stats["short_circuit"]["reads"] == before
        time.sleep(bulkpaths.LEAN_RETRY_FIRST * 2 + 0.2)
    before = fs.session.bulk_stats["short_circuit"]["reads"]
    assert fs.cat_file("cachefs://data/obj") == data
    assert fs.session.bulk_stats["short_circuit"]["reads"] == before + 1


def _worker_rpcs(worker) -> dict[str, float]:
    """The worker's gRPC calls so far, by method."""
    out: dict[str, float] = {}
    for family in worker.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "cachefs_worker_requests_total":
                out[sample.labels["method"]] = out.get(sample.labels["method"], 0) + sample.value
    return out


@pytest.mark.parametrize("path", ["short_circuit", "data_port"])
def test_a_main_process_reads_and_lists_over_the_workers_sockets(local_store, make_worker, path):
    """Info, listings and reads, cold and warm, go over the worker's own sockets in a process
    that may use gRPC too (the client protocol's first operations moved): the worker answers
    no gRPC call but the one GetStatus that finds its sockets."""
    objects = {f"d/o{i}": payload(3 * 65536 + i, 40 + i) for i in range(5)}
    for key, data in objects.items():
        local_store.add(key, data)
    worker = make_worker(local_store.mount, page_size=65536)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=path == "short_circuit")
    try:
        assert fs.info("cachefs://data/d/o1")["size"] == len(objects["d/o1"])
        assert sorted(fs.ls("cachefs://data/d")) == sorted(f"data/{k}" for k in objects)
        assert sorted(fs.find("cachefs://data/")) == sorted(f"data/{k}" for k in objects)
        for _ in range(2):  # cold (filled by the worker in the same request), then warm
            for key, data in objects.items():
                assert fs.cat_file(f"cachefs://data/{key}") == data
                assert fs.cat_file(f"cachefs://data/{key}", 100, 70000) == data[100:70000]
        with pytest.raises(FileNotFoundError):
            fs.cat_file("cachefs://data/d/missing")
        with pytest.raises(FileNotFoundError):
            fs.info("cachefs://data/d/missing")
        rpcs = _worker_rpcs(worker)
        assert set(rpcs) <= {"GetStatus"}, (rpcs, fs.session.bulk_stats)
        assert fs.session.bulk_stats[path]["reads"] >= 2 * 2 * len(objects)
    finally:
        fs.close()


def test_a_frozen_worker_costs_a_main_process_call_its_budget_once(tmp_path):
    """One budget per call (``timeout`` for metadata, the read timeout for a read): the worker's
    socket and then gRPC are both tried within it, so a call to a frozen worker ends within
    budget + 1 s with a precise error (before: each path, and each try, had a budget of its own)."""
    import os
    import signal

    from cachefs.errors import WorkerUnavailableError
    from cachefs.local import worker_process

    store = tmp_path / "store"
    store.mkdir()
    for name in ("warm", "cold", "other"):  # each in a directory of its own: no listing answers for another
        (store / name).mkdir()
        (store / name / name).write_bytes(payload(100_000, len(name)))
    with worker_process({"data": str(store)}, str(tmp_path / "cache")) as worker:
        fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, timeout=2.0, fallback=False,
                             scan_ahead=False)
        try:
            assert fs.cat_file("cachefs://data/warm/warm") == payload(100_000, 4)  # sockets probed, connected
            os.kill(worker.pid, signal.SIGSTOP)
            try:  # stopped once the kernel says so (a request already in hand may still be answered)
                assert wait_for(lambda: open(f"/proc/{worker.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T",
                                timeout=10, interval=0.02)
                for what, call in [("info", lambda: fs.info("cachefs://data/cold/cold", refresh=True)),
                                   ("ls", lambda: fs.ls("cachefs://data/cold/", refresh=True)),
                                   ("read", lambda: fs.cat_file("cachefs://data/other/other", 0, 100_000))]:
                    started = time.monotonic()
                    try:
                        got = call()
                    except (TimeoutError, WorkerUnavailableError):
                        pass
                    else:
                        pytest.fail(f"{what} answered from a frozen worker: {got!r:.200}")
                    took = time.monotonic() - started
                    budget = fs.session.read_timeout(100_000)
                    assert took <= budget + 1.0, (what, took, budget)
            finally:
                os.kill(worker.pid, signal.SIGCONT)
        finally:
            fs.close()
