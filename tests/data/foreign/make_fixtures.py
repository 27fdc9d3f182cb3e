"""Writes the foreign-index fixtures under this directory with the real writer libraries.

    pip install --no-deps --target /tmp/foreignlibs mosaicml-streaming litdata xxhash zstd \
        lightning-utilities catalogue
    PYTHONPATH=/tmp/foreignlibs .venv/bin/python tests/data/foreign/make_fixtures.py

Run once; the output is committed (CI does not install either library). The libraries' package
``__init__``s import much that writing shards never uses (transformers, torchvision, brotli,
snappy): those are stubbed with empty modules here, only for this script.

The samples are ``sample(i)`` below; tests/test_foreign_indexes.py imports it to know what each
shard must hold.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import shutil
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
MDS_COLUMNS = {"id": "int", "name": "str", "blob": "bytes", "score": "float32", "meta": "json", "count": "uint16"}
N = {"mds": 40, "mds_zstd": 6, "litdata": 30, "litdata_tuple": 12, "litdata_zstd": 6, "litdata_arrow": 7}


def sample(i: int) -> dict:
    """Sample ``i``: values of every simple type the two formats encode, variable sizes included
    (an empty ``blob`` every seventh sample)."""
    return {"id": 1000 + i, "name": f"sample-{i:03d}" + "x" * (i % 5), "blob": bytes((i * 7 + k) % 256 for k in range((i * 13) % 41 if i % 7 else 0)),
            "score": i / 4, "meta": {"i": i, "even": i % 2 == 0}, "count": i * 3}


class _Stub(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for the imports writing never uses (see the module doc)."""

    roots = {"transformers", "torchvision", "brotli", "snappy"}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def _fresh(name: str) -> str:
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    return out


def write_mds(name: str, compression: str | None) -> None:
    from streaming.base.format.mds.writer import MDSWriter

    with MDSWriter(columns=MDS_COLUMNS, out=_fresh(name), size_limit=900, compression=compression) as w:
        for i in range(N[name]):
            w.write(sample(i))


def write_litdata(name: str, compression: str | None, as_tuple: bool = False, flat: bool = False) -> None:
    import numpy as np
    from litdata.streaming.writer import BinaryWriter

    out = _fresh(name)
    os.makedirs(out)
    w = BinaryWriter(out, chunk_size=5, compression=compression)
    for i in range(N[name]):
        s = sample(i)
        # ndarray leaves keep litdata from its Arrow-footer layout for flat JSON-like rows: the
        # classic pytree chunk is what this reads (and a footer is refused, see foreign.py)
        arr = np.arange(i % 4 + 1, dtype=np.int32) * i
        mat = np.full((2, i % 3 + 1), i, dtype=np.float32)
        if flat:  # JSON-like leaves only: litdata keeps these rows in its Arrow footer
            w[i] = {"id": s["id"], "name": s["name"]}
        else:
            w[i] = (s["id"], s["blob"], arr) if as_tuple else {
                "id": s["id"], "name": s["name"], "blob": s["blob"], "score": s["score"], "arr": arr, "mat": mat}
    w.done()
    w.merge()
    for f in os.listdir(out):  # the per-rank index the merge read
        if f != "index.json" and f.endswith("index.json"):
            os.remove(os.path.join(out, f))


def main() -> None:
    sys.meta_path.append(_StubFinder())
    write_mds("mds", None)
    write_mds("mds_zstd", "zstd")
    write_litdata("litdata", None)
    write_litdata("litdata_tuple", None, as_tuple=True)
    write_litdata("litdata_zstd", "zstd")
    write_litdata("litdata_arrow", None, flat=True)
    import litdata
    import streaming
    versions = {"mosaicml-streaming": streaming.__version__, "litdata": litdata.__version__}
    with open(os.path.join(HERE, "versions.json"), "w") as f:
        json.dump(versions, f, indent=1, sort_keys=True)
        f.write("\n")
    print(versions)


if __name__ == "__main__":
    main()
