#!/usr/bin/env python
"""Reads on a TLS cluster: the data port over TLS against gRPC over TLS (what a client on a TLS
cluster used before the framed ports spoke TLS), and the plaintext data port beside them.

    .venv/bin/python benchmarks/bench_tls_reads.py                 # 5 rounds
    .venv/bin/python benchmarks/bench_tls_reads.py --rounds 9

Two ``cachefs local``-style clusters in child processes (one worker each, a local-directory
mount): one serving TLS (certificates made here: tests/tlscerts.py), one plaintext. Per round,
each way in turn reads, warm (read once before), with short-circuit off (the other host's path):

    tls-dataport   the TLS cluster, the data port over TLS (the client's default there now)
    tls-grpc       the TLS cluster, data_port=False: gRPC over TLS
    plain-dataport the plaintext cluster's data port (what TLS costs on top)

Workloads: ``large`` (8 objects of 16 MiB, one reader) and ``small`` (400 objects of 256 KiB, one
reader). Every read is compared with the file. Reported: median seconds per way and workload,
MB/s, and each way's time over tls-grpc's. JSON: benchmarks/results/tls-reads-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

WORKLOADS = {"large": (8, 16 << 20), "small": (400, 256 << 10)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()

    import fsspec

    from cachefs.local import LocalCluster
    from cachefs.tls import TLSConfig
    from tlscerts import make_pki

    results: dict[str, dict[str, list[float]]] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        root = Path(tmp)
        pki = make_pki(root / "pki")
        data = root / "data"
        files: dict[str, dict[str, bytes]] = {}
        for name, (count, size) in WORKLOADS.items():
            (data / name).mkdir(parents=True)
            files[name] = {}
            for i in range(count):
                blob = os.urandom(size)
                (data / name / f"{i:04d}.bin").write_bytes(blob)
                files[name][f"data/{name}/{i:04d}.bin"] = blob
        server_tls = TLSConfig(ca_file=pki.ca, cert_file=pki.server_cert, key_file=pki.server_key)
        with LocalCluster(str(root / "tls"), workers=1, mounts={"data": str(data)}, tls=server_tls) as secure, \
                LocalCluster(str(root / "plain"), workers=1, mounts={"data": str(data)}) as plain:
            assert secure.wait_for_workers(timeout=60) and plain.wait_for_workers(timeout=60)
            ways = {
                "tls-dataport": fsspec.filesystem("cachefs", skip_instance_cache=True, master=secure.master_address,
                                                  short_circuit=False, tls_ca_file=pki.ca),
                "tls-grpc": fsspec.filesystem("cachefs", skip_instance_cache=True, master=secure.master_address,
                                              short_circuit=False, data_port=False, tls_ca_file=pki.ca),
                "plain-dataport": fsspec.filesystem("cachefs", skip_instance_cache=True, master=plain.master_address,
                                                    short_circuit=False),
            }
            for fs in ways.values():  # warm: every object cached, connections open
                for name in WORKLOADS:
                    for path, blob in files[name].items():
                        if fs.cat_file(path) != blob:
                            failures.append(f"warm-up read of {path} differs")
            for _ in range(args.rounds):
                for way, fs in ways.items():
                    for name in WORKLOADS:
                        t0 = time.perf_counter()
                        got = [fs.cat_file(path) for path in files[name]]
                        results.setdefault(way, {}).setdefault(name, []).append(time.perf_counter() - t0)
                        if got != list(files[name].values()):
                            failures.append(f"{way} {name}: wrong bytes")
            stats = {way: fs.session.bulk_stats["data_port"]["reads"] for way, fs in ways.items()}
            for fs in ways.values():
                fs.close()

    report: dict = {"benchmark": "warm reads on a TLS cluster: data port over TLS vs gRPC over TLS",
                    "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "rounds": args.rounds, "data_port_reads": stats, "results": {}, "failures": failures}
    for way, by_name in results.items():
        report["results"][way] = {}
        for name, times in by_name.items():
            count, size = WORKLOADS[name]
            med = statistics.median(times)
            report["results"][way][name] = {"median_s": round(med, 4), "mb_per_s": round(count * size / med / 1e6, 1),
                                            "runs_s": [round(t, 4) for t in times]}
    report["time_vs_tls_grpc"] = {
        way: {name: round(r["median_s"] / report["results"]["tls-grpc"][name]["median_s"], 3)
              for name, r in by_name.items()}
        for way, by_name in report["results"].items()}
    os.makedirs(args.out, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    with open(os.path.join(args.out, f"tls-reads-{stamp}.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
