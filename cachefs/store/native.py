"""S3 reads through obstore (Rust), where it is installed and the mount's options translate.

benchmarks/bench_store_client.py measured it against the s3fs backend on the same objects: a
256 KiB ranged GET costs 0.8-1.0 ms of client CPU against 2.5-3.0 ms, which is most of a cold
epoch's worker CPU. Only the data reads go native (``read``, ``read_pieces``, ``head_read``):
metadata (HEAD, listings) and writes stay on s3fs, whose semantics for prefixes, "directories"
and errors the rest of the worker relies on. Reads keep the s3fs backend's contract: pinned to
the version with ``If-Match`` (a changed object is StaleObjectError, never other bytes), a
missing one FileNotFoundError, an unreachable store ConnectionError (the store breaker's signal).

Translated s3fs options: ``key``/``secret``/``token``, ``endpoint_url`` (also in
``client_kwargs``), ``client_kwargs.region_name``, ``anon``, and of ``config_kwargs`` the
connect/read timeouts and retry attempts (the mount table's fail-fast defaults); credentials not given are taken from
the environment as the AWS SDKs do (obstore reads ``AWS_*`` and instance credentials). Any other
option (``profile``, ``config_kwargs``, ``requester_pays``, ...) keeps the mount on s3fs.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence
from typing import Any

import fsspec

from cachefs.errors import StaleObjectError
from cachefs.store.backends import PieceSink, _S3Backend, _mtime_of

try:  # optional: ``pip install cachefs[native]``
    import obstore
    from obstore.exceptions import NotFoundError, PreconditionError
    from obstore.store import S3Store
except ImportError:  # pragma: no cover - the s3fs backend serves instead
    obstore = None

__all__ = ["NativeS3Backend", "native_backend_for"]

# s3fs options with no bearing on reads (caching of listings, its own event loop, ...).
_IGNORED = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                      "asynchronous", "loop", "default_block_size", "default_fill_cache", "default_cache_type",
                      "cache_regions", "use_ssl", "version_aware"})
_CONNECTION_MARKERS = ("error sending request", "connection refused", "connection reset", "timed out",
                       "dns error", "connect error", "broken pipe", "connection closed")
RETRIES = 1  # obstore's own retries where the mount names none (botocore's max_attempts 2)


def store_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """obstore S3Store keyword arguments for a mount's s3fs options, or None: keep s3fs."""
    out: dict[str, Any] = {}
    client_kwargs = dict(options.get("client_kwargs") or {})
    endpoint = options.get("endpoint_url") or client_kwargs.pop("endpoint_url", None)
    region = client_kwargs.pop("region_name", None)
    if client_kwargs:
        return None  # e.g. a custom botocore config: not ours to translate
    for name, value in options.items():
        if name in _IGNORED or name in ("client_kwargs", "endpoint_url", "config_kwargs"):
            continue
        if name in ("key", "secret", "token") and value:
            out[{"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}[name]] = value
        elif name == "anon":
            if value:
                out["skip_signature"] = True
        elif value not in (None, "", False):
            return None  # profile, config_kwargs, requester_pays, s3_additional_kwargs, ...
    client_options: dict[str, Any] = {}
    config = dict(options.get("config_kwargs") or {})
    for name, key in (("connect_timeout", "connect_timeout"), ("read_timeout", "timeout")):
        if name in config:
            client_options[key] = f"{float(config.pop(name)):g}s"
    retries = dict(config.pop("retries", None) or {})
    attempts = retries.pop("max_attempts", retries.pop("total_max_attempts", None))
    retries.pop("mode", None)
    if config or retries:
        return None  # other botocore settings: s3fs honours them, this would not
    out["retry_config"] = {"max_retries": RETRIES if attempts is None else max(0, int(attempts) - 1),
                           "retry_timeout": dt.timedelta(seconds=30)}
    if endpoint:
        out["endpoint"] = str(endpoint)
        out["virtual_hosted_style_request"] = False  # path style: MinIO, moto, most S3 clones
        if str(endpoint).startswith("http://"):
            client_options["allow_http"] = True
    if client_options:
        out["client_options"] = client_options
    if region:
        out["region"] = str(region)
    return out


def native_backend_for(fs: fsspec.AbstractFileSystem) -> "NativeS3Backend | None":
    """The native backend for an s3fs filesystem, or None (not installed, or options it cannot take)."""
    if obstore is None:
        return None
    options = store_options(dict(getattr(fs, "storage_options", {}) or {}))
    return None if options is None else NativeS3Backend(options)


def _translate(exc: BaseException, store_path: str, version: str) -> BaseException:
    if isinstance(exc, PreconditionError):
        return StaleObjectError(f"{store_path} changed in the store (ETag {version} no longer matches)")
    if isinstance(exc, (NotFoundError, FileNotFoundError)):
        return FileNotFoundError(f"{store_path}: no such object")
    first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]  # obstore appends a debug dump
    if any(marker in str(exc).lower() for marker in _CONNECTION_MARKERS):
        return ConnectionError(f"{store_path}: {first}")
    return OSError(f"{store_path}: {first}")


class NativeS3Backend(_S3Backend):
    """``_S3Backend`` with its data reads through obstore (one S3Store per bucket)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                store = self._stores[bucket] = S3Store(bucket, **self._options)
            return store

    def _get(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, end: int, version: str) -> Any:
        bucket, key, _ = fs.split_path(store_path)
        options: dict[str, Any] = {"range": (start, end)}
        if version:
            options["if_match"] = f'"{version}"'
        try:
            return obstore.get(self._store(bucket), key, options=options)
        except Exception as exc:  # noqa: BLE001 - obstore's errors, as the s3fs backend raises them
            raise _translate(exc, store_path, version) from exc

    def read(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, end: int, version: str) -> bytes:
        if end <= start:
            return b""
        result = self._get(fs, store_path, start, end, version)
        try:
            return bytes(result.bytes())
        except Exception as exc:  # noqa: BLE001 - the body broke off
            raise _translate(exc, store_path, version) from exc

    def read_pieces(self, fs: fsspec.AbstractFileSystem, store_path: str, start: int, sizes: Sequence[int],
                    version: str, deliver: PieceSink) -> None:
        """One ranged GET (If-Match), streamed: each piece handed on as soon as its bytes arrived."""
        total = sum(sizes)
        if total <= 0:
            return
        result = self._get(fs, store_path, start, start + total, version)
        buffer, index, at = bytearray(), 0, start
        try:
            for chunk in result.stream(min_chunk_size=min(max(sizes), 8 << 20)):
                view = memoryview(chunk)
                if not buffer:  # whole pieces straight out of the chunk: one copy each
                    used = 0
                    while index < len(sizes) and len(view) - used >= sizes[index]:
                        size = sizes[index]
                        deliver(index, bytes(view[used:used + size]))
                        used, index, at = used + size, index + 1, at + size
                    view = view[used:]
                buffer += view
                while index < len(sizes) and len(buffer) >= sizes[index]:
                    size = sizes[index]
                    deliver(index, bytes(buffer[:size]))
                    del buffer[:size]
                    index, at = index + 1, at + size
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, store_path, version) from exc
        if index < len(sizes):
            raise StaleObjectError(f"{store_path}: stream ended at {at + len(buffer)}, expected {start + total}")

    def head_read(self, fs: fsspec.AbstractFileSystem, store_path: str,
                  length: int) -> tuple[tuple[int, str, float, bool], bytes | None]:
        """One GET for metadata and the first ``length`` bytes; anything unusual (a prefix, an
        empty object, an error other than an unreachable store) is left to s3fs's HEAD."""
        try:
            result = self._get(fs, store_path, 0, length, "")
            data = bytes(result.bytes())
        except ConnectionError:
            raise  # the store is down: asking again with a HEAD would only double the wait
        except Exception:  # noqa: BLE001 - a prefix, an empty object (416), a real error: info() tells
            return self.info(fs, store_path), None
        meta = result.meta
        version = str(meta.get("e_tag") or "").strip('"')
        if not version:
            return self.info(fs, store_path), None
        return (int(meta["size"]), version, _mtime_of({"mtime": meta.get("last_modified")}), False), data
