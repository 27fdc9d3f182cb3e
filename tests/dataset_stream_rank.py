"""One rank of tests/test_dataset_stream.py's one-lister test: make the dataset, read one epoch
with 2 forked DataLoader workers, print the sample ids and len as JSON."""

from __future__ import annotations

import json
import sys

from torch.utils.data import DataLoader

from cachefs.client.datasets.dataset import CacheDataset


def main() -> None:
    args = json.loads(sys.argv[1])
    ds = CacheDataset.from_prefix(args["url"], storage_options={"workers": args["workers"]},
                                  rank=args["rank"], world_size=args["world"], index_cache=args["cache"],
                                  shuffle=args.get("shuffle", False), plan_ahead=False, index_timeout=120,
                                  kept_index=args.get("kept", "refresh"))  # "refresh": the store's listing
    loader = DataLoader(ds, batch_size=50, sampler=ds.sampler(), num_workers=2, collate_fn=lambda b: b,
                        multiprocessing_context="fork", timeout=120)
    ids = [int(bytes(t[:8].numpy()).decode()) for batch in ds.track(loader) for t in batch]
    print(json.dumps({"ids": ids, "len": len(ds)}))


if __name__ == "__main__":
    main()
