"""Cluster jobs (load a prefix into the cache, free it): durable records, a small pool, resume.

A job's record lives in memory and in the master's state (SQLite, or etcd with several
masters; written when the state changes, about once a second while it makes progress, and at
the end), so ``cachefs jobs`` survives a restart. The record stays a few hundred bytes: its
figures, a load's cursor (the last name of the listing whose objects, and all before it, are
done) and the figures committed up to it, and how many workers it planned on. A job that was
PENDING or RUNNING when the master stopped (or died) is run again when it comes back (with
several masters: by the next leader, from the record the last one kept): a load lists after
its cursor and starts from its committed figures, so what was done is neither listed nor
counted again; what was done after the cursor is asked again, and the workers skip it. Resumed
jobs first wait for the workers to re-register (the live set to stop changing, and as many as
it planned on), or they would be planned on a partial ring and fill the wrong workers.

LOAD: list the path a page (one store request) at a time (``loadpages``: not cached, kept
nowhere), plan each page by placement (``loadplan``) and send its batches (``loadrun``), a few
pages at a time: the leader holds a few thousand objects of a load, whatever its size. While
the listing goes on, the totals are what was listed so far (``Job.listing``). Ends SUCCEEDED,
FAILED (any object failed; the error quotes the first few) or CANCELLED.
FREE: ``Free(prefix)`` on every live worker; SUCCEEDED when all answered. The prefix is a key
prefix, as the workers apply it: ``data/d`` also frees ``data/d2``; ``data/d/`` does not.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc

from cachefs.errors import InvalidPathError
from cachefs.paths import parse_path
from cachefs.proto import master_pb2, worker_pb2
from cachefs.ring import RingConfig
from cachefs.server.master.catalog import Catalog
from cachefs.server.master.loadpages import load_pages
from cachefs.server.master.loadrun import LoadProgress, LoadRun, LoadSettings
from cachefs.server.master.membership import Member
from cachefs.server.master.placement import ring_of
from cachefs.server.master.state import MasterState

log = logging.getLogger(__name__)

MAX_REPLICAS = 16
ACTIVE = frozenset({master_pb2.PENDING, master_pb2.RUNNING})
_KINDS = {master_pb2.LOAD, master_pb2.FREE}


@dataclass
class JobRecord:
    """One job; field names and meanings are those of ``master.proto``'s ``Job``."""

    job_id: str
    kind: int
    path: str
    replicas: int
    state: int = master_pb2.PENDING
    objects_total: int = 0
    objects_done: int = 0
    objects_failed: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    bytes_skipped: int = 0
    error: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float = 0.0
    listing: bool = False
    # Not in the proto: what a resumed job starts from. The workers a running job planned on
    # (how many: a count, not their addresses, so the record stays small), its cursor and
    # the figures committed up to it (LoadProgress's counts and first failures).
    planned_workers: int = 0
    cursor: str = ""
    committed: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_proto(self) -> master_pb2.Job:
        fields = dataclasses.asdict(self)
        for name in _NOT_IN_PROTO:
            fields.pop(name)
        return master_pb2.Job(**fields)

    def to_json(self) -> dict[str, Any]:
        """For the state file: enums by name, so a renumbering cannot change a stored job."""
        out = dataclasses.asdict(self)
        out["kind"] = master_pb2.JobKind.Name(self.kind)
        out["state"] = master_pb2.JobState.Name(self.state)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "JobRecord":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["kind"] = master_pb2.JobKind.Value(values["kind"])
        values["state"] = master_pb2.JobState.Value(values["state"])
        if "planned_on" in data and "planned_workers" not in data:  # a record from before #47
            values["planned_workers"] = len(data["planned_on"])
        values["cursor"] = str(values.get("cursor", ""))
        values["committed"] = dict(values.get("committed") or {})
        return cls(**values)

    def start_figures(self) -> LoadProgress:
        """The progress a resumed load starts from: what was committed up to its cursor."""
        c = self.committed
        return LoadProgress(**{name: int(c.get(name, 0)) for name in LoadProgress.COUNTS},
                            reasons=[str(r) for r in c.get("reasons", ())][:5])


_NOT_IN_PROTO = ("planned_workers", "cursor", "committed")


@dataclass(frozen=True)
class JobSettings:
    threads: int = 2  # jobs running at once
    load: LoadSettings = LoadSettings()
    free_timeout: float = 60.0  # seconds for one worker's Free
    persist_seconds: float = 1.0  # progress reaches the state file at least this often
    settle_seconds: float = 4.0  # a resumed job waits until the live workers stop changing this long
    settle_max_seconds: float = 30.0  # ... and for the workers it planned on, but no longer than this
    max_finished: int = 1000  # finished jobs kept (the oldest are dropped)


class JobManager:
    """Submits, runs, persists, cancels and resumes jobs. ``start()`` resumes; ``stop()`` leaves them resumable."""

    def __init__(
        self,
        state: MasterState,
        catalog: Catalog,
        live: Callable[[], Sequence[Member]],
        stubs: Callable[[str], Any],
        ring_config: Callable[[], RingConfig],
        settings: JobSettings = JobSettings(),
        on_finish: Callable[[JobRecord, LoadProgress | None], None] | None = None,
        clock: Callable[[], float] = time.time,
        epoch: int = 0,
        leading: Callable[[], bool] | None = None,
    ) -> None:
        # With several masters: this manager lives for one term as leader (``epoch``, sent on
        # every Load/Free) and stops acting the moment ``leading()`` turns false.
        self.epoch = epoch
        self._leading = leading
        self.state = state
        self.catalog = catalog
        self.live = live
        self.stubs = stubs
        self.ring_config = ring_config
        self.settings = settings
        self.on_finish = on_finish
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self._cancel: dict[str, threading.Event] = {}
        self._futures: dict[str, Future] = {}
        self._shutdown = threading.Event()
        self._pool = ThreadPoolExecutor(settings.threads, thread_name_prefix="cachefs-job")

    # -- lifecycle --

    def start(self) -> list[str]:
        """Load the stored jobs; run again those that were not finished. Returns their ids."""
        resumed = []
        for data in self.state.jobs():
            try:
                record = JobRecord.from_json(data)
            except (KeyError, ValueError, TypeError):
                log.warning("ignoring an unreadable job record %.80r", data)
                continue
            if record.state in ACTIVE:
                start = record.start_figures()
                log.info("job %s was %s with %d of %d objects done (%d failed); it goes on after %r "
                         "with %d done", record.job_id, master_pb2.JobState.Name(record.state),
                         record.objects_done, record.objects_total, record.objects_failed, record.cursor,
                         start.objects_done)
                record = dataclasses.replace(
                    record, state=master_pb2.PENDING, objects_total=start.objects_total,
                    objects_done=start.objects_done, objects_failed=start.objects_failed,
                    bytes_total=start.bytes_total, bytes_done=start.bytes_done, bytes_skipped=start.bytes_skipped,
                    error="", updated_at=self._clock())
                resumed.append(record.job_id)
            with self._lock:
                self._jobs[record.job_id] = record
        for job_id in resumed:
            log.info("job %s resumes (it was not finished when the master stopped)", job_id)
            self._persist(job_id)
            self._schedule(job_id, resumed=True)
        return resumed

    def stop(self, timeout: float = 5.0) -> None:
        """Stop dispatching; running jobs keep their RUNNING record, so the next start resumes them."""
        self._shutdown.set()
        with self._lock:
            futures = list(self._futures.values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        wait(futures, timeout=timeout)

    # -- API (the servicer's) --

    def submit(self, kind: int, path: str, replicas: int = 0) -> master_pb2.Job:
        if kind not in _KINDS:
            raise InvalidPathError(f"job kind must be LOAD or FREE, got {kind}")
        parsed = parse_path(path)
        self.catalog.check_mount(parsed)
        replicas = replicas or 1
        if kind == master_pb2.FREE:
            replicas = 0
        elif not 1 <= replicas <= MAX_REPLICAS:
            raise InvalidPathError(f"replicas must be 1-{MAX_REPLICAS}, got {replicas}")
        if self._shutdown.is_set():
            raise ConnectionError("the master is stopping")
        target = str(parsed)
        if kind == master_pb2.FREE and parsed.key and path.endswith("/"):
            target += "/"  # workers free by key prefix: "data/d/" spares "data/d2/...", "data/d" does not
        now = self._clock()
        record = JobRecord(uuid.uuid4().hex[:12], kind, target, replicas, created_at=now, updated_at=now)
        with self._lock:
            self._jobs[record.job_id] = record
        self._persist(record.job_id)
        log.info("job %s: %s %s (replicas %d)", record.job_id, master_pb2.JobKind.Name(kind), record.path, replicas)
        self._schedule(record.job_id)
        return self.get(record.job_id)

    def get(self, job_id: str) -> master_pb2.Job:
        with self._lock:
            record = self._jobs.get(job_id)
            if record is None:
                raise FileNotFoundError(f"no job {job_id!r}")
            return record.to_proto()

    def list(self, active_only: bool = False) -> list[master_pb2.Job]:
        """Newest first."""
        with self._lock:
            records = [r for r in self._jobs.values() if not active_only or r.state in ACTIVE]
            records.sort(key=lambda r: (r.created_at, r.job_id), reverse=True)
            return [r.to_proto() for r in records]

    def cancel(self, job_id: str) -> master_pb2.Job:
        """A pending job ends CANCELLED now; a running one stops dispatching and ends CANCELLED soon.

        Cancelling a finished job changes nothing (and is not an error).
        """
        with self._lock:
            record = self._jobs.get(job_id)
            if record is None:
                raise FileNotFoundError(f"no job {job_id!r}")
            event = self._cancel.get(job_id)
            if event is not None:
                event.set()
            pending = record.state == master_pb2.PENDING
        if pending:
            self._finish(job_id, master_pb2.CANCELLED, "cancelled", only_if_pending=True)
        return self.get(job_id)

    def counts(self) -> Counter[tuple[str, str]]:
        """Jobs by (kind, state) names, for the metrics."""
        with self._lock:
            return Counter((master_pb2.JobKind.Name(r.kind), master_pb2.JobState.Name(r.state))
                           for r in self._jobs.values())

    # -- running --

    def _halted(self) -> bool:
        """Stopping, or this master's term as leader ended: dispatch nothing more, finish nothing."""
        return self._shutdown.is_set() or (self._leading is not None and not self._leading())

    def _schedule(self, job_id: str, resumed: bool = False) -> None:
        with self._lock:
            self._cancel[job_id] = threading.Event()
            try:
                self._futures[job_id] = self._pool.submit(self._run, job_id, resumed)
            except RuntimeError:  # the pool is shut down: the master is stopping, resume next time
                self._cancel.pop(job_id, None)

    def _run(self, job_id: str, resumed: bool) -> None:
        try:
            with self._lock:
                record = self._jobs[job_id]
                cancel = self._cancel[job_id]
                if record.state != master_pb2.PENDING or self._halted():
                    return
                record.state = master_pb2.RUNNING
                record.updated_at = self._clock()
            self._persist(job_id)
            stop = lambda: cancel.is_set() or self._halted()  # noqa: E731
            progress: LoadProgress | None = None
            try:
                members = self._settled_members(stop, record.planned_workers) if resumed else list(self.live())
                if stop():
                    pass
                elif not members:
                    raise ConnectionError("no live workers")
                elif record.kind == master_pb2.LOAD:
                    progress = self._load(job_id, record, members, stop)
                else:
                    self._free(record, members)
            except Exception as exc:  # noqa: BLE001 - the job fails, the master does not
                if self._halted() and not cancel.is_set():
                    self._persist(job_id)  # failed because the master stops: resume it next time
                    return
                if not isinstance(exc, OSError):
                    log.exception("job %s failed", job_id)
                self._finish(job_id, master_pb2.FAILED, str(exc) or type(exc).__name__, progress)
                return
            if cancel.is_set():
                self._finish(job_id, master_pb2.CANCELLED, "cancelled", progress)
            elif self._halted():
                self._persist(job_id)  # still RUNNING in the state: the next start (or leader) resumes it
            elif progress is not None and progress.objects_failed:
                self._finish(job_id, master_pb2.FAILED, _failure_message(record, progress), progress)
            else:
                self._finish(job_id, master_pb2.SUCCEEDED, "", progress)
        finally:
            with self._lock:
                self._cancel.pop(job_id, None)
                self._futures.pop(job_id, None)

    def _settled_members(self, stop: Callable[[], bool], planned_workers: int = 0) -> list[Member]:
        """The live workers once the set has not changed for ``settle_seconds`` and is as large as
        the set the job planned on before the restart (bounded by ``settle_max_seconds``).

        Waiting for the planned workers matters: a worker that re-registers after the set looked
        settled would be left out of the resumed plan, and its share loaded onto the wrong workers.
        """
        s = self.settings
        deadline = time.monotonic() + s.settle_max_seconds
        current = list(self.live())
        since = time.monotonic()
        while not stop() and time.monotonic() < deadline:
            if current and len(current) >= planned_workers and time.monotonic() - since >= s.settle_seconds:
                break
            self._shutdown.wait(min(0.2, s.settle_seconds))
            now = list(self.live())
            if {m.address for m in now} != {m.address for m in current}:
                current, since = now, time.monotonic()
        return current

    def _load(self, job_id: str, record: JobRecord, members: list[Member],
              stop: Callable[[], bool]) -> LoadProgress:
        ring = ring_of(members, self.ring_config())
        s = self.settings.load
        pages = load_pages(self.catalog, parse_path(record.path), record.cursor, s.page_objects)
        with self._lock:
            record.planned_workers = len(members)
            record.listing = True
            record.updated_at = self._clock()
        self._persist(job_id)
        saved = {"at": time.monotonic(), "figures": ()}

        def on_progress(run: LoadRun) -> None:
            p = run.progress
            figures = (p.objects_total, p.objects_done, p.objects_failed, p.bytes_done, p.bytes_skipped,
                       run.cursor, run.listing)
            if figures == saved["figures"]:
                return
            self._apply(record, p, run)
            if time.monotonic() - saved["at"] >= self.settings.persist_seconds:
                saved["at"], saved["figures"] = time.monotonic(), figures
                self._persist(job_id)

        run = LoadRun(pages, ring, record.replicas, self.stubs, s, stop, on_progress, epoch=self.epoch,
                      start=record.start_figures(), cursor=record.cursor)
        progress = run.run()
        self._apply(record, progress, run)
        return progress

    def _free(self, record: JobRecord, members: list[Member]) -> None:
        def free(member: Member) -> str | None:
            try:
                if self._halted():
                    return f"{member.address}: not sent (this master stopped leading)"
                resp = self.stubs(member.address).Free(worker_pb2.FreeRequest(prefix=record.path,
                                                                              leader_epoch=self.epoch),
                                                       timeout=self.settings.free_timeout)
            except grpc.RpcError as err:
                return f"{member.address}: {err.code().name}: {err.details()}"
            except ConnectionError as exc:
                return f"{member.address}: {exc}"
            log.info("job %s: %s freed %d pages", record.job_id, member.address, resp.pages_freed)
            return None

        with ThreadPoolExecutor(min(16, len(members)), thread_name_prefix="cachefs-free") as pool:
            failures = [f for f in pool.map(free, members) if f]
        if failures:
            raise ConnectionError(f"{len(failures)} of {len(members)} workers did not free: " + "; ".join(failures[:5]))

    # -- records --

    def _apply(self, record: JobRecord, p: LoadProgress, run: LoadRun | None = None) -> None:
        """The run's figures into the record; with ``run``, its cursor and what it committed too
        (taken together on the run's thread, so a saved cursor always matches its figures)."""
        committed = None
        if run is not None:
            c = run.committed
            committed = {name: getattr(c, name) for name in LoadProgress.COUNTS}
            if c.reasons:
                committed["reasons"] = list(c.reasons)
        with self._lock:
            if run is not None:
                record.cursor, record.committed, record.listing = run.cursor, committed, run.listing
            record.objects_total = p.objects_total
            record.bytes_total = p.bytes_total
            record.objects_done = p.objects_done
            record.objects_failed = p.objects_failed
            record.bytes_done = p.bytes_done
            record.bytes_skipped = p.bytes_skipped
            record.updated_at = self._clock()

    def _finish(self, job_id: str, state: int, error: str, progress: LoadProgress | None = None,
                only_if_pending: bool = False) -> None:
        with self._lock:
            record = self._jobs[job_id]
            if record.state not in ACTIVE or (only_if_pending and record.state != master_pb2.PENDING):
                return
            record.state = state
            record.error = error
            record.updated_at = record.finished_at = self._clock()
            record.cursor, record.committed = "", {}  # never resumed: nothing to start from
        if progress is not None:
            self._apply(record, progress)
        self._persist(job_id)
        log.info("job %s %s%s", job_id, master_pb2.JobState.Name(state), f": {error}" if error else "")
        if self.on_finish is not None:
            self.on_finish(record, progress)
        self._prune()

    def _persist(self, job_id: str) -> None:
        with self._lock:
            record = self._jobs.get(job_id)
            if record is None:
                return
            data = record.to_json()
        try:
            self.state.save_job(record.job_id, record.created_at, data)
        except Exception:  # noqa: BLE001 - a closed or failing state must not kill the job's thread
            log.warning("job %s: could not save its record", job_id, exc_info=True)

    def _prune(self) -> None:
        with self._lock:
            finished = sorted((r for r in self._jobs.values() if r.state not in ACTIVE),
                              key=lambda r: (r.created_at, r.job_id))
            drop = [r.job_id for r in finished[:max(0, len(finished) - self.settings.max_finished)]]
            for job_id in drop:
                del self._jobs[job_id]
        if drop:
            self.state.delete_jobs(drop)


def _failure_message(record: JobRecord, p: LoadProgress) -> str:
    return f"{p.objects_failed} of {record.objects_total} objects failed: " + "; ".join(p.reasons)
