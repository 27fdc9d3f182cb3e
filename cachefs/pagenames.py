"""Where a cached page lives, computed the same way by the worker and by a client on its host.

The page store names a page file by a digest of (mount, key, version, page index) and puts it
in the cache dir that wins weighted rendezvous hashing of that digest. A client on the worker's
host that runs as the worker's user (the dirs are mode 0700) can compute the same path and open
the page file itself, with no message to the worker (client/transport/namedpages.py), once it knows which
version of the object the worker vouches for. The worker publishes that in the *name index*, a
memfd it hands each local client (server/worker/names.py writes it, clients map it read-only).

Name index layout (little-endian): a 64-byte header (magic, slots, entry size), then ``slots``
entries of 128 bytes, an object's entry in one of ``PROBES`` slots (``probe_slots``: double
hashing from ``hash(path) % slots``, so that crowded slots do not make crowded windows). When all
of them are taken, a newer object replaces the one that runs out first: this is a cache of the
worker's knowledge, not the knowledge. (With one slot per path, 2,000 objects in 65,536 slots
left ~1.5% of them out, and each batch that met one asked the worker for the next batch's
descriptors.) Each entry is written under a sequence count (odd while the worker writes it),
so a reader that sees the count change, or odd, treats the entry as absent. A torn read the count misses could only
produce a page name that does not exist or a length the page's trailer refuses. A table that
fills up (a new entry would push out one still valid) is replaced by one four times larger, up
to the worker's ``name_index_max_slots``: the live entries are copied over and the old table's
header marked superseded, which readers check before each lookup (they then ask for the new
one with their next message). The header also carries the stale window: how long past an
entry's time a client may go on reading by name (the worker's metadata stale grace), naming the
objects it read that way in its next message so that the worker refreshes them.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterator

import xxhash

__all__ = [
    "ENTRY",
    "NAMES_HEADER",
    "NAMES_MAGIC",
    "PROBES",
    "STALE_WINDOW",
    "STALE_WINDOW_AT",
    "SUPERSEDED",
    "SUPERSEDED_AT",
    "VERSION_BYTES",
    "dir_score",
    "name_hashes",
    "raw_name_hashes",
    "page_digest",
    "page_file",
    "path_page_digest",
    "pick_dir",
    "probe_offsets",
    "probe_slots",
]

DIGEST_DOMAIN = b"cachefs-page-v1\0"
PAGES_SUBDIR = "pages"


def _lp(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return len(raw).to_bytes(4, "little") + raw


@functools.lru_cache(maxsize=4096)
def object_prefix(mount: str, key: str, version: str) -> bytes:
    """The digest input common to an object's pages (an object's pages are looked up together)."""
    return DIGEST_DOMAIN + _lp(mount) + _lp(key) + _lp(version)


def page_digest(mount: str, key: str, version: str, index: int) -> str:
    """Stable 32-hex-digit name: xxh3_128 over length-prefixed fields (never Python's hash())."""
    return xxhash.xxh3_128_hexdigest(object_prefix(mount, key, version) + index.to_bytes(8, "little"))


def path_page_digest(path: bytes, version: bytes, index: int) -> xxhash.xxh3_128:
    """``page_digest`` of a canonical ``mount/key`` path and a version given as UTF-8 bytes (a
    name index entry's own), as the hash object (``hexdigest()``, ``digest()``): the warm read
    path names a page with no str round trip. Mount names hold no "/"."""
    mount, _, key = path.partition(b"/")
    return xxhash.xxh3_128(DIGEST_DOMAIN + len(mount).to_bytes(4, "little") + mount + len(key).to_bytes(4, "little")
                           + key + len(version).to_bytes(4, "little") + version + index.to_bytes(8, "little"))


def dir_score(digest: str, root: str, quota: int) -> float:
    """Weighted rendezvous score: the dir with the highest score holds the page."""
    h = xxhash.xxh3_64_intdigest(f"{digest}\0{root}".encode("utf-8", "surrogatepass"))
    u = ((h >> 11) + 0.5) / float(1 << 53)  # uniform in the open interval (0, 1)
    return -quota / math.log(u)


def pick_dir(digest: str, dirs: list[tuple[str, int]]) -> str:
    """The root, among ``(root, quota)``, that holds the page ``digest``."""
    if len(dirs) == 1:
        return dirs[0][0]
    return max(dirs, key=lambda d: dir_score(digest, d[0], d[1]))[0]


def page_file(root: str, digest: str) -> str:
    return f"{root}/{PAGES_SUBDIR}/{digest[:2]}/{digest}"  # os.path.join's generality costs ~5 us a page


# -- the name index -------------------------------------------------------------------------------
NAMES_MAGIC = 0x31534D414E534643  # b"CFSNAMS1" little-endian
NAMES_HEADER = struct.Struct("<QQQQ32x")  # magic, slots, entry size, superseded; 64 bytes
SUPERSEDED = struct.Struct("<Q")  # at SUPERSEDED_AT: nonzero once the worker moved to a larger table
SUPERSEDED_AT = 24
# At STALE_WINDOW_AT (in the header's spare bytes; 0 in a table of an older worker): nanoseconds
# past an entry's time during which a client may still read by name, as the worker itself serves
# metadata past its TTL within the stale grace, if it tells the worker (which refreshes it).
STALE_WINDOW = struct.Struct("<Q")
STALE_WINDOW_AT = 32
VERSION_BYTES = 72  # an object whose version is longer is not published (read through messages)
# Slots a path's entry may be in (probe_slots; readers look at all of them, a found entry at the
# first probes mostly). With the worker moving an entry within its own window to make room, 8
# fill a table to ~3/4 before it grows (4 grew it to ~1/5: 512 MiB for 200,000 objects). A
# client of an older release looks at the first 4 only: it asks the worker for the others.
PROBES = 8
# seq, path hash, path check, size, valid until (CLOCK_MONOTONIC ns), mtime, version length, 4
# bytes of the worker's own (server/worker/names.py's GEN_AT: clients skip them), version
ENTRY = struct.Struct(f"<QQQQqdI4x{VERSION_BYTES}s")
SEQ = struct.Struct("<Q")
_CHECK_SEED = 0x9E3779B97F4A7C15


def name_hashes(path: str) -> tuple[int, int]:
    """(hash, check) of an object's path: the hash picks the slot, both must match."""
    return raw_name_hashes(path.encode("utf-8", "surrogatepass"))


def raw_name_hashes(raw: bytes) -> tuple[int, int]:
    """``name_hashes`` of a path given as UTF-8 bytes."""
    return xxhash.xxh3_64_intdigest(raw), xxhash.xxh3_64_intdigest(raw, seed=_CHECK_SEED)


def probe_slots(h: int, check: int, slots: int) -> list[int]:
    """The slots ``path``'s entry may be in (``h, check = name_hashes(path)``), in the order both
    sides look: ``h % slots``, then steps of an odd stride taken from ``check``."""
    return [(off - NAMES_HEADER.size) // ENTRY.size for off in probe_offsets(h, check, slots)]


def probe_offsets(h: int, check: int, slots: int) -> Iterator[int]:
    """The byte offsets of ``probe_slots`` in a table of ``slots``, made as they are looked at
    (a found entry is at its first slot mostly: a lookup need not work out all of them)."""
    slot, step = h % slots, (check % slots) | 1 if slots > 1 else 0
    for _ in range(min(PROBES, slots)):
        yield NAMES_HEADER.size + slot * ENTRY.size
        slot = (slot + step) % slots
