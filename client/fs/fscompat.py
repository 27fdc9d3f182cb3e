"""The parts of s3fs's public surface that libraries call, for ``CacheFileSystem``.

Libraries written against ``s3://`` call more than fsspec's core: ``modified`` (HF datasets,
dask), ``checksum``/``ukey`` (caches keyed on an object's identity), ``info()["ETag"]`` and
``["LastModified"]``, ``open_async``. This mixin gives them the same answers s3fs gives, computed
from what a worker reports (size, version, mtime), and refuses clearly what a read-mostly cache
in front of the store cannot do (presigned URLs, tags, ACLs, bucket versioning, multipart
administration). docs/compatibility.md has the method-by-method table.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
from typing import Any

from fsspec.asyn import AbstractAsyncStreamedFile
from fsspec.utils import tokenize

#: s3fs methods that only make sense against S3 itself, and why cachefs refuses each.
_CREDENTIALS = "the workers hold the store's credentials; clients never do"
S3_ONLY: dict[str, str] = {
    "sign": f"presigned URLs would bypass the cache and need the store's credentials ({_CREDENTIALS}); "
            "sign the store URL with s3fs",
    "url": f"presigned URLs would bypass the cache ({_CREDENTIALS}); use s3fs for them",
    "get_tags": "object tags are not cached or passed through; read them with s3fs",
    "put_tags": "object tags are not passed through (writes carry bytes only)",
    "metadata": "user metadata (x-amz-meta-*) is not cached or passed through; read it with s3fs",
    "getxattr": "user metadata (x-amz-meta-*) is not cached or passed through; read it with s3fs",
    "setxattr": "user metadata (x-amz-meta-*) is not passed through (writes carry bytes only)",
    "chmod": "ACLs are the store's business, not the cache's; set them with s3fs",
    "merge": "server-side multipart concatenation is not passed through; write the whole object",
    "object_version_info": "cachefs reads the current version of an object only (no version_id)",
    "is_bucket_versioned": "buckets are administered in the store, not through the cache",
    "make_bucket_versioned": "buckets are administered in the store, not through the cache",
    "list_multipart_uploads": "multipart uploads are the workers' (each write is one upload, aborted on failure)",
    "abort_mpu": "multipart uploads are the workers' (each write is one upload, aborted on failure)",
    "clear_multipart_uploads": "multipart uploads are the workers'; use the bucket rule AbortIncompleteMultipartUpload",
    "get_s3": f"there is no S3 client in a cachefs client ({_CREDENTIALS})",
    "call_s3": f"there is no S3 client in a cachefs client ({_CREDENTIALS})",
    "connect": "a cachefs filesystem connects on its first call (to workers or the master, not to S3)",
    "set_session": "a cachefs filesystem connects on its first call (to workers or the master, not to S3)",
    "close_session": "use close(): it closes this process's channels to the workers",
    "get_delegated_s3pars": f"no S3 credentials to delegate ({_CREDENTIALS})",
    "invalidate_region_cache": "no S3 regions in a cachefs client (workers resolve the store)",
    "split_path": "cachefs paths are <mount>/<key>, not bucket/key: use cachefs.paths.parse_path",
}


def _refusal(name: str, reason: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"cachefs: {name}() is not supported: {reason}")

    refuse.__name__ = name
    refuse.__doc__ = f"Not supported: {reason}."
    return refuse


def etag_of(info: dict[str, Any]) -> str | None:
    """The S3 ETag in an object's version, if it is one. A version is the ETag on S3 and
    ``<size>-<mtime>`` on other stores (cachefs/store/backends.py version_of)."""
    version = info.get("version") or ""
    if not version or info.get("type") != "file":
        return None
    size, sep, rest = version.partition("-")
    if sep and size == str(info.get("size")):
        try:
            float(rest)
            return None  # <size>-<mtime>: a local file's version, not an ETag
        except ValueError:
            pass
    return version


def s3_fields(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with the fields s3fs's info has where cachefs knows them: ``ETag`` (quoted, as S3
    sends it), ``LastModified`` (an aware UTC datetime). ``mtime`` stays seconds (pyarrow, local)."""
    etag = etag_of(info)
    if etag is not None:
        info["ETag"] = f'"{etag}"'
    if info.get("type") == "file" and info.get("mtime"):
        info["LastModified"] = datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.timezone.utc)
    return info


class S3CompatMethods:
    """s3fs's identity and time methods, and ``open_async``, over ``info`` (mixed into CacheFileSystem)."""

    def modified(self, path: str, refresh: bool = False, **kwargs: Any) -> datetime.datetime:
        """The object's last modification as an aware UTC datetime (s3fs: ``LastModified``).
        A directory has none: IsADirectoryError, as s3fs raises."""
        info = self.info(path, refresh=refresh, **kwargs)  # type: ignore[attr-defined]
        if info.get("type") != "file":
            raise IsADirectoryError(f"{path} is a directory: it has no modification time")
        if "LastModified" not in info:
            raise NotImplementedError(f"cachefs: the store reports no modification time for {path}")
        return info["LastModified"]

    def created(self, path: str) -> datetime.datetime:
        raise NotImplementedError("cachefs: created() is not supported: S3 keeps no creation time (s3fs "
                                  "raises too), and workers report only the modification time (modified())")

    def checksum(self, path: str, refresh: bool = False) -> int:
        """Changes when the object changes. On S3 the same number s3fs gives (the ETag as an int);
        elsewhere a hash of size and version."""
        info = self.info(path, refresh=refresh)  # type: ignore[attr-defined]
        etag = etag_of(info)
        if etag is not None:
            try:
                return int(etag.split("-")[0], 16)
            except ValueError:
                pass
        return int(tokenize(info["name"], info["size"], info.get("version", ""), info["type"]), 16)

    def ukey(self, path: str) -> str:
        """A hex key of the object's identity (name, size, version): equal while the bytes are."""
        info = self.info(path)  # type: ignore[attr-defined]
        key = f"{info['name']}\0{info['size']}\0{info.get('version', '')}\0{info['type']}"
        return hashlib.sha256(key.encode()).hexdigest()

    async def _checksum(self, path: str, refresh: bool = False) -> int:
        return await asyncio.to_thread(self.checksum, path, refresh)

    async def _modified(self, path: str, refresh: bool = False) -> datetime.datetime:
        return await asyncio.to_thread(self.modified, path, refresh)

    async def open_async(self, path: str, mode: str = "rb", **kwargs: Any) -> "CacheAsyncFile":
        """A streamed async reader (s3fs's ``open_async``), pinned to the version seen at open."""
        if "b" not in mode or kwargs.get("compression"):
            raise ValueError("open_async: binary modes only, no compression (as s3fs)")
        if mode != "rb":
            raise NotImplementedError("cachefs: open_async() reads only; write with open(path, 'wb') or pipe")
        cp = self._path(path)  # type: ignore[attr-defined]
        if cp is None:
            raise NotImplementedError("cachefs: open_async() of a chained URL under no mount")
        info = await asyncio.to_thread(self.session.info, cp)  # type: ignore[attr-defined]
        if info["type"] != "file":
            raise IsADirectoryError(f"{path} is a directory")
        return CacheAsyncFile(self, path, info, cp)


for _name, _reason in S3_ONLY.items():
    setattr(S3CompatMethods, _name, _refusal(_name, _reason))


class CacheAsyncFile(AbstractAsyncStreamedFile):
    """``await f.read(n)`` through the session, on a thread (the client's calls block)."""

    def __init__(self, fs: Any, path: str, info: dict[str, Any], cp: Any) -> None:
        self.version = info.get("version", "")
        self.cp = cp
        super().__init__(fs, path, "rb", size=info["size"], cache_type="none")

    async def _fetch_range(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return (await asyncio.to_thread(self.fs.session.read, self.cp, start, end - start, self.version))[0]
