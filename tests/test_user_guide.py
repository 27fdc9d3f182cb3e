"""Every ```python block of docs/user-guide.md runs, in order, against a real local cluster.

The cluster is the one the guide describes: a master and a worker as child processes, over a
moto S3 bucket ``my-training-data`` mounted as ``datasets`` (read-only) and ``checkpoints``;
the client finds it through ``CACHEFS_MASTER``, as the guide says.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from cachefs.client.fs.filesystem import CacheFileSystem
from cachefs.local import LocalCluster
from helpers import payload

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "user-guide.md"
BUCKET = "my-training-data"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_guide_has_examples_for_each_step():
    blocks = python_blocks(GUIDE.read_text())
    assert len(blocks) >= 6
    joined = "\n".join(blocks)
    for needed in ("cachefs://datasets", "CacheDataset", "torch.save", "cachefs::s3://", "pd.read_csv"):
        assert needed in joined, needed


@pytest.mark.slow
def test_user_guide_examples_run(moto_server, aws_env, tmp_path, monkeypatch):
    s3 = moto_server.client()
    if BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=BUCKET)
    for i in range(64):
        s3.put_object(Bucket=BUCKET, Key=f"datasets/train/sample-{i:05d}.bin", Body=payload(4096, seed=i))
    s3.put_object(Bucket=BUCKET, Key="datasets/tables/labels.csv",
                  Body=b"sample,label\n" + b"".join(b"%d,%d\n" % (i, i % 10) for i in range(64)))
    options = moto_server.storage_options()
    mounts = {"datasets": {"url": f"s3://{BUCKET}/datasets", "options": options, "read_only": True},
              "checkpoints": {"url": f"s3://{BUCKET}/checkpoints", "options": options}}
    with LocalCluster(str(tmp_path / "cluster"), workers=1, mounts=mounts) as cluster:
        assert cluster.wait_for_workers(timeout=30)
        monkeypatch.setenv("CACHEFS_MASTER", cluster.master_address)
        CacheFileSystem.clear_instance_cache()  # no filesystem of another test's cluster
        namespace: dict = {"__name__": "user_guide"}
        try:
            for i, block in enumerate(python_blocks(GUIDE.read_text())):
                try:
                    exec(compile(block, f"{GUIDE.name}[python block {i}]", "exec"), namespace)  # noqa: S102
                except Exception as exc:
                    raise AssertionError(f"user-guide python block {i} failed:\n{block}") from exc
        finally:
            CacheFileSystem.clear_instance_cache()
    # What the guide wrote is in the bucket, and what it refused is not.
    body = s3.get_object(Bucket=BUCKET, Key="checkpoints/run-1/step-100.pt")["Body"].read()
    assert torch.load(io.BytesIO(body), weights_only=True)["step"] == 100
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="datasets/train/oops.bin")
