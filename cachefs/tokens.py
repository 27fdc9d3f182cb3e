"""Where a client finds a cluster's access token when it was given none: one rule for the fsspec
client, the datasets, the FUSE mount and the admin CLI.

1. the ``token`` option (or ``--token``);
2. ``CACHEFS_TOKEN`` in the environment (the config layers: cachefs/config.py);
3. a file named after the master's address in this user's private runtime directory
   (``<runtime dir>/tokens/<host>_<port>``, cachefs/runtimedir.py), which ``cachefs local`` writes
   when it starts a cluster with a generated token: every process of that user on this machine
   then finds it by the master address it was given, with nothing to copy.

The admin CLI looks for the cluster token the same way (``--cluster-token``,
``CACHEFS_CLUSTER_TOKEN``, then ``<host>_<port>.cluster``), then for the access token.

A token file is read only when it is a regular file of this user's, not a symlink, and not
readable by others (0600), in a directory of this user's: a file another user planted is never
taken (it would hand our requests a token of theirs).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat

from cachefs.runtimedir import private_dir, runtime_dir

log = logging.getLogger(__name__)

TOKEN_DIR = "tokens"


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


#: The kinds of token a cluster has: what clients present, and what its daemons and admins do.
ACCESS, CLUSTER = "access", "cluster"


def token_path(master: str, kind: str = ACCESS, root: str | None = None) -> str:
    """The token file of the master at ``master`` (one address, ``host:port``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", master.strip()) + ("" if kind == ACCESS else f".{kind}")
    return os.path.join(root or runtime_dir(create=False), TOKEN_DIR, name)


def save_token(master: str, token: str, kind: str = ACCESS) -> str:
    """Write ``token`` as the master's token of ``kind`` (0600, private dirs); its path."""
    directory = private_dir(os.path.join(runtime_dir(), TOKEN_DIR))
    path = os.path.join(directory, os.path.basename(token_path(master, kind)))
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return path


def forget_tokens(master: str) -> None:
    """Remove the master's token files, if any (its cluster stopped)."""
    for kind in (ACCESS, CLUSTER):
        try:
            os.unlink(token_path(master, kind))
        except FileNotFoundError:
            pass


def _read_private(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            log.warning("ignoring token file %s: not a private file of this user's (mode %o, uid %d)",
                        path, stat.S_IMODE(st.st_mode), st.st_uid)
            return ""
        return os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)


def find_token(masters: str, kind: str = ACCESS) -> str:
    """The token of ``kind`` kept for the first master of ``masters`` (``m1:p1,m2:p2``) that has
    one, else ""."""
    for master in (m for m in masters.split(",") if m.strip()):
        token = _read_private(token_path(master, kind))
        if token:
            return token
    return ""
