"""Domain errors. Domain code raises these; gpuloom/convert/status.py maps them to gRPC codes.

Nothing here knows about gRPC, so the policies and the simulator can use the same errors.
"""

from __future__ import annotations


class DomainError(Exception):
    """Base of every error a domain core raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(DomainError):
    """The request itself is wrong; `field` names the offending field (dotted path)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(DomainError):
    pass


class AlreadyExists(DomainError):
    pass


class FailedPrecondition(DomainError):
    """The request is well-formed but the system is not in a state that allows it."""


class Aborted(DomainError):
    """A concurrency conflict, such as a stale version on a write: read again, then retry."""


class Unauthenticated(DomainError):
    """The caller did not prove who it is (no bearer token, or one nobody issued)."""


class PermissionDenied(DomainError):
    """The caller is known but may not do this (another submitter's job, an admin's RPC)."""


class ResourceExhausted(DomainError):
    pass


class Unavailable(DomainError):
    """A dependency the request needs (a database, a dispatcher) cannot be reached right now."""
