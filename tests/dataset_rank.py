"""One simulated DDP rank, as its own process: reads its share of an epoch through a DataLoader
with real worker processes and prints the sample ids it got (JSON), for test_dataset_ranks.py."""

from __future__ import annotations

import argparse
import json
import sys

from torch.utils.data import DataLoader

from cachefs.client.datasets.dataset import CacheDataset
from cachefs.client.datasets.iterable import CacheIterableDataset


def _as_list(batch):
    return batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["map", "iter"], required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--workers", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--epoch", type=int, default=0)
    args = ap.parse_args()
    opts = {"workers": args.workers}
    common = dict(storage_options=opts, rank=args.rank, world_size=args.world, seed=11)
    if args.kind == "map":
        ds = CacheDataset.from_prefix(args.url, **common)
        loader = DataLoader(ds, batch_size=4, sampler=ds.sampler(), num_workers=args.num_workers,
                            collate_fn=_as_list, timeout=120)
        key = lambda t: int(bytes(t[:8].numpy()))  # noqa: E731
    else:
        ds = CacheIterableDataset.from_prefix(args.url, batch_size=4, **common)
        loader = DataLoader(ds, batch_size=4, num_workers=args.num_workers, collate_fn=_as_list, timeout=120)
        key = lambda s: int(bytes(s["id"].numpy()))  # noqa: E731
    ds.set_epoch(args.epoch)
    ids = [key(item) for batch in ds.track(loader) for item in batch]
    json.dump({"ids": ids, "state": ds.state_dict()}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
