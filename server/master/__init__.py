"""The master daemon: membership with leases, the watched cluster view, the durable mount table."""

from cachefs.server.master.daemon import Master, serve

__all__ = ["Master", "serve"]
