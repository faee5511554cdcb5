"""gpuloom.v1.Placement servicer: protobuf in, domain core, protobuf out. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import grpc

from gpuloom.convert.placement import gpu_info_from_pb, spec_from_pb
from gpuloom.convert.training import reports_from_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.training import MAX_SUSPEND_REASON_CHARS
from gpuloom.services.common.auth import Role, current_caller
from gpuloom.services.common.grpc_errors import rpc, stream_rpc
from gpuloom.services.placement import convert
from gpuloom.services.placement.core import PlacementCore
from gpuloom.services.placement.domain import Job
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc as pb_grpc

SERVICE = "gpuloom.v1.Placement"
Context = grpc.aio.ServicerContext
MAX_MESSAGE_CHARS = 4096


def _job_id(job_id: str) -> str:
    if not 1 <= len(job_id) <= 64:
        raise InvalidArgument("job_id", "required (at most 64 characters)")
    return job_id


def _text(field: str, value: str) -> str:
    if len(value) > MAX_MESSAGE_CHARS:
        raise InvalidArgument(field, f"must be at most {MAX_MESSAGE_CHARS} characters")
    return value


def _owner() -> str:
    """Who submits: the name of the caller's token ("" when placement takes no tokens)."""
    caller = current_caller()
    return "" if caller is None else caller.name


def _only() -> str | None:
    """Whose jobs the caller may see and end: a submitter its own, anyone else every job."""
    caller = current_caller()
    return None if caller is None or caller.sees_every_job else caller.name


def _submitted(job: Job) -> bool:
    """Whether the caller submitted `job`: only then does an answer carry its assignment token
    (an admin who sees every job, and an anonymous reader, never get another's). Where
    placement takes no tokens (GPULOOM_INSECURE) every caller is the same one."""
    caller = current_caller()
    return caller is None or (caller.role is not Role.ANONYMOUS and caller.name == job.owner)


def _evictions(evictions: Sequence[pb.Eviction]) -> list[tuple[str, str]]:
    """A heartbeat's evictions (assignment id, reason), each checked."""
    for index, eviction in enumerate(evictions):
        if not 1 <= len(eviction.assignment_id) <= 128:
            raise InvalidArgument(f"evictions[{index}].assignment_id", "1..128 characters")
        if len(eviction.reason) > MAX_SUSPEND_REASON_CHARS:
            raise InvalidArgument(
                f"evictions[{index}].reason", f"at most {MAX_SUSPEND_REASON_CHARS} characters"
            )
    return [(e.assignment_id, e.reason) for e in evictions]


class PlacementServicer(pb_grpc.PlacementServicer):
    def __init__(self, core: PlacementCore) -> None:
        self._core = core

    @rpc(SERVICE)
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Context) -> pb.Job:
        job = await self._core.submit(
            request.request_id, spec_from_pb(request.spec), owner=_owner()
        )
        return convert.job_to_pb(job, with_token=_submitted(job))

    @rpc(SERVICE)
    async def GetJob(self, request: pb.GetJobRequest, context: Context) -> pb.Job:
        # Its submitter, an admin or an anonymous reader gets the job; only its submitter gets
        # the token (besides SubmitJob's answer; ListJobs and WatchJob never carry it).
        job = await self._core.get(_job_id(request.job_id), _only())
        return convert.job_to_pb(job, with_token=_submitted(job))

    @rpc(SERVICE)
    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsResponse:
        where = replace(convert.filter_from_pb(request), owner=_only())
        jobs, token = await self._core.list(where, request.page_size, request.page_token)
        return pb.ListJobsResponse(jobs=[convert.job_to_pb(j) for j in jobs], next_page_token=token)

    @rpc(SERVICE)
    async def CancelJob(self, request: pb.CancelJobRequest, context: Context) -> pb.Job:
        job = await self._core.cancel(
            _job_id(request.job_id), _text("reason", request.reason), _only()
        )
        return convert.job_to_pb(job)

    @stream_rpc(SERVICE)
    async def WatchJob(
        self, request: pb.WatchJobRequest, context: Context
    ) -> AsyncIterator[pb.Job]:
        async for job in self._core.watch(_job_id(request.job_id), _only()):
            yield convert.job_to_pb(job)

    @rpc(SERVICE)
    async def ReportJobDone(self, request: pb.ReportJobDoneRequest, context: Context) -> pb.Job:
        job = await self._core.report_done(
            _job_id(request.job_id),
            request.succeeded,
            request.exit_code,
            _text("message", request.message),
            _only(),
        )
        return convert.job_to_pb(job)

    @rpc(SERVICE)
    async def ReportCheckpoint(
        self, request: pb.ReportCheckpointRequest, context: Context
    ) -> pb.Job:
        job = await self._core.report_checkpoint(
            _job_id(request.job_id),
            _text("migration_id", request.migration_id),
            request.succeeded,
            _text("message", request.message),
            _only(),
        )
        return convert.job_to_pb(job, with_token=_submitted(job))

    @rpc(SERVICE)
    async def SetFunctionLoad(
        self, request: pb.SetFunctionLoadRequest, context: Context
    ) -> pb.SetFunctionLoadResponse:
        template = spec_from_pb(request.template, "template")
        result = await self._core.set_function_load(
            request.function, request.requests_per_s, template
        )
        return convert.scaling_to_pb(result)

    @rpc(SERVICE)
    async def RegisterGpu(
        self, request: pb.RegisterGpuRequest, context: Context
    ) -> pb.RegisterGpuResponse:
        info = gpu_info_from_pb(request.gpu)
        interval = await self._core.register_gpu(
            info,
            request.dispatcher_address,
            convert.direct_reservations_from_pb(info.gpu_uuid, request.reservations),
            convert.store_models_from_pb(request.models),
        )
        return pb.RegisterGpuResponse(heartbeat_interval_s=interval)

    @rpc(SERVICE)
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Context
    ) -> pb.HeartbeatResponse:
        stale = await self._core.heartbeat(
            request.gpu_uuid,
            request.utilization_percent,
            request.memory_used_bytes,
            request.assignment_ids,
            convert.direct_reservations_from_pb(request.gpu_uuid, request.reservations),
            convert.store_models_from_pb(request.models),
            reports_from_pb(request.training),
            _evictions(request.evictions),
            request.suspend_releases_memory,
        )
        return pb.HeartbeatResponse(release_assignment_ids=stale)

    @rpc(SERVICE)
    async def ListGpus(self, request: pb.ListGpusRequest, context: Context) -> pb.ListGpusResponse:
        views, token = self._core.gpus(request.node, request.page_size, request.page_token)
        return pb.ListGpusResponse(
            gpus=[convert.gpu_entry_to_pb(v) for v in views], next_page_token=token
        )
