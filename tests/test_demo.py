"""``cachefs demo`` end to end, small: an embedded S3 behind the delay proxy, a DataLoader epoch
through s3fs and through a local cluster, cold then warm, every sample's bytes checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("moto")


def test_demo_prints_both_loaders_side_by_side_and_a_conclusion(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "cachefs.cli", "demo", "--samples", "64", "--sample-size", "16KiB",
                           "--delay-ms", "2", "--batch-size", "8", "--step-ms", "0", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240,
                          env={k: v for k, v in os.environ.items() if k != "CACHEFS_SCAN_AHEAD"})  # as users run it
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"behind a delay proxy, 2 ms each way: one GET's first byte after [\d.]+ ms \(measured\)", out)
    rows = dict(re.findall(r"^(s3fs direct, cold|s3fs direct, warm|cachefs, cold|cachefs, warm \(x3\))\s+([\d.]+)\s",
                           out, re.M))
    assert set(rows) == {"s3fs direct, cold", "s3fs direct, warm", "cachefs, cold", "cachefs, warm (x3)"}, out
    assert all(float(v) > 0 for v in rows.values())
    assert "wrong bytes: 0 samples" in out
    # the workers fetched the data set from S3 about once in four epochs (64 x 16 KiB = 1.0 MB), and cache it
    fetched = re.search(r"cachefs workers: ([\d.]+) MB fetched from S3 in all, for a 1\.0 MB data set read 4 times "
                        r"through cachefs; 64 pages cached", out)
    assert fetched and float(fetched.group(1)) < 2.0, out
    assert re.search(r"^conclusion: the same Dataset code read [\d.]+x faster through cachefs", out, re.M)


def test_demo_without_the_embedded_s3_says_how_to_get_it(tmp_path) -> None:
    """moto missing (a plain `pip install cachefs`): one line naming the extra, exit 1, no traceback."""
    blocker = tmp_path / "nomoto"
    blocker.mkdir()
    (blocker / "moto.py").write_text("raise ImportError('No module named moto (hidden by the test)')\n")
    proc = subprocess.run([sys.executable, "-m", "cachefs.cli", "demo", "--samples", "4"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(blocker)})
    assert proc.returncode == 1 and "pip install 'cachefs[demo]'" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
