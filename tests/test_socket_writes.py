"""Writes, removals, copies and directories over the workers' sockets (the data port's streamed
writes, the mutations of server/worker/metaops.py): a training process that writes (outputs,
logs, checkpoints) needs no gRPC either, and a forked child that must not touch gRPC can write.

The user's case runs as the README runs it: ``cachefs local`` as a command, the script in a
process of its own importing only cachefs and fsspec. The protocol's edges (a part too large, a
write cut off, too many writes at once, a wrong token, a read-only mount) are driven on the wire
against an in-process worker.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cachefs.mounts import MountSpec
from cachefs.proto import common_pb2, dataport_pb2
from cachefs.server.worker.dataport import MAX_WRITE_PART, MAX_WRITES
from helpers import local_master, stop_local, wait_for

Reply = dataport_pb2.DataReply
FRAME = struct.Struct(">I")

USER_WRITES = textwrap.dedent('''
    import json, os, sys
    import cachefs, fsspec

    fs = fsspec.filesystem("cachefs", master=sys.argv[1])
    out = {}
    big = os.urandom((9 << 20) + 123)  # three parts
    fs.pipe_file("data/out/big.bin", big)
    out["pipe"] = fs.cat_file("data/out/big.bin") == big
    with fs.open("data/out/f.bin", "wb") as f:
        f.write(b"x" * 100)
        f.write(b"y" * (5 << 20))
    out["open_wb"] = fs.cat_file("data/out/f.bin") == b"x" * 100 + b"y" * (5 << 20)
    try:
        with fs.open("data/out/never.bin", "wb") as f:
            f.write(b"z" * (6 << 20))  # a part went out already
            raise RuntimeError("the producer failed")
    except RuntimeError:
        pass
    out["abandoned_unpublished"] = not fs.exists("data/out/never.bin")
    fs.mkdir("data/out/sub")
    fs.cp_file("data/out/f.bin", "data/out/sub/g.bin")
    out["copy"] = fs.cat_file("data/out/sub/g.bin") == b"x" * 100 + b"y" * (5 << 20)
    fs.rm("data/out/f.bin")
    out["rm"] = not fs.exists("data/out/f.bin")
    fs.put_file(sys.argv[2], "data/out/put.bin")
    out["put"] = fs.cat_file("data/out/put.bin") == open(sys.argv[2], "rb").read()
    try:
        fs.rm("data/out/no-such-object")
        out["missing_rm"] = "no error"
    except FileNotFoundError:
        out["missing_rm"] = "FileNotFoundError"
    print(json.dumps({"grpc_before": "grpc" in sys.modules}), flush=True)
    # A child forked after the parent loaded gRPC must never touch it: it writes over the socket.
    import grpc  # noqa: F401 - what a parent using gRPC would have loaded
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child = fsspec.filesystem("cachefs", master=sys.argv[1], skip_instance_cache=True)
            child.pipe_file("data/out/from-child.bin", b"child" * 1000)
            code = 0 if child.cat_file("data/out/from-child.bin") == b"child" * 1000 else 2
        finally:
            os._exit(code)
    out["child_exit"] = os.waitpid(pid, 0)[1]
    out["child_wrote"] = fs.cat_file("data/out/from-child.bin") == b"child" * 1000
    fs.rm("data/out", recursive=True)
    out["rm_recursive"] = not fs.exists("data/out/big.bin") and not fs.exists("data/out/sub/g.bin")
    print(json.dumps(out), flush=True)
''')


def test_a_user_script_writes_copies_and_removes_without_grpc(tmp_path: Path):
    """Every write operation of the fsspec API against ``cachefs local`` as the README starts it,
    from a process that imports only cachefs and fsspec: the bytes land in the store, an
    abandoned write publishes nothing, a recursive removal is seen by every worker (each had
    metadata of objects under it), and no gRPC is loaded until the script itself imports it
    (to fork a child that must not use it, which then writes over the data port)."""
    data = tmp_path / "data"
    data.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_")) and k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "2", "--mount",
                             f"data={data}", "--dir", str(tmp_path / "cluster")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        master = local_master(proc, timeout=90)
        script = tmp_path / "writes.py"
        script.write_text(USER_WRITES)
        local = tmp_path / "local.bin"
        local.write_bytes(os.urandom(300_000))
        done = subprocess.run([sys.executable, str(script), master, str(local)], capture_output=True, text=True,
                              timeout=180, env=env, cwd=tmp_path)
    finally:
        stop_local(proc)
    assert done.returncode == 0, f"the script failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"grpc_before": False}, "writing loaded gRPC"
    assert lines[1] == {"pipe": True, "open_wb": True, "abandoned_unpublished": True, "copy": True, "rm": True,
                        "put": True, "missing_rm": "FileNotFoundError", "child_exit": 0, "child_wrote": True,
                        "rm_recursive": True}
    assert not (data / "out").exists() and not list(data.iterdir())


# -- the protocol on the wire ---------------------------------------------------------------------------
def _connect(worker) -> socket.socket:
    return socket.create_connection(("127.0.0.1", worker.data_port), timeout=10)


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _part(sock: socket.socket, data: bytes = b"", token: str = "", **fields) -> Reply:
    body = dataport_pb2.DataRequest(token=token, write=dataport_pb2.WritePart(length=len(data), **fields))
    raw = body.SerializeToString()
    sock.sendall(FRAME.pack(len(raw)) + raw + data)
    (size,) = FRAME.unpack(_recv(sock, 4))
    return Reply.FromString(_recv(sock, size))


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_parts_then_commit_publish_and_only_the_commit_does(local_store, make_worker, tmp_path):
    worker = make_worker(local_store.mount)
    root = Path(local_store.mount.url)
    sock = _connect(worker)
    assert not _part(sock, b"a" * 1000, path="data/w.bin", size_hint=3000).meta.error_code
    assert not _part(sock, b"b" * 2000).meta.error_code
    assert not (root / "w.bin").exists(), "published before the commit"
    reply = _part(sock, commit=True)
    assert not reply.meta.error_code and reply.meta.info.size == 3000
    assert (root / "w.bin").read_bytes() == b"a" * 1000 + b"b" * 2000
    # The connection serves the next write (and reads) after a commit.
    assert not _part(sock, b"c", path="data/w2.bin", commit=True).meta.error_code
    assert (root / "w2.bin").read_bytes() == b"c"
    # An abort publishes nothing and leaves the connection usable.
    assert not _part(sock, b"d" * 10, path="data/w3.bin").meta.error_code
    assert not _part(sock, abort=True).meta.error_code
    assert not _part(sock, b"e", path="data/w4.bin", commit=True).meta.error_code
    assert not (root / "w3.bin").exists() and (root / "w4.bin").read_bytes() == b"e"
    sock.close()


def test_a_write_cut_off_publishes_nothing_and_frees_its_slot(local_store, make_worker):
    worker = make_worker(local_store.mount)
    root = Path(local_store.mount.url)
    (root / "keep.bin").write_bytes(b"old")
    for _ in range(MAX_WRITES + 2):  # more than the slots: each cut-off write gave its slot back
        sock = _connect(worker)
        assert not _part(sock, b"new" * 1000, path="data/keep.bin").meta.error_code
        sock.close()
    assert wait_for(lambda: worker.data_port_server._writing == 0, timeout=10)
    assert (root / "keep.bin").read_bytes() == b"old"
    sock = _connect(worker)
    assert not _part(sock, b"new", path="data/keep.bin", commit=True).meta.error_code
    assert (root / "keep.bin").read_bytes() == b"new"


def test_too_many_writes_at_once_are_told_busy(local_store, make_worker):
    worker = make_worker(local_store.mount)
    socks = [_connect(worker) for _ in range(MAX_WRITES)]
    for i, sock in enumerate(socks):
        assert not _part(sock, b"x", path=f"data/busy{i}.bin").meta.error_code
    extra = _connect(worker)
    reply = _part(extra, b"x", path="data/one-too-many.bin")
    assert reply.code == Reply.REFUSED and reply.retry_after_ms > 0 and "BUSY" in reply.message
    assert not _part(socks[0], commit=True).meta.error_code  # one ends: a slot is free again
    assert not _part(extra, b"x", path="data/one-too-many.bin", commit=True).meta.error_code
    for sock in socks + [extra]:
        sock.close()


def test_bad_parts_get_precise_errors(local_store, make_worker, tmp_path):
    worker = make_worker(local_store.mount, access_token="s3cret")
    sock = _connect(worker)
    reply = _part(sock, b"x", path="data/t.bin", token="wrong")
    assert reply.code == Reply.REFUSED and reply.message.startswith("UNAUTHENTICATED")
    assert _closed(sock)  # refused before its bytes were read: the stream is out of step
    sock = _connect(worker)
    reply = _part(sock, b"x", path="../escape", token="s3cret")
    assert reply.meta.error_code == "INVALID_ARGUMENT"
    reply = _part(sock, b"x", path="data/a.bin", token="s3cret")
    assert not reply.meta.error_code
    reply = _part(sock, b"x", path="data/other.bin", token="s3cret")  # a part of another object
    assert reply.meta.error_code == "INVALID_ARGUMENT" and "inside the write" in reply.meta.error_message
    assert not (Path(local_store.mount.url) / "a.bin").exists()
    # A part larger than the worker takes: refused, and the stream (out of step) closed.
    raw = dataport_pb2.DataRequest(token="s3cret", write=dataport_pb2.WritePart(
        path="data/huge.bin", length=MAX_WRITE_PART + 1)).SerializeToString()
    sock.sendall(FRAME.pack(len(raw)) + raw)
    (size,) = FRAME.unpack(_recv(sock, 4))
    assert "too large" in Reply.FromString(_recv(sock, size)).message
    assert _closed(sock)
    # A read-only mount: PERMISSION_DENIED, nothing written.
    ro_root = tmp_path / "ro"
    ro_root.mkdir()
    ro = make_worker(MountSpec("ro", str(ro_root), read_only=True))
    sock = _connect(ro)
    reply = _part(sock, b"x", path="ro/t.bin")
    assert reply.meta.error_code == "PERMISSION_DENIED" and not list(ro_root.iterdir())
    sock.close()


def test_mutations_over_the_socket(local_store, make_worker):
    """REMOVE, MKDIR, COPY and FREE as metadata operations, errors as gRPC carries them."""
    worker = make_worker(local_store.mount)
    root = Path(local_store.mount.url)
    (root / "src.bin").write_bytes(b"source")
    sock = _connect(worker)

    def meta(**fields) -> common_pb2.MetaReply:
        raw = dataport_pb2.DataRequest(meta=common_pb2.MetaRequest(**fields)).SerializeToString()
        sock.sendall(FRAME.pack(len(raw)) + raw)
        (size,) = FRAME.unpack(_recv(sock, 4))
        return Reply.FromString(_recv(sock, size)).meta

    Op = common_pb2.MetaRequest
    assert meta(op=Op.COPY, path="data/src.bin", destination="data/dst.bin").info.size == 6
    assert (root / "dst.bin").read_bytes() == b"source"
    assert not meta(op=Op.MKDIR, path="data/d1/d2", create_parents=True).error_code
    assert (root / "d1" / "d2").is_dir()
    assert meta(op=Op.MKDIR, path="data/d1/d2").error_code == "ALREADY_EXISTS"
    assert not meta(op=Op.REMOVE, path="data/dst.bin").error_code and not (root / "dst.bin").exists()
    assert meta(op=Op.REMOVE, path="data/dst.bin").error_code == "NOT_FOUND"
    assert not meta(op=Op.FREE, path="data/").error_code
    sock.close()


@pytest.mark.parametrize("size", [0, 1, (4 << 20) + 1])
def test_the_client_writes_over_the_data_port_with_no_grpc_write(local_store, make_worker, size):
    """A main process's writes reach the worker over its data port: the worker's gRPC Write is
    never called (its call count stays 0), and the bytes are right at the part boundaries."""
    from cachefs.client.fs.filesystem import CacheFileSystem

    worker = make_worker(local_store.mount)
    fs = CacheFileSystem(workers=worker.address, skip_instance_cache=True, short_circuit=False)
    data = os.urandom(size)
    fs.pipe_file("cachefs://data/p.bin", data)
    assert (Path(local_store.mount.url) / "p.bin").read_bytes() == data
    assert fs.cat_file("cachefs://data/p.bin") == data
    fs.rm("cachefs://data/p.bin")
    assert not (Path(local_store.mount.url) / "p.bin").exists()
    fs.makedirs("cachefs://data/dir", exist_ok=True)
    fs.pipe_file("cachefs://data/dir/a.bin", data)
    fs.cp_file("cachefs://data/dir/a.bin", "cachefs://data/dir/b.bin")
    assert (Path(local_store.mount.url) / "dir" / "b.bin").read_bytes() == data
    fs.rm("cachefs://data/dir", recursive=True)
    assert not (Path(local_store.mount.url) / "dir").exists()
    samples = {(s.labels["method"], s.labels["code"]): s.value
               for metric in worker.metrics.requests.collect() for s in metric.samples if s.name.endswith("_total")}
    assert not [k for k in samples if k[0] in ("Write", "Remove", "MakeDir", "Copy", "Free")], samples


# -- slow work never takes every serving thread ---------------------------------------------------------
def test_a_slow_store_never_holds_up_cached_reads(local_store, make_worker):
    """Forty clients ask a worker for the info of objects of a store that takes 2 s a request,
    each on a connection of its own: at most half of the data port's threads go into such work
    (server/connections.py SLOW_SHARE), the others are told busy at once, and a cached range of
    another mount is served in milliseconds meanwhile. Before, the forty took every thread and
    the cached read waited for the store."""
    import threading
    import time

    import cachefs.testing  # noqa: F401 - registers synthetic://
    from cachefs.server.connections import SLOW_SHARE, THREADS

    local_store.add("warm.bin", b"w" * 100_000)
    slow = MountSpec("slow", "synthetic://data", {"count": 1000, "per_dir": 100, "size": 10, "latency": 2.0})
    worker = make_worker(local_store.mount, slow)
    warm = dataport_pb2.DataRequest(path="data/warm.bin", offset=0, length=-1, fill=True).SerializeToString()

    def read_warm() -> float:
        sock = _connect(worker)
        t0 = time.monotonic()
        sock.sendall(FRAME.pack(len(warm)) + warm)
        (size,) = FRAME.unpack(_recv(sock, 4))
        reply = Reply.FromString(_recv(sock, size))
        assert reply.code == Reply.OK
        _recv(sock, sum(seg.length for seg in reply.segments))
        sock.close()
        return time.monotonic() - t0

    read_warm()  # cached now
    codes: list[str] = []

    def ask_info(i: int) -> None:
        sock = _connect(worker)
        request = dataport_pb2.DataRequest(meta=common_pb2.MetaRequest(
            op=common_pb2.MetaRequest.INFO, path=f"slow/d{i // 100:05d}/{i:08d}.bin")).SerializeToString()
        sock.sendall(FRAME.pack(len(request)) + request)
        (size,) = FRAME.unpack(_recv(sock, 4))
        codes.append(Reply.FromString(_recv(sock, size)).meta.error_code)
        sock.close()

    askers = [threading.Thread(target=ask_info, args=(i,)) for i in range(40)]
    for t in askers:
        t.start()
    time.sleep(0.5)  # every slow slot taken by now
    took = read_warm()
    for t in askers:
        t.join(30)
    slots = int(THREADS * SLOW_SHARE)
    assert took < 1.0, f"a cached read waited {took:.2f} s behind slow work"
    assert codes.count("") <= slots and codes.count("RESOURCE_EXHAUSTED") >= 40 - slots, codes
    assert worker.data_port_server.counts["slow_refused"] >= 40 - slots


def test_a_part_whose_bytes_trickle_is_cut_off_in_seconds(local_store, make_worker):
    """A client that announces a part and then sends its bytes slowly holds a serving thread no
    longer than the frame timeout plus the part at 1 MiB/s; one without the token holds none."""
    import time

    from cachefs.server.worker.dataport import WRITE_MIN_RATE

    worker = make_worker(local_store.mount)
    n = 1 << 20
    raw = dataport_pb2.DataRequest(write=dataport_pb2.WritePart(path="data/slow.bin", length=n)).SerializeToString()
    sock = _connect(worker)
    t0 = time.monotonic()
    sock.sendall(FRAME.pack(len(raw)) + raw + b"x" * 1000)  # then nothing more
    assert _closed(sock)
    took = time.monotonic() - t0
    limit = worker.data_port_server.frame_timeout + n / WRITE_MIN_RATE
    assert limit - 0.5 <= took <= limit + 3, took
    assert not (Path(local_store.mount.url) / "slow.bin").exists()
