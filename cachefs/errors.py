"""Errors, and the one table that maps them to and from gRPC status codes.

Errors are members of the built-in OSError family (as fsspec's are), so callers catch
``FileNotFoundError`` or ``PermissionError`` whether data came from the cache or the store.

On the wire. A server (worker or master) aborts a failed RPC with :func:`abort`: the status code
from the table, the exception's message as the details, and a trailing-metadata entry
``cachefs-error`` (:data:`ERROR_METADATA`) that names what failed, e.g.
``type=FileNotFoundError;fault=request;errno=ENOENT``: the table type the exception is an
instance of (most specific first), its fault domain, and its errno by name (when it has one).
Several types share a status code (UnknownMountError and FileNotFoundError are both NOT_FOUND),
so the code alone cannot say which; the detail can. The client turns the failure back into the
same exception type with :func:`from_rpc_error` (status code kept as ``exc.grpc_code``, the
server's message, the RPC error as ``__cause__``); without a detail (an older server, or gRPC's
own errors: a dead channel, a deadline) it falls back to what the code alone means.

Fault domains (:func:`fault_of`), which decide what a client does next:

- ``"worker"`` (:data:`WORKER`): the server that answered could not serve (down, shutting down,
  overloaded, too slow, its own disk or a bug): another worker may; count it against this one.
- ``"store"`` (:data:`STORE`): the object store behind the worker failed or changed (outage,
  I/O error, timeout, the object changed under a pinned reader): every worker would meet the same,
  so no worker's breaker opens, and the caller gets the store error.
- ``"request"`` (:data:`REQUEST`): the request itself fails anywhere (bad path, no such mount or
  object, denied, unsupported): raise it to the caller as it is.

Importing this module loads neither grpc nor fsspec: status codes are kept by name and
resolved when a function needs them.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import grpc


def _rebuild(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> OSError:
    """Unpickle a :class:`CacheFSError` (see its ``__reduce__``)."""
    error = cls.__new__(cls, *args)
    OSError.__init__(error, *args)
    error.__dict__.update(state)
    return error


class CacheFSError(OSError):
    """Base class for errors raised by cachefs itself (not by the object store)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # The subclasses take (message) while OSError pickles (errno, message): rebuilt without
        # calling their __init__, so an error crosses a pipe (a DataLoader worker's) as itself.
        return (_rebuild, (type(self), self.args, self.__dict__))


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

    # Wording of the message only: nothing parses it. Clients tell a store outage from a worker
    # fault by the error detail (fault_of), never by this text.
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


class ControlPlaneUnavailableError(CacheFSError, ConnectionError):
    """The control plane cannot act now: no leading master (an election under way), or its etcd
    cannot be reached. Reads go on from the last view; another master may answer. errno EAGAIN:
    a leader is to be expected soon (asking again within a budget helps: cachefs/masters.py);
    ENOTCONN (``soon=False``): etcd cannot be reached, so no master can lead until it can."""

    def __init__(self, message: str, soon: bool = True) -> None:
        OSError.__init__(self, errno.EAGAIN if soon else errno.ENOTCONN, message)


class StaleLeaderError(CacheFSError):
    """A worker refused a command from a master whose leadership has ended (an older epoch)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPERM, message)


class InternalError(CacheFSError):
    """A server failed in a way it did not expect (a bug in it): what any exception outside the
    table below is sent as. The message says what; another server may not fail the same way."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


WORKER = "worker"
STORE = "store"
REQUEST = "request"
FAULTS = (WORKER, STORE, REQUEST)

#: Trailing-metadata key of the error detail (see the module docstring for its value).
ERROR_METADATA = "cachefs-error"

# The one table: exception type, status code (by name), fault domain, the errno a rebuilt
# exception gets when the server's had none, and whether it is what the code means alone (one per
# code; the client's fallback when a failure carries no detail). Most specific first: an exception
# is sent as the first type it is an instance of. Both directions are derived from it below.
_TABLE: tuple[tuple[type[BaseException], str, str, int | None, bool], ...] = (
    (InvalidPathError, "INVALID_ARGUMENT", REQUEST, errno.EINVAL, True),
    (StoreUnavailableError, "UNAVAILABLE", STORE, errno.ECONNREFUSED, False),
    (StaleObjectError, "ABORTED", STORE, errno.ESTALE, True),
    (UnknownMountError, "NOT_FOUND", REQUEST, errno.ENOENT, False),
    (WorkerUnavailableError, "UNAVAILABLE", WORKER, errno.EHOSTUNREACH, True),
    (UnauthenticatedError, "UNAUTHENTICATED", REQUEST, errno.EACCES, True),
    (OverloadedError, "RESOURCE_EXHAUSTED", WORKER, errno.EBUSY, True),
    (DeadlineExceededError, "DEADLINE_EXCEEDED", WORKER, errno.ETIMEDOUT, True),
    (StoreError, "INTERNAL", STORE, errno.EIO, True),
    (FileNotFoundError, "NOT_FOUND", REQUEST, errno.ENOENT, True),
    (FileExistsError, "ALREADY_EXISTS", REQUEST, errno.EEXIST, True),
    (IsADirectoryError, "FAILED_PRECONDITION", REQUEST, errno.EISDIR, True),
    (NotADirectoryError, "FAILED_PRECONDITION", REQUEST, errno.ENOTDIR, False),
    (PermissionError, "PERMISSION_DENIED", REQUEST, errno.EACCES, True),
    (TimeoutError, "DEADLINE_EXCEEDED", STORE, errno.ETIMEDOUT, False),  # a store call that timed out
    (ValueError, "INVALID_ARGUMENT", REQUEST, None, False),
    (NotImplementedError, "UNIMPLEMENTED", REQUEST, None, True),
    (ControlPlaneUnavailableError, "UNAVAILABLE", WORKER, errno.EAGAIN, False),
    (StaleLeaderError, "FAILED_PRECONDITION", REQUEST, errno.EPERM, False),
    (InternalError, "INTERNAL", WORKER, errno.EIO, False),
    (OSError, "INTERNAL", WORKER, errno.EIO, False),  # not the store's: _store_errors wraps those
)

# Codes only gRPC itself produces (no row has them): what they mean without a detail.
_GRPC_ONLY: dict[str, type[OSError]] = {
    "CANCELLED": WorkerUnavailableError,
    "UNKNOWN": WorkerUnavailableError,  # a server that failed without saying how
    "OUT_OF_RANGE": InvalidPathError,
}

_Row = tuple[type[BaseException], str, str, "int | None", bool]
_BY_NAME: dict[str, _Row] = {row[0].__name__: row for row in _TABLE}
_BARE: dict[str, type[BaseException]] = {code: t for t, code, _, _, bare in _TABLE if bare}


def _row(exc: BaseException) -> _Row:
    """The row ``exc`` is sent as: the first type it is an instance of; anything outside the
    table (a bug in the server) as InternalError."""
    for row in _TABLE:
        if isinstance(exc, row[0]):
            return row
    return _BY_NAME[InternalError.__name__]


def _code(name: str) -> grpc.StatusCode:
    import grpc  # here, not at import time: see the module docstring

    return grpc.StatusCode[name]


def to_status(exc: BaseException) -> grpc.StatusCode:
    """Status code for an exception raised while serving an RPC."""
    return _code(_row(exc)[1])


def error_detail(exc: BaseException) -> str:
    """The ``cachefs-error`` trailing-metadata value for ``exc`` (ASCII, ``key=value;...``)."""
    row = _row(exc)
    parts = [f"type={row[0].__name__}", f"fault={row[2]}"]
    number = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if isinstance(number, int) and number in errno.errorcode:
        parts.append(f"errno={errno.errorcode[number]}")
    return ";".join(parts)


def abort(context: Any, exc: BaseException, message: str | None = None) -> NoReturn:
    """End the RPC being served with ``exc``'s status, message and error detail.

    The one way servers fail an RPC (servicers through server/rpc.py, the token check, the decode
    guard), so every abort carries the detail that :func:`from_rpc_error` reads.
    """
    context.set_trailing_metadata(((ERROR_METADATA, error_detail(exc)),))
    context.abort(to_status(exc), message if message is not None else (str(exc) or type(exc).__name__))
    raise AssertionError("context.abort returned")  # grpc raises; this keeps NoReturn honest


def parse_detail(err: Any) -> dict[str, str]:
    """The error detail an RPC error carries ({} if none, or a fake error without metadata)."""
    try:
        metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a call that never started has none
        metadata = None
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == ERROR_METADATA:
            if isinstance(value, bytes):
                value = value.decode("ascii", "replace")
            return _detail_fields(str(value))
    return {}


def _detail_fields(value: str) -> dict[str, str]:
    fields = dict(part.partition("=")[::2] for part in value.split(";") if part)
    return {k.strip(): v.strip() for k, v in fields.items()}


def _code_name(err: Any) -> str:
    code = err.code() if hasattr(err, "code") else None
    return getattr(code, "name", None) or "UNKNOWN"


def _bare_type(code_name: str) -> type[BaseException]:
    return _BARE.get(code_name) or _GRPC_ONLY.get(code_name) or StoreError


def _fault_of_type(exc_type: type[BaseException]) -> str:
    for t, _, fault, _, _ in _TABLE:
        if issubclass(exc_type, t):
            return fault
    return _BY_NAME[InternalError.__name__][2]


def fault_of(err: BaseException) -> str:
    """Where a failure lies: ``"worker"``, ``"store"`` or ``"request"`` (see the module docstring).

    ``err`` is a ``grpc.RpcError`` (its detail if it has one, else what its code alone means:
    UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, CANCELLED, UNKNOWN are the worker's, INTERNAL
    the store's, the rest the request's), or an exception from :func:`from_rpc_error` or raised
    locally (by its type). Only ``"worker"`` should open a worker's breaker or move on to the next
    worker; a ``"store"`` fault reaches the caller as the store error it is.
    """
    fault = getattr(err, "cachefs_fault", None)
    if fault in FAULTS:
        return fault
    if hasattr(err, "code") and not isinstance(err, OSError):  # an RpcError (or one shaped like it)
        fault = parse_detail(err).get("fault")
        if fault in FAULTS:
            return fault
        return _fault_of_type(_bare_type(_code_name(err)))
    return _fault_of_type(type(err))


def is_worker_fault(err: BaseException) -> bool:
    """``fault_of(err) == "worker"``: try the next worker and count a failure against this one."""
    return fault_of(err) == WORKER


def from_rpc_error(err: grpc.RpcError, what: str = "") -> OSError:
    """The Python exception for a failed RPC: the type the server raised (by its error detail; by
    the status code when there is none), ``grpc_code`` and ``cachefs_fault`` set, the RPC error as
    its ``__cause__``. ValueError and NotImplementedError come back as themselves (not OSErrors)."""
    code_name = _code_name(err)
    details = (err.details() if hasattr(err, "details") else None) or code_name
    exc = _rebuild_error(code_name, parse_detail(err), details, what)
    exc.grpc_code = err.code() if hasattr(err, "code") else _code("UNKNOWN")  # type: ignore[attr-defined]
    exc.__cause__ = err
    return exc


def wire_error(exc: BaseException) -> tuple[str, str, str]:
    """``exc`` as a server sends it outside gRPC (the worker's sockets: server/worker/metaops.py):
    its status code's name, its error detail and its message."""
    return _row(exc)[1], error_detail(exc), str(exc) or type(exc).__name__


def from_wire_error(code_name: str, detail: str, message: str, what: str = "") -> OSError:
    """The exception :func:`wire_error` describes, as :func:`from_rpc_error` would build it
    (without ``grpc_code``: this needs no grpc)."""
    return _rebuild_error(code_name or "UNKNOWN", _detail_fields(detail), message or code_name, what)


def failed_range_error(number: int, message: str) -> OSError:
    """A range a worker's socket answered FAILED, with an errno (one of the errors asking again
    cannot mend: server/worker/fill.py), as the exception gRPC would have raised for it."""
    exc = InvalidPathError(message) if number == errno.EINVAL else OSError(number or errno.EIO, message)
    exc.cachefs_fault = REQUEST  # type: ignore[attr-defined]  # the object's or the request's, not the socket's
    return exc


def _rebuild_error(code_name: str, detail: dict[str, str], details: str, what: str) -> OSError:
    message = f"{what}: {details}" if what else details
    row = _BY_NAME.get(detail.get("type", ""))
    exc_type = row[0] if row else _bare_type(code_name)
    fault = detail.get("fault")
    if fault not in FAULTS:
        fault = _fault_of_type(exc_type)
    number = getattr(errno, detail.get("errno", ""), None) if detail.get("errno", "").startswith("E") else None
    if issubclass(exc_type, CacheFSError):
        exc: BaseException = exc_type(message)  # type: ignore[call-arg]
        if isinstance(number, int):
            exc.errno = number  # type: ignore[attr-defined]
    elif issubclass(exc_type, OSError):
        default = _BY_NAME[exc_type.__name__][3]
        exc = exc_type(number if isinstance(number, int) else default, message)
    else:  # ValueError, NotImplementedError
        exc = exc_type(message)
    exc.cachefs_fault = fault  # type: ignore[attr-defined]
    return exc  # type: ignore[return-value]


def retryable_codes() -> frozenset[grpc.StatusCode]:
    """Codes that, without a detail, mean the worker could not serve (derived from the table)."""
    names = {code for code, t in _BARE.items() if _fault_of_type(t) == WORKER}
    names |= {code for code, t in _GRPC_ONLY.items() if _fault_of_type(t) == WORKER}
    return frozenset(_code(name) for name in names)


def __getattr__(name: str) -> Any:
    # RETRYABLE_CODES needs grpc's StatusCode: made on first use, so importing this module does not
    # load grpc. Prefer fault_of(err): a code cannot tell a store outage from a worker's.
    if name == "RETRYABLE_CODES":
        value = retryable_codes()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
