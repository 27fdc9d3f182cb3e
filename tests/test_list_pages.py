"""Listings in pages (#46): no List call carries a whole prefix.

The client asks the worker page after page (``ListRequest.paged``, ``start_after``), each page
at most the worker's page size, by name; together they are the whole listing, as before.
"""

from __future__ import annotations

from cachefs.server.worker import metaops, service
from cachefs.proto import worker_pb2, worker_pb2_grpc
from helpers import client

import grpc


def test_a_listing_comes_in_pages_and_whole(local_store, make_worker, monkeypatch):
    for i in range(250):
        local_store.add(f"many/{i:04d}.bin", b"x")
    local_store.add("many/sub/deeper.bin", b"y")
    worker = make_worker(local_store.mount)
    monkeypatch.setattr(service, "LIST_BATCH", 60)
    pages: list[int] = []
    page = metaops.ListingPages.page

    def spy(self, *args):
        out = page(self, *args)
        pages.append(len(out[0]))
        return out

    monkeypatch.setattr(metaops.ListingPages, "page", spy)
    fs = client(worker.address, short_circuit=False, data_port=False)
    found = fs.find("cachefs://data/many")
    assert found == sorted([f"data/many/{i:04d}.bin" for i in range(250)] + ["data/many/sub/deeper.bin"])
    assert len(pages) == 5 and max(pages) == 60 and sum(pages) == 251
    pages.clear()
    listed = fs.ls("cachefs://data/many", detail=False)
    assert sorted(listed) == sorted([f"data/many/{i:04d}.bin" for i in range(250)] + ["data/many/sub"])
    assert max(pages) <= 60 and len(pages) >= 5


def test_a_page_is_the_entries_after_start_after(local_store, make_worker):
    for i in range(30):
        local_store.add(f"p/{i:02d}", b"z")
    worker = make_worker(local_store.mount)
    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        names, after, calls = [], "", 0
        while True:
            (reply,) = list(stub.List(worker_pb2.ListRequest(path="data/p", paged=True, start_after=after,
                                                             max_entries=7)))
            calls += 1
            assert len(reply.entries) <= 7
            names += [e.path for e in reply.entries]
            if not reply.next_after:
                break
            after = reply.next_after
        assert calls == 5 and names == [f"data/p/{i:02d}" for i in range(30)]
        # unpaged (a client before pages): the whole listing, as before
        whole = [e.path for r in stub.List(worker_pb2.ListRequest(path="data/p")) for e in r.entries]
        assert sorted(whole) == names
