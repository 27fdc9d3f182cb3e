"""What the cache knows about one object: its own module so that the metadata table and the
store adapter can both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

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


#: A listing entry as a store that makes them itself gives it (the local walk, localpages.py):
#: (store name, size, version, mtime, is_dir), where fsspec stores give an info dict to be read
#: field by field (backends.version_of). A version of None: the one derived from size and mtime
#: (a local store's, ``f"{size}-{mtime!r}"``). A plain tuple: a million are made per
#: million-object listing.
ListedEntry = tuple[str, int, Union[str, None], float, bool]
Listing = list[Union[ListedEntry, dict]]
