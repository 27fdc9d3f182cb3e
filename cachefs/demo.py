"""``cachefs demo``: why cachefs exists, in one run on this machine.

An S3 store (moto, embedded: the ``demo`` extra) sits behind a userspace delay proxy
(cachefs/netem.py) so that a request's first byte comes ~20 ms after it is sent, as from a real
object store. One Dataset class reads one sample per item with ``fs.cat_file(url)``; a DataLoader
(the same settings every time) runs an epoch over it through s3fs directly and through
``cachefs://`` (a local master and worker processes), cold then warm, and the demo prints items/s
and the share of the epoch the loop spent waiting for data, then a one-line conclusion.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from cachefs.config import parse_size


def _digest(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data) >> 1  # fits an int64 tensor


class UrlDataset:
    """Item i is the bytes of ``urls[i]`` as a uint8 tensor, with their digest; the same code for
    ``s3://`` and ``cachefs://`` (only the storage options differ). The filesystem is made in
    each DataLoader worker on its first item."""

    def __init__(self, urls: list[str], storage_options: dict[str, Any]) -> None:
        self.urls = urls
        self.storage_options = storage_options
        self._fs: Any = None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import fsspec
        import torch

        if self._fs is None:
            self._fs = fsspec.core.url_to_fs(self.urls[0], **self.storage_options)[0]
        data = self._fs.cat_file(self.urls[i])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), _digest(data)


@dataclass
class Epoch:
    label: str
    items: int
    seconds: float
    wait: float
    wrong: int

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def wait_share(self) -> float:
        return self.wait / self.seconds


def _epoch(label: str, loader: Any, expected: dict[int, int], step_s: float) -> Epoch:
    """One pass: the time spent in ``next()`` is the data wait; each batch then takes ``step_s``
    (a stand-in for the GPU step: it sleeps, as a host waiting on a GPU does)."""
    t0 = time.perf_counter()
    wait, items, wrong = 0.0, 0, 0
    batches = iter(loader)
    while True:
        w0 = time.perf_counter()
        batch = next(batches, None)
        wait += time.perf_counter() - w0
        if batch is None:
            break
        data, digests = batch
        items += len(digests)
        wrong += sum(1 for d in digests.tolist() if d not in expected)
        if step_s:
            time.sleep(step_s)
    return Epoch(label, items, time.perf_counter() - t0, wait, wrong)


def _upload(endpoint: Any, bucket: str, samples: int, size: int) -> dict[int, int]:
    client = endpoint.client()

    def put(i: int) -> int:
        data = os.urandom(size)
        client.put_object(Bucket=bucket, Key=f"train/sample-{i:06d}.bin", Body=data)
        return _digest(data)

    with ThreadPoolExecutor(8) as pool:  # within botocore's 10 pooled connections
        return {d: 1 for d in pool.map(put, range(samples))}


def _cache_report(cluster: Any, dataset_bytes: int, epochs: int, token: str = "") -> str:
    """What the workers fetched from the store and what their page store answered, summed."""
    from cachefs.proto import worker_pb2, worker_pb2_grpc
    from cachefs.tls import open_channel

    pages = from_store = 0
    for worker in cluster.workers:
        with open_channel(worker.address, token=token) as channel:
            status = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        pages += status.pages
        from_store += status.bytes_from_store
    # (their hit/miss counters leave out the reads a client on this host makes from page files itself)
    return (f"cachefs workers: {from_store / 1e6:.1f} MB fetched from S3 in all, for a {dataset_bytes / 1e6:.1f} MB "
            f"data set read {epochs} times through cachefs; {pages} pages cached")


def run_demo(samples: int = 600, sample_size: str | int = "256KiB", delay_ms: float = 5.0, workers: int = 2,
             batch_size: int = 32, num_workers: int = 2, step_ms: float = 5.0, workdir: str | None = None,
             warm_epochs: int = 3) -> int:
    """Prints the side-by-side epochs; returns 0, or 1 if a sample's bytes were wrong or the cluster
    did not start. Needs the ``demo`` extra (moto) for the embedded S3."""
    import torch

    from cachefs.local import LocalCluster
    from cachefs.tokens import new_token

    try:
        from cachefs.netem import moto_endpoint
        import moto  # noqa: F401  (the embedded S3 runs in a child process; fail here with the fix)
    except ImportError as exc:
        print(f"cachefs demo needs the embedded S3: pip install 'cachefs[demo]' ({exc})")
        return 1
    size = parse_size(sample_size)
    workdir = workdir or tempfile.mkdtemp(prefix="cachefs-demo-")
    settings = dict(batch_size=batch_size, num_workers=num_workers, persistent_workers=num_workers > 0,
                    shuffle=False)
    print(f"cachefs demo: {samples} samples of {size // 1024} KiB in S3, one epoch = {samples} reads; "
          f"DataLoader batch {batch_size}, {num_workers} workers, a {step_ms:g} ms step per batch")
    t_start = time.perf_counter()
    with moto_endpoint(delay_ms, netem=False) as endpoint:
        print(f"S3: moto on this machine behind a delay proxy, {delay_ms:g} ms each way: "
              f"one GET's first byte after {endpoint.rtt_ms} ms (measured)")
        bucket = endpoint.new_bucket("cachefs-demo")
        expected = _upload(endpoint, bucket, samples, size)
        keys = [f"train/sample-{i:06d}.bin" for i in range(samples)]
        mount = {"url": f"s3://{bucket}", "options": endpoint.storage_options()}
        token = new_token()  # secure by default, as `cachefs local` runs (cachefs/tokens.py)
        with LocalCluster(os.path.join(workdir, "cluster"), workers=workers, mounts={"demo": mount},
                          quota="4GiB", access_token=token, cluster_token=new_token()) as cluster:
            if not cluster.wait_for_workers():
                print(f"the cluster's workers did not join the master in time (logs in {workdir}/cluster)")
                return 1
            print(f"cachefs: a master and {workers} workers on this machine, mount demo -> s3://{bucket}")
            runs = [("s3fs direct", [f"s3://{bucket}/{k}" for k in keys], endpoint.storage_options()),
                    ("cachefs", [f"cachefs://demo/{k}" for k in keys],
                     {"master": cluster.master_address, "token": token})]
            epochs: list[Epoch] = []
            print(f"{'':26}{'items/s':>10}{'data wait':>12}{'seconds':>9}")
            for name, urls, options in runs:
                loader = torch.utils.data.DataLoader(UrlDataset(urls, options), **settings)
                for phase in ("cold", "warm"):
                    e = _epoch(f"{name}, {phase}", loader, expected, step_ms / 1000)
                    if phase == "warm" and name == "cachefs":
                        # an epoch of a fraction of a second is at the mercy of a busy core: the
                        # warm row is three epochs together (s3fs's one takes many seconds)
                        more = [_epoch("", loader, expected, step_ms / 1000) for _ in range(warm_epochs - 1)]
                        e = Epoch(f"{e.label} (x{warm_epochs})", e.items + sum(m.items for m in more),
                                  e.seconds + sum(m.seconds for m in more), e.wait + sum(m.wait for m in more),
                                  e.wrong + sum(m.wrong for m in more))
                    epochs.append(e)
                    print(f"{e.label:26}{e.rate:10.1f}{100 * e.wait_share:11.1f}%{e.seconds:8.1f}s", flush=True)
                del loader  # its persistent workers exit
            print(_cache_report(cluster, samples * size, 1 + warm_epochs, token))
    wrong = sum(e.wrong for e in epochs)
    s3_warm, cache_warm = epochs[1], epochs[3]
    speedup = cache_warm.rate / s3_warm.rate
    print(f"wrong bytes: {wrong} samples; demo took {time.perf_counter() - t_start:.0f} s")
    print(f"conclusion: the same Dataset code read {speedup:.1f}x faster through cachefs (warm) than through "
          f"s3fs directly; the loop waited for data {100 * cache_warm.wait_share:.0f}% of the epoch instead "
          f"of {100 * s3_warm.wait_share:.0f}%")
    return 1 if wrong else 0
