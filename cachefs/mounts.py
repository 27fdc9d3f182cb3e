"""The mount table: mount name -> fsspec URL plus options.

Mount options may hold object-store credentials. They stay in the process that owns the
table (worker, later the master): :meth:`MountSpec.public` is the only view that leaves it.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachefs.errors import InvalidPathError, UnknownMountError, WorkerUnavailableError
from cachefs.paths import CachePath, validate_mount_name

if TYPE_CHECKING:
    import fsspec

# fsspec is imported when a mount is opened (MountTable.add), not here: the configs hold
# MountSpecs, and loading a config must not load fsspec.

# Option names (at any depth) whose values are secrets and never leave the daemon.
_SECRET_MARKERS = ("secret", "password", "passwd", "pwd", "pass", "token", "key", "credential", "session", "auth",
                   "passphrase", "connection_string",  # the last: Azure's holds the account key
                   "cookie", "signature", "bearer", "private", "sas")
_NOT_SECRET = {"endpoint_url", "region_name", "anon", "use_ssl", "requester_pays"}
# Option names whose whole value is hidden (a proxy URL may carry credentials in any part of it).
_HIDDEN = {"proxies", "proxy", "proxy_url", "proxy_headers", "https_proxy", "http_proxy"}
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]*@")
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&#;\s]+)=(?P<value>[^&#;\s]*)")
_SECRET_PARAMS = {"sig", "x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature",
                  "x-goog-credential"}


def _is_secret(name: str) -> bool:
    lname = name.lower()
    return lname not in _NOT_SECRET and any(m in lname for m in _SECRET_MARKERS)


def public_url(url: str) -> str:
    """``url`` without credentials: user info (``https://user:pass@host`` -> ``https://***@host``)
    and secret-looking query parameters (signatures, tokens: ``?sig=...`` -> ``?sig=***``)."""
    if "@" in url:
        url = _USERINFO.sub(r"\g<scheme>***@", url)
    if "=" in url:
        url = _QUERY_PARAM.sub(lambda m: m.group(0) if not (_is_secret(m.group("name"))
                                                            or m.group("name").lower() in _SECRET_PARAMS)
                               else f"{m.group('sep')}{m.group('name')}=***", url)
    return url


def _redact_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return redact(value)
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], str) and _is_secret(value[0]):
            return [value[0], "***"]  # a (name, value) pair: headers as a list, say
        return [_redact_value(v) for v in value]
    if isinstance(value, str):
        return public_url(value)
    return value


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` without any secret-looking entry, recursively through mappings,
    lists and tuples; URLs lose their user info and secret query parameters; proxies are hidden."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if _is_secret(str(name)):
            continue
        out[name] = "***" if str(name).lower() in _HIDDEN else _redact_value(value)
    return out


@dataclass(frozen=True)
class MountSpec:
    name: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    read_only: bool = False

    def __post_init__(self) -> None:
        validate_mount_name(self.name)
        if not self.url or not isinstance(self.url, str):
            raise ValueError(f"mount {self.name!r}: url is empty")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"mount {self.name!r}: options must be a mapping")

    def public(self) -> dict[str, Any]:
        """What a client may see: URL and non-secret options, never credentials."""
        return {"name": self.name, "url": public_url(self.url), "options": redact(self.options),
                "read_only": self.read_only}

    def __repr__(self) -> str:  # never print credentials in logs
        return f"MountSpec(name={self.name!r}, url={public_url(self.url)!r}, read_only={self.read_only})"

    @classmethod
    def parse(cls, value: Any, name: str | None = None) -> "MountSpec":
        """From ``"NAME=URL"``, or a mapping with url/options/read_only (and name)."""
        if isinstance(value, MountSpec):
            return value
        if isinstance(value, str):
            if name is None:
                name, sep, value = value.partition("=")
                if not sep:
                    raise ValueError(f"mount {name!r}: expected NAME=URL")
            return cls(name, value)
        if isinstance(value, Mapping):
            return cls(
                name=str(value.get("name", name)),
                url=str(value["url"]),
                options=dict(value.get("options", {})),
                read_only=bool(value.get("read_only", False)),
            )
        raise ValueError(f"cannot parse mount from {value!r}")

    @classmethod
    def parse_many(cls, value: Any) -> list["MountSpec"]:
        """A list of mounts, or a ``{name: url-or-table}`` mapping (TOML's natural shape)."""
        if isinstance(value, Mapping):
            return [cls.parse(v, name=k) for k, v in value.items()]
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        return [cls.parse(v) for v in value]


# botocore's defaults (legacy mode: 5 attempts with backoff, 60 s connect timeout) make a read
# against a store that refuses connections take ~10 s before it fails; a cache must fail fast
# and let its breaker (cachefs/store/health.py) take over. A mount's own config_kwargs win.
_S3_CLIENT_DEFAULTS = {"connect_timeout": 3, "retries": {"max_attempts": 2, "mode": "standard"}}


def _with_store_defaults(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(options)
    if url.split("://", 1)[0] in ("s3", "s3a"):
        out["config_kwargs"] = {**_S3_CLIENT_DEFAULTS, **dict(out.get("config_kwargs") or {})}
    return out


@dataclass(frozen=True)
class ResolvedPath:
    """Where a :class:`CachePath` lives in its object store."""

    spec: MountSpec
    fs: fsspec.AbstractFileSystem
    store_path: str


class MountTable:
    """Thread-safe mount registry that opens each mount's filesystem once."""

    def __init__(self, specs: Iterable[MountSpec] = ()) -> None:
        self._lock = threading.Lock()
        # name -> (spec, its filesystem, root in it, whether that is the local file system)
        self._mounts: dict[str, tuple[MountSpec, fsspec.AbstractFileSystem, str, bool]] = {}
        # Set while the table still waits for its source (a worker's master: why, in words). A
        # mount not here yet is then the worker's fault, not the request's: a worker restarted on
        # its port is sent reads at once by clients that knew it, before its first mount sync, and
        # they must go to the next worker rather than fail with "no mount named".
        self.awaiting = ""
        for spec in specs:
            self.add(spec)

    def add(self, spec: MountSpec, exact_root: bool = False) -> None:
        """Open ``spec``'s filesystem. A local root is taken by its realpath; with ``exact_root``
        (mounts from the master, which hands out realpaths it checked: cachefs/mountpolicy.py)
        a root that is not its own realpath now (a symlink swapped in since) is refused."""
        import fsspec.core
        from fsspec.implementations.local import LocalFileSystem

        fs, root = fsspec.core.url_to_fs(spec.url, **_with_store_defaults(spec.url, spec.options))
        root = root.rstrip("/")
        local = isinstance(fs, LocalFileSystem)
        if local:
            real = os.path.realpath(root)
            if exact_root and real != os.path.normpath(os.path.abspath(root or "/")):
                raise InvalidPathError(f"mount {spec.name!r}: its local path {root} now leads to {real} (a symbolic "
                                       "link on the way): not mounted")
            root = real
        with self._lock:
            self._mounts[spec.name] = (spec, fs, root, local)

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._mounts.pop(name, None) is not None

    def specs(self) -> list[MountSpec]:
        with self._lock:
            return [entry[0] for entry in self._mounts.values()]

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._mounts

    def resolve(self, path: CachePath) -> ResolvedPath:
        with self._lock:
            entry = self._mounts.get(path.mount)
        if entry is None:
            awaiting = self.awaiting
            if awaiting:
                raise WorkerUnavailableError(f"no mount named {path.mount!r} here yet: {awaiting}")
            raise UnknownMountError(f"no mount named {path.mount!r}")
        spec, fs, root, local = entry
        if local:
            # A symlink inside a local mount must not lead outside it: the local backend opens
            # the key beneath the root and follows no symlink (cachefs/store/beneath.py), rather
            # than checking a realpath that may change before the open.
            from cachefs.store.beneath import LocalStorePath

            return ResolvedPath(spec, fs, LocalStorePath(root, path.key))
        store_path = f"{root}/{path.key}" if path.key else root
        return ResolvedPath(spec, fs, store_path)

    def to_key(self, path: CachePath, store_path: str) -> str:
        """Inverse of :meth:`resolve` for listing results: store path -> key in the mount."""
        with self._lock:
            _, fs, root, _ = self._mounts[path.mount]
        store_path = fs._strip_protocol(store_path).rstrip("/")
        if store_path == root:
            return ""
        if not store_path.startswith(root + "/"):
            raise InvalidPathError(f"{store_path!r} is outside mount {path.mount!r}")
        return store_path[len(root) + 1:]
