"""Local mounts: every open stays under the mount's root and follows no symbolic link.

A check of ``realpath`` before an open is a race: a directory swapped for a symlink between the
two leads the open outside the mount (to /etc, say). Here the open itself refuses: Linux's
``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` (5.6+; called through ctypes) resolves the key
relative to a descriptor of the root and fails on any symlink or ``..``; where it is missing
(older kernels, seccomp filters) each component is opened with ``openat(O_NOFOLLOW)`` relative
to the previous one, which gives the same guarantee one step at a time. Reads, stats, listings,
writes, renames and removals of local mounts all go through here (backends.py, write.py).

Symbolic links inside a local mount are never followed, even to a place inside it: reading one
fails with :class:`~cachefs.errors.InvalidPathError` ("... symbolic link ..."); a listing shows
the link itself (its own size, not a directory).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cachefs.errors import InvalidPathError

_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)  # Linux; elsewhere a plain read-only open
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same on every Linux architecture since 5.1 (asm-generic table), alpha aside
_DIR_FLAGS = _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalStorePath(str):
    """A local mount's store path (``root/key``, what fsspec would use) that knows its root and
    key, so the local backend opens ``key`` beneath ``root`` rather than the path."""

    root: str
    key: str

    def __new__(cls, root: str, key: str) -> "LocalStorePath":
        self = super().__new__(cls, f"{root}/{key}" if key else root)
        self.root, self.key = root, key
        return self


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_openat2() -> Any:
    if not sys.platform.startswith("linux") or os.environ.get("CACHEFS_NO_OPENAT2"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]

    def openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
        how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                       _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        fd = syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            number = ctypes.get_errno()
            raise OSError(number, os.strerror(number), path)
        return int(fd)

    try:  # a kernel without it answers ENOSYS; a seccomp filter EPERM or ENOSYS
        top = os.open("/", _O_PATH | os.O_CLOEXEC)
        try:
            os.close(openat2(top, ".", _O_PATH))
        finally:
            os.close(top)
    except OSError:
        return None
    return openat2


_openat2 = _load_openat2()


def uses_openat2() -> bool:
    """Whether opens go through openat2 (else the O_NOFOLLOW walk)."""
    return _openat2 is not None


def _parts(key: str) -> list[str]:
    parts = key.split("/") if key else []
    if any(p in ("", ".", "..") for p in parts) or "\0" in key:
        raise InvalidPathError(f"{key!r}: not a plain relative key")
    return parts


def _symlink_error(key: str) -> InvalidPathError:
    return InvalidPathError(f"{key!r}: a symbolic link on the way; local mounts follow none (it could lead "
                            "outside its mount)")


def _open_root(root: str) -> int:
    """A descriptor of the mount's root (a realpath, MountTable.add): no symlink followed on its
    path either, so a component swapped for a link after the mount was added fails closed."""
    if _openat2 is not None and root.startswith("/"):
        top = os.open("/", _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return _openat2(top, root.lstrip("/") or ".", _O_PATH | os.O_DIRECTORY)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                raise InvalidPathError(f"the mount's root {root}: a symbolic link on the way now (swapped in "
                                       "after it was mounted): refused") from None
            raise
        finally:
            os.close(top)
    return os.open(root, _DIR_FLAGS)  # the walk: the last component, at least


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _walk(root_fd: int, parts: list[str], key: str, create: bool = False) -> int:
    """A descriptor (O_PATH) of the directory ``parts`` under ``root_fd``, one O_NOFOLLOW step at a
    time (``create``: making what is missing)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    raise _symlink_error(key) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_beneath(root: str, key: str, flags: int, mode: int = 0o666) -> int:
    """``os.open`` of ``key`` under ``root``, following no symlink on the way nor at the end."""
    parts = _parts(key)
    root_fd = _open_root(root)
    try:
        if _openat2 is not None:
            try:
                return _openat2(root_fd, key or ".", flags, mode)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EXDEV):
                    raise _symlink_error(key) from None
                raise type(exc)(exc.errno, exc.strerror, key) from None
        if not parts:
            return os.open(".", flags | os.O_CLOEXEC, dir_fd=root_fd)
        parent = _walk(root_fd, parts[:-1], key)
        try:
            try:
                fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _is_link(parts[-1], parent):
                    raise _symlink_error(key) from None
                raise type(exc)(exc.errno, exc.strerror, key) from None
            if flags & _O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):  # O_PATH|O_NOFOLLOW: the link
                os.close(fd)
                raise _symlink_error(key)
            return fd
        finally:
            os.close(parent)
    finally:
        os.close(root_fd)


def stat_beneath(path: LocalStorePath) -> os.stat_result:
    fd = open_beneath(path.root, path.key, _O_PATH)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def open_file(path: LocalStorePath, mode: str = "rb") -> Any:
    """A Python file object for reading ``path`` (unbuffered for "rb")."""
    fd = open_beneath(path.root, path.key, os.O_RDONLY)
    try:
        return os.fdopen(fd, mode, buffering=0 if mode == "rb" else -1)
    except BaseException:
        os.close(fd)
        raise


def local_version(st: os.stat_result) -> str:
    """A local file's version: its size and mtime, the string version_of() makes from fsspec's info."""
    return f"{st.st_size}-{st.st_mtime!r}"


def _entry_info(name: str, st: os.stat_result) -> dict[str, Any]:
    mode = st.st_mode
    kind = "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
    return {"name": name, "size": st.st_size, "type": kind, "mtime": st.st_mtime, "created": st.st_ctime,
            "islink": stat.S_ISLNK(mode), "mode": mode}


def _scan(fd: int, base: str) -> list[tuple[str, os.stat_result]]:
    with os.scandir(fd) as entries:
        return [(f"{base}/{e.name}", e.stat(follow_symlinks=False)) for e in entries]


def list_beneath(path: LocalStorePath) -> list[Any]:
    """The entries of ``fs.ls(path)``, without following any symlink (a link is listed as
    itself), as ``ListedEntry`` tuples (name, size, version, mtime, is_dir), a file's version None
    (derived from size and mtime, as the local backend's): no info dict made and read back per
    entry (the revalidator lists every directory of a warm epoch longer than the TTL). A file's
    own path: its info dict, as ``fs.ls`` gives it."""
    fd = _open_dir(path)
    if fd is None:
        return [_entry_info(str(path), stat_beneath(path))]
    isdir = stat.S_ISDIR
    try:
        return [(name, 0, "", st.st_mtime, True) if isdir(st.st_mode) else (name, st.st_size, None, st.st_mtime, False)
                for name, st in _scan(fd, str(path))]
    finally:
        os.close(fd)


def _open_dir(path: LocalStorePath) -> int | None:
    """A descriptor to list ``path``, or None if it is not a directory (a file: listed as itself)."""
    for _ in range(3):  # a directory and a file swapped under us: ask again
        try:
            return open_beneath(path.root, path.key, os.O_RDONLY | os.O_DIRECTORY)
        except NotADirectoryError:
            if not stat.S_ISDIR(stat_beneath(path).st_mode):
                return None
    raise OSError(errno.EAGAIN, f"{path.key!r} keeps changing between a directory and something else")


def find_beneath(path: LocalStorePath) -> list[dict[str, Any]]:
    """Every file (not directory) under ``path``, recursively, as ``fs.find(detail=True)``; a
    missing path gives nothing (as fsspec's); symlinks are listed as themselves, never entered."""
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        return []
    if fd is None:
        return [_entry_info(str(path), stat_beneath(path))]
    out: list[dict[str, Any]] = []

    def walk(dir_fd: int, base: str) -> None:
        for name, st in _scan(dir_fd, base):
            if stat.S_ISDIR(st.st_mode):
                try:
                    child = os.open(name.rsplit("/", 1)[1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                    | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError:  # swapped for a link or removed meanwhile: not entered
                    continue
                try:
                    walk(child, name)
                finally:
                    os.close(child)
            else:
                out.append(_entry_info(name, st))

    try:
        walk(fd, str(path))
    finally:
        os.close(fd)
    return out


@contextmanager
def parent_dir(path: LocalStorePath, create: bool = False) -> Iterator[tuple[int, str]]:
    """(a descriptor of ``path``'s parent directory, ``path``'s last name), the parent reached
    without following any symlink (``create``: directories made on the way)."""
    parts = _parts(path.key)
    if not parts:
        raise PermissionError(errno.EPERM, "the root of a mount cannot be written or removed")
    root_fd = _open_root(path.root)
    try:
        if _openat2 is not None and not create:
            try:
                fd = _openat2(root_fd, "/".join(parts[:-1]) or ".", _O_PATH | os.O_DIRECTORY)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EXDEV):
                    raise _symlink_error(path.key) from None
                raise type(exc)(exc.errno, exc.strerror, path.key) from None
        else:
            fd = _walk(root_fd, parts[:-1], path.key, create=create)
    finally:
        os.close(root_fd)
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def make_dirs(path: LocalStorePath, exist_ok: bool = True) -> None:
    """``os.makedirs`` beneath the root (no symlink followed)."""
    with parent_dir(path, create=True) as (fd, name):
        try:
            os.mkdir(name, 0o777, dir_fd=fd)
        except FileExistsError:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _symlink_error(path.key) from None
            if not exist_ok or not stat.S_ISDIR(st.st_mode):
                raise FileExistsError(errno.EEXIST, f"{path} exists") from None


def make_dir(path: LocalStorePath) -> None:
    """``os.mkdir``: the parent must exist."""
    with parent_dir(path) as (fd, name):
        os.mkdir(name, 0o777, dir_fd=fd)


def remove(path: LocalStorePath, is_dir: bool, recursive: bool) -> None:
    """Remove a file (a link: the link), an empty directory, or a tree (``recursive``)."""
    with parent_dir(path) as (fd, name):
        if not is_dir:
            os.unlink(name, dir_fd=fd)
        elif recursive:
            shutil.rmtree(name, dir_fd=fd)  # fd-based on Linux: never follows a link out
        else:
            os.rmdir(name, dir_fd=fd)  # OSError(ENOTEMPTY) if it is not empty


class LocalWriter:
    """A hidden temporary file next to the target (no symlink followed on the way), renamed over
    it on commit: the target is replaced whole, a link in its place included (never written
    through)."""

    def __init__(self, path: LocalStorePath, partial_mark: str, suffix: str) -> None:
        self.path = path
        self._dir = parent_dir(path, create=True)
        self._fd, self.name = self._dir.__enter__()
        try:
            try:
                st = os.stat(self.name, dir_fd=self._fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, f"{path} is a directory")
            self.tmp_name = f".{self.name}{partial_mark}{suffix}"
            self.tmp = os.path.join(os.path.dirname(str(path)), self.tmp_name)
            fd = os.open(self.tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o666, dir_fd=self._fd)
            self._file = os.fdopen(fd, "wb")
        except BaseException:
            self._dir.__exit__(None, None, None)
            raise

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def commit(self) -> None:
        try:
            self._file.close()
            os.replace(self.tmp_name, self.name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        finally:
            self._dir.__exit__(None, None, None)

    def discard(self) -> None:
        try:
            self._file.close()
            try:
                os.unlink(self.tmp_name, dir_fd=self._fd)
            except FileNotFoundError:
                pass
        finally:
            self._dir.__exit__(None, None, None)
