"""Private directories and files for a daemon's sockets, cache and state, never squatted ones.

Predictable names in a shared directory (``/tmp/cachefs-<uid>/...``) can be created first by
another user: a directory of theirs (or a symlink to one) would then hold our page files, our
master's state (``master.db`` with mount credentials) or our socket. So every directory a daemon
keeps things in is checked when it is made or opened (:func:`private_dir`): it must be a real
directory (not a symlink), owned by this process's user, and it is narrowed to ``0700`` (``0750``
with a group); anything else is refused with a :class:`PrivateDirError` naming the path and its
owner. A state file is opened the same way (:func:`private_file`).

Defaults, when nothing is configured:

* runtime (sockets): ``$CACHEFS_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/cachefs``, else
  ``/run/cachefs`` where ``/run`` is writable (root), else ``/tmp/cachefs-<uid>`` (checked as
  above: a squatted one is refused, never used);
* cache (page files: big, on disk, not in a tmpfs): ``/var/cache/cachefs`` for root, else
  ``$XDG_CACHE_HOME/cachefs`` (``~/.cache/cachefs``);
* state (the master's ``master.db``): ``/var/lib/cachefs`` for root, else ``$XDG_STATE_HOME/cachefs``
  (``~/.local/state/cachefs``).

A user without a usable home directory falls back to the runtime directory for all three.
"""

from __future__ import annotations

import os
import stat
import tempfile

__all__ = ["PrivateDirError", "cache_root", "check_socket_dir", "share_socket_with_group", "trusted_path", "private_dir", "private_file", "runtime_dir", "state_root"]


class PrivateDirError(PermissionError):
    """A directory or file that should be this user's own is not (another owner, a symlink, ...)."""


def _owner_error(path: str, st: os.stat_result, what: str) -> PrivateDirError:
    return PrivateDirError(
        f"{what} {path} is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}: refusing to use it "
        "(pre-created by another user?); remove it or point the configuration elsewhere")


def private_dir(path: str | os.PathLike[str], mode: int = 0o700, group: int = -1,
                narrow: bool = True) -> str:
    """Make ``path`` (and missing parents) or check the existing one: a directory, not a symlink,
    owned by this process's user. With ``narrow``, a new one gets ``mode`` (``0750`` and ``group``
    when a group is given) and an existing one loses its permissions for others. Returns the
    path; PrivateDirError otherwise."""
    path = os.fspath(path)
    if group >= 0 and mode == 0o700:
        mode = 0o750
    parent = os.path.dirname(os.path.abspath(path))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o755 if os.geteuid() == 0 else 0o700, exist_ok=True)
    try:
        os.mkdir(path, mode)
        created = True
    except FileExistsError:
        created = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise PrivateDirError(f"directory {path} is a symlink (to {os.readlink(path)!r}): refusing to use it; "
                                  "configure the real path instead") from None
        raise PrivateDirError(f"{path} is not a directory this process can use: {exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _owner_error(path, st, "directory")
        if narrow:
            if group >= 0 and st.st_gid != group:
                os.fchown(fd, -1, group)
            # A new directory gets ``mode`` exactly; an existing one (an operator's) keeps its group
            # bits and loses only what it gives everyone else.
            want = mode if created else stat.S_IMODE(st.st_mode) & ~0o007
            if stat.S_IMODE(st.st_mode) != want:
                os.fchmod(fd, want)
    finally:
        os.close(fd)
    return path


def private_file(path: str | os.PathLike[str], mode: int = 0o600) -> str:
    """Create ``path`` with ``mode`` or check the existing one: a regular file, not a symlink,
    owned by this process's user (then narrowed to ``mode``). PrivateDirError otherwise."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        with_link = os.path.islink(path)
        raise PrivateDirError(f"file {path} is a symlink: refusing to use it" if with_link
                              else f"cannot open {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PrivateDirError(f"{path} is not a regular file: refusing to use it")
        if st.st_uid != os.geteuid():
            raise _owner_error(path, st, "file")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


def trusted_path(path: str | os.PathLike[str]) -> str:
    """A configured path may go through symlinks (``/data`` -> ``/mnt/nvme0``), but only ones
    this user or root made: a symlink of another user's on the way is refused. Returns the path."""
    path = os.path.abspath(os.fspath(path))
    parts = path.split(os.sep)[1:]
    prefix = os.sep
    for part in parts:
        prefix = os.path.join(prefix, part)
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            break  # made later, by us
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.geteuid(), 0):
            raise PrivateDirError(f"{prefix} (in {path}) is a symlink owned by uid {st.st_uid}, not by this "
                                  f"process's uid {os.geteuid()} or root: refusing to follow it")
    return path


def check_socket_dir(path: str | os.PathLike[str]) -> str:
    """A configured socket's directory must be a real directory owned by this user or root (a
    directory of another user's could swap the socket). Returns the socket's path."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise PrivateDirError(f"socket directory {directory} is a symlink: refusing to listen in it")
    if st.st_uid not in (os.geteuid(), 0):
        raise _owner_error(directory, st, "socket directory")
    return path


def share_socket_with_group(path: str | os.PathLike[str], gid: int) -> None:
    """Let members of ``gid`` reach the socket at ``path``: the socket's group becomes ``gid``
    (its mode stays 0660) and its directory, when it is ours, gains group search (not listing:
    ``g+x``) with that group. The worker still checks each peer (cachefs/peercred.py)."""
    path = os.fspath(path)
    os.chown(path, -1, gid, follow_symlinks=False)
    directory = os.path.dirname(os.path.abspath(path))
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_gid != gid and not stat.S_IMODE(st.st_mode) & 0o070:
            os.fchown(fd, -1, gid)  # a private dir of ours: give it to the group, to search only
        if st.st_uid == os.geteuid() and (st.st_gid == gid or os.fstat(fd).st_gid == gid):
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o010)
    finally:
        os.close(fd)


def _home_dir(variable: str, *default: str) -> str | None:
    """``$variable``, else ``~/<default...>``; None without a usable home."""
    value = os.environ.get(variable)
    if value and os.path.isabs(value):
        return value
    home = os.path.expanduser("~")
    if not home or home == "~" or not os.path.isdir(home) or not os.access(home, os.W_OK):
        return None
    return os.path.join(home, *default)


def runtime_dir(create: bool = True) -> str:
    """The directory for this user's sockets (see the module's doc), made or checked private."""
    configured = os.environ.get("CACHEFS_RUNTIME_DIR")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if configured:
        path = configured
    elif xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        path = os.path.join(xdg, "cachefs")
    elif os.access("/run", os.W_OK):
        path = "/run/cachefs"
    else:
        path = os.path.join(tempfile.gettempdir(), f"cachefs-{os.geteuid()}")
    return private_dir(path) if create else path


def cache_root() -> str:
    """Where page files go by default (not made here: the page store makes and checks it)."""
    if os.geteuid() == 0:
        return "/var/cache/cachefs"
    base = _home_dir("XDG_CACHE_HOME", ".cache")
    return os.path.join(base, "cachefs") if base else runtime_dir(create=False)


def state_root() -> str:
    """Where a master keeps its state by default (not made here: the master makes and checks it)."""
    if os.geteuid() == 0:
        return "/var/lib/cachefs"
    base = _home_dir("XDG_STATE_HOME", ".local", "state")
    return os.path.join(base, "cachefs") if base else runtime_dir(create=False)
