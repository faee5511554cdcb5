"""How placement talks to dispatchers: binding reservations, and running MIG batches. Each is a
small Protocol (so tests and the benchmark can stand in their own dispatchers) with its gRPC
implementation; both gRPC implementations share one `DispatcherChannels`, so placement holds one
connection per dispatcher."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from gpuloom.convert.mig import task_run_from_pb, task_start_from_pb
from gpuloom.convert.shares import reservation_share_fields
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.errors import DomainError, Unavailable
from gpuloom.domain.mig_runs import TaskEnd, TaskRun, TaskStart
from gpuloom.domain.shares import Share
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc

if TYPE_CHECKING:
    from gpuloom.services.placement.domain import Binding, Job


@dataclass(frozen=True, slots=True)
class BindRequest:
    """What placement asks a dispatcher to reserve for a job: the share its binding holds on
    that GPU (the job's, with the memory cap placement decided)."""

    assignment_id: str
    client_name: str
    share: Share
    token: str
    task_key: str
    time_slice_of: str = ""  # the time-slice group it joins on that GPU (Binding.time_slice_of)


def bind_request(job: Job, binding: Binding) -> BindRequest:
    """What reserving `job` where `binding` says (its GPU, or a migration's target) asks of
    that GPU's dispatcher."""
    spec = job.spec
    return BindRequest(
        assignment_id=job.job_id,
        client_name=spec.name,
        share=binding.share,
        token=binding.token,
        task_key=spec.task_key,
        time_slice_of=binding.time_slice_of,
    )


class Dispatchers(Protocol):
    async def reserve(self, address: str, request: BindRequest) -> dict[str, str]:
        """Reserve on the dispatcher at `address` (idempotent by assignment id); returns the
        environment the job's process must run with. Raises a DomainError."""
        ...

    async def release(self, address: str, assignment_id: str) -> None:
        """Release (idempotent: an unknown id is fine). Raises a DomainError."""
        ...


class DispatcherChannels:
    """One gRPC channel per dispatcher address, opened on first use, for every client of the
    dispatchers; its owner closes it once they are done."""

    def __init__(self) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, dispatcher_pb2_grpc.DispatcherStub]] = {}

    def stub(self, address: str) -> dispatcher_pb2_grpc.DispatcherStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = open_aio_channel(address)
            entry = self._stubs[address] = (channel, dispatcher_pb2_grpc.DispatcherStub(channel))
        return entry[1]

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


class GrpcDispatchers:
    def __init__(self, channels: DispatcherChannels, timeout_s: float) -> None:
        self._channels = channels
        self._timeout_s = timeout_s

    async def reserve(self, address: str, request: BindRequest) -> dict[str, str]:
        message = dispatcher_pb2.ReserveRequest(
            assignment_id=request.assignment_id,
            client_name=request.client_name,
            **reservation_share_fields(request.share),
            assignment_token=request.token,
            task_key=request.task_key,
            time_slice_of=request.time_slice_of,
        )
        try:
            answer = await self._channels.stub(address).Reserve(message, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None
        return dict(answer.environment)

    async def release(self, address: str, assignment_id: str) -> None:
        try:
            await self._channels.stub(address).Release(
                dispatcher_pb2.ReleaseRequest(assignment_id=assignment_id),
                timeout=self._timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None


def _domain_error(address: str, error: grpc.aio.AioRpcError) -> DomainError:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"dispatcher {address} unreachable: {error.details() or error.code()}")
    domain = error_from_rpc(error)
    domain.message = f"dispatcher {address}: {domain.message}"
    return domain


# ---- MIG batches ----


@dataclass(frozen=True, slots=True)
class MigTaskRequest:
    name: str
    seconds_by_size: Mapping[int, float] = field(hash=False)


@dataclass(frozen=True, slots=True)
class MigRunRequest:
    tasks: tuple[MigTaskRequest, ...]
    policy: str = "far"
    # Instance creation/destruction seconds by size instead of the paper's Table 1 (empty:
    # the dispatcher's defaults).
    create_seconds: Mapping[int, float] = field(default_factory=dict, hash=False)
    destroy_seconds: Mapping[int, float] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, slots=True)
class MigRunStarted:
    """The dispatcher planned the batch and starts running it."""

    planned_makespan_s: float


class MigRunner(Protocol):
    def run_mig_batch(
        self, address: str, request: MigRunRequest, ends: AsyncIterator[TaskEnd]
    ) -> AsyncIterator[MigRunStarted | TaskStart | TaskRun]:
        """Run a batch on the dispatcher at `address` (RunMigBatch) as its runner: yields
        MigRunStarted once it is planned there, then each task as it is handed out (TaskStart:
        its instance) and as it ends, and stops when the run is over. `ends` are the runner's
        reports of how its started tasks ended, sent as they come; when they stop, the run
        winds down. Raises a DomainError when the dispatcher refuses the batch, cannot be
        reached, or the stream breaks."""
        ...


class GrpcMigRunner:
    """RunMigBatch over gRPC. The stream has no deadline (a batch runs as long as its tasks
    do); the first answer must come within `start_timeout_s`."""

    def __init__(self, channels: DispatcherChannels, start_timeout_s: float = 60.0) -> None:
        self._channels = channels
        self._start_timeout_s = start_timeout_s

    async def run_mig_batch(
        self, address: str, request: MigRunRequest, ends: AsyncIterator[TaskEnd]
    ) -> AsyncIterator[MigRunStarted | TaskStart | TaskRun]:
        batch = dispatcher_pb2.RunMigBatchRequest(
            tasks=[
                dispatcher_pb2.MigTaskSpec(
                    name=task.name, seconds_by_size=dict(task.seconds_by_size)
                )
                for task in request.tasks
            ],
            policy=request.policy,
            create_seconds=dict(request.create_seconds),
            destroy_seconds=dict(request.destroy_seconds),
        )

        async def inputs() -> AsyncIterator[dispatcher_pb2.MigRunInput]:
            yield dispatcher_pb2.MigRunInput(batch=batch)
            async for end in ends:
                yield dispatcher_pb2.MigRunInput(
                    task_end=dispatcher_pb2.MigTaskEnd(task=end.task, exit_code=end.exit_code)
                )

        call = self._channels.stub(address).RunMigBatch(inputs())
        try:
            try:
                first = await asyncio.wait_for(call.read(), self._start_timeout_s)
            except TimeoutError:
                raise Unavailable(
                    f"dispatcher {address} did not start the MIG batch within "
                    f"{self._start_timeout_s:g} s"
                ) from None
            update = first
            while update is not grpc.aio.EOF:
                kind = update.WhichOneof("update")
                if kind == "planned":
                    yield MigRunStarted(update.planned.planned_makespan_s)
                elif kind == "task_started":
                    yield task_start_from_pb(update.task_started)
                elif kind == "task_ended":
                    yield task_run_from_pb(update.task_ended)
                update = await call.read()
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None
        finally:
            call.cancel()  # a no-op once the stream is over
