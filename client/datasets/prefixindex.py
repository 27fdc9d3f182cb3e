"""A prefix's sample index for ``CacheDataset.from_prefix``: listed a page at a time, kept
between starts, and rechecked against the store in the background.

Listing: ``Session.list_pages`` hands the listing over a page at a time; each page's files go
into an ``IndexBuilder`` (client/datasets/sampleindex.py) and the page is dropped, so no object per entry
outlives its page. The listing's fingerprint (count, a digest of every name, size and version,
the newest modification time) is taken on the way.

Keeping (``kept_index="auto"`` or ``"refresh"``): the index is written, tmp + rename, as one binary
file in the kept-index directory (``index_cache``, else ``CACHEFS_INDEX_CACHE``, as
client/datasets/indexcache.py's shard indexes; ``""`` keeps nothing), named by the prefix and the cluster it was listed from. It maps
in milliseconds, so a restart skips the listing: the reason to keep it. So it cannot be keyed by
the listing itself; the staleness rule instead:

* ``"auto"``: a kept index is used at once, and a background thread lists the prefix again
  (``ds.index_check``, a Future of a ``Recheck``). If the fingerprint differs, a warning says
  so, this run keeps the index it started with (an epoch's order, resume points and per-rank
  counts stand on it; a changed object is read as it is now, a deleted one fails its read by
  name), and the fresh listing replaces the kept file, so the next start uses it. With no kept
  index, ``"auto"`` lists and keeps.
* ``"refresh"``: list now, and keep what was listed.
* ``None`` (the default): list, keep nothing, as before kept indexes: a data set that changes
  between runs is never read from an old listing unless asked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from cachefs.client import forksafe
from cachefs.client.datasets import indexcache
from cachefs.client.datasets.sampleindex import IndexBuilder, SampleIndex, trim_heap

log = logging.getLogger(__name__)

__all__ = ["MODES", "Fingerprint", "JobHandoff", "KeptIndexes", "Recheck", "job_token", "list_prefix", "open_prefix",
           "recheck"]

MODES = (None, "auto", "refresh")
SUFFIX = ".cfsidx"
#: A listing this long gives its pages' freed memory back to the OS (sampleindex.trim_heap).
TRIM_AFTER = 100_000
#: Rank 0's index for the other ranks of one job is removed by a later job's rank 0 after this long.
JOB_FILES_KEPT = 86400.0


class Fingerprint:
    """What a listing was: count, digest of (name, size, version) in order, newest mtime."""

    def __init__(self) -> None:
        self.count, self.newest = 0, 0.0
        self._h = hashlib.blake2b(b"cachefs-listing:1:", digest_size=16)

    def add(self, name: str, size: int, version: str, mtime: Any) -> None:
        self.count += 1
        self._h.update(f"{name}\0{size}\0{version}\n".encode())
        self.newest = max(self.newest, float(mtime or 0))

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "digest": self._h.hexdigest(), "newest_mtime": self.newest}


def list_prefix(fs: Any, url: str, refresh: bool = False,
                page: Callable[[list[str], list[int]], None] | None = None) -> tuple[SampleIndex, dict[str, Any]]:
    """Files below ``url`` (sorted by path, ``cachefs://`` + name) and the listing's fingerprint.

    A page at a time from the workers where ``url`` is a cachefs path; through ``fs.find``
    otherwise (a chained URL read directly), as ``from_prefix`` did before. ``refresh``: the
    store's listing now, not one the workers cached (a recheck). ``page(names, sizes)``: told
    each page's files as they come (liststream.py), which must then come in name order."""
    builder, fp = IndexBuilder(), Fingerprint()
    cp = None if fs._is_root(url) else fs._path(url)
    named = fs._caller_name
    names: list[str] = []
    sizes: list[int] = []

    def add(entry: dict[str, Any]) -> None:
        if entry.get("type", "file") == "file":
            name = named(entry["name"])
            builder.add(f"cachefs://{name}", int(entry["size"]))
            fp.add(name, int(entry["size"]), str(entry.get("version", "")), entry.get("mtime"))
            if page is not None:
                names.append(name)
                sizes.append(int(entry["size"]))

    def told() -> None:
        if page is None or not names:
            return
        if not (builder.sorted and builder.unique):  # positions handed out stand for listing ranks
            raise ValueError(f"the listing of {url} came out of name order (or named an object twice) at "
                             f"{names[-1]!r}; the first epoch cannot read it as it streams: pass stream=False")
        page(names[:], sizes[:])
        names.clear()
        sizes.clear()

    if cp is None:
        for entry in sorted(fs.find(url, detail=True, refresh=refresh).values(), key=lambda e: e["name"]):
            add(entry)
        told()
    else:
        try:
            for listed in fs.session.list_pages(cp, recursive=True, refresh=refresh):
                for entry in listed:
                    add(entry)
                del listed
                told()
        except FileNotFoundError:
            pass
        if not len(builder):  # a file's listing is that file, as fs.find has it
            try:
                info = fs.info(url)
            except FileNotFoundError:
                info = None
            if info is not None and info.get("type") == "file":
                add(info)
                told()
    if not len(builder):
        raise FileNotFoundError(f"no objects below {url}")
    # Pages come in name order; a listing that did not (a store's fallback) is sorted here.
    index = builder.finish(sort=True, meta={"url": url, "listing": fp.as_dict(), "listed_at": time.time()})
    if len(index) >= TRIM_AFTER:
        trim_heap()  # the pages' dicts are gone: their memory too
    return index, fp.as_dict()


class KeptIndexes:
    """Kept map-dataset indexes, one binary file per (prefix, cluster)."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = indexcache.default_dir() if directory is None else directory

    @staticmethod
    def key(url: str, storage_options: dict[str, Any]) -> str:
        where = {k: str(storage_options.get(k, "")) for k in ("master", "workers", "target_protocol")}
        doc = json.dumps(["map", url.rstrip("/"), where], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()

    def file(self, key: str) -> str:
        return os.path.join(self.directory, key + SUFFIX)

    def load(self, key: str, url: str) -> SampleIndex | None:
        if not self.directory:
            return None
        try:
            index = SampleIndex.open(self.file(key))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as exc:  # unreadable, torn, another format: list again
            log.warning("ignoring the kept sample index %s: %s", self.file(key), exc)
            return None
        if index.meta.get("url", "").rstrip("/") != url.rstrip("/"):
            return None
        return index

    def save(self, key: str, index: SampleIndex) -> str | None:
        """Keep ``index``; a failure (read-only home, full disk) costs only the next listing."""
        if not self.directory:
            return None
        try:
            return indexcache.write_whole(self.directory, os.path.basename(self.file(key)), index.write)
        except OSError as exc:
            log.warning("could not keep the sample index in %s: %s", self.directory, exc)
            return None


@dataclass
class Recheck:
    """A kept index checked against a fresh listing."""

    stale: bool
    kept: dict[str, Any]  # the kept index's fingerprint
    listed: dict[str, Any]  # the fresh listing's
    seconds: float


def recheck(make_fs: Any, url: str, index: SampleIndex, kept: KeptIndexes, key: str) -> Future[Recheck]:
    """List ``url`` again on a daemon thread; warn, and keep the fresh listing, if it changed."""
    future: Future[Recheck] = Future()
    before = dict(index.meta.get("listing") or {})

    def run() -> None:
        t0 = time.monotonic()
        try:
            fs = make_fs()
            try:
                fresh, listed = list_prefix(fs, url, refresh=True)
            finally:
                fs.close()
            stale = listed != before
            if stale:
                log.warning("the kept index of %s is stale (kept: %s; listed now: %s): this run reads the "
                            "kept one; the fresh listing is kept for the next start (kept_index='refresh' lists "
                            "at once)", url, before, listed)
                kept.save(key, fresh)
            future.set_result(Recheck(stale, before, listed, time.monotonic() - t0))
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            log.warning("could not recheck the kept index of %s: %s", url, exc)
            future.set_exception(exc)

    future.set_running_or_notify_cancel()
    threading.Thread(target=run, name="cachefs-index-recheck", daemon=True).start()
    return future


# -- one lister per job: rank 0 lists, the other ranks map what it kept -------------------------------
def job_token(rank: int, world_size: int) -> str:
    """What every rank of one run agrees on without talking: ``$CACHEFS_JOB_ID``, else torchrun's
    ``$TORCHELASTIC_RUN_ID`` with its restart count (a restarted run lists again), else a token
    rank 0 broadcasts over torch.distributed when it is initialized; "" where there is none
    (every rank then lists, as before)."""
    if os.environ.get("CACHEFS_JOB_ID"):
        return "cachefs:" + os.environ["CACHEFS_JOB_ID"]
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"torchelastic:{run}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
            box = [uuid.uuid4().hex if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)  # every rank is in from_prefix: a collective is safe here
            return f"dist:{box[0]}"
    except Exception as exc:  # noqa: BLE001 - no token: every rank lists
        log.warning("could not agree on a job token over torch.distributed (%s): every rank lists", exc)
    return ""


class JobHandoff:
    """Rank 0's index of one run, as a file the other ranks of that run wait for and map.

    Named by the kept-index key and the run's token (``job_token``), so a rank never takes
    another run's listing, nor a kept index that a recheck replaced meanwhile: every rank of the
    run reads the very index rank 0 reads. A failed listing leaves ``<file>.failed`` with why."""

    def __init__(self, directory: str, key: str, token: str, url: str) -> None:
        tag = hashlib.sha256(token.encode()).hexdigest()[:16]
        self.directory, self.url = directory, url
        self.file = os.path.join(directory, f"{key}.job-{tag}{SUFFIX}")
        self.failed = self.file + ".failed"

    def publish(self, index: SampleIndex) -> None:
        """Rank 0: hand ``index`` over (a hard link of a kept file it mapped, else a copy)."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            tmp = f"{self.file}.{forksafe.pid()}.tmp"
            linked = False
            if index.path and index._fd >= 0:
                try:
                    os.link(index.path, tmp)
                    linked = os.stat(tmp).st_ino == os.fstat(index._fd).st_ino  # not one renamed in since
                    if not linked:
                        os.unlink(tmp)
                except OSError:
                    linked = False
            if not linked:
                with open(tmp, "wb") as f:
                    index.write(f)
            os.replace(tmp, self.file)
        except OSError as exc:
            self.fail(exc)
            raise
        self._sweep()

    def fail(self, exc: BaseException) -> None:
        """Rank 0: tell the other ranks at once that there is no index to wait for."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            with open(self.failed, "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
        except OSError as err:
            log.warning("could not tell the other ranks that listing %s failed: %s", self.url, err)

    def wait(self, rank: int, timeout: float) -> SampleIndex:
        """Ranks > 0: rank 0's index, once it is there; an error naming what is missing after ``timeout``."""
        t0, delay = time.monotonic(), 0.01
        while True:
            if os.path.exists(self.file):
                index = SampleIndex.open(self.file)
                if index.meta.get("url", "").rstrip("/") != self.url.rstrip("/"):
                    raise ValueError(f"{self.file} is an index of {index.meta.get('url')!r}, not of {self.url!r}")
                return index
            if os.path.exists(self.failed):
                with open(self.failed) as f:
                    raise OSError(f"rank 0 could not list {self.url} for this job: {f.read()}")
            waited = time.monotonic() - t0
            if waited > timeout:
                raise TimeoutError(
                    f"rank {rank} waited {waited:.0f} s for rank 0's index of {self.url} ({self.file}); rank 0 "
                    "lists the prefix and writes it there. Is index_cache a directory every rank sees (one "
                    "shared by all hosts), did rank 0 start, and is the run's token the same on every rank "
                    "($CACHEFS_JOB_ID, $TORCHELASTIC_RUN_ID or torch.distributed)? index_cache='' lists on "
                    "every rank")
            time.sleep(delay)
            delay = min(0.2, delay * 1.5)

    def _sweep(self) -> None:
        """Remove other runs' hand-over files older than ``JOB_FILES_KEPT``."""
        now = time.time()
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if ".job-" in name and (name.endswith(SUFFIX) or name.endswith(".failed")):
                path = os.path.join(self.directory, name)
                try:
                    if now - os.stat(path).st_mtime > JOB_FILES_KEPT:
                        os.unlink(path)
                except OSError:
                    pass


# -- CacheDataset.from_prefix: which index, from where ------------------------------------------------
def open_prefix(cls: Any, url: str, storage_options: dict[str, Any] | None, kwargs: dict[str, Any], *,
                kept_index: str | None, index_cache: str | None, stream: bool, index_timeout: float,
                rank: int, world_size: int) -> Any:
    """``cls(index, ...)`` for ``CacheDataset.from_prefix`` (its doc says what each option does):
    rank 0's hand-over on other ranks, else a kept index, else a listing, streamed where the first
    epoch reads in listing order (liststream.py)."""
    from cachefs.client.datasets.liststream import GrowingIndex, Listing

    options = dict(storage_options or {})
    kept = KeptIndexes(index_cache)
    key = KeptIndexes.key(url, options)
    plan_ahead = bool(kwargs.pop("plan_ahead", True))

    def made(index: Any) -> Any:
        ds = cls(index, storage_options=storage_options, plan_ahead=False, **kwargs)
        ds.plan_ahead = plan_ahead
        ds._publish_soon()  # the read plan, registered on a thread (or when the listing ends)
        return ds

    handoff = None
    if world_size > 1 and kept.directory:
        token = job_token(rank, world_size)
        handoff = JobHandoff(kept.directory, key, token, url) if token else None
    if handoff is not None and rank > 0:
        return made(handoff.wait(rank, index_timeout))
    found = kept.load(key, url) if kept_index == "auto" else None
    if found is not None:
        ds = made(found)
        ds.index_check = recheck(lambda: cls._filesystem(options), url, found, kept, key)
        if handoff is not None:
            handoff.publish(found)
        return ds

    def finished(index: SampleIndex | None, error: BaseException | None) -> None:
        if index is not None and kept_index:
            kept.save(key, index)
        if handoff is not None:
            if index is None:
                handoff.fail(error or RuntimeError("no index"))
            else:
                handoff.publish(index)

    def run(page: Any = None) -> SampleIndex:
        fs = cls._filesystem(options)
        try:  # "refresh": the store's listing now
            return list_prefix(fs, url, refresh=kept_index == "refresh", page=page)[0]
        finally:
            fs.close()

    listing = None
    if stream and kwargs.get("shuffle", True) is False:
        try:
            listing = Listing(run, url, on_done=finished)
        except OSError as exc:  # no room for the log's map (a small RLIMIT_AS): list whole, as before
            log.warning("listing %s whole before the first epoch (no shared log: %s)", url, exc)
    if listing is None:
        try:
            index = run()
        except BaseException as exc:
            finished(None, exc)
            raise
        finished(index, None)
        return made(index)
    listing.first.wait()
    if not listing.log.count():
        listing.result()  # raises what the listing raised (nothing below url, ...)
    ds = made(GrowingIndex(listing.log, url))  # publishes nothing until the listing ends
    ds._listing = listing
    ref = weakref.ref(ds)

    def settle(index: SampleIndex | None, error: BaseException | None) -> None:
        got = ref()
        if got is not None and index is not None:
            got._settle(index)

    listing.then(settle)
    return ds
