"""Object pages on local disk: one checksummed file per page, per-dir quotas, LRU, a durable index."""

from cachefs.server.pagestore.store import CacheDir, CacheDirInUseError, PageId, PageStore, PageStoreStats

__all__ = ["CacheDir", "CacheDirInUseError", "PageId", "PageStore", "PageStoreStats"]
