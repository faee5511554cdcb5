"""MIG task starts and runs to and from gpuloom.v1 protobuf (the dispatcher sends them; placement
and `gpuloom mig run` read them)."""

from __future__ import annotations

from gpuloom.domain.mig_runs import TaskRun, TaskStart
from gpuloom.v1 import dispatcher_pb2


def task_run_from_pb(msg: dispatcher_pb2.MigTaskRun) -> TaskRun:
    return TaskRun(
        task=msg.task,
        size=msg.size,
        first_slice=msg.first_slice,
        instance_uuid=msg.instance_uuid,
        planned_start_s=msg.planned_start_s,
        planned_end_s=msg.planned_end_s,
        start_s=msg.start_s,
        end_s=msg.end_s,
        exit_code=msg.exit_code,
    )


def task_run_to_pb(run: TaskRun) -> dispatcher_pb2.MigTaskRun:
    return dispatcher_pb2.MigTaskRun(
        task=run.task,
        size=run.size,
        first_slice=run.first_slice,
        instance_uuid=run.instance_uuid,
        planned_start_s=run.planned_start_s,
        planned_end_s=run.planned_end_s,
        start_s=run.start_s,
        end_s=run.end_s,
        exit_code=run.exit_code,
    )


def task_start_from_pb(msg: dispatcher_pb2.MigTaskStarted) -> TaskStart:
    return TaskStart(
        task=msg.task,
        size=msg.size,
        first_slice=msg.first_slice,
        instance_uuid=msg.instance_uuid,
        planned_start_s=msg.planned_start_s,
        planned_end_s=msg.planned_end_s,
        start_s=msg.start_s,
    )


def task_start_to_pb(start: TaskStart) -> dispatcher_pb2.MigTaskStarted:
    return dispatcher_pb2.MigTaskStarted(
        task=start.task,
        size=start.size,
        first_slice=start.first_slice,
        instance_uuid=start.instance_uuid,
        planned_start_s=start.planned_start_s,
        planned_end_s=start.planned_end_s,
        start_s=start.start_s,
    )
