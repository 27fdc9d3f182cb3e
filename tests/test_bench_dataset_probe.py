"""bench_dataset's outside writer (``write_probe``): the cost of new page-cache memory on the
machine during an epoch, measured by a process that is no loader's, then cleaned up."""

from __future__ import annotations

import os
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


@pytest.mark.timeout(120)
def test_write_probe_times_new_files_and_removes_them(tmp_path):
    bench_dataset = pytest.importorskip("bench_dataset")
    where = tmp_path / "probe"
    with bench_dataset.write_probe(str(where)) as out:
        deadline = time.monotonic() + 60
        while not (where.exists() and len(os.listdir(where)) >= 3) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert out == {}  # figures come when it stops
    assert out["writes"] >= 3
    assert 0 < out["median_ms"] <= out["p90_ms"]
    assert os.listdir(where) == []  # its files do not outlive it
