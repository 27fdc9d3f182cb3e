"""cachefs: a caching data-access layer between object stores and GPU training.

The data path is client -> worker -> page store -> object store:
``cachefs.client`` (fsspec filesystem), ``cachefs.server`` (worker and master daemons, page
store), ``cachefs.proto`` (gRPC wire format). Shared pieces (config, errors, paths, mounts, the
page-file format, and ``cachefs.store``: the object-store adapter) live at this level.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["CacheDataset", "CacheFileSystem", "CacheIterableDataset", "StepTimer", "register_webdataset", "write_tar_shards",
           "__version__"]


def __getattr__(name: str):
    # Lazy: importing cachefs must not pull grpc/fsspec into every process that only
    # needs the config or errors (e.g. the CLI parsing its flags).
    if name == "CacheFileSystem":
        from cachefs.client.fs.filesystem import CacheFileSystem

        return CacheFileSystem
    if name == "CacheDataset":  # imports torch: only when asked for
        from cachefs.client.datasets.dataset import CacheDataset

        return CacheDataset
    if name == "CacheIterableDataset":
        from cachefs.client.datasets.iterable import CacheIterableDataset

        return CacheIterableDataset
    if name == "StepTimer":  # no torch, no grpc: times any iterable of batches
        from cachefs.client.stats.steptimer import StepTimer

        return StepTimer
    if name == "register_webdataset":  # webdataset opens cachefs:// URLs (client/fs/wds.py)
        from cachefs.client.fs.wds import register_webdataset

        return register_webdataset
    if name == "write_tar_shards":
        from cachefs.client.datasets.shards import write_tar_shards

        return write_tar_shards
    raise AttributeError(f"module 'cachefs' has no attribute {name!r}")
