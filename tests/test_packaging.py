"""Packaging: one distribution, one import namespace, current protobuf stubs, the fsspec entry point,
dependency ranges (not pins) and CI's constraints file."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import fsspec
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from cachefs.client.fs.filesystem import CacheFileSystem
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
    assert "cachefs = cachefs.client.fs.filesystem:CacheFileSystem" in entry_points
    assert "cachefs = cachefs.cli:main" in entry_points


def test_fsspec_finds_cachefs_through_its_entry_point():
    eps = importlib.metadata.entry_points(group="fsspec.specs")
    assert any(ep.name == "cachefs" and ep.value == "cachefs.client.fs.filesystem:CacheFileSystem" for ep in eps)
    assert fsspec.get_filesystem_class("cachefs") is CacheFileSystem


def test_console_command_runs():
    out = subprocess.run([sys.executable, "-m", "cachefs.cli", "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.startswith("cachefs ")


# ------------------------------------------------------------ declared ranges, CI's pins
# These read files and the installed metadata only: nothing is installed at test time.
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
REQUIRED_AT_RUNTIME = ("fsspec", "s3fs", "grpcio", "protobuf", "torch", "diskcache", "prometheus-client")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _declared(group: str | None = None) -> dict[str, Requirement]:
    project = _pyproject()["project"]
    lines = project["dependencies"] if group is None else project["optional-dependencies"][group]
    reqs = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r for r in reqs}


def _pins() -> dict[str, Version]:
    pins = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one exact pin per line
        assert spec.operator == "==", f"{CONSTRAINTS.name}: {raw!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{CONSTRAINTS.name}: {req.name} pinned twice"
        pins[name] = Version(spec.version)
    return pins


def test_runtime_dependencies_are_ranges_not_pins():
    for name, req in _declared().items():
        exact = [s for s in req.specifier if s.operator in ("==", "===")]
        assert not exact, f"{req}: a library must not pin ({name} would clash with a user's other version)"
        assert req.specifier, f"{req}: give it a lower bound at least"
    for name in REQUIRED_AT_RUNTIME:
        assert canonicalize_name(name) in _declared(), f"{name} is not declared in [project] dependencies"


def test_fsspec_and_s3fs_have_lower_bounds_the_docs_name():
    declared = _declared()
    lows = {}
    for name in ("fsspec", "s3fs"):
        low = [Version(s.version) for s in declared[name].specifier if s.operator == ">="]
        assert low, f"{name} needs a lower bound (unbounded, pip resolved s3fs back to 0.4.2)"
        lows[name] = low[0]
    # Each s3fs release pins the fsspec of the same version: the oldest pair is one version.
    assert lows["fsspec"] == lows["s3fs"], lows
    compat = (ROOT / "docs" / "compatibility.md").read_text()
    assert f"fsspec {lows['fsspec']}" in compat and f"s3fs {lows['s3fs']}" in compat, \
        "docs/compatibility.md must state the oldest supported fsspec/s3fs pair"


def test_each_constraints_pin_lies_in_the_declared_range():
    declared = {**_declared("test"), **_declared()}
    pins = _pins()
    for name in (*REQUIRED_AT_RUNTIME, "grpcio-tools", "aiobotocore", "botocore", "boto3", "moto", "torchdata"):
        assert canonicalize_name(name) in pins, f"{name} is not pinned in {CONSTRAINTS.name}"
    for name, version in pins.items():
        if name in declared:
            assert declared[name].specifier.contains(version, prereleases=True), \
                f"{CONSTRAINTS.name} pins {name}=={version}, outside the declared {declared[name]}"


def test_s3fs_pin_is_the_release_that_pins_this_fsspec():
    pins = _pins()
    assert Version(importlib.metadata.version("s3fs")) == pins["s3fs"], "run: bash .ci/setup"
    fsspec_reqs = [Requirement(r) for r in importlib.metadata.requires("s3fs") or []]
    fsspec_reqs = [r for r in fsspec_reqs if canonicalize_name(r.name) == "fsspec" and not r.marker]
    assert fsspec_reqs, "s3fs declares no fsspec requirement?"
    for req in fsspec_reqs:
        assert req.specifier.contains(pins["fsspec"]), \
            f"s3fs {pins['s3fs']} requires {req}, but {CONSTRAINTS.name} pins fsspec=={pins['fsspec']}"
    # And the object-store stack s3fs needs agrees with the other pins (aiobotocore, then botocore).
    for dist, dep in (("s3fs", "aiobotocore"), ("aiobotocore", "botocore"), ("boto3", "botocore")):
        for req in (Requirement(r) for r in importlib.metadata.requires(dist) or []):
            if canonicalize_name(req.name) == dep and not req.marker:
                assert req.specifier.contains(pins[dep], prereleases=True), \
                    f"{dist} requires {req}, but {CONSTRAINTS.name} pins {dep}=={pins[dep]}"


def test_installed_versions_are_the_constraints_pins():
    wrong = {}
    for name, pinned in _pins().items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            wrong[name] = (str(pinned), "not installed")
            continue
        # torch's CPU build is 2.13.0+cpu: a pin without a local label accepts it (PEP 440).
        if Version(installed.public) != pinned:
            wrong[name] = (str(pinned), str(installed))
    assert not wrong, f"installed versions differ from {CONSTRAINTS.name} (pinned, installed): {wrong}; run: bash .ci/setup"
