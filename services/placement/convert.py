"""Protobuf <-> domain for the placement service. Missing sub-messages become zero values,
which the domain validation then names (e.g. "spec.kind: required ...")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuloom.convert.placement import KIND_FROM_PB, STATE_FROM_PB, throughput_config_to_pb
from gpuloom.convert.placement import gpu_entry_to_pb as entry_to_pb
from gpuloom.convert.placement import job_to_pb as view_to_pb
from gpuloom.convert.training import hook_from_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.models import check_model_name
from gpuloom.domain.placement import (
    ASSIGNMENT_TOKEN_VARIABLE,
    AssignedGpu,
    Assignment,
    GpuEntry,
    JobSpec,
    JobState,
    JobView,
    Slo,
)
from gpuloom.domain.shares import (
    DEFAULT_PRIORITY,
    LOWEST_PRIORITY,
    SpatioTemporalShare,
    TimeQuota,
)
from gpuloom.policies.placement import Allocation
from gpuloom.services.placement.domain import JOB_ID_PREFIX, Job
from gpuloom.services.placement.inventory import GpuView, StoreModels, direct_id
from gpuloom.services.placement.repository import JobFilter
from gpuloom.services.placement.scaling import ScalingResult
from gpuloom.v1 import placement_pb2 as pb


def spec_from_pb(msg: pb.JobSpec, field: str = "spec") -> JobSpec:
    if msg.kind not in KIND_FROM_PB and msg.kind != pb.JOB_KIND_UNSPECIFIED:
        raise InvalidArgument(f"{field}.kind", f"unknown job kind {msg.kind}")
    resources = msg.resources
    which = resources.WhichOneof("share")
    share = None
    if which == "mps":
        quota = resources.mps.quota
        # A limit of 0 means "no more than the request".
        limit = quota.limit_percent or quota.request_percent
        share = SpatioTemporalShare(
            resources.mps.sm_percent, TimeQuota(quota.request_percent, limit)
        )
    return JobSpec(
        name=msg.name,
        kind=KIND_FROM_PB.get(msg.kind),
        memory_bytes=resources.memory_bytes,
        share=share,
        whole_gpus=resources.whole_gpus if which == "whole_gpus" else 0,
        mig_slices=(resources.mig.slices or 1) if which == "mig" else 0,
        task_key=msg.task_key,
        priority=msg.priority.level if msg.HasField("priority") else DEFAULT_PRIORITY,
        slo=Slo(msg.slo.p99_latency_ms, msg.slo.target_requests_per_s),
        policy=msg.policy.strip(),
        gpu_model=msg.gpu_model.strip(),
        command=tuple(msg.command),
        shared_model=msg.shared_model,
        checkpoint=hook_from_pb(msg),
        max_gpus=msg.max_gpus,
        cpu_milli=msg.cpu_milli,
        host_memory_bytes=msg.host_memory_bytes,
    )


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
            "memory_cap_bytes": binding.memory_cap_bytes,
        }
        if binding.mig is not None:
            environment = _environment(job, binding.environment, with_token)
            assignment = Assignment(**common, mig=binding.mig, environment=environment)
        else:
            x, y, _w, _h = binding.rect
            assignment = Assignment(
                **common,
                share=SpatioTemporalShare(job.spec.sm_percent, job.spec.quota),
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
        share = reservation.share
        field = f"reservations[{index}]"
        if not 1 <= share.sm_percent <= 100:
            raise InvalidArgument(f"{field}.share.sm_percent", "must be within 1..100")
        if not 0 < share.quota.request_percent <= 100:
            raise InvalidArgument(f"{field}.share.quota.request_percent", "must be in (0, 100]")
        if not reservation.assignment_id:
            raise InvalidArgument(f"{field}.assignment_id", "must not be empty")
        direct.append(
            Allocation(
                allocation_id=direct_id(gpu_uuid, reservation.assignment_id),
                sm_percent=share.sm_percent,
                quota_percent=share.quota.request_percent,
                memory_bytes=reservation.memory_cap_bytes,
                priority=min(reservation.priority.level, LOWEST_PRIORITY),
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
