"""The plain fsspec API on the lean path: cat_file, open().read(), read(n), readinto give the
object's bytes, at the right position and version, with and without short-circuit."""

from __future__ import annotations

import pytest

from cachefs.client import rawbytes
from helpers import client, payload

PAGE = 64 << 10


@pytest.fixture
def served(local_store, make_worker):
    objects = {"multi.bin": payload(7 * PAGE + 123, 1), "one.bin": payload(PAGE // 2, 2), "empty.bin": b""}
    for key, data in objects.items():
        local_store.add(key, data)
    return objects, make_worker(local_store.mount, page_size=PAGE)


def test_fillable_bytes_is_a_real_bytes_object_filled_in_place():
    data, view = rawbytes.fillable_bytes(5)
    view[:] = b"hello"
    view.release()
    assert type(data) is bytes and data == b"hello" and hash(data) == hash(b"hello")
    assert data.decode() == "hello" and data[1:3] == b"el"
    empty, _ = rawbytes.fillable_bytes(0)
    assert empty == b""


@pytest.mark.parametrize("lean", [True, False], ids=["short-circuit", "grpc"])
def test_whole_reads_cat_and_open_return_the_object(served, lean):
    objects, worker = served
    fs = client(worker.address, short_circuit=lean, data_port=False, block_size=2 * PAGE)
    for _ in range(2):  # cold (filled through gRPC), then warm (short-circuit when lean)
        for key, data in objects.items():
            got = fs.cat_file(f"cachefs://data/{key}")
            assert type(got) is bytes and got == data
            with fs.open(f"cachefs://data/{key}") as f:
                whole = f.read()
                assert type(whole) is bytes and whole == data and f.tell() == len(data)
                assert f.read() == b""
    if lean:
        assert fs.session.bulk_stats["short_circuit"]["reads"] > 0


@pytest.mark.parametrize("lean", [True, False], ids=["short-circuit", "grpc"])
def test_reads_of_a_block_or_more_and_readinto_keep_the_position(served, lean):
    objects, worker = served
    data = objects["multi.bin"]
    fs = client(worker.address, short_circuit=lean, data_port=False, block_size=2 * PAGE)
    fs.cat_file("cachefs://data/multi.bin")  # warm
    with fs.open("cachefs://data/multi.bin") as f:
        assert f.read(10) == data[:10]  # below the block size: the block cache
        assert f.read(3 * PAGE) == data[10:10 + 3 * PAGE]  # a block or more: straight through
        f.seek(PAGE + 7)
        buf = bytearray(2 * PAGE + 1)
        assert f.readinto(buf) == len(buf) and bytes(buf) == data[PAGE + 7:3 * PAGE + 8]
        assert f.tell() == 3 * PAGE + 8
        f.seek(len(data) - 5)
        tail = bytearray(100)
        assert f.readinto(tail) == 5 and bytes(tail[:5]) == data[-5:]
        assert f.readinto(tail) == 0 and f.read(4 * PAGE) == b""


def test_an_open_file_keeps_its_version_when_the_object_changes(served, local_store):
    objects, worker = served
    fs = client(worker.address, short_circuit=False, data_port=False, block_size=PAGE)
    with fs.open("cachefs://data/multi.bin") as f:
        local_store.add("multi.bin", payload(7 * PAGE + 123, 99))  # a new version, same size
        buf = bytearray(3 * PAGE)
        try:
            n = f.readinto(buf)
        except OSError as err:  # the old version is gone from the store: a clear error, never mixed bytes
            assert "version" in str(err).lower() or "changed" in str(err).lower() or "stale" in str(err).lower(), err
        else:
            assert bytes(buf[:n]) == objects["multi.bin"][:n]
