"""The master's durable state, behind one interface: SQLite (one master) or etcd (several).

:class:`StateBackend` is what the rest of the master uses (mount table, its version, jobs).
``state.py`` is the embedded default (``cachefs local``, a single master); ``etcdstate.py``
keeps the same records in etcd, where every master sees them and only the leader writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from cachefs.mounts import MountSpec


class StateBackend(Protocol):
    """Mounts (with a version that grows with each change), job records, the master's id."""

    master_id: str
    boot: int

    @property
    def mounts_version(self) -> int: ...

    def mounts(self) -> tuple[int, list[MountSpec]]:
        """(mounts_version, mounts sorted by name), one consistent snapshot."""

    def add_mount(self, spec: MountSpec, replace: bool = False) -> int: ...

    def remove_mount(self, name: str) -> int: ...

    def ensure_mounts(self, specs: Iterable[MountSpec]) -> list[str]: ...

    def save_job(self, job_id: str, created_at: float, record: dict[str, Any]) -> None: ...

    def jobs(self) -> list[dict[str, Any]]: ...

    def delete_jobs(self, job_ids: Iterable[str]) -> None: ...

    def close(self) -> None: ...
