"""What the master lets a mount point at: URL schemes, local directories, store endpoints.

Anyone who may call ``AddMount`` chooses what every worker (and the master) opens and serves
to every client: with no policy, ``cachefs mount evil /etc`` served the workers' /etc, and
``http://169.254.169.254/...`` the instance role's credentials. The master therefore allows:

- remote stores by URL scheme (``allowed_schemes``; default the object stores: S3, GCS, Azure);
- local directories (``file://`` or a plain path) only at or under ``allowed_local_roots``
  (compared by realpath, so a symlink into /etc is refused), plus the local directories of the
  mounts the operator configured the master with (``--mount``, ``mounts`` in its file:
  ``cachefs local --mount data=/dir`` allows /dir and below);
- no store endpoint (``endpoint_url`` in the options) at a link-local or cloud metadata address.

The same check runs on ``AddMount`` and on every mount read back from the durable state (SQLite
or etcd): one that fails it (say, added before this policy, or outside a root since removed) is
kept in the state but not served (see :class:`PolicedState`) and is logged once.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from cachefs.mounts import MountSpec

log = logging.getLogger(__name__)

#: The object stores fsspec knows, with their aliases: what a mount may use by default.
DEFAULT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs")
#: Schemes that are the local file system (governed by allowed_local_roots, never by scheme).
LOCAL_SCHEMES = ("file", "local")
#: Host names of cloud instance-metadata services (their addresses are link-local as well).
_METADATA_HOSTS = {"metadata.google.internal", "metadata.goog", "metadata", "instance-data",
                   "instance-data.ec2.internal"}


class MountRefusedError(PermissionError):
    """A mount the master's policy does not allow (sent as PERMISSION_DENIED, message as is)."""


def _local_path(url: str) -> str | None:
    """The absolute local path of a ``file://``/``local://``/plain-path URL, else None."""
    from fsspec.core import split_protocol

    protocol, _ = split_protocol(url)
    if protocol is not None and protocol not in LOCAL_SCHEMES:
        return None
    from fsspec.implementations.local import LocalFileSystem

    return os.path.abspath(LocalFileSystem._strip_protocol(url))


def _has_userinfo(url: str) -> bool:
    if "://" not in url:
        return False
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:
        return True  # not a URL anyone can read: refused as if it held credentials


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _endpoints(options: Mapping[str, Any]) -> Iterable[str]:
    """Every endpoint URL an option tree names (s3fs: ``endpoint_url``, ``client_kwargs``...)."""
    for name, value in options.items():
        if isinstance(value, Mapping):
            yield from _endpoints(value)
        elif isinstance(value, str) and "endpoint" in str(name).lower():
            yield value


def _metadata_host(endpoint: str) -> str | None:
    """The host of ``endpoint`` if it is a link-local or instance-metadata address, else None."""
    try:
        host = (urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}").hostname or "").lower()
    except ValueError:
        return None
    if host.rstrip(".") in _METADATA_HOSTS:
        return host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    if address.is_link_local or address == ipaddress.ip_address("fd00:ec2::254"):
        return host
    return None


class MountPolicy:
    """The master's mount rules (MasterConfig.allowed_schemes / allowed_local_roots)."""

    def __init__(self, schemes: Iterable[str] = DEFAULT_SCHEMES, local_roots: Iterable[str] = (),
                 configured: Iterable[MountSpec] = ()) -> None:
        self.schemes = tuple(s.lower() for s in schemes)
        roots = [os.path.realpath(r) for r in local_roots]
        # The operator's own mounts (the master's config): their URLs are allowed whatever their
        # scheme, and their local directories are roots themselves.
        self.configured = frozenset((spec.name, spec.url) for spec in configured)
        for spec in configured:
            path = _local_path(spec.url)
            if path is not None:
                roots.append(os.path.realpath(path))
        self.local_roots = tuple(dict.fromkeys(roots))

    @classmethod
    def from_config(cls, config: Any) -> "MountPolicy":
        return cls(config.allowed_schemes, config.allowed_local_roots, config.mounts)

    def check(self, spec: MountSpec) -> None:
        """Raise :class:`MountRefusedError` naming the setting if ``spec`` is not allowed."""
        name = spec.name
        operators = (spec.name, spec.url) in self.configured
        for part in spec.url.split("::") if not operators else ():  # chained URLs: every link
            if _has_userinfo(part):
                raise MountRefusedError(f"mount {name!r}: credentials in the URL (user info): put them in the "
                                        "mount's options, which are never shown")
            path = _local_path(part)
            if path is not None:
                real = os.path.realpath(path)
                if not any(_under(real, root) for root in self.local_roots):
                    shown = path if real == path else f"{path} (really {real})"
                    now = ", ".join(self.local_roots) or "none"
                    raise MountRefusedError(
                        f"mount {name!r}: local path {shown} is not under allowed_local_roots "
                        f"(master setting allowed_local_roots, CACHEFS_MASTER_ALLOWED_LOCAL_ROOTS; now: {now})")
                continue
            from fsspec.core import split_protocol

            scheme = (split_protocol(part)[0] or "").lower()
            if "*" not in self.schemes and scheme not in self.schemes:
                raise MountRefusedError(
                    f"mount {name!r}: URL scheme {scheme!r} is not allowed (master setting allowed_schemes, "
                    f"CACHEFS_MASTER_ALLOWED_SCHEMES; now: {', '.join(self.schemes) or 'none'})")
        for endpoint in _endpoints(spec.options):
            host = _metadata_host(endpoint)
            if host is not None:
                raise MountRefusedError(f"mount {name!r}: an endpoint at {host} (link-local, an instance "
                                        "metadata service) is never allowed")

    def allows(self, spec: MountSpec) -> bool:
        try:
            self.check(spec)
        except MountRefusedError:
            return False
        return True

    @staticmethod
    def pinned(spec: MountSpec) -> MountSpec:
        """``spec`` with a local path replaced by its realpath (what :meth:`check` compared): the
        workers and the master's catalog mount exactly that, and refuse it if a symlink has been
        swapped in on its path since (MountTable.add(exact_root=True))."""
        path = _local_path(spec.url) if "::" not in spec.url else None
        if path is None:
            return spec
        real = os.path.realpath(path)
        return spec if real == spec.url else MountSpec(spec.name, real, spec.options, spec.read_only)


class PolicedState:
    """The master's state as the rest of the master sees it: mounts the policy refuses are left
    out, local ones are served by the realpath the policy checked (:meth:`MountPolicy.pinned`).

    Everything else is the wrapped state's (writes included: AddMount checks before writing, and
    a refused mount can still be removed or replaced). Each refused mount is logged once.
    """

    def __init__(self, state: Any, policy: MountPolicy) -> None:
        self._state = state
        self.policy = policy
        self._lock = threading.Lock()
        self._served: dict[tuple[str, str, str], MountSpec | None] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def _serve(self, spec: MountSpec) -> MountSpec | None:
        key = (spec.name, spec.url, json.dumps(spec.options, sort_keys=True, default=str))
        with self._lock:
            if key in self._served:
                return self._served[key]
        try:
            self.policy.check(spec)
            served: MountSpec | None = self.policy.pinned(spec)
        except MountRefusedError as exc:
            log.error("not serving %s: %s", spec.name, exc)
            served = None
        with self._lock:
            if len(self._served) > 10_000:
                self._served.clear()
            self._served[key] = served
        return served

    def mounts(self) -> tuple[int, list[MountSpec]]:
        version, specs = self._state.mounts()
        return version, [s for s in map(self._serve, specs) if s is not None]
