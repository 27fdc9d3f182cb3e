"""The worker's view of the object stores behind its mounts.

Three jobs: object metadata (size and *version*, which is part of every cached page's
identity) cached with a TTL; listings cached with a TTL; and ranged reads that are checked
against the version the reader opened, so that a read never mixes two versions of an object.
How the version is checked depends on the store (backends.py).
"""

from __future__ import annotations

import bisect
import errno
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Generic, TypeVar

from cachefs.config import S3_CLIENTS
from cachefs.errors import CacheFSError, InvalidPathError, StaleObjectError, StoreError, StoreUnavailableError
from cachefs.mounts import MountTable, ResolvedPath
from cachefs.paths import CachePath
from cachefs.store.backends import PieceSink, _Backend, _backend_for, _mtime_of, version_of
from cachefs.store.health import StoreBreaker
from cachefs.store.listed import ListedEntries, ListedObjects, Relisted
from cachefs.store.listings import Chunk, ListingCache
from cachefs.store.meta import Listing, ObjectMeta
from cachefs.store.metatable import MetadataTable
from cachefs.store.revalidate import PagedDirectorySizes, Revalidator
from cachefs.store.write import StoreWriter, copy_between, make_dir, open_writer
from cachefs.store.write import remove as remove_path

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """A bounded map whose entries expire; the oldest entries go first when full."""

    def __init__(self, ttl: float, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._data: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            if item[0] <= self._clock():
                del self._data[key]
                return None
            return item[1]

    def put(self, key: K, value: V) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            self._data[key] = (self._clock() + self.ttl, value)
            self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)

    def pop(self, key: K) -> None:
        with self._lock:
            self._data.pop(key, None)

    def pop_where(self, predicate: Callable[[K], bool]) -> None:
        with self._lock:
            for key in [k for k in self._data if predicate(k)]:
                del self._data[key]


_PASS_THROUGH = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, TimeoutError,
                 CacheFSError)


@contextmanager
def _store_errors(path: CachePath, what: str) -> Iterator[None]:
    """Errors from the store keep their meaning (missing, denied...); anything else (a refused
    connection, botocore's own exception types) becomes a StoreError that names the object."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:  # a key the store's file system cannot name
            raise InvalidPathError(f"{path}: a name in the key is too long for this store") from exc
        if isinstance(exc, _PASS_THROUGH):
            raise
        raise StoreError(f"{path}: object store {what} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - translated, with the cause kept
        raise StoreError(f"{path}: object store {what} failed: {exc}") from exc


class CacheFSErrorPassThrough(CacheFSError):
    """Carries a store error that must keep its own type through _store_errors."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.errno, str(error))
        self.error = error


#: How long a client may keep using metadata past its TTL (within the stale grace) that came with
#: page handles: the background refresh it set off lands well within it.
STALE_HOLD = 2.0
OPEN_JOIN_SECONDS = 120.0  # how long a caller waits on another's open of the same object
LIST_CACHE_BYTES = 256 << 20  # listings kept, estimated bytes at most (WorkerConfig.list_cache_bytes)
METADATA_CACHE_BYTES = 1 << 30  # objects' metadata kept, bytes at most (WorkerConfig.metadata_cache_bytes)
LIST_CHUNK = 1000  # entries a store listing request returns at most (S3's own page)


class ObjectStore:
    """Metadata, listings and versioned ranged reads over every mount."""

    def __init__(self, mounts: MountTable, metadata_ttl: float = 30.0, list_ttl: float = 30.0,
                 metadata_cache_bytes: int = METADATA_CACHE_BYTES, breaker: StoreBreaker | None = None, stale_grace: float = 0.0,
                 s3_client: str = "auto", list_cache_bytes: int = LIST_CACHE_BYTES):
        if s3_client not in S3_CLIENTS:
            raise ValueError(f"s3_client must be one of {', '.join(S3_CLIENTS)}, got {s3_client!r}")
        self.mounts = mounts
        self.s3_client = s3_client  # which client S3 data reads take (backends.py)
        # Per mount: after a few connection failures in a row, fail at once (see health.py).
        self.breaker = breaker or StoreBreaker()
        self._meta = MetadataTable(metadata_ttl, max_bytes=metadata_cache_bytes, grace=stale_grace)
        # Stale-while-revalidate: past its TTL (within the grace) an entry is still used, and
        # refreshed in the background, one refresh per object at a time, many of one directory
        # by one listing (revalidate.py).
        self.revalidator = Revalidator(self._refresh_one, self._list_to_refresh, self._fresh, relist_after=metadata_ttl)
        # Directory sizes from paged listings, for the revalidator's listings of run-out objects.
        self._paged_sizes = PagedDirectorySizes(self.revalidator.note_listing)
        # Listings by (path, recursive), in chunks shared by simultaneous listers (listings.py).
        self._lists = ListingCache(list_ttl, list_cache_bytes)
        self._backends: dict[int, _Backend] = {}
        # One thread makes a mount's backend, the others wait for it: an S3 one builds a botocore
        # client (tenths of a second), and a worker's first cold reads (one per fill thread)
        # each built their own at once (bench_read's cold small_conc: p99 1 s, 0.51x the previous).
        self._backend_lock = threading.Lock()
        # Called with each object's metadata fresh from the store: the worker drops the pages of
        # any other version it still holds (and with them the handles local clients hold on them).
        self.on_fetched: Callable[[ObjectMeta], None] | None = None
        # The same for a listing's objects, a chunk at a time (the entries, and the keys of those
        # that are objects; else on_fetched, one by one).
        self.on_listed: Callable[[ListedEntries, list[str], Relisted | None], None] | None = None
        # Called when metadata is dropped before it runs out (the object deleted or changed, a
        # path or mount invalidated): with the path, or None for a whole mount.
        # The worker stops vouching for those objects' versions (server/worker/names.py).
        self.on_forgotten: Callable[[CachePath | None], None] | None = None
        # Called once per request sent to the store, with its kind (info, open, list, read):
        # the worker counts them (a cold epoch should cost one request per object, no more).
        self.on_request: Callable[[str], None] | None = None
        self._opening: dict[CachePath, Future[tuple[ObjectMeta, bytes | None]]] = {}  # single flight
        self._open_lock = threading.Lock()
        self.opens_joined = 0  # opens that shared another caller's request

    def _count(self, kind: str) -> None:
        counter = self.on_request
        if counter is not None:
            counter(kind)

    def _forgotten(self, path: CachePath | None) -> None:
        listener = self.on_forgotten
        if listener is not None:
            try:
                listener(path)
            except Exception:  # never let a listener fail the read that found out
                log.exception("metadata listener failed for %s", path)

    def _drop(self, path: CachePath) -> None:
        """Forget ``path``'s metadata now (not merely expired: gone, changed, or invalidated)."""
        self._meta.pop(path)
        self._forgotten(path)

    def _remember(self, path: CachePath, meta: ObjectMeta) -> None:
        listener = self.on_fetched
        if listener is not None and not meta.is_dir:
            try:
                listener(meta)
            except Exception:  # never let a listener fail a metadata refresh
                log.exception("metadata listener failed for %s", path)
        self._meta.put(path, meta)

    def _remember_listed(self, entries: ListedEntries, keys: list[str], known_only: bool,
                         rows: list[tuple[str, int, str | None, float, bool]] | None = None,
                         listing: Hashable | None = None) -> None:
        """A listing's objects (``keys``: their keys; ``rows``: the entries' fields, where at hand:
        (key, size, version or None where derived, mtime, is_dir)): the listener hears of them, the
        table keeps them (``known_only``: those of directories it has entries in), its lock taken
        once a batch. ``listing``: what was listed, where it is a whole listing with its rows: one
        the same as the last listing of it (its digest) extends what that one put instead of
        putting every row again (a warm epoch past the TTL refreshes every directory unchanged)."""
        objects = [i for i, key in enumerate(keys) if not entries.is_dir(i)]
        relisted = None
        if listing is not None and rows is not None and not known_only:
            digest = entries.digest()
            relisted = Relisted(listing, digest, self._meta.extend_listed(listing, digest))
        try:
            if self.on_listed is not None:
                self.on_listed(entries, [keys[i] for i in objects], relisted)
            elif self.on_fetched is not None:
                for i in objects:
                    self.on_fetched(entries[i])
        except Exception:  # never let a listener fail a listing
            log.exception("metadata listener failed for a listing of %d objects", len(objects))
        if known_only:  # asked once a directory (a listing's entries come directory by directory)
            known, last_dir, last_known = [], None, False
            for i in objects:
                directory = keys[i].rpartition("/")[0]
                if directory != last_dir:
                    last_dir, last_known = directory, self._meta.knows_directory(entries.mount, keys[i])
                if last_known:
                    known.append(i)
            objects = known
        if relisted is not None and relisted.unchanged:
            return
        if rows is None:
            self._meta.put_many([entries[i] for i in objects])
        elif relisted is not None:
            self._meta.put_rows(entries.mount, [rows[i] for i in objects], listing, relisted.digest)
        else:
            self._meta.put_rows(entries.mount, [rows[i] for i in objects])

    @contextmanager
    def _call(self, path: CachePath, what: str) -> Iterator[None]:
        """One store call: refused at once while the mount's breaker is open, else run, its
        outcome counted, and errors translated (a connection failure -> StoreUnavailableError)."""
        self.breaker.check(path.mount, f"{path}: {what}")
        try:
            with _store_errors(path, what):
                yield
        except Exception as exc:
            if self.breaker.record(path.mount, exc) and not isinstance(exc, StoreUnavailableError):
                raise StoreUnavailableError(f"{path}: {what}: {StoreUnavailableError.MARKER}: {exc}") from exc
            raise
        self.breaker.record(path.mount, None)

    def _backend(self, resolved: ResolvedPath) -> _Backend:
        backend = self._backends.get(id(resolved.fs))
        if backend is None:
            with self._backend_lock:
                backend = self._backends.get(id(resolved.fs))
                if backend is None:
                    backend = self._backends[id(resolved.fs)] = _backend_for(resolved.fs, self.s3_client)
        return backend

    def _revalidate(self, path: CachePath) -> None:
        """Refresh an expired entry in the background (the caller goes on with the old one)."""
        self.revalidator.submit(path)

    def _refresh_one(self, path: CachePath) -> None:
        self.info(path, refresh=True)

    def _list_to_refresh(self, directory: CachePath) -> Container[CachePath]:
        return ListedObjects(self.list(directory, refresh=True))

    def _fresh(self, path: CachePath) -> bool:
        found = self._meta.get_with_expiry(path)
        return found is not None and found[1] > time.monotonic()

    def cached_info(self, path: CachePath) -> ObjectMeta | None:
        """What is known of ``path`` without asking the store (None: not known, or expired)."""
        return self._meta.get(path)

    @property
    def stale_grace(self) -> float:
        """How long past its TTL metadata is still used (refreshed behind the read)."""
        return self._meta.grace

    def cached_info_until(self, path: CachePath) -> tuple[ObjectMeta, float, bool] | None:
        """What a read would use, with no store call: fresh metadata and when it expires, or
        metadata past its TTL but within the stale grace (refreshed in the background, as
        :meth:`info` does), trusted for at most ``STALE_HOLD`` seconds more; and whether it is
        that stale kind."""
        return self.cached_infos_until([path])[0]

    def cached_infos_until(self, paths: list[CachePath]) -> list[tuple[ObjectMeta, float, bool] | None]:
        """``cached_info_until`` of each, the refreshes of those past their TTL queued together
        (Revalidator.submit_many)."""
        out: list[tuple[ObjectMeta, float, bool] | None] = []
        stale: list[CachePath] = []
        now = time.monotonic()
        for path in paths:
            found = self._meta.get_with_expiry(path)
            if found is None:
                out.append(None)
                continue
            meta, expiry = found
            if expiry > now:
                out.append((meta, expiry, False))
            else:
                stale.append(path)
                out.append((meta, min(now + STALE_HOLD, expiry + self._meta.grace), True))
        if stale:
            self.revalidator.submit_many(stale)
        return out

    def info(self, path: CachePath, refresh: bool = False) -> ObjectMeta:
        if not refresh:
            found = self._meta.get_stale(path)
            if found is not None:
                if not found[1]:
                    self._revalidate(path)
                return found[0]
            # Nothing left to serve from (past the grace: a long epoch): a listing of the
            # directory, once many of it ran out, rather than a HEAD each (revalidate.py).
            if self.revalidator.refresh_expired(path):
                meta = self._meta.get(path)
                if meta is not None:
                    return meta
        resolved = self.mounts.resolve(path)
        try:
            with self._call(path, "info"):
                self._count("info")
                size, version, mtime, is_dir = self._backend(resolved).info(resolved.fs, resolved.store_path)
        except FileNotFoundError as exc:
            self._drop(path)
            raise FileNotFoundError(f"{path}: no such object") from exc
        meta = ObjectMeta(path, size, version, mtime, is_dir)
        self._remember(path, meta)
        return meta

    def open(self, path: CachePath, head_bytes: int,
             adopt: Callable[[ObjectMeta, bytes], bool] | None = None) -> tuple[ObjectMeta, bytes | None]:
        """Metadata for a read, plus the object's first ``head_bytes`` when they came for free.

        On a cold S3 object this is one GET where info() then read() would be a HEAD and a GET:
        half the requests for a small object, which is what cold epochs are made of. Callers
        opening the same object at once (a read and a hinted load, say) share one request:
        the first one's ``adopt`` takes the head bytes (the page reader) before the others go
        on, so they find its pages in flight; with ``adopt`` the head is returned only to the
        caller whose ``adopt`` took it.
        """
        cached = self._meta.get(path)
        if cached is not None:
            return cached, None
        with self._open_lock:
            shared = self._opening.get(path)
            leader = shared is None
            if leader:
                shared = self._opening[path] = Future()
            else:
                self.opens_joined += 1
        if not leader:
            try:  # the first caller's answer, its error included (asked at the same moment)
                return shared.result(timeout=OPEN_JOIN_SECONDS)[0], None
            except FutureTimeout:  # a store this slow: ask on our own
                return self.info(path), None
        try:
            meta, head = self._open_uncached(path, head_bytes)
            if adopt is not None:
                head = head if head is not None and not meta.is_dir and adopt(meta, head) else None
            # Known only now: a caller arriving before the pages were adopted would fetch them.
            self._remember(path, meta)
        except BaseException as exc:
            shared.set_exception(exc)
            raise
        else:
            shared.set_result((meta, head))
        finally:
            with self._open_lock:
                self._opening.pop(path, None)
        return meta, head

    def _open_uncached(self, path: CachePath, head_bytes: int) -> tuple[ObjectMeta, bytes | None]:
        resolved = self.mounts.resolve(path)
        try:
            with self._call(path, "read"):
                self._count("open")
                (size, version, mtime, is_dir), head = self._backend(resolved).head_read(
                    resolved.fs, resolved.store_path, head_bytes)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{path}: no such object") from exc
        meta = ObjectMeta(path, size, version, mtime, is_dir)
        if head is not None and len(head) != min(size, head_bytes):
            head = None  # not what we asked for: fetch normally
        return meta, head

    def list(self, path: CachePath, recursive: bool = False, refresh: bool = False) -> Sequence[ObjectMeta]:
        """The whole listing of ``path``, sorted by key (kept for ``list_ttl``; a sequence whose
        items are made when taken: listed.py)."""
        cache_key = (path, recursive)
        if not refresh:
            cached = self._lists.whole(cache_key)
            if cached is not None:
                return cached
        resolved = self.mounts.resolve(path)
        fs = resolved.fs
        try:
            with self._call(path, "listing"):
                self._count("list")
                if recursive:
                    raw = self._backend(resolved).find(fs, resolved.store_path)
                else:
                    raw = self._backend(resolved).ls(fs, resolved.store_path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{path}: no such directory") from exc
        entries = self._listed(path, raw, str(resolved.store_path), listing=cache_key)
        entries = self._lists.put_whole(cache_key, entries).entries
        self._note_listing(path, recursive, entries)
        return entries

    def list_chunk(self, path: CachePath, recursive: bool, after: str, refresh: bool = False) -> Chunk:
        """A chunk of ``path``'s listing holding the entries right after the name ``after`` ("": from
        the first), as many as one store request gives (listings.py): a page of a million-key
        listing without listing the whole prefix first. Listers of one prefix share the chunks;
        a store that cannot page is listed whole (and kept) as before. ``refresh``: ask the store
        afresh (for a listing's first page only: later pages never refresh mid-listing)."""
        cache_key, refresh = (path, recursive), refresh and not after
        resolved = self.mounts.resolve(path)
        below = f"{path}/"
        if after and not after.startswith(below):
            if after > below:  # past every name below the path
                return Chunk(after, [], True)
            after = ""

        def fetch(start: str) -> tuple[ListedEntries | list[ObjectMeta], bool]:
            try:
                with self._call(path, "listing"):
                    found = self._backend(resolved).list_after(resolved.fs, resolved.store_path, recursive,
                                                               start[len(below):], LIST_CHUNK)
                    if found is not None:  # else no request was made: list() makes (and counts) it
                        self._count("list")
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"{path}: no such directory") from exc
            if found is None or (not start and found == ([], True)):
                # No paging here, or nothing below the path (a file's own path lists the file itself):
                # the whole listing, as before.
                return [m for m in self.list(path, recursive, refresh and not start) if str(m.path) > start], True
            entries = self._listed(path, found[0], str(resolved.store_path), remember="known")
            if entries:
                keys = [entries.key(i) for i in range(len(entries)) if not entries.is_dir(i)]
                self._paged_sizes.chunk(cache_key, path, start[len(path.mount) + 1:] if start else None, keys,
                                        entries.key(len(entries) - 1), found[1])
            elif not start and found[1]:
                self._note_listing(path, recursive, entries)
            return entries, found[1]

        return self._lists.chunk(cache_key, after, fetch, refresh=refresh)

    def list_page(self, path: CachePath, after: str, limit: int = LIST_CHUNK) -> tuple[list[ObjectMeta], str, bool]:
        """Up to ``limit`` objects below ``path`` (recursively) whose names sort after ``after``
        ("": from the first), asked of the store in one request; the last name that request
        covered (where the next page starts: a page of directories only has no object), and
        whether it was the last page.
        Kept nowhere, neither in the listing cache nor in the metadata table: a load job's listing
        passes through the master once, and ten million objects must not fill its memory. A
        store that cannot page is listed whole (``list``, kept as any whole listing is) and cut."""
        below = f"{path}/"
        if after and not after.startswith(below):
            if after > below:  # past every name below the path
                return [], after, True
            after = ""
        resolved = self.mounts.resolve(path)
        try:
            with self._call(path, "listing"):
                found = self._backend(resolved).list_after(resolved.fs, resolved.store_path, True,
                                                           after[len(below):], limit)
                if found is not None:
                    self._count("list")
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{path}: no such directory") from exc
        if found is None:
            whole = self.list(path, recursive=True, refresh=not after)
            start = bisect.bisect_right(whole, after, key=lambda m: str(m.path))
            entries = whole[start:start + limit]
            final = start + limit >= len(whole)
        else:
            entries = self._listed(path, found[0], str(resolved.store_path), remember="")
            final = found[1]
        last = str(entries[-1].path) if entries else after
        return [m for m in entries if not m.is_dir], last, final or not entries

    def _listed(self, path: CachePath, raw: Listing, below: str = "", remember: str = "all",
                listing: Hashable | None = None) -> ListedEntries:
        """A store's listing entries (info dicts, or ``ListedEntry`` tuples) as columns (listed.py),
        in name order.
        ``remember``: "all": each object's metadata is kept (a whole listing is a free metadata
        refresh: the revalidator lists a directory to refresh many objects at once); "known": only
        those of directories the metadata table has entries in (a paged listing of a million
        objects never read would add a million entries, most of its CPU, for reads whose own
        request brings the metadata anyway); "": none (a load job's). Unless "", the listener
        hears of every object (the worker drops pages of other versions).
        ``below``: the listed path's store path, where the entries' names are it, "/" and their
        rest (the paged listings': their keys found without the store's path parsing).
        ``listing``: the whole listing's name (_remember_listed)."""
        rows = []
        cut, head = len(below) + 1, f"{path.key}/" if path.key else ""
        for info in raw:
            if type(info) is tuple:
                name, size, version, mtime, is_dir = info
            else:
                name, is_dir = info["name"], info.get("type") == "directory"
                size = 0 if is_dir else int(info.get("size") or 0)
                version, mtime = "" if is_dir else version_of(info), _mtime_of(info)
            key = head + name[cut:] if below and name.startswith(below) and name[cut - 1:cut] == "/" \
                else self.mounts.to_key(path, name)
            rows.append((key, size, version, mtime, is_dir))
        if any(a[0] > b[0] for a, b in zip(rows, rows[1:])):  # a paged walk gives them in order already
            rows.sort(key=lambda row: row[0])
        entries = ListedEntries(path.mount)
        for row in rows:
            entries.add(*row)
        keys = [row[0] for row in rows]
        if remember:  # all kept: from the rows themselves, no metadata object each
            self._remember_listed(entries, keys, known_only=remember == "known",
                                  rows=rows if remember == "all" else None, listing=listing)
        return entries

    def _note_listing(self, path: CachePath, recursive: bool, entries: ListedEntries) -> None:
        """How large each directory of a whole listing is: whether a listing can refresh it (revalidate.py)."""
        per_dir: dict[str, int] = {} if recursive else {path.key: 0}
        for i in range(len(entries)):
            if not entries.is_dir(i):
                directory = entries.key(i).rpartition("/")[0]  # revalidate.parent_of's key
                per_dir[directory] = per_dir.get(directory, 0) + 1
        for directory, objects in per_dir.items():
            self.revalidator.note_listing(CachePath(path.mount, directory), objects)

    def read(self, meta: ObjectMeta, start: int, end: int) -> bytes:
        """Bytes [start, end) of the version described by ``meta``; StaleObjectError if it changed."""
        resolved = self.mounts.resolve(meta.path)
        try:
            with self._call(meta.path, "read"):
                self._count("read")
                return self._backend(resolved).read(resolved.fs, resolved.store_path, start, end, meta.version)
        except (StaleObjectError, FileNotFoundError):
            self._drop(meta.path)  # the next reader asks the store afresh
            raise

    def read_pieces(self, meta: ObjectMeta, start: int, sizes: Sequence[int], deliver: PieceSink) -> None:
        """Like read(), cut in pieces of ``sizes`` handed to ``deliver(i, piece)`` in order as they come.

        Pieces already delivered when an error is raised are good (same version); the rest never come.
        """
        resolved = self.mounts.resolve(meta.path)
        try:
            with self._call(meta.path, "read"):
                self._count("read")
                self._backend(resolved).read_pieces(resolved.fs, resolved.store_path, start, sizes, meta.version,
                                                    deliver)
        except (StaleObjectError, FileNotFoundError):
            self._drop(meta.path)
            raise

    def prepare(self, names: Iterable[str]) -> None:
        """Make the backends of mounts ``names`` now (a mount that cannot be resolved is left to its
        first read, which says why): off the first reads' time."""
        for name in names:
            try:
                self._backend(self.mounts.resolve(CachePath(name, "")))
            except Exception as exc:  # noqa: BLE001 - the first read reports it
                log.debug("backend of mount %s not prepared: %s", name, exc)

    def forget_mount(self, name: str) -> None:
        """A mount changed or went away: nothing cached about it may be trusted."""
        self._meta.pop_prefix(name, "")
        self._lists.forget(lambda k: k[0].mount == name)
        self._forgotten(None)

    def forget_prefix(self, mount: str, prefix: str) -> None:
        """Drop the metadata of every key starting with ``prefix`` (and the mount's listings),
        so what is read or loaded after a free is looked up afresh."""
        self._meta.pop_prefix(mount, prefix)
        self._lists.forget(lambda k: k[0].mount == mount)
        # (Not told to on_forgotten: both callers, a free and a remove, delete the pages under
        # the prefix, so nothing of it can be read by name; telling would have to clear every
        # other object's name entry too, and freeing one data set made the next warm epoch of
        # another ask the worker for every batch.)

    def invalidate(self, path: CachePath) -> None:
        self._drop(path)
        self._lists.forget(lambda k: k[0].mount == path.mount)


    # -- write-through ------------------------------------------------------------------------
    @staticmethod
    @contextmanager
    def _write_errors(path: CachePath, what: str) -> Iterator[None]:
        """As _store_errors, and an existing target or a non-empty directory keep their meaning."""
        try:
            with _store_errors(path, what):
                try:
                    yield
                except OSError as exc:
                    if isinstance(exc, FileExistsError) or exc.errno == errno.ENOTEMPTY:
                        raise CacheFSErrorPassThrough(exc) from exc
                    raise
        except CacheFSErrorPassThrough as wrapped:
            raise wrapped.error from wrapped.error.__cause__

    def writable(self, path: CachePath) -> ResolvedPath:
        """Where a write to ``path`` goes; PermissionError on a read-only mount or a mount's root."""
        resolved = self.mounts.resolve(path)
        if resolved.spec.read_only:
            raise PermissionError(errno.EROFS, f"{path}: mount {path.mount!r} is read-only")
        if not path.key:
            raise PermissionError(errno.EPERM, f"{path}: the root of a mount cannot be written or removed")
        return resolved

    def open_write(self, path: CachePath, block_size: int | None = None) -> "StoreWriter":
        """A writer that replaces ``path`` whole on commit (see write.py)."""
        resolved = self.writable(path)
        with self._write_errors(path, "write"):
            return open_writer(resolved, block_size)

    def written(self, path: CachePath) -> ObjectMeta:
        """After a write: forget what we knew of ``path`` and its listings, return its new metadata."""
        self.invalidate(path)
        self._forget_parents(path)
        return self.info(path, refresh=True)

    def _forget_parents(self, path: CachePath) -> None:
        """Directories above a changed path may have appeared or (on S3, when emptied) vanished."""
        key = path.key
        while key:
            key = key.rpartition("/")[0]
            self._meta.pop(CachePath(path.mount, key))

    def remove(self, path: CachePath, recursive: bool = False) -> None:
        resolved = self.writable(path)
        meta = self.info(path, refresh=True)  # FileNotFoundError if there is nothing to remove
        try:
            with self._write_errors(path, "remove"):
                remove_path(resolved, path, meta.is_dir, recursive)
        finally:
            self.forget_prefix(path.mount, path.key)  # the path and everything below it
            self._forget_parents(path)

    def make_dir(self, path: CachePath, create_parents: bool = True, exist_ok: bool = False) -> None:
        resolved = self.writable(path)
        with self._write_errors(path, "mkdir"):
            make_dir(resolved, create_parents, exist_ok)
        self.invalidate(path)
        self._forget_parents(path)

    def copy(self, source: CachePath, destination: CachePath) -> ObjectMeta:
        dst = self.writable(destination)
        if self.info(source, refresh=True).is_dir:  # as fsspec's local cp_file: make the directory
            self.make_dir(destination, create_parents=True, exist_ok=True)
            return self.info(destination, refresh=True)  # FileNotFoundError on S3: it has no empty dirs
        with self._write_errors(destination, "copy"):
            copy_between(self.mounts.resolve(source), dst)
        return self.written(destination)
