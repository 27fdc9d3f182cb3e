"""Parsing and validating ``cachefs://<mount>/<key>`` paths.

Validation happens on both sides: the client refuses bad paths early with a clear error,
and the worker refuses them again, because the worker is what holds the store credentials.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

from cachefs.errors import InvalidPathError

PROTOCOL = "cachefs"
MAX_KEY_BYTES = 1024  # S3's own limit on key length
_MOUNT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Percent-encoded '/', '\', '.', NUL: a store or proxy that decodes them would let a key
# escape its mount, so they are refused rather than passed through.
_ENCODED_RE = re.compile(r"%(2f|5c|2e|00)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CachePath:
    """A validated path: ``mount`` names a mount, ``key`` is relative to its root ('' = root)."""

    mount: str
    key: str

    def __str__(self) -> str:
        return f"{self.mount}/{self.key}" if self.key else self.mount

    @property
    def url(self) -> str:
        return f"{PROTOCOL}://{self}"


_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f]")


def strip_protocol(path: str) -> str:
    """``cachefs://m/k`` -> ``m/k``; also accepts paths without the protocol."""
    if not isinstance(path, str):
        raise InvalidPathError(f"path must be a string, not {type(path).__name__}")
    for prefix in (f"{PROTOCOL}://", f"{PROTOCOL}::"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    return path.lstrip("/")


def validate_mount_name(mount: str) -> str:
    if not _MOUNT_RE.match(mount) or mount in (".", ".."):
        raise InvalidPathError(
            f"invalid mount name {mount!r}: use 1-63 letters, digits, '_', '-', '.', starting with a letter or digit"
        )
    return mount


def validate_key(key: str) -> str:
    """Return ``key`` normalised (trailing '/' dropped) or raise :class:`InvalidPathError`."""
    if "\x00" in key:
        raise InvalidPathError("key contains a NUL character")
    if _CONTROL_RE.search(key):  # exactly Unicode's Cc category: U+0000-001F, U+007F-009F
        raise InvalidPathError(f"key contains a control character: {key!r}")
    if "\\" in key:
        raise InvalidPathError(f"key contains a backslash: {key!r}")
    if _ENCODED_RE.search(key):
        raise InvalidPathError(f"key contains an encoded separator or dot: {key!r}")
    if key.startswith("/"):
        raise InvalidPathError(f"key must be relative to its mount: {key!r}")
    key = key.rstrip("/")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidPathError(f"key is longer than {MAX_KEY_BYTES} bytes")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPathError(f"key is not valid UTF-8: {key!r}") from exc
    if key:
        for part in key.split("/"):
            if part in ("", ".", ".."):
                raise InvalidPathError(f"key escapes or is not normalised ({part!r} component): {key!r}")
        # Look-alikes ('\u2025', full-width dots and slashes) become '..' or '/' under NFKC:
        # a store or proxy that normalises keys would see a path that escapes the mount.
        folded = key if key.isascii() else unicodedata.normalize("NFKC", key)  # ASCII is NFKC already
        if folded != key and ("\\" in folded or any(p in ("", ".", "..") for p in folded.split("/"))):
            raise InvalidPathError(f"key has Unicode look-alikes of '.', '/' or '\\' that escape when normalised: {key!r}")
    return key


@functools.lru_cache(maxsize=1 << 16)
def parse_path(path: str) -> CachePath:
    """Parse ``cachefs://mount/key`` (or ``mount/key``) into a validated :class:`CachePath`.

    Memoised (a CachePath is immutable; a refused path raises every time): every read parses its
    path on both sides, and a training epoch asks for the same paths again and again."""
    bare = strip_protocol(path)
    if not bare:
        raise InvalidPathError("path names no mount: expected cachefs://<mount>/<key>")
    mount, _, key = bare.partition("/")
    return CachePath(validate_mount_name(mount), validate_key(key))
