"""A listing's entries held as columns, not an object each (#46).

A chunk of a listing is kept for every lister of its prefix (listings.py) and a million-object
prefix is a thousand chunks: as ``ObjectMeta`` objects (with their ``CachePath`` and strings)
an entry took ~390 bytes, so the cache's bound held only part of such a listing and a second
``ls`` of it went back to the store. Here an entry is its key's UTF-8 bytes in one blob, its
version's in another (none where the version is the size and mtime a local store derives),
and its size, mtime and kind in arrays: ~50 bytes for a 25-byte key. ``ObjectMeta`` objects are
made when asked for, a page of them at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from cachefs.paths import CachePath
from cachefs.store.meta import ObjectMeta

_DIR, _DERIVED = 1, 2  # flags: a directory; the version is f"{size}-{mtime!r}" (nothing stored)
_FIXED = 4 + 4 + 8 + 8 + 1  # per entry: key and version offsets, size, mtime, flags


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # an unvalidated store name is kept exactly


class ListedEntries(Sequence[ObjectMeta]):
    """The entries of one listing of one mount, sorted by name (``str(path)``)."""

    __slots__ = ("mount", "_keys", "_key_at", "_versions", "_version_at", "_sizes", "_mtimes", "_flags")

    def __init__(self, mount: str) -> None:
        self.mount = mount
        self._keys, self._key_at = bytearray(), array("I", [0])
        self._versions, self._version_at = bytearray(), array("I", [0])
        self._sizes, self._mtimes, self._flags = array("q"), array("d"), bytearray()

    # -- building ------------------------------------------------------------------------------------
    def add(self, key: str, size: int, version: str | None, mtime: float, is_dir: bool) -> None:
        """Append one entry (callers add them in name order). A version of None is the one
        derived from size and mtime (a local store's)."""
        self._keys += _bytes(key)
        self._key_at.append(len(self._keys))
        flags = _DIR if is_dir else 0
        if version is None or version == f"{size}-{mtime!r}":
            flags |= _DERIVED
        elif version:
            self._versions += _bytes(version)
        self._version_at.append(len(self._versions))
        self._sizes.append(size)
        self._mtimes.append(mtime)
        self._flags.append(flags)

    @classmethod
    def of(cls, mount: str, metas: Sequence[ObjectMeta]) -> "ListedEntries":
        """``metas`` (of ``mount``) in name order."""
        out = cls(mount)
        for m in sorted(metas, key=lambda m: str(m.path)):
            if m.path.mount != mount:
                raise ValueError(f"a listing of mount {mount!r} holds {m.path}")
            out.add(m.path.key, m.size, m.version, m.mtime, m.is_dir)
        return out

    # -- reading -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._flags)

    def key(self, i: int) -> str:
        return self._keys[self._key_at[i]:self._key_at[i + 1]].decode("utf-8", "surrogatepass")

    def name(self, i: int) -> str:
        """``str(path)`` of entry ``i``: what a listing is ordered and paged by."""
        key = self.key(i)
        return f"{self.mount}/{key}" if key else self.mount

    def is_dir(self, i: int) -> bool:
        return bool(self._flags[i] & _DIR)

    def fields(self, i: int) -> tuple[str, int, str, float, bool]:
        """(key, size, version, mtime, is_dir) of entry ``i``, no object made for it."""
        flags, size, mtime = self._flags[i], self._sizes[i], self._mtimes[i]
        if flags & _DERIVED:
            version = f"{size}-{mtime!r}"
        else:
            version = self._versions[self._version_at[i]:self._version_at[i + 1]].decode("utf-8", "surrogatepass")
        return self.key(i), size, version, mtime, bool(flags & _DIR)

    def named_fields(self, i: int) -> tuple[str, int, str, float, bool]:
        """``fields`` with the entry's name (``str(path)``) for its key: what a listing's message holds."""
        key, size, version, mtime, is_dir = self.fields(i)
        return f"{self.mount}/{key}" if key else self.mount, size, version, mtime, is_dir

    def _meta(self, i: int) -> ObjectMeta:
        key, size, version, mtime, is_dir = self.fields(i)
        return ObjectMeta(CachePath(self.mount, key), size, version, mtime, is_dir)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._meta(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("listing entry out of range")
        return self._meta(i)

    def __iter__(self) -> Iterator[ObjectMeta]:
        return (self._meta(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ListedEntries, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def names(self) -> "Names":
        return Names(self)

    def digest(self) -> bytes:
        """A 128-bit digest of every entry (names, sizes, versions, mtimes, kinds): two listings
        with the same digest list the same objects at the same versions."""
        h = xxhash.xxh3_128(self.mount.encode("utf-8", "surrogatepass") + b"\0")
        for column in (self._keys, self._key_at, self._versions, self._version_at, self._sizes, self._mtimes,
                       self._flags):
            h.update(len(column).to_bytes(8, "little"))
            h.update(column)
        return h.digest()

    @property
    def nbytes(self) -> int:
        """What the entries hold (their arrays' allocations, roughly)."""
        return len(self._keys) + len(self._versions) + len(self) * _FIXED

    def __repr__(self) -> str:
        return f"ListedEntries({self.mount!r}, {len(self)} entries)"


class ListedObjects:
    """The objects (not directories) of a listing, as a container of their paths: what the
    revalidator asks of a directory it listed (was this object in it?), by key, with no
    ``ObjectMeta`` or ``CachePath`` made per entry."""

    __slots__ = ("mount", "_keys")

    def __init__(self, listing: Sequence[ObjectMeta]) -> None:
        if isinstance(listing, ListedEntries):
            self.mount = listing.mount
            self._keys = {listing.key(i) for i in range(len(listing)) if not listing.is_dir(i)}
        else:
            self.mount = listing[0].path.mount if len(listing) else ""
            self._keys = {m.path.key for m in listing if not m.is_dir}

    def __contains__(self, path: object) -> bool:
        return isinstance(path, CachePath) and path.mount == self.mount and path.key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class Names(Sequence[str]):
    """The entries' names (``str(path)``), made when asked for: bisect works on it."""

    __slots__ = ("_entries",)

    def __init__(self, entries: ListedEntries) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: Any) -> Any:
        n = len(self._entries)
        if isinstance(i, slice):
            return [self._entries.name(j) for j in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("listing name out of range")
        return self._entries.name(i)


@dataclass(frozen=True)
class Relisted:
    """A whole listing as its listener hears of it: what was listed (its path), the listing's
    digest (``ListedEntries.digest``), and whether it is the same as the last listing of that
    path, so that what was made of that one (metadata, name entries) is extended, not made again."""

    listing: Hashable
    digest: bytes
    unchanged: bool
