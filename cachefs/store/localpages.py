"""A local mount's listing a page at a time, in key order, from any name (#46).

The worker cuts a listing's pages from chunks of the store's listing (listings.py); for a local
mount a chunk is the next ``limit`` entries after a key, found by walking directories in the
order of the keys they give: each directory's entries sorted by name, a directory walked into as
its name and "/" (every key below it starts so: "a-b" < "a.b/c" < "a/b", since '-' and '.' sort
before '/'). Directories whose keys all sort before the name are skipped unread, and within a
directory the walk starts by bisection, so a chunk costs about a chunk of reading wherever it
starts: a million files in 1,000 directories give their first 1,000 after reading two.

A directory of many entries (a flat data set) would be read and sorted again for each chunk of
it: its sorted names are kept, by its inode and modification time, for a short while.
Like every local listing, nothing here follows a symlink (beneath.py).
"""

from __future__ import annotations

import bisect
import os
import stat
import threading
import time
from collections import OrderedDict

from cachefs.store.beneath import LocalStorePath, _entry_info, _open_dir, stat_beneath
from cachefs.store.meta import Listing

#: Directories with more entries than this keep their sorted names between chunks (a chunk of
#: 1,000 entries reads its directory's parent again, and usually two directories of 1,000).
KEEP_ABOVE = 256
#: Names kept in all (about 80 bytes each), and for how long (a directory changed within one
#: timestamp tick of its last read is seen when this runs out).
KEEP_NAMES = 2_000_000
KEEP_SECONDS = 30.0

_kept_lock = threading.Lock()
_kept: OrderedDict[tuple[int, int, int, bool], tuple[float, list[str]]] = OrderedDict()
_kept_names = 0


def _read_sorted(dir_fd: int, recursive: bool) -> list[str]:
    """A directory's names, sorted as the keys they give (a directory entered: its name and "/")."""
    out = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            try:
                enter = recursive and entry.is_dir(follow_symlinks=False)  # the entry's type: no stat
            except OSError:  # gone meanwhile
                continue
            out.append(entry.name + "/" if enter else entry.name)
    out.sort()
    return out


def sorted_names(dir_fd: int, recursive: bool) -> list[str]:
    """``_read_sorted``, kept for large directories while they are unchanged."""
    global _kept_names
    st = os.fstat(dir_fd)
    key = (st.st_dev, st.st_ino, st.st_mtime_ns, recursive)
    now = time.monotonic()
    with _kept_lock:
        found = _kept.get(key)
        if found is not None and found[0] > now:
            _kept.move_to_end(key)
            return found[1]
    names = _read_sorted(dir_fd, recursive)
    if len(names) > KEEP_ABOVE:
        with _kept_lock:
            old = _kept.pop(key, None)
            _kept_names -= len(old[1]) if old else 0
            _kept[key] = (now + KEEP_SECONDS, names)
            _kept_names += len(names)
            while _kept_names > KEEP_NAMES and len(_kept) > 1:
                _kept_names -= len(_kept.popitem(last=False)[1][1])
    return names


def _walk_after(dir_fd: int, base: str, rel: str, after: str, limit: int, recursive: bool,
                out: Listing) -> bool:
    """Appends to ``out`` (up to ``limit``) the entries of the directory ``dir_fd`` (store path
    ``base``, keys ``rel``... below the listed path) whose keys sort after ``after``, in key
    order, entering directories if ``recursive``; True if nothing is left after them."""
    names = sorted_names(dir_fd, recursive)
    # Walked into only when ``after`` is below this directory or sorts before all of it.
    local = after[len(rel):] if after.startswith(rel) else ""
    start = bisect.bisect_right(names, local)
    if start and names[start - 1].endswith("/") and local.startswith(names[start - 1]):
        start -= 1  # ``after`` is inside that directory: resume in it
    for sort_name in names[start:]:
        key = rel + sort_name
        name = sort_name.rstrip("/")
        if sort_name.endswith("/"):
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:  # swapped for a link or removed meanwhile: not entered
                continue
            try:
                if not _walk_after(child, f"{base}/{name}", key, after, limit, recursive, out):
                    return False
            finally:
                os.close(child)
            continue
        if key <= after:
            continue
        if len(out) >= limit:
            return False
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:  # removed since the directory was read
            continue
        if recursive and stat.S_ISDIR(st.st_mode):
            continue  # a file swapped for a directory meanwhile: a recursive listing has no directories
        if stat.S_ISDIR(st.st_mode):  # a directory of a listing that is not recursive
            out.append((f"{base}/{name}", 0, "", st.st_mtime, True))
        else:
            out.append((f"{base}/{name}", st.st_size, None, st.st_mtime, False))  # version: local_version(st)
    return True


def page_after(path: LocalStorePath, recursive: bool, after: str, limit: int) -> tuple[Listing, bool]:
    """Up to ``limit`` entries of ``list_beneath`` (``find_beneath`` if ``recursive``) whose keys
    below ``path`` sort after ``after`` ("": from the first), in key order, and whether they are
    the last ones. Files come as ``ListedEntry`` tuples (their version None: derived from size and
    mtime, as the local backend's), not info dicts: no dict per entry, none read back field by field."""
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        if recursive:
            return [], True  # as find_beneath
        raise
    if fd is None:  # a file: listed as itself
        return ([] if after else [_entry_info(str(path), stat_beneath(path))]), True
    out: Listing = []
    try:
        done = _walk_after(fd, str(path), "", after, limit, recursive, out)
    finally:
        os.close(fd)
    return out, done
