"""The ``cachefs`` command: daemons (worker, master), a local cluster, admin commands, the FUSE mount, the demo."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from cachefs import __version__


def _worker_flags(args: argparse.Namespace) -> dict:
    flags = {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "page_size": args.page_size,
        "data_port": args.data_port,
        "metadata_ttl": args.metadata_ttl,
        "list_ttl": args.list_ttl,
        "master": args.master,
        "advertise_address": args.advertise_address,
        "cluster_token": args.cluster_token,
        "insecure": True if args.insecure else None,
        "eviction": args.eviction,
        "s3_client": args.s3_client,
    }
    if args.cache_dir:
        flags["cache_dirs"] = args.cache_dir
    if args.mount or args.mount_option:
        from cachefs.mountflags import mounts_from_flags

        flags["mounts"] = mounts_from_flags(args.mount, args.mount_option)
    return {k: v for k, v in flags.items() if v is not None}


def cmd_worker(args: argparse.Namespace) -> int:
    from cachefs.config import load_worker_config
    from cachefs.server.worker import serve

    try:
        config = load_worker_config(args.config, flags=_worker_flags(args))
    except (ValueError, OSError) as exc:
        print(f"cachefs worker: bad configuration: {exc}", file=sys.stderr)
        return 2
    _warn_if_open("worker", config)
    return serve(config)


def _warn_if_open(daemon: str, config: Any) -> None:
    from cachefs.config import is_loopback

    if config.insecure and not config.access_token and not is_loopback(config.host):
        print(f"cachefs {daemon}: WARNING: serving {config.host} with no access token (insecure): anyone who "
              "reaches it can read, write and delete through it", file=sys.stderr, flush=True)


def cmd_master(args: argparse.Namespace) -> int:
    from cachefs.config import load_master_config
    from cachefs.server.master import serve

    flags = {
        "host": args.host, "port": args.port, "metrics_port": args.metrics_port, "state_dir": args.state_dir,
        "lease_seconds": args.lease_seconds, "heartbeat_seconds": args.heartbeat_seconds,
        "cluster_token": args.cluster_token, "insecure": True if args.insecure else None,
        "metadata_ttl": args.metadata_ttl, "list_ttl": args.list_ttl, "job_threads": args.job_threads,
        "etcd": args.etcd, "etcd_prefix": args.etcd_prefix, "etcd_ca_file": args.etcd_ca_file,
        "etcd_cert_file": args.etcd_cert_file, "etcd_key_file": args.etcd_key_file, "etcd_user": args.etcd_user,
        "election_lease_seconds": args.election_lease_seconds, "advertise_address": args.advertise_address,
        "allowed_local_roots": args.allowed_local_root, "allowed_schemes": args.allowed_scheme,
    }
    try:
        if args.mount or args.mount_option:
            from cachefs.mountflags import mounts_from_flags

            flags["mounts"] = mounts_from_flags(args.mount, args.mount_option)
        config = load_master_config(args.config, flags={k: v for k, v in flags.items() if v is not None})
    except (ValueError, OSError) as exc:
        print(f"cachefs master: bad configuration: {exc}", file=sys.stderr)
        return 2
    _warn_if_open("master", config)
    return serve(config)


def cmd_local(args: argparse.Namespace) -> int:
    import os
    import signal
    import tempfile
    import threading

    from cachefs.local import LocalCluster, Supervisor
    from cachefs.mountflags import mounts_from_flags
    from cachefs.tokens import ACCESS, CLUSTER, forget_tokens, new_token, save_token

    try:
        mounts = {m["name"]: {"url": m["url"], "options": m["options"]} if m["options"] else m["url"]
                  for m in mounts_from_flags(args.mount, args.mount_option)}
    except ValueError as exc:
        print(f"cachefs local: {exc}", file=sys.stderr)
        return 2
    workdir = args.dir or tempfile.mkdtemp(prefix="cachefs-local-")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Secure by default: an access token (clients) and a cluster token (daemons, admin commands)
    # for this run, kept where this user's processes find them by the master's address.
    access, admin = ("", "") if args.insecure else (new_token(), new_token())
    cluster = LocalCluster(workdir, workers=args.workers, mounts=mounts, quota=args.quota,
                           allowed_local_roots=args.allowed_local_root or (), access_token=access,
                           cluster_token=admin)
    code = 0
    try:
        cluster.start()
        if access:
            token_file = save_token(cluster.master_address, access, ACCESS)
            save_token(cluster.master_address, admin, CLUSTER)
        cluster.wait_for_workers()
        # A daemon that exits is restarted on its port with its cache/state dir (Supervisor).
        supervisor = Supervisor(cluster, status_path=os.path.join(workdir, "local.json"))
        print(f"cachefs local: master {cluster.master_address}, {args.workers} worker(s), state in {workdir}")
        for entry in [supervisor.status()["master"], *supervisor.status()["workers"]]:
            print(f"  {entry['name']}: pid {entry['pid']} at {entry['address']}, log {entry['log']}")
        print(f"  export CACHEFS_MASTER={cluster.master_address}")
        if access:
            print(f"  access token in {token_file} (this user's clients find it; elsewhere: CACHEFS_TOKEN)")
        else:
            print("  --insecure: no token, any local process may read, write and mount")
        print(f"  a daemon that exits is restarted where it was (pids, addresses: {supervisor.status_path})")
        print("  Ctrl-C stops the cluster", flush=True)
        if not stop.is_set():
            code = supervisor.run(stop)
    finally:
        if access and cluster.master is not None and cluster.master.ready:
            forget_tokens(cluster.master_address)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("cachefs local: stopped", flush=True)
    return code


def cmd_cat(args: argparse.Namespace) -> int:
    from cachefs.client.fs.wds import cat_main

    options = {k: v for k, v in (("master", args.master), ("workers", args.workers)) if v}
    return cat_main(args.urls, options)


def cmd_fuse(args: argparse.Namespace) -> int:
    from cachefs.client.fuse.fusemount import run
    from cachefs.config import load_fuse_config

    client_flags = {"master": args.master, "workers": args.workers, "token": args.token,
                    "tls_ca_file": args.tls_ca_file, "tls_cert_file": args.tls_cert_file,
                    "tls_key_file": args.tls_key_file, "timeout": args.timeout,
                    "fallback": True if args.fallback else None}
    flags = {"attr_timeout": args.attr_timeout, "metadata_ttl": args.metadata_ttl, "max_read": args.max_read,
             "read_ahead": args.read_ahead,
             "threads": args.threads, "allow_other": True if args.allow_other else None,
             "writable": True if args.writable else None,
             "revalidate_open": False if args.no_revalidate_open else None}
    try:
        config = load_fuse_config(args.config, flags={k: v for k, v in flags.items() if v is not None},
                                  client_flags=client_flags)
    except (ValueError, OSError) as exc:
        print(f"cachefs fuse: bad configuration: {exc}", file=sys.stderr)
        return 2
    return run(args.mountpoint, config)


def cmd_demo(args: argparse.Namespace) -> int:
    from cachefs.demo import run_demo

    return run_demo(samples=args.samples, sample_size=args.sample_size, delay_ms=args.delay_ms, workers=args.workers,
                    batch_size=args.batch_size, num_workers=args.num_workers, step_ms=args.step_ms, workdir=args.dir)


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
    w.add_argument("--mount", action="append", metavar="NAME=URL", help="mount an fsspec URL, e.g. data=s3://bucket/prefix, options as a query string: ...?endpoint_url=http://minio:9000 (repeatable)")
    w.add_argument("--mount-option", action="append", metavar="NAME:KEY=VALUE", help="an option of a --mount, e.g. data:endpoint_url=http://minio:9000 or data:client_kwargs.region_name=eu-west-1 (repeatable; secrets: the config file or the environment)")
    w.add_argument("--data-port", type=int, help="TCP port sending cached pages with sendfile (0 = pick a free one, -1 = off)")
    w.add_argument("--page-size", help="page size, e.g. 1MiB")
    w.add_argument("--metadata-ttl", type=float, help="seconds an object's size/version is trusted")
    w.add_argument("--list-ttl", type=float, help="seconds a listing is trusted")
    w.add_argument("--master", help="master HOST:PORT to register with (several: m1:19998,m2:19998)")
    w.add_argument("--advertise-address", help="HOST:PORT clients dial, if not the bound one")
    w.add_argument("--cluster-token", help="shared secret for the master (or CACHEFS_WORKER_CLUSTER_TOKEN)")
    w.add_argument("--insecure", action="store_true",
                   help="serve an address other machines reach with no access token (refused otherwise)")
    w.add_argument("--eviction", choices=("future", "lru"),
                   help="evict the page training plans read furthest ahead (future, default) or the least recently used")
    w.add_argument("--s3-client", choices=("auto", "http", "obstore", "s3fs"),
                   help="client for S3 data reads (auto: http, configured as botocore resolves the mount for s3fs; s3fs where it cannot send the same requests)")
    w.set_defaults(func=cmd_worker)

    m = sub.add_parser("master", help="run the master (gRPC): membership, view, mounts, metadata cache, jobs")
    m.add_argument("--config", help="TOML file (settings at top level or under [master])")
    m.add_argument("--host", help="address to bind (default 127.0.0.1)")
    m.add_argument("--port", type=int, help="gRPC port (0 = pick a free one)")
    m.add_argument("--metrics-port", type=int, help="Prometheus port (-1 = off, 0 = pick a free one)")
    m.add_argument("--state-dir", help="directory for the durable state (mount table)")
    m.add_argument("--lease-seconds", type=float, help="a worker silent this long leaves the view")
    m.add_argument("--heartbeat-seconds", type=float, help="heartbeat interval given to workers")
    m.add_argument("--cluster-token", help="shared secret workers must present (or CACHEFS_MASTER_CLUSTER_TOKEN)")
    m.add_argument("--insecure", action="store_true",
                   help="serve an address other machines reach with no access token (refused otherwise)")
    m.add_argument("--mount", action="append", metavar="NAME=URL", help="mount to add at start if absent, options as a query string: data=s3://bucket?endpoint_url=http://minio:9000 (repeatable)")
    m.add_argument("--mount-option", action="append", metavar="NAME:KEY=VALUE", help="an option of a --mount, e.g. data:endpoint_url=http://minio:9000 or data:client_kwargs.region_name=eu-west-1 (repeatable; secrets: the config file or the environment)")
    m.add_argument("--metadata-ttl", type=float, help="seconds the master trusts an object's size/version")
    m.add_argument("--list-ttl", type=float, help="seconds the master trusts a listing")
    m.add_argument("--job-threads", type=int, help="cluster jobs (load, free) running at once")
    m.add_argument("--etcd", metavar="URL[,URL...]",
                   help="several masters, one leader: keep the state in etcd at these endpoints (default: SQLite)")
    m.add_argument("--etcd-prefix", help="key prefix of this cluster in etcd (default /cachefs/default/)")
    m.add_argument("--etcd-ca-file", help="CA bundle (PEM) to verify etcd: talk TLS to it")
    m.add_argument("--etcd-cert-file", help="client certificate (PEM) for etcd")
    m.add_argument("--etcd-key-file", help="client key (PEM) for etcd")
    m.add_argument("--etcd-user", help="etcd user (password: CACHEFS_MASTER_ETCD_PASSWORD or the config file)")
    m.add_argument("--election-lease-seconds", type=float, help="the leader's lease in etcd (default 5)")
    m.add_argument("--advertise-address", help="HOST:PORT workers and other masters dial, if not the bound one")
    m.add_argument("--allowed-local-root", action="append", metavar="DIR",
                   help="a directory `cachefs mount` may mount local paths at or under (repeatable; the --mount "
                        "dirs are allowed anyway; see docs/security.md)")
    m.add_argument("--allowed-scheme", action="append", metavar="SCHEME",
                   help="a URL scheme mounts may use, replacing the default s3, s3a, gs, gcs, az, abfs (repeatable; "
                        "* for any)")
    m.set_defaults(func=cmd_master)

    loc = sub.add_parser("local", help="a master and N workers on this machine, restarted if they exit, until Ctrl-C")
    loc.add_argument("--workers", type=int, default=2, help="number of worker processes")
    loc.add_argument("--mount", action="append", metavar="NAME=URL", help="mount an fsspec URL, options as a query string: data=s3://bucket?endpoint_url=http://minio:9000 (repeatable)")
    loc.add_argument("--mount-option", action="append", metavar="NAME:KEY=VALUE", help="an option of a --mount, e.g. data:endpoint_url=http://minio:9000 or data:client_kwargs.region_name=eu-west-1 (repeatable; secrets: the config file or the environment)")
    loc.add_argument("--dir", help="state and cache directory (default: a new temporary one)")
    loc.add_argument("--quota", default="2GiB", help="cache quota per worker")
    loc.add_argument("--allowed-local-root", action="append", metavar="DIR",
                     help="a directory `cachefs mount` may mount local paths at or under, besides the --mount dirs "
                          "(repeatable)")
    loc.add_argument("--insecure", action="store_true",
                     help="no tokens: any local process reaches the cluster (default: tokens made for this run, "
                          "kept where this user's clients find them: cachefs/tokens.py)")
    loc.set_defaults(func=cmd_local)

    from cachefs import admin

    admin.register(sub)

    c = sub.add_parser("cat", help="write objects' bytes to stdout, in order (e.g. webdataset's pipe: URLs)")
    c.add_argument("urls", nargs="+", metavar="URL", help="cachefs://MOUNT/KEY (or any fsspec URL)")
    c.add_argument("--master", help="master HOST:PORT, or several m1:PORT,m2:PORT (default: CACHEFS_MASTER)")
    c.add_argument("--workers", help="worker addresses, comma-separated (default: CACHEFS_WORKERS)")
    c.set_defaults(func=cmd_cat)

    d = sub.add_parser("demo", help="a DataLoader epoch from S3 (embedded, ~20 ms away) through s3fs and through "
                                    "cachefs, cold then warm, side by side")
    d.add_argument("--samples", "--objects", type=int, default=600, help="samples (objects) in the bucket")
    d.add_argument("--sample-size", "--object-size", default="256KiB", help="size of each sample")
    d.add_argument("--delay-ms", type=float, default=5.0,
                   help="delay each way in front of S3 (moto closes connections: first byte after ~4x this)")
    d.add_argument("--workers", type=int, default=2, help="cachefs worker processes")
    d.add_argument("--batch-size", type=int, default=32, help="DataLoader batch size (both runs)")
    d.add_argument("--num-workers", type=int, default=2, help="DataLoader workers (both runs)")
    d.add_argument("--step-ms", type=float, default=5.0, help="simulated training step per batch")
    d.add_argument("--dir", help="working directory (default: a new temporary one)")
    d.set_defaults(func=cmd_demo)

    f = sub.add_parser("fuse", help="mount the cluster at MOUNTPOINT (FUSE; read-only unless --writable), until SIGTERM or Ctrl-C")
    f.add_argument("mountpoint", metavar="MOUNTPOINT", help="an empty directory; each mount is a folder in it")
    f.add_argument("--config", help="TOML file: [client] (master, workers, token, tls_*...) and [fuse] tables")
    f.add_argument("--master", help="master HOST:PORT, or several m1:PORT,m2:PORT (or CACHEFS_MASTER)")
    f.add_argument("--workers", help="worker addresses HOST:PORT,... without a master (or CACHEFS_WORKERS)")
    f.add_argument("--token", help="access token, if the cluster wants one (or CACHEFS_TOKEN)")
    f.add_argument("--tls-ca-file", help="CA bundle (PEM): use TLS and verify the cluster with it")
    f.add_argument("--tls-cert-file", help="client certificate (PEM) for mutual TLS")
    f.add_argument("--tls-key-file", help="its private key (PEM)")
    f.add_argument("--timeout", type=float, help="seconds for a metadata call (a read adds length/min_throughput)")
    f.add_argument("--fallback", action="store_true", help="read the store directly when no worker answers "
                   "(needs this process's own store credentials)")
    f.add_argument("--attr-timeout", type=float, help="seconds the kernel keeps attributes and names (default 1)")
    f.add_argument("--metadata-ttl", type=float, help="the workers' metadata_ttl: attr-timeout may not exceed it")
    f.add_argument("--max-read", help="bytes of one kernel read request (default 1MiB)")
    f.add_argument("--read-ahead", help="the kernel's read-ahead for the mount (default 8MiB; 0: the kernel's)")
    f.add_argument("--threads", type=int, help="requests served at once (default 16)")
    f.add_argument("--allow-other", action="store_true", help="let other users read the mount (root only)")
    f.add_argument("--no-revalidate-open", action="store_true", help="read-only mounts: the kernel opens files "
                   "without asking (faster small files; a file open across a change may mix versions)")
    f.add_argument("--writable", action="store_true", help="allow writes: new files and whole rewrites stream to "
                   "the store and are published at close; unlink, mkdir, rename (copy + delete) (default: read-only)")
    f.set_defaults(func=cmd_fuse)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # a command without its own handling: no traceback, the usual code
        print("cachefs: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
