"""A dispatcher's GPU as its clients see it (GetGpuStatus): the GPU, its scheduling window and
each process holding a reservation there. What `gpuloom top` and `gpuloom dispatcher` show."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.shares import Share
from gpuloom.domain.training import TrainingCycle

__all__ = [
    "DispatcherStatus",
    "LeaseState",
    "ProcessStatus",
    "SuspendState",
    "TrainingCycle",  # the training domain's, re-exported: a client's cycle in GetGpuStatus
]


class LeaseState(enum.Enum):
    IDLE = "idle"  # connected (or not), asking for nothing
    WAITING = "waiting"  # queued for a lease
    HOLDING = "holding"  # holds a lease
    BLOCKED = "blocked"  # reached its quota limit; waits for the next window

    @property
    def asking(self) -> bool:
        """The process asked for a lease it does not hold yet."""
        return self in (LeaseState.WAITING, LeaseState.BLOCKED)


@dataclass(frozen=True, slots=True)
class SuspendState:
    """A client's suspension as SuspendClient/ResumeClient answer it."""

    assignment_id: str
    suspended: bool
    reason: str
    outcome: str  # low_point, timeout, no_cycle, not_running; "" when not suspended
    wait_ms: float
    memory_bytes: int  # held when suspended
    minibatch_s: float  # the detected mini-batch time (0: none)
    at_unix_s: float = 0.0  # when it was suspended
    memory_released: bool = False  # its device memory is in host memory (checkpointed)
    memory_note: str = ""  # why not released, or why a resume could not restore it


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    """One reservation on the GPU and the process bound to it (pid 0: none registered yet)."""

    assignment_id: str  # a placement job's id ("j-...") or a direct Reserve's own id
    client_name: str
    task_key: str
    mode: str  # the shim mode: "share", "measure", "off" or "fikit"
    share: Share  # as reserved: SM percent, quota, memory cap, priority
    reserved_at: float  # unix seconds
    socket_path: str  # the GPU's shim channel
    connected: bool
    pid: int
    state: LeaseState
    used_percent: float  # GPU time charged in the current window, % of the window
    lease_remaining_ms: float  # -1: an open-ended lease
    waiting_s: float  # since the lease request it waits on; 0 unless WAITING or BLOCKED
    memory_allocated_bytes: int  # as the process's shim last reported
    lease_length_ms: float
    leases_granted: int
    gpu_time_s: float
    training: TrainingCycle | None = None  # the detected mini-batch cycle, if any
    suspension: SuspendState | None = None  # set while suspended
    time_slice_of: str = ""  # the time-slice group it belongs to ("": none; docs/dispatcher.md)


@dataclass(frozen=True, slots=True)
class DispatcherStatus:
    gpu: GpuInfo  # as the dispatcher describes it (no MIG instances, MPS or node resources)
    backend: str  # "nvml" or "simulated"
    policy: str
    window_ms: float
    processes: tuple[ProcessStatus, ...]
    waiting: tuple[str, ...]  # assignment ids in the order they will be served
    running_sm_percent: int
    utilization_percent: float
    memory_used_bytes: int
    memory_reserved_bytes: int
    quota_reserved_percent: float  # sum of the time-quota requests (a time-slice group once)
    window_elapsed_ms: float

    @property
    def quota_used_percent(self) -> float:
        """GPU time charged to every process in the current window, % of the window."""
        return sum(p.used_percent for p in self.processes)
