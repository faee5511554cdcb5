"""MIG task starts and runs to and from gpuloom.v1 protobuf (the dispatcher sends them; placement
and `gpuloom mig run` read them)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from gpuloom.domain.mig_runs import TaskRun, TaskStart
from gpuloom.v1 import dispatcher_pb2

# The messages name their fields as the domain types do, one for one.
TASK_RUN_FIELDS = tuple(f.name for f in fields(TaskRun))
TASK_START_FIELDS = tuple(f.name for f in fields(TaskStart))


def _named(source: object, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(source, name) for name in names}


def task_run_from_pb(msg: dispatcher_pb2.MigTaskRun) -> TaskRun:
    return TaskRun(**_named(msg, TASK_RUN_FIELDS))


def task_run_to_pb(run: TaskRun) -> dispatcher_pb2.MigTaskRun:
    return dispatcher_pb2.MigTaskRun(**_named(run, TASK_RUN_FIELDS))


def task_start_from_pb(msg: dispatcher_pb2.MigTaskStarted) -> TaskStart:
    return TaskStart(**_named(msg, TASK_START_FIELDS))


def task_start_to_pb(start: TaskStart) -> dispatcher_pb2.MigTaskStarted:
    return dispatcher_pb2.MigTaskStarted(**_named(start, TASK_START_FIELDS))
