"""``cachefs://`` for readers that open URLs themselves rather than through fsspec: webdataset's
``gopen`` (a handler, registered with one call) and shell pipes (``cachefs cat URL...``, for
webdataset's ``pipe:`` URLs and any tool that reads stdin).

    import cachefs; cachefs.register_webdataset()     # then WebDataset("cachefs://m/shard-{000..009}.tar")
    WebDataset("pipe:cachefs cat cachefs://m/shard-000.tar")   # no registration: a child process
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Iterable
from typing import IO, Any

#: Bytes per read when streaming an object to a pipe.
CHUNK = 4 << 20


def gopen_cachefs(url: str, mode: str = "rb", bufsize: int = 8192, *,
                  storage_options: dict[str, Any] | None = None, **kwargs: Any) -> IO[bytes]:
    """webdataset's handler signature: an open binary file for ``url`` (``rb``, or ``wb`` for its
    writers). Options: ``storage_options`` given at registration, else ``CACHEFS_*`` env."""
    import fsspec

    if mode not in ("rb", "wb"):
        raise ValueError(f"{url}: mode {mode!r}: webdataset opens shards 'rb' or 'wb'")
    return fsspec.open(url, mode, **(storage_options or {})).open()


def register_webdataset(storage_options: dict[str, Any] | None = None) -> None:
    """Let webdataset open ``cachefs://`` URLs (its ``gopen_schemes`` table). Call it where the
    WebDataset is made (module level, so spawned DataLoader workers run it too; forked ones
    inherit it). ``storage_options``: client options (``master=...``), else ``CACHEFS_*`` env."""
    # the module, not the function of the same name that webdataset's package exports
    schemes = importlib.import_module("webdataset.gopen").gopen_schemes
    schemes["cachefs"] = functools.partial(gopen_cachefs, storage_options=storage_options)


def cat(urls: Iterable[str], out: IO[bytes], storage_options: dict[str, Any] | None = None) -> None:
    """Each object's bytes, in order, to ``out`` (a missing one raises FileNotFoundError after the
    objects before it were written, as ``cat`` does)."""
    import fsspec

    for url in urls:
        with fsspec.open(url, "rb", **(storage_options or {})) as f:
            while chunk := f.read(CHUNK):
                out.write(chunk)
    out.flush()


def cat_main(urls: list[str], storage_options: dict[str, Any]) -> int:
    """``cachefs cat``: 0; 1 with a message for an object that cannot be read; 141 (as a shell's
    SIGPIPE) when the reader closes the pipe early, which webdataset's pipes take as normal."""
    try:
        cat(urls, sys.stdout.buffer, storage_options)
    except BrokenPipeError:
        # Python would complain while flushing stdout at exit: point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError) as exc:
        print(f"cachefs cat: {exc}", file=sys.stderr)
        return 1
    return 0
