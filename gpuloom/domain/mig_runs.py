"""What running a MIG plan on a GPU reports: each task as it is handed to its runner (its
instance) and as it ends, and each reconfiguration, with the planned and the real times (seconds
from the start of the run). The dispatcher produces them; the caller of RunMigBatch (placement,
or `gpuloom mig run`) starts each task it is handed and reports its end."""

from __future__ import annotations

from dataclasses import dataclass

# The exit code of a task that was handed out and ended without its runner saying how: the runner
# went away, or placement ended the job (cancelled, no runner followed it).
NOT_REPORTED = -1


@dataclass(frozen=True, slots=True)
class TaskStart:
    """A task handed to its runner: start it now in this instance."""

    task: str
    size: int
    first_slice: int
    instance_uuid: str
    planned_start_s: float
    planned_end_s: float
    start_s: float


@dataclass(frozen=True, slots=True)
class TaskEnd:
    """How a started task ended, as its runner reports it."""

    task: str
    exit_code: int


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
