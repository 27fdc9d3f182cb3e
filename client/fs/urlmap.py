"""URL chaining: ``cachefs::s3://bucket/key`` reaches the same cached data as ``cachefs://mount/key``.

fsspec gives a chained filesystem the inner URL's protocol (``target_protocol``) and the
inner path. The path is mapped onto the mount whose store URL is the longest prefix of it
(``s3://bucket/root`` holds ``s3://bucket/root/a/b`` as key ``a/b``); protocols that name
the same fsspec class (``s3``/``s3a``) are the same store. Names the filesystem hands back
(``info``, ``ls``) are mapped back, so callers keep seeing the URLs they used.
"""

from __future__ import annotations

from collections.abc import Iterable

import fsspec
from fsspec.core import split_protocol

from cachefs.errors import UnknownMountError
from cachefs.mounts import MountSpec
from cachefs.paths import CachePath, validate_key, validate_mount_name


def _family(protocol: str) -> str:
    """A name shared by every protocol of one fsspec class (s3 and s3a are one store)."""
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):
        return protocol
    names = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    return str(names[0])


class UrlMap:
    """Store URLs of one protocol <-> cachefs paths, from the cluster's public mount table."""

    def __init__(self, protocol: str, mounts: Iterable[MountSpec]) -> None:
        self.protocol = protocol
        family = _family(protocol)
        cls = fsspec.get_filesystem_class(protocol)
        roots: list[tuple[str, str]] = []
        for spec in mounts:
            mount_protocol, _ = split_protocol(spec.url)
            if _family(mount_protocol or "file") != family:
                continue
            roots.append((cls._strip_protocol(spec.url).rstrip("/"), spec.name))
        # Longest root first: a mount of s3://b/x/y wins over one of s3://b/x for s3://b/x/y/k.
        self._roots = sorted(roots, key=lambda r: len(r[0]), reverse=True)
        self._by_mount = {name: root for root, name in roots}
        self._cls = cls

    def to_cache_path(self, path: str) -> CachePath | None:
        """The cachefs path for a store path (with or without its protocol); None under no mount."""
        bare = self._cls._strip_protocol(path).rstrip("/")
        for root, name in self._roots:
            if bare == root:
                return CachePath(validate_mount_name(name), "")
            if bare.startswith(root + "/"):
                return CachePath(validate_mount_name(name), validate_key(bare[len(root) + 1:]))
        return None

    def require(self, path: str) -> CachePath:
        cp = self.to_cache_path(path)
        if cp is None:
            known = ", ".join(f"{self.protocol}://{root} ({name})" for root, name in self._roots) or "none"
            raise UnknownMountError(
                f"{self.protocol}://{self._cls._strip_protocol(path)} is under no cachefs mount (mounts of this "
                f"store: {known}); pass unmounted='direct' to read it from the store without the cache"
            )
        return cp

    def to_store_path(self, name: str) -> str:
        """A cachefs name (``mount/key``) as the store path the caller used."""
        mount, _, key = name.partition("/")
        root = self._by_mount.get(mount)
        if root is None:
            return name
        return f"{root}/{key}" if key else root
