"""S3 reads through obstore (Rust), where it is installed and the mount's options translate.

benchmarks/bench_store_client.py measured it against the s3fs backend on the same objects: a
256 KiB ranged GET costs 0.8-1.0 ms of client CPU against 2.5-3.0 ms, which is most of a cold
epoch's worker CPU. Only the data reads go native (``read``, ``read_pieces``, ``head_read``):
metadata (HEAD, listings) and writes stay on s3fs, whose semantics for prefixes, "directories"
and errors the rest of the worker relies on. Reads keep the s3fs backend's contract: pinned to
the version with ``If-Match`` (a changed object is StaleObjectError, never other bytes), a
missing one FileNotFoundError, an unreachable store ConnectionError (the store breaker's signal).

Like the HTTP client (s3http.py) it never reads a mount's options itself (#49): botocore resolves
them as for s3fs (cachefs/store/s3config.py) and each bucket's S3Store is built from that: the
bucket's URL (endpoint, addressing style), the signing region, the credentials (a provider that
hands obstore botocore's, refreshed), timeouts, attempts, requester pays. obstore reads neither
profiles, ``services`` sections nor SSO by itself; here it need not. A mount the HTTP client
cannot take (a proxy, a CA bundle of its own, extra request parameters) stays on s3fs here too.
Only chosen by naming it (worker setting ``s3_client = "obstore"``): ``auto`` is the HTTP client,
else s3fs (docs/architecture.md says why, with the figures).
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

_CONNECTION_MARKERS = ("error sending request", "connection refused", "connection reset", "timed out",
                       "dns error", "connect error", "broken pipe", "connection closed")


def store_options(resolution: Any, bucket: str) -> dict[str, Any] | None:
    """obstore S3Store keyword arguments for one bucket of a botocore resolution, or None: keep s3fs."""
    if resolution.unsupported():
        return None
    verify = resolution.verify
    target = resolution.target(bucket)
    if target.scheme == "https" and isinstance(verify, str) and verify != _default_ca_bundle():
        return None  # a CA bundle of the mount's own (or AWS_CA_BUNDLE's): obstore takes none
    path_style = target.base.endswith("/" + bucket)
    base = target.base[:-len(bucket) - 1] if path_style else target.base
    out: dict[str, Any] = {"endpoint": f"{target.scheme}://{target.netloc}{base}", "region": target.region,
                           "virtual_hosted_style_request": not path_style,
                           "retry_config": {"max_retries": max(0, resolution.attempts - 1),
                                            "retry_timeout": dt.timedelta(seconds=30)}}
    client_options: dict[str, Any] = {"connect_timeout": f"{resolution.connect_timeout:g}s",
                                      "timeout": f"{resolution.read_timeout:g}s"}
    if target.scheme == "http":
        client_options["allow_http"] = True
    if verify is False:
        client_options["allow_invalid_certificates"] = True
    out["client_options"] = client_options
    if resolution.requester_pays:
        out["request_payer"] = True
    if resolution.unsigned:
        out["skip_signature"] = True
    else:
        def credentials() -> dict[str, Any]:
            access, secret, token = resolution.credentials()
            # Asked again within a minute: botocore knows when its credentials expire and refreshes them.
            return {"access_key_id": access, "secret_access_key": secret, "token": token or None,
                    "expires_at": dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=60)}
        out["credential_provider"] = credentials
    return out


def _default_ca_bundle() -> str:
    from botocore.httpsession import get_cert_path

    return get_cert_path(True)


def native_backend_for(fs: fsspec.AbstractFileSystem) -> "NativeS3Backend | None":
    """The native backend for an s3fs filesystem, or None (not installed, or a mount it cannot take)."""
    if obstore is None:
        return None
    from cachefs.store.s3config import resolve_fs

    options = dict(getattr(fs, "storage_options", {}) or {})
    if options.get("s3_additional_kwargs") or options.get("session"):
        return None
    try:
        resolution = resolve_fs(fs)
    except Exception:  # noqa: BLE001 - s3fs says what is wrong with the options
        return None
    return None if resolution.unsupported() else NativeS3Backend(resolution)


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

    def __init__(self, resolution: Any) -> None:
        self.resolution = resolution
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                options = store_options(self.resolution, bucket)
                if options is None:
                    raise OSError(f"s3://{bucket}: obstore cannot send what botocore would "
                                  f"({self.resolution.unsupported() or 'a CA bundle of its own'}): s3_client s3fs")
                store = self._stores[bucket] = S3Store(bucket, **options)
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
