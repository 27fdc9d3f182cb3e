"""``cachefs fuse MOUNTPOINT``: mounts client/fuse/fusefs.py with libfuse 3 (mfusepy) in the foreground.

mfusepy is ctypes over the installed libfuse 3 (``cachefs[fuse]``; Debian's ``fuse3``): the
libfuse multi-threaded loop calls the operations from its own threads, which suits the
blocking, thread-safe client session (docs/architecture.md says why not pyfuse3). libfuse's
own handlers take SIGTERM and SIGINT: the loop ends, the mount is unmounted, and this returns.

A mount left behind by a killed process ("Transport endpoint is not connected") is detected
before mounting and detached, with a message saying so; a live mount there is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from typing import Any

from cachefs.client import forksafe
from cachefs.client.fuse.fusefs import CacheFuseOps
from cachefs.client.fuse.fusewrite import WritableFuseOps
from cachefs.client.transport.session import ClientSession
from cachefs.config import FuseConfig

log = logging.getLogger(__name__)

FSNAME = "cachefs"
_MNT_DETACH = 2
_CAP_AUTO_INVAL_DATA = 1 << 12  # fuse_common.h: a lookup showing a new size or mtime drops cached pages


class FuseUnavailableError(RuntimeError):
    """The binding or libfuse 3 is not installed, or this machine has no /dev/fuse."""


def fuse_available() -> str | None:
    """None when a mount can be tried here; else why not (tests skip with it)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE in this kernel or container)"
    try:
        _binding()
    except FuseUnavailableError as exc:
        return str(exc)
    return None


def _binding() -> Any:
    try:
        import mfusepy
    except (ImportError, OSError) as exc:  # OSError: mfusepy found no libfuse
        raise FuseUnavailableError(f"the FUSE binding cannot load ({exc}): pip install 'cachefs[fuse]' "
                                   f"and install libfuse 3 (Debian: apt-get install fuse3)") from None
    if mfusepy.fuse_version_major != 3:
        raise FuseUnavailableError(f"libfuse {mfusepy.fuse_version_major} found; cachefs fuse needs libfuse 3")
    return mfusepy


def mount_entry(mountpoint: str) -> dict[str, str] | None:
    """The /proc/self/mountinfo entry mounted on ``mountpoint`` (the last one), if any."""
    target = os.path.abspath(mountpoint)
    found = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                point = fields[4].encode().decode("unicode_escape")  # \040 for a space
                if point == target:
                    found = {"mountpoint": point, "fstype": fields[sep + 1], "source": fields[sep + 2],
                             "dev": fields[2]}
    except OSError:
        return None
    return found


def clear_stale_mount(mountpoint: str) -> str | None:
    """Detach a dead FUSE mount on ``mountpoint``; returns what was done (None: nothing there).
    Raises FileExistsError when a live FUSE file system is mounted there.

    Asked with statfs, which the kernel always sends to the FUSE process (a stat of the mount's
    root may be answered from cached attributes even when that process is gone)."""
    entry = mount_entry(mountpoint)
    if entry is None or not entry["fstype"].startswith("fuse"):
        return None
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        if exc.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            raise
        _detach(mountpoint)
        return (f"cachefs fuse: {mountpoint} held a dead {entry['fstype']} mount ({entry['source']}; "
                f"its process was killed): detached it, mounting afresh")
    raise FileExistsError(errno.EBUSY, f"{mountpoint} is already a live FUSE mount ({entry['source']}): "
                                       f"unmount it first (fusermount3 -u {mountpoint})")


def set_read_ahead(mountpoint: str, nbytes: int) -> str | None:
    """The kernel's read-ahead for the mount (its bdi's ``read_ahead_kb``; root only): with the
    default 128 KiB a sequential reader's requests are 128 KiB each, not ``max_read``. Reads
    /proc, never the mount itself (this runs inside libfuse's init). Returns why not, if not."""
    entry = mount_entry(mountpoint)
    if entry is None:
        return "the mount is not in /proc/self/mountinfo"
    path = f"/sys/class/bdi/{entry['dev']}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(max(4, nbytes // 1024)))
    except OSError as exc:
        return f"cannot set {path}: {exc.strerror or exc}"
    return None


def _detach(mountpoint: str) -> None:
    """A lazy unmount: umount2(MNT_DETACH) as root, else ``fusermount3 -u -z``."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.umount2(os.fsencode(mountpoint), _MNT_DETACH) == 0:
            return
        err = ctypes.get_errno()
        raise OSError(err, f"cannot detach the dead mount on {mountpoint}: {os.strerror(err)}")
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise OSError(errno.ENOENT, f"cannot detach the dead mount on {mountpoint}: no fusermount3")
    subprocess.run([tool, "-u", "-z", mountpoint], check=True, capture_output=True, timeout=30)


def _fuse_class(mfusepy: Any) -> type:
    class _Fuse(mfusepy.FUSE):  # type: ignore[misc, name-defined]
        """mfusepy's FUSE with reads filled straight into libfuse's reply buffer (no bytes copy)."""

        def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
            out = memoryview((ctypes.c_char * size).from_address(ctypes.addressof(buf.contents))).cast("B")
            fh = fip.contents.fh if fip else 0
            if fh == 0 and path is not None:  # the kernel opened the file itself (revalidate_open off)
                return self.operations.read_path(path.decode(self.encoding, self.errors), out, offset)
            return self.operations.read_into(fh, out, offset)

        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:  # mfusepy drops the flags
            return self.operations.rename(old.decode(self.encoding, self.errors),
                                          new.decode(self.encoding, self.errors), flags)

    return _Fuse


class _MountedSettings:
    """Mixed into the operations: libfuse's init (the kernel-facing settings) and the ready line."""

    config: FuseConfig
    mountpoint: str
    session: ClientSession

    def __init__(self, session: ClientSession, config: FuseConfig, mountpoint: str) -> None:
        super().__init__(session, attr_timeout=config.attr_timeout, max_read=config.max_read,  # type: ignore[call-arg]
                         revalidate_open=config.revalidate_open)
        self.config = config
        self.mountpoint = mountpoint
        # Owner, group and modes the kernel checks accesses against (default_permissions).
        if config.uid >= 0:
            self._uid = config.uid
        if config.gid >= 0:
            self._gid = config.gid
        self.umask = config.umask

    def init_with_config(self, conn: Any, cfg: Any) -> None:
        if cfg is not None:
            cfg.entry_timeout = cfg.attr_timeout = cfg.negative_timeout = self.config.attr_timeout
            cfg.kernel_cache = cfg.auto_cache = 0  # keep_cache is decided per open, by version
        if conn is not None:
            conn.max_read = self.config.max_read
            if conn.capable & _CAP_AUTO_INVAL_DATA:  # libfuse 3's default; what keeps kernel opens honest
                conn.want |= _CAP_AUTO_INVAL_DATA
            log.info("cachefs fuse: kernel capabilities %#x, wanted %#x, max_write %d, max_readahead %d",
                     conn.capable, conn.want, conn.max_write, conn.max_readahead)
        if self.config.read_ahead:  # after the kernel has the init reply (which caps it): a thread
            threading.Thread(target=self._read_ahead, name="cachefs-fuse-readahead", daemon=True).start()
        print(json.dumps({"event": "mounted", "mountpoint": self.mountpoint, "pid": forksafe.pid(),
                          "writable": self.config.writable}), flush=True)

    def _read_ahead(self) -> None:
        try:
            os.stat(self.mountpoint)  # answered once the kernel has processed the init reply
        except OSError:
            return
        why = set_read_ahead(self.mountpoint, self.config.read_ahead)
        if why:
            log.warning("cachefs fuse: kernel read-ahead left at its default (%s): sequential reads come "
                        "in smaller requests", why)

    def destroy(self, path: str) -> None:
        self.session.close()


class _Mounted(_MountedSettings, CacheFuseOps):
    """The read-only mount (the default): the kernel refuses every write with EROFS."""


class _MountedWritable(_MountedSettings, WritableFuseOps):
    """``--writable``: writes stream through to the store (client/fuse/fusewrite.py)."""


def run(mountpoint: str, config: FuseConfig) -> int:
    """Mount, serve until SIGTERM/SIGINT (or an unmount), unmount; the exit code."""
    try:
        mfusepy = _binding()
    except FuseUnavailableError as exc:
        print(f"cachefs fuse: {exc}", file=sys.stderr)
        return 2
    if not os.path.exists("/dev/fuse"):
        print("cachefs fuse: /dev/fuse does not exist (a container needs --device /dev/fuse)", file=sys.stderr)
        return 2
    mountpoint = os.path.abspath(mountpoint)
    try:
        note = clear_stale_mount(mountpoint)
    except OSError as exc:
        print(f"cachefs fuse: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if note:
        print(note, file=sys.stderr, flush=True)
    if not os.path.isdir(mountpoint):
        print(f"cachefs fuse: mount point {mountpoint} is not a directory", file=sys.stderr)
        return 2
    session = ClientSession(config.client)
    options: dict[str, Any] = {"fsname": FSNAME, "subtype": FSNAME, "max_read": config.max_read,
                               "max_threads": config.threads}
    if not config.writable:
        options["ro"] = True
    mounted = (_MountedWritable if config.writable else _Mounted)(session, config, mountpoint)
    if config.allow_other:
        options["allow_other"] = True
    if config.default_permissions:  # the kernel checks modes, owner and group on every access
        options["default_permissions"] = True
    try:
        _fuse_class(mfusepy)(mounted, mountpoint, raw_fi=True, foreground=True, **options)
    except RuntimeError as exc:
        # libfuse 3.14's fuse_main answers 8 when its loop ended on a signal (SIGTERM, SIGINT),
        # the way this command is meant to stop; the mount is gone by then.
        if str(exc) != "8" or mount_entry(mountpoint) is not None:
            print(f"cachefs fuse: libfuse failed (fuse_main returned {exc}); see its messages above",
                  file=sys.stderr)
            return 1
    finally:
        session.close()
    print(json.dumps({"event": "unmounted", "mountpoint": mountpoint}), flush=True)
    return 0
