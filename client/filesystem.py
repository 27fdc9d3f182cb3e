"""``cachefs://`` for fsspec: reads objects through cachefs workers.

    fs = fsspec.filesystem("cachefs", workers="127.0.0.1:29999")
    fs.cat_file("cachefs://datasets/train/0001.tar", start=0, end=1 << 20)

Paths are ``<mount>/<key>``; the worker resolves the mount to its object store and holds
the credentials. Each path prefers one worker (stable hashing), then the next; when none
answers and ``fallback=True``, the client reads the object store itself.

The class is an fsspec ``AsyncFileSystem`` (``asynchronous=True`` and the ``_cat_file``
family work, and fsspec's concurrent ``cat_ranges``/``cat`` use them), but the work itself
is done by blocking gRPC calls (see transport.py for why): the sync methods on the hot
path (``cat_file``, ``info``, file reads) run them in the caller's thread with no event-loop
hop, and the async methods run them on a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec.asyn
import grpc
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.spec import AbstractBufferedFile

from cachefs.client.urlmap import UrlMap
from cachefs.client.writer import CacheWriteFile, WriteMethods, Writes, check_write_mode

from cachefs.client.bulkpaths import BulkPaths
from cachefs.client.transport import CHANNEL_OPTIONS, WorkerSet
from cachefs.client.view import ViewWatcher
from cachefs.config import ClientConfig
from cachefs.errors import (
    RETRYABLE_CODES,
    StaleObjectError,
    UnknownMountError,
    WorkerUnavailableError,
    from_rpc_error,
)
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import PROTOCOL, CachePath, parse_path, strip_protocol
from cachefs.proto import common_pb2, master_pb2, worker_pb2, worker_pb2_grpc
from cachefs.ring import RingConfig
from cachefs.tls import explain, open_channel

log = logging.getLogger(__name__)

T = TypeVar("T")


def _info_dict(msg: common_pb2.ObjectInfo) -> dict[str, Any]:
    is_dir = msg.type == common_pb2.DIRECTORY
    return {
        "name": msg.path,
        "size": msg.size,
        "type": "directory" if is_dir else "file",
        "version": msg.version,
        "mtime": msg.mtime,
    }


def _meta_dict(meta: Any) -> dict[str, Any]:
    return {"name": str(meta.path), "size": meta.size, "type": "directory" if meta.is_dir else "file",
            "version": meta.version, "mtime": meta.mtime}


class CacheFileSystem(WriteMethods, AsyncFileSystem, ChainedFileSystem):
    """``cachefs://mount/key``; chained (``cachefs::s3://bucket/key``) it maps store URLs onto mounts."""

    protocol = PROTOCOL
    root_marker = ""
    async_impl = True

    def __init__(
        self,
        master: str | None = None,
        workers: str | list[str] | None = None,
        fallback: bool | None = None,
        fallback_mounts: dict[str, Any] | None = None,
        fallback_concurrency: int | None = None,
        timeout: float | None = None,
        block_size: int | str | None = None,
        min_throughput: int | str | None = None,
        stripe_size: int | str | None = None,
        token: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        short_circuit: bool | str | None = None,
        data_port: bool | str | None = None,
        write_via: str = "worker",
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        unmounted: str = "error",
        asynchronous: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(asynchronous=asynchronous, loop=loop, **kwargs)
        if unmounted not in ("error", "direct"):
            raise ValueError(f"unmounted must be 'error' or 'direct', got {unmounted!r}")
        # Chained use (cachefs::s3://...): paths are the target store's; see client/urlmap.py.
        self._target_protocol = target_protocol
        self._target_options = dict(target_options or {})
        self._unmounted = unmounted
        self._urlmap_cached: UrlMap | None = None
        self._direct_fs: Any = None
        self._writes = Writes(self, write_via)
        self.config = ClientConfig.from_options(
            {
                "master": master,
                "workers": workers,
                "fallback": fallback,
                "fallback_mounts": fallback_mounts,
                "fallback_concurrency": fallback_concurrency,
                "timeout": timeout,
                "block_size": block_size,
                "min_throughput": min_throughput,
                "stripe_size": stripe_size,
                "token": token,
                "tls_ca_file": tls_ca_file,
                "tls_cert_file": tls_cert_file,
                "tls_key_file": tls_key_file,
                "short_circuit": short_circuit,
                "data_port": data_port,
            }
        )
        self._bulk = BulkPaths(self)
        self._abandoned: list[WorkerSet] = []
        self._state_pid = -1
        self._state_lock = threading.Lock()
        self._process_state()

    # -- per-process state ----------------------------------------------------------------------
    def _process_state(self) -> WorkerSet:
        """Channels and the fallback store of *this* process; a forked child starts afresh."""
        if self._state_pid != os.getpid():
            with self._state_lock:
                if self._state_pid != os.getpid():
                    if self._state_pid != -1:
                        # Keep the parent's channels referenced but untouched: closing them from
                        # the child could disturb the parent.
                        self._abandoned.append(self._workers)
                    self._workers = WorkerSet(list(self.config.workers), RingConfig(stripe_size=self.config.stripe_size),
                                              connect=self._connect)
                    self._fallback_store: Any = None
                    self._mounts_learned = False
                    self._fallback_slots = threading.BoundedSemaphore(self.config.fallback_concurrency)
                    self._view: master_pb2.ClusterView | None = None
                    self._watcher: ViewWatcher | None = None
                    self._state_pid = os.getpid()
                    if self.config.master:
                        self._watcher = ViewWatcher(self.config.master, self._apply_view, timeout=self.config.timeout,
                                                    tls=self.config.tls, token=self.config.token)
                        self._watcher.fetch()
                        self._watcher.start()
        return self._workers

    def _connect(self, address: str) -> grpc.Channel:
        """A channel to one worker with this filesystem's TLS and token (cachefs/tls.py)."""
        return open_channel(address, self.config.tls, options=CHANNEL_OPTIONS, token=self.config.token)

    def _apply_view(self, view: master_pb2.ClusterView) -> None:
        """A newer cluster view: route by its live workers and ring settings from now on."""
        ring = RingConfig(vnodes=view.ring.vnodes or RingConfig().vnodes,
                          stripe_size=view.ring.stripe_size or self.config.stripe_size)
        if view.workers or not self._workers:
            self._workers.update([w.address for w in view.workers], ring)
        else:
            # No live workers: a master that just restarted (workers have not re-registered
            # yet), or a cluster that is really down. Either way the last workers are the best
            # bet: dead ones fail fast behind their breakers, and fallback still applies.
            log.warning("cluster view %d has no workers; keeping the last %d", view.version,
                        len(self._workers.addresses))
        self._view = view
        log.debug("cluster view %d: %d workers", view.version, len(view.workers))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():  # forked: the parent's loop thread does not exist here
            self._pid = os.getpid()
            self._loop = fsspec.asyn.get_loop()
        return self._loop

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> str | list[str]:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]  # type: ignore[misc]
        return strip_protocol(path).rstrip("/")

    # -- calling workers ----------------------------------------------------------------------
    def _on_workers(self, key: str, call: Callable[[worker_pb2_grpc.WorkerServiceStub], T], what: str,
                    offset: int = 0) -> T | None:
        """Run ``call(stub)`` on the workers placed for ``key`` (its stripe at ``offset``), in order.

        Returns None when no worker answered and fallback is on; raises otherwise.
        """
        workers = self._process_state()
        last_error: grpc.RpcError | None = None
        for handle in workers.candidates(key, offset, include_broken=not self.config.fallback):
            try:
                result = call(handle.stub())
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE_CODES:
                    handle.breaker.record_success()  # it answered: the error is about the request
                    raise from_rpc_error(err, what) from None
                log.warning("worker %s failed %s: %s", handle.address, what, err.code().name)
                handle.breaker.record_failure()
                last_error = err
                continue
            handle.breaker.record_success()
            self._learn_mounts()
            return result
        if self.config.fallback:
            return None
        if last_error is not None:
            hint = explain(last_error.details(), self.config.tls)  # e.g. a TLS cluster dialled in plaintext
            raise from_rpc_error(last_error, f"{what}: no worker could serve it"
                                 + (f" ({hint})" if hint else "")) from None
        raise WorkerUnavailableError(f"{what}: no worker is available")

    # -- fallback to the object store ---------------------------------------------------------
    def _fallback(self) -> Any:  # -> cachefs.server.objectstore.ObjectStore
        self._process_state()
        if self._fallback_store is None:
            from cachefs.store.objects import ObjectStore  # the same adapter the worker uses

            specs = [MountSpec.parse(v, name=k) for k, v in self.config.fallback_mounts.items()]
            if not specs:
                specs = self._public_mounts()
            self._fallback_store = ObjectStore(MountTable(specs), metadata_ttl=5.0, list_ttl=5.0)
        return self._fallback_store

    def _public_mounts(self) -> list[MountSpec]:
        view = self._view
        if view is not None and view.mounts:
            return [MountSpec(m.name, m.url, json.loads(m.options_json or "{}"), m.read_only) for m in view.mounts]
        resp = self._on_workers(
            "", lambda stub: stub.ListMounts(worker_pb2.ListMountsRequest(), timeout=self.config.timeout),
            "list mounts",
        )
        if resp is None:
            raise WorkerUnavailableError(
                "no worker answered and no fallback_mounts are configured: cannot read the store directly"
            )
        return [MountSpec(m.name, m.url, json.loads(m.options_json or "{}"), m.read_only) for m in resp.mounts]

    def _learn_mounts(self) -> None:
        """While workers answer, remember their public mount table for a later fallback (once)."""
        if self.config.fallback and not self._mounts_learned:
            self._mounts_learned = True
            try:
                self._fallback()
            except (OSError, ValueError) as exc:
                self._mounts_learned = False
                log.debug("could not learn mounts for fallback: %s", exc)

    # -- paths: plain, or chained onto a mount ----------------------------------------------------
    def _urlmap(self) -> UrlMap:
        if self._urlmap_cached is None:
            assert self._target_protocol
            self._urlmap_cached = UrlMap(self._target_protocol, self._public_mounts())
        return self._urlmap_cached

    def _path(self, path: str) -> CachePath | None:
        """The cachefs path of a caller's path; None for a chained URL under no mount when the
        caller asked for direct reads (``unmounted='direct'``)."""
        if not self._target_protocol:
            return parse_path(self._strip_protocol(path))
        cp = self._urlmap().to_cache_path(path)
        if cp is None and self._unmounted != "direct":
            self._urlmap().require(path)  # raises, naming the mounts that exist
        return cp

    def _write_path(self, path: str) -> CachePath:
        if not self._target_protocol:
            return parse_path(self._strip_protocol(path))
        return self._urlmap().require(path)  # never write around the cache

    def _direct(self) -> Any:
        if self._direct_fs is None:
            self._direct_fs = fsspec.filesystem(self._target_protocol, **self._target_options)
        return self._direct_fs

    def _named(self, entry: dict[str, Any]) -> dict[str, Any]:
        """An entry as the caller addressed it: chained callers get store paths back."""
        if self._target_protocol:
            entry["name"] = self._urlmap().to_store_path(entry["name"])
        return entry

    def _is_root(self, path: str) -> bool:
        return not self._target_protocol and self._strip_protocol(path) == ""

    # -- the work, blocking ------------------------------------------------------------------------
    def info(self, path: str, refresh: bool = False, **kwargs: Any) -> dict[str, Any]:
        if self._is_root(path):
            return {"name": "", "size": 0, "type": "directory"}
        cp = self._path(path)
        if cp is None:
            return self._direct().info(path, refresh=refresh)
        request = worker_pb2.InfoRequest(path=str(cp), refresh=refresh)
        msg = self._on_workers(str(cp), lambda stub: stub.GetInfo(request, timeout=self.config.timeout), f"info {cp}")
        if msg is not None:
            return self._named(_info_dict(msg))
        return self._named(_meta_dict(self._fallback().info(cp, refresh)))

    def ls(self, path: str, detail: bool = False, refresh: bool = False, **kwargs: Any) -> list[Any]:
        if self._is_root(path):
            entries = [{"name": m.name, "size": 0, "type": "directory"} for m in self._public_mounts()]
        else:
            cp = self._path(path)
            if cp is None:
                return self._direct().ls(path, detail=detail, refresh=refresh)
            entries = [self._named(e) for e in self._list(cp, recursive=False, refresh=refresh)]
        return entries if detail else [e["name"] for e in entries]

    def _list(self, cp: CachePath, recursive: bool, refresh: bool = False) -> list[dict[str, Any]]:
        request = worker_pb2.ListRequest(path=str(cp), recursive=recursive, refresh=refresh)

        def call(stub: worker_pb2_grpc.WorkerServiceStub) -> list[dict[str, Any]]:
            return [_info_dict(e) for batch in stub.List(request, timeout=self.config.timeout) for e in batch.entries]

        entries = self._on_workers(str(cp), call, f"list {cp}")
        if entries is not None:
            return entries
        return [_meta_dict(m) for m in self._fallback().list(cp, recursive, refresh)]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        cp = None if maxdepth is not None or withdirs or self._is_root(path) else self._path(path)
        if cp is None:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, **kwargs)
        detail = kwargs.pop("detail", False)
        try:
            entries = [self._named(e) for e in self._list(cp, recursive=True)]
        except FileNotFoundError:
            entries = []
        if not entries:
            try:  # find() of a file is [file], as in fsspec
                info = self.info(path)
                entries = [info] if info["type"] == "file" else []
            except FileNotFoundError:
                entries = []
        out = {e["name"]: e for e in entries}
        return out if detail else sorted(out)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, version: str = "",
                 **kwargs: Any) -> bytes:
        cp = self._path(path)
        if cp is None:
            return self._direct().cat_file(path, start=start, end=end)
        if (start is not None and start < 0) or (end is not None and end < 0):
            size = self.info(path)["size"]
            start = None if start is None else max(0, size + start) if start < 0 else start
            end = None if end is None else max(0, size + end) if end < 0 else end
        offset = start or 0
        length = -1 if end is None else max(0, end - offset)
        return self.read_range(cp, offset, length, version)

    def read_into(self, path: str, out: Any, offset: int = 0) -> tuple[int, int]:
        """Fill ``out`` (a writable buffer: numpy array, torch tensor's ``.numpy()``, bytearray)
        with the object's bytes from ``offset``; returns (bytes read, fewer at the object's end;
        the object's size).

        Cached bytes land in ``out`` directly: page files read into it from a worker on this
        host, or received into it from another host's data port; otherwise they come through
        gRPC and are copied in once.
        """
        view = memoryview(out).cast("B")
        cp = parse_path(self._strip_protocol(path))
        stripe, pos, end, version = self.config.stripe_size, offset, offset + len(view), ""
        size = -1
        while pos < end or size < 0:
            want = min(end, (pos // stripe + 1) * stripe) - pos
            got = self._bulk.read(str(cp), pos, want, version, view[pos - offset:pos - offset + want]) \
                if self._bulk.enabled and want else None
            if got is None:
                data, size, version = self._read_stripe(cp, pos, want, version, bulk=False)
                view[pos - offset:pos - offset + len(data)] = data
                n = len(data)
            else:
                n, size, version = len(got[0]), got[1], got[2]
            pos += n
            if n < want or pos >= min(end, size):
                break
        return pos - offset, size

    def read_range(self, cp: CachePath, offset: int, length: int, version: str = "") -> bytes:
        """Bytes [offset, offset+length) (length -1: to the end) of the given version, if any.

        A range is read stripe by stripe, each from the workers the ring places that stripe
        on; every stripe after the first is pinned to the version the first one saw.
        """
        return self._read_range(cp, offset, length, version)[0]

    def _read_range(self, cp: CachePath, offset: int, length: int, version: str = "") -> tuple[bytes, int]:
        """``read_range``, and the object's size."""
        stripe = self.config.stripe_size
        end = None if length < 0 else offset + length
        parts: list[bytes] = []
        pos = offset
        while True:
            boundary = (pos // stripe + 1) * stripe
            want = (boundary if end is None else min(end, boundary)) - pos
            data, size, version = self._read_stripe(cp, pos, want, version)
            parts.append(data)
            pos += len(data)
            end = size if end is None else min(end, size)
            if len(data) < want or pos >= end:
                break
        return (parts[0] if len(parts) == 1 else b"".join(parts)), size

    def _read_stripe(self, cp: CachePath, offset: int, length: int, version: str,
                     bulk: bool = True) -> tuple[bytes, int, str]:
        """Up to ``length`` bytes at ``offset`` (within one stripe), the object's size and version."""
        if bulk and self._bulk.enabled:  # cached bytes: page files or the data port, not gRPC messages
            got = self._bulk.read(str(cp), offset, length, version)
            if got is not None:
                return got
        request = worker_pb2.ReadRequest(path=str(cp), offset=offset, length=length, version=version)
        timeout = self._read_timeout(length)

        def call(stub: worker_pb2_grpc.WorkerServiceStub) -> tuple[bytes, int, str]:
            # The first block in one unary call (a streaming call costs a thread and ~1 ms more
            # here, which is most of a small object's read); only what is left streams.
            reply = stub.ReadBlock(request, timeout=timeout)
            info = reply.info
            want = max(0, min(length, info.size - offset))
            if len(reply.data) >= want:
                return reply.data, info.size, info.version
            rest = worker_pb2.ReadRequest(path=str(cp), offset=offset + len(reply.data),
                                          length=want - len(reply.data), version=info.version)
            parts = [reply.data, *(chunk.data for chunk in stub.Read(rest, timeout=timeout))]
            return b"".join(parts), info.size, info.version

        result = self._on_workers(str(cp), call, f"read {cp}", offset=offset)
        if result is not None:
            return result
        return self._read_from_store(cp, offset, length, version)

    def _read_from_store(self, cp: CachePath, offset: int, length: int, version: str) -> tuple[bytes, int, str]:
        store = self._fallback()
        if cp.mount not in store.mounts:
            raise UnknownMountError(f"no mount named {cp.mount!r} in the fallback mount table")
        meta = store.info(cp)
        if version and meta.version != version:
            meta = store.info(cp, refresh=True)
            if meta.version != version:
                raise StaleObjectError(f"{cp} changed since it was opened (version {version} -> {meta.version})")
        if meta.is_dir:
            raise IsADirectoryError(f"{cp} is a directory")
        end = min(meta.size, offset + length)
        if offset >= end:
            return b"", meta.size, meta.version
        if not self._fallback_slots.acquire(timeout=self._read_timeout(end - offset)):
            raise WorkerUnavailableError(f"read {cp}: no worker answered and the store is busy with this "
                                         f"process's other fallback reads (fallback_concurrency)")
        try:
            return store.read(meta, offset, end), meta.size, meta.version
        finally:
            self._fallback_slots.release()

    def _read_timeout(self, length: int) -> float:
        return self.config.timeout + length / self.config.min_throughput

    # -- the async API: the same work on a thread -------------------------------------------------
    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.info, path, **kwargs)

    async def _ls(self, path: str, detail: bool = False, **kwargs: Any) -> list[Any]:
        return await asyncio.to_thread(self.ls, path, detail, **kwargs)

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        if maxdepth is not None or withdirs or self._is_root(path):
            return await super()._find(path, maxdepth=maxdepth, withdirs=withdirs, **kwargs)
        return await asyncio.to_thread(self.find, path, **kwargs)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        return await asyncio.to_thread(self.cat_file, path, start, end, **kwargs)

    # -- files ----------------------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict | None = None, cache_type: str = "readahead", **kwargs: Any) -> Any:
        if mode != "rb":
            check_write_mode(mode)
            cp = self._write_path(path)
            if mode == "xb" and self._exists_now(path):
                raise FileExistsError(f"{path} exists (mode 'xb')")
            return CacheWriteFile(self, cp, "wb", block_size or self.config.block_size)
        cp = self._path(path)
        if cp is None:
            return self._direct().open(path, mode, block_size=block_size, cache_options=cache_options,
                                       cache_type=cache_type, **kwargs)
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(f"{path} is a directory")
        return CacheFile(self, info["name"], mode, block_size or self.config.block_size, cache_type=cache_type,
                         cache_options=cache_options, size=info["size"], version=info.get("version", ""), cp=cp)

    def close(self) -> None:
        """Close this process's channels and stop following the master."""
        if self._state_pid == os.getpid():
            if self._watcher is not None:
                self._watcher.stop()
            self._workers.close()
        self._bulk.close()


class CacheFile(AbstractBufferedFile):
    """A read-only file pinned to the object version seen at open: it never mixes versions."""

    def __init__(self, fs: CacheFileSystem, path: str, mode: str, block_size: int, *, version: str,
                 cp: CachePath, **kwargs: Any) -> None:
        self.version = version
        self.cp = cp  # the object in the cache (path may be a chained caller's store path)
        super().__init__(fs, path, mode, block_size, **kwargs)

    def _fetch_range(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self.fs.read_range(self.cp, start, end - start, self.version)
