"""PyTorch datasets: map-style (dataset.py) and tar shards (iterable.py, shards.py), their
sampling, indexes, prefetch and read plans.
"""

__all__ = [
    "dataset",
    "indexcache",
    "iterable",
    "plans",
    "prefetch",
    "prefixindex",
    "runbuffers",
    "sampleindex",
    "sampling",
    "shards",
    "shardscan",
]
