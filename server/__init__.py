"""The daemons: ``worker`` (serves pages), ``pagestore`` (pages on local disk), ``master``
(membership, view, mounts). The stores behind the mounts are in :mod:`cachefs.store`, shared with
the client's fallback path."""
