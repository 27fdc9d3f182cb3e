"""A foreign sample's bytes split into its columns, and the simple columns decoded when asked.

MDS (MosaicML streaming): a uint32 size for each variable-size column, then every column's bytes
in column order (fixed-size columns' sizes are in the index). LitData (pytree items): a uint32
size for every flattened leaf, then the leaves' bytes. Columns are views of the bytes read
(uint8 tensors, as tar fields are): no copy.

``decode=True`` turns the encodings that are plain data into values, as the writing library
would: MDS ``bytes``, ``str``, ``int``, the numpy scalar types, ``str_int``/``str_float``/
``str_decimal`` and ``json``; LitData ``int``, ``float``, ``bool``, ``str``, ``text``, ``bytes``
and numpy arrays of a numeric dtype. Anything else (images, ``ndarray``, tensors, and pickles,
which would run the data's code) stays bytes; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np
import torch

from cachefs.client.datasets.shards import ShardFormatError

__all__ = ["Columns", "columns_for"]

_SCALARS = {name: np.dtype(name) for name in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                                              "int64", "float16", "float32", "float64")}
_MDS: dict[str, Callable[[bytes], Any]] = {
    "bytes": bytes, "str": lambda b: b.decode("utf-8"), "int": lambda b: int.from_bytes(b, "little", signed=True),
    "str_int": lambda b: int(b.decode("utf-8")), "str_float": lambda b: float(b.decode("utf-8")),
    "str_decimal": lambda b: Decimal(b.decode("utf-8")), "json": lambda b: json.loads(b.decode("utf-8")),
    **{name: (lambda dt: lambda b: np.frombuffer(b, dt)[0])(dt) for name, dt in _SCALARS.items()},
}
# LitData's numpy dtype numbering (its constants._NUMPY_SCTYPES), the numeric and bool ones only
_LITDATA_DTYPES = [np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                         "float16", "float32", "float64", "complex64", "complex128", "bool")]


def _numpy_with_header(b: bytes) -> Any:
    """LitData's ``numpy``: uint32 dtype number, uint32 ndim, ndim uint32 dims, values."""
    code, ndim = struct.unpack_from("<II", b)
    if code >= len(_LITDATA_DTYPES):
        return b
    shape = struct.unpack_from(f"<{ndim}I", b, 8)
    return np.frombuffer(b, _LITDATA_DTYPES[code], offset=8 + 4 * ndim).reshape(shape).copy()


def _litdata_decoder(fmt: str) -> Callable[[bytes], Any] | None:
    if fmt.startswith("no_header_numpy:"):
        code = int(fmt.split(":", 1)[1])
        if code < len(_LITDATA_DTYPES):
            return (lambda dt: lambda b: np.frombuffer(b, dt).copy())(_LITDATA_DTYPES[code])
        return None
    return {"int": lambda b: struct.unpack("<q", b)[0], "float": lambda b: struct.unpack("<d", b)[0],
            "bool": lambda b: b[0] != 0, "str": lambda b: b.decode("utf-8"), "text": lambda b: b.decode("utf-8"),
            "bytes": bytes, "numpy": _numpy_with_header}.get(fmt)


class Columns:
    """Splits one data set's samples into columns (``fmt``: ``mds`` or ``litdata``; ``meta``:
    its table's, foreign.py)."""

    def __init__(self, fmt: str, meta: dict[str, Any], decode: bool = False) -> None:
        self._args = (fmt, meta, decode)  # what a pickle carries (spawned DataLoader workers)
        self.fmt, self.names = fmt, [str(n) for n in meta["columns"]]
        if fmt == "mds":
            self.fixed: list[int | None] = [None if s is None else int(s) for s in meta["sizes"]]
            encodings = [str(e) for e in meta["encodings"]]
            self.decoders = [_MDS.get(e) if decode else None for e in encodings]
        elif fmt == "litdata":
            self.fixed = [None] * len(self.names)  # every leaf's size is in the item's prefix
            self.decoders = [_litdata_decoder(str(f)) if decode else None for f in meta["formats"]]
        else:
            raise ValueError(f"no columns for shard format {fmt!r}")
        self.n_prefix = sum(1 for s in self.fixed if s is None)
        self._prefix = struct.Struct(f"<{self.n_prefix}I")

    def __reduce__(self) -> tuple[Any, ...]:
        return Columns, self._args

    def split(self, data: torch.Tensor, where: Callable[[], str]) -> dict[str, Any]:
        """``data``: one sample's bytes (a uint8 tensor); ``where()``: names it in an error."""
        array = data.numpy()
        if len(array) < self._prefix.size:
            raise ShardFormatError(f"{where()}: {len(array)} bytes, shorter than its column sizes")
        given = iter(self._prefix.unpack_from(array))
        sizes = [next(given) if fixed is None else fixed for fixed in self.fixed]
        at = self._prefix.size
        if at + sum(sizes) != len(array):
            raise ShardFormatError(f"{where()}: its columns' sizes add up to {at + sum(sizes)} bytes, "
                                   f"the sample has {len(array)}")
        out: dict[str, Any] = {}
        for name, size, decode in zip(self.names, sizes, self.decoders):
            out[name] = data[at:at + size] if decode is None else decode(array[at:at + size].tobytes())
            at += size
        return out


def columns_for(fmt: str, meta: dict[str, Any], decode: bool) -> Columns | None:
    """The splitter of a table's samples; None for tar (its fields are in the table)."""
    if fmt in ("mds", "litdata"):
        return Columns(fmt, meta, decode)
    if decode:
        raise ValueError(f"decode=True decodes MDS and LitData columns; {fmt} samples are bytes (use transform)")
    return None
