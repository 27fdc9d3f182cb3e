"""The master's durable state in ``state_dir``: the mount table, its version, the jobs, the master's id.

Stored in SQLite (stdlib, WAL, synchronous=FULL: mount changes are rare and must survive a
crash). One connection guarded by a lock; reads are served from an in-memory copy kept in
step with every committed write, so building a view never touches the disk. Mount options
may hold credentials, hence a 0o700 directory and 0o600 files.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cachefs.errors import UnknownMountError
from cachefs.mounts import MountSpec
from cachefs.runtimedir import private_dir, private_file

DB_NAME = "master.db"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS mounts (
    name TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    options_json TEXT NOT NULL,
    read_only INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    record_json TEXT NOT NULL
);
"""



def _private_dir(path: Path) -> None:
    """0o700, ours, not a symlink: a state dir pre-created by another user is refused."""
    private_dir(path, mode=0o700)
    os.chmod(path, 0o700)


def _private_file(path: Path) -> None:
    """Create ``path`` 0o600 before SQLite opens it (SQLite gives -wal/-shm the same mode); one
    owned by another user, or a symlink, is refused (cachefs/runtimedir.py)."""
    private_file(path, 0o600)


class MasterState:
    """Mount table + mounts_version + master_id + a boot counter, persisted in ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)
        _private_dir(self.state_dir)
        path = self.state_dir / DB_NAME
        _private_file(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            with self._transaction():
                self.master_id = self._meta("master_id") or uuid.uuid4().hex[:16]
                self.boot = int(self._meta("boot") or 0) + 1
                self._set_meta("master_id", self.master_id)
                self._set_meta("boot", str(self.boot))
            self._version = int(self._meta("mounts_version") or 0)
            self._mounts = {
                name: MountSpec(name, url, json.loads(options), bool(read_only))
                for name, url, options, read_only in self._db.execute(
                    "SELECT name, url, options_json, read_only FROM mounts ORDER BY name"
                )
            }
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                private_file(side, 0o600)

    # -- sqlite helpers (caller holds the lock) --

    def _transaction(self) -> "_Tx":
        return _Tx(self._db)

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def _set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def _bump_locked(self) -> int:
        version = self._version + 1
        self._set_meta("mounts_version", str(version))
        return version

    # -- public API --

    @property
    def mounts_version(self) -> int:
        with self._lock:
            return self._version

    def mounts(self) -> tuple[int, list[MountSpec]]:
        """(mounts_version, mounts sorted by name), one consistent snapshot."""
        with self._lock:
            return self._version, [self._mounts[n] for n in sorted(self._mounts)]

    def add_mount(self, spec: MountSpec, replace: bool = False) -> int:
        """Add (or with ``replace``, overwrite) a mount; returns the new mounts_version."""
        try:
            options = json.dumps(dict(spec.options), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mount {spec.name!r}: options must be plain JSON values") from exc
        with self._lock:
            if spec.name in self._mounts and not replace:
                raise FileExistsError(f"mount {spec.name!r} already exists (use replace to change it)")
            with self._transaction():
                self._db.execute(
                    "INSERT OR REPLACE INTO mounts (name, url, options_json, read_only) VALUES (?, ?, ?, ?)",
                    (spec.name, spec.url, options, int(spec.read_only)),
                )
                version = self._bump_locked()
            self._mounts[spec.name] = MountSpec(spec.name, spec.url, json.loads(options), spec.read_only)
            self._version = version
            return version

    def remove_mount(self, name: str) -> int:
        """Remove a mount; returns the new mounts_version. :class:`UnknownMountError` if absent."""
        with self._lock:
            if name not in self._mounts:
                raise UnknownMountError(f"no mount named {name!r}")
            with self._transaction():
                self._db.execute("DELETE FROM mounts WHERE name = ?", (name,))
                version = self._bump_locked()
            del self._mounts[name]
            self._version = version
            return version

    def ensure_mounts(self, specs: Iterable[MountSpec]) -> list[str]:
        """Add the configured mounts that are absent (the durable table wins); returns those added."""
        added = []
        for spec in specs:
            try:
                self.add_mount(spec)
            except FileExistsError:
                continue
            added.append(spec.name)
        return added

    # -- jobs: the record is opaque here (server/master/jobs.py owns its shape) --

    def save_job(self, job_id: str, created_at: float, record: dict[str, Any]) -> None:
        """Insert or overwrite one job's record (progress is saved about once a second per job)."""
        text = json.dumps(record, sort_keys=True)
        with self._lock:
            with self._transaction():
                self._db.execute(
                    "INSERT OR REPLACE INTO jobs (job_id, created_at, record_json) VALUES (?, ?, ?)",
                    (job_id, created_at, text),
                )

    def jobs(self) -> list[dict[str, Any]]:
        """Every stored job record, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT record_json FROM jobs ORDER BY created_at, job_id").fetchall()
        return [json.loads(text) for (text,) in rows]

    def delete_jobs(self, job_ids: Iterable[str]) -> None:
        ids = [(job_id,) for job_id in job_ids]
        if not ids:
            return
        with self._lock:
            with self._transaction():
                self._db.executemany("DELETE FROM jobs WHERE job_id = ?", ids)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error (autocommit connection)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
