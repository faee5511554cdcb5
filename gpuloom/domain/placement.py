"""Placement as its clients see it: a job with the assignment placement answered, a GPU of the
inventory with what the fleet holds on it, and the outcome of an auto-scaling request.

These are the public views of the gpuloom.v1.Placement answers. The service keeps richer
records of its own (services/placement/domain.py: a job's binding with its rectangle and
token); the job spec, states and GPU description are the service's own types."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuloom.services.common.shapes import SpatioTemporalShare
from gpuloom.services.placement.domain import GpuInfo, JobSpec, JobState, MigSlot


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where an assigned job runs and what its process must run with. A MIG batch task has a
    `mig` slot instead of a share, offsets and environment (the dispatcher runs it)."""

    gpu_uuid: str
    node: str
    dispatcher_address: str
    assignment_id: str
    memory_cap_bytes: int
    share: SpatioTemporalShare | None = None
    # Where the job sits in the GPU's (time quota x SM) rectangle.
    quota_offset_percent: float = 0.0
    sm_offset_percent: int = 0
    # GPULOOM_DISPATCHER_SOCKET, GPULOOM_ASSIGNMENT_TOKEN, ...: only while the job holds it.
    environment: Mapping[str, str] = field(default_factory=dict, hash=False)
    mig: MigSlot | None = None


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as placement reports it: its spec, its state and, once placed, its assignment
    (kept after it finishes, to say where it ran)."""

    job_id: str
    request_id: str
    spec: JobSpec
    state: JobState
    submitted_at: float
    updated_at: float
    revision: int
    pending_reason: str = ""  # PENDING: why it is not placed yet
    message: str = ""  # FAILED / LOST / CANCELLED: what happened
    assignment: Assignment | None = None
    policy: str = ""  # the policy that placed it
    exit_code: int = 0
    function: str = ""  # set on replicas created by auto-scaling


@dataclass(frozen=True, slots=True)
class GpuEntry:
    """A registered GPU: what its dispatcher registered, what its heartbeats say, and what the
    fleet has reserved on it."""

    gpu: GpuInfo
    dispatcher_address: str
    schedulable: bool
    lost: bool  # heartbeats stopped
    last_heartbeat: float
    utilization_percent: float
    memory_used_bytes: int
    memory_reserved_bytes: int
    area_reserved_percent: float  # of the (quota x SM) rectangle, in percent
    jobs: int


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """One profiled configuration of an inference function's replicas."""

    sm_percent: int
    quota_percent: float
    requests_per_s: float


@dataclass(frozen=True, slots=True)
class FunctionScaling:
    """What placement did to serve a function's request rate."""

    added: tuple[JobView, ...]
    removed: tuple[JobView, ...]
    capacity_requests_per_s: float  # what the replicas serve together now
    most_efficient: ThroughputConfig | None
