"""On-disk format of one cached page: the raw payload at offset 0, then a 32-byte trailer.

The payload starts at offset 0 so a page file can be sent with ``sendfile`` or handed to a local
client as a file descriptor without any header arithmetic. The trailer makes the file
self-describing, so a truncated, torn or bit-flipped file is detected on every read:

    offset  size  field
    0       4     magic b"CFPG"
    4       2     format version (1)
    6       2     reserved (0)
    8       8     payload length (must equal file size - 32)
    16      8     xxh3_64 of the payload
    24      4     xxh32 of bytes 0..24 (guards the trailer itself)
    28      4     reserved (0)

All integers are little-endian. Page files are never fsynced: a file torn by power loss fails the
size or checksum check and is dropped, which is all a cache needs.
"""

from __future__ import annotations

import os
import struct

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "TRAILER_SIZE",
    "CorruptPageError",
    "decode_trailer",
    "encode_trailer",
    "read_page",
    "read_page_into",
    "write_page_file",
]

MAGIC = b"CFPG"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sHHQQ")  # the 24 bytes covered by the trailer checksum
_TAIL = struct.Struct("<II")
TRAILER_SIZE = _HEAD.size + _TAIL.size  # 32
_OPEN_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class CorruptPageError(Exception):
    """A page file whose size, trailer or checksum is wrong; it must be dropped, never served."""


def encode_trailer(payload_len: int, checksum: int) -> bytes:
    """Build the trailer for a payload of ``payload_len`` bytes with xxh3_64 ``checksum``."""
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, 0, payload_len, checksum)
    return head + _TAIL.pack(xxhash.xxh32_intdigest(head), 0)


def decode_trailer(trailer: bytes) -> tuple[int, int]:
    """Return ``(payload_len, checksum)``; raise CorruptPageError on any inconsistency."""
    if len(trailer) != TRAILER_SIZE:
        raise CorruptPageError(f"trailer is {len(trailer)} bytes, expected {TRAILER_SIZE}")
    head = trailer[: _HEAD.size]
    magic, version, _reserved, payload_len, checksum = _HEAD.unpack(head)
    (head_sum, _pad) = _TAIL.unpack(trailer[_HEAD.size :])
    if magic != MAGIC:
        raise CorruptPageError(f"bad magic {magic!r}")
    if head_sum != xxhash.xxh32_intdigest(head):
        raise CorruptPageError("trailer checksum mismatch")
    if version != FORMAT_VERSION:
        raise CorruptPageError(f"unknown page format version {version}")
    return payload_len, checksum


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_page_file(tmp_path: str, final_path: str, payload: memoryview) -> int:
    """Write ``payload`` + trailer to ``tmp_path`` and atomically rename it to ``final_path``.

    Readers see either no file or a complete one. Returns the payload's xxh3_64. On any error
    the tmp file is removed and the error is re-raised.
    """
    checksum = xxhash.xxh3_64_intdigest(payload)
    trailer = encode_trailer(payload.nbytes, checksum)
    fd = os.open(tmp_path, _OPEN_WRITE, 0o600)
    try:
        try:
            written = os.writev(fd, (payload, trailer))  # both in one call, unless it comes up short
            if written < payload.nbytes:
                _write_all(fd, payload[written:])
            _write_all(fd, memoryview(trailer)[max(0, written - payload.nbytes):])
        finally:
            os.close(fd)
        try:
            os.replace(tmp_path, final_path)
        except FileNotFoundError:
            # The fan-out directory vanished (someone cleaned it); recreate once and retry.
            os.makedirs(os.path.dirname(final_path), mode=0o700, exist_ok=True)
            os.replace(tmp_path, final_path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        raise
    return checksum


def _open_checked(path: str, file_size: int, checksum: int | None) -> tuple[int, int, int]:
    """Open ``path``, check its size and trailer; return ``(fd, payload_len, checksum)``.

    ``checksum``, when given, is what the index recorded: a self-consistent file with another
    checksum is not the page the caller asked for.
    """
    fd = os.open(path, _OPEN_READ)
    try:
        actual = os.fstat(fd).st_size
        if actual != file_size:
            raise CorruptPageError(f"file is {actual} bytes, index says {file_size}")
        payload_len, found = decode_trailer(os.pread(fd, TRAILER_SIZE, file_size - TRAILER_SIZE))
        if payload_len != file_size - TRAILER_SIZE:
            raise CorruptPageError(f"trailer says {payload_len} payload bytes in a {actual}-byte file")
        if checksum is not None and found != checksum:
            raise CorruptPageError("file holds another page (checksum differs from the index)")
    except BaseException:
        os.close(fd)
        raise
    return fd, payload_len, found


def read_page(path: str, file_size: int, checksum: int | None = None) -> bytes:
    """Read and verify a page; raise CorruptPageError, FileNotFoundError or OSError."""
    fd, payload_len, checksum = _open_checked(path, file_size, checksum)
    try:
        # One pread straight into the result (no file object: it costs more than the call on a warm page).
        data = os.pread(fd, payload_len, 0) if payload_len else b""
    finally:
        os.close(fd)
    if len(data) != payload_len:
        raise CorruptPageError(f"short read: {len(data)} of {payload_len} bytes")
    if xxhash.xxh3_64_intdigest(data) != checksum:
        raise CorruptPageError("payload checksum mismatch")
    return data


def read_page_into(path: str, file_size: int, buf: memoryview, checksum: int | None = None) -> int:
    """Read and verify a page into ``buf`` (readinto, no intermediate copy); return its length.

    Raises ValueError if ``buf`` is too small, else as :func:`read_page`.
    """
    fd, payload_len, checksum = _open_checked(path, file_size, checksum)
    with open(fd, "rb", buffering=0) as f:
        if buf.nbytes < payload_len:
            raise ValueError(f"buffer of {buf.nbytes} bytes cannot hold a {payload_len}-byte page")
        target = buf.cast("B")[:payload_len]
        got = 0
        while got < payload_len:
            n = f.readinto(target[got:])
            if not n:
                raise CorruptPageError(f"short read: {got} of {payload_len} bytes")
            got += n
    if xxhash.xxh3_64_intdigest(target) != checksum:
        raise CorruptPageError("payload checksum mismatch")
    return payload_len
