"""Protobuf <-> the placement service's own records (a job with its binding, the inventory's
GPUs, a dispatcher's heartbeat). The job spec and every type the clients see convert in
gpuloom.convert.placement, the one converter of those messages. Missing sub-messages become
zero values, which the domain validation then names (e.g. "spec.kind: required ...")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from gpuloom.convert.placement import STATE_FROM_PB, throughput_config_to_pb
from gpuloom.convert.placement import gpu_entry_to_pb as entry_to_pb
from gpuloom.convert.placement import job_to_pb as view_to_pb
from gpuloom.convert.shares import reservation_share
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.models import check_model_name
from gpuloom.domain.placement import (
    ASSIGNMENT_TOKEN_VARIABLE,
    AssignedGpu,
    Assignment,
    GpuEntry,
    JobState,
    JobView,
)
from gpuloom.domain.shares import LOWEST_PRIORITY
from gpuloom.policies.placement import Allocation
from gpuloom.services.placement.domain import JOB_ID_PREFIX, Job
from gpuloom.services.placement.inventory import GpuView, StoreModels, direct_id
from gpuloom.services.placement.repository import JobFilter
from gpuloom.services.placement.scaling import ScalingResult
from gpuloom.v1 import placement_pb2 as pb


def job_view(job: Job, with_token: bool = False) -> JobView:
    """What the service tells about a job: its binding as the assignment (a finished job still
    says where it ran; only a live one carries its environment, and its assignment token only
    `with_token`: for the submitter, never in listings; see docs/security.md)."""
    binding = job.binding
    assignment = None
    if binding is not None and job.state is not JobState.PENDING:
        common = {
            "gpu_uuid": binding.gpu_uuid,
            "node": binding.node,
            "dispatcher_address": binding.dispatcher_address,
            "assignment_id": job.job_id,
            "memory_cap_bytes": binding.share.memory_bytes,
        }
        if binding.mig is not None:
            environment = _environment(job, binding.environment, with_token)
            assignment = Assignment(**common, mig=binding.mig, environment=environment)
        else:
            x, y, _w, _h = binding.rect
            assignment = Assignment(
                **common,
                share=job.spec.share.partition,
                quota_offset_percent=x / 100,
                sm_offset_percent=y,
                environment=_environment(job, binding.environment, with_token),
                extra_gpus=tuple(
                    AssignedGpu(
                        g.gpu_uuid,
                        binding.node,
                        g.dispatcher_address,
                        _environment(job, g.environment, with_token),
                    )
                    for g in binding.extra
                ),
                time_slice_of=binding.time_slice_of,
            )
    return JobView(
        job_id=job.job_id,
        request_id=job.request_id,
        spec=job.spec,
        state=job.state,
        submitted_at=job.submitted_at,
        updated_at=job.updated_at,
        revision=job.revision,
        pending_reason=job.pending_reason,
        message=job.message,
        assignment=assignment,
        policy=job.policy,
        exit_code=job.exit_code,
        function=job.function,
        started_at=job.started_at,
        owner=job.owner,
        training=job.training,
    )


def _environment(job: Job, environment: Mapping[str, str], with_token: bool) -> dict[str, str]:
    if not job.state.holds_capacity:
        return {}
    return {
        name: value
        for name, value in environment.items()
        if with_token or name != ASSIGNMENT_TOKEN_VARIABLE
    }


def job_to_pb(job: Job, with_token: bool = False) -> pb.Job:
    """`with_token` only in answers to the job's submitter (SubmitJob, GetJob by its id)."""
    return view_to_pb(job_view(job, with_token))


def state_from_pb(code: int, field: str) -> JobState:
    state = STATE_FROM_PB.get(code)
    if state is None:
        raise InvalidArgument(field, f"unknown job state {code}")
    return state


def filter_from_pb(request: pb.ListJobsRequest) -> JobFilter:
    return JobFilter(
        states=tuple(state_from_pb(s, "states") for s in request.states),
        task_key=request.task_key,
        gpu_uuid=request.gpu_uuid,
        function=request.function,
    )


def direct_reservations_from_pb(
    gpu_uuid: str, reservations: Iterable[pb.DispatcherReservation]
) -> list[Allocation]:
    """The shares a dispatcher reports that placement did not reserve (its own jobs' ids start
    with JOB_ID_PREFIX), as fleet allocations; values the dispatcher could not have accepted are
    refused, naming the field."""
    direct = []
    for index, reservation in enumerate(reservations):
        if reservation.assignment_id.startswith(JOB_ID_PREFIX):
            continue
        field = f"reservations[{index}]"
        share = reservation_share(reservation)
        share.partition.validate(f"{field}.share")
        if not reservation.assignment_id:
            raise InvalidArgument(f"{field}.assignment_id", "must not be empty")
        direct.append(
            Allocation(
                allocation_id=direct_id(gpu_uuid, reservation.assignment_id),
                share=replace(share, priority=min(share.priority, LOWEST_PRIORITY)),
                task_key=reservation.task_key,
            )
        )
    return direct


def store_models_from_pb(models: Iterable[pb.ResidentModel]) -> StoreModels:
    """The models a dispatcher's store holds, sorted by name; a name the store could not hold,
    a size of 0 or a name listed twice is refused, naming the field."""
    seen: dict[str, int] = {}
    for index, model in enumerate(models):
        field = f"models[{index}]"
        check_model_name(f"{field}.name", model.name)
        if model.bytes <= 0 or model.bytes >= 1 << 63:
            raise InvalidArgument(f"{field}.bytes", f"must be within 1..2**63-1, got {model.bytes}")
        if model.name in seen:
            raise InvalidArgument(f"{field}.name", f"model {model.name!r} is listed twice")
        seen[model.name] = model.bytes
    return tuple(sorted(seen.items()))


def gpu_entry_to_pb(view: GpuView) -> pb.GpuEntry:
    """The inventory's view of a GPU as its clients see it, in the one shared converter."""
    record = view.record
    return entry_to_pb(
        GpuEntry(
            gpu=record.info,
            dispatcher_address=record.dispatcher_address,
            schedulable=view.schedulable,
            lost=record.lost,
            last_heartbeat=record.last_heartbeat,
            utilization_percent=record.utilization_percent,
            memory_used_bytes=record.memory_used_bytes,
            memory_reserved_bytes=view.memory_reserved_bytes,
            area_reserved_percent=view.area_reserved_percent,
            jobs=view.jobs,
            direct_reservations=view.direct_reservations,
        )
    )


def scaling_to_pb(result: ScalingResult) -> pb.SetFunctionLoadResponse:
    msg = pb.SetFunctionLoadResponse(
        added=[job_to_pb(j, with_token=True) for j in result.added],
        removed=[job_to_pb(j) for j in result.removed],
        capacity_requests_per_s=result.capacity_rps,
    )
    if result.most_efficient is not None:
        msg.most_efficient.CopyFrom(throughput_config_to_pb(result.most_efficient))
    return msg
