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
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import fsspec.asyn
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.spec import AbstractBufferedFile

from cachefs.client import forksafe
from cachefs.client.fs.fscompat import S3CompatMethods, s3_fields
from cachefs.client.fs.hints import Hinter
from cachefs.client.fs.scanahead import ScanAhead
from cachefs.client.transport.session import ClientSession, SessionBootstrap
from cachefs.client.fs.urlmap import UrlMap
from cachefs.client.fs.writer import CacheWriteFile, WriteMethods, Writes, check_write_mode
from cachefs.config import ClientConfig, client_option_names
from cachefs.paths import PROTOCOL, CachePath, parse_path, strip_protocol

log = logging.getLogger(__name__)

#: Keyword arguments that fsspec's own base classes take (instance cache, listings cache, the
#: async batch size); everything else is a cachefs client option (cachefs/config.py ClientConfig).
#: Ranges whose page handles are fetched at once by cat_ranges and a multi-path cat: one message
#: per local worker, well within the handles a process keeps (client/transport/handles.py).
PREPARE_BATCH = 64
_GLOB_CHARS = frozenset("*?[")

FSSPEC_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "batch_size"})
#: The event loop of a filesystem made without one, until something asks for it (``loop``): the
#: reads of a DataLoader worker (a new process every epoch) never do, and fsspec's loop would
#: start a thread in each of them.
_NO_LOOP_YET: Any = object()


class CacheFileSystem(S3CompatMethods, WriteMethods, AsyncFileSystem, ChainedFileSystem):
    """``cachefs://mount/key``; chained (``cachefs::s3://bucket/key``) it maps store URLs onto mounts.

    Options are ClientConfig's fields (``master``, ``workers``, ``fallback``, ``timeout``...;
    each also ``CACHEFS_<NAME>`` in the env), plus ``write_via`` and ``unmounted``; an unknown
    option is a TypeError. Constructing one does no network I/O: the first call connects.
    """

    protocol = PROTOCOL
    root_marker = ""
    async_impl = True

    def __init__(
        self,
        *args: Any,
        write_via: str = "worker",
        unmounted: str = "error",
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        asynchronous: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
        **options: Any,
    ) -> None:
        if args:
            raise TypeError("CacheFileSystem takes keyword options only (master=..., workers=...)")
        fsspec_options = {k: options.pop(k) for k in list(options) if k in FSSPEC_OPTIONS}
        super().__init__(asynchronous=asynchronous, loop=loop if loop is not None or asynchronous else _NO_LOOP_YET,
                         **fsspec_options)
        if unmounted not in ("error", "direct"):
            raise ValueError(f"unmounted must be 'error' or 'direct', got {unmounted!r}")
        # What a main process learnt of the cluster, for the processes it starts (the datasets
        # hand it to their DataLoader workers: session.SessionBootstrap).
        bootstrap = options.pop("bootstrap", None)
        if bootstrap is not None and not isinstance(bootstrap, SessionBootstrap):
            raise TypeError(f"bootstrap must be a SessionBootstrap, not {type(bootstrap).__name__}")
        self.config = ClientConfig.from_options(options)
        self.session = ClientSession(self.config, bootstrap)
        self._writes = Writes(self.session, write_via)
        # Chained use (cachefs::s3://...): paths are the target store's; see client/fs/urlmap.py.
        self._target_protocol = target_protocol
        self._target_options = dict(target_options or {})
        self._unmounted = unmounted
        self._urlmap_cached: UrlMap | None = None
        self._direct_fs: Any = None
        self._scan: ScanAhead | None = None  # read-ahead across objects (client/fs/scanahead.py)
        self._scan_hinter: Hinter | None = None

    @staticmethod
    def option_names() -> frozenset[str]:
        """The keyword options this filesystem takes besides fsspec's own."""
        return client_option_names() | {"write_via", "unmounted", "bootstrap"}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != forksafe.pid() or self._loop is _NO_LOOP_YET:  # forked: the parent's loop thread is not here
            self._pid = forksafe.pid()
            self._loop = fsspec.asyn.get_loop()
        return self._loop

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> str | list[str]:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]  # type: ignore[misc]
        return strip_protocol(path).rstrip("/")

    # -- paths: plain, or chained onto a mount ----------------------------------------------------
    def _urlmap(self) -> UrlMap:
        if self._urlmap_cached is None:
            assert self._target_protocol
            self._urlmap_cached = UrlMap(self._target_protocol, self.session.public_mounts())
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

    def _caller_name(self, name: str) -> str:
        """A cache path as the caller addressed it (chained callers get store paths back)."""
        return self._urlmap().to_store_path(name) if self._target_protocol else name

    def _named(self, entry: dict[str, Any]) -> dict[str, Any]:
        """An entry as the caller addressed it, with the fields s3fs's entries have where they
        are known (``ETag``, ``LastModified``)."""
        entry["name"] = self._caller_name(entry["name"])
        return s3_fields(entry)

    def _is_root(self, path: str) -> bool:
        return not self._target_protocol and self._strip_protocol(path) == ""

    # -- the work, blocking ------------------------------------------------------------------------
    def info(self, path: str, refresh: bool = False, **kwargs: Any) -> dict[str, Any]:
        if kwargs.get("version_id") is not None:
            raise NotImplementedError("cachefs: version_id is not supported: the cache reads an object's "
                                      "current version only")
        if self._is_root(path):
            return {"name": "", "size": 0, "type": "directory"}
        cp = self._path(path)
        if cp is None:
            return self._direct().info(path, refresh=refresh)
        return self._named(self.session.info(cp, refresh))

    def ls(self, path: str, detail: bool = False, refresh: bool = False, **kwargs: Any) -> list[Any]:
        if self._is_root(path):
            entries = [{"name": m.name, "size": 0, "type": "directory"} for m in self.session.public_mounts()]
        else:
            cp = self._path(path)
            if cp is None:
                return self._direct().ls(path, detail=detail, refresh=refresh)
            entries = [self._named(e) for e in self.session.list(cp, recursive=False, refresh=refresh)]
        return entries if detail else [e["name"] for e in entries]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        cp = None if maxdepth is not None or withdirs or self._is_root(path) else self._path(path)
        if cp is None:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, **kwargs)
        detail = kwargs.pop("detail", False)
        try:
            entries = [self._named(e) for e in self.session.list(cp, recursive=True)]
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
        if offset == 0:
            self._scan_note(cp)
        return self.session.read(cp, offset, length, version)[0]

    def _scan_note(self, cp: CachePath) -> None:
        """An object read from its start: the objects after it in its directory's order are
        hinted once such reads keep to that order (client/fs/scanahead.py)."""
        if not self.config.scan_ahead:
            return
        scan = self._scan
        if scan is None:
            hinter = self._scan_hinter = Hinter(self.session)

            def hint(keys: list[str]) -> int:
                # What a worker here vouches for is cached already (a warm pass): not sent, and
                # counted as taken. (A socket hint's reply does not say, so no backing off there.)
                cold = [k for k in keys if not self.session.vouched(k)]
                if not cold:
                    return len(keys)
                hinter.reset()  # the scan sends each name once itself; the hinter's memory stays small
                sent = hinter.hint(cold)
                return len(keys) if sent == len(cold) else sent

            def list_pages(directory: CachePath) -> Iterator[list[str]]:
                # Page by page: the scan stops asking at its cap (scanahead.py MAX_LISTING).
                pages = self.session.list_pages(directory, recursive=False)
                try:
                    for page in pages:
                        yield [e["name"].rsplit("/", 1)[-1] for e in page if e["type"] == "file"]
                finally:
                    pages.close()

            scan = self._scan = ScanAhead(list_pages, hint)
        scan.note(cp)

    def prepare(self, ranges: Iterable[tuple[str, int, int | None]], fill: bool = True) -> int:
        """Get ready to read ranges ``(path, start, end)`` (end None: to the object's end): the
        page handles of those on a worker on this host come in one message per worker (cold ones
        fetched into its cache first, all at once, unless ``fill`` is False), and their reads
        then need no message at all. Returns how many are held; only a hint."""
        wanted = []
        for path, start, end in ranges:
            if start is None:
                start = 0
            if start < 0 or (end is not None and end < 0):
                continue  # from the end: the size is not known here
            cp = self._path(path)
            if cp is not None:
                wanted.append((cp, start, -1 if end is None else max(0, end - start)))
        return self.session.prepare(wanted, fill).held if wanted else 0

    def cat_ranges(self, paths: list[str], starts: Any, ends: Any, max_gap: Any = None, on_error: str = "return",
                   **kwargs: Any) -> list[Any]:
        """fsspec's ``cat_ranges``, with the ranges' page handles fetched a batch at a time."""
        if max_gap is not None:
            raise NotImplementedError("max_gap: cachefs reads each range as asked")
        if not isinstance(paths, list):
            raise TypeError("paths must be a list")
        starts = starts if isinstance(starts, list) else [starts] * len(paths)
        ends = ends if isinstance(ends, list) else [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("paths, starts and ends must have the same length")
        out: list[Any] = []
        for i in range(0, len(paths), PREPARE_BATCH):
            chunk = list(zip(paths[i:i + PREPARE_BATCH], starts[i:i + PREPARE_BATCH], ends[i:i + PREPARE_BATCH]))
            self.prepare(chunk)
            for path, start, end in chunk:
                try:
                    out.append(self.cat_file(path, start, end, **kwargs))
                except Exception as exc:
                    if on_error != "return":
                        raise
                    out.append(exc)
        return out

    def cat(self, path: Any, recursive: bool = False, on_error: str = "raise", **kwargs: Any) -> Any:
        """fsspec's ``cat``; a list of plain paths has its page handles fetched a batch at a time."""
        if isinstance(path, list) and not recursive and len(path) > 1 and not any(_GLOB_CHARS & set(p) for p in path):
            out: dict[str, Any] = {}
            for i in range(0, len(path), PREPARE_BATCH):
                chunk = path[i:i + PREPARE_BATCH]
                self.prepare([(p, 0, None) for p in chunk])
                out.update(super().cat(chunk, on_error=on_error, **kwargs))
            return out
        return super().cat(path, recursive=recursive, on_error=on_error, **kwargs)

    def read_into(self, path: str, out: Any, offset: int = 0) -> tuple[int, int]:
        """Fill ``out`` (a writable buffer: numpy array, torch tensor's ``.numpy()``, bytearray)
        with the object's bytes from ``offset``; returns (bytes read, fewer at the object's end;
        the object's size).

        Cached bytes land in ``out`` directly: page files read into it from a worker on this
        host, or received into it from another host's data port; otherwise they come through
        gRPC and are copied in once. Paths are parsed as ``cat_file`` parses them (chained
        ``cachefs::s3://`` URLs included).
        """
        cp = self._path(path)
        if cp is None:  # a chained URL under no mount, read directly (unmounted='direct')
            view = memoryview(out).cast("B")
            direct = self._direct()
            data = direct.cat_file(path, start=offset, end=offset + len(view))
            view[:len(data)] = data
            return len(data), int(direct.info(path)["size"])
        if offset == 0:
            self._scan_note(cp)
        return self.session.read_into(cp, out, offset)

    def read_range(self, cp: CachePath, offset: int, length: int, version: str = "") -> bytes:
        """Bytes [offset, offset+length) (length -1: to the end) of the given version, if any."""
        return self.session.read(cp, offset, length, version)[0]

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
            if not autocommit:
                raise NotImplementedError("cachefs: transactions are not supported: a write is published "
                                          "when its file closes (all or nothing), not at the transaction's end")
            cp = self._write_path(path)
            if mode == "xb" and self._exists_now(path):
                raise FileExistsError(f"{path} exists (mode 'xb')")
            return CacheWriteFile(self, self._writes, cp, "wb", block_size or self.config.block_size)
        cp = self._path(path)
        if cp is None:
            return self._direct().open(path, mode, block_size=block_size, cache_options=cache_options,
                                       cache_type=cache_type, **kwargs)
        # A read follows: from a worker on this host, the info and the first block's page
        # handles come in one message (client/transport/handles.py), not an info RPC and then the read.
        # Only size, version and name are needed here: the s3fs-style fields (ETag, LastModified)
        # come with ``f.details``, built when asked for (~7 us an open otherwise).
        self._scan_note(cp)
        info = self.session.info(cp, read_ahead=block_size or self.config.block_size)
        if info["type"] != "file":
            raise IsADirectoryError(f"{path} is a directory")
        return CacheFile(self, self._caller_name(info["name"]), mode, block_size or self.config.block_size, cache_type=cache_type,
                         cache_options=cache_options, size=info["size"], version=info.get("version", ""), cp=cp)

    def close(self) -> None:
        """Close this process's channels and sockets and stop following the master."""
        if self._scan is not None:
            self._scan.close()
        self.session.close()


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
        return self.fs.session.read(self.cp, start, end - start, self.version)[0]

    def read(self, length: int = -1) -> bytes:
        """Reads to the end (``read()``: pandas, torch.load) and reads of a block or more skip the
        block cache: the bytes come back as the session reads them, not through a cached copy
        that nothing reads again; smaller reads go through the cache as fsspec's do."""
        if self.mode != "rb" or self.closed:
            return super().read(length)
        remaining = max(0, self.size - self.loc)
        to_end = length is None or length < 0 or length >= remaining
        want = remaining if to_end else length
        if want == 0 or (not to_end and want < self.blocksize):
            return super().read(length)
        data = self.fs.session.read(self.cp, self.loc, want, self.version)[0]
        self.loc += len(data)
        return data

    def readinto(self, b: Any) -> int:
        """Straight into ``b`` (page files read into it on this host), pinned to the open version."""
        if self.mode != "rb" or self.closed:
            return super().readinto(b)
        view = memoryview(b).cast("B")
        want = min(len(view), max(0, self.size - self.loc))
        if want == 0:
            return 0
        got, _size = self.fs.session.read_into(self.cp, view[:want], self.loc, self.version)
        self.loc += got
        return got


def split_storage_options(storage_options: dict[str, Any] | None, kwargs: dict[str, Any],
                          own: Callable[..., Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """fsspec-style keywords (``master=...``, as ``fsspec.open`` takes them) moved out of
    ``kwargs`` into the storage options; returns (storage options, the other keywords).

    Keywords that ``own`` (e.g. a dataset's ``__init__``) takes itself stay with it (a dataset's
    ``timeout`` is its own, not the client's). A keyword given both ways is a TypeError, so a
    caller never wonders which one won.
    """
    options = dict(storage_options or {})
    params = inspect.signature(own).parameters if own is not None else {}
    takes_any = own is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = (CacheFileSystem.option_names() | {"skip_instance_cache"}) - set(params)
    rest = {}
    for key, value in kwargs.items():
        if key in names:
            if key in options:
                raise TypeError(f"{key!r} given both as a keyword and in storage_options")
            options[key] = value
        elif key in params or takes_any:
            rest[key] = value
        else:  # refused before any listing or read, naming the keyword
            raise TypeError(f"unexpected keyword argument {key!r} (neither a dataset argument "
                            f"nor a cachefs client option)")
    return options, rest
