"""gpuloom.v1.Placement's messages to and from the client-facing domain types
(gpuloom.domain.placement and the job spec), and their JSON form: the one converter of each
message, for the service and its clients alike.

Every conversion here is exact for what the service sends, so `job_to_pb(job_from_pb(m))` is
`m` again: `*_json` print the same JSON as protobuf's own mapping of the message would (field
names as in the proto, enums by name, 64-bit integers as strings)."""

from __future__ import annotations

from typing import Any, Protocol

from google.protobuf.message import Message

from gpuloom.convert.gpus import gpu_fields, gpu_from_fields
from gpuloom.convert.json_mapping import message_json
from gpuloom.convert.shares import priority_from_pb, share_from_pb, share_to_pb
from gpuloom.convert.times import timestamp, unix_s
from gpuloom.convert.training import hook_from_pb, hook_to_pb, training_from_pb, training_to_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import GpuInfo, MigInstance
from gpuloom.domain.placement import (
    AssignedGpu,
    Assignment,
    FunctionScaling,
    GpuEntry,
    JobKind,
    JobSpec,
    JobState,
    JobView,
    MigSlot,
    Slo,
    ThroughputConfig,
)
from gpuloom.domain.shares import Share, share_of
from gpuloom.v1 import common_pb2
from gpuloom.v1 import placement_pb2 as pb

KIND_TO_PB = {
    JobKind.INFERENCE: pb.JOB_KIND_INFERENCE,
    JobKind.TRAINING: pb.JOB_KIND_TRAINING,
    JobKind.BATCH: pb.JOB_KIND_BATCH,
}
KIND_FROM_PB = {code: kind for kind, code in KIND_TO_PB.items()}
STATE_TO_PB = {state: pb.JobState.Value("JOB_STATE_" + state.name) for state in JobState}
STATE_FROM_PB = {code: state for state, code in STATE_TO_PB.items()}


# ---- job specs ----


def spec_from_pb(msg: pb.JobSpec, field: str = "spec") -> JobSpec:
    """Unvalidated but for the kind (InvalidArgument names `field`.kind for a kind this
    version does not know), with the share's defaults applied (gpuloom.domain.shares.share_of)
    and the policy and GPU model stripped of blanks. A MIG request marks a MIG batch task
    (`mig_slices` 1) and asks for the size its `slices` names (`mig_size`; 0: the batch planner
    chooses)."""
    if msg.kind not in KIND_FROM_PB and msg.kind != pb.JOB_KIND_UNSPECIFIED:
        raise InvalidArgument(f"{field}.kind", f"unknown job kind {msg.kind}")
    resources = msg.resources
    which = resources.WhichOneof("share")
    mps = resources.mps if which == "mps" else None
    share = share_of(
        None if mps is None else mps.sm_percent,
        None if mps is None else mps.quota.request_percent,
        None if mps is None else mps.quota.limit_percent or None,
        resources.memory_bytes,
        priority_from_pb(msg),
    )
    return JobSpec(
        name=msg.name,
        kind=KIND_FROM_PB.get(msg.kind),
        share=share,
        mps=mps is not None,
        whole_gpus=resources.whole_gpus if which == "whole_gpus" else 0,
        mig_slices=1 if which == "mig" else 0,
        mig_size=resources.mig.slices if which == "mig" else 0,
        task_key=msg.task_key,
        slo=Slo(msg.slo.p99_latency_ms, msg.slo.target_requests_per_s),
        policy=msg.policy.strip(),
        gpu_model=msg.gpu_model.strip(),
        command=tuple(msg.command),
        shared_model=msg.shared_model,
        checkpoint=hook_from_pb(msg),
        max_gpus=msg.max_gpus,
        nodes=tuple(msg.nodes),
        cpu_milli=msg.cpu_milli,
        host_memory_bytes=msg.host_memory_bytes,
    )


def share_into_pb(msg: pb.JobSpec, share: Share, mps: bool) -> None:
    """A job's share into its spec message: the priority, the memory cap and, for an MPS
    share (`mps`), the SM percent and quota (a whole GPU's are implied)."""
    msg.priority.level = share.priority
    if share.memory_bytes:
        msg.resources.memory_bytes = share.memory_bytes
    if mps:
        msg.resources.mps.CopyFrom(share_to_pb(share))


def spec_to_pb(spec: JobSpec) -> pb.JobSpec:
    msg = pb.JobSpec(
        name=spec.name,
        task_key=spec.task_key,
        kind=KIND_TO_PB[spec.kind] if spec.kind else pb.JOB_KIND_UNSPECIFIED,
        slo=pb.Slo(
            p99_latency_ms=spec.slo.p99_latency_ms,
            target_requests_per_s=spec.slo.target_requests_per_s,
        ),
        policy=spec.policy,
        gpu_model=spec.gpu_model,
        command=spec.command,
        shared_model=spec.shared_model,
        cpu_milli=spec.cpu_milli,
        host_memory_bytes=spec.host_memory_bytes,
        max_gpus=spec.max_gpus,
        nodes=spec.nodes,
    )
    share_into_pb(msg, spec.share, spec.mps)
    if spec.whole_gpus:
        msg.resources.whole_gpus = spec.whole_gpus
    elif spec.mig_slices:
        msg.resources.mig.SetInParent()
        msg.resources.mig.slices = spec.mig_size
    if spec.checkpoint is not None:
        msg.checkpoint.CopyFrom(hook_to_pb(spec.checkpoint))
    return msg


# ---- jobs ----


def state_from_pb(code: int) -> JobState:
    try:
        return STATE_FROM_PB[code]
    except KeyError:
        raise ValueError(f"placement sent an unknown job state {code}") from None


def job_from_pb(msg: pb.Job) -> JobView:
    return JobView(
        job_id=msg.job_id,
        request_id=msg.request_id,
        spec=spec_from_pb(msg.spec),
        state=state_from_pb(msg.state),
        submitted_at=unix_s(msg, "submitted_at"),
        updated_at=unix_s(msg, "updated_at"),
        revision=msg.revision,
        pending_reason=msg.pending_reason,
        message=msg.message,
        assignment=_assignment_from_pb(msg.assignment) if msg.HasField("assignment") else None,
        policy=msg.policy,
        exit_code=msg.exit_code,
        function=msg.function,
        started_at=unix_s(msg, "started_at"),
        owner=msg.owner,
        training=training_from_pb(msg.training) if msg.HasField("training") else None,
    )


def job_to_pb(job: JobView) -> pb.Job:
    msg = pb.Job(
        job_id=job.job_id,
        request_id=job.request_id,
        spec=spec_to_pb(job.spec),
        state=STATE_TO_PB[job.state],
        pending_reason=job.pending_reason,
        message=job.message,
        policy=job.policy,
        submitted_at=timestamp(job.submitted_at),
        updated_at=timestamp(job.updated_at),
        exit_code=job.exit_code,
        revision=job.revision,
        function=job.function,
        started_at=timestamp(job.started_at),
        owner=job.owner,
    )
    if job.assignment is not None:
        msg.assignment.CopyFrom(_assignment_to_pb(job.assignment))
    if job.training is not None:
        msg.training.CopyFrom(training_to_pb(job.training))
    return msg


def _assignment_from_pb(msg: pb.JobAssignment) -> Assignment:
    slot = msg.mig
    return Assignment(
        gpu_uuid=msg.gpu.gpu_uuid,
        node=msg.gpu.node,
        dispatcher_address=msg.dispatcher_address,
        assignment_id=msg.assignment_id,
        memory_cap_bytes=msg.memory_cap_bytes,
        share=share_from_pb(msg.share) if msg.HasField("share") else None,
        quota_offset_percent=msg.quota_offset_percent,
        sm_offset_percent=msg.sm_offset_percent,
        environment=dict(msg.environment),
        mig=(
            MigSlot(
                slot.size,
                slot.first_slice,
                unix_s(slot, "planned_start"),
                unix_s(slot, "planned_end"),
                slot.instance_uuid,
            )
            if msg.HasField("mig")
            else None
        ),
        extra_gpus=tuple(
            AssignedGpu(g.gpu.gpu_uuid, g.gpu.node, g.dispatcher_address, dict(g.environment))
            for g in msg.extra_gpus
        ),
        time_slice_of=msg.time_slice_of,
    )


def _assignment_to_pb(assignment: Assignment) -> pb.JobAssignment:
    msg = pb.JobAssignment(
        gpu=common_pb2.GpuRef(node=assignment.node, gpu_uuid=assignment.gpu_uuid),
        dispatcher_address=assignment.dispatcher_address,
        assignment_id=assignment.assignment_id,
        memory_cap_bytes=assignment.memory_cap_bytes,
        quota_offset_percent=assignment.quota_offset_percent,
        sm_offset_percent=assignment.sm_offset_percent,
        environment=assignment.environment,
        extra_gpus=[
            pb.AssignedGpu(
                gpu=common_pb2.GpuRef(node=g.node, gpu_uuid=g.gpu_uuid),
                dispatcher_address=g.dispatcher_address,
                environment=g.environment,
            )
            for g in assignment.extra_gpus
        ],
        time_slice_of=assignment.time_slice_of,
    )
    if assignment.share is not None:
        msg.share.CopyFrom(share_to_pb(assignment.share))
    slot = assignment.mig
    if slot is not None:
        msg.mig.CopyFrom(
            pb.MigSlot(
                size=slot.size,
                first_slice=slot.first_slice,
                planned_start=timestamp(slot.planned_start),
                planned_end=timestamp(slot.planned_end),
                instance_uuid=slot.instance_uuid,
            )
        )
    return msg


# ---- inventory and auto-scaling ----


def gpu_info_from_pb(msg: pb.GpuInfo) -> GpuInfo:
    return gpu_from_fields(
        msg,
        mig_instances=tuple(
            MigInstance(m.slices, m.first_slice, m.uuid) for m in msg.mig_instances
        ),
        mps_enabled=msg.mps_enabled,
        node_cpu_milli=msg.node_cpu_milli,
        node_memory_bytes=msg.node_memory_bytes,
    )


def gpu_info_to_pb(info: GpuInfo) -> pb.GpuInfo:
    return pb.GpuInfo(
        **gpu_fields(info),
        mig_instances=[
            pb.MigInstance(slices=m.slices, first_slice=m.first_slice, uuid=m.uuid)
            for m in info.mig_instances
        ],
        mps_enabled=info.mps_enabled,
        node_cpu_milli=info.node_cpu_milli,
        node_memory_bytes=info.node_memory_bytes,
    )


def gpu_entry_from_pb(msg: pb.GpuEntry) -> GpuEntry:
    return GpuEntry(
        gpu=gpu_info_from_pb(msg.gpu),
        dispatcher_address=msg.dispatcher_address,
        schedulable=msg.schedulable,
        lost=msg.lost,
        last_heartbeat=unix_s(msg, "last_heartbeat"),
        utilization_percent=msg.utilization_percent,
        memory_used_bytes=msg.memory_used_bytes,
        memory_reserved_bytes=msg.memory_reserved_bytes,
        area_reserved_percent=msg.area_reserved_percent,
        jobs=msg.jobs,
        direct_reservations=msg.direct_reservations,
    )


def gpu_entry_to_pb(entry: GpuEntry) -> pb.GpuEntry:
    return pb.GpuEntry(
        gpu=gpu_info_to_pb(entry.gpu),
        dispatcher_address=entry.dispatcher_address,
        schedulable=entry.schedulable,
        lost=entry.lost,
        last_heartbeat=timestamp(entry.last_heartbeat),
        utilization_percent=entry.utilization_percent,
        memory_used_bytes=entry.memory_used_bytes,
        memory_reserved_bytes=entry.memory_reserved_bytes,
        area_reserved_percent=entry.area_reserved_percent,
        jobs=entry.jobs,
        direct_reservations=entry.direct_reservations,
    )


def scaling_from_pb(msg: pb.SetFunctionLoadResponse) -> FunctionScaling:
    best = msg.most_efficient
    return FunctionScaling(
        added=tuple(job_from_pb(j) for j in msg.added),
        removed=tuple(job_from_pb(j) for j in msg.removed),
        capacity_requests_per_s=msg.capacity_requests_per_s,
        most_efficient=(
            ThroughputConfig(best.sm_percent, best.quota_percent, best.requests_per_s)
            if msg.HasField("most_efficient")
            else None
        ),
    )


def scaling_to_pb(scaling: FunctionScaling) -> pb.SetFunctionLoadResponse:
    msg = pb.SetFunctionLoadResponse(
        added=[job_to_pb(j) for j in scaling.added],
        removed=[job_to_pb(j) for j in scaling.removed],
        capacity_requests_per_s=scaling.capacity_requests_per_s,
    )
    if scaling.most_efficient is not None:
        msg.most_efficient.CopyFrom(throughput_config_to_pb(scaling.most_efficient))
    return msg


class ThroughputLike(Protocol):
    """A point of a throughput profile: the client's ThroughputConfig, the policy's point."""

    @property
    def sm_percent(self) -> int: ...
    @property
    def quota_percent(self) -> float: ...
    @property
    def requests_per_s(self) -> float: ...


def throughput_config_to_pb(point: ThroughputLike) -> pb.ThroughputConfig:
    return pb.ThroughputConfig(
        sm_percent=point.sm_percent,
        quota_percent=point.quota_percent,
        requests_per_s=point.requests_per_s,
    )


# ---- JSON ----


def job_json(job: JobView) -> dict[str, Any]:
    return _json(job_to_pb(job))


def gpu_entry_json(entry: GpuEntry) -> dict[str, Any]:
    return _json(gpu_entry_to_pb(entry))


def scaling_json(scaling: FunctionScaling) -> dict[str, Any]:
    return _json(scaling_to_pb(scaling))


def _json(msg: Message) -> dict[str, Any]:
    return message_json(msg)
