"""The one table between exceptions and gRPC statuses."""

from __future__ import annotations

import grpc
import pytest

from cachefs.errors import (
    DeadlineExceededError,
    InvalidPathError,
    StaleObjectError,
    StoreError,
    UnknownMountError,
    WorkerUnavailableError,
    from_rpc_error,
    to_status,
)


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "exc, code, back",
    [
        (InvalidPathError("bad"), grpc.StatusCode.INVALID_ARGUMENT, InvalidPathError),
        (UnknownMountError("m"), grpc.StatusCode.NOT_FOUND, FileNotFoundError),
        (FileNotFoundError("x"), grpc.StatusCode.NOT_FOUND, FileNotFoundError),
        (PermissionError("x"), grpc.StatusCode.PERMISSION_DENIED, PermissionError),
        (IsADirectoryError("x"), grpc.StatusCode.FAILED_PRECONDITION, IsADirectoryError),
        (StaleObjectError("x"), grpc.StatusCode.ABORTED, StaleObjectError),
        (DeadlineExceededError("x"), grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (WorkerUnavailableError("x"), grpc.StatusCode.UNAVAILABLE, WorkerUnavailableError),
        (StoreError("x"), grpc.StatusCode.INTERNAL, StoreError),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL, StoreError),
    ],
)
def test_round_trip_keeps_type_message_code_and_cause(exc, code, back):
    assert to_status(exc) == code
    err = _FakeRpcError(code, "details from the worker")
    out = from_rpc_error(err, "read data/x")
    assert isinstance(out, back)
    assert isinstance(out, OSError)
    assert "read data/x" in str(out) and "details from the worker" in str(out)
    assert out.grpc_code == code
    assert out.__cause__ is err
