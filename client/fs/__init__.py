"""The fsspec surface (``cachefs://``): the filesystem, s3fs's extra surface, writes, URL chaining,
webdataset's handler, hints and read-ahead across objects.
"""

__all__ = [
    "filesystem",
    "fscompat",
    "hints",
    "scanahead",
    "urlmap",
    "wds",
    "writer",
]
