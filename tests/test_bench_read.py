"""The read benchmark (benchmarks/bench_read.py) runs end to end at tiny sizes.

A real run, as a child process: moto, the raw gRPC and TCP limit servers and cachefs workers
are real processes; every case must read verified bytes and the JSON and PNG must be written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_read.py")
WORKLOADS = ("small_seq", "small_conc", "large", "large_conc")
PHASES = {"s3fs": ("direct",), "simplecache": ("first", "second"), "blockcache": ("first", "second"),
          "cachefs_local": ("cold", "warm"), "cachefs_remote": ("cold", "warm"),
          "cachefs_cat": ("cold", "warm"), "cachefs_open": ("cold", "warm"),
          "local": ("limit",), "grpc_raw": ("limit",), "tcp_raw": ("limit",)}
PEERS_FLAKY_WHEN_CONCURRENT = ("simplecache", "blockcache")  # fsspec's caches race on a first read


@pytest.mark.timeout(120)
def test_smoke_run_has_every_case_verified_and_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--threads", "4", "--out-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "latest.json").read_text())
    assert doc["ok"] and doc["wrong_objects"] == 0 and not doc["failed_cases"]
    assert doc["parameters"]["store_note"]
    cases = {(r["system"], r["workload"], r["phase"]): r for r in doc["results"]}
    for system, phases in PHASES.items():
        for workload in WORKLOADS:
            for phase in phases:
                r = cases.get((system, workload, phase))
                flaky = system in PEERS_FLAKY_WHEN_CONCURRENT and workload.endswith("_conc")
                if r is None and flaky and cases[(system, workload, "first")]["error"]:
                    continue  # the first pass raised: no second pass on that cache
                assert r is not None, f"missing case {system}/{workload}/{phase}"
                assert r["api"], r
                if flaky and not r["verified"]:
                    continue  # recorded as a failed peer, not a failed run
                assert r["verified"] and r["error"] is None and r["wrong_objects"] == 0, r
                want_objects = 4 if workload == "large_conc" else 2 if workload == "large" else 8
                assert r["objects"] == want_objects, r
                assert r["bytes"] == want_objects * (2 << 20 if workload.startswith("large") else 64 << 10), r
                assert r["readers"] == (4 if workload.endswith("_conc") else 1), r
                if workload.startswith("small"):
                    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"], r
    # Large objects go through read_into for cachefs; cachefs_remote never takes the short-circuit.
    assert "read_into" in cases[("cachefs_local", "large", "warm")]["api"]
    remote_paths = cases[("cachefs_remote", "large", "warm")].get("extra", {}).get("client_paths")
    if remote_paths is not None:
        assert remote_paths["short_circuit"]["reads"] == 0, remote_paths
    # The warm pass is served by the worker's cache: every read a hit on the client's side, and the
    # worker's status reports its page store's counters. (Its own hit counter sees a page opened
    # for a read; pages a client holds or opens by name are counted when its report of them, sent
    # behind the reads, arrives, and cold reads whose fill ran past its deadline on a busy machine
    # were read another way: it can still be 0 here.)
    warm = cases[("cachefs_local", "small_seq", "warm")]["extra"]
    status = warm["worker_status"]
    assert status["hits"] + status["misses"] > 0 and status["bytes_from_store"] >= 8 * (64 << 10), status
    short = warm["client_paths"]["short_circuit"]
    assert short["reads"] == 8 and short["hits"] >= 8 and short["misses"] == 0, short
    # Every target ratio is computed (every case it needs ran).
    ratios = doc["ratios"]
    for name in ("cachefs_local_warm_vs_local.large", "cachefs_remote_warm_vs_tcp_raw.large",
                 "cachefs_local_warm_vs_s3fs_direct.small_seq", "cachefs_local_cold_wall_vs_s3fs_direct_wall.large",
                 "grpc_raw_vs_tcp_raw.large_conc"):
        assert ratios[name]["value"] is not None and ratios[name]["value"] > 0, (name, ratios[name])
    png = out / doc["plot"]
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "latest.png").exists()
    assert "ratios (same run, same data)" in proc.stdout and "store:" in proc.stdout
