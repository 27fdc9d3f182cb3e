"""A new ``bytes`` object that can be filled in place before anyone else sees it.

``cat_file`` and ``open().read()`` must return ``bytes``; reading page files into pieces and
joining them copies every byte twice (the join was half the time of a warm 64 MiB read here).
C code makes such a result with ``PyBytes_FromStringAndSize(NULL, n)`` and writes into it before
handing it out; this is the same, through ctypes, on CPython only. The object is fresh (one
reference, not hashed, not interned) and written only before it is returned.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["SUPPORTED", "fillable_bytes"]

SUPPORTED = sys.implementation.name == "cpython"

if SUPPORTED:
    _new = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new.restype = ctypes.py_object
    _new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _PAYLOAD = bytes.__basicsize__ - 1  # offset of ob_sval: the byte array ends the object


def fillable_bytes(n: int) -> tuple[bytes, memoryview]:
    """A ``bytes`` of length ``n`` (contents undefined) and a writable view of its bytes.

    Fill the view completely, drop it, then hand out the bytes; never write after that.
    Raises RuntimeError off CPython (callers check ``SUPPORTED``).
    """
    if not SUPPORTED:
        raise RuntimeError("fillable bytes need CPython")
    if n <= 0:
        return b"", memoryview(bytearray(0))
    obj = _new(None, n)
    array = (ctypes.c_char * n).from_address(id(obj) + _PAYLOAD)
    return obj, memoryview(array).cast("B")
