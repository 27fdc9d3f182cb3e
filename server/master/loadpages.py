"""A load job's listing, one store request a page, after a cursor (#47).

The pages come from ``Catalog.list_page`` (S3: ListObjectsV2 with StartAfter; local mounts and
the synthetic store: their own paging; a store that cannot page: its whole listing, cut), are
kept nowhere, and are asked for only as the run has room for them (``loadrun.py``), so a
resumed job lists what comes after its cursor and never what was done before it.
"""

from __future__ import annotations

from collections.abc import Iterator

from cachefs.paths import CachePath
from cachefs.server.master.catalog import Catalog
from cachefs.server.master.loadplan import Page


def load_pages(catalog: Catalog, path: CachePath, cursor: str, page_objects: int) -> Iterator[Page]:
    """The objects ``path`` names (itself if it is an object, else every object below it) whose
    names sort after ``cursor`` ("": all), a page per store request."""
    root = catalog.info(path, refresh=True)  # a load sees the store as it is
    if not root.is_dir:
        if str(root.path) > cursor:
            yield Page([(str(root.path), root.size)], str(root.path))
        return
    after = cursor
    while True:
        objects, last, final = catalog.list_page(path, after, page_objects)
        yield Page([(str(m.path), m.size) for m in objects], last)
        if final or last <= after:  # the end, or a store that did not move on (never loop on it)
            return
        after = last
