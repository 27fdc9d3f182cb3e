"""What a client and a worker on one host share for short-circuit reads: the host's identity
and the bounds of the socket protocol (proto/shortcircuit.proto)."""

from __future__ import annotations

import socket

MAX_PAGES = 128          # descriptors per reply (the kernel allows 253)
MAX_MESSAGE = 64 << 10   # request and reply size bound


def host_id() -> str:
    """This kernel's identity: the same for every container on the host, new at every boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()
