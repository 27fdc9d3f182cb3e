"""The object stores behind the mounts, as both sides see them: the workers and the master read
through :class:`cachefs.store.objects.ObjectStore`, and so does the client's fallback when no
worker can serve. Nothing here imports a daemon module.

``meta`` (ObjectMeta), ``metatable`` (the compact metadata cache), ``objects`` (ObjectStore:
metadata, listings, versioned reads, writes), ``backends`` (how each store checks a version),
``write`` (whole-object writers), ``health`` (the per-mount breaker).
"""
