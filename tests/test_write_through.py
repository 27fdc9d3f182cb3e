"""Write-through: writes reach the store through the owning worker and drop what it cached.

Each test runs against a local directory and against moto S3 (the ``store`` fixture) unless
it is about one store only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import fsspec
import pytest

from cachefs.mounts import MountSpec
from helpers import client, payload, wait_for

PAGE = 64 << 10


def _store_bytes(store, key: str) -> bytes:
    fs, root = fsspec.core.url_to_fs(store.mount.url, **dict(store.mount.options))
    fs.invalidate_cache()
    return fs.cat_file(f"{root.rstrip('/')}/{key}")


def _store_has(store, key: str) -> bool:
    fs, root = fsspec.core.url_to_fs(store.mount.url, **dict(store.mount.options))
    fs.invalidate_cache()
    return fs.exists(f"{root.rstrip('/')}/{key}")


def test_pipe_overwrite_is_seen_at_once_and_drops_old_pages(store, make_worker):
    store.add("k/a.bin", payload(3 * PAGE + 5, seed=1))
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    old = fs.info("cachefs://data/k/a.bin")
    assert fs.cat_file("cachefs://data/k/a.bin") == store.objects["k/a.bin"]
    # Pages are written to the page store in the background.
    assert wait_for(lambda: worker.pages.cached_bytes("data", "k/a.bin", old["version"]) == 3 * PAGE + 5)

    new = payload(2 * PAGE + 1, seed=2)
    fs.pipe_file("cachefs://data/k/a.bin", new)
    assert fs.cat_file("cachefs://data/k/a.bin") == new  # no TTL wait: the owner forgot the old version
    assert _store_bytes(store, "k/a.bin") == new
    info = fs.info("cachefs://data/k/a.bin")
    assert info["size"] == len(new) and info["version"] != old["version"]
    assert worker.pages.cached_bytes("data", "k/a.bin", old["version"]) == 0  # old pages freed


def test_open_wb_streams_and_lists_update(store, make_worker):
    store.add("d/existing", b"x")
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    assert fs.ls("cachefs://data/d") == ["data/d/existing"]  # now cached by the worker
    data = payload(9 << 20, seed=3)
    with fs.open("cachefs://data/d/ckpt.bin", "wb", block_size=1 << 20) as f:
        for start in range(0, len(data), 300_000):  # small writes, as torch.save makes
            f.write(data[start:start + 300_000])
    assert f.written_info["size"] == len(data)
    assert sorted(fs.ls("cachefs://data/d")) == ["data/d/ckpt.bin", "data/d/existing"]
    assert fs.cat_file("cachefs://data/d/ckpt.bin") == data
    assert _store_bytes(store, "d/ckpt.bin") == data


def test_large_s3_write_is_multipart(s3_store, make_worker):
    worker = make_worker(s3_store.mount, page_size=PAGE)
    fs = client(worker.address)
    data = payload(40 << 20, seed=4)  # 16 MiB parts (cachefs/store/write.py), several in flight
    fs.pipe_file("cachefs://data/big.bin", data)
    # An S3 multipart object's ETag ends in -<parts>.
    assert fs.info("cachefs://data/big.bin")["version"].endswith("-3")
    assert fs.cat_file("cachefs://data/big.bin") == data


def test_failed_write_publishes_nothing(store, make_worker, moto_server):
    store.add("keep.bin", b"old contents")
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    with pytest.raises(RuntimeError, match="producer failed"):
        with fs.open("cachefs://data/keep.bin", "wb", block_size=1 << 20) as f:
            f.write(payload(3 << 20, seed=5))  # past block_size: already streaming
            raise RuntimeError("producer failed")
    with pytest.raises(RuntimeError):
        with fs.open("cachefs://data/new.bin", "wb", block_size=1 << 20) as f:
            f.write(payload(20 << 20, seed=6))  # on S3, a multipart upload is under way
            raise RuntimeError("producer failed")
    assert fs.cat_file("cachefs://data/keep.bin") == b"old contents"
    assert not fs.exists("cachefs://data/new.bin")
    assert _store_bytes(store, "keep.bin") == b"old contents" and not _store_has(store, "new.bin")
    # The worker aborts after the client has gone: give it a moment (a busy machine, more).
    if store.kind == "s3":  # the aborted multipart upload leaves nothing behind
        bucket = store.mount.url.split("/")[2]
        assert wait_for(lambda: not moto_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads"))
    else:
        root = store.mount.url
        left = lambda: [p.name for p in Path(root).iterdir()]  # noqa: E731
        assert wait_for(lambda: left() == ["keep.bin"], timeout=30), left()  # no partial file left


def test_rm_mkdir_copy_mv(store, make_worker):
    for i in range(3):
        store.add(f"tree/sub/f{i}", payload(1000 + i, seed=i))
    store.add("tree/top", b"top")
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    assert fs.cat_file("cachefs://data/tree/sub/f0") == store.objects["tree/sub/f0"]  # cached

    fs.cp_file("cachefs://data/tree/top", "cachefs://data/tree/copy")
    assert fs.cat_file("cachefs://data/tree/copy") == b"top"
    fs.mv("cachefs://data/tree/copy", "cachefs://data/tree/moved")
    assert not fs.exists("cachefs://data/tree/copy") and fs.cat_file("cachefs://data/tree/moved") == b"top"

    fs.rm("cachefs://data/tree/sub", recursive=True)
    assert not fs.exists("cachefs://data/tree/sub/f0")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("cachefs://data/tree/sub/f0")
    assert not worker.pages.holds_object("data", "tree/sub/f0")
    assert sorted(fs.ls("cachefs://data/tree")) == ["data/tree/moved", "data/tree/top"]
    assert not _store_has(store, "tree/sub/f1")

    fs.rm_file("cachefs://data/tree/top")
    assert fs.ls("cachefs://data/tree") == ["data/tree/moved"]
    with pytest.raises(FileNotFoundError):
        fs.rm_file("cachefs://data/tree/top")

    fs.makedirs("cachefs://data/newdir/inner", exist_ok=True)
    if store.kind == "local":  # S3 has no empty directories
        assert fs.isdir("cachefs://data/newdir/inner")
        with pytest.raises(FileExistsError):
            fs.mkdir("cachefs://data/newdir/inner")


def test_read_only_mount_refuses_every_write(store, make_worker, tmp_path):
    store.add("ro.bin", b"original")
    mount = dataclasses.replace(store.mount, read_only=True)
    worker = make_worker(mount, page_size=PAGE)
    fs = client(worker.address)
    local = tmp_path / "up.bin"
    local.write_bytes(b"new")
    attempts = {
        "pipe": lambda: fs.pipe_file("cachefs://data/ro.bin", b"new"),
        "open": lambda: fs.open("cachefs://data/ro.bin", "wb").close(),
        "put": lambda: fs.put_file(str(local), "cachefs://data/ro.bin"),
        "rm": lambda: fs.rm("cachefs://data/ro.bin"),
        "cp": lambda: fs.cp_file("cachefs://data/ro.bin", "cachefs://data/ro2.bin"),
        "mkdir": lambda: fs.makedirs("cachefs://data/dir"),
    }
    for name, attempt in attempts.items():
        with pytest.raises(PermissionError, match="read-only"):
            attempt()
    assert fs.cat_file("cachefs://data/ro.bin") == b"original"
    assert _store_bytes(store, "ro.bin") == b"original" and not _store_has(store, "ro2.bin")


def test_mount_root_cannot_be_removed(store, make_worker):
    store.add("x", b"x")
    fs = client(make_worker(store.mount).address)
    with pytest.raises(PermissionError, match="root of a mount"):
        fs.rm("cachefs://data", recursive=True)
    assert fs.cat_file("cachefs://data/x") == b"x"


def test_put_and_get_files(store, make_worker, tmp_path):
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    src = tmp_path / "src.bin"
    src.write_bytes(payload(5 << 20, seed=8))
    fs.put_file(str(src), "cachefs://data/up/src.bin")
    dst = tmp_path / "dst.bin"
    fs.get_file("cachefs://data/up/src.bin", str(dst))
    assert dst.read_bytes() == src.read_bytes()


def test_write_via_client_invalidates_the_owner(local_store, make_worker):
    local_store.add("c.bin", b"v1")
    worker = make_worker(local_store.mount, page_size=PAGE)
    fs = client(worker.address, write_via="client",
                fallback_mounts={"data": local_store.mount.url})
    reader = client(worker.address)
    assert reader.cat_file("cachefs://data/c.bin") == b"v1"  # cached in the worker
    fs.pipe_file("cachefs://data/c.bin", b"version two")
    assert _store_bytes(local_store, "c.bin") == b"version two"
    assert reader.cat_file("cachefs://data/c.bin") == b"version two"  # the worker was told to forget


def test_writes_route_to_the_owner_of_stripe_zero(local_store, make_worker):
    workers = [make_worker(local_store.mount, page_size=PAGE) for _ in range(3)]
    fs = client(*(w.address for w in workers))
    path = "data/owned/obj.bin"
    owner = fs.session.candidates(path)[0].address
    local_store.add("owned/obj.bin", b"first")
    assert fs.cat_file(path) == b"first"
    fs.pipe_file(path, b"second")
    assert fs.cat_file(path) == b"second"
    by_address = {w.address: w for w in workers}
    # Over the owner's data port (the worker's socket operations), none through gRPC's Write.
    calls = {a: w.metrics.registry.get_sample_value("cachefs_worker_socket_operations_total",
                                                     {"op": "write", "outcome": "ok"}) or 0
             for a, w in by_address.items()}
    assert calls[owner] == 1 and sum(calls.values()) == 1
    assert not any(w.metrics.registry.get_sample_value("cachefs_worker_requests_total", {"method": "Write", "code": "OK"})
                   for w in workers)


def test_unknown_write_mode_is_refused(local_store, make_worker):
    fs = client(make_worker(local_store.mount).address)
    with pytest.raises(NotImplementedError, match="'ab'"):
        fs.open("cachefs://data/x", "ab")
    fs.pipe_file("cachefs://data/x", b"1")
    with pytest.raises(FileExistsError):
        fs.open("cachefs://data/x", "xb")


def test_mount_spec_read_only_parses():
    assert MountSpec.parse({"name": "m", "url": "/tmp", "read_only": True}).read_only
    assert not MountSpec.parse("m=/tmp").read_only


def test_s3_writer_discard_aborts_the_upload(s3_store, moto_server):
    from cachefs.mounts import MountTable
    from cachefs.paths import CachePath
    from cachefs.store.write import S3Writer

    resolved = MountTable([s3_store.mount]).resolve(CachePath("data", "mpu.bin"))
    writer = S3Writer(resolved.fs, resolved.store_path, part_size=5 << 20)
    writer.write(payload(12 << 20, seed=11))  # two parts on their way
    bucket = s3_store.mount.url.split("/")[2]
    assert moto_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    writer.discard()
    assert not moto_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert not _store_has(s3_store, "mpu.bin")

    data = payload(11 << 20, seed=12)
    writer = S3Writer(resolved.fs, resolved.store_path, part_size=5 << 20)
    for start in range(0, len(data), 1 << 20):
        writer.write(data[start:start + (1 << 20)])
    writer.commit()
    assert _store_bytes(s3_store, "mpu.bin") == data


def test_parent_directory_metadata_follows_writes(store, make_worker):
    worker = make_worker(store.mount, page_size=PAGE)
    fs = client(worker.address)
    assert not fs.exists("cachefs://data/p/q")
    fs.pipe_file("cachefs://data/p/q/f", b"1")
    assert fs.isdir("cachefs://data/p/q") and fs.isdir("cachefs://data/p")  # now cached as directories
    fs.rm_file("cachefs://data/p/q/f")
    # On S3 a prefix with no objects is gone; a local directory stays until removed.
    assert fs.exists("cachefs://data/p/q") == (store.kind == "local")


@pytest.mark.slow
def test_worker_killed_mid_write_fails_the_write_and_keeps_the_old_object(local_store, tmp_path):
    """kill -9 of the worker process while a checkpoint streams into it: the writer gets an
    OSError (no hang), and readers still see the old object whole."""
    import signal

    from cachefs.local import worker_process

    local_store.add("ckpt.bin", b"previous checkpoint")
    worker = worker_process({"data": local_store.mount.url}, str(tmp_path / "cache"))
    with worker:
        fs = client(worker.address, timeout=5)
        f = fs.open("cachefs://data/ckpt.bin", "wb", block_size=1 << 20)
        f.write(payload(8 << 20, seed=13))  # streaming by now
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(timeout=10)
        with pytest.raises(OSError):
            f.write(payload(8 << 20, seed=14))
            f.close()
    assert _store_bytes(local_store, "ckpt.bin") == b"previous checkpoint"


def test_write_stream_must_name_its_path_first(local_store, make_worker):
    import grpc

    from cachefs.proto import worker_pb2, worker_pb2_grpc

    worker = make_worker(local_store.mount)
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Write(iter([worker_pb2.WriteChunk(data=b"no path")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # the worker checks paths again
            stub.Write(iter([worker_pb2.WriteChunk(path="data/../etc/passwd", data=b"x")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError):  # no commit message: a cancelled stream, nothing published
            stub.Write(iter([worker_pb2.WriteChunk(path="data/raw.bin", data=b"partial")]), timeout=10)
        assert not _store_has(local_store, "raw.bin")
        info = stub.Write(iter([worker_pb2.WriteChunk(path="data/raw.bin"), worker_pb2.WriteChunk(data=b"ab"),
                                worker_pb2.WriteChunk(data=b"cd", commit=True)]), timeout=10)
        assert info.size == 4 and info.path == "data/raw.bin"
    assert _store_bytes(local_store, "raw.bin") == b"abcd"
