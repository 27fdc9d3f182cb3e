"""The example training script runs end to end on a local cluster (CPU path: no pinning, blocking
copies), reports samples/s and the data-wait share per epoch, and resumes from its checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"
sys.path.insert(0, str(EXAMPLE.parent))

from train import decode_on_device  # noqa: E402


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--local", "--samples", "96", "--sample-size", "8192",
                           "--batch-size", "16", "--num-workers", "2", *args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_example_trains_reports_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    out = _run("--epochs", "2", "--workdir", str(tmp_path / "w"), "--checkpoint", str(ckpt),
               "--checkpoint-every", "2", "--tensorboard", str(tmp_path / "tb"), "--log-every", "2")
    assert "device cpu" in out and "pin_memory False" in out
    # one page a sample: the warm epoch's 96 are hits; the cold one's are misses unless a hint was first
    pages = re.search(r"pages (\d+) hits, (\d+) misses \(as the workers knew them\); 0 failovers, 0 errors", out)
    assert pages and int(pages[1]) + int(pages[2]) == 192 and int(pages[1]) >= 96, out
    # The TensorBoard log, drawn headless (docs/dataset.md shows such a picture): every default tag
    from tensorboard_png import DEFAULT_TAGS, load, render
    scalars = load(str(tmp_path / "tb"))
    assert scalars["cachefs/data/samples"][-1][1] == 192 and len(scalars["cachefs/step/wait_share"]) >= 6
    png = tmp_path / "tb.png"
    assert render(str(tmp_path / "tb"), str(png)) == list(DEFAULT_TAGS)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    epochs = re.findall(r"epoch (\d): 96 samples in [\d.]+ s = (\d+) samples/s; waiting for data ([\d.]+)%", out)
    assert [e[0] for e in epochs] == ["0", "1"]
    assert all(int(rate) > 0 and 0 <= float(share) <= 100 for _, rate, share in epochs)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["data"]["epoch"] == 1 and saved["data"]["samples_seen"] == 96
    again = _run("--epochs", "3", "--workdir", str(tmp_path / "w"), "--checkpoint", str(ckpt))
    assert "resumed at epoch 1, sample 96 of 96" in again
    assert re.findall(r"epoch (\d): (\d+) samples", again) == [("1", "0"), ("2", "96")]


def test_decode_on_device_cpu_fallback():
    batch = torch.zeros(4, 4200, dtype=torch.uint8)
    batch[:, 8] = torch.tensor([1, 2, 3, 13], dtype=torch.uint8)
    batch[:, 16] = 255
    x, y = decode_on_device(batch, torch.device("cpu"))
    assert x.dtype == torch.float32 and x.shape == (4, 4096) and float(x[0, 0]) == 1.0
    assert y.tolist() == [1, 2, 3, 3]
