"""The placement service's own records: jobs with their bindings (rectangle and token), the
inventory's GPU records. The job spec, its states and the GPU description are the domain's
(gpuloom/domain/placement.py), shared with the clients. Nothing here knows about gRPC or SQL."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobSpec, JobState, MigSlot
from gpuloom.domain.shares import Share
from gpuloom.domain.training import TrainingState

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ADDRESS = re.compile(r"[A-Za-z0-9.\-_\[\]:]{1,253}:\d{1,5}")
JOB_ID_PREFIX = "j-"  # the dispatcher's assignment id is the job id: ids with it are ours


@dataclass(frozen=True, slots=True)
class ExtraGpu:
    """A further GPU of a job on several whole GPUs (same node, same assignment id and token),
    and once bound, what its dispatcher answered."""

    gpu_uuid: str
    dispatcher_address: str
    environment: dict[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, slots=True)
class Binding:
    """Where a job's capacity is reserved, and (once bound) what its process runs with."""

    gpu_uuid: str
    node: str
    dispatcher_address: str
    # The job's rectangle in the GPU's (quota x SM) grid: quota in 0.01 % steps, SM in %.
    rect: tuple[int, int, int, int]
    # The job's share as reserved there: its memory is the cap the dispatcher enforces (less
    # than the job asked for a replica beside its model; a MIG instance's memory).
    share: Share
    token: str
    environment: dict[str, str] = field(default_factory=dict, hash=False)
    mig: MigSlot | None = None  # MIG batch tasks: the instance planned for it (rect unused)
    extra: tuple[ExtraGpu, ...] = ()  # a job on several whole GPUs: the GPUs after the first
    # A training job time-sliced into a full GPU (Gandiva's over-subscription): the time-slice
    # group it joined, whose rectangle it shares (it runs while the group's others are
    # suspended); `rect` is that rectangle. "" for a job in a rectangle of its own.
    time_slice_of: str = ""
    # A time-slice member whose GPUs' dispatchers free a suspended member's memory: the group
    # takes its memory in turns (the fleet charges the group its largest member's memory);
    # its share's memory is still the memory it runs with.
    memory_in_turns: bool = False

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return (self.gpu_uuid, *(g.gpu_uuid for g in self.extra))

    def on(self, gpu_uuid: str) -> bool:
        """Whether the job holds (part of) this GPU."""
        return gpu_uuid == self.gpu_uuid or any(g.gpu_uuid == gpu_uuid for g in self.extra)


@dataclass(frozen=True, slots=True)
class Job:
    job_id: str
    request_id: str
    spec: JobSpec
    state: JobState
    submitted_at: float
    updated_at: float
    revision: int = 1
    pending_reason: str = ""
    message: str = ""
    policy: str = ""  # the policy that placed it
    binding: Binding | None = None
    exit_code: int = 0
    function: str = ""
    started_at: float = 0.0  # when it became ASSIGNED; 0: never (yet)
    # Who submitted it: the name of the caller's bearer token ("" when placement takes none).
    owner: str = ""
    # Training jobs: Gandiva's state of it (services/placement/training.py), in memory only.
    training: TrainingState | None = None

    def advance(self, now: float, **changes: object) -> Job:
        """The next revision of this job."""
        return replace(self, updated_at=now, revision=self.revision + 1, **changes)  # type: ignore[arg-type]


@dataclass(slots=True)
class GpuRecord:
    """The inventory's view of one GPU: what was registered plus what heartbeats say."""

    info: GpuInfo
    dispatcher_address: str
    registered_at: float
    last_heartbeat: float
    lost: bool = False
    utilization_percent: float = 0.0
    memory_used_bytes: int = 0


def validate_request_id(request_id: str) -> None:
    if not REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument(
            "request_id", f"must match [A-Za-z0-9._:-]{{1,128}}, got {request_id[:140]!r}"
        )


def validate_address(field_name: str, address: str) -> None:
    if not ADDRESS.fullmatch(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
        raise InvalidArgument(field_name, f"must be host:port, got {address[:260]!r}")
