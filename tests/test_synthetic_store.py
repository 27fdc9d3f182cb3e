"""cachefs.testing's synthetic store: objects that are only arithmetic, mounted like any store;
and, over it, #47's "no store request for a cached object while its metadata is fresh"."""

from __future__ import annotations

import fsspec
import pytest

import cachefs.testing  # noqa: F401 - registers synthetic://
from cachefs.config import MountSpec
from cachefs.mounts import MountTable
from cachefs.paths import CachePath
from cachefs.store.objects import ObjectStore


def synthetic_store(count: int, **options) -> ObjectStore:
    mount = MountSpec("syn", "synthetic://data", {"count": count, "per_dir": 100, **options})
    return ObjectStore(MountTable([mount]), metadata_ttl=60, list_ttl=0)


def test_it_lists_stats_and_reads_what_it_generates():
    fs = fsspec.filesystem("synthetic", count=250, per_dir=100, size=30)
    assert [d["name"] for d in fs.ls("synthetic://data")] == ["data/d00000", "data/d00001", "data/d00002"]
    assert len(fs.ls("data/d00002")) == 50 and len(fs.find("data")) == 250
    assert fs.info("data/d00001/00000123.bin") == {"name": "data/d00001/00000123.bin", "size": 30,
                                                   "type": "file", "mtime": 1.7e9}
    assert fs.cat_file("data/d00001/00000123.bin") == (b"00000123\n" * 4)[:30]
    assert fs.cat_file("data/d00001/00000123.bin", 9, 12) == b"000"
    for missing in ("data/d00003", "data/d00001/00000023.bin", "data/d00002/00000250.bin", "data/x", "other"):
        with pytest.raises(FileNotFoundError):
            fs.info(missing)
    assert fs.requests["info"] == 6 and fs.requests["ls"] == 2 and fs.requests["read"] == 2


def test_a_cached_object_costs_no_store_request_while_fresh():
    objects = synthetic_store(1000, size=10)
    fs = objects.mounts.resolve(CachePath("syn", "")).fs
    for j in range(10):
        objects.list(CachePath("syn", f"d{j:05d}"))
    asked = dict(fs.requests)
    assert asked == {"ls": 10}
    for i in range(1000):
        meta = objects.info(CachePath("syn", fs.key(i)))
        assert (meta.size, meta.version) == (10, f"10-{1.7e9!r}")
    assert dict(fs.requests) == asked  # all from the metadata table
    objects.forget_prefix("syn", "d00003/")
    objects.info(CachePath("syn", fs.key(300)))
    objects.info(CachePath("syn", fs.key(400)))
    assert fs.requests["info"] == 1  # only the freed one is asked again
