"""Placement as its clients see it: a job with the assignment placement answered, a GPU of the
inventory with what the fleet holds on it, and the outcome of an auto-scaling request.

These are the public views of the gpuloom.v1.Placement answers, and the job spec with its
validation, the job states and the GPU description, which the service uses too. The service
keeps richer records of its own (services/placement/domain.py: a job's binding with its
rectangle and token)."""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import MAX_CPU_MILLI, MAX_HOST_MEMORY_BYTES, MAX_NAME, GpuInfo
from gpuloom.domain.models import check_model_name
from gpuloom.domain.shares import (
    Share,
    SpatioTemporalShare,
    validate_mig_slices,
    validate_priority,
)
from gpuloom.domain.training import CheckpointHook, TrainingState

MAX_KEY = 256
# A MIG batch task's command, as the dispatcher takes it (RunMigBatch's MigTaskSpec.argv).
MAX_COMMAND_ARGS = 256
MAX_COMMAND_ARG_CHARS = 4096
# A job's whole GPUs (all on one node) and its gpu_model alternatives ("A|B"), at most.
MAX_WHOLE_GPUS = 64
MAX_MODEL_ALTERNATIVES = 16
# The nodes a job may be restricted to, at most (a Kubernetes scheduler's candidates).
MAX_NODES = 4096
MAX_NODE_NAME = 253


class JobKind(enum.Enum):
    INFERENCE = "inference"
    TRAINING = "training"
    BATCH = "batch"


class JobState(enum.Enum):
    PENDING = "pending"
    BINDING = "binding"
    ASSIGNED = "assigned"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"
    EVICTED = "evicted"  # its dispatcher took its reservation away (EvictClient)

    @property
    def finished(self) -> bool:
        return self in FINISHED

    @property
    def holds_capacity(self) -> bool:
        return self in (JobState.BINDING, JobState.ASSIGNED)


FINISHED = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.LOST, JobState.EVICTED}
)


@dataclass(frozen=True, slots=True)
class Slo:
    p99_latency_ms: float = 0.0
    target_requests_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a submitter asks for. `share` is what the job holds of each GPU it runs on (SM
    percent, time quota, memory cap, priority), the form it keeps up to the dispatcher's
    reservation. Exactly one of `mps` (the share's SM percent and quota partition one GPU
    through MPS), `whole_gpus` (that many GPUs, whole: the share's SM and quota are 100) and
    `mig_slices` is set. `mig_slices` marks a MIG batch task (kind batch, with a task key and a
    `command`); `mig_size` is the instance size it asks for, in compute slices (1, 2, 3, 4 or
    7), or 0 to let the batch planner choose one from the task's MIG profile. `mig_times`
    (size -> seconds) is what placement read from that profile when it accepted the task (of
    the asked size only, when it asks one), kept with the job so that a restart plans it the
    same way; it is not part of the request (not compared)."""

    name: str
    kind: JobKind | None
    share: Share
    mps: bool = False
    whole_gpus: int = 0
    mig_slices: int = 0
    mig_size: int = 0
    task_key: str = ""
    slo: Slo = field(default_factory=Slo)
    policy: str = ""
    gpu_model: str = ""
    command: tuple[str, ...] = ()
    mig_times: tuple[tuple[int, float], ...] = field(default=(), compare=False)
    # Of the node the job's GPUs are on: CPU in thousandths of a core, host memory in bytes.
    cpu_milli: int = 0
    host_memory_bytes: int = 0
    # A replica of this model: placed first where a model store holds it, charged its memory
    # less the weights there (docs/placement.md, "Replicas of a shared model"). "" = none.
    shared_model: str = ""
    # Training jobs: how the job saves its state before a migration (None: never migrated).
    checkpoint: CheckpointHook | None = None
    # Grow-shrink: the most whole GPUs (of one node) the job may grow onto; its elastic range
    # is whole_gpus..max_gpus. 0: not elastic.
    max_gpus: int = 0
    # Only GPUs of these nodes; () = any node.
    nodes: tuple[str, ...] = ()

    @property
    def priority(self) -> int:
        return self.share.priority

    @property
    def memory_bytes(self) -> int:
        """The GPU memory cap it asks on each GPU (0: a whole GPU's memory)."""
        return self.share.memory_bytes

    @property
    def elastic(self) -> bool:
        return self.max_gpus > max(self.whole_gpus, 1)

    @property
    def is_mig_batch(self) -> bool:
        return self.mig_slices > 0

    @property
    def gpu_models(self) -> tuple[str, ...]:
        """The models `gpu_model` admits ("A|B" -> ("A", "B")); () = any."""
        return tuple(m.strip() for m in self.gpu_model.split("|")) if self.gpu_model else ()

    def validate(self, policies: Collection[str]) -> None:
        """InvalidArgument naming the first field that makes no sense; `policies` are the
        placement policies the service knows (the domain does not know the registry)."""
        if not 1 <= len(self.name) <= MAX_NAME or not self.name.isprintable():
            raise InvalidArgument(
                "spec.name", f"must be 1..{MAX_NAME} printable characters, got {self.name!r}"
            )
        if self.kind is None:
            raise InvalidArgument("spec.kind", "required: inference, training or batch")
        if len(self.task_key) > MAX_KEY or not self.task_key.isprintable():
            raise InvalidArgument(
                "spec.task_key", f"must be at most {MAX_KEY} printable characters"
            )
        validate_priority("spec.priority.level", self.share.priority)
        self._validate_gpu_model()
        for name, value, most in (
            ("spec.cpu_milli", self.cpu_milli, MAX_CPU_MILLI),
            ("spec.host_memory_bytes", self.host_memory_bytes, MAX_HOST_MEMORY_BYTES),
        ):
            if not 0 <= value <= most:
                raise InvalidArgument(name, f"must be within 0..{most}, got {value}")
        if self.policy and self.policy not in policies:
            known = ", ".join(sorted(policies))
            raise InvalidArgument(
                "spec.policy", f"unknown placement policy {self.policy!r}; known: {known}"
            )
        for name, value in (
            ("p99_latency_ms", self.slo.p99_latency_ms),
            ("target_requests_per_s", self.slo.target_requests_per_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"spec.slo.{name}", f"must be finite and >= 0, got {value}")
        if self.shared_model:
            check_model_name("spec.shared_model", self.shared_model)
        self._validate_nodes()
        self._validate_resources()
        if self.checkpoint is not None:
            if self.kind is not JobKind.TRAINING:
                raise InvalidArgument(
                    "spec.checkpoint", "only training jobs (kind training) take a checkpoint hook"
                )
            self.checkpoint.validate()
        if self.max_gpus:
            self._validate_elastic()

    def _validate_elastic(self) -> None:
        """An elastic range (max_gpus): a training job on whole GPUs with a checkpoint hook
        (a resize restarts it from its checkpoint), max_gpus within whole_gpus..64."""
        field = "spec.max_gpus"
        if self.kind is not JobKind.TRAINING:
            raise InvalidArgument(field, "only training jobs (kind training) take an elastic range")
        if not self.whole_gpus:
            raise InvalidArgument(
                field, "an elastic range needs whole GPUs (resources.whole_gpus), not a share"
            )
        if self.checkpoint is None:
            raise InvalidArgument(
                field,
                "an elastic range needs a checkpoint hook (spec.checkpoint): growing or "
                "shrinking restarts the job from its checkpoint",
            )
        if not self.whole_gpus <= self.max_gpus <= MAX_WHOLE_GPUS:
            raise InvalidArgument(
                field,
                f"must be within whole_gpus..{MAX_WHOLE_GPUS} ({self.whole_gpus}.."
                f"{MAX_WHOLE_GPUS}), got {self.max_gpus}",
            )

    def _validate_nodes(self) -> None:
        if len(self.nodes) > MAX_NODES:
            raise InvalidArgument("spec.nodes", f"at most {MAX_NODES} nodes, got {len(self.nodes)}")
        for i, node in enumerate(self.nodes):
            if not 1 <= len(node) <= MAX_NODE_NAME or not node.isprintable():
                raise InvalidArgument(
                    f"spec.nodes[{i}]", f"must be 1..{MAX_NODE_NAME} printable characters"
                )
        if len(set(self.nodes)) != len(self.nodes):
            raise InvalidArgument("spec.nodes", "names a node twice")
        if self.nodes and self.mig_slices:
            raise InvalidArgument(
                "spec.nodes", "a MIG batch task goes where the batch planner puts it"
            )

    def _validate_gpu_model(self) -> None:
        models = self.gpu_models
        if len(models) > MAX_MODEL_ALTERNATIVES:
            raise InvalidArgument(
                "spec.gpu_model",
                f"at most {MAX_MODEL_ALTERNATIVES} alternatives, got {len(models)}",
            )
        for model in models:
            if not 1 <= len(model) <= MAX_NAME or not model.isprintable():
                raise InvalidArgument(
                    "spec.gpu_model",
                    f"each model (alternatives separated by '|') must be 1..{MAX_NAME} printable "
                    f"characters, got {self.gpu_model[:300]!r}",
                )

    def validate_as(self, name: str, policies: Collection[str]) -> None:
        """validate(), naming fields under `name` (a template) instead of `spec`."""
        try:
            self.validate(policies)
        except InvalidArgument as error:
            field = error.field.replace("spec", name, 1)
            raise InvalidArgument(field, error.message.split(": ", 1)[1]) from None

    def _validate_resources(self) -> None:
        if self.mig_slices:
            if self.shared_model:
                raise InvalidArgument(
                    "spec.shared_model", "a MIG batch task holds no share a model store serves"
                )
            self._validate_mig()
            return
        if self.command:
            raise InvalidArgument(
                "spec.command", "only MIG batch tasks (resources.mig, kind batch) take a command"
            )
        if self.mps == bool(self.whole_gpus):
            raise InvalidArgument(
                "spec.resources", "set one of mps (SM percent and time quota) or whole_gpus"
            )
        if not 0 <= self.whole_gpus <= MAX_WHOLE_GPUS:
            raise InvalidArgument(
                "spec.resources.whole_gpus",
                f"must be within 1..{MAX_WHOLE_GPUS} (all on one node), got {self.whole_gpus}",
            )
        if self.shared_model and self.whole_gpus > 1:
            raise InvalidArgument(
                "spec.shared_model",
                f"a replica of a shared model takes one GPU, not {self.whole_gpus} whole GPUs",
            )
        if not self.mps:
            if not self.share.whole:
                raise InvalidArgument(
                    "spec.resources.mps",
                    "whole GPUs take no SM percent or quota (only an MPS share does)",
                )
            return
        self.share.partition.validate("spec.resources.mps")
        if self.share.memory_bytes <= 0:
            raise InvalidArgument(
                "spec.resources.memory_bytes",
                "required for an MPS share (the GPU memory cap, in bytes)",
            )

    def _validate_mig(self) -> None:
        if self.mps or self.whole_gpus or not self.share.whole:
            raise InvalidArgument(
                "spec.resources", "mig cannot be combined with an MPS share or whole_gpus"
            )
        if self.mig_size:
            validate_mig_slices("spec.resources.mig.slices", self.mig_size)
        if self.kind is not JobKind.BATCH:
            raise InvalidArgument(
                "spec.kind", "a MIG task (resources.mig) must be of kind batch (JOB_KIND_BATCH)"
            )
        for name, value in (
            ("spec.cpu_milli", self.cpu_milli),
            ("spec.host_memory_bytes", self.host_memory_bytes),
        ):
            if value:
                raise InvalidArgument(
                    name, "a MIG task asks for no node resources (the batch planner places it)"
                )
        if not self.task_key:
            raise InvalidArgument(
                "spec.task_key",
                "required for a MIG task: its MIG profile in the profile store gives its time "
                "on each instance size",
            )
        if not self.command or len(self.command) > MAX_COMMAND_ARGS:
            raise InvalidArgument(
                "spec.command",
                f"a MIG task needs its command: 1..{MAX_COMMAND_ARGS} arguments, got "
                f"{len(self.command)}",
            )
        if not self.command[0]:
            raise InvalidArgument("spec.command", "the program (the first argument) is empty")
        for i, arg in enumerate(self.command):
            if len(arg) > MAX_COMMAND_ARG_CHARS or "\0" in arg:
                raise InvalidArgument(
                    f"spec.command[{i}]",
                    f"arguments are at most {MAX_COMMAND_ARG_CHARS} characters, with no NUL",
                )


@dataclass(frozen=True, slots=True)
class MigSlot:
    """Where and when the fleet's batch planner put a MIG task: an instance of `size` slices
    from `first_slice` on, from planned_start to planned_end (Unix seconds)."""

    size: int
    first_slice: int
    planned_start: float
    planned_end: float
    # The instance its batch's run handed the task (its runner starts it there); "" until then.
    instance_uuid: str = ""


# The assignment's secret: whoever presents it to the dispatcher first holds the reservation,
# so placement tells it only to the job's submitter (see docs/security.md).
ASSIGNMENT_TOKEN_VARIABLE = "GPULOOM_ASSIGNMENT_TOKEN"


@dataclass(frozen=True, slots=True)
class AssignedGpu:
    """A further GPU of a job on several whole GPUs, reserved on its own dispatcher."""

    gpu_uuid: str
    node: str
    dispatcher_address: str
    environment: Mapping[str, str] = field(default_factory=dict, hash=False)


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
    # A job on several whole GPUs: the GPUs after the first, all on the same node.
    extra_gpus: tuple[AssignedGpu, ...] = ()
    # A training job time-sliced into a full GPU: the time-slice group whose rectangle it
    # shares, taking turns with the group's other jobs ("" for a rectangle of its own).
    time_slice_of: str = ""

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return (self.gpu_uuid, *(g.gpu_uuid for g in self.extra_gpus))


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
    started_at: float = 0.0  # when it became ASSIGNED; 0: never (yet)
    owner: str = ""  # who submitted it: its bearer token's name ("" without tokens)
    training: TrainingState | None = None  # training jobs: Gandiva's view (docs/training.md)


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
    # Shares reserved on the dispatcher directly, not by placement (in the figures above).
    direct_reservations: int = 0


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
