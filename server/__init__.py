"""The daemons: ``worker`` (serves pages), ``pagestore`` (pages on local disk), ``objectstore``
(the stores behind the mounts; also the client's fallback path), ``master`` (membership, view, mounts)."""
