"""The short soak (benchmarks/soak.py --short, ~35 s) as CI runs it: a real local cluster
(master + 2 worker processes) under 4 reader threads and 2 reader processes.

Bounds: no error; every byte read verified against its source; per worker, resident memory
grows by at most RSS_BOUND_KB and open descriptors by at most FD_BOUND between the first and
the last sample taken under full load (observed here over 120 s: < 1 MiB, +0-1 fds).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RSS_BOUND_KB = 48 << 10
FD_BOUND = 4


def test_short_soak_has_no_error_verifies_every_byte_and_stays_flat(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--out", str(out),
                           "--dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0, (result["first_errors"], proc.stderr[-2000:])
    assert result["errors"] == 0, result["first_errors"]
    assert result["reads"] > 500 and result["bytes_read"] > 0
    assert result["bytes_verified"] == result["bytes_read"]
    assert result["readers"]["processes"] == 2 and result["readers"]["total"] == 8
    assert result["seconds"] >= 29
    # Each page came from the store about once: the rest was served from the workers' caches.
    assert 0 < result["bytes_from_store"] <= 1.5 * result["source_bytes"]
    assert result["bytes_read"] > 5 * result["source_bytes"]
    for address, worker in result["workers"].items():
        assert worker["rss_growth_kb"] <= RSS_BOUND_KB, (address, worker)
        assert worker["fd_growth"] <= FD_BOUND, (address, worker)
        assert not worker["degraded"]
    assert len(result["timeline"]) >= 5  # sampled along the way, not only at the ends
