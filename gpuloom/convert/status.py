"""The one table mapping domain errors to gRPC status codes, both ways: servicers answer with
`status_for` (through services/common/grpc_errors.py), clients turn a failed call back into
its domain error with `error_from_rpc`."""

from __future__ import annotations

import grpc

from gpuloom.domain import errors

STATUS_BY_ERROR: dict[type[errors.DomainError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(error: errors.DomainError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return grpc.StatusCode.INTERNAL


ERROR_BY_STATUS: dict[grpc.StatusCode, type[errors.DomainError]] = {
    code: error for error, code in STATUS_BY_ERROR.items()
}


def error_from_rpc(error: grpc.RpcError) -> errors.DomainError:
    """The client side of the table: turn a failed call back into the domain error it came from."""
    code = error.code()  # type: ignore[attr-defined]
    message = error.details() or code.name  # type: ignore[attr-defined]
    cls = ERROR_BY_STATUS.get(code)
    if cls is errors.InvalidArgument:
        field, _, problem = message.partition(": ")
        return errors.InvalidArgument(field, problem)
    if cls is None:
        return errors.Unavailable(f"{code.name}: {message}")
    return cls(message)
