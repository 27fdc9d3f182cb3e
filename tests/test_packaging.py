"""Packaging: one distribution, one import namespace, current protobuf stubs, the fsspec entry point."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import fsspec
import pytest

from cachefs.client.filesystem import CacheFileSystem
from cachefs.proto import generate

ROOT = Path(__file__).resolve().parent.parent


def test_protobuf_stubs_are_current():
    assert generate.stale_files() == [], "run: python -m cachefs.proto.generate"


def test_stubs_use_package_qualified_imports():
    for stub in (ROOT / "proto").glob("*_pb2*.py"):
        for line in stub.read_text().splitlines():
            if line.startswith(("import ", "from ")) and "_pb2" in line:
                assert line.startswith("from cachefs.proto import"), f"{stub.name}: {line}"


@pytest.mark.slow
def test_wheel_installs_only_the_cachefs_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("cachefs-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"cachefs", f"cachefs-{importlib.metadata.version('cachefs')}.dist-info"}, top
    for sub in ("server", "client", "proto"):
        assert any(n.startswith(f"cachefs/{sub}/") for n in names), sub
    assert "cachefs/proto/worker.proto" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "cachefs = cachefs.client.filesystem:CacheFileSystem" in entry_points
    assert "cachefs = cachefs.cli:main" in entry_points


def test_fsspec_finds_cachefs_through_its_entry_point():
    eps = importlib.metadata.entry_points(group="fsspec.specs")
    assert any(ep.name == "cachefs" and ep.value == "cachefs.client.filesystem:CacheFileSystem" for ep in eps)
    assert fsspec.get_filesystem_class("cachefs") is CacheFileSystem


def test_console_command_runs():
    out = subprocess.run([sys.executable, "-m", "cachefs.cli", "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.startswith("cachefs ")
