"""Daemon configuration: one frozen dataclass per daemon, layered defaults < file < env < flags.

Each layer is a plain dict of field name -> value (strings allowed: env vars and flags are
strings); :func:`build_config` merges them in order and the dataclass validates the result
eagerly in ``__post_init__``, so a bad value fails at start-up with the field's name, never
minutes later on the first request.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cachefs.addresses import split_address, split_addresses
from cachefs.mounts import MountSpec
from cachefs.runtimedir import cache_root, state_root
from cachefs.tls import TLSConfig

#: The worker's choices of client for S3 data reads (WorkerConfig.s3_client; cachefs/store/backends.py).
S3_CLIENTS = ("auto", "http", "obstore", "s3fs")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """``"512MiB"`` -> 536870912; ``"1GB"`` -> 10**9; ints pass through."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (examples: 1048576, 64MiB, 10GB)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    scale = base ** "bkmgtp".index(unit[0]) if unit and unit[0] != "b" else 1
    return int(number * scale)


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclass(frozen=True)
class CacheDirSpec:
    path: str
    quota_bytes: int

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("cache dir path is empty")
        if self.quota_bytes <= 0:
            raise ValueError(f"cache dir {self.path}: quota must be > 0, got {self.quota_bytes}")

    @classmethod
    def parse(cls, value: Any) -> "CacheDirSpec":
        """Accepts ``{"path": ..., "quota": "10GiB"}`` or ``"PATH:QUOTA"``."""
        if isinstance(value, CacheDirSpec):
            return value
        if isinstance(value, Mapping):
            quota = value.get("quota", value.get("quota_bytes"))
            if quota is None:
                raise ValueError(f"cache dir {value!r} has no quota")
            return cls(str(value["path"]), parse_size(quota))
        path, sep, quota = str(value).rpartition(":")
        if not sep:
            raise ValueError(f"cache dir {value!r}: expected PATH:QUOTA, e.g. /nvme/cachefs:100GiB")
        return cls(path, parse_size(quota))


def _default_cache_dir() -> tuple[CacheDirSpec, ...]:
    base = Path(cache_root()) / "pages"  # never a predictable name in /tmp (cachefs/runtimedir.py)
    return (CacheDirSpec(str(base), 8 * 1024**3),)


def _check_listen(host: str, port: int, metrics_port: int) -> None:
    if not host:
        raise ValueError("host is empty")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if not -1 <= metrics_port <= 65535:
        raise ValueError(f"metrics_port must be in [-1, 65535], got {metrics_port}")


def _check_unique_mounts(mounts: tuple[MountSpec, ...]) -> None:
    names = [m.name for m in mounts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate mount names: {names}")


def _check_tokens(config: Any, *names: str) -> None:
    """Tokens travel as gRPC metadata values: printable ASCII, no spaces (never echoed here)."""
    for name in names:
        value = getattr(config, name)
        if value and not (value.isascii() and value.isprintable() and " " not in value):
            raise ValueError(f"{name} must be printable ASCII without spaces")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (only this machine reaches it)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def _check_exposed(config: Any, daemon: str) -> None:
    """A daemon that other machines reach serves only with an access token, unless told
    ``insecure`` (as Redis's protected mode): with none, anyone who reaches the port reads,
    writes and deletes through it with the daemon's store credentials."""
    if config.access_token or config.insecure or is_loopback(config.host):
        return
    raise ValueError(f"{daemon} would serve {config.host} with no access_token: anyone who reaches it could read, "
                     f"write and delete through it. Set access_token (CACHEFS_{daemon.upper()}_ACCESS_TOKEN, or "
                     "the config file), or insecure = true (--insecure) to serve it open on purpose")


def _check_daemon_tls(config: Any) -> None:
    """A daemon's TLS settings parse, and a daemon that dials with TLS also serves with it.
    Its tokens are checked here too: the same place, the same reason (the wire)."""
    _check_tokens(config, "access_token", "cluster_token")
    tls = TLSConfig.from_fields(config)
    if tls.enabled and not tls.cert_file:
        raise ValueError("tls_ca_file is set but tls_cert_file/tls_key_file are not: a daemon serves TLS "
                         "with its own certificate whenever it uses TLS at all")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs; see docs/configuration.md for each field."""

    host: str = "127.0.0.1"
    port: int = 29999  # 0 = pick a free port and report it
    metrics_port: int = -1  # -1 = no metrics endpoint, 0 = pick a free port
    cache_dirs: tuple[CacheDirSpec, ...] = field(default_factory=_default_cache_dir)
    page_size: int = 1 << 20
    mounts: tuple[MountSpec, ...] = ()
    metadata_ttl: float = 30.0  # seconds an object's size/version is trusted
    # Past metadata_ttl, for this many seconds more, a read still uses the last size/version
    # (serving cached pages at once) while the worker revalidates it in the background.
    metadata_stale_grace: float = 600.0
    # Objects' metadata kept (cachefs/store/metatable.py: ~60 bytes an object, counted as the docs
    # say), bytes at most; past it the entries put longest ago go. 0: none kept (every read asks).
    metadata_cache_bytes: int = 1 << 30
    list_ttl: float = 30.0  # seconds a directory listing is trusted
    # Listings kept (in chunks shared by listers of a prefix: cachefs/store/listings.py), estimated
    # bytes at most; 0: none kept past the request (simultaneous listers still share a fetch).
    list_cache_bytes: int = 256 << 20
    fetch_threads: int = 16  # concurrent page fetches from the object store
    write_threads: int = 4  # background writes into the page store
    rpc_threads: int = 32
    parallel_pages: int = 32  # pages of one read in flight (bounds a read's memory)
    fetch_group_pages: int = 8  # consecutive missing pages fetched in one store request
    # The largest store request of a load, a fill or read-ahead: a bigger object (a shard) is
    # fetched as several extents side by side, since a store serves each connection at a bounded
    # speed (S3: tens of MB/s a stream) and one GET per shard would be held to it.
    extent_size: int = 16 << 20
    readahead_pages: int = 8  # max read-ahead window for sequential readers
    store_timeout: float = 60.0  # seconds for one page fetch from the object store
    max_pending_write_bytes: int = 256 << 20  # fetched pages waiting for the cache disk, at most
    # A cache dir that failed a write (disk full, EIO) stays degraded until a write succeeds and no
    # disk error has followed for this many seconds (a full disk still takes the odd small page).
    degraded_settle_s: float = 10.0
    # Freed memory the worker process keeps for reuse (malloc's trim threshold; blocks up to 64 MiB
    # from its heap) rather than faulting new memory in for every fetched page
    # (server/worker/heap.py); 0: the allocator's defaults.
    heap_keep_bytes: int = 512 << 20
    # master address (host:port), or several masters (m1:19998,m2:19998); empty: a standalone
    # worker with its own mounts
    master: str = ""
    advertise_address: str = ""  # what clients dial; default host:port (with the bound port)
    cluster_token: str = field(default="", repr=False)  # shared with the master: to register, to get credentials
    shutdown_grace: float = 5.0
    access_token: str = field(default="", repr=False)  # if set: every gRPC call must carry it (or the cluster token)
    # Serve an address other machines reach with no access_token (refused at start otherwise).
    insecure: bool = False
    open_status: bool = False  # with access_token: GetStatus answers without a token (probes)
    tls_cert_file: str = ""  # PEM chain: serve TLS with it (and present it when dialing the master)
    tls_key_file: str = ""
    tls_ca_file: str = ""  # PEM CA bundle: verify the master (and clients, with tls_require_client_cert)
    tls_require_client_cert: bool = False  # mutual TLS: callers must present a certificate from tls_ca_file
    # Unix socket for short-circuit reads by clients on this host ("auto": in the first cache
    # dir, or the temp dir if that path is too long for a socket; "": off).
    short_circuit_socket: str = "auto"
    # Who may connect to the short-circuit socket besides this worker's own uid and root (checked
    # with SO_PEERCRED at accept; others are closed before a byte is read): uids (a list, or
    # "1000,1001" in env), and members of one group (a gid or a group name; -1: none).
    allowed_uids: tuple[int, ...] = ()
    allowed_gid: int = -1
    # Slots in the shared table of pages handed to local clients to keep open and read again
    # without asking (server/worker/handles.py); 0: clients read each descriptor once.
    short_circuit_handles: int = 1 << 16
    # Publish which object versions this worker vouches for (a shared table with as many entries
    # as short_circuit_handles), so local clients of this worker's user open cached page files by
    # name with no message (server/worker/names.py). Needs short_circuit_handles > 0.
    short_circuit_by_name: bool = True
    # The name index starts with short_circuit_handles slots and, when full, grows 2x at a time
    # up to this many (128 bytes each, memory used as entries are written): a data set of more
    # objects than the first table holds is still read by name.
    name_index_max_slots: int = 1 << 22
    # Share of the quota that evicted or freed pages still held open by local clients may take
    # (their bytes stay counted until the hold ends); past it, descriptors are handed out for one read.
    max_held_fraction: float = 0.125
    # TCP port on `host` that sends cached pages with sendfile to clients on other hosts
    # (server/worker/dataport.py): 0 = pick a free one (reported by GetStatus), -1 = off.
    # Plain TCP: off whenever the worker serves TLS.
    data_port: int = 0
    # Which page leaves first when room is needed: "future" (the one that registered training
    # plans read furthest ahead; pages no plan reads, least recently used, go before any;
    # server/worker/plans.py) or "lru" (least recently used).
    eviction: str = "future"
    # Which client S3 data reads take: "http" (cachefs/store/s3http.py: signed GETs on plain
    # sockets, the least CPU), "obstore" (its Rust client, if installed), "s3fs"; "auto" takes
    # the first that a mount's options allow; "http" also lists directories (the rest of the
    # metadata and writes are always s3fs's).
    s3_client: str = "auto"

    def __post_init__(self) -> None:
        _check_listen(self.host, self.port, self.metrics_port)
        if self.eviction not in ("future", "lru"):
            raise ValueError(f"eviction must be 'future' or 'lru', got {self.eviction!r}")
        if self.s3_client not in S3_CLIENTS:
            raise ValueError(f"s3_client must be one of {', '.join(S3_CLIENTS)}, got {self.s3_client!r}")
        if not -1 <= self.data_port < 65536:
            raise ValueError(f"data_port must be -1 (off), 0 (any free port) or a port number, got {self.data_port}")
        if not self.cache_dirs:
            raise ValueError("at least one cache dir is required")
        if len({d.path for d in self.cache_dirs}) != len(self.cache_dirs):
            raise ValueError("cache dirs must be distinct")
        if not 4096 <= self.page_size <= 64 << 20 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two in [4 KiB, 64 MiB], got {self.page_size}")
        if not 4096 <= self.extent_size <= 1 << 30:  # below page_size: one page a request
            raise ValueError(f"extent_size must be in [4 KiB, 1 GiB], got {self.extent_size}")
        _check_unique_mounts(self.mounts)
        for name in ("metadata_ttl", "metadata_stale_grace", "list_ttl", "store_timeout", "shutdown_grace",
                     "degraded_settle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("fetch_threads", "write_threads", "rpc_threads", "parallel_pages", "fetch_group_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.master:
            _check_address(self.master, "master")
        if self.advertise_address:
            _check_address(self.advertise_address, "advertise_address")
        if self.max_pending_write_bytes < 0:
            raise ValueError("max_pending_write_bytes must be >= 0")
        if self.list_cache_bytes < 0:
            raise ValueError("list_cache_bytes must be >= 0")
        if self.metadata_cache_bytes < 0:
            raise ValueError("metadata_cache_bytes must be >= 0")
        if self.heap_keep_bytes < 0:
            raise ValueError("heap_keep_bytes must be >= 0")
        if self.readahead_pages < 0:
            raise ValueError("readahead_pages must be >= 0")
        if self.short_circuit_handles != 0 and not 2 <= self.short_circuit_handles <= 1 << 24:
            raise ValueError(f"short_circuit_handles must be 0 (off) or in [2, 16777216], "
                             f"got {self.short_circuit_handles}")
        if not 2 <= self.name_index_max_slots <= 1 << 26:
            raise ValueError(f"name_index_max_slots must be in [2, 67108864], got {self.name_index_max_slots}")
        object.__setattr__(self, "allowed_uids", tuple(int(u) for u in self.allowed_uids))
        if any(u < 0 for u in self.allowed_uids) or self.allowed_gid < -1:
            raise ValueError(f"allowed_uids must be uids (>= 0) and allowed_gid a gid or -1, got "
                             f"{list(self.allowed_uids)} and {self.allowed_gid}")
        if not 0.0 <= self.max_held_fraction <= 0.5:
            raise ValueError(f"max_held_fraction must be in [0, 0.5], got {self.max_held_fraction}")
        _check_daemon_tls(self)
        _check_exposed(self, "worker")

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig.from_fields(self)


def _check_mount_policy(config: Any) -> None:
    schemes = tuple(s.strip().lower() for s in _split_addresses(config.allowed_schemes))
    for scheme in schemes:
        if scheme in ("file", "local"):
            raise ValueError(f"allowed_schemes: {scheme!r} is not a scheme setting: local directories are "
                             "allowed by allowed_local_roots")
        if scheme != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
            raise ValueError(f"allowed_schemes: {scheme!r} is not a URL scheme")
    roots = _split_addresses(config.allowed_local_roots)
    for root in roots:
        if not os.path.isabs(root):
            raise ValueError(f"allowed_local_roots: {root!r} is not an absolute path")
    object.__setattr__(config, "allowed_schemes", schemes)
    object.__setattr__(config, "allowed_local_roots", roots)


def _check_address(address: str, what: str) -> None:
    if what == "master":
        if not split_addresses(address, what):
            raise ValueError("master is empty")
        return
    split_address(address, what)


def _default_master_dir() -> str:
    return str(Path(state_root()) / "master")  # never a predictable name in /tmp (cachefs/runtimedir.py)


@dataclass(frozen=True)
class MasterConfig:
    """Everything a master needs; see docs/configuration.md for each field."""

    host: str = "127.0.0.1"
    port: int = 19998  # 0 = pick a free port and report it
    metrics_port: int = -1
    state_dir: str = field(default_factory=_default_master_dir)  # durable state (mounts, jobs)
    lease_seconds: float = 10.0  # a worker that has not heartbeated for this long leaves the view
    heartbeat_seconds: float = 2.0  # what workers are told to use
    vnodes: int = 2000  # ring settings published in the view: every client uses the same
    stripe_size: int = 64 << 20
    cluster_token: str = field(default="", repr=False)  # if set: workers present it to register, get credentials
    mounts: tuple[MountSpec, ...] = ()  # added at start when absent (the durable table wins)
    rpc_threads: int = 16
    shutdown_grace: float = 2.0
    metadata_ttl: float = 30.0  # the master's metadata cache (GetInfo, Stat, job listings)
    list_ttl: float = 30.0  # the master's listing cache (List)
    job_threads: int = 2  # cluster jobs (load, free) running at once; more wait PENDING
    access_token: str = field(default="", repr=False)  # if set: every gRPC call must carry it (or the cluster token)
    # Serve an address other machines reach with no access_token (refused at start otherwise).
    insecure: bool = False
    open_status: bool = False  # with access_token: GetView answers without a token (`cachefs status`)
    tls_cert_file: str = ""  # PEM chain: serve TLS with it (and present it when dialing workers)
    tls_key_file: str = ""
    tls_ca_file: str = ""  # PEM CA bundle: verify workers (and clients, with tls_require_client_cert)
    tls_require_client_cert: bool = False  # mutual TLS: callers must present a certificate from tls_ca_file
    # Several masters, one leader: the state (mounts, jobs, live workers) in etcd at these
    # endpoints (http[s]://HOST:PORT, comma-separated); empty: one master on SQLite in state_dir.
    etcd: tuple[str, ...] = ()
    etcd_prefix: str = "/cachefs/default/"  # every key of this cluster lives under it
    etcd_ca_file: str = ""  # PEM CA: talk TLS to etcd and verify it (https:// endpoints imply TLS)
    etcd_cert_file: str = ""  # client certificate for etcd (--client-cert-auth)
    etcd_key_file: str = ""
    etcd_user: str = ""  # etcd's user auth
    etcd_password: str = field(default="", repr=False)
    etcd_timeout: float = 3.0  # seconds for one etcd call over all endpoints (admin commands fail within it)
    election_lease_seconds: float = 5.0  # the leader's lease: a dead leader is replaced within ~2x this
    advertise_address: str = ""  # what workers and the other masters dial; default host:port
    # Serve the cluster view to training processes on port + 1, plain TCP with no gRPC
    # (server/master/clientport.py); never with TLS (its clients then use gRPC).
    client_port: bool = True
    # What a mount may point at (cachefs/mountpolicy.py): remote stores by URL scheme ("*": any
    # scheme); local directories (file://, plain paths) only at or under allowed_local_roots
    # (by realpath) or under a mount in this config (`mounts`, --mount: the operator's own).
    allowed_schemes: tuple[str, ...] = ("s3", "s3a", "gs", "gcs", "az", "abfs")
    allowed_local_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_listen(self.host, self.port, self.metrics_port)
        object.__setattr__(self, "etcd", _split_addresses(self.etcd))
        _check_mount_policy(self)
        if self.etcd:
            from cachefs.server.etcd.client import settings_of  # masters only: never in a client

            settings_of(self)  # endpoints parse, cert and key go together
            if not self.etcd_prefix.startswith("/") or not self.etcd_prefix.endswith("/"):
                raise ValueError(f"etcd_prefix must start and end with '/', got {self.etcd_prefix!r}")
            if not 2 <= self.election_lease_seconds <= 60:
                raise ValueError(f"election_lease_seconds must be in [2, 60], got {self.election_lease_seconds}")
            # A failover takes up to about one election lease; workers cannot renew their own
            # leases meanwhile, so theirs must outlast it and one heartbeat more.
            if self.lease_seconds < self.election_lease_seconds + 2 * self.heartbeat_seconds:
                raise ValueError(f"with etcd, lease_seconds ({self.lease_seconds}) must be at least "
                                 f"election_lease_seconds + 2 x heartbeat_seconds "
                                 f"({self.election_lease_seconds + 2 * self.heartbeat_seconds}): workers' "
                                 "leases must outlast a failover")
        if self.advertise_address:
            _check_address(self.advertise_address, "advertise_address")
        if not self.state_dir:
            raise ValueError("state_dir is empty")
        if self.heartbeat_seconds <= 0 or self.lease_seconds < 2 * self.heartbeat_seconds:
            raise ValueError("need heartbeat_seconds > 0 and lease_seconds >= 2 x heartbeat_seconds")
        if self.vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        if self.stripe_size <= 0 or self.stripe_size & (self.stripe_size - 1):
            raise ValueError(f"stripe_size must be a power of two, got {self.stripe_size}")
        _check_unique_mounts(self.mounts)
        if self.rpc_threads < 1 or self.shutdown_grace < 0:
            raise ValueError("rpc_threads must be >= 1 and shutdown_grace >= 0")
        for name in ("metadata_ttl", "list_ttl"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.job_threads <= 64:
            raise ValueError(f"job_threads must be in [1, 64], got {self.job_threads}")
        _check_daemon_tls(self)
        _check_exposed(self, "master")

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig.from_fields(self)


_C = TypeVar("_C")

# Fields that are not scalars, with the parser that turns one layer's value into the field type.
_COMPLEX_FIELDS = {
    "cache_dirs": lambda v: tuple(
        CacheDirSpec.parse(x) for x in (v.split(",") if isinstance(v, str) else v)
    ),
    "mounts": lambda v: tuple(MountSpec.parse_many(json.loads(v) if isinstance(v, str) else v)),
    "workers": lambda v: _split_addresses(v),
    "etcd": lambda v: _split_addresses(v),
    "allowed_schemes": lambda v: _split_addresses(v),
    "allowed_local_roots": lambda v: _split_addresses(v),
    "fallback_mounts": lambda v: json.loads(v) if isinstance(v, str) else v,
    "allowed_uids": lambda v: tuple(int(u) for u in (v.split(",") if isinstance(v, str) else v) if str(u).strip()),
    "allowed_gid": lambda v: _gid(v),
    "client": lambda v: v,  # FuseConfig's: a ClientConfig, built by load_fuse_config
    "umask": lambda v: int(v, 8) if isinstance(v, str) else int(v),  # FuseConfig's: octal text
}
_SIZE_FIELDS = {"page_size", "extent_size", "max_pending_write_bytes", "heap_keep_bytes", "list_cache_bytes", "metadata_cache_bytes", "stripe_size", "block_size", "min_throughput", "max_read", "read_ahead"}


def _gid(value: Any) -> int:
    """A group id, or a group's name -> its id."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    import grp

    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"allowed_gid: no group named {text!r}") from None


def _coerce(cls: type, name: str, value: Any) -> Any:
    if name in _COMPLEX_FIELDS:
        return _COMPLEX_FIELDS[name](value)
    if name in _SIZE_FIELDS:
        return parse_size(value)
    ftype = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    ftype = ftype if isinstance(ftype, str) else getattr(ftype, "__name__", str(ftype))
    try:
        if ftype == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if ftype == "float":
            return float(value)
        if ftype == "bool":
            return _parse_bool(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot use {value!r} as {ftype}") from exc


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML config file; daemon settings may sit at top level or under ``[worker]``."""
    with open(path, "rb") as f:
        return tomllib.load(f)


def env_layer(prefix: str, cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """``CACHEFS_WORKER_PORT=1234`` -> ``{"port": "1234"}`` for every field of ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in environ.items():
        if key.startswith(prefix):
            name = key[len(prefix):].lower()
            if name in names:
                out[name] = value
    return out


def build_config(cls: type[_C], *layers: Mapping[str, Any] | None) -> _C:
    """Merge layers left to right (later wins) onto the defaults and validate."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    merged: dict[str, Any] = {}
    for layer in layers:
        for name, value in (layer or {}).items():
            if value is None:
                continue
            if name not in names:
                raise ValueError(f"unknown {cls.__name__} setting {name!r}; known: {sorted(names)}")
            merged[name] = _coerce(cls, name, value)
    return cls(**merged)


def _load_daemon_config(cls: type[_C], section: str, config_file: str | None,
                        environ: Mapping[str, str] | None, flags: Mapping[str, Any] | None) -> _C:
    """defaults < file (``[section]`` or top level) < env (``CACHEFS_<SECTION>_*``) < flags."""
    environ = os.environ if environ is None else environ
    prefix = f"CACHEFS_{section.upper()}_"
    file_layer: dict[str, Any] = {}
    config_file = config_file or environ.get(f"{prefix}CONFIG")
    if config_file:
        data = load_file(config_file)
        file_layer = dict(data.get(section, data))
        for other in ("worker", "master"):  # the other daemon's table, not the worker's `master` address
            if isinstance(file_layer.get(other), Mapping):
                file_layer.pop(other)
        if "mounts" not in file_layer and "mounts" in data:
            file_layer["mounts"] = data["mounts"]
    env = env_layer(prefix, cls, environ)
    env.pop("config", None)
    return build_config(cls, file_layer, env, flags)


def load_master_config(
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> MasterConfig:
    """defaults < file < env (``CACHEFS_MASTER_*``) < flags."""
    return _load_daemon_config(MasterConfig, "master", config_file, environ, flags)


def load_worker_config(
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> WorkerConfig:
    """defaults < file < env (``CACHEFS_WORKER_*``) < flags."""
    return _load_daemon_config(WorkerConfig, "worker", config_file, environ, flags)


def _split_addresses(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(a.strip() for a in value if a and a.strip())


@dataclass(frozen=True)
class ClientConfig:
    """What a ``cachefs://`` client needs; built from fsspec storage options (and env)."""

    master: str = ""  # the master's HOST:PORT: workers and placement come from its view
    workers: tuple[str, ...] = ()  # without a master, or before its first view
    # Read the object store directly when no worker answers. Off by default: it needs the
    # client to be allowed to read the store itself (its own IAM role / env credentials).
    fallback: bool = False
    # Client-side mount table for fallback: {name: url} or {name: {"url":..., "options":...}}.
    # Without it, the client uses the public part of the workers' mount table (never secrets).
    fallback_mounts: Mapping[str, Any] = field(default_factory=dict)
    # Reads this process sends to the store at once while no worker answers: a flapping
    # cluster must not turn every DataLoader worker of every job into a stampede on the store.
    fallback_concurrency: int = 8
    timeout: float = 30.0  # seconds for a metadata RPC; a read adds length / min_throughput
    min_throughput: int = 16 << 20  # bytes/s a read may be expected to sustain before its deadline
    block_size: int = 4 << 20  # read block of open() files
    # Bytes per placement stripe of a large object (must match every client of a cluster).
    stripe_size: int = 64 << 20
    # The cluster's access token, sent on every call; none given: CACHEFS_TOKEN, then the one
    # `cachefs local` keeps for this master (cachefs/tokens.py).
    token: str = field(default="", repr=False)
    tls_ca_file: str = ""  # PEM CA bundle: use TLS and verify the workers and the master with it
    tls_cert_file: str = ""  # client certificate chain, for a cluster that requires one (mutual TLS)
    tls_key_file: str = ""
    # Read cached pages of a worker on this host as file descriptors over its Unix socket
    # (client/transport/shortcircuit.py), not through gRPC.
    short_circuit: bool = True
    # Page file descriptors from a worker on this host kept open per process and read again
    # with no message to the worker (client/transport/handles.py), at most a quarter of the process's
    # descriptor limit; 0: one read each. 4096 pages of 1 MiB: a warm epoch of a few GiB per
    # process reads with no message at all.
    short_circuit_handles: int = 4096
    # Open a local worker's cached page files by name, with the version its name index vouches
    # for (client/transport/namedpages.py), when the worker offers it (same user): no message per page,
    # even for a process's first read of it. Off: descriptors over the socket only.
    short_circuit_by_name: bool = True
    # Large results of cached pages (cat_file, open().read(): 4 MiB and more) in
    # transparent huge pages where the kernel allows it: a new 64 MiB result costs 16,384 page
    # faults in 4 KiB pages (2.6 GB/s here) and 32 in 2 MiB ones (11 GB/s). Off for hosts where
    # THP compaction stalls matter.
    huge_pages: bool = True
    # Read cached pages of other hosts' workers through their data port (TCP, sendfile; see
    # server/worker/dataport.py), and write through it, not through gRPC (over TLS where the cluster has TLS).
    data_port: bool = True
    # Whole objects read in their directory's listing order (cat_file, open, read_into from the
    # start) get the next ones hinted to the cache, a window that grows while the order holds
    # (client/fs/scanahead.py): a plain Dataset with shuffle=False stops waiting on the store for
    # each object. Off: no listing, no hints.
    scan_ahead: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", _split_addresses(self.workers))
        if self.stripe_size <= 0 or self.stripe_size & (self.stripe_size - 1):
            raise ValueError(f"stripe_size must be a power of two, got {self.stripe_size}")
        for address in self.workers:
            _check_address(address, "worker address")
        if self.master:
            _check_address(self.master, "master")
        if not self.workers and not self.master and not self.fallback:
            raise ValueError("no master or workers given: pass master='host:port' (or workers='host:port,...'), "
                             "or set CACHEFS_MASTER / CACHEFS_WORKERS")
        if self.timeout <= 0:
            raise ValueError("timeout must be > 0")
        if self.fallback_concurrency < 1:
            raise ValueError("fallback_concurrency must be >= 1")
        if self.min_throughput <= 0:
            raise ValueError("min_throughput must be > 0")
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if not 0 <= self.short_circuit_handles <= 1 << 16:
            raise ValueError(f"short_circuit_handles must be in [0, 65536], got {self.short_circuit_handles}")
        if not isinstance(self.fallback_mounts, Mapping):
            raise ValueError("fallback_mounts must be a mapping of mount name -> url")
        TLSConfig.from_fields(self)  # files exist and parse
        if not self.token and self.master:  # the token cachefs local keeps for this master (cachefs/tokens.py)
            from cachefs.tokens import find_token

            object.__setattr__(self, "token", find_token(self.master))
        _check_tokens(self, "token")

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig.from_fields(self)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "ClientConfig":
        """defaults < env (``CACHEFS_<FIELD>``, e.g. ``CACHEFS_MASTER``) < storage options.

        The fields of this class are the client's options, listed once: each is an fsspec
        storage option and an environment variable. An unknown option is a TypeError, as an
        unknown keyword argument is.
        """
        names = client_option_names()
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown cachefs client option(s) {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(sorted(names))}")
        environ = os.environ if environ is None else environ
        return build_config(cls, env_layer("CACHEFS_", cls, environ), options)


def client_option_names() -> frozenset[str]:
    """Every option a cachefs client takes (storage options, ``CACHEFS_<NAME>`` in the env)."""
    return frozenset(f.name for f in dataclasses.fields(ClientConfig))


@dataclass(frozen=True)
class FuseConfig:
    """What ``cachefs fuse`` needs: the kernel-facing settings, and the client it reads through.

    The mount reads through a ``ClientSession`` exactly as ``cachefs://`` does (``client``, built
    from the same options, env ``CACHEFS_<NAME>`` and a ``[client]`` table); see docs/user-guide.md.
    """

    # Seconds the kernel keeps an object's attributes, a name's lookup and a missing name.
    # Never longer than metadata_ttl: the kernel must not trust a size longer than the workers do.
    attr_timeout: float = 1.0
    metadata_ttl: float = 30.0  # the workers' metadata_ttl (what attr_timeout is capped by)
    max_read: int = 1 << 20  # bytes of one read request from the kernel (its usual maximum)
    # The kernel's read-ahead for the mount (bytes; 0: leave the kernel's 128 KiB): sequential
    # reads come as max_read requests, several in flight on libfuse's threads. Root only.
    read_ahead: int = 8 << 20
    threads: int = 16  # libfuse threads serving requests at once (the client is thread-safe)
    allow_other: bool = False  # let other users (a training pod's) read the mount; needs root
    # The kernel checks each access against the modes, owner and group below (FUSE's
    # default_permissions): with allow_other, who may read (and, writable, write) is then up to
    # them, not to anyone who can reach the mount point.
    default_permissions: bool = True
    uid: int = -1  # the owner of every file and directory (-1: the user running the mount)
    gid: int = -1  # their group (-1: that user's group)
    # Taken from 0o555 (dirs) and 0o444 (files), plus write for the owner when writable: e.g.
    # 0o027 with a gid lets only that group (and the owner) read. Octal ("027") from text.
    umask: int = 0o022
    # Every open reaches the mount, which revalidates the version and pins the open file to it
    # (never mixed: ESTALE). False (read-only mounts only): the kernel opens files without asking
    # (no round trip per open; its page cache dropped when a lookup shows a new size or mtime),
    # but a file held open across a change of its object may read bytes of both versions.
    revalidate_open: bool = True
    # Writes through the mount (client/fuse/fusewrite.py: whole objects, streamed, published at close).
    # Off by default: a read-only mount can never change the store by mistake.
    writable: bool = False
    client: ClientConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.client, ClientConfig):
            raise ValueError("the FUSE mount needs a client configuration (master or workers)")
        if self.metadata_ttl < 0 or not 0 <= self.attr_timeout <= self.metadata_ttl:
            raise ValueError(f"attr_timeout must be in [0, metadata_ttl={self.metadata_ttl}], got {self.attr_timeout}")
        if not 4096 <= self.max_read <= 16 << 20:
            raise ValueError(f"max_read must be in [4 KiB, 16 MiB], got {self.max_read}")
        if not 0 <= self.read_ahead <= 1 << 30:
            raise ValueError(f"read_ahead must be in [0, 1 GiB], got {self.read_ahead}")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be in [1, 1024], got {self.threads}")
        if not 0 <= self.umask <= 0o777:
            raise ValueError(f"umask must be in [0, 0o777], got {self.umask:#o}")
        if self.uid < -1 or self.gid < -1:
            raise ValueError("uid and gid must be -1 (the mounting user's) or an id")
        if self.writable and not self.revalidate_open:
            raise ValueError("revalidate_open = false needs a read-only mount (writable = false): "
                             "a write starts at an open")



def load_fuse_config(
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    client_flags: Mapping[str, Any] | None = None,
) -> FuseConfig:
    """defaults < file (``[fuse]`` and ``[client]`` tables) < env (``CACHEFS_FUSE_*``; the client's
    ``CACHEFS_<NAME>``) < flags."""
    environ = os.environ if environ is None else environ
    data = load_file(config_file) if config_file else {}
    for table in ("fuse", "client"):
        if not isinstance(data.get(table, {}), Mapping):
            raise ValueError(f"[{table}] in {config_file} must be a table")
    unknown = sorted(set(data) - {"fuse", "client"})
    if unknown:
        raise ValueError(f"{config_file}: unknown table(s) or key(s) {unknown}: settings go under [fuse] or [client]")
    client_options = {**data.get("client", {}), **{k: v for k, v in (client_flags or {}).items() if v is not None}}
    try:
        client = ClientConfig.from_options(client_options, environ)
    except TypeError as exc:  # an unknown option: a bad configuration, as for the daemons
        raise ValueError(str(exc)) from None
    env = env_layer("CACHEFS_FUSE_", FuseConfig, environ)
    env.pop("client", None)
    return build_config(FuseConfig, data.get("fuse", {}), env, flags, {"client": client})
