"""How placement binds reservations on dispatchers: a small Protocol (so tests and the
benchmark can stand in their own dispatchers) and its gRPC implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import grpc

from gpuloom.services.common.errors import DomainError, Unavailable
from gpuloom.services.common.grpc_errors import error_from_rpc
from gpuloom.v1 import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc


@dataclass(frozen=True, slots=True)
class BindRequest:
    assignment_id: str
    client_name: str
    priority: int
    memory_cap_bytes: int
    sm_percent: int
    quota_request_percent: float
    quota_limit_percent: float
    token: str
    task_key: str


class Dispatchers(Protocol):
    async def reserve(self, address: str, request: BindRequest) -> dict[str, str]:
        """Reserve on the dispatcher at `address` (idempotent by assignment id); returns the
        environment the job's process must run with. Raises a DomainError."""
        ...

    async def release(self, address: str, assignment_id: str) -> None:
        """Release (idempotent: an unknown id is fine). Raises a DomainError."""
        ...

    async def close(self) -> None: ...


class GrpcDispatchers:
    """One channel per dispatcher address, opened on first use."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._stubs: dict[str, tuple[grpc.aio.Channel, dispatcher_pb2_grpc.DispatcherStub]] = {}

    def _stub(self, address: str) -> dispatcher_pb2_grpc.DispatcherStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address)
            entry = self._stubs[address] = (channel, dispatcher_pb2_grpc.DispatcherStub(channel))
        return entry[1]

    async def reserve(self, address: str, request: BindRequest) -> dict[str, str]:
        message = dispatcher_pb2.ReserveRequest(
            assignment_id=request.assignment_id,
            client_name=request.client_name,
            priority=common_pb2.Priority(level=request.priority),
            memory_cap_bytes=request.memory_cap_bytes,
            share=common_pb2.SpatioTemporalShare(
                sm_percent=request.sm_percent,
                quota=common_pb2.TimeQuota(
                    request_percent=request.quota_request_percent,
                    limit_percent=request.quota_limit_percent,
                ),
            ),
            assignment_token=request.token,
            task_key=request.task_key,
        )
        try:
            answer = await self._stub(address).Reserve(message, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None
        return dict(answer.environment)

    async def release(self, address: str, assignment_id: str) -> None:
        try:
            await self._stub(address).Release(
                dispatcher_pb2.ReleaseRequest(assignment_id=assignment_id),
                timeout=self._timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


def _domain_error(address: str, error: grpc.aio.AioRpcError) -> DomainError:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"dispatcher {address} unreachable: {error.details() or error.code()}")
    domain = error_from_rpc(error)
    domain.message = f"dispatcher {address}: {domain.message}"
    return domain
