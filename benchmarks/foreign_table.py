"""Time and size of an MDS index's ShardTable at N shards x M samples (#46).

    .venv/bin/python benchmarks/foreign_table.py [shards] [samples_per_shard]

The shards' headers are made in memory and handed to ``foreign_table`` as its range reader, so
this measures the table's making (header checks, columns, the buffer) and not the reads through
the cache (one ``4 * (M + 2)``-byte range per shard).
"""

from __future__ import annotations

import json
import struct
import sys
import time

import numpy as np

from cachefs.client.datasets.foreign import foreign_table


def main() -> None:
    n_shards = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    shards, headers = [], {}
    for s in range(n_shards):
        name = f"shard.{s:05d}.mds"
        off = 4 * (n + 2) + 200 + np.arange(n + 1, dtype=np.int64) * 50  # 200: MDS's config JSON
        shards.append({"format": "mds", "version": 2, "compression": None, "column_names": ["img", "label"],
                       "column_encodings": ["jpeg", "int"], "column_sizes": [None, 8], "samples": n,
                       "raw_data": {"basename": name, "bytes": int(off[-1])}})
        headers[f"cachefs://data/train/{name}"] = struct.pack("<I", n) + off.astype("<u4").tobytes()
    doc = {"version": 2, "shards": shards}
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        table = foreign_table(doc, "cachefs://data/train/index.json", "cachefs://data/train",
                              lambda path, at, length: headers[path][at:at + length], None)
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"shards": n_shards, "samples": table.n_samples, "best_of_3_s": round(best, 3),
                      "bytes_per_sample": round(table.nbytes / table.n_samples, 1)}))


if __name__ == "__main__":
    main()
