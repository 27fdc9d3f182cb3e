"""The worker's Prometheus endpoint: the metrics the issue names, with values that add up."""

from __future__ import annotations

from helpers import client, payload, scrape, wait_for

PAGE = 64 << 10


def test_metrics_endpoint_reports_the_read_path(local_store, make_worker):
    data = payload(3 * PAGE + 10, 1)
    local_store.add("a.bin", data)
    worker = make_worker(local_store.mount, page_size=PAGE, metrics_port=0, readahead_pages=0)
    assert worker.metrics_port
    fs = client(worker.address, short_circuit=False, data_port=False)  # every read through gRPC (its metrics are the point)
    assert fs.cat_file("data/a.bin") == data  # 4 misses
    assert wait_for(lambda: worker.pages.stats().pages == 4)
    assert fs.cat_file("data/a.bin") == data  # 4 hits
    m = scrape(worker.metrics_port)
    assert m["cachefs_worker_bytes_from_store_total"] == len(data)
    assert m["cachefs_worker_bytes_from_cache_total"] == len(data)
    assert m["cachefs_worker_bytes_served_total"] == 2 * len(data)
    assert m['cachefs_worker_page_reads_total{outcome="hit"}'] == 4
    assert m['cachefs_worker_page_reads_total{outcome="miss"}'] == 4
    assert m["cachefs_worker_cache_pages"] == 4
    assert 0 < m["cachefs_worker_cache_used_bytes"] <= m["cachefs_worker_cache_capacity_bytes"]
    assert m["cachefs_worker_cache_evictions_total"] == 0
    assert m["cachefs_worker_cache_corrupt_pages_total"] == 0
    assert m["cachefs_worker_cache_page_write_cpu_seconds_total"] == worker.pages.stats().write_cpu_s > 0
    assert m['cachefs_worker_requests_total{code="OK",method="ReadBlock"}'] == 2
    assert m['cachefs_worker_request_seconds_count{method="ReadBlock"}'] == 2
    assert m["cachefs_worker_store_fetch_seconds_count"] >= 1
    # Errors are counted by status code.
    try:
        fs.cat_file("data/missing.bin")
    except FileNotFoundError:
        pass
    m = scrape(worker.metrics_port)
    assert m['cachefs_worker_requests_total{code="NOT_FOUND",method="ReadBlock"}'] == 1
