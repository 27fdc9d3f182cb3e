"""Regenerate (or check) the protobuf/gRPC stubs in this folder.

    python -m cachefs.proto.generate          # rewrite the stubs
    python -m cachefs.proto.generate --check  # exit 1 if they are stale

protoc sees the sources as ``cachefs/proto/*.proto``, so the generated modules import each
other as ``cachefs.proto.x_pb2`` (package-qualified), never as a top-level ``x_pb2``.
Needs grpcio-tools (the ``test`` extra), pinned so that output is reproducible.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto here into ``out_dir``; returns the generated files."""
    from grpc_tools import protoc  # imported late: only needed at build/test time

    import importlib.resources

    with tempfile.TemporaryDirectory() as tmp:
        src_root = Path(tmp) / "src"
        pkg = src_root / "cachefs" / "proto"
        pkg.mkdir(parents=True)
        sources = sorted(HERE.glob("*.proto"))
        for src in sources:
            shutil.copy(src, pkg / src.name)
        gen_root = Path(tmp) / "gen"
        gen_root.mkdir()
        well_known = str(importlib.resources.files("grpc_tools") / "_proto")
        args = [
            "protoc",
            f"-I{src_root}",
            f"-I{well_known}",
            f"--python_out={gen_root}",
            f"--pyi_out={gen_root}",
            f"--grpc_python_out={gen_root}",
            *[f"cachefs/proto/{s.name}" for s in sources],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((gen_root / "cachefs" / "proto").iterdir()):
            if f.name.endswith(SUFFIXES):
                shutil.copy(f, out_dir / f.name)
                written.append(out_dir / f.name)
        return written


def stale_files() -> list[str]:
    """Names of stubs that differ from (or are missing against) a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh if not (HERE / f.name).exists() or not filecmp.cmp(f, HERE / f.name, shallow=False)]
        fresh_names = {f.name for f in fresh}
        stale += [p.name for p in HERE.iterdir() if p.name.endswith(SUFFIXES) and p.name not in fresh_names]
        return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale protobuf stubs (run python -m cachefs.proto.generate):", ", ".join(stale))
            return 1
        print("protobuf stubs are current")
        return 0
    for f in generate(HERE):
        print("wrote", f.relative_to(HERE.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
