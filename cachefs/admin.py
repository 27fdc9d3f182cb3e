"""Commands a shell user runs against the master.

Cluster: status, mount, unmount, mounts. Data: ls, stat (through the master's metadata cache
and the workers' reports). Jobs (cachefs/admin_jobs.py): load, free, jobs, job, cancel.

Exit codes: 0 done; 1 the master refused (unknown mount or path, already exists, bad
request) or a waited-for job did not succeed (FAILED, or cancelled elsewhere); 2 bad usage;
3 the master could not be reached; 130 interrupted (Ctrl-C while waiting for a job, which
cancels it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import grpc

from cachefs.auth import token_metadata
from cachefs.tokens import ACCESS, CLUSTER, find_token
from cachefs.errors import parse_detail
from cachefs.tls import TLSConfig, explain

from cachefs.progress import human_bytes

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


_human = human_bytes


class _Master:
    def __init__(self, args: argparse.Namespace) -> None:
        from cachefs.masters import MasterList

        # One master or several (m1:19998,m2:19998): calls go to one that answers.
        address = args.master or os.environ.get("CACHEFS_MASTER", "127.0.0.1:19998")
        # The cluster token (changes, credentials) also passes the access check; else the access token.
        token = (args.cluster_token or os.environ.get("CACHEFS_CLUSTER_TOKEN", "")
                 or find_token(address, CLUSTER)  # the ones cachefs local keeps (cachefs/tokens.py)
                 or getattr(args, "token", None) or os.environ.get("CACHEFS_TOKEN", "")
                 or find_token(address, ACCESS))
        self.address = address
        self.metadata = token_metadata(token)
        self.timeout = args.timeout
        self.tls = admin_tls(args)
        self.masters = MasterList(address, self.tls)

    @property
    def stub(self) -> Any:
        return self.masters.stub()

    def call(self, method: str, request: Any) -> Any:
        # --timeout is the whole call's budget: a lost leader is waited for within it.
        return self.masters.call(method, request, budget=self.timeout, timeout=self.timeout, metadata=self.metadata)


def admin_tls(args: argparse.Namespace) -> TLSConfig:
    """TLS for admin commands: flags over ``CACHEFS_TLS_CA_FILE`` / ``_CERT_FILE`` / ``_KEY_FILE``."""

    def pick(name: str) -> str:
        return getattr(args, name, None) or os.environ.get(f"CACHEFS_{name.upper()}", "")

    return TLSConfig(ca_file=pick("tls_ca_file"), cert_file=pick("tls_cert_file"), key_file=pick("tls_key_file"))


def _run(args: argparse.Namespace, action) -> int:
    try:
        master = _Master(args)
    except ValueError as exc:  # unreadable TLS files, a bad master address
        print(f"cachefs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return action(master)
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.UNAVAILABLE and parse_detail(err):
            # A master answered, but the control plane cannot act (no leader, etcd unreachable).
            print(f"cachefs: the master at {master.masters.current} cannot do this now: {err.details()}",
                  file=sys.stderr)
            return EXIT_UNREACHABLE
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = explain(err.details(), master.tls)
            print(f"cachefs: cannot reach the master at {master.address}: {err.details()}"
                  + (f" ({hint})" if hint else ""), file=sys.stderr)
            return EXIT_UNREACHABLE
        print(f"cachefs: {code.name.lower().replace('_', ' ')}: {err.details()}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        master.masters.close()


def cmd_status(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        view = master.call("GetView", master_pb2.GetViewRequest())
        now = time.time()
        workers = []
        for w in view.workers:
            s = w.stats
            lookups = s.hits + s.misses
            workers.append({
                "worker_id": w.worker_id, "address": w.address, "capacity_bytes": s.capacity_bytes,
                "used_bytes": s.used_bytes, "pages": s.pages,
                "hit_ratio": round(s.hits / lookups, 4) if lookups else None,
                "eviction": s.eviction_policy or "-", "plans": s.plans,
                "heartbeat_age_s": round(max(0.0, now - w.last_heartbeat), 1) if w.last_heartbeat else None,
            })
        answered = master.masters.current
        leader = ({"leader_id": view.leader_id, "leader_address": view.leader_address,
                   "leader_epoch": view.leader_epoch, "masters": list(view.masters)} if view.leader_epoch else {})
        if args.json:
            print(json.dumps({"master": answered, "view_version": view.version, "workers": workers,
                              "mounts": [m.name for m in view.mounts], **leader}, indent=2))
            return EXIT_OK
        print(f"master {answered}  view {view.version}  {len(workers)} live worker(s)  "
              f"{len(view.mounts)} mount(s)")
        if leader:
            print(f"leader {view.leader_address or '(none now)'}  epoch {view.leader_epoch}  "
                  f"masters {', '.join(view.masters)}")
        if workers:
            print(f"{'worker':18} {'address':24} {'used':>11} {'capacity':>11} {'pages':>8} {'hit ratio':>9} "
                  f"{'eviction':>14} {'heartbeat':>9}")
            for w in workers:
                ratio = "-" if w["hit_ratio"] is None else f"{w['hit_ratio']:.3f}"
                age = "-" if w["heartbeat_age_s"] is None else f"{w['heartbeat_age_s']}s ago"
                policy = f"{w['eviction']} ({w['plans']} plans)" if w["eviction"] == "future" else w["eviction"]
                print(f"{w['worker_id']:18} {w['address']:24} {_human(w['used_bytes']):>11} "
                      f"{_human(w['capacity_bytes']):>11} {w['pages']:>8} {ratio:>9} {policy:>14} {age:>9}")
        return EXIT_OK

    return _run(args, action)


def cmd_mounts(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        resp = master.call("GetMounts", master_pb2.GetMountsRequest())
        rows = [{"name": m.name, "url": m.url, "read_only": m.read_only,
                 "options": json.loads(m.options_json or "{}")} for m in resp.mounts]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                flags = " (read-only)" if r["read_only"] else ""
                # Where an S3 mount's reads go, as pinned when it was added (#49).
                options = r["options"]
                endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
                region = (options.get("client_kwargs") or {}).get("region_name")
                where = "".join(f"  {k} {v}" for k, v in (("endpoint", endpoint), ("region", region)) if v)
                print(f"{r['name']:20} {r['url']}{flags}{where}")
        return EXIT_OK

    return _run(args, action)


def _parse_options(pairs: list[str], options_json: str | None) -> dict[str, Any]:
    options: dict[str, Any] = json.loads(options_json) if options_json else {}
    if not isinstance(options, dict):
        raise ValueError("--options-json must be a JSON object")
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)  # numbers, booleans, objects
        except ValueError:
            options[key] = value
    return options


def cmd_mount(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    try:
        options = _parse_options(args.option, args.options_json)
    except ValueError as exc:
        print(f"cachefs mount: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def action(master: _Master) -> int:
        resp = master.call("AddMount", master_pb2.AddMountRequest(
            name=args.name, url=args.url, options_json=json.dumps(options), read_only=args.read_only,
            replace=args.replace))
        flags = " (read-only)" if args.read_only else ""
        print(f"mounted {args.name} -> {args.url}{flags} (mounts version {resp.mounts_version})")
        return EXIT_OK

    return _run(args, action)


def cmd_unmount(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        resp = master.call("RemoveMount", master_pb2.RemoveMountRequest(name=args.name))
        print(f"unmounted {args.name} (mounts version {resp.mounts_version})")
        return EXIT_OK

    return _run(args, action)


def _entry(info: Any) -> dict[str, Any]:
    from cachefs.proto import common_pb2

    return {"path": info.path, "type": "directory" if info.type == common_pb2.DIRECTORY else "file",
            "size": info.size, "version": info.version, "mtime": info.mtime}


def cmd_ls(args: argparse.Namespace) -> int:
    """Printed a page at a time as the master hands them out (paged List): the first line
    comes after one page, and neither side holds the whole listing. ``--json`` is one JSON
    array, an entry a line, written as the pages come (a failure mid-way leaves it unclosed,
    with the exit code saying so)."""
    from cachefs.proto import worker_pb2

    def action(master: _Master) -> int:
        out = sys.stdout
        after, opened = "", False
        try:
            while True:
                request = worker_pb2.ListRequest(path=args.path, recursive=args.recursive,
                                                 refresh=args.refresh and not after, paged=True, start_after=after)
                next_after = ""
                # A master that knows no pages answers the whole listing in batches with no
                # next_after: printed batch by batch all the same.
                for batch in master.stub.List(request, timeout=master.timeout, metadata=master.metadata):
                    next_after = batch.next_after or next_after
                    for info in batch.entries:
                        e = _entry(info)
                        if args.json:
                            out.write(("[\n" if not opened else ",\n") + json.dumps(e))
                            opened = True
                        elif e["type"] == "directory":
                            out.write(f"{'DIR':>12}  {'':19}  {e['path']}/\n")
                        else:
                            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["mtime"])) if e["mtime"] else "-"
                            out.write(f"{e['size']:>12}  {when:19}  {e['path']}\n")
                    out.flush()  # a page on the terminal (or down the pipe) as soon as it came
                if not next_after or next_after <= after:  # no progress: a page past the end
                    break
                after = next_after
        except grpc.RpcError:
            if opened:
                out.write("\n")
                out.flush()
            raise
        except BrokenPipeError:  # `cachefs ls big | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # no second error at exit's flush
            return EXIT_OK
        if args.json:
            out.write("\n]\n" if opened else "[]\n")
            out.flush()
        return EXIT_OK

    return _run(args, action)


def cmd_stat(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        resp = master.call("Stat", master_pb2.StatRequest(path=args.path, refresh=args.refresh))
        fraction = resp.cached_bytes / resp.total_bytes if resp.total_bytes else 1.0
        out = {**_entry(resp.info), "objects": resp.objects, "total_bytes": resp.total_bytes,
               "cached_bytes": resp.cached_bytes, "cached_fraction": round(fraction, 6),
               "truncated": resp.truncated,
               "workers": [{"worker_id": w.worker_id, "address": w.address, "cached_bytes": w.cached_bytes}
                           for w in resp.workers]}
        if args.json:
            print(json.dumps(out, indent=2))
            return EXIT_OK
        kind = out["type"] + (f" ({resp.objects} objects)" if out["type"] == "directory" else "")
        print(f"path     {resp.info.path}")
        print(f"type     {kind}{'  (counted the first objects only: too many)' if resp.truncated else ''}")
        print(f"size     {_human(resp.total_bytes)} ({resp.total_bytes} bytes)")
        if resp.info.version:
            print(f"version  {resp.info.version}")
        print(f"cached   {fraction * 100:.1f}% ({_human(resp.cached_bytes)})")
        for i, w in enumerate(resp.workers):
            label = "workers " if i == 0 else ""
            print(f"{label:8} {w.worker_id or '?':18} {w.address:24} {_human(w.cached_bytes):>11}")
        return EXIT_OK

    return _run(args, action)


def add_master_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", help="master HOST:PORT, or several m1:PORT,m2:PORT (default: $CACHEFS_MASTER or 127.0.0.1:19998)")
    parser.add_argument("--cluster-token", help="cluster token (default: $CACHEFS_CLUSTER_TOKEN)")
    parser.add_argument("--token", help="access token, if the cluster wants one (default: $CACHEFS_TOKEN)")
    parser.add_argument("--tls-ca-file", help="CA bundle (PEM) to verify the master: use TLS "
                        "(default: $CACHEFS_TLS_CA_FILE)")
    parser.add_argument("--tls-cert-file", help="client certificate (PEM) for mutual TLS (default: $CACHEFS_TLS_CERT_FILE)")
    parser.add_argument("--tls-key-file", help="its private key (PEM) (default: $CACHEFS_TLS_KEY_FILE)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds a call may take in all (a lost leader is waited for within them)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="workers, liveness, capacity, use, hit ratio")
    add_master_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("mounts", help="list the mount table")
    add_master_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_mounts)

    p = sub.add_parser("mount", help="mount an fsspec URL under a name")
    add_master_options(p)
    p.add_argument("name")
    p.add_argument("url", help="e.g. s3://bucket/prefix or /data/dir")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="filesystem option (repeatable)")
    p.add_argument("--options-json", help="filesystem options as one JSON object")
    p.add_argument("--read-only", action="store_true")
    p.add_argument("--replace", action="store_true", help="replace a mount of the same name")
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("unmount", help="remove a mount")
    add_master_options(p)
    p.add_argument("name")
    p.set_defaults(func=cmd_unmount)

    p = sub.add_parser("ls", help="list a path through the master's listing cache")
    add_master_options(p)
    p.add_argument("path", metavar="PATH", help="<mount>[/<prefix>]")
    p.add_argument("-r", "--recursive", action="store_true", help="every object below PATH")
    p.add_argument("--refresh", action="store_true", help="ask the store, not the master's cache")
    p.add_argument("--json", action="store_true", help="machine-readable output: one JSON array, an entry "
                   "a line, printed as the pages come")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stat", help="size, version, fraction cached and on which workers")
    add_master_options(p)
    p.add_argument("path", metavar="PATH", help="an object or a prefix")
    p.add_argument("--refresh", action="store_true", help="ask the store, not the master's cache")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stat)

    from cachefs import admin_jobs

    admin_jobs.register(sub, add_master_options)
