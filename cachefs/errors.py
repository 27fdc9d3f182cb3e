"""Errors, and the one table that maps them to and from gRPC status codes.

Errors are members of the built-in OSError family (as fsspec's are), so callers catch
``FileNotFoundError`` or ``PermissionError`` whether data came from the cache or the store.
The worker turns an exception into a status with :func:`to_status`; the client turns the
status back into the same exception type with :func:`from_rpc_error`, keeping the
status code and the server's message, and chaining the RPC error as ``__cause__``.
"""

from __future__ import annotations

import errno

import grpc


class CacheFSError(OSError):
    """Base class for errors raised by cachefs itself (not by the object store)."""


class InvalidPathError(CacheFSError, ValueError):
    """A path that is malformed or escapes its mount (``..``, NUL, encoded separators)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EINVAL, message)


class UnknownMountError(CacheFSError, FileNotFoundError):
    """The first path component names no mount."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOENT, message)


class WorkerUnavailableError(CacheFSError, ConnectionError):
    """No worker could serve the request (and fallback to the store is off)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EHOSTUNREACH, message)


class StoreError(CacheFSError):
    """The object store failed in a way that is not a missing object or a denied access."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class StoreUnavailableError(StoreError, ConnectionError):
    """The object store cannot be reached (refused, timed out, or its breaker is open).

    Cached data is still served; only reads that need the store fail, and they fail fast.
    """

    MARKER = "object store unavailable"

    def __init__(self, message: str) -> None:
        OSError.__init__(self, errno.ECONNREFUSED, message)


class DeadlineExceededError(CacheFSError, TimeoutError):
    def __init__(self, message: str) -> None:
        super().__init__(errno.ETIMEDOUT, message)


class UnauthenticatedError(CacheFSError, PermissionError):
    """The caller did not present the cluster token (or presented a wrong one)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EACCES, message)


class OverloadedError(CacheFSError):
    """The server refuses more of this kind of work for now (e.g. too many open watch streams)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EBUSY, message)


class StaleObjectError(CacheFSError):
    """The object changed in the store after the reader opened it (a read never mixes versions)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ESTALE, message)


# Exception type -> status code, most specific first. The inverse is derived from it,
# so the two directions cannot drift apart.
_TO_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidPathError, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (StaleObjectError, grpc.StatusCode.ABORTED),
    (UnknownMountError, grpc.StatusCode.NOT_FOUND),
    (WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (StoreError, grpc.StatusCode.INTERNAL),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (FileExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (IsADirectoryError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotADirectoryError, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (OSError, grpc.StatusCode.INTERNAL),
)

_FROM_STATUS: dict[grpc.StatusCode, type[OSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPathError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidPathError,
    grpc.StatusCode.NOT_FOUND: FileNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: FileExistsError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,  # a PermissionError: no or a wrong token
    grpc.StatusCode.FAILED_PRECONDITION: IsADirectoryError,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: WorkerUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: WorkerUnavailableError,
    grpc.StatusCode.UNIMPLEMENTED: NotImplementedError,  # type: ignore[dict-item]
    grpc.StatusCode.ABORTED: StaleObjectError,
}

# Codes that say the *worker* could not serve (down, overloaded, too slow): try the next
# worker, or the object store. INTERNAL is not among them: the worker answered, and what
# failed behind it (usually the object store) would fail the same way elsewhere.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,
    }
)


def to_status(exc: BaseException) -> grpc.StatusCode:
    """Status code for an exception raised while serving an RPC."""
    for exc_type, code in _TO_STATUS:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def from_rpc_error(err: grpc.RpcError, what: str = "") -> OSError:
    """The Python exception for a failed RPC; the RPC error becomes its ``__cause__``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    message = f"{what}: {details}" if what else details
    exc_type = _FROM_STATUS.get(code, StoreError)
    if code == grpc.StatusCode.UNAVAILABLE and StoreUnavailableError.MARKER in details:
        exc_type = StoreUnavailableError  # the worker is up; the store behind it is not
    if exc_type in (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError):
        errno_for = {
            FileNotFoundError: errno.ENOENT,
            FileExistsError: errno.EEXIST,
            PermissionError: errno.EACCES,
            IsADirectoryError: errno.EISDIR,
        }
        exc: OSError = exc_type(errno_for[exc_type], message)
    elif exc_type is NotImplementedError:
        exc = NotImplementedError(message)  # type: ignore[assignment]
    else:
        exc = exc_type(message)  # type: ignore[call-arg]
    exc.grpc_code = code  # type: ignore[attr-defined]
    exc.__cause__ = err
    return exc

