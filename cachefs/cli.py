"""The ``cachefs`` command: ``cachefs worker`` runs a worker, ``cachefs demo`` the main job."""

from __future__ import annotations

import argparse
import logging
import sys

from cachefs import __version__


def _worker_flags(args: argparse.Namespace) -> dict:
    flags = {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "page_size": args.page_size,
        "metadata_ttl": args.metadata_ttl,
        "list_ttl": args.list_ttl,
    }
    if args.cache_dir:
        flags["cache_dirs"] = args.cache_dir
    if args.mount:
        flags["mounts"] = args.mount
    return {k: v for k, v in flags.items() if v is not None}


def cmd_worker(args: argparse.Namespace) -> int:
    from cachefs.config import load_worker_config
    from cachefs.server.worker import serve

    try:
        config = load_worker_config(args.config, flags=_worker_flags(args))
    except (ValueError, OSError) as exc:
        print(f"cachefs worker: bad configuration: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def cmd_demo(args: argparse.Namespace) -> int:
    from cachefs.demo import run_demo

    return run_demo(objects=args.objects, object_size=args.object_size, workdir=args.dir, threads=args.threads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachefs", description="A caching data-access layer for training.")
    parser.add_argument("--version", action="version", version=f"cachefs {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run a cache worker (gRPC)")
    w.add_argument("--config", help="TOML file (settings at top level or under [worker])")
    w.add_argument("--host", help="address to bind (default 127.0.0.1)")
    w.add_argument("--port", type=int, help="gRPC port (0 = pick a free one)")
    w.add_argument("--metrics-port", type=int, help="Prometheus port (-1 = off, 0 = pick a free one)")
    w.add_argument("--cache-dir", action="append", metavar="PATH:QUOTA", help="cache directory and its quota, e.g. /nvme/cachefs:100GiB (repeatable)")
    w.add_argument("--mount", action="append", metavar="NAME=URL", help="mount an fsspec URL, e.g. data=s3://bucket/prefix (repeatable)")
    w.add_argument("--page-size", help="page size, e.g. 1MiB")
    w.add_argument("--metadata-ttl", type=float, help="seconds an object's size/version is trusted")
    w.add_argument("--list-ttl", type=float, help="seconds a listing is trusted")
    w.set_defaults(func=cmd_worker)

    d = sub.add_parser("demo", help="start a local worker over a generated dataset and read it twice")
    d.add_argument("--objects", type=int, default=400, help="number of sample objects")
    d.add_argument("--object-size", default="256KiB", help="size of each object")
    d.add_argument("--threads", type=int, default=8, help="concurrent readers")
    d.add_argument("--dir", help="working directory (default: a new temporary one)")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
