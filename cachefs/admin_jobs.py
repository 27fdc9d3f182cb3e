"""``cachefs load``, ``free``, ``jobs``, ``job``, ``cancel``: cluster jobs from a shell.

Exit codes as in :mod:`cachefs.admin`, plus: a waited-for job exits 0 only when it SUCCEEDED,
1 when it FAILED or was cancelled elsewhere, 130 on Ctrl-C (which cancels the job first).
While waiting, a master that is briefly away (a restart) is waited for, up to ``--timeout``
plus 30 s; then 3.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

import grpc

from cachefs.admin import EXIT_OK, EXIT_REFUSED, _Master, _run
from cachefs.progress import JobProgress, duration, human_bytes

EXIT_INTERRUPTED = 130
POLL_SECONDS = 0.5
MASTER_AWAY_SECONDS = 30.0  # a restarting master is waited for this long (plus --timeout)
_FINISHED = {"SUCCEEDED", "FAILED", "CANCELLED"}


def job_dict(job: Any) -> dict[str, Any]:
    from cachefs.proto import master_pb2

    return {
        "job_id": job.job_id, "kind": master_pb2.JobKind.Name(job.kind), "path": job.path,
        "replicas": job.replicas, "state": master_pb2.JobState.Name(job.state),
        "objects_total": job.objects_total, "objects_done": job.objects_done,
        "objects_failed": job.objects_failed, "bytes_total": job.bytes_total, "bytes_done": job.bytes_done,
        "bytes_skipped": job.bytes_skipped, "error": job.error, "created_at": job.created_at,
        "updated_at": job.updated_at, "finished_at": job.finished_at,
        # A load whose listing has not reached its end: the totals are what was listed so far.
        "listing": bool(getattr(job, "listing", False)),
    }


def _summary(job: Any) -> str:
    d = job_dict(job)
    took = duration(job.finished_at - job.created_at) if job.finished_at else "-"
    if d["kind"] == "FREE":
        return f"job {job.job_id} {d['state']}: free {job.path} ({took})"
    more = "+" if d["listing"] else ""  # totals so far (a job cancelled or stopped while listing)
    return (f"job {job.job_id} {d['state']}: load {job.path}: {job.objects_done}/{job.objects_total}{more} objects, "
            f"{human_bytes(job.bytes_done)} of {human_bytes(job.bytes_total)}{more} "
            f"({human_bytes(job.bytes_skipped)} already cached), {job.objects_failed} failed, in {took}")


def _get_job(master: _Master, job_id: str, patience: float) -> Any:
    """GetJob, retrying while the master is unreachable for up to ``patience`` seconds."""
    from cachefs.proto import master_pb2

    deadline = time.monotonic() + patience
    while True:
        try:
            return master.call("GetJob", master_pb2.GetJobRequest(job_id=job_id))
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or time.monotonic() > deadline:
                raise
            time.sleep(POLL_SECONDS)


def _cancel_interrupted(master: _Master, job_id: str) -> int:
    from cachefs.proto import master_pb2

    try:
        master.call("CancelJob", master_pb2.GetJobRequest(job_id=job_id))
        print(f"cachefs: interrupted: cancelled job {job_id}", file=sys.stderr)
    except grpc.RpcError as err:
        print(f"cachefs: interrupted; could not cancel job {job_id}: {err.details()}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _submit_job(master: _Master, request: Any) -> tuple[Any, bool]:
    """SubmitJob with Ctrl-C held back until it returns (an interrupt in the middle of the call
    would leave a job running whose id we never saw); returns (job, interrupted)."""
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        job = master.call("SubmitJob", request)
    finally:
        signal.signal(signal.SIGINT, previous)
    return job, interrupted.is_set()


def _follow(master: _Master, job: Any, args: argparse.Namespace) -> int:
    """Wait for ``job`` to finish, showing progress on stderr; Ctrl-C cancels it."""
    from cachefs.proto import master_pb2

    show = JobProgress(sys.stderr) if job.kind == master_pb2.LOAD and not args.quiet else None
    try:
        while master_pb2.JobState.Name(job.state) not in _FINISHED:
            if show is not None:
                show.update(job)
            time.sleep(POLL_SECONDS)
            job = _get_job(master, job.job_id, args.timeout + MASTER_AWAY_SECONDS)
        if show is not None:
            show.update(job, force=True)
            show.close()
    except KeyboardInterrupt:
        if show is not None:
            show.close()
        return _cancel_interrupted(master, job.job_id)
    if args.json:
        print(json.dumps(job_dict(job), indent=2))
    else:
        print(_summary(job))
    state = master_pb2.JobState.Name(job.state)
    if state != "SUCCEEDED":
        print(f"cachefs: job {job.job_id} {state.lower()}: {job.error or 'no reason given'}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


def _submit(args: argparse.Namespace, kind: int, replicas: int) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        job, interrupted = _submit_job(master, master_pb2.SubmitJobRequest(kind=kind, path=args.path,
                                                                          replicas=replicas))
        if interrupted and not args.no_wait:
            return _cancel_interrupted(master, job.job_id)
        if args.no_wait:
            print(json.dumps(job_dict(job), indent=2) if args.json else job.job_id)
            return EXIT_OK
        return _follow(master, job, args)

    return _run(args, action)


def cmd_load(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    return _submit(args, master_pb2.LOAD, args.replicas)


def cmd_free(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    return _submit(args, master_pb2.FREE, 0)


def cmd_jobs(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        jobs = [job_dict(j) for j in master.call("ListJobs", master_pb2.ListJobsRequest(active_only=args.active)).jobs]
        if args.json:
            print(json.dumps(jobs, indent=2))
            return EXIT_OK
        print(f"{'job':12} {'kind':5} {'state':9} {'objects':>13} {'bytes':>21} {'created':19}  path")
        for j in jobs:
            more = "+" if j["listing"] else ""  # still listing: the totals so far
            objects = f"{j['objects_done'] + j['objects_failed']}/{j['objects_total']}{more}"
            nbytes = f"{human_bytes(j['bytes_done'])}/{human_bytes(j['bytes_total'])}{more}"
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"]))
            print(f"{j['job_id']:12} {j['kind']:5} {j['state']:9} {objects:>13} {nbytes:>21} {created:19}  {j['path']}")
        return EXIT_OK

    return _run(args, action)


def cmd_job(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        job = master.call("GetJob", master_pb2.GetJobRequest(job_id=args.job_id))
        if args.json:
            print(json.dumps(job_dict(job), indent=2))
        else:
            print(_summary(job))
            if job.error:
                print(f"error: {job.error}")
        return EXIT_OK

    return _run(args, action)


def cmd_cancel(args: argparse.Namespace) -> int:
    from cachefs.proto import master_pb2

    def action(master: _Master) -> int:
        job = master.call("CancelJob", master_pb2.GetJobRequest(job_id=args.job_id))
        state = master_pb2.JobState.Name(job.state)
        note = " (stopping)" if state == "RUNNING" else ""
        print(f"job {job.job_id}: {state}{note}")
        return EXIT_OK

    return _run(args, action)


def register(sub: argparse._SubParsersAction, add_master_options: Any) -> None:
    p = sub.add_parser("load", help="preload a prefix (or one object) into the cache, by placement")
    add_master_options(p)
    p.add_argument("path", metavar="PREFIX", help="<mount>/<prefix or key>, e.g. datasets/train")
    p.add_argument("--replicas", type=int, default=1, help="copies: the first N workers of each object's placement")
    p.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    p.add_argument("--json", action="store_true", help="machine-readable output (the final job)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("free", help="evict a prefix from every worker's cache")
    add_master_options(p)
    p.add_argument("path", metavar="PREFIX")
    p.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    p.add_argument("--json", action="store_true", help="machine-readable output (the final job)")
    p.set_defaults(func=cmd_free, quiet=True)

    p = sub.add_parser("jobs", help="list cluster jobs, newest first")
    add_master_options(p)
    p.add_argument("--active", action="store_true", help="only pending and running jobs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", help="one job's state and progress")
    add_master_options(p)
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("cancel", help="cancel a pending or running job")
    add_master_options(p)
    p.add_argument("job_id", metavar="ID")
    p.set_defaults(func=cmd_cancel)
