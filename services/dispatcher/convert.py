"""Protobuf <-> domain for the dispatcher. Missing sub-messages become zero values, which the
domain validation then names (e.g. "share.sm_percent: must be within 1..100, got 0")."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import replace

from gpuloom.convert.dispatcher import gpu_description_to_pb
from gpuloom.convert.mig import task_run_to_pb, task_start_to_pb
from gpuloom.convert.shares import reservation_share, reservation_share_fields
from gpuloom.convert.times import timestamp
from gpuloom.convert.training import cycle_to_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.mig_runs import MigRunReport, TaskEnd, TaskRun, TaskStart
from gpuloom.policies.mig import Plan
from gpuloom.services.dispatcher.domain import (
    ClientStatus,
    DispatcherEvent,
    EventKind,
    GpuStatusView,
    LeaseState,
    Reservation,
    ReserveSpec,
)
from gpuloom.services.dispatcher.gpu.backend import GpuUsage
from gpuloom.services.dispatcher.mig_executor import MigBatchTask
from gpuloom.services.dispatcher.model_store import ModelView
from gpuloom.shimwire import ShimMode
from gpuloom.v1 import common_pb2, dispatcher_pb2, shim_pb2

_LEASE_STATE_TO_PB = {
    LeaseState.IDLE: dispatcher_pb2.LEASE_STATE_IDLE,
    LeaseState.WAITING: dispatcher_pb2.LEASE_STATE_WAITING,
    LeaseState.HOLDING: dispatcher_pb2.LEASE_STATE_HOLDING,
    LeaseState.BLOCKED: dispatcher_pb2.LEASE_STATE_BLOCKED,
}
_EVENT_KIND_TO_PB = {
    kind: dispatcher_pb2.DispatcherEventKind.Value("DISPATCHER_EVENT_KIND_" + kind.name)
    for kind in EventKind
}


def reserve_spec_from_pb(request: dispatcher_pb2.ReserveRequest) -> ReserveSpec:
    mode = request.mode or shim_pb2.SHIM_MODE_SHARE
    if mode not in (int(m) for m in ShimMode):
        raise InvalidArgument("mode", f"unknown shim mode {mode}")
    return ReserveSpec(
        assignment_id=request.assignment_id,
        client_name=request.client_name,
        share=reservation_share(request),
        mode=ShimMode(mode),
        token=request.assignment_token,
        task_key=request.task_key,
        time_slice_of=request.time_slice_of,
    )


def gpu_ref(gpu: GpuInfo, node: str) -> common_pb2.GpuRef:
    return common_pb2.GpuRef(node=node, gpu_uuid=gpu.gpu_uuid)


def assignment_to_pb(
    reservation: Reservation,
    gpu: GpuInfo,
    node: str,
    socket_path: str,
    environment: dict[str, str] | None,
) -> dispatcher_pb2.Assignment:
    """With `environment` (Reserve's answer) the token is included; listings pass None."""
    return dispatcher_pb2.Assignment(
        assignment_id=reservation.assignment_id,
        client_name=reservation.client_name,
        **reservation_share_fields(reservation.share),
        mode=int(reservation.mode),
        assignment_token=reservation.token if environment is not None else "",
        socket_path=socket_path,
        gpu=gpu_ref(gpu, node),
        reserved_at=timestamp(reservation.reserved_at_unix_s),
        environment=environment or {},
        task_key=reservation.task_key,
        time_slice_of=reservation.time_slice_of,
    )


def client_status_to_pb(
    status: ClientStatus, gpu: GpuInfo, node: str, socket_path: str
) -> dispatcher_pb2.ClientStatus:
    remaining_ms = status.lease_remaining_s * 1e3
    suspension = status.suspension
    return dispatcher_pb2.ClientStatus(
        assignment=assignment_to_pb(status.reservation, gpu, node, socket_path, None),
        connected=status.connected,
        pid=status.pid,
        state=_LEASE_STATE_TO_PB[status.state],
        used_percent=status.used_fraction * 100,
        # An open-ended (exclusive) lease has no end to count down to; -1 says so.
        lease_remaining_ms=remaining_ms if math.isfinite(remaining_ms) else -1.0,
        lease_length_ms=status.lease_length_s * 1e3,
        leases_granted=status.leases_granted,
        gpu_time_s=status.gpu_time_s,
        waiting_ms=status.waiting_s * 1e3,
        memory_allocated_bytes=status.allocated_bytes,
        training=None if status.training is None else cycle_to_pb(status.training),
        suspended=suspension is not None,
        suspended_reason="" if suspension is None else suspension.reason,
        suspended_at=None if suspension is None else timestamp(suspension.at_unix_s),
        suspend_wait_ms=0.0 if suspension is None else suspension.wait_s * 1e3,
        suspended_memory_bytes=0 if suspension is None else suspension.memory_bytes,
        suspend_outcome="" if suspension is None else suspension.outcome.value,
        suspended_memory_released=suspension is not None and suspension.memory_released,
        suspended_memory_note="" if suspension is None else suspension.memory_note,
    )


def gpu_status_to_pb(
    view: GpuStatusView,
    usage: GpuUsage,
    gpu: GpuInfo,
    node: str,
    backend: str,
    socket_path: str,
) -> dispatcher_pb2.GpuStatus:
    return dispatcher_pb2.GpuStatus(
        gpu=gpu_description_to_pb(replace(gpu, node=node), backend),
        policy=view.policy,
        window_ms=view.window_s * 1e3,
        clients=[client_status_to_pb(c, gpu, node, socket_path) for c in view.clients],
        waiting=list(view.waiting),
        running_sm_percent=view.running_sm_percent,
        utilization_percent=usage.utilization_percent,
        memory_used_bytes=usage.memory_used_bytes,
        memory_reserved_bytes=view.memory_reserved_bytes,
        quota_reserved_percent=view.quota_reserved_percent,
        window_elapsed_ms=view.window_elapsed_s * 1e3,
    )


def event_to_pb(event: DispatcherEvent) -> dispatcher_pb2.DispatcherEvent:
    return dispatcher_pb2.DispatcherEvent(
        kind=_EVENT_KIND_TO_PB[event.kind],
        time=timestamp(event.time_unix_s),
        assignment_id=event.assignment_id,
        detail=event.detail,
        lease_id=event.lease_id,
        lease_ms=event.lease_ms,
    )


def mig_batch_from_pb(request: dispatcher_pb2.RunMigBatchRequest) -> list[MigBatchTask]:
    return [MigBatchTask(task.name, dict(task.seconds_by_size)) for task in request.tasks]


async def task_ends_from_pb(
    inputs: AsyncIterator[dispatcher_pb2.MigRunInput],
) -> AsyncIterator[TaskEnd]:
    """The task ends a RunMigBatch caller sends after its batch."""
    async for message in inputs:
        if message.WhichOneof("input") != "task_end":
            raise InvalidArgument(
                "task_end", "after the first message (the batch) only task ends are sent"
            )
        yield TaskEnd(message.task_end.task, message.task_end.exit_code)


def mig_update_to_pb(
    update: Plan | TaskStart | TaskRun | MigRunReport,
) -> dispatcher_pb2.MigRunUpdate:
    if isinstance(update, Plan):
        planned = dispatcher_pb2.MigPlanned(
            policy=update.policy,
            planned_makespan_s=update.makespan_s,
            tasks=len(update.assignments),
        )
        return dispatcher_pb2.MigRunUpdate(planned=planned)
    if isinstance(update, TaskStart):
        return dispatcher_pb2.MigRunUpdate(task_started=task_start_to_pb(update))
    if isinstance(update, TaskRun):
        return dispatcher_pb2.MigRunUpdate(task_ended=task_run_to_pb(update))
    report = dispatcher_pb2.MigRunReport(
        tasks=[task_run_to_pb(t) for t in update.tasks],
        reconfigurations=[
            dispatcher_pb2.MigReconfigRun(
                action=r.action,
                size=r.size,
                first_slice=r.first_slice,
                start_s=r.start_s,
                end_s=r.end_s,
            )
            for r in update.reconfigurations
        ],
        planned_makespan_s=update.planned_makespan_s,
        makespan_s=update.makespan_s,
    )
    return dispatcher_pb2.MigRunUpdate(report=report)


def model_info_to_pb(view: ModelView) -> dispatcher_pb2.ModelInfo:
    return dispatcher_pb2.ModelInfo(
        name=view.name,
        model_id=view.model_id,
        path=view.path,
        bytes=view.nbytes,
        tensor_count=len(view.tensors),
        replicas=list(view.replicas),
        loaded_at=timestamp(view.loaded_at_unix_s),
    )


def model_handle_to_pb(view: ModelView, gpu: GpuInfo, node: str) -> dispatcher_pb2.ModelHandle:
    return dispatcher_pb2.ModelHandle(
        name=view.name,
        model_id=view.model_id,
        gpu=gpu_ref(gpu, node),
        ipc_handle=view.ipc_handle,
        bytes=view.nbytes,
        tensors=[
            dispatcher_pb2.ModelTensor(
                name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes
            )
            for t in view.tensors
        ],
    )
