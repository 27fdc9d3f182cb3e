"""Short-circuit reads: cached page files handed to a client on the same host, as descriptors.

Through gRPC a cached page is read from disk into Python, copied into a message, sent over
TCP and copied again on the client's side. When the client runs on the worker's host, the
worker can instead open the page files and pass their descriptors over a Unix socket
(SCM_RIGHTS), as HDFS short-circuit reads do: the client reads the bytes straight into its own
(aligned) buffer and checks each page's checksum itself. The client never learns a path and
can read only the descriptors it is handed (opened read-only); the socket is guarded by its
file mode and, when the worker has an access token, by that token in every request.

Only fully cached ranges are served here: a range with a missing page gets NOT_CACHED and the
client reads it through gRPC, which fetches, caches and serves it as usual; unless the client
asked for it to be filled (a cold read on this host): then the worker fetches it into the page
store first and hands out the pages (fill.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable, Hashable
from typing import Any

from cachefs.localhost import MAX_MESSAGE, MAX_PAGES
from cachefs.peercred import PeerPolicy
from cachefs.proto import shortcircuit_pb2
from cachefs.server.rpc import info_message
from cachefs.server.connections import token_checker
from cachefs.server.worker.bulkpath import OK, CachedPages
from cachefs.server.connections import Connection, ConnectionServer
from cachefs.server.worker.fill import RangeFiller
from cachefs.server.worker.handles import HandleTable
from cachefs.server.worker.metaops import MetaOps
from cachefs.server.worker.names import NameIndex

__all__ = ["ShortCircuitServer", "token_checker"]

Reply = shortcircuit_pb2.ShortCircuitReply
RangeReply = shortcircuit_pb2.RangeReply

#: How long a client may keep a handed-out descriptor at most, whatever the metadata TTL.
MAX_HOLD_SECONDS = 300.0
#: A client's connect fails at once (EAGAIN) while the backlog is full, and its reads then go to
#: gRPC for a while: leave room for a burst (many loader processes starting at once).
LISTEN_BACKLOG = 512


def _dir_id(path: str) -> str:
    """A directory's identity, which a client in another mount namespace can compare with its own."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


class ShortCircuitServer(ConnectionServer):
    name = "shortcircuit"
    #: Who may connect at all (cachefs/peercred.py; the daemon's allowed_uids / allowed_gid):
    #: others are closed before a byte is read. Default: this process's uid and root.
    peers: PeerPolicy = PeerPolicy()

    def __init__(self, path: str, pages: CachedPages, mode: int = 0o660,
                 on_served: Callable[[int, int, int], None] | None = None, table: HandleTable | None = None,
                 hold: Callable[[list[str], float, bool], bool] | None = None,
                 still_cached: Callable[[str], bool] | None = None,
                 on_touched: Callable[[int, int], None] | None = None, filler: RangeFiller | None = None,
                 on_handed_out: Callable[[int], None] | None = None,
                 on_load: Callable[[list[str]], int] | None = None,
                 passing: Callable[[str], bool] | None = None,
                 on_progress: Callable[[str, int, int, int], None] | None = None,
                 names: NameIndex | None = None, page_dirs: list[tuple[str, int]] | None = None,
                 on_named: Callable[[list[str], int], None] | None = None,
                 on_stale: Callable[[list[str]], None] | None = None, meta: MetaOps | None = None,
                 **limits: Any) -> None:
        """With a ``table``, pages are handed out to be held: ``hold(digests, until, by_name)``
        charges them to the quota while clients may hold them (False: hand them out for one read;
        ``by_name``: the client can open them by name later),
        and ``still_cached(digest)`` closes the race with an eviction in between. With a ``filler``,
        ranges asked for with ``fill`` are fetched into the page store first (fill.py). ``limits``:
        ConnectionServer's (max_connections, max_per_peer: per client process, threads, timeouts).
        With ``names`` (names.py) and the page store's ``page_dirs`` (root, quota), clients of this
        process's user may open cached page files by name; ``on_named(digests, bytes)`` hears
        of the pages they read that way, ``on_stale(paths)`` of the objects they read so past
        their entries' time (within the table's stale window: to be refreshed). With ``meta``
        (metaops.py), a request's metadata operation is answered and every reply carries the
        worker's view version."""
        super().__init__(**limits)
        self.path, self.mode, self.pages, self._on_served = path, mode, pages, on_served
        self.table, self._hold, self._still_cached, self._on_touched = table, hold, still_cached, on_touched
        self.filler, self._on_handed_out = filler, on_handed_out
        self._on_load = on_load  # hints: objects to load in the background (hintloads.py)
        self._passing = passing  # pages served but not admitted (pagestore/passing.py)
        self._on_progress = on_progress  # a reading job's position in its plan (worker/plans.py)
        self.names, self._page_dirs, self._on_named = names, page_dirs or [], on_named
        self._on_stale = on_stale
        self.meta = meta
        self._uid = os.getuid()

    def _listen(self) -> socket.socket:
        if len(os.fsencode(self.path)) >= 108:
            raise ValueError(f"short-circuit socket path is too long for a Unix socket: {self.path}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.mode)
            sock.listen(LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        return sock

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _peer(self, sock: socket.socket, address: Any) -> Hashable:
        pid, uid, _gid = self.peers.check(sock)  # PeerNotAllowedError (an OSError): the connection is closed
        return uid, pid  # the client process

    def _read_request(self, conn: Connection) -> bytes | None:
        """A message is one request, and comes whole (SOCK_SEQPACKET)."""
        try:
            data = os.read(conn.fd, MAX_MESSAGE)
        except BlockingIOError:
            return None
        if not data:
            raise EOFError
        return data

    def _handle(self, conn: Connection, data: bytes) -> bool:
        fds: list[int] = []
        try:
            reply = self._answer(data, fds, conn.peer)
            socket.send_fds(conn.sock, [reply.SerializeToString()], fds)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _answer(self, data: bytes, fds: list[int], peer: Hashable = None) -> Any:
        """The reply to one request; the descriptors to send with it are appended to ``fds``.
        ``peer``: the client process, (uid, pid)."""
        request = shortcircuit_pb2.ShortCircuitRequest()
        try:
            request.ParseFromString(data)
        except Exception:
            return Reply(refused=True, message="malformed request", answered=True)
        if not self.pages.token_ok(request.token):
            return Reply(refused=True, message="UNAUTHENTICATED: missing or wrong access token", answered=True)
        if request.touched and self.table is not None:
            touched = self.table.touched(request.touched)
            if self._on_touched is not None:
                self._on_touched(touched, request.touched_bytes)
        if request.touched_pages and self._on_named is not None:
            self._on_named([d.hex() for d in request.touched_pages if len(d) == 16],
                           request.touched_pages_bytes)
        if request.stale_paths and self._on_stale is not None:
            self._on_stale(list(request.stale_paths))
        reply = Reply(answered=True)
        if self.meta is not None:
            reply.view_version = self.meta.view_version()
            if request.HasField("meta"):
                reply.meta.CopyFrom(self.meta.answer(request.meta, self.slow_slot))
        by_name = request.by_name and self._names_for(peer)
        if request.plan_job and self._on_progress is not None:
            self._on_progress(request.plan_job, request.plan_position, request.plan_reader,
                              request.plan_furthest)
        if request.load and self._on_load is not None:
            reply.loading = self._on_load(list(request.load))
        if request.hello and self.table is not None:
            fds.append(self.table.reader_fd())
            reply.instance, reply.table_slots = self.table.instance, self.table.slots
            reply.page_size = self.pages.page_size
            if self._names_for(peer):
                names_fd, reply.names_slots = self.names.reader()
                fds.append(names_fd)
                reply.page_dirs.extend(root for root, _quota in self._page_dirs)
                reply.page_dir_quotas.extend(quota for _root, quota in self._page_dirs)
                reply.page_dir_ids.extend(_dir_id(root) for root, _quota in self._page_dirs)
        # Each range's descriptors apart until the end: a filled range is opened again after the
        # others, and the reply's descriptors must come in the order of its ranges.
        answers: list[tuple[Any, list[int]]] = []
        budget = MAX_PAGES - len(fds)  # descriptors left for this reply
        try:
            for wanted in request.ranges:
                answers.append(self._range(wanted, budget, by_name=by_name))
                budget -= len(answers[-1][1])
            cold = [i for i, (wanted, (got, _)) in enumerate(zip(request.ranges, answers))
                    if wanted.fill and got.code == RangeReply.NOT_CACHED]
            fetched: list[set[Any]] = [set() for _ in cold]  # per cold range: pages not cached (misses)
            failures: list[OSError | None] = [None] * len(cold)
            filling = False
            if cold and self.filler is not None:
                with self.slow_slot() as slot:  # none: NOT_CACHED (the client's other ways)
                    filling = slot and self.filler.fill([request.ranges[i] for i in cold], fetched, failures)
            if filling:
                for i, missed, failure in zip(cold, fetched, failures):
                    if failure is not None:  # no use asking again: the client raises it
                        answers[i] = (RangeReply(code=RangeReply.FAILED, errno=failure.errno or errno.EIO,
                                                 message=failure.strerror or str(failure)), [])
                        continue
                    answers[i] = self._range(request.ranges[i], budget, missed, by_name)
                    budget -= len(answers[i][1])
                    answers[i][0].filled = True
        except BaseException:
            for _, range_fds in answers:
                for fd in range_fds:
                    os.close(fd)
            raise
        for got, range_fds in answers:
            reply.ranges.append(got)
            fds.extend(range_fds)
        return reply

    def _range(self, wanted: Any, budget: int, missed: set[Any] | None = None,
               by_name: bool = False) -> tuple[Any, list[int]]:
        """The reply for one range and the descriptors to send with it (at most ``budget``);
        ``missed``: ids of its pages fetched for this request (flagged ``fetched``); ``by_name``:
        the client opens cached pages by name (it holds fewer)."""
        if budget <= 0:
            return RangeReply(code=RangeReply.REFUSED, message=f"more than {MAX_PAGES} pages in one reply"), []
        opened = self.pages.open(wanted, max_pages=budget)
        info = info_message(opened.meta) if opened.meta is not None else None
        if opened.code != OK:
            return RangeReply(code=opened.code, message=opened.message, info=info), []
        now = time.monotonic()
        if self.names is not None and opened.fds and opened.meta is not None:
            meta = opened.meta
            # Clients read by name up to the table's stale window past an entry's time: an entry of
            # stale metadata is published that much earlier (never trusted past TTL + grace).
            named_until = opened.valid_until - (self.names.stale_window if opened.stale else 0.0)
            self.names.publish(str(meta.path), meta.version, meta.size, meta.mtime, named_until)
        until = min(opened.valid_until, now + MAX_HOLD_SECONDS)
        slots, generations = self._slots(opened.pages, until, by_name)
        once = [slot == 0 and self._passing is not None and self._passing(pid.digest())
                for slot, pid in zip(slots, opened.pages)]
        if self._on_served is not None and opened.fds and not wanted.ahead:
            self._on_served(len(opened.fds), opened.end - opened.offset,
                            sum(1 for pid in opened.pages if pid in missed) if missed else 0)
        elif self._on_handed_out is not None and opened.fds:
            self._on_handed_out(opened.end - opened.offset)
        range_fds, opened.fds = opened.fds, []
        fetched = [pid in missed for pid in opened.pages] if missed else []
        return RangeReply(code=RangeReply.OK, info=info, page_offsets=opened.page_offsets,
                          page_lengths=opened.page_lengths, slots=slots, generations=generations,
                          valid_ms=max(0, int((until - now) * 1000)), fetched=fetched,
                          once=once if any(once) else []), range_fds

    def _names_for(self, peer: Hashable) -> bool:
        """True if this client is offered the name index (reads by name are on here, for its user)."""
        return self.names is not None and bool(self._page_dirs) and self._by_name_allowed(peer)

    def _by_name_allowed(self, peer: Hashable) -> bool:
        """Only a client of this process's user (or root) could open the page files anyway."""
        uid = peer[0] if isinstance(peer, tuple) and peer else -1
        return uid in (self._uid, 0)

    def _slots(self, pages: list[Any], until: float, by_name: bool = False) -> tuple[list[int], list[int]]:
        """Per page, its (slot, generation), or (0, 0): read it now, do not keep the descriptor."""
        if self.table is None or self._hold is None or not pages or until <= time.monotonic():
            return [0] * len(pages), [0] * len(pages)
        digests = [pid.digest() for pid in pages]
        if not self._hold(digests, until, by_name):
            return [0] * len(pages), [0] * len(pages)
        slots, generations = [], []
        for digest in digests:
            slot, generation = self.table.assign(digest)
            # An eviction between opening the file and taking the slot would not have told us.
            if self._still_cached is not None and not self._still_cached(digest):
                self.table.invalidate([digest])
                slot = generation = 0
            slots.append(slot)
            generations.append(generation)
        return slots, generations
