"""The cold read path's pipelining: streamed store reads, first pages with the metadata, the
rest of a read fetched while its first block travels, and partial runs on a store error."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from fsspec.asyn import get_loop

from cachefs.errors import StaleObjectError, StoreUnavailableError
from cachefs.mounts import MountTable
from cachefs.paths import CachePath
from cachefs.proto import worker_pb2, worker_pb2_grpc
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore
from cachefs.store.backends import _S3Backend
from cachefs.server.pagestore import CacheDir, PageId, PageStore
from cachefs.server.worker.metrics import WorkerMetrics
from cachefs.server.worker.reader import PageReader, ReaderOptions
from helpers import payload, wait_for

PAGE = 64 << 10
BLOCK = 4 << 20  # the worker's ReadBlock reply size (service.MAX_BLOCK)


def _stub(worker) -> worker_pb2_grpc.WorkerServiceStub:
    channel = grpc.insecure_channel(worker.address, options=[("grpc.max_receive_message_length", 64 << 20)])
    return worker_pb2_grpc.WorkerServiceStub(channel)


def _sample(worker, name: str, labels: dict[str, str] | None = None) -> float:
    return worker.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_read_pieces_cut_a_range_in_order_and_refuse_a_changed_object(store):
    data = payload(5 * PAGE + 7, 1)
    store.add("obj.bin", data)
    objects = ObjectStore(MountTable([store.mount]), metadata_ttl=60)
    meta = objects.info(CachePath("data", "obj.bin"))
    got: list[tuple[int, bytes]] = []
    sizes = [PAGE, PAGE, PAGE, PAGE + 7]
    objects.read_pieces(meta, PAGE, sizes, lambda i, piece: got.append((i, piece)))
    assert [i for i, _ in got] == [0, 1, 2, 3]
    assert [type(p) for _, p in got] == [bytes] * 4
    assert b"".join(p for _, p in got) == data[PAGE:]
    assert [len(p) for _, p in got] == sizes
    store.add("obj.bin", payload(5 * PAGE + 7, 2))  # same size, other bytes
    got.clear()
    with pytest.raises(StaleObjectError):
        objects.read_pieces(meta, 0, [PAGE, PAGE], lambda i, piece: got.append((i, piece)))
    assert got == []  # nothing of the new version reached the reader


class _Body:
    """An S3 body that arrives in small chunks and notes how many pieces were out at each read."""

    def __init__(self, data: bytes, delivered: list[int]) -> None:
        self.data, self.at, self.delivered = data, 0, delivered
        self.seen: list[tuple[int, int]] = []  # (offset asked for, pieces delivered by then)
        self.closed = False

    async def read(self, amt: int) -> bytes:
        await asyncio.sleep(0)
        self.seen.append((self.at, len(self.delivered)))
        chunk = self.data[self.at:self.at + min(amt, 10_000)]
        self.at += len(chunk)
        return chunk

    def close(self) -> None:
        self.closed = True


class _FakeS3:
    """Just what _S3Backend.read_pieces touches of s3fs (unit level: the streaming order)."""

    def __init__(self, data: bytes, delivered: list[int]) -> None:
        self.loop = get_loop()
        self.data, self.delivered = data, delivered
        self.calls: list[dict] = []
        self.body: _Body | None = None

    def split_path(self, path: str) -> tuple[str, str, None]:
        bucket, _, key = path.partition("/")
        return bucket, key, None

    async def _call_s3(self, method: str, **kwargs):
        self.calls.append(dict(kwargs, method=method))
        lo, hi = (int(x) for x in kwargs["Range"].removeprefix("bytes=").split("-"))
        self.body = _Body(self.data[lo:hi + 1], self.delivered)
        return {"Body": self.body}


def test_s3_pieces_are_handed_over_as_they_arrive_from_one_get():
    data = payload(3 * PAGE + 100, 3)
    delivered: list[int] = []
    fake = _FakeS3(data, delivered)
    pieces: dict[int, bytes] = {}

    def deliver(i: int, piece: bytes) -> None:
        delivered.append(i)
        pieces[i] = piece

    _S3Backend().read_pieces(fake, "bucket/key", 100, [PAGE, PAGE, PAGE], "etag1", deliver)
    assert len(fake.calls) == 1 and fake.calls[0]["IfMatch"] == '"etag1"'
    assert fake.calls[0]["Range"] == f"bytes=100-{100 + 3 * PAGE - 1}"
    assert [pieces[i] for i in range(3)] == [data[100 + i * PAGE:100 + (i + 1) * PAGE] for i in range(3)]
    assert fake.body is not None and fake.body.closed
    # When the body was asked for the bytes of piece 1, piece 0 was already out, and so on.
    for offset, out in fake.body.seen:
        assert out >= offset // PAGE, (offset, out)


def test_s3_stream_that_ends_early_delivers_what_came_then_fails():
    data = payload(PAGE + 10, 4)  # the store has less than the run asks for
    delivered: list[int] = []
    fake = _FakeS3(data, delivered)
    with pytest.raises(StaleObjectError):
        _S3Backend().read_pieces(fake, "bucket/key", 0, [PAGE, PAGE], "etag1", lambda i, p: delivered.append(i))
    assert delivered == [0]


class _HalfStore:
    """Delivers the first piece of a run, then the store goes away (unit level)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read_pieces(self, meta, start, sizes, deliver) -> None:
        deliver(0, self.data[start:start + sizes[0]])
        raise StoreUnavailableError("store went away mid-stream")


def test_pages_that_arrived_before_a_store_error_are_served_and_cached(tmp_path):
    data = payload(3 * PAGE, 5)
    pages = PageStore([CacheDir(str(tmp_path / "cache"), 1 << 30)], PAGE)
    reader = PageReader(pages, _HalfStore(data), WorkerMetrics(),  # type: ignore[arg-type]
                        ReaderOptions(readahead_pages=0, fetch_group_pages=8))
    meta = ObjectMeta(CachePath("m", "k"), len(data), "v1", 0.0)
    try:
        chunks = reader.read(meta, 0, len(data), deadline=time.monotonic() + 10)
        assert bytes(next(chunks)) == data[:PAGE]
        with pytest.raises(StoreUnavailableError):
            next(chunks)
        assert wait_for(lambda: pages.contains(PageId("m", "k", "v1", 0)))
        assert not pages.contains(PageId("m", "k", "v1", 1))
        assert not reader._inflight  # nothing left claimed: the next reader fetches pages 1-2 afresh
    finally:
        reader.close()
        pages.close()


@pytest.mark.parametrize("write_here", [True, False], ids=["written-here", "queued"])
def test_adopted_pages_are_cached_either_on_the_callers_thread_or_by_a_writer(tmp_path, write_here):
    """A load's resolve thread (or a fill) writes the head it adopted itself once its open is over
    (no writer hand-off); a request thread queues it. Either way every whole page lands and
    settles, nothing stays pending."""
    data = payload(2 * PAGE + 100, 8)
    pages = PageStore([CacheDir(str(tmp_path / "cache"), 1 << 30)], PAGE)
    reader = PageReader(pages, _HalfStore(data), WorkerMetrics(),  # type: ignore[arg-type]
                        ReaderOptions(readahead_pages=0, fetch_group_pages=8))
    meta = ObjectMeta(CachePath("m", "k"), len(data), "v1", 0.0)
    try:
        later: list | None = [] if write_here else None
        assert reader.adopt(meta, data, later)
        ids = [PageId("m", "k", "v1", i) for i in range(3)]
        if write_here:  # left to the caller: in flight (served from memory) until it writes them
            assert [pid for pid, _ in later] == ids and all(pid in reader._inflight for pid in ids)
            reader.write_adopted(later)
            assert all(pages.contains(pid) for pid in ids) and not reader._inflight and later == []
        assert all(reader.wait_settled(pid, time.monotonic() + 10) for pid in ids)
        assert all(pages.contains(pid) for pid in ids)
        assert reader._pending_write_bytes == 0
    finally:
        reader.close()
        pages.close()


def test_cold_first_block_comes_with_the_metadata_in_one_get(s3_store, make_worker):
    data = payload(12 * PAGE, 6)
    s3_store.add("obj.bin", data)
    worker = make_worker(s3_store.mount, page_size=PAGE, readahead_pages=0, fetch_group_pages=8)
    stub = _stub(worker)
    reply = stub.ReadBlock(worker_pb2.ReadRequest(path="data/obj.bin", offset=0, length=4 * PAGE), timeout=30)
    assert reply.data == data[:4 * PAGE] and reply.info.size == len(data)
    # One GET brought size, version and the four pages: no separate page fetch, nothing more read.
    assert _sample(worker, "cachefs_worker_store_fetch_seconds_count") == 0
    assert _sample(worker, "cachefs_worker_bytes_from_store_total") == 4 * PAGE
    assert wait_for(lambda: worker.pages.stats().pages == 4)
    # A long first read takes one fetch run with it (8 pages), not the whole object.
    s3_store.add("big.bin", data)
    reply = stub.ReadBlock(worker_pb2.ReadRequest(path="data/big.bin", offset=0, length=-1), timeout=30)
    assert reply.data == data
    # pages 4-11 in one run (its time is recorded once the run's last page is handed on: the
    # reply may be out first)
    assert wait_for(lambda: _sample(worker, "cachefs_worker_store_fetch_seconds_count") == 1)
    assert _sample(worker, "cachefs_worker_store_fetch_seconds_count") == 1


@pytest.mark.parametrize("rest", [False, True])
def test_first_block_starts_fetching_the_rest_of_the_read(local_store, make_worker, rest):
    data = payload(BLOCK + 10 * PAGE, 7)
    local_store.add("obj.bin", data)
    worker = make_worker(local_store.mount, page_size=PAGE, readahead_pages=0, parallel_pages=32)
    stub = _stub(worker)
    length = len(data) if rest else BLOCK
    reply = stub.ReadBlock(worker_pb2.ReadRequest(path="data/obj.bin", offset=0, length=length), timeout=30)
    assert reply.data == data[:BLOCK]
    version = reply.info.version
    if rest:  # the 10 pages after the block are fetched and cached without being asked for again
        assert wait_for(lambda: worker.pages.cached_bytes("data", "obj.bin", version) == len(data))
        assert _sample(worker, "cachefs_worker_page_reads_total", {"outcome": "prefetch"}) == 10
        chunks = list(stub.Read(worker_pb2.ReadRequest(path="data/obj.bin", offset=BLOCK, length=-1,
                                                       version=version), timeout=30))
        assert b"".join(c.data for c in chunks) == data[BLOCK:]
        assert _sample(worker, "cachefs_worker_bytes_from_store_total") == len(data)  # nothing twice
    else:
        # Read-ahead is claimed (and counted) inside the call, before its reply: none was.
        assert _sample(worker, "cachefs_worker_page_reads_total", {"outcome": "prefetch"}) == 0
        assert wait_for(lambda: worker.pages.cached_bytes("data", "obj.bin", version) == BLOCK)
        # Every fetch and page write is over (nothing in flight could add a page): just the block.
        assert wait_for(lambda: not worker.reader._inflight)
        assert worker.pages.cached_bytes("data", "obj.bin", version) == BLOCK
        assert _sample(worker, "cachefs_worker_bytes_from_store_total") == BLOCK
