"""What a client and a worker on one host share for short-circuit reads: the host's identity
and the bounds of the socket protocol (proto/shortcircuit.proto)."""

from __future__ import annotations

import socket

MAX_PAGES = 128          # descriptors per reply (the kernel allows 253)
MAX_MESSAGE = 64 << 10   # request and reply size bound
#: The client protocol's version on the daemons' raw sockets (a HELLO's answer): 1 = info, listing
#: pages, view, status, read plans and hinted loads as metadata operations; 2 = streamed writes,
#: remove/mkdir/copy/free, TLS on the framed ports, a HELLO naming the client (counted per client).
PROTOCOL_VERSION = 2


def host_id() -> str:
    """This kernel's identity: the same for every container on the host, new at every boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


# -- the handle table (server/worker/handles.py writes it, client/transport/handles.py reads it) ----------
# A shared, read-only (for clients) array of little-endian u64 words: a header, then one
# generation per slot. Slot 0 is never handed out: a page given with slot 0 is read once and its
# descriptor closed.
TABLE_MAGIC = 0x31544C4248534643  # b"CFSHBLT1" little-endian
TABLE_HEADER_WORDS = 8            # magic, heartbeat (CLOCK_MONOTONIC ns), state, slots, 4 spare
TABLE_WORD_MAGIC, TABLE_WORD_HEARTBEAT, TABLE_WORD_STATE, TABLE_WORD_SLOTS = 0, 1, 2, 3
TABLE_SERVING, TABLE_CLOSED = 1, 2
#: The worker beats every HEARTBEAT_SECONDS; a table whose beat is older than TABLE_STALE_SECONDS
#: belongs to a worker that died (or hangs): its clients stop trusting every handle from it.
HEARTBEAT_SECONDS = 0.5
TABLE_STALE_SECONDS = 5.0
#: A client looks at its held descriptors' slots every HANDLE_SWEEP_SECONDS and closes those the
#: worker invalidated; the worker counts an unlinked page that a client held for
#: HELD_CLOSE_SECONDS after its eviction (server/pagestore/store.py), not for the whole hold.
HANDLE_SWEEP_SECONDS = 1.0
HELD_CLOSE_SECONDS = 5.0
