"""The master's state in etcd: mounts, jobs and live workers under one key prefix.

Layout (``<prefix>`` is ``etcd_prefix``, ``/cachefs/default/`` by default)::

    <prefix>leader             the leading master (election.py), tied to its lease
    <prefix>mounts/<name>      {"url", "options", "read_only"}: the mount table (with credentials)
    <prefix>jobs/<job_id>      a job's record (jobs.py), progress written about once a second
    <prefix>members/<worker>   {"address", "version", "registered_at", "lean"}, tied to the worker's lease
                               ("lean": its LeanPaths message, base64)
    <prefix>masters/<master>   the master's address, tied to its election lease (who is up)

Every master keeps the mounts and members in memory, loaded once and then followed by one
watch on ``mounts/`` and ``members/``: a standby serves the same view as the leader, and the
view's version is etcd's revision of the last change, so every master numbers views alike and
a client moving between them never sees a version go back by more than a watch's lag.
Writes are leader-only and fenced (:meth:`Election.fence`).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefs.errors import ControlPlaneUnavailableError, UnknownMountError
from cachefs.mounts import MountSpec
from cachefs.server.etcd import api
from cachefs.server.etcd.client import EtcdClient
from cachefs.server.master.viewversion import ViewVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemberKey:
    """One worker's key in etcd, as the watch last saw it."""

    worker_id: str
    address: str
    version: str
    registered_at: float
    lease: int
    revision: int
    lean: bytes = b""  # a serialized master_pb2.LeanPaths


def local_master_id(state_dir: str) -> str:
    """This master's id, kept in its state dir (several masters share etcd, each has its own)."""
    path = Path(state_dir)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    file = path / "master-id"
    try:
        return file.read_text().strip() or _new_id(file)
    except FileNotFoundError:
        return _new_id(file)


def _new_id(file: Path) -> str:
    master_id = uuid.uuid4().hex[:16]
    file.write_text(master_id + "\n")
    return master_id


class EtcdState:
    """Implements :class:`~cachefs.server.master.backend.StateBackend` over etcd."""

    boot = 0

    def __init__(self, client: EtcdClient, prefix: str, master_id: str, versions: ViewVersion,
                 fence: Callable[[], list[Any]]) -> None:
        self.client = client
        self.prefix = prefix.encode()
        self.master_id = master_id
        self.versions = versions
        self._fence = fence
        self._lock = threading.Lock()
        self._mounts: dict[str, MountSpec] = {}
        self._members: dict[str, MemberKey] = {}
        self._masters: dict[str, str] = {}
        self._mounts_version = 0
        self._members_version = 0
        self.revision = 0  # the etcd revision the in-memory copy is at
        self._caught_up = threading.Condition(self._lock)
        self._watches: list[Any] = []
        self.member_listeners: list[Callable[[], None]] = []

    # -- keys --

    def key(self, kind: str, name: str = "") -> bytes:
        return self.prefix + kind.encode() + b"/" + name.encode()

    # -- loading and following --

    def start(self) -> "EtcdState":
        revision = self._reload()
        # One watch over the whole prefix: events come in revision order, so "applied up to R"
        # means every change up to R (job and leader events are only counted, not kept).
        self._watches.append(self.client.watch_prefix(self.prefix, revision + 1, self._apply, self._reload,
                                                      name="cachefs-etcd-watch"))
        return self

    def resync(self) -> int:
        """Read everything again, at etcd's current revision: a new leader starts from all that was
        written before its election."""
        return self._reload()

    def _reload(self) -> int:
        """Read mounts, members and masters whole, all at one revision (start, a new leader, or a
        watch that fell behind a compaction); returns the revision the copy is at."""
        mounts_resp = self.client.get_prefix(self.key("mounts"))
        at = mounts_resp.header.revision
        members_resp = self.client.get_prefix(self.key("members"), timeout=None, revision=at)
        masters_resp = self.client.get_prefix(self.key("masters"), revision=at)
        with self._lock:
            if at <= self.revision:
                return self.revision  # the watch has applied everything up to here already
            self._masters = {bytes(kv.key)[len(self.key("masters")):].decode(): kv.value.decode("utf-8", "replace")
                             for kv in masters_resp.kvs}
            self._mounts = dict(filter(None, (self._mount_of(kv) for kv in mounts_resp.kvs)))
            self._members = dict(filter(None, (self._member_of(kv) for kv in members_resp.kvs)))
            self._mounts_version = self._members_version = at
            self.revision = at
            self._caught_up.notify_all()
        self.versions.advance(at)
        for listener in self.member_listeners:
            listener()
        return at

    def _apply(self, revision: int, events: list[Any]) -> None:
        mounts_changed = members_changed = False
        mounts_key, members_key, masters_key = self.key("mounts"), self.key("members"), self.key("masters")
        with self._lock:
            for event in events:
                if event.kv.mod_revision <= self.revision:
                    continue  # already in the copy (a reload read past it)
                key = bytes(event.kv.key)
                if key.startswith(masters_key):
                    mid = key[len(masters_key):].decode()
                    if event.type == api.EVENT_DELETE:
                        self._masters.pop(mid, None)
                    else:
                        self._masters[mid] = bytes(event.kv.value).decode("utf-8", "replace")
                elif key.startswith(mounts_key):
                    name = key[len(mounts_key):].decode()
                    if event.type == api.EVENT_DELETE:
                        self._mounts.pop(name, None)
                    else:
                        item = self._mount_of(event.kv)
                        if item:
                            self._mounts[item[0]] = item[1]
                    mounts_changed = True
                elif key.startswith(members_key):
                    wid = key[len(members_key):].decode()
                    if event.type == api.EVENT_DELETE:
                        self._members.pop(wid, None)
                    else:
                        item = self._member_of(event.kv)
                        if item:
                            self._members[item[0]] = item[1]
                    members_changed = True
            if mounts_changed:
                self._mounts_version = revision
            if members_changed:
                self._members_version = revision
            self.revision = max(self.revision, revision)
            self._caught_up.notify_all()
        if mounts_changed or members_changed:
            self.versions.advance(revision)
        if members_changed:
            for listener in self.member_listeners:
                listener()

    def wait_revision(self, revision: int, timeout: float) -> bool:
        """Until the in-memory copy has every change up to ``revision`` (a new leader's first step)."""
        with self._lock:
            return self._caught_up.wait_for(lambda: self.revision >= revision, timeout)

    def _mount_of(self, kv: Any) -> tuple[str, MountSpec] | None:
        name = bytes(kv.key)[len(self.key("mounts")):].decode()
        try:
            data = json.loads(kv.value)
            return name, MountSpec(name, data["url"], data.get("options", {}), bool(data.get("read_only")))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable mount record %r in etcd", name)
            return None

    def _member_of(self, kv: Any) -> tuple[str, MemberKey] | None:
        wid = bytes(kv.key)[len(self.key("members")):].decode()
        try:
            data = json.loads(kv.value)
            return wid, MemberKey(wid, str(data["address"]), str(data.get("version", "")),
                                  float(data.get("registered_at", 0.0)), kv.lease, kv.mod_revision,
                                  base64.b64decode(data.get("lean", ""), validate=True))
        except (ValueError, KeyError, TypeError, binascii.Error):
            log.warning("ignoring an unreadable member record %r in etcd", wid)
            return None

    # -- members (written by etcdmembers.py) --

    def members(self) -> dict[str, MemberKey]:
        with self._lock:
            return dict(self._members)

    def masters(self) -> dict[str, str]:
        """master id -> address of every master whose election lease lives."""
        with self._lock:
            return dict(self._masters)

    @property
    def members_version(self) -> int:
        with self._lock:
            return self._members_version

    # -- the mount table --

    @property
    def mounts_version(self) -> int:
        with self._lock:
            return self._mounts_version

    def mounts(self) -> tuple[int, list[MountSpec]]:
        with self._lock:
            return self._mounts_version, [self._mounts[n] for n in sorted(self._mounts)]

    def _write(self, compare: list[Any], ops: list[Any]) -> Any:
        return self.client.txn(self._fence() + compare, ops)

    def _settle(self, resp: Any) -> int:
        """The write's revision, once this master's copy has it (read-your-writes for the caller)."""
        revision = resp.header.revision
        self.wait_revision(revision, self.client.settings.timeout)
        return revision

    def add_mount(self, spec: MountSpec, replace: bool = False) -> int:
        try:
            value = json.dumps({"url": spec.url, "options": dict(spec.options), "read_only": spec.read_only},
                               sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mount {spec.name!r}: options must be plain JSON values") from exc
        key = self.key("mounts", spec.name)
        compare = [] if replace else [api.Compare(key=key, target=api.TARGET_VERSION, result=api.EQUAL, version=0)]
        resp = self._write(compare, [api.RequestOp(request_put=api.PutRequest(key=key, value=value))])
        if not resp.succeeded:
            self._fence()  # still leading? then the mount exists
            raise FileExistsError(f"mount {spec.name!r} already exists (use replace to change it)")
        return self._settle(resp)

    def remove_mount(self, name: str) -> int:
        key = self.key("mounts", name)
        resp = self._write([api.Compare(key=key, target=api.TARGET_VERSION, result=api.GREATER, version=0)],
                           [api.RequestOp(request_delete_range=api.DeleteRangeRequest(key=key))])
        if not resp.succeeded:
            self._fence()
            raise UnknownMountError(f"no mount named {name!r}")
        return self._settle(resp)

    def ensure_mounts(self, specs: Iterable[MountSpec]) -> list[str]:
        added = []
        for spec in specs:
            try:
                self.add_mount(spec)
            except FileExistsError:
                continue
            added.append(spec.name)
        return added

    # -- jobs --

    def save_job(self, job_id: str, created_at: float, record: dict[str, Any]) -> None:
        value = json.dumps(record, sort_keys=True).encode()
        resp = self._write([], [api.RequestOp(request_put=api.PutRequest(key=self.key("jobs", job_id), value=value))])
        if not resp.succeeded:
            self._fence()
            raise ControlPlaneUnavailableError("job record not saved: this master's term as leader ended")

    def jobs(self) -> list[dict[str, Any]]:
        resp = self.client.get_prefix(self.key("jobs"))
        records = []
        for kv in resp.kvs:
            try:
                records.append(json.loads(kv.value))
            except ValueError:
                log.warning("ignoring an unreadable job record %r in etcd", bytes(kv.key))
        records.sort(key=lambda r: (r.get("created_at", 0.0), r.get("job_id", "")))
        return records

    def delete_jobs(self, job_ids: Iterable[str]) -> None:
        ops = [api.RequestOp(request_delete_range=api.DeleteRangeRequest(key=self.key("jobs", j))) for j in job_ids]
        for start in range(0, len(ops), 100):  # etcd's default --max-txn-ops is 128
            self._write([], ops[start:start + 100])

    def close(self) -> None:
        for watch in self._watches:
            watch.stop()
        self._watches = []
