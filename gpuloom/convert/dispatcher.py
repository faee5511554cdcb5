"""A dispatcher's GetGpuStatus answer to and from the domain's `DispatcherStatus`, and its JSON
(the protos' JSON mapping), for the clients; its GPU's description (GpuDescription, the
dispatcher's answer to SetMigMode too) for the dispatcher and its clients alike."""

from __future__ import annotations

from typing import Any

from gpuloom.convert.gpus import gpu_fields, gpu_from_fields
from gpuloom.convert.json_mapping import message_json
from gpuloom.convert.shares import reservation_share, reservation_share_fields
from gpuloom.convert.times import timestamp, unix_s
from gpuloom.convert.training import cycle_from_pb, cycle_to_pb
from gpuloom.domain.dispatcher import (
    DispatcherStatus,
    LeaseState,
    ProcessStatus,
    SuspendState,
)
from gpuloom.domain.gpus import GpuInfo
from gpuloom.v1 import common_pb2, shim_pb2
from gpuloom.v1 import dispatcher_pb2 as pb

LEASE_STATE_TO_PB = {
    state: pb.LeaseState.Value("LEASE_STATE_" + state.name) for state in LeaseState
}
_LEASE_STATE_FROM_PB = {code: state for state, code in LEASE_STATE_TO_PB.items()}
_MODES = ("share", "measure", "off", "fikit")
_MODE_TO_PB = {mode: shim_pb2.ShimMode.Value("SHIM_MODE_" + mode.upper()) for mode in _MODES}
_MODE_FROM_PB = {code: mode for mode, code in _MODE_TO_PB.items()}


def gpu_description_to_pb(gpu: GpuInfo, backend: str) -> pb.GpuDescription:
    return pb.GpuDescription(**gpu_fields(gpu), index=gpu.index, backend=backend)


def gpu_description_from_pb(msg: pb.GpuDescription) -> GpuInfo:
    return gpu_from_fields(msg, index=msg.index)


def status_from_pb(msg: pb.GpuStatus) -> DispatcherStatus:
    return DispatcherStatus(
        gpu=gpu_description_from_pb(msg.gpu),
        backend=msg.gpu.backend,
        policy=msg.policy,
        window_ms=msg.window_ms,
        processes=tuple(_process_from_pb(c) for c in msg.clients),
        waiting=tuple(msg.waiting),
        running_sm_percent=msg.running_sm_percent,
        utilization_percent=msg.utilization_percent,
        memory_used_bytes=msg.memory_used_bytes,
        memory_reserved_bytes=msg.memory_reserved_bytes,
        quota_reserved_percent=msg.quota_reserved_percent,
        window_elapsed_ms=msg.window_elapsed_ms,
    )


def status_to_pb(status: DispatcherStatus) -> pb.GpuStatus:
    gpu = gpu_description_to_pb(status.gpu, status.backend)
    return pb.GpuStatus(
        gpu=gpu,
        policy=status.policy,
        window_ms=status.window_ms,
        clients=[_process_to_pb(p, gpu.ref) for p in status.processes],
        waiting=status.waiting,
        running_sm_percent=status.running_sm_percent,
        utilization_percent=status.utilization_percent,
        memory_used_bytes=status.memory_used_bytes,
        memory_reserved_bytes=status.memory_reserved_bytes,
        quota_reserved_percent=status.quota_reserved_percent,
        window_elapsed_ms=status.window_elapsed_ms,
    )


def status_json(status: DispatcherStatus) -> dict[str, Any]:
    return message_json(status_to_pb(status))


def _process_from_pb(msg: pb.ClientStatus) -> ProcessStatus:
    a = msg.assignment
    return ProcessStatus(
        assignment_id=a.assignment_id,
        client_name=a.client_name,
        task_key=a.task_key,
        mode=_MODE_FROM_PB.get(a.mode, "share"),
        share=reservation_share(a),
        reserved_at=unix_s(a, "reserved_at"),
        socket_path=a.socket_path,
        connected=msg.connected,
        pid=msg.pid,
        state=_LEASE_STATE_FROM_PB.get(msg.state, LeaseState.IDLE),
        used_percent=msg.used_percent,
        lease_remaining_ms=msg.lease_remaining_ms,
        waiting_s=msg.waiting_ms / 1e3,
        memory_allocated_bytes=msg.memory_allocated_bytes,
        lease_length_ms=msg.lease_length_ms,
        leases_granted=msg.leases_granted,
        gpu_time_s=msg.gpu_time_s,
        training=cycle_from_pb(msg.training) if msg.HasField("training") else None,
        suspension=suspend_state_from_pb(msg) if msg.suspended else None,
        time_slice_of=a.time_slice_of,
    )


def suspend_state_from_pb(msg: pb.ClientStatus) -> SuspendState:
    return SuspendState(
        assignment_id=msg.assignment.assignment_id,
        suspended=msg.suspended,
        reason=msg.suspended_reason,
        outcome=msg.suspend_outcome,
        wait_ms=msg.suspend_wait_ms,
        memory_bytes=msg.suspended_memory_bytes,
        minibatch_s=msg.training.minibatch_s,
        at_unix_s=unix_s(msg, "suspended_at"),
        memory_released=msg.suspended_memory_released,
        memory_note=msg.suspended_memory_note,
    )


def _process_to_pb(process: ProcessStatus, gpu: common_pb2.GpuRef) -> pb.ClientStatus:
    suspension = process.suspension
    return pb.ClientStatus(
        assignment=pb.Assignment(
            assignment_id=process.assignment_id,
            client_name=process.client_name,
            **reservation_share_fields(process.share),
            mode=_MODE_TO_PB[process.mode],
            socket_path=process.socket_path,
            gpu=gpu,
            reserved_at=timestamp(process.reserved_at),
            task_key=process.task_key,
            time_slice_of=process.time_slice_of,
        ),
        connected=process.connected,
        pid=process.pid,
        state=LEASE_STATE_TO_PB[process.state],
        used_percent=process.used_percent,
        lease_remaining_ms=process.lease_remaining_ms,
        waiting_ms=process.waiting_s * 1e3,
        memory_allocated_bytes=process.memory_allocated_bytes,
        lease_length_ms=process.lease_length_ms,
        leases_granted=process.leases_granted,
        gpu_time_s=process.gpu_time_s,
        training=None if process.training is None else cycle_to_pb(process.training),
        suspended=suspension is not None,
        suspended_reason="" if suspension is None else suspension.reason,
        suspended_at=None if suspension is None else timestamp(suspension.at_unix_s),
        suspend_wait_ms=0.0 if suspension is None else suspension.wait_ms,
        suspended_memory_bytes=0 if suspension is None else suspension.memory_bytes,
        suspend_outcome="" if suspension is None else suspension.outcome,
        suspended_memory_released=suspension is not None and suspension.memory_released,
        suspended_memory_note="" if suspension is None else suspension.memory_note,
    )
