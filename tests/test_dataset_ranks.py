"""Both datasets with ranks as real processes (each with 2 DataLoader worker processes) over a
real worker and a real store (a local dir and moto S3): each sample exactly once per epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path


from cachefs.client.datasets.shards import write_tar_shards

HERE = Path(__file__).parent
N = 48  # divides over 2 ranks x 2 workers x batches of 4: no padding, so "exactly once" is exact


def _run_ranks(kind: str, url: str, workers: str, world: int = 2, epoch: int = 0) -> list[list[int]]:
    procs = [subprocess.Popen([sys.executable, str(HERE / "dataset_rank.py"), "--kind", kind, "--url", url,
                               "--workers", workers, "--rank", str(r), "--world", str(world),
                               "--epoch", str(epoch)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]  # all ranks at once, as DDP runs them
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout)["ids"])
    return out


def test_map_dataset_ranks_in_processes(store, make_worker):
    for i in range(N):
        store.add(f"train/{i:05d}.bin", f"{i:08d}".encode() + bytes(1000 + i))
    worker = make_worker(store.mount, page_size=64 << 10)
    per_rank = _run_ranks("map", "cachefs://data/train", worker.address)
    assert [len(r) for r in per_rank] == [N // 2, N // 2]
    assert Counter(i for r in per_rank for i in r) == Counter(range(N))
    again = _run_ranks("map", "cachefs://data/train", worker.address, epoch=1)
    assert Counter(i for r in again for i in r) == Counter(range(N)) and again != per_rank


def test_iterable_dataset_ranks_in_processes(store, make_worker, tmp_path):
    samples = ((f"s/{i:05d}", {"id": f"{i:08d}".encode(), "bin": bytes(2000 + i)}) for i in range(N))
    write_tar_shards(samples, str(tmp_path / "shards"), shard_bytes=30_000)
    for f in sorted((tmp_path / "shards").iterdir()):
        store.add(f"shards/{f.name}", f.read_bytes())
    worker = make_worker(store.mount, page_size=64 << 10)
    per_rank = _run_ranks("iter", "cachefs://data/shards", worker.address)
    assert [len(r) for r in per_rank] == [N // 2, N // 2]
    assert Counter(i for r in per_rank for i in r) == Counter(range(N))
