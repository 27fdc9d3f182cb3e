"""Fork and spawn safety (client/forksafe.py): a child forked while the parent's client is busy
(a lock held, a thread inside gRPC, a socket mid-request, the view stream open, prefetch and
hint threads running) reads correctly within a deadline, and the parent keeps working."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable

import fsspec
import pytest

from cachefs.client import forksafe
from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.forksafe import ForkSafeLock, ProcessLocal
from cachefs.client.fs.hints import Hinter
from cachefs.config import MasterConfig
from cachefs.server.master import Master
from helpers import client, payload, wait_for

PAGE = 64 << 10
CHILD_DEADLINE = 60.0


def _child_reads(conn, fs, paths: list[str], stacks: str) -> None:
    with open(stacks, "w") as out:
        # A wedged child says where: its threads' stacks reach the parent's failure message.
        faulthandler.dump_traceback_later(CHILD_DEADLINE / 2, file=out)
        try:
            conn.send([fs.cat_file(p) for p in paths])
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(exc)
        finally:
            faulthandler.cancel_dump_traceback_later()
            conn.close()


def _fork_and_read(fs, paths: list[str]) -> list[bytes]:
    """Fork now; the child reads ``paths`` through the inherited ``fs`` and sends the bytes back."""
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    fd, stacks = tempfile.mkstemp(prefix="cachefs-fork-child-", suffix=".txt")
    os.close(fd)
    proc = ctx.Process(target=_child_reads, args=(child_end, fs, paths, stacks))
    proc.start()
    child_end.close()
    try:
        if not parent_end.poll(CHILD_DEADLINE):
            proc.kill()
            with open(stacks) as f:
                raise AssertionError(f"the forked child did not answer in {CHILD_DEADLINE:.0f} s; "
                                     f"its stacks:\n{f.read()}")
        got = parent_end.recv()
    finally:
        os.unlink(stacks)
        proc.join(CHILD_DEADLINE)
        if proc.is_alive():
            proc.kill()
    if isinstance(got, BaseException):
        raise AssertionError(f"the child failed: {got!r}") from got
    assert proc.exitcode == 0
    return got


class _Busy:
    """Runs ``work`` in a loop on a few threads until stopped (the parent's readers)."""

    def __init__(self, work: Callable[[], None], threads: int = 3) -> None:
        self._stop = threading.Event()
        self.rounds = 0
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(work,), daemon=True) for _ in range(threads)]

    def _run(self, work: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                work()
                self.rounds += 1
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)
                return

    def __enter__(self) -> "_Busy":
        for t in self._threads:
            t.start()
        assert wait_for(lambda: self.rounds >= 3, timeout=30), "the busy readers never got going"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        assert not self.errors, self.errors


@pytest.fixture
def served(local_store, make_worker):
    objects = {f"obj{i}.bin": payload(3 * PAGE + 17 * i, i) for i in range(6)}
    for key, data in objects.items():
        local_store.add(key, data)
    worker = make_worker(local_store.mount, page_size=PAGE)
    return objects, worker


def _paths(objects: dict[str, bytes]) -> list[str]:
    return [f"cachefs://data/{k}" for k in objects]


@pytest.mark.parametrize("lean", [True, False], ids=["short-circuit", "data-port"])
def test_fork_while_reads_are_in_flight(served, lean):
    """Threads inside gRPC calls and socket exchanges at the moment of the fork; the child reads
    (and fills what is not cached) over the worker's Unix socket or its data port, never gRPC."""
    objects, worker = served
    fs = client(worker.address, short_circuit=lean, data_port=not lean)
    paths = _paths(objects)
    want = list(objects.values())
    with _Busy(lambda: [fs.cat_file(p) for p in paths]):
        for _ in range(3):
            assert _fork_and_read(fs, paths) == want
    assert [fs.cat_file(p) for p in paths] == want  # the parent is undisturbed


def test_fork_while_client_locks_are_held(served):
    """Every lock a client holds, held by another thread at the fork: the child gets fresh ones."""
    objects, worker = served
    fs = client(worker.address)
    paths = _paths(objects)
    assert fs.cat_file(paths[0]) == objects["obj0.bin"]  # state, channels and sockets exist
    state = fs.session._state  # the per-process holder itself, and what it holds
    held = [state._lock, state.get().lock, state.get().bulk._lock, state.get().workers._lock]
    held += [h._lock for h in (state.get().workers.candidates("data/obj0.bin"))]
    for reader, _ in state.get().bulk._readers.values():
        if reader is not None:
            held.append(reader._pool._lock)
    release = threading.Event()
    acquired = threading.Barrier(len(held) + 1, timeout=30)

    def hold(lock: threading.Lock) -> None:
        with lock:
            acquired.wait()
            release.wait(60)

    holders = [threading.Thread(target=hold, args=(lock,), daemon=True) for lock in held]
    for t in holders:
        t.start()
    acquired.wait()
    try:
        assert _fork_and_read(fs, paths) == list(objects.values())
    finally:
        release.set()
        for t in holders:
            t.join(30)


def test_fork_while_hints_and_prefetches_run(served):
    """Hint futures in flight (gRPC completing async calls) and prefetch threads mid-read."""
    objects, worker = served
    paths = _paths(objects)
    ds = CacheDataset(paths * 20, storage_options={"workers": worker.address}, shuffle=False,
                      prefetch_depth=8, prefetch_threads=3, hint_samples=64)
    fs = client(worker.address)
    hinter = Hinter(fs.session, max_in_flight=4, batch=2)
    # One read first, as a training process makes before its DataLoader starts: the child then
    # starts from what this process learnt (no gRPC probe there, which can crash a forked child).
    assert fs.cat_file(paths[0]) == objects["obj0.bin"]

    def work() -> None:
        for i in range(0, len(ds), 7):
            ds[i]
        hinter.reset()
        hinter.hint(paths)

    with _Busy(work, threads=1):
        for _ in range(3):
            assert _fork_and_read(fs, paths) == list(objects.values())


def test_fork_while_the_view_stream_is_open(served, tmp_path):
    """The gRPC view watch (a master without a client port, or TLS) across forks."""
    objects, worker = served
    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "master"),
                                 client_port=False)).start()
    try:
        fs = client(worker.address, master=master.address)
        paths = _paths(objects)
        assert fs.cat_file(paths[0]) == objects["obj0.bin"]
        watcher = fs.session._state.get().watcher
        assert watcher is not None and wait_for(lambda: watcher._call is not None, timeout=30)
        assert _fork_and_read(fs, paths) == list(objects.values())
        assert wait_for(lambda: watcher._call is not None, timeout=30)  # reopened in the parent
    finally:
        master.stop()


def test_spawned_and_unpickled_copies_start_unconnected(served):
    objects, worker = served
    fs = client(worker.address)
    paths = _paths(objects)
    assert fs.cat_file(paths[0]) == objects["obj0.bin"]
    clone = pickle.loads(pickle.dumps(fs.session))
    assert clone._state.peek() is None  # nothing of the original's process state came along
    assert clone.read(fs._path(paths[1]), 0, -1)[0] == objects["obj1.bin"]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_spawned_read, (fs, paths)).get(CHILD_DEADLINE) == list(objects.values())


def _spawned_read(fs, paths: list[str]) -> list[bytes]:
    return [fs.cat_file(p) for p in paths]


# -- the pieces, at unit level ---------------------------------------------------------------------
def test_process_local_builds_once_per_process_and_drops_the_parents_value():
    built: list[int] = []
    released: list[object] = []
    holder = ProcessLocal(lambda: built.append(os.getpid()) or object(), inherited=released.append)
    first = holder.get()
    assert holder.get() is first and built == [os.getpid()]
    holder.after_fork_in_child()  # what the registry runs in a forked child
    assert released == [first] and holder.peek() is None
    assert holder.get() is not first and len(built) == 2
    holder.clear()
    assert holder.peek() is None


def test_a_fork_safe_lock_held_at_fork_is_free_in_the_child():
    lock = ForkSafeLock()
    ctx = multiprocessing.get_context("fork")
    with lock:
        proc = ctx.Process(target=_take_lock, args=(lock,))
        proc.start()
        proc.join(CHILD_DEADLINE)
    assert proc.exitcode == 0


def _take_lock(lock: ForkSafeLock) -> None:
    with lock:
        pass


def test_a_failing_hook_does_not_stop_a_fork():
    class Bad:
        def before_fork(self, deadline: float) -> None:
            raise RuntimeError("boom")

        def after_fork_in_parent(self) -> None:
            raise RuntimeError("boom")

        def after_fork_in_child(self) -> None:
            raise RuntimeError("boom")

    bad = Bad()
    forksafe.register(bad)
    try:
        proc = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
        proc.start()
        proc.join(CHILD_DEADLINE)
        assert proc.exitcode == 0
    finally:
        forksafe.unregister(bad)


def test_rpc_gate_holds_a_fork_until_calls_leave_and_new_calls_until_it_is_done():
    """The gate every session channel goes through (client/transport/workers.py GatedChannel)."""
    gate = forksafe.RpcGate()
    gate.enter()  # a reader thread is inside a gRPC call
    forked = threading.Event()

    def fork() -> None:
        gate.before_fork(time.monotonic() + 30)
        forked.set()

    forker = threading.Thread(target=fork)
    forker.start()
    assert not forked.wait(0.3), "before_fork returned while a call was inside gRPC"
    gate.leave()
    assert forked.wait(30)
    # While the fork is pending, a new call waits...
    entered = threading.Event()
    caller = threading.Thread(target=lambda: (gate.enter(), entered.set()))
    caller.start()
    assert not entered.wait(0.3), "a call went into gRPC while a fork was pending"
    gate.after_fork_in_parent()  # ... until the parent resumes
    assert entered.wait(30)
    gate.leave()
    forker.join(30)
    caller.join(30)
    assert gate.inside == 0


def test_rpc_gate_gives_up_at_the_deadline_and_the_child_starts_clean():
    gate = forksafe.RpcGate()
    gate.enter()  # a call that never leaves (a slow cold read)
    started = time.monotonic()
    gate.before_fork(time.monotonic() + 0.2)
    assert time.monotonic() - started < 5
    gate.after_fork_in_child()
    assert gate.inside == 0
    gate.enter()  # the child's first call is not held by the parent's pending fork
    gate.leave()


def test_session_channels_go_through_the_gate(served):
    objects, worker = served
    fs = client(worker.address, short_circuit=False, data_port=False)
    paths = _paths(objects)
    gate = fs.session.rpc_gate
    seen: list[int] = []
    original = gate.enter

    def counting_enter() -> None:
        original()
        seen.append(gate.inside)

    gate.enter = counting_enter  # type: ignore[method-assign]
    assert fs.cat_file(paths[0]) == objects["obj0.bin"]
    assert seen and max(seen) >= 1 and gate.inside == 0


def test_importing_the_client_changes_no_grpc_setting() -> None:
    """grpcio's fork support hung DataLoader workers at every epoch start: the client must not
    turn it on (it did at import, for processes that imported it before grpc)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    probe = ("import os, cachefs, cachefs.client.fs.filesystem, cachefs.client.datasets.dataset\n"
             "from cachefs.client import forksafe\n"
             "print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'), forksafe.grpc_fork_support())")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "None False"


def _in_forked_child(work: Callable[[], object], meanwhile: Callable[[], object] | None = None) -> object:
    """``work()`` in a forked child: what it returned, or the exception it raised (pickled back).
    ``meanwhile()`` runs in the parent once the child has started."""
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)

    def run() -> None:
        try:
            child_end.send(work())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            child_end.send(exc)

    proc = ctx.Process(target=run)
    proc.start()
    child_end.close()
    try:
        if meanwhile is not None:
            meanwhile()
        assert parent_end.poll(CHILD_DEADLINE), "the forked child did not answer"
        return parent_end.recv()
    finally:
        proc.join(CHILD_DEADLINE)
        if proc.is_alive():
            proc.kill()


def test_a_forked_child_never_calls_grpc(served):
    """A stub or a view watcher asked for in a process forked from one that had loaded gRPC
    raises at once, naming what was asked for; the parent's are untouched."""
    objects, worker = served
    fs = client(worker.address, short_circuit=False, data_port=False)
    assert fs.cat_file(_paths(objects)[0]) == objects["obj0.bin"]  # the parent has a channel open
    handle = fs.session.workers.candidates_all()[0]

    def ask_stub() -> object:
        t0 = time.monotonic()
        try:
            handle.stub()
        except forksafe.GrpcInheritedError as exc:
            return ("raised", str(exc), time.monotonic() - t0)
        return ("no error",)

    got = _in_forked_child(ask_stub)
    assert got[0] == "raised" and worker.address in got[1] and "forked" in got[1] and got[2] < 1.0, got

    from cachefs.client.transport.view import ViewWatcher

    watcher = ViewWatcher("127.0.0.1:1", lambda view: None)
    got = _in_forked_child(lambda: watcher.start())
    assert isinstance(got, forksafe.GrpcInheritedError) and "127.0.0.1:1" in str(got), got
    # Reads with both socket paths off: a precise error at once, not a gRPC call.
    t0 = time.monotonic()
    got = _in_forked_child(lambda: fs.cat_file(_paths(objects)[1]))
    assert isinstance(got, ConnectionError) and "short_circuit and data_port are both off" in str(got), got
    assert time.monotonic() - t0 < 10
    assert fs.cat_file(_paths(objects)[1]) == objects["obj1.bin"]  # the parent still reads through gRPC


# -- DataLoader workers on a worker's host: no gRPC on their data path ------------------------------
def _refuse_grpc_channels(_worker_id: int) -> None:
    """worker_init_fn: any gRPC channel this DataLoader worker opens fails loudly."""
    import grpc

    def refuse(*_args, **_kwargs):
        raise RuntimeError("a DataLoader worker opened a gRPC channel")

    grpc.insecure_channel = refuse
    grpc.secure_channel = refuse


@pytest.mark.parametrize("kind", ["map", "iter"])
def test_dataloader_workers_read_without_a_grpc_channel(local_store, make_worker, tmp_path, kind):
    """A forked child's first gRPC channel can hang (forksafe.py): DataLoader workers on the
    worker's host read cold and warm epochs through the short-circuit socket alone, starting
    from what the main process learnt (SessionBootstrap)."""
    from torch.utils.data import DataLoader

    from cachefs.client.datasets.iterable import CacheIterableDataset
    from cachefs.client.datasets.shards import write_tar_shards

    n = 24
    if kind == "map":
        for i in range(n):
            local_store.add(f"train/{i:05d}.bin", f"{i:05d}".encode() + payload(3000 + i, i))
    else:
        samples = ((f"s/{i:05d}", {"id": f"{i:05d}".encode(), "bin": payload(3000 + i, i)}) for i in range(n))
        write_tar_shards(samples, str(tmp_path / "shards"), shard_bytes=20_000)
        for f in sorted((tmp_path / "shards").iterdir()):
            local_store.add(f"shards/{f.name}", f.read_bytes())
    worker = make_worker(local_store.mount, page_size=PAGE)
    opts = {"workers": worker.address}
    if kind == "map":
        ds = CacheDataset.from_prefix("cachefs://data/train", storage_options=opts, seed=1)
        loader = DataLoader(ds, batch_size=4, sampler=ds.sampler(), num_workers=2, collate_fn=list,
                            timeout=CHILD_DEADLINE, worker_init_fn=_refuse_grpc_channels)

        def ids(batch):
            return [int(bytes(t[:5].numpy()).decode()) for t in batch]
    else:
        ds = CacheIterableDataset.from_prefix("cachefs://data/shards", storage_options=opts, batch_size=4)
        loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=CHILD_DEADLINE,
                            worker_init_fn=_refuse_grpc_channels)

        def ids(sample):  # batch_size=None: one sample (a dict of fields) at a time
            return [int(bytes(sample["id"].numpy()).decode())]
    assert ds._bootstrap is not None and ds._bootstrap.statuses  # learnt in this (main) process
    for _epoch in ("cold", "warm"):
        got = sorted(i for batch in loader for i in ids(batch))
        assert got == list(range(n))


def test_a_session_started_from_a_bootstrap_asks_no_one_before_reading(served, monkeypatch):
    """The view and lean paths handed down are used as they are: no GetView, no probe, and the
    watch opens its channel on its own thread (where, refused here, it only logs)."""
    import grpc

    from cachefs.client.transport.session import ClientSession, SessionBootstrap
    from cachefs.config import ClientConfig
    from cachefs.proto import master_pb2

    objects, worker = served
    parent = client(worker.address)
    boot = parent.session.bootstrap()
    assert [a for a, _ in boot.statuses] == [worker.address]
    view = master_pb2.ClusterView(version=7, master_id="m1", workers=[master_pb2.WorkerInfo(address=worker.address)])
    boot = SessionBootstrap(view.SerializeToString(), boot.statuses)

    def refuse(*_args, **_kwargs):
        raise RuntimeError("opened a gRPC channel")

    monkeypatch.setattr(grpc, "insecure_channel", refuse)
    session = ClientSession(ClientConfig(master="127.0.0.1:1", workers=()), boot)
    try:
        assert session.workers.addresses == [worker.address]  # from the handed-down view
        path = parent._path(_paths(objects)[0])
        assert session.read(path, 0, -1)[0] == objects["obj0.bin"]
        assert session._state.get().bulk.stats["short_circuit"]["reads"] >= 1
    finally:
        session.close()


def test_hints_from_a_forked_process_go_through_the_short_circuit_socket(served):
    """In a process forked from one that used gRPC (forksafe.grpc_inherited), hints to a worker
    on this host go through its short-circuit socket; the worker loads them in the background."""
    objects, worker = served
    fs = client(worker.address)
    paths = _paths(objects)
    assert fs.cat_file(paths[0]) == objects["obj0.bin"]  # gRPC used here: a fork inherits it
    parent_conn, child_conn = multiprocessing.get_context("fork").Pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from cachefs.client.fs.hints import Hinter

            hinter = Hinter(fs.session)
            child_conn.send((forksafe.grpc_inherited(), hinter.hint(paths[1:]), dict(hinter.stats)))
            code = 0
        finally:
            os._exit(code)
    try:
        assert parent_conn.poll(CHILD_DEADLINE)
        inherited, sent, stats = parent_conn.recv()
    finally:
        os.waitpid(pid, 0)
    assert inherited and sent == len(paths) - 1 and stats["sent"] >= 1, stats
    keys = [fs._path(p).key for p in paths[1:]]
    # Loaded by the worker in the background: every hinted object's pages end up cached.
    assert wait_for(lambda: all(worker.pages.holds_object("data", k) for k in keys), timeout=30)


def test_a_forked_child_starts_from_what_its_parent_knew(served):
    """A plain filesystem used in a DataLoader (a user's own Dataset): a child forked after the
    parent read once probes nothing through gRPC; it reads through the short-circuit socket."""
    objects, worker = served
    fs = client(worker.address)
    paths = _paths(objects)
    assert fs.cat_file(paths[0]) == objects["obj0.bin"]  # the parent probed the worker here
    parent_conn, child_conn = multiprocessing.get_context("fork").Pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _refuse_grpc_channels(0)
            child_conn.send([fs.cat_file(p) for p in paths])
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            child_conn.send(repr(exc))
        finally:
            os._exit(code)
    try:
        assert parent_conn.poll(CHILD_DEADLINE)
        got = parent_conn.recv()
    finally:
        os.waitpid(pid, 0)
    assert got == list(objects.values()), got


@pytest.mark.parametrize("short_circuit", [True, False], ids=["short-circuit", "data-port"])
def test_a_forked_child_lists_reads_and_follows_the_view_over_the_sockets(local_store, make_worker, tmp_path,
                                                                          short_circuit):
    """A forked child (no gRPC) lists a directory of more than one reply's worth of entries,
    reads uncached objects, gets precise errors, and learns a worker that joined after the fork
    from the replies of the worker it already knew (their view version), not from the master."""
    many = {f"many/k{i:05d}": payload(16 + i % 7, i) for i in range(2500)}
    for key, data in many.items():
        local_store.add(key, data)
    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "master"),
                                 heartbeat_seconds=0.2)).start()
    try:
        first = make_worker(local_store.mount, master=master.address, page_size=PAGE)
        fs = fsspec.filesystem("cachefs", master=master.address, skip_instance_cache=True,
                               short_circuit=short_circuit, data_port=not short_circuit)
        assert wait_for(lambda: len(fs.session.workers.addresses) == 1, timeout=30)
        assert fs.cat_file("cachefs://data/many/k00000") == many["many/k00000"]

        def child_work() -> object:
            names = fs.ls("cachefs://data/many", detail=False)
            info = fs.info("cachefs://data/many/k00042")
            try:
                fs.info("cachefs://data/many/none")
                missing = "no error"
            except FileNotFoundError as exc:
                missing = str(exc)
            deadline = time.monotonic() + 40
            keys = sorted(many)
            i = 0
            while len(fs.session.workers.addresses) < 2 and time.monotonic() < deadline:
                key = keys[i % len(keys)]
                assert fs.cat_file(f"cachefs://data/{key}") == many[key]
                i += 1
            wrong = [k for k in keys[:300] if fs.cat_file(f"cachefs://data/{k}") != many[k]]
            return len(names), info["size"], missing, sorted(fs.session.workers.addresses), wrong

        joined: list = []  # a worker that joins after the fork
        got = _in_forked_child(child_work, lambda: joined.append(
            make_worker(local_store.mount, master=master.address, page_size=PAGE)))
        second = joined[0]
        assert not isinstance(got, BaseException), repr(got)
        listed, size, missing, workers, wrong = got
        assert listed == len(many)
        assert size == len(many["many/k00042"])
        assert "many/none" in missing
        assert workers == sorted([first.address, second.address])
        assert wrong == []
    finally:
        master.stop()


@pytest.mark.parametrize("short_circuit", [True, False], ids=["short-circuit", "data-port"])
def test_a_forked_child_reads_a_range_larger_than_one_socket_reply(local_store, make_worker, short_circuit):
    """A range of more pages than one socket request carries (MAX_PAGES) was refused, and a
    forked child (no gRPC to take it) asked again for 15 s and failed: it reads it in pieces."""
    big = payload(1 << 20, 7)  # 256 pages of 4 KiB
    local_store.add("big.bin", big)
    worker = make_worker(local_store.mount, page_size=4096)
    fs = client(worker.address, short_circuit=short_circuit, data_port=not short_circuit)
    assert fs.cat_file("cachefs://data/big.bin", start=0, end=4096) == big[:4096]  # the parent probes

    def read() -> object:
        t0 = time.monotonic()
        whole = fs.cat_file("cachefs://data/big.bin")
        part = fs.cat_file("cachefs://data/big.bin", start=1000, end=900_000)
        return whole == big, part == big[1000:900_000], time.monotonic() - t0

    got = _in_forked_child(read)
    assert not isinstance(got, BaseException), repr(got)
    assert got[0] and got[1] and got[2] < 10, got


@pytest.mark.parametrize("short_circuit", [True, False], ids=["short-circuit", "data-port"])
def test_a_forked_child_with_a_wrong_token_fails_at_once(local_store, make_worker, short_circuit):
    """A refusal (a wrong token) is final for a child that has only the worker's sockets: it raises
    PermissionError at once, not after asking again for 15 s on every read."""
    from cachefs.client.transport.session import ClientSession
    from cachefs.config import ClientConfig
    from cachefs.paths import CachePath

    local_store.add("obj.bin", payload(5000, 1))
    worker = make_worker(local_store.mount, page_size=PAGE, access_token="s3cret")
    good = client(worker.address, token="s3cret", short_circuit=short_circuit, data_port=not short_circuit)
    assert good.cat_file("cachefs://data/obj.bin") == payload(5000, 1)
    bad = ClientSession(ClientConfig(workers=(worker.address,), token="wrong", short_circuit=short_circuit,
                                     data_port=not short_circuit), good.session.bootstrap())

    def read() -> object:
        t0 = time.monotonic()
        try:
            bad.read(CachePath("data", "obj.bin"), 0, -1)
        except PermissionError as exc:
            return "PermissionError", str(exc), time.monotonic() - t0
        except BaseException as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return "no error", "", time.monotonic() - t0

    kind, message, seconds = _in_forked_child(read)
    assert kind == "PermissionError" and "token" in message and seconds < 5, (kind, message, seconds)


def test_a_forked_childs_read_ends_within_its_budget_when_its_worker_is_frozen(local_store, make_worker):
    """One deadline per read: a forked child whose only worker stops answering (SIGSTOP-like: its
    sockets accept but nothing replies) gets an error within the read's budget (timeout +
    length / min_throughput) plus a second, not the sum of every step's own bound."""
    local_store.add("obj.bin", payload(5000, 3))
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = client(worker.address, timeout=3, short_circuit=False, data_port=True)
    assert fs.cat_file("cachefs://data/obj.bin") == payload(5000, 3)
    local_store.add("cold.bin", payload(7000, 4))
    server = worker.data_port_server
    server._answer = lambda conn, body: time.sleep(60)  # type: ignore[method-assign]  # wedged

    def read() -> object:
        t0 = time.monotonic()
        try:
            fs.cat_file("cachefs://data/cold.bin", start=0, end=7000)  # budget: 3 s + 7000 B at min_throughput
        except BaseException as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return "no error", "", time.monotonic() - t0

    kind, message, seconds = _in_forked_child(read)
    assert kind == "WorkerUnavailableError" and 2.5 < seconds < 3 + 1 + 0.5, (kind, message, seconds)


def test_a_forked_child_gets_a_view_for_clients_its_parent_never_used(local_store, make_worker, tmp_path):
    """A client made (or first used) in a forked child, where gRPC is off limits, still gets the
    cluster view: from a session of the parent that was never used (fetched for the children just
    before the fork), from the parent's last view of that master (another session's), else from a
    helper interpreter (client/transport/viewfetch.py). A DataLoader worker that builds its filesystem
    lazily does exactly this."""
    from cachefs.client.transport import viewfetch

    local_store.add("obj.bin", payload(6000, 5))
    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "master"))).start()
    try:
        make_worker(local_store.mount, master=master.address, page_size=PAGE)
        unused = fsspec.filesystem("cachefs", master=master.address, skip_instance_cache=True)
        probe = fsspec.filesystem("cachefs", master=master.address, skip_instance_cache=True)
        assert wait_for(lambda: len(probe.session.workers.addresses) == 1, timeout=30)

        def new_client_reads(helper_allowed: bool) -> object:
            if not helper_allowed:
                viewfetch.from_helper_process = lambda *a, **k: (_ for _ in ()).throw(AssertionError("helper"))
            fs = fsspec.filesystem("cachefs", master=master.address, skip_instance_cache=True)
            return fs.cat_file("cachefs://data/obj.bin") == payload(6000, 5)

        # 1. the unused session: its view was fetched for the children before the fork
        assert _in_forked_child(lambda: unused.cat_file("cachefs://data/obj.bin") == payload(6000, 5)) is True
        # 2. a new client in the child: the parent's last view of this master, no helper process
        assert _in_forked_child(lambda: new_client_reads(False)) is True
        # 3. no view of this master in the parent at all: the helper interpreter asks the master
        viewfetch._LAST.clear()
        got = _in_forked_child(lambda: new_client_reads(True))
        assert got is True, repr(got)
    finally:
        master.stop()


def test_a_child_forked_after_a_view_of_no_workers_still_reaches_the_workers(local_store, make_worker, tmp_path):
    """A restarted master's first view lists no workers (they have not re-registered yet): the
    parent keeps routing to the last ones, and a DataLoader worker forked then must start from
    those too, not from the empty view (it read from no one until its DataLoader timed out:
    seen in the chaos soak)."""
    from cachefs.proto import master_pb2

    local_store.add("obj.bin", payload(6000, 6))
    master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "master"))).start()
    try:
        make_worker(local_store.mount, master=master.address, page_size=PAGE)
        fs = fsspec.filesystem("cachefs", master=master.address, skip_instance_cache=True)
        assert wait_for(lambda: len(fs.session.workers.addresses) == 1, timeout=30)
        state = fs.session._state.get()
        state.apply_view(master_pb2.ClusterView(version=state.view.version + (1 << 32), master_id=state.view.master_id))
        assert len(fs.session.workers.addresses) == 1
        got = _in_forked_child(lambda: (len(fs.session.workers.addresses),
                                        fs.cat_file("cachefs://data/obj.bin") == payload(6000, 6)))
        assert got == (1, True), repr(got)
    finally:
        master.stop()


def test_a_worker_that_has_not_had_its_mounts_yet_sends_reads_to_the_next_worker(local_store, make_worker):
    """A worker restarted on its port is sent reads at once by clients that knew it, before its
    first mount sync with the master: a mount it does not have yet is its own fault (the next
    worker is tried), not a FileNotFoundError for the caller (3 reads failed so in a 10-minute
    chaos soak), in the main process (gRPC) and in a forked child (sockets)."""
    import socket as socket_module

    with socket_module.socket() as dead:  # a master that never answers: the mounts never come
        dead.bind(("127.0.0.1", 0))
        waiting = make_worker(master=f"127.0.0.1:{dead.getsockname()[1]}", page_size=PAGE)
        healthy = make_worker(local_store.mount, page_size=PAGE)
        fs = client(waiting.address, healthy.address)
        # Objects placed first on the waiting worker (and a few on the other), whatever the ports.
        first = {f"obj{i}.bin": fs.session.candidates(f"data/obj{i}.bin")[0].address for i in range(64)}
        keys = [k for k, a in first.items() if a == waiting.address][:8] + \
            [k for k, a in first.items() if a == healthy.address][:4]
        assert any(first[k] == waiting.address for k in keys)
        objects = {key: payload(3000 + i, 50 + i) for i, key in enumerate(keys)}
        for key, data in objects.items():
            local_store.add(key, data)
        paths = _paths(objects)
        assert [fs.cat_file(p) for p in paths] == list(objects.values())
        assert fs.info(paths[0])["size"] == len(objects[keys[0]])
        got = _in_forked_child(lambda: ([fs.cat_file(p) for p in paths] == list(objects.values()),
                                        fs.info(paths[1])["size"], len(fs.ls("cachefs://data"))))
        assert got == (True, len(objects[keys[1]]), len(objects)), repr(got)


def test_a_fork_with_grpc_fork_support_on_warns_once() -> None:
    """With GRPC_ENABLE_FORK_SUPPORT=1 in the environment (the client no longer sets it) grpc's
    at-fork handler can hang DataLoader workers: a fork through the client says so, once."""
    import subprocess
    import sys

    probe = ("import logging, os, time\n"
             "logging.basicConfig(level=logging.WARNING)\n"
             "import grpc\n"
             "from cachefs.client import forksafe\n"
             "gate = forksafe.RpcGate()\n"
             "for _ in range(2):\n"
             "    pid = os.fork()\n"
             "    if pid == 0:\n"
             "        os._exit(0)\n"
             "    os.waitpid(pid, 0)\n")
    said = {}
    for value in ("1", "0"):
        env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": value}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        said[value] = done.stderr.count("fork support on")
    assert said == {"1": 1, "0": 0}, said
