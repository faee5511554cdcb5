"""What running a MIG plan on a GPU reports: each task's run and each reconfiguration, with the
planned and the real times (seconds from the start of the run). The dispatcher produces them;
placement follows them to finish its MIG batch jobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TaskRun:
    task: str
    size: int
    first_slice: int
    instance_uuid: str
    planned_start_s: float
    planned_end_s: float
    start_s: float
    end_s: float
    exit_code: int


@dataclass(frozen=True, slots=True)
class ReconfigRun:
    action: str  # "create" or "destroy"
    size: int
    first_slice: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class MigRunReport:
    tasks: tuple[TaskRun, ...]
    reconfigurations: tuple[ReconfigRun, ...]
    planned_makespan_s: float
    makespan_s: float
