"""``HOST:PORT`` addresses, checked and split in one place (configs, the master, the clients).

IPv6 hosts come in brackets (``[::1]:29999``); the host returned has them stripped.
"""

from __future__ import annotations

#: A master's client port (the view for training processes, no gRPC) is this far above its gRPC
#: port: a client given ``host:19998`` dials 19999 (server/master/clientport.py).
CLIENT_PORT_OFFSET = 1


def split_address(address: str, what: str = "address") -> tuple[str, int]:
    """``"h:1"`` -> ``("h", 1)``; a ValueError naming ``what`` for anything that is not HOST:PORT."""
    host, sep, port = str(address).rpartition(":")
    if (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536
            or any(c.isspace() for c in str(address))):
        raise ValueError(f"{what} {address!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def split_addresses(value: str | tuple[str, ...] | list[str], what: str = "address") -> tuple[str, ...]:
    """``"m1:19998,m2:19998"`` -> both, each checked; a master address is always such a list."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(a.strip() for a in items if a and a.strip())
    for address in out:
        split_address(address, what)
    return out
