"""The cluster view for a process that must not call gRPC and was handed none.

A process forked from one that had loaded gRPC never calls it (client/forksafe.py). It routes by
the view its parent had: a session's own (inherited with it), else the last view any session of
the parent had for the same master (:func:`remember`, kept per process and inherited by a fork).
A client made in such a process for a master its parent never asked (a DataLoader worker that
builds its filesystem lazily, a process pool) has neither: :func:`from_helper_process` then asks
the master from a fresh interpreter (``python -m cachefs.client.transport.viewfetch``: its gRPC is its own),
once, and reads the view from its output. It imports grpc and the stubs, not torch: well under a
second here, paid once by such a process.

    python -m cachefs.client.transport.viewfetch MASTER [--timeout S] [--ca-file F --cert-file F --key-file F]
    (the token, if any, in the environment as CACHEFS_VIEWFETCH_TOKEN; the view on stdout, base64)
"""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
from typing import Any

from cachefs.tls import PLAINTEXT, TLSConfig

_TOKEN_VARIABLE = "CACHEFS_VIEWFETCH_TOKEN"
#: The last serialized view per master address that any session of this process had.
_LAST: dict[str, bytes] = {}


def remember(master: str, view: bytes) -> None:
    """A session of this process has ``view`` (serialized) for ``master``."""
    _LAST[master] = view


def last_known(master: str) -> bytes:
    """The last view of ``master`` a session of this process (or of the one it was forked from) had."""
    return _LAST.get(master, b"")


def from_helper_process(master: str, timeout: float, tls: TLSConfig = PLAINTEXT, token: str = "") -> bytes:
    """The master's view (serialized), asked for from a new interpreter; b"" if it got none."""
    args = [sys.executable, "-m", "cachefs.client.transport.viewfetch", master, "--timeout", str(timeout)]
    for flag, value in (("--ca-file", tls.ca_file), ("--cert-file", tls.cert_file), ("--key-file", tls.key_file)):
        if value:
            args += [flag, value]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_ENABLE_FORK")}
    if token:
        env[_TOKEN_VARIABLE] = token  # never on a command line (ps shows those)
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout + 10, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return b""
    if done.returncode != 0:
        return b""
    try:
        return base64.b64decode(done.stdout.strip(), validate=True)
    except ValueError:
        return b""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print the master's cluster view (base64)")
    parser.add_argument("master")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--ca-file", default="")
    parser.add_argument("--cert-file", default="")
    parser.add_argument("--key-file", default="")
    args = parser.parse_args(argv)
    from cachefs.client.transport.view import fetch_view_once

    tls = TLSConfig(ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
    view: Any = fetch_view_once(args.master, args.timeout, tls, os.environ.get(_TOKEN_VARIABLE, ""))
    if view is None:
        return 1
    print(base64.b64encode(view.SerializeToString()).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
