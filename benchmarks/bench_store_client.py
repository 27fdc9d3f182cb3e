"""S3 client cost, side by side: the worker's s3fs backend against a native-code client, one run.

    .venv/bin/python benchmarks/bench_store_client.py              # 256 KiB and 8 MiB GETs
    .venv/bin/python benchmarks/bench_store_client.py --quick
    .venv/bin/python benchmarks/bench_store_client.py --delay-ms 10

#15 asks which S3 client the worker should use, by CPU seconds per GB and throughput. Each
client reads the same objects from one moto server (netem.py; ``--delay-ms`` as there) with
ranged GETs pinned to the ETag (``If-Match``), as the worker does: ``s3fs`` is
``cachefs.store.backends._S3Backend.read`` (aiobotocore), ``obstore`` is obstore's Rust client
(``pip install obstore``; skipped, and said so, where it is missing). Reported per client, object
size and reader count: GETs/s, MB/s and this process's CPU seconds per GB (user + system, all
threads), and moto's CPU per GB apart. Writes benchmarks/results/store-client-<timestamp>.json
(and latest-store-client.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netem import moto_endpoint  # noqa: E402
from read_common import machine_info, process_cpu  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def s3fs_reader(endpoint: Any, bucket: str) -> Callable[[str, int, str], bytes]:
    import s3fs

    from cachefs.store.backends import _S3Backend

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **endpoint.storage_options())
    backend = _S3Backend()
    return lambda key, size, etag: backend.read(fs, f"{bucket}/{key}", 0, size, etag)


def obstore_reader(endpoint: Any, bucket: str) -> Callable[[str, int, str], bytes]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint.url, access_key_id="testing", secret_access_key="testing",
                    region="us-east-1", virtual_hosted_style_request=False,
                    client_options={"allow_http": True})

    def read(key: str, size: int, etag: str) -> bytes:
        return bytes(obstore.get(store, key, options={"range": (0, size), "if_match": etag}).bytes())
    return read


def http_reader(endpoint: Any, bucket: str, signer: Any = None) -> Callable[[str, int, str], bytes]:
    """The worker's HTTP client, configured as botocore resolves the options (s3config.py)."""
    from cachefs.store.s3http import S3HttpClient, S3Settings

    client = S3HttpClient(S3Settings(endpoint=endpoint.url, key="testing", secret="testing", region="us-east-1"))
    if signer is not None:
        client._signer = signer

    def read(key: str, size: int, etag: str) -> bytes:
        out: list[bytes] = []
        client.get(bucket, key, 0, [size], etag, lambda i, piece: out.append(piece))
        return out[0]
    return read


class BotocoreSigner:
    """The HTTP client's signer swapped for botocore's S3SigV4Auth (#49: does the client still pay
    once signing is botocore's too?)."""

    def sign(self, credentials: tuple[str, str, str], region: str, path: str, query: str,
             headers: dict[str, str]) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import ReadOnlyCredentials

        request = AWSRequest(method="GET", url=f"http://{headers['host']}{path}" + (f"?{query}" if query else ""),
                             headers=dict(headers))
        S3SigV4Auth(ReadOnlyCredentials(credentials[0], credentials[1], credentials[2] or None), "s3",
                    region).add_auth(request)
        headers.update({k.lower(): v for k, v in request.headers.items()})


def http_botocore_signer_reader(endpoint: Any, bucket: str) -> Callable[[str, int, str], bytes]:
    return http_reader(endpoint, bucket, BotocoreSigner())


CLIENTS = {"s3fs": s3fs_reader, "obstore": obstore_reader, "http": http_reader,
           "http-botocore-signer": http_botocore_signer_reader}


def one_pass(read: Callable[[str, int, str], bytes], keys: list[str], size: int, etags: dict[str, str],
             readers: int, store_pid: int) -> dict[str, Any]:
    t0, c0, s0 = time.perf_counter(), own_cpu(), process_cpu(store_pid)
    with ThreadPoolExecutor(readers) as pool:
        got = list(pool.map(lambda k: len(read(k, size, etags[k])), keys))
    wall, cpu, store = time.perf_counter() - t0, own_cpu() - c0, process_cpu(store_pid) - s0
    if got != [size] * len(keys):
        raise AssertionError(f"short reads: {sorted(set(got))}")
    gb = len(keys) * size / 1e9
    return {"gets_per_s": round(len(keys) / wall, 1), "mb_per_s": round(len(keys) * size / wall / 1e6, 1),
            "client_cpu_s_per_gb": round(cpu / gb, 2), "client_cpu_ms_per_get": round(cpu / len(keys) * 1e3, 3),
            "store_cpu_s_per_gb": round(store / gb, 2), "seconds": round(wall, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer objects (128 small, 8 large)")
    p.add_argument("--readers", default="1,8")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--repeat", type=int, default=2, help="passes per case (the one of median wall is kept)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    sizes = {256 << 10: 128 if args.quick else 512, 8 << 20: 8 if args.quick else 24}
    readers = [int(r) for r in args.readers.split(",")]
    results, skipped = [], {}
    started = dt.datetime.now(dt.timezone.utc)
    with moto_endpoint(args.delay_ms) as moto:
        print(f"object store: {moto.note}", flush=True)
        bucket, s3 = moto.new_bucket("store-client"), moto.client()
        keys: dict[int, list[str]] = {}
        etags: dict[str, str] = {}
        for size, count in sizes.items():
            body = os.urandom(size)
            keys[size] = [f"o{size}/{i:05d}" for i in range(count)]
            for key in keys[size]:
                etags[key] = s3.put_object(Bucket=bucket, Key=key, Body=body)["ETag"].strip('"')
        clients = {}
        for name, make in CLIENTS.items():
            try:
                clients[name] = make(moto, bucket)
            except ImportError as exc:
                skipped[name] = f"not installed: {exc}"
        for size, names in keys.items():
            for n in readers:
                for name, read in clients.items():
                    read(names[0], size, etags[names[0]])  # connections and imports warmed
                    passes = [one_pass(read, names, size, etags, n, moto.store_pid) for _ in range(args.repeat)]
                    row = {"client": name, "size": size, "readers": n, "objects": len(names),
                           **sorted(passes, key=lambda r: r["seconds"])[len(passes) // 2]}
                    print(json.dumps(row), flush=True)
                    results.append(row)
    doc = {"benchmark": "store-client", "started": started.isoformat(), "args": vars(args),
           "machine": machine_info(), "endpoint": moto.as_dict(), "skipped": skipped, "results": results,
           "ratios": ratios(results)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"store-client-{started.strftime('%Y%m%dT%H%M%SZ')}.json")
    for target in (path, os.path.join(args.out, "latest-store-client.json")):
        with open(target, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc["ratios"], indent=1))
    print(f"wrote {path}")
    return 0


def ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each client against s3fs per case: client CPU per GB (lower is better) and throughput."""
    by = {(r["client"], r["size"], r["readers"]): r for r in results}
    out = {}
    for (client, size, n), r in by.items():
        base = by.get(("s3fs", size, n))
        if client == "s3fs" or base is None:
            continue
        out[f"{client} vs s3fs, {size >> 10} KiB, {n} readers"] = {
            "client_cpu_per_gb": round(r["client_cpu_s_per_gb"] / base["client_cpu_s_per_gb"], 3),
            "throughput": round(r["mb_per_s"] / base["mb_per_s"], 3)}
        native = by.get(("obstore", size, n))
        if client.startswith("http") and native is not None:  # #49's bar: at most 0.7x obstore's CPU
            out[f"{client} vs obstore, {size >> 10} KiB, {n} readers"] = {
                "client_cpu_per_gb": round(r["client_cpu_s_per_gb"] / native["client_cpu_s_per_gb"], 3)}
    return out


if __name__ == "__main__":
    sys.exit(main())
