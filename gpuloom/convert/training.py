"""Gandiva's training messages (placement.proto's CheckpointHook, TrainingState, TrainingReport;
common.proto's TrainingCycle, which the dispatcher's GetGpuStatus and heartbeats carry too) to
and from gpuloom.domain.training. Exact both ways for what the services send (instants to the
microsecond, gpuloom/convert/times.py)."""

from __future__ import annotations

from collections.abc import Iterable

from gpuloom.convert.times import timestamp, unix_s
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.training import (
    CheckpointHook,
    MigrationRequest,
    PackingTrial,
    TrainingCycle,
    TrainingPhase,
    TrainingReport,
    TrainingState,
)
from gpuloom.v1 import common_pb2
from gpuloom.v1 import placement_pb2 as pb

PHASE_TO_PB = {
    TrainingPhase.RUNNING: pb.TRAINING_PHASE_RUNNING,
    TrainingPhase.SUSPENDED: pb.TRAINING_PHASE_SUSPENDED,
    TrainingPhase.PACKED: pb.TRAINING_PHASE_PACKED,
    TrainingPhase.MIGRATING: pb.TRAINING_PHASE_MIGRATING,
}
PHASE_FROM_PB = {code: phase for phase, code in PHASE_TO_PB.items()}


def hook_from_pb(msg: pb.JobSpec) -> CheckpointHook | None:
    """The spec's hook as sent, unvalidated; None when the spec has none."""
    if not msg.HasField("checkpoint"):
        return None
    hook = msg.checkpoint
    return CheckpointHook(tuple(hook.command), hook.signal, hook.timeout_s)


def hook_to_pb(hook: CheckpointHook) -> pb.CheckpointHook:
    return pb.CheckpointHook(command=hook.command, signal=hook.signal, timeout_s=hook.timeout_s)


def cycle_from_pb(msg: common_pb2.TrainingCycle) -> TrainingCycle:
    return TrainingCycle(
        minibatch_s=msg.minibatch_s,
        stable=msg.stable,
        low_memory_bytes=msg.low_memory_bytes,
        high_memory_bytes=msg.high_memory_bytes,
        next_low_point_unix_s=unix_s(msg, "next_low_point"),
        samples=msg.samples,
        minibatches=msg.minibatches,
    )


def cycle_to_pb(cycle: TrainingCycle) -> common_pb2.TrainingCycle:
    return common_pb2.TrainingCycle(
        minibatch_s=cycle.minibatch_s,
        stable=cycle.stable,
        low_memory_bytes=cycle.low_memory_bytes,
        high_memory_bytes=cycle.high_memory_bytes,
        next_low_point=timestamp(cycle.next_low_point_unix_s),
        samples=cycle.samples,
        minibatches=cycle.minibatches,
    )


def reports_from_pb(reports: Iterable[pb.TrainingReport]) -> list[TrainingReport]:
    """A heartbeat's training reports, each validated (InvalidArgument names `training[i]`)."""
    out = []
    for index, msg in enumerate(reports):
        try:
            cycle = cycle_from_pb(msg.cycle)
        except InvalidArgument as error:  # a Timestamp out of range: name it in full
            problem = error.message.removeprefix(f"{error.field}: ")
            raise InvalidArgument(f"training[{index}].cycle.{error.field}", problem) from None
        report = TrainingReport(
            msg.assignment_id,
            cycle,
            msg.suspended,
            msg.suspended_reason,
            msg.memory_released,
            msg.memory_note,
            msg.restore_failed,
        )
        report.validate(f"training[{index}]")
        out.append(report)
    return out


def report_to_pb(report: TrainingReport) -> pb.TrainingReport:
    """A cycle of which nothing is known yet (TrainingCycle()) is left out: it reads back the
    same."""
    return pb.TrainingReport(
        assignment_id=report.assignment_id,
        cycle=None if report.cycle == TrainingCycle() else cycle_to_pb(report.cycle),
        suspended=report.suspended,
        suspended_reason=report.suspended_reason,
        memory_released=report.memory_released,
        memory_note=report.memory_note,
        restore_failed=report.restore_failed,
    )


def training_to_pb(state: TrainingState) -> pb.TrainingState:
    msg = pb.TrainingState(
        phase=PHASE_TO_PB[state.phase],
        packed_with=state.packed_with,
        minibatch_s=state.minibatch_s,
        solo_minibatch_s=state.solo_minibatch_s,
        height=state.height,
        minibatches=state.minibatches,
        packings=[
            pb.PackingTrial(
                partner=t.partner,
                started_at=timestamp(t.started_at),
                solo_minibatch_s=t.solo_minibatch_s,
                packed_minibatch_s=t.packed_minibatch_s,
                gain=t.gain,
                undone=t.undone,
            )
            for t in state.packings
        ],
        migrations=state.migrations,
        failed_migrations=state.failed_migrations,
        last_hook_error=state.last_hook_error,
        last_hook_error_at=timestamp(state.last_hook_error_at),
        resizes=state.resizes,
        memory_in_turns=state.memory_in_turns,
        memory_released=state.memory_released,
        preempted_by=state.preempted_by,
        memory_note=state.memory_note,
    )
    migration = state.migration
    if migration is not None:
        msg.migration.CopyFrom(
            pb.MigrationRequest(
                migration_id=migration.migration_id,
                target=common_pb2.GpuRef(
                    node=migration.target_node, gpu_uuid=migration.target_gpu_uuid
                ),
                reason=migration.reason,
                requested_at=timestamp(migration.requested_at),
                deadline=timestamp(migration.deadline),
                gpus=migration.gpus,
            )
        )
    return msg


def training_from_pb(msg: pb.TrainingState) -> TrainingState:
    phase = PHASE_FROM_PB.get(msg.phase)
    if phase is None:
        raise ValueError(f"placement sent an unknown training phase {msg.phase}")
    migration = None
    if msg.HasField("migration"):
        m = msg.migration
        migration = MigrationRequest(
            migration_id=m.migration_id,
            target_gpu_uuid=m.target.gpu_uuid,
            target_node=m.target.node,
            reason=m.reason,
            requested_at=unix_s(m, "requested_at"),
            deadline=unix_s(m, "deadline"),
            gpus=m.gpus,
        )
    return TrainingState(
        phase=phase,
        packed_with=msg.packed_with,
        minibatch_s=msg.minibatch_s,
        solo_minibatch_s=msg.solo_minibatch_s,
        height=msg.height,
        minibatches=msg.minibatches,
        packings=tuple(
            PackingTrial(
                partner=t.partner,
                started_at=unix_s(t, "started_at"),
                solo_minibatch_s=t.solo_minibatch_s,
                packed_minibatch_s=t.packed_minibatch_s,
                gain=t.gain,
                undone=t.undone,
            )
            for t in msg.packings
        ),
        migrations=msg.migrations,
        failed_migrations=msg.failed_migrations,
        last_hook_error=msg.last_hook_error,
        last_hook_error_at=unix_s(msg, "last_hook_error_at"),
        migration=migration,
        resizes=msg.resizes,
        memory_in_turns=msg.memory_in_turns,
        memory_released=msg.memory_released,
        preempted_by=msg.preempted_by,
        memory_note=msg.memory_note,
    )
