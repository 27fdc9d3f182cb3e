"""docs/metrics.md against what real daemons expose, and the Grafana dashboard against docs/metrics.md.

A master and a worker run as processes; after a read and a load job, every metric family each
one exposes must be documented (name, type, help text) and every documented one exposed.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefs.local import LocalCluster
from cachefs.proto import master_pb2, master_pb2_grpc, worker_pb2, worker_pb2_grpc
from helpers import payload, scrape, wait_for

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "cachefs.json"
_ROW = re.compile(r"^\|\s*`(cachefs_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|[^|]*\|\s*(.*?)\s*\|\s*$")


def documented() -> dict[str, tuple[str, str]]:
    """name (as queried) -> (type, help text) from the tables in docs/metrics.md."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            name, kind, text = m.groups()
            assert name not in out, f"{name} is documented twice"
            out[name] = (kind, text.replace("\\|", "|"))
    return out


def exposed(port: int) -> dict[str, tuple[str, str]]:
    """name (as queried: counters with _total) -> (type, help) from a daemon's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    out = {}
    for name, f in families.items():
        base = name[: -len("_created")] if name.endswith("_created") else None
        if base is not None and (base in families or base + "_total" in families):
            continue  # prometheus_client's creation timestamp of a counter/histogram
        out[name + "_total" if f.type == "counter" else name] = (f.type, f.documentation)
    return out


def test_docs_table_parses():
    docs = documented()
    assert len(docs) >= 40
    assert all(n.startswith(("cachefs_worker_", "cachefs_master_", "cachefs_client_")) for n in docs)
    assert all(n.endswith("_total") == (kind == "counter") for n, (kind, _) in docs.items())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("metrics-docs")
    store = tmp / "store"
    (store / "d").mkdir(parents=True)
    for i in range(3):
        (store / "d" / f"{i}.bin").write_bytes(payload(200_000, i))
    c = LocalCluster(str(tmp / "cluster"), workers=1, mounts={"data": str(store)}, quota="64MiB",
                     master_args=["--metrics-port", "0"])
    with c:
        assert c.wait_for_workers(timeout=30)
        # Traffic, so labelled families have samples: a read (miss, then hit) and a load job. The
        # read is a plain ReadBlock RPC, so no client-side shortcut can bypass the worker's counters.
        wport = c.workers[0].ready["metrics_port"]
        with grpc.insecure_channel(c.workers[0].address) as channel:
            read = worker_pb2_grpc.WorkerServiceStub(channel).ReadBlock
            request = worker_pb2.ReadRequest(path="data/d/0.bin", offset=0, length=-1)
            assert read(request, timeout=30).data == payload(200_000, 0)
            assert wait_for(lambda: scrape(wport)["cachefs_worker_cache_pages"] >= 1, timeout=15)  # written behind
            assert read(request, timeout=30).data == payload(200_000, 0)
        with grpc.insecure_channel(c.master_address) as channel:
            stub = master_pb2_grpc.MasterServiceStub(channel)
            job = stub.SubmitJob(master_pb2.SubmitJobRequest(kind=master_pb2.LOAD, path="data/d"), timeout=10)
            assert wait_for(lambda: stub.GetJob(master_pb2.GetJobRequest(job_id=job.job_id), timeout=5).state
                            == master_pb2.SUCCEEDED, timeout=60)
        yield c


def test_every_exposed_metric_is_documented_and_every_documented_one_exposed(cluster: LocalCluster):
    master = exposed(cluster.master.ready["metrics_port"])
    worker = exposed(cluster.workers[0].ready["metrics_port"])
    assert all(n.startswith("cachefs_master_") for n in master)
    assert all(n.startswith("cachefs_worker_") for n in worker)
    docs = {n: v for n, v in documented().items() if not n.startswith("cachefs_client_")}
    live = {**master, **worker}
    assert sorted(set(live) - set(docs)) == [], "exposed but not in docs/metrics.md"
    assert sorted(set(docs) - set(live)) == [], "in docs/metrics.md but not exposed"
    wrong = {n: (live[n], docs[n]) for n in docs if live[n] != docs[n]}
    assert wrong == {}, "type or help text differs (exposed, documented)"


def test_the_named_figures_are_there_with_values(cluster: LocalCluster):
    """The figures the issue names, with values that follow from the traffic above."""
    def samples(port: int) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    w = samples(cluster.workers[0].ready["metrics_port"])
    assert w['cachefs_worker_page_reads_total{"outcome": "hit"}'] >= 1
    assert 0 < w["cachefs_worker_cache_hit_ratio"] < 1
    assert w["cachefs_worker_bytes_from_cache_total"] >= 200_000
    assert w["cachefs_worker_bytes_from_store_total"] >= 3 * 200_000  # the read and the load
    assert w["cachefs_worker_cache_capacity_bytes"] == 64 << 20
    assert w['cachefs_worker_load_bytes_total{"outcome": "fetched"}'] >= 2 * 200_000
    m = samples(cluster.master.ready["metrics_port"])
    assert m["cachefs_master_workers_live"] == 1
    assert m['cachefs_master_jobs{"kind": "LOAD", "state": "SUCCEEDED"}'] == 1
    assert m['cachefs_master_job_objects_total{"outcome": "done"}'] == 3
    assert m['cachefs_master_active_job_bytes{"part": "total"}'] == 0  # nothing left running
    assert wait_for(lambda: samples(cluster.master.ready["metrics_port"])["cachefs_master_cluster_capacity_bytes"]
                    == 64 << 20, timeout=15)  # from the worker's heartbeats


def test_a_jobs_client_metrics_on_one_port_are_documented_and_sum_its_processes(local_store, make_worker):
    """A training job's port (client/stats/prometheus.py) over 2 DataLoader workers: every client metric
    documented, and the values are the whole job's (the workers' reads, not the main process's)."""
    from torch.utils.data import DataLoader

    from cachefs import StepTimer
    from cachefs.client.stats import prometheus
    from cachefs.client.datasets.dataset import CacheDataset

    n = 12
    for i in range(n):
        local_store.add(f"train/{i:03d}.bin", payload(2000, i))
    worker = make_worker(local_store.mount, page_size=64 << 10)
    ds = CacheDataset.from_prefix("cachefs://data/train", storage_options={"workers": worker.address},
                                  rank=0, world_size=1, hint_samples=0)
    loader = DataLoader(ds, batch_size=3, sampler=ds.sampler(), num_workers=2, timeout=60,
                        multiprocessing_context="fork")
    timer = StepTimer()
    assert sum(len(b) for b in timer(loader)) == n
    server = prometheus.serve(0, datasets=[ds], timer=timer)
    try:
        live = exposed(server.port)
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    finally:
        server.close()
    docs = {k: v for k, v in documented().items() if k.startswith("cachefs_client_")}
    assert sorted(set(live) - set(docs)) == [], "exposed but not in docs/metrics.md"
    assert sorted(set(docs) - set(live)) == [], "in docs/metrics.md but not exposed"
    wrong = {k: (live[k], docs[k]) for k in docs if live[k] != docs[k]}
    assert wrong == {}, "type or help text differs (exposed, documented)"
    values = {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["cachefs_client_samples_total"] == n
    # cold: every page fetched for the job's requests, read through the handles it came with
    assert values['cachefs_client_pages_total{"outcome": "miss", "path": "held"}'] == n
    assert values['cachefs_client_bytes_total{"path": "held"}'] == n * 2000
    assert values['cachefs_client_reads_total{"path": "grpc"}'] == 0
    assert values["cachefs_client_steps_total"] == timer.summary().steps > 0


def _exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_dashboard_queries_only_documented_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard["panels"])
    assert len(exprs) >= 20
    docs = documented()
    histograms = {n for n, (kind, _) in docs.items() if kind == "histogram"}
    used = set()
    for expr in exprs:
        names = re.findall(r"\bcachefs_[a-z0-9_]+", expr)
        assert names, f"an expression with no cachefs metric: {expr}"
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in docs or base in histograms, f"undocumented metric {name!r} in {expr}"
            used.add(base if base in histograms else name)
    # The figures the dashboard exists for.
    for name in ("cachefs_worker_page_reads_total", "cachefs_worker_bytes_from_cache_total",
                 "cachefs_worker_bytes_from_store_total", "cachefs_worker_cache_evictions_total",
                 "cachefs_worker_cache_capacity_bytes", "cachefs_worker_request_seconds",
                 "cachefs_master_active_job_bytes"):
        assert name in used
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"] if p["type"] != "row")
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
