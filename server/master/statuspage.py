"""The master's status page (/status): workers and their health, capacity and use, hit ratio, jobs.

Built from what the master already has (membership, the view version, the mount table, the
jobs) plus each live worker's own ``GetStatus``, asked concurrently with a short deadline: a
worker that does not answer shows as such, with the figures of its last heartbeat. One
self-contained HTML document: inline CSS, no scripts, nothing fetched from elsewhere. Keys,
mount names, URLs and addresses are user data, so every value goes through ``html.escape``.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from cachefs.proto import master_pb2, worker_pb2

MAX_STATUS_THREADS = 16


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    address: str
    version: str
    answered: bool
    health: str  # "ok", or why it did not answer (a gRPC status name)
    heartbeat_age: float | None  # seconds since its last heartbeat reached this master (None: not known here)
    capacity_bytes: int = 0
    used_bytes: int = 0
    pages: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = -1  # -1: unknown (only GetStatus reports it)
    bytes_from_cache: int = 0
    bytes_from_store: int = 0

    @property
    def hit_ratio(self) -> float | None:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else None


@dataclass(frozen=True)
class ClusterStatus:
    master_id: str
    view_version: int
    generated_at: float
    workers: Sequence[WorkerRow]
    mounts: Sequence[dict[str, Any]]  # MountSpec.public(): never credentials
    jobs: Sequence[master_pb2.Job]


def _figures(source: Any) -> dict[str, int]:
    names = ("capacity_bytes", "used_bytes", "pages", "hits", "misses", "bytes_from_cache", "bytes_from_store")
    return {name: int(getattr(source, name)) for name in names} if source is not None else {}


class StatusPage:
    """Collects a :class:`ClusterStatus` per request and renders it (``html()`` is the HTTP page)."""

    def __init__(self, master_id: str, membership: Any, versions: Any, state: Any, jobs: Any,
                 stubs: Callable[[str], Any], deadline: float = 1.0, max_jobs: int = 20,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.master_id = master_id
        self.membership = membership
        self.versions = versions
        self.state = state
        self.jobs = jobs
        self.stubs = stubs
        self.deadline = deadline
        self.max_jobs = max_jobs
        self._wall = wall_clock

    def _row(self, member: Any, now: float) -> WorkerRow:
        base = dict(worker_id=member.worker_id, address=member.address, version=member.version,
                    heartbeat_age=max(0.0, now - member.last_heartbeat) if member.last_heartbeat else None)
        try:
            status: worker_pb2.WorkerStatus = self.stubs(member.address).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=self.deadline)
        except grpc.RpcError as err:
            code = err.code() if callable(getattr(err, "code", None)) else None
            reason = code.name if code is not None else type(err).__name__
            return WorkerRow(answered=False, health=f"not answering ({reason})", **base, **_figures(member.stats))
        except (ConnectionError, ValueError) as exc:  # the master is stopping; a bad address
            return WorkerRow(answered=False, health=f"not answering ({exc})", **base, **_figures(member.stats))
        return WorkerRow(answered=True, health="ok", evictions=int(status.evictions), **base, **_figures(status))

    def collect(self) -> ClusterStatus:
        now = self._wall()
        members = self.membership.live()
        rows: list[WorkerRow] = []
        if members:
            with ThreadPoolExecutor(min(MAX_STATUS_THREADS, len(members)), thread_name_prefix="cachefs-status") as pool:
                rows = list(pool.map(lambda m: self._row(m, now), members))
        _, mounts = self.state.mounts()
        every = self.jobs.list()
        active = [j for j in every if j.state in (master_pb2.PENDING, master_pb2.RUNNING)]
        finished = [j for j in every if j.state not in (master_pb2.PENDING, master_pb2.RUNNING)]
        return ClusterStatus(self.master_id, self.versions.value, now, rows, [m.public() for m in mounts],
                             active + finished[: max(0, self.max_jobs - len(active))])

    def html(self) -> tuple[str, bytes]:
        return "text/html; charset=utf-8", render(self.collect()).encode()


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f}%"


def _bar(used: int, capacity: int) -> str:
    pct = min(100.0, 100.0 * used / capacity) if capacity > 0 else 0.0
    return (f'<div class="bar" title="{pct:.1f}%"><div style="width:{pct:.1f}%"></div></div>'
            f"{_e(_size(used))} / {_e(_size(capacity))}")


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff;min-width:40em}
th,td{border:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:middle}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#17692c;font-weight:600}.bad{color:#b00020;font-weight:600}
.bar{display:inline-block;width:8em;height:.7em;background:#e4e4e4;margin-right:.5em;vertical-align:middle}
.bar div{height:100%;background:#3b7dd8}.muted{color:#777}
.summary span{display:inline-block;margin-right:2em}
"""


def _workers_table(rows: Sequence[WorkerRow]) -> str:
    if not rows:
        return '<p class="muted" id="no-workers">No live workers.</p>'
    out = ['<table id="workers"><tr><th>worker</th><th>address</th><th>health</th><th>last heartbeat</th>'
           "<th>cache used / capacity</th><th>pages</th><th>hit ratio</th><th>from cache</th>"
           "<th>from store</th><th>evictions</th><th>version</th></tr>"]
    for w in rows:
        css = "ok" if w.answered else "bad"
        out.append(
            f'<tr class="worker" data-worker-id="{_e(w.worker_id)}" data-health="{css}">'
            f'<td class="worker-id">{_e(w.worker_id)}</td><td>{_e(w.address)}</td>'
            f'<td class="health {css}">{_e(w.health)}</td><td class="num">{"at the leader" if w.heartbeat_age is None else f"{w.heartbeat_age:.1f} s ago"}</td>'
            f"<td>{_bar(w.used_bytes, w.capacity_bytes)}</td><td class=\"num\">{w.pages}</td>"
            f'<td class="num hit-ratio">{_e(_ratio(w.hit_ratio))}</td>'
            f'<td class="num">{_e(_size(w.bytes_from_cache))}</td><td class="num">{_e(_size(w.bytes_from_store))}</td>'
            f'<td class="num">{"-" if w.evictions < 0 else w.evictions}</td><td>{_e(w.version)}</td></tr>')
    out.append("</table>")
    return "".join(out)


def _jobs_table(jobs: Sequence[master_pb2.Job]) -> str:
    if not jobs:
        return '<p class="muted" id="no-jobs">No jobs.</p>'
    out = ['<table id="jobs"><tr><th>job</th><th>kind</th><th>path</th><th>state</th><th>objects</th>'
           "<th>bytes</th><th>error</th></tr>"]
    for j in jobs:
        state = master_pb2.JobState.Name(j.state)
        more = "+" if j.listing else ""  # still listing: the totals so far
        objects = f"{j.objects_done}/{j.objects_total}{more}" + (f" ({j.objects_failed} failed)" if j.objects_failed else "")
        out.append(
            f'<tr class="job" data-job-id="{_e(j.job_id)}" data-state="{_e(state)}">'
            f'<td class="job-id">{_e(j.job_id)}</td><td>{_e(master_pb2.JobKind.Name(j.kind))}</td>'
            f"<td>{_e(j.path)}</td><td class=\"job-state\">{_e(state)}</td><td class=\"num\">{_e(objects)}</td>"
            f'<td class="num">{_e(_size(j.bytes_done))} / {_e(_size(j.bytes_total))}{more}</td>'
            f"<td>{_e(j.error)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _mounts_table(mounts: Sequence[dict[str, Any]]) -> str:
    if not mounts:
        return '<p class="muted" id="no-mounts">No mounts.</p>'
    out = ['<table id="mounts"><tr><th>mount</th><th>url</th><th>read-only</th></tr>']
    for m in mounts:
        out.append(f'<tr class="mount"><td>{_e(m["name"])}</td><td>{_e(m["url"])}</td>'
                   f'<td>{"yes" if m.get("read_only") else "no"}</td></tr>')
    out.append("</table>")
    return "".join(out)


def render(status: ClusterStatus) -> str:
    """The whole page; every user-supplied value is escaped."""
    rows = status.workers
    answering = sum(1 for w in rows if w.answered)
    hits, misses = sum(w.hits for w in rows), sum(w.misses for w in rows)
    used, capacity = sum(w.used_bytes for w in rows), sum(w.capacity_bytes for w in rows)
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(status.generated_at))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="refresh" content="10"><title>cachefs status</title>'
        f"<style>{_CSS}</style></head><body>"
        f'<h1>cachefs cluster</h1><p class="muted">master <span id="master-id">{_e(status.master_id)}</span>'
        f" &middot; view version {status.view_version} &middot; {_e(generated)}</p>"
        '<p class="summary">'
        f'<span id="workers-summary">workers: {answering} answering of {len(rows)} live</span>'
        f'<span id="capacity-summary">cache: {_bar(used, capacity)}</span>'
        f'<span id="hit-ratio">hit ratio: {_e(_ratio(hits / (hits + misses) if hits + misses else None))}</span>'
        "</p>"
        f"<h2>Workers</h2>{_workers_table(rows)}"
        f"<h2>Jobs</h2>{_jobs_table(status.jobs)}"
        f"<h2>Mounts</h2>{_mounts_table(status.mounts)}"
        "</body></html>"
    )
