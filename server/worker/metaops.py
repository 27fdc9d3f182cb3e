"""The metadata a worker answers on its own sockets, one request table for both of them.

A process forked from one that had loaded gRPC must not touch gRPC (client/forksafe.py): a
DataLoader worker reads pages over the short-circuit socket (shortcircuit.py) or the data port
(dataport.py), and asks for what else it needs the same way: an object's info, a listing (in
pages: a reply of the short-circuit socket is one 64 KiB message), the cluster view the worker
last had from the master, the worker's status, read plans (the worker's Plan call), hinted
loads, and the mutations (remove, mkdir, copy, free; a write's parts come over the data port:
dataport.py). Each socket server parses its own framing and
hands the ``MetaRequest`` here; errors go back as gRPC would have carried them (status code
name, the ``cachefs-error`` detail, the message: cachefs/errors.py), so the client raises the
same exception either way.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

from cachefs.errors import OverloadedError, wire_error
from cachefs.localhost import PROTOCOL_VERSION
from cachefs.paths import parse_path
from cachefs.proto import common_pb2, worker_pb2
from cachefs.server.rpc import info_message, info_of

log = logging.getLogger(__name__)

MetaRequest = common_pb2.MetaRequest
MetaReply = common_pb2.MetaReply

#: Entries in one listing page at most, and their encoded bytes at most: a short-circuit reply
#: is one SOCK_SEQPACKET message of 64 KiB (cachefs/localhost.py MAX_MESSAGE) with its header.
LIST_PAGE_ENTRIES = 1000
LIST_PAGE_BYTES = 48 << 10
_MUTATIONS = (MetaRequest.REMOVE, MetaRequest.MKDIR, MetaRequest.COPY, MetaRequest.FREE)
#: Operations that may wait on the store or work long (server/connections.py SLOW_SHARE).
SLOW_OPS = frozenset((MetaRequest.INFO, MetaRequest.LIST, MetaRequest.PLAN) + _MUTATIONS)


def _parsed(message: Any, data: bytes) -> Any:
    try:
        return message.FromString(data)
    except Exception as exc:  # protobuf's DecodeError: the request's fault
        raise ValueError(f"malformed {message.DESCRIPTOR.name}: {exc}") from None


class ListingPages:
    """A listing handed out page by page, by name: each page the entries after ``start_after``,
    cut from the store listing's chunk that holds them (ObjectStore.list_chunk): a page costs
    about a page of store work, and listers of one prefix share the chunks. A page ends where its
    chunk does, so every lister asks for the next chunk after the same name."""

    def __init__(self, objects: Any) -> None:
        self._objects = objects

    def page(self, raw_path: str, recursive: bool, refresh: bool, start_after: str, max_entries: int,
             max_entries_default: int, max_bytes: int) -> tuple[list[Any], str]:
        """(entries as ObjectInfo messages, the name to ask the next page after; "" at the end)."""
        path = parse_path(raw_path)
        # A new listing: the store's cache decides how fresh; a later page: never a refresh mid-listing.
        chunk = self._objects.list_chunk(path, recursive, start_after, refresh=refresh and not start_after)
        names, ordered = chunk.names, chunk.entries
        start = bisect.bisect_right(names, start_after) if start_after else 0
        limit = min(max_entries_default, max_entries or max_entries_default)
        out: list[Any] = []
        size = 0
        end = start
        while end < len(ordered) and end - start < limit:
            name, entry_size, version, mtime, is_dir = ordered.named_fields(end)
            # At least the entry's encoded size: its strings' bytes, and at most 40 for its tags,
            # lengths, varints and double (cheaper than ByteSize() of each message).
            size += len(name.encode()) + len(version.encode()) + 40
            if size > max_bytes and end > start:
                break
            out.append(info_of(name, entry_size, version, mtime, is_dir))
            end += 1
        return out, (names[end - 1] if end < len(ordered) or not chunk.final else "")


class MetaOps:
    """Answers ``MetaRequest``s with the worker's object store and what it knows of the cluster."""

    def __init__(self, objects: Any, status: Callable[[], bytes],
                 view: Callable[[], tuple[int, bytes]] | None = None,
                 plan: Callable[[Any], Any] | None = None, load: Callable[[list[str]], int] | None = None,
                 mutations: Any = None, on_answered: Callable[[str, bool], None] | None = None) -> None:
        """``objects``: the worker's ObjectStore (its metadata and listing caches);
        ``status()``: its serialized WorkerStatus; ``view()``: (version, serialized ClusterView)
        of the view it last had from the master ((0, b"") without one); ``plan(PlanRequest)``:
        the PlanReply (the Plan call's work); ``load(paths)``: hinted loads started in the
        background, how many were taken (hintloads.py); ``mutations``: what does the worker's
        Remove, MakeDir, Copy and Free (its servicer's ``remove``, ``make_dir``, ``copy``, ``free``);
        ``on_answered(op, ok)``: counts each answer (metrics)."""
        self._objects, self._status = objects, status
        self._view = view or (lambda: (0, b""))
        self._plan, self._load, self._mutations = plan, load, mutations
        self._on_answered = on_answered
        self._pages = ListingPages(objects)

    def view_version(self) -> int:
        return self._view()[0]

    def answer(self, request: Any, slow_slot: Callable[[], Any] | None = None) -> Any:
        """The reply to one request (never raises for a bad request or a store failure).
        ``slow_slot``: the serving server's ``ConnectionServer.slow_slot``; a slow operation
        (``SLOW_OPS``) with no slot free is answered busy (OverloadedError: the client tries
        another worker, or again after a moment)."""
        if slow_slot is not None and request.op in SLOW_OPS:
            with slow_slot() as got:
                reply = self._answer(request) if got else self._busy()
        else:
            reply = self._answer(request)
        if self._on_answered is not None:
            name = MetaRequest.Op.Name(request.op).lower() if request.op in MetaRequest.Op.values() else "unknown"
            self._on_answered(name, not reply.error_code)
        return reply

    @staticmethod
    def _busy() -> Any:
        code, detail, message = wire_error(OverloadedError("BUSY: the worker's threads for slow work are taken"))
        return MetaReply(error_code=code, error_detail=detail, error_message=message)

    def _answer(self, request: Any) -> Any:
        try:
            if request.op == MetaRequest.INFO:
                return MetaReply(info=info_message(self._objects.info(parse_path(request.path),
                                                                       refresh=request.refresh)))
            if request.op == MetaRequest.LIST:
                return self._list_page(request)
            if request.op == MetaRequest.VIEW:
                return MetaReply(view=self._view()[1])
            if request.op == MetaRequest.STATUS:
                return MetaReply(status=self._status())
            if request.op == MetaRequest.PLAN and self._plan is not None:
                return MetaReply(plan=self._plan(_parsed(worker_pb2.PlanRequest, request.plan)).SerializeToString())
            if request.op == MetaRequest.LOAD and self._load is not None:
                for raw in request.paths:
                    parse_path(raw)  # a bad path is the request's error, not a failed background load
                return MetaReply(loading=self._load(list(request.paths)))
            if request.op == MetaRequest.HELLO:
                return MetaReply(role="worker", protocol=PROTOCOL_VERSION)
            if request.op in _MUTATIONS and self._mutations is not None:
                return self._mutate(request)
            raise ValueError(f"unknown metadata operation {request.op}")
        except Exception as exc:  # noqa: BLE001 - every failure goes back as the error it is
            if not isinstance(exc, (OSError, ValueError, NotImplementedError)):
                log.exception("metadata operation %s on %r failed", request.op, request.path)
            code, detail, message = wire_error(exc)
            return MetaReply(error_code=code, error_detail=detail, error_message=message)

    def _mutate(self, request: Any) -> Any:
        m = self._mutations
        if request.op == MetaRequest.REMOVE:
            return MetaReply(pages_freed=m.remove(request.path, request.recursive))
        if request.op == MetaRequest.MKDIR:
            m.make_dir(request.path, request.create_parents, request.exist_ok)
            return MetaReply()
        if request.op == MetaRequest.COPY:
            return MetaReply(info=info_message(m.copy(request.path, request.destination)))
        return MetaReply(pages_freed=m.free(request.path))

    def _list_page(self, request: Any) -> Any:
        entries, next_after = self._pages.page(request.path, request.recursive, request.refresh, request.start_after,
                                               request.max_entries, LIST_PAGE_ENTRIES, LIST_PAGE_BYTES)
        reply = MetaReply(entries=entries)
        if next_after:
            reply.next_after = next_after
        return reply
