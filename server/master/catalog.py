"""The master's metadata and listing cache over the object stores (TTL, explicit refresh).

Clients that list a huge prefix through the master share one listing instead of each asking
the store. The master opens every mount *with* its credentials (it holds them in its durable
state), in one :class:`ObjectStore` whose caches live as long as the master; a mount that is
changed or removed is dropped from it (and from its caches) on the next call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from cachefs.errors import StoreError, UnknownMountError
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import CachePath
from cachefs.server.master.state import MasterState
from cachefs.store.meta import ObjectMeta
from cachefs.store.objects import ObjectStore

log = logging.getLogger(__name__)


class Catalog:
    """Metadata, listings and "every object below a path", over the master's mount table."""

    def __init__(self, state: MasterState, metadata_ttl: float, list_ttl: float) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._mounts = MountTable()
        self._store = ObjectStore(self._mounts, metadata_ttl=metadata_ttl, list_ttl=list_ttl)
        self._specs: dict[str, MountSpec] = {}
        self._broken: dict[str, str] = {}  # mount -> why its filesystem could not be opened
        self._version: int | None = None

    def _sync(self) -> ObjectStore:
        """Follow the durable mount table (cheap when its version has not moved)."""
        if self._state.mounts_version == self._version:
            return self._store
        with self._lock:
            version, specs = self._state.mounts()
            if version == self._version:
                return self._store
            wanted = {spec.name: spec for spec in specs}
            for name in list(self._specs):
                if wanted.get(name) != self._specs[name]:
                    self._mounts.remove(name)
                    self._store.forget_mount(name)
                    del self._specs[name]
            self._broken = {n: why for n, why in self._broken.items() if n in wanted}
            for name, spec in wanted.items():
                if name in self._specs:
                    continue
                try:
                    self._mounts.add(spec, exact_root=True)  # a realpath the policy checked
                except Exception as exc:  # noqa: BLE001 - one bad mount must not hide the others
                    # The type only: a message from a store's constructor may quote its options.
                    self._broken[name] = type(exc).__name__
                    log.warning("mount %s: cannot open its filesystem (%s)", name, type(exc).__name__)
                    continue
                self._specs[name] = spec
                self._broken.pop(name, None)
            self._version = version
            return self._store

    def _store_for(self, path: CachePath) -> ObjectStore:
        store = self._sync()
        if path.mount in self._broken:
            raise StoreError(f"mount {path.mount!r}: its filesystem cannot be opened ({self._broken[path.mount]})")
        return store

    def has_mount(self, name: str) -> bool:
        self._sync()
        return name in self._specs or name in self._broken

    def check_mount(self, path: CachePath) -> None:
        """:class:`UnknownMountError` unless ``path``'s mount is in the table."""
        if not self.has_mount(path.mount):
            raise UnknownMountError(f"no mount named {path.mount!r}")

    def info(self, path: CachePath, refresh: bool = False) -> ObjectMeta:
        return self._store_for(path).info(path, refresh=refresh)

    def list(self, path: CachePath, recursive: bool = False, refresh: bool = False) -> Sequence[ObjectMeta]:
        return self._store_for(path).list(path, recursive=recursive, refresh=refresh)

    def list_chunk(self, path: CachePath, recursive: bool, after: str, refresh: bool = False) -> Any:
        """The listing cache's chunk holding the entries right after ``after`` (ObjectStore.list_chunk):
        a paged List (``cachefs ls``) is answered a chunk at a time, never the whole prefix at once."""
        return self._store_for(path).list_chunk(path, recursive, after, refresh=refresh)

    def list_page(self, path: CachePath, after: str, limit: int) -> tuple[list[ObjectMeta], str, bool]:
        """One store request's worth of the objects below ``path`` after the name ``after``, the
        last name it covered, and whether it was the last (``ObjectStore.list_page``: kept nowhere)."""
        return self._store_for(path).list_page(path, after, limit)

    def objects_under(
        self, path: CachePath, refresh: bool = False, limit: int | None = None
    ) -> tuple[ObjectMeta, list[ObjectMeta], bool]:
        """(the path itself, the objects it names, truncated): one object, or every object below a prefix.

        ``limit`` caps the objects returned (truncated=True then). The listing itself is whole:
        the store is listed once and cached, however many objects are counted from it.
        """
        store = self._store_for(path)
        root = store.info(path, refresh=refresh)
        if not root.is_dir:
            return root, [root], False
        objects = [m for m in store.list(path, recursive=True, refresh=refresh) if not m.is_dir]
        if limit is not None and len(objects) > limit:
            return root, objects[:limit], True
        return root, objects, False
