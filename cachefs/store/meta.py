"""What the cache knows about one object: its own module so that the metadata table and the
store adapter can both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from cachefs.paths import CachePath


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """Size and *version* of an object (or a directory) in its store; the version is part of
    every cached page's identity, so a changed object never shares pages with the old one."""

    path: CachePath
    size: int
    version: str
    mtime: float
    is_dir: bool = False
