"""Which lean path carries a cached range from a worker, per process: short-circuit or data port.

gRPC carries control, metadata and uncached reads. For cached bytes each worker offers two
faster paths, learnt once from its ``GetStatus``: a Unix socket handing over page file
descriptors, usable when the worker runs on this host (client/transport/shortcircuit.py), and a TCP data
port that sends page files with sendfile (client/transport/dataport.py). A read tries the path of the
worker placed first for the range; None from here means "read through gRPC", so these paths
can make a read faster but never fail it.

A process that must not use gRPC (forked from one that had loaded it: client/forksafe.py) has
only these paths: it learns them from the cluster view (each worker's ``LeanPaths``) or from
the process it was forked from, never by a GetStatus; its reads ask the worker to fill what is
not cached, go on to the ring's next workers when one fails, and its info, listings and newer
cluster views come over the same sockets (``meta``; server/worker/metaops.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Protocol

from cachefs.addresses import split_address
from cachefs.client import forksafe
from cachefs.client.transport.dataport import DataPortReader
from cachefs.client.transport.shortcircuit import Prepared, ShortCircuitReader
from cachefs.errors import (REQUEST, WORKER, OverloadedError, WorkerUnavailableError, fault_of, from_wire_error,
                            is_worker_fault)
from cachefs import rawbytes
from cachefs.localhost import MAX_PAGES, host_id
from cachefs.proto import common_pb2, worker_pb2
from cachefs.client.timeouts import (
    PROBE_RETRY, SOCKET_TIMEOUT, LEAN_RETRY_FIRST, AWAY_RETRY, NO_GRPC_RETRY, MIN_TRY_SECONDS, BUSY_BACKOFF,
)

log = logging.getLogger(__name__)

_HOST_ID = host_id()
#: The page size assumed for a worker that did not say its own (an older one): the smallest a
#: worker takes, so that a piece of MAX_PAGES / 2 pages is never refused as too large.
DEFAULT_PAGE_SIZE = 4096


def try_share(left: float, more: bool) -> float:
    """What one try may take of the ``left`` seconds of its call's budget: half while another way
    follows it (the next worker, gRPC after a socket), so a frozen or cut-off worker leaves time
    to fail over within the budget; all of it for the last."""
    return max(MIN_TRY_SECONDS, left / 2) if more else left


def read_budget(config: Any, length: int) -> float:
    """One read's budget, every retry, fallback and failover inside it: the metadata timeout plus
    the time ``length`` bytes take at min_throughput."""
    return config.timeout + max(0, length) / config.min_throughput


def _worker_away(exc: BaseException) -> bool:
    """The worker is not there right now (restarting, stopped), as opposed to slow or broken. A
    connection it reset or closed under a request is that too: a worker stopping closes its
    sockets (seen: a reader cut off by a restart read through gRPC for a minute after it)."""
    if isinstance(exc, (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BrokenPipeError,
                        ConnectionAbortedError, EOFError)):
        return True
    code = getattr(exc, "code", None)
    return callable(code) and getattr(code(), "name", "") == "UNAVAILABLE"


class PlanProgress:
    """Where this process reads in its registered plan, and the furthest it read since the last
    request took it: a pass read by name sends no message, so without the furthest a worker
    would see the next pass begin (position 0) after a reader that seemed to stand still, not a
    rewind. Advisory: a race between threads at most loses one furthest; with several local
    workers the next request to any of them carries it."""

    def __init__(self) -> None:
        self._job = ""
        self._position = 0
        self._furthest = 0

    def note(self, job: str, position: int) -> None:
        if job != self._job:
            self._job, self._furthest = job, position
        self._position = position
        if position > self._furthest:
            self._furthest = position

    def take(self) -> tuple[str, int, int] | None:
        """(job, position, furthest since the last take), or None before any plan read."""
        if not self._job:
            return None
        position, furthest = self._position, self._furthest
        self._furthest = position
        return self._job, position, furthest


class Reader(Protocol):
    kind: str

    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None) -> tuple[Any, int, str] | None: ...

    def close(self) -> None: ...

    def release_inherited(self) -> None: ...


def _host(address: str) -> str:
    return split_address(address, "worker address")[0]


class BulkPaths:
    """Per worker: its lean reader (or None: gRPC only), probed lazily. One per process: the
    session keeps it in its per-process state (forksafe.py), so a forked child never uses a
    parent's socket."""

    def __init__(self, config: Any, workers: Any, known: dict[str, Any] | None = None) -> None:
        self.config, self.workers = config, workers
        self._lock = threading.Lock()
        self._readers: dict[str, tuple[Reader | None, float]] = {}
        self._ports: dict[str, DataPortReader] = {}  # data ports of workers read through their Unix socket
        # Each worker's GetStatus answer: learnt here by a probe, or handed down by the process
        # that started this one (session.SessionBootstrap) and used instead of asking until that
        # worker's lean path fails; a probe after that asks again.
        self._statuses: dict[str, Any] = {}
        self._handed_down: dict[str, Any] = dict(known or {})
        # Each worker's lean paths as the cluster view publishes them (LeanPaths, as a WorkerStatus):
        # what a process that must not use gRPC probes with instead of asking.
        self._from_view: dict[str, Any] = {}
        # Called with a serialized ClusterView newer than any this process had, learnt from a
        # worker's reply (a process that cannot watch the master: the session applies it).
        self.on_view: Any = None
        self._view_known = 0
        self._failures: dict[str, int] = {}  # lean path failures in a row, per worker
        self._warned: set[str] = set()
        # Per lean path: reads, bytes, reads sent to gRPC (fallbacks, errors), and pages read by
        # hit or miss as the worker knew them (the readers count those: shortcircuit.py, dataport.py).
        self.stats = {kind: {"reads": 0, "bytes": 0, "fallbacks": 0, "errors": 0, "hits": 0, "misses": 0,
                             "busy": 0} for kind in ("short_circuit", "data_port")}
        self.stats["short_circuit"].update(held_hits=0, held_misses=0)
        # The part of stats["short_circuit"] read through page handles held here (no message).
        self.held = {"reads": 0, "bytes": 0}
        # Worker faults that moved a read or a metadata operation to the next worker's socket.
        self.failovers = 0
        # Where this process's dataset reads in its registered plan (client/datasets/plans.py), told to
        # local workers with every short-circuit request.
        self.plan_progress = PlanProgress()

    @property
    def enabled(self) -> bool:
        return bool(self.config.short_circuit or self.config.data_port)

    def _status(self, handle: Any, timeout: float = SOCKET_TIMEOUT) -> Any:
        # Kept (threads of this process may probe at once) until this worker's lean path fails;
        # then the view's copy (a worker that restarted on new sockets re-registers them: the
        # view moves, and this process follows it), so no process asks gRPC for it. Only a
        # worker the view publishes no sockets of (an older one) is asked through gRPC.
        status = self._handed_down.get(handle.address)
        if status is None:
            status = self._from_view.get(handle.address)
        if status is None and forksafe.grpc_inherited():
            status = self._known_status(handle.address)
            if status is None:
                raise WorkerUnavailableError(f"worker {handle.address}: the cluster view names no socket of it "
                                             "(a worker older than this client?), and this forked process "
                                             "cannot ask it through gRPC")
        if status is None:
            status = handle.stub().GetStatus(worker_pb2.GetStatusRequest(), timeout=min(SOCKET_TIMEOUT, timeout))
        self._statuses[handle.address] = status
        return status

    def _known_status(self, address: str) -> Any:
        """What this process knows of a worker's sockets without asking it: handed down, probed,
        or published in the view; None if nothing."""
        for known in (self._handed_down, self._statuses, self._from_view):
            status = known.get(address)
            if status is not None:
                return status
        return None

    def note_view(self, view: Any) -> None:
        """A cluster view: its workers' lean paths (for a process that must not use gRPC)."""
        self._from_view = {w.address: worker_pb2.WorkerStatus(host_id=w.lean.host_id, data_port=w.lean.data_port,
                                                              short_circuit_socket=w.lean.short_circuit_socket,
                                                              page_size=w.lean.page_size)
                           for w in view.workers if w.HasField("lean")}
        self._view_known = max(self._view_known, view.version)

    def learn(self, handles: list[Any]) -> None:
        """Probe the workers not probed yet."""
        for handle in handles:
            if handle.address not in self._readers:
                self._reader(handle)

    def known_statuses(self) -> dict[str, Any]:
        """Every worker's GetStatus known here (probed or handed down), by address."""
        return {**self._handed_down, **self._statuses}

    def _probe(self, handle: Any, timeout: float = SOCKET_TIMEOUT) -> Reader | None:
        config = self.config
        status = self._status(handle, timeout)
        timeout = min(SOCKET_TIMEOUT, config.timeout)
        kind = self._socket_of(status)
        if kind == "short_circuit":
            return ShortCircuitReader(status.short_circuit_socket, config.token, timeout=timeout,
                                      handles=config.short_circuit_handles, counts=self.stats["short_circuit"],
                                      progress=self.plan_progress.take, by_name=config.short_circuit_by_name,
                                      huge_pages=config.huge_pages)
        if kind == "data_port":
            return DataPortReader(_host(handle.address), status.data_port, config.token, timeout=timeout,
                                  counts=self.stats["data_port"], huge_pages=config.huge_pages, tls=config.tls)
        return None

    def _reader(self, handle: Any, timeout: float = SOCKET_TIMEOUT) -> Reader | None:
        """``handle``'s lean path (None: none now); ``timeout``: what a probe may take of the
        caller's budget."""
        known = self._readers.get(handle.address)
        if known is not None and (known[0] is not None or time.monotonic() - known[1] < PROBE_RETRY):
            return known[0]
        reader, since = None, time.monotonic()
        try:
            reader = self._probe(handle, timeout)
        except Exception as exc:  # an old worker, an unreachable one: gRPC only
            log.debug("probe of %s for lean read paths failed: %s", handle.address, exc)
            if forksafe.grpc_avoided():
                since -= PROBE_RETRY - NO_GRPC_RETRY
            elif _worker_away(exc) or (hasattr(exc, "code") and is_worker_fault(exc)):  # an RpcError
                since -= PROBE_RETRY - AWAY_RETRY  # away, or too slow for this call: asked again soon
        with self._lock:
            self._readers[handle.address] = (reader, since)
        return reader

    def read(self, path: str, offset: int, length: int, version: str,
             out: memoryview | None = None, deadline: float | None = None) -> tuple[Any, int, str] | None:
        """The range from the first placed worker's lean path, or None: read it through gRPC.

        Any failure of a lean path (a socket error, a bad or undecodable reply, a bug) sends the
        read to gRPC, is counted, and drops that worker's lean path for a while; the first one
        per worker is logged at warning. In a process that must not use gRPC: ``_read_no_grpc``;
        in one that keeps off it (forksafe.grpc_avoided), ``_read_no_grpc`` after the first try
        (the rest of the budget), unless no placed worker offers a socket at all.
        ``deadline`` (monotonic): the read's budget, which the socket exchange stays within.
        """
        if forksafe.grpc_inherited():
            return self._read_no_grpc(path, offset, length, version, out, deadline)
        candidates = self.workers.candidates(path, offset, include_broken=False)
        if not candidates:
            return self._read_off_grpc(path, offset, length, version, out, deadline)
        handle = candidates[0]
        left = None if deadline is None else try_share(deadline - time.monotonic(), True)  # gRPC follows
        reader = self._reader(handle, SOCKET_TIMEOUT if left is None else left)
        if reader is None:
            return self._read_off_grpc(path, offset, length, version, out, deadline)
        stats = self.stats[reader.kind]
        try:
            # A miss is filled by the worker in the same request on either socket: the bytes
            # then come as pages (descriptors, sendfile), not copied through gRPC messages.
            got = (reader.read(path, offset, length, version, out, fill=True, timeout=left)
                   if isinstance(reader, DataPortReader) else reader.read(path, offset, length, version, out, timeout=left))
        except OverloadedError:  # over the worker's connection limit: busy, not wedged (no failure)
            stats["busy"] += 1
            got = None
        except Exception as exc:  # noqa: BLE001 - a lean path may make a read faster, never fail it
            if getattr(exc, "cachefs_fault", None) == REQUEST:
                raise  # about the object or the request (no such object): gRPC would say the same
            avoided = forksafe.grpc_avoided()
            self._failed(handle, reader, exc, "trying the next worker's socket" if avoided else "reading through gRPC")
            if avoided:
                self.failovers += 1
            got = None
        if got is None:
            stats["fallbacks"] += 1
            return self._read_off_grpc(path, offset, length, version, out, deadline)
        if self._failures:
            self._failures.pop(handle.address, None)
        stats["reads"] += 1
        stats["bytes"] += len(got[0])
        return got

    def _read_off_grpc(self, path: str, offset: int, length: int, version: str,
                       out: memoryview | None, deadline: float | None) -> tuple[Any, int, str] | None:
        """What a first try did not serve, in a process that keeps off gRPC: the placed workers'
        sockets again, within the budget (``_read_no_grpc``); None (gRPC) in a process that has
        gRPC loaded already, or where no placed worker offers a socket."""
        if not forksafe.grpc_avoided() or not self.offers_socket(path, offset):
            return None
        return self._read_no_grpc(path, offset, length, version, out, deadline)

    def offers_socket(self, key: str, offset: int = 0) -> bool:
        """Whether a worker placed for ``key`` offers this process a socket (as far as is known
        here, asking no one): then a process that keeps off gRPC has a way other than gRPC."""
        if not self.enabled:
            return False
        for handle in self.workers.candidates(key, offset, include_broken=True):
            status = self._known_status(handle.address)
            if status is not None and self._socket_of(status) is not None:
                return True
        return False

    def _socket_of(self, status: Any) -> str | None:
        """The lean path a worker's status offers this process: "short_circuit", "data_port" or None."""
        config = self.config
        if config.short_circuit and status.host_id == _HOST_ID and status.short_circuit_socket \
                and os.path.exists(status.short_circuit_socket):
            return "short_circuit"
        if config.data_port and status.data_port:  # over TLS where the cluster has it
            return "data_port"
        return None

    def _failed(self, handle: Any, reader: Any, exc: BaseException, then: str) -> None:
        """``handle``'s lean path failed: counted, dropped, asked again later (the first failure
        per worker logged at warning): after LEAN_RETRY_FIRST, doubling with each failure in a
        row up to PROBE_RETRY (a busy or briefly slow worker is not a wedged one); a process
        without gRPC asks again at once (it has no other way)."""
        self.stats[reader.kind]["errors"] += 1
        no_grpc = forksafe.grpc_avoided()
        with self._lock:
            failures = self._failures[handle.address] = self._failures.get(handle.address, 0) + 1
            retry = NO_GRPC_RETRY if no_grpc else min(PROBE_RETRY, LEAN_RETRY_FIRST * 2 ** min(failures - 1, 16))
            self._readers[handle.address] = (None, time.monotonic() - (PROBE_RETRY - retry))
            if not no_grpc:
                self._handed_down.pop(handle.address, None)  # the next probe asks the worker
            first = handle.address not in self._warned
            self._warned.add(handle.address)
        log.log(logging.WARNING if first else logging.DEBUG, "%s request to %s failed (%s: %s); %s for %.1f s",
                reader.kind, handle.address, type(exc).__name__, exc, then, retry)
        with contextlib.suppress(Exception):
            reader.close()

    def _read_no_grpc(self, path: str, offset: int, length: int, version: str,
                      out: memoryview | None, deadline: float | None = None) -> tuple[Any, int, str] | None:
        """A read in a process that must not use gRPC, in pieces a socket serves in one request
        (half of MAX_PAGES pages of the placed worker's page size: gRPC is not there to take a
        range the socket refuses as too large)."""
        chunk = self._chunk_bytes(path, offset)
        if deadline is None:
            deadline = time.monotonic() + read_budget(self.config, length)
        if 0 <= length <= chunk:
            return self._read_no_grpc_once(path, offset, length, version, out, deadline)
        parts: list[Any] = []
        pos, end, size = offset, (None if length < 0 else offset + length), -1
        while True:
            want = chunk if end is None else min(chunk, end - pos)
            into = out[pos - offset:pos - offset + want] if out is not None and end is not None else None
            got = self._read_no_grpc_once(path, pos, want, version, into, deadline)
            if got is None:
                return None
            data, size, version = got
            parts.append(data)
            pos += len(data)
            end = size if end is None else min(end, size)
            if len(data) < want or pos >= end:
                break
        if out is not None and length >= 0:
            return out[:pos - offset], size, version
        return rawbytes.join(parts, self.config.huge_pages), size, version

    def _chunk_bytes(self, path: str, offset: int) -> int:
        candidates = self.workers.candidates(path, offset, include_broken=True)
        status = self._known_status(candidates[0].address) if candidates else None
        page_size = getattr(status, "page_size", 0) or DEFAULT_PAGE_SIZE
        return max(1, MAX_PAGES // 2) * page_size

    def _read_no_grpc_once(self, path: str, offset: int, length: int, version: str,
                           out: memoryview | None, deadline: float) -> tuple[Any, int, str] | None:
        """One piece: from the placed workers' lean paths in ring order, each asked to fill what
        is not cached, again with back-off (0.02 s doubling to 0.5 s) while none serves it, until
        ``deadline``; None if none did by then. An error about the object or the request itself
        (no such object, denied, a wrong token) is raised at once."""
        pause = 0.02
        while True:
            busy = 0.0  # the longest retry-after a busy worker asked for this round
            for handle in self.workers.candidates(path, offset, include_broken=True):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                reader = self._reader(handle)
                if reader is None:
                    continue
                stats = self.stats[reader.kind]
                try:
                    if isinstance(reader, DataPortReader):
                        got = reader.read(path, offset, length, version, out, fill=True, timeout=left)
                    else:
                        got = reader.read(path, offset, length, version, out, timeout=left)
                except OverloadedError as exc:  # busy: the next worker, then this one after its retry-after
                    stats["busy"] += 1
                    busy = max(busy, getattr(exc, "retry_after", 0.2))
                    continue
                except Exception as exc:  # noqa: BLE001 - the next worker may serve it
                    if getattr(exc, "cachefs_fault", None) == REQUEST:
                        raise
                    self._failed(handle, reader, exc, "trying the next worker")
                    handle.breaker.record_failure()  # asked after the others for a while (a frozen worker)
                    self.failovers += 1
                    continue
                handle.breaker.record_success()
                self._follow_view(reader)
                if got is not None:
                    stats["reads"] += 1
                    stats["bytes"] += len(got[0])
                    return got
                stats["fallbacks"] += 1
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(max(pause, busy), left))
            pause = min(0.5, pause * 2)

    def meta(self, key: str, request: Any, what: str, deadline: float | None = None) -> Any:
        """A metadata operation (common_pb2.MetaRequest) answered by the first of the workers
        placed for ``key`` whose lean path answers (a process that must not use gRPC); raises
        the error the worker reported, or WorkerUnavailableError if none answered."""
        if deadline is None:
            deadline = time.monotonic() + self.config.timeout
        while True:
            reply, last, busy = self._meta_round(key, request, what, deadline)
            if reply is not None:
                return reply
            # Every worker that answered was busy (slow work, or connections): not wedged. Once
            # more after a moment, within the budget, rather than failing the call.
            left = deadline - time.monotonic()
            if not busy or left <= MIN_TRY_SECONDS + BUSY_BACKOFF:
                break
            time.sleep(BUSY_BACKOFF)
        raise WorkerUnavailableError(f"{what}: no worker's socket answered" + (f" (last: {last})" if last else ""))

    def _meta_round(self, key: str, request: Any, what: str,
                    deadline: float) -> tuple[Any, BaseException | None, bool]:
        """One pass of ``meta`` over the placed workers: (the reply or None, the last failure,
        whether every worker asked was busy)."""
        last: BaseException | None = None
        asked = busy = 0
        handles = self.workers.candidates(key, 0, include_broken=True)
        for i, handle in enumerate(handles):
            left = deadline - time.monotonic()
            if left <= MIN_TRY_SECONDS:
                break
            # Another worker, or (in a process with gRPC) gRPC, may follow: half of what is left.
            share = try_share(left, i + 1 < len(handles) or not forksafe.grpc_avoided())
            try_end = time.monotonic() + share  # the probe (if any) and the request within it
            reader = self._reader(handle, share)
            if reader is None:
                continue
            asked += 1
            try:
                reply = reader.meta(request, timeout=max(MIN_TRY_SECONDS, try_end - time.monotonic()))
            except OverloadedError as exc:  # busy, not wedged: no failure recorded; the next worker
                self.stats[reader.kind]["busy"] += 1
                last, busy = exc, busy + 1
                continue
            except Exception as exc:  # noqa: BLE001 - the next worker may answer
                self._failed(handle, reader, exc, "trying the next worker")
                self.failovers += 1
                if forksafe.grpc_avoided():  # (with gRPC, its calls keep the breakers: the lean path has its own window)
                    handle.breaker.record_failure()
                last = exc
                continue
            handle.breaker.record_success()
            self._follow_view(reader)
            if reply.error_code:
                error = from_wire_error(reply.error_code, reply.error_detail, reply.error_message, what)
                if isinstance(error, OverloadedError):  # its threads for slow work are taken
                    self.stats[reader.kind]["busy"] += 1
                    last, busy = error, busy + 1
                    continue
                if fault_of(error) == WORKER:  # this worker could not (e.g. restarted, its mounts not synced yet)
                    last = error
                    continue
                raise error
            return reply, None, False
        return None, last, bool(asked) and busy == asked

    def _follow_view(self, reader: Any) -> None:
        """A reply said its worker has a newer cluster view than this process: ask it for that
        view (once per version) and hand it to ``on_view``."""
        version = getattr(reader, "view_version", 0)
        if version <= self._view_known or self.on_view is None:
            return
        self._view_known = version
        try:
            reply = reader.meta(common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW))
        except Exception as exc:  # noqa: BLE001 - the next reply says so again
            log.debug("fetching the cluster view %d from a worker failed: %s", version, exc)
            self._view_known = version - 1
            return
        if reply.view:
            self.on_view(reply.view)

    def read_held(self, reads: list[tuple[str, int, memoryview]]) -> list[tuple[int, int] | None]:
        """Many reads ``(path, offset, out)`` through page handles held from local workers
        (their placed worker's), no message sent; per read (bytes read, object size) or None:
        not held there, read it another way."""
        results: list[tuple[int, int] | None] = [None] * len(reads)
        handles = self.workers.first_healthy([(path, offset) for path, offset, _out in reads])
        by_handle: list[tuple[Any, list[int]]]
        if handles and handles[0] is not None and handles.count(handles[0]) == len(handles):
            by_handle = [(handles[0], list(range(len(reads))))]  # one local worker: the usual case
        else:
            grouped: dict[int, tuple[Any, list[int]]] = {}
            for i, handle in enumerate(handles):
                if handle is not None:
                    grouped.setdefault(id(handle), (handle, []))[1].append(i)
            by_handle = list(grouped.values())
        for handle, indices in by_handle:
            reader = self._reader(handle)
            if reader is None or not hasattr(reader, "read_held_into"):
                continue
            try:
                got = reader.read_held_into(reads if len(indices) == len(reads) else [reads[i] for i in indices])
            except Exception as exc:  # noqa: BLE001 - the reads find another way
                log.debug("held read of %d ranges failed: %s", len(indices), exc)
                continue
            n = nbytes = 0
            for i, one in zip(indices, got):
                if one is not None:
                    results[i] = one
                    n += 1
                    nbytes += one[0]
            stats = self.stats[reader.kind]
            stats["reads"] += n
            stats["bytes"] += nbytes
            self.held["reads"] += n
            self.held["bytes"] += nbytes
        return results

    def prepare(self, ranges: list[tuple[str, int, int, str]], fill: bool = True) -> Prepared:
        """Get the page handles of many ranges ahead of their reads, one message per local
        worker (``fill``: cold ranges fetched into its page store first); returns how many ranges
        are now held here (their reads need no message at all) and how many were filled.
        Ranges whose first placed worker is not on this host are left to their reads."""
        by_reader: dict[int, tuple[Any, list[tuple[str, int, int, str]]]] = {}
        asked = 0  # ranges left to their reads (no local worker) count as asked: they take a message
        for r in ranges:
            candidates = self.workers.candidates(r[0], r[1], include_broken=False)
            reader = self._reader(candidates[0]) if candidates else None
            if reader is None or not hasattr(reader, "prepare"):
                asked += 1
                continue
            by_reader.setdefault(id(reader), (reader, []))[1].append(r)
        ready = filled = 0
        for reader, wanted in by_reader.values():
            try:
                got = reader.prepare(wanted, fill)
            except Exception as exc:  # noqa: BLE001 - only a hint: the reads find their own way
                log.debug("preparing %d ranges failed: %s", len(wanted), exc)
                asked += len(wanted)
                continue
            ready, filled, asked = ready + got.held, filled + got.filled, asked + got.asked
        return Prepared(ready, filled, asked)

    def info(self, path: str, fetch: int = 0) -> tuple[int, str, float] | None:
        """(size, version, mtime) of a cached file as a worker on this host vouched for it (and,
        with ``fetch``, asked for with the handles of its first bytes), or None: ask through gRPC."""
        candidates = self.workers.candidates(path, 0, include_broken=False)
        reader = self._reader(candidates[0]) if candidates else None
        if reader is None or not hasattr(reader, "info"):
            return None
        try:
            return reader.info(path, fetch)
        except Exception as exc:  # noqa: BLE001 - gRPC answers instead
            log.debug("short-circuit info of %s failed: %s", path, exc)
            return None

    def hint(self, handle: Any, keys: list[str]) -> int | None:
        """Ask ``handle``'s worker over its socket (short-circuit or data port) to load ``keys``
        in the background; how many it took (0: busy, or the socket failed); None when this
        process has no socket to that worker."""
        reader = self._reader(handle)
        if reader is None:
            return None
        try:
            if hasattr(reader, "hint"):
                return reader.hint(keys)
            return reader.meta(common_pb2.MetaRequest(op=common_pb2.MetaRequest.LOAD, paths=keys)).loading
        except Exception as exc:  # noqa: BLE001 - only a hint
            log.debug("hint of %d objects over %s failed: %s", len(keys), reader.kind, exc)
            return 0

    def data_port(self, handle: Any, timeout: float = SOCKET_TIMEOUT) -> DataPortReader | None:
        """``handle``'s data port for this process, even where its short-circuit socket serves the
        reads (a write's parts do not fit that socket's messages); None when it offers none."""
        reader = self._reader(handle, timeout)
        if isinstance(reader, DataPortReader):
            return reader
        config = self.config
        status = self._known_status(handle.address)
        if status is None or not status.data_port or not config.data_port:
            return None
        with self._lock:
            port = self._ports.get(handle.address)
            if port is None or port.port != status.data_port:
                port = self._ports[handle.address] = DataPortReader(
                    _host(handle.address), status.data_port, config.token, timeout=min(SOCKET_TIMEOUT, config.timeout),
                    counts=self.stats["data_port"], huge_pages=config.huge_pages, tls=config.tls)
        return port

    def meta_on(self, handle: Any, request: Any, timeout: float) -> Any | None:
        """A metadata operation on ``handle``'s worker itself over its socket (a read plan goes to
        the worker that holds the pages); None when this process has no socket to it. Raises the
        socket's failure (the caller's request is advisory or retried by it)."""
        reader = self._reader(handle, timeout)
        if reader is None:
            return None
        try:
            reply = reader.meta(request, timeout=timeout)
        except Exception as exc:
            self._failed(handle, reader, exc, "the operation fails")
            raise
        self._follow_view(reader)
        if reply.error_code:
            raise from_wire_error(reply.error_code, reply.error_detail, reply.error_message, f"worker {handle.address}")
        return reply

    def report(self) -> None:
        """Tell each local worker of the reads made through held page handles since the last
        request (they are otherwise reported with the next one)."""
        with self._lock:
            readers = [r for r, _ in self._readers.values() if r is not None and hasattr(r, "report")]
        for reader in readers:
            with contextlib.suppress(OSError):
                reader.report()

    def close(self) -> None:
        with self._lock:
            readers, self._readers = self._readers, {}
            ports, self._ports = self._ports, {}
        for reader in [r for r, _ in readers.values()] + list(ports.values()):
            if reader is not None:
                with contextlib.suppress(OSError):
                    reader.close()

    def release_inherited(self) -> None:
        """In a forked child: close this process's copies of the parent's idle sockets (the
        parent's own descriptors stay open, so its connections are undisturbed). No lock is
        taken: a parent thread may have held one at the fork."""
        self._lock = threading.Lock()
        readers, self._readers = self._readers, {}
        ports, self._ports = self._ports, {}
        for reader in [r for r, _ in readers.values()] + list(ports.values()):
            if reader is not None:
                reader.release_inherited()
