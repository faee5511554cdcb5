"""Training jobs under Gandiva (docs/training.md): the checkpoint hook a job declares, what a
dispatcher reports of a training process's mini-batch cycle, and the training state placement
keeps and shows for each training job. Shared by the placement service and its clients; no
gRPC, no I/O."""

from __future__ import annotations

import enum
import math
import signal
from dataclasses import dataclass

from gpuloom.domain.errors import InvalidArgument

DEFAULT_HOOK_TIMEOUT_S = 60.0
MAX_HOOK_TIMEOUT_S = 3600.0
MAX_HOOK_ARGS = 64
MAX_HOOK_ARG_CHARS = 4096
# The signals a job may answer as its checkpoint hook (SIGKILL and SIGSTOP cannot be answered).
HOOK_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP")
MAX_SUSPEND_REASON_CHARS = 1024  # SuspendClient's reason, and so a heartbeat's report of it
# The reason of the suspensions that time-slice training jobs: placement's driver gives it to
# its own, and a dispatcher to a job reserved to time-slice in another's rectangle (it starts
# suspended); in heartbeats it tells a placement which suspensions are its to resume.
TIME_SLICE_REASON = "gandiva: time-slicing"
MAX_PACKINGS_SHOWN = 8


@dataclass(frozen=True, slots=True)
class CheckpointHook:
    """How `gpuloom run` makes a job save its state before a migration: run `command`, or send
    the job's process `signal`, which must save and exit with 0 within `timeout_s`."""

    command: tuple[str, ...] = ()
    signal: str = ""
    timeout_s: float = 0.0  # 0: DEFAULT_HOOK_TIMEOUT_S

    @property
    def effective_timeout_s(self) -> float:
        return self.timeout_s or DEFAULT_HOOK_TIMEOUT_S

    @property
    def signal_number(self) -> int:
        return int(signal.Signals[self.signal])

    def validate(self, field: str = "spec.checkpoint") -> None:
        if bool(self.command) == bool(self.signal):
            raise InvalidArgument(field, "set exactly one of command and signal")
        if not (math.isfinite(self.timeout_s) and 0 <= self.timeout_s <= MAX_HOOK_TIMEOUT_S):
            raise InvalidArgument(
                f"{field}.timeout_s",
                f"must be within 0..{MAX_HOOK_TIMEOUT_S:g} s (0 = {DEFAULT_HOOK_TIMEOUT_S:g} s),"
                f" got {self.timeout_s}",
            )
        if self.signal and self.signal not in HOOK_SIGNALS:
            raise InvalidArgument(
                f"{field}.signal",
                f"must be one of {', '.join(HOOK_SIGNALS)}, got {self.signal[:40]!r}",
            )
        if self.command:
            if len(self.command) > MAX_HOOK_ARGS or not self.command[0]:
                raise InvalidArgument(
                    f"{field}.command",
                    f"1..{MAX_HOOK_ARGS} arguments, the first (the program) not empty",
                )
            for i, arg in enumerate(self.command):
                if len(arg) > MAX_HOOK_ARG_CHARS or "\0" in arg:
                    raise InvalidArgument(
                        f"{field}.command[{i}]",
                        f"arguments are at most {MAX_HOOK_ARG_CHARS} characters, with no NUL",
                    )


@dataclass(frozen=True, slots=True)
class TrainingCycle:
    """A training process's mini-batch cycle, as its dispatcher detected it from the memory
    samples its shim writes (Gandiva's introspection; gpuloom.v1.TrainingCycle): in the
    dispatcher's GetGpuStatus and in its heartbeats' TrainingReports to placement."""

    minibatch_s: float = 0.0  # 0: not detected (yet)
    stable: bool = False  # the period held over the cycles seen (coefficient of variation <= 0.1)
    low_memory_bytes: int = 0  # device memory allocated at the cycle's low points
    high_memory_bytes: int = 0  # ... and at its peaks
    next_low_point_unix_s: float = 0.0  # predicted; 0 = unknown
    samples: int = 0  # memory samples the detection used
    minibatches: int = 0  # low points seen since the process registered


@dataclass(frozen=True, slots=True)
class TrainingReport:
    """What a dispatcher's heartbeat says of one training process it serves."""

    assignment_id: str
    cycle: TrainingCycle
    suspended: bool
    suspended_reason: str = ""  # while suspended: the reason it was suspended for
    # While suspended: its device memory is in host memory (the driver's checkpoint API), so
    # the GPU's memory it was given is free until it resumes.
    memory_released: bool = False
    # While suspended: why its memory is not in host memory (no checkpoint API, a lock or
    # checkpoint that failed), or why a resume could not restore it (it stays suspended).
    memory_note: str = ""
    # While suspended: a restore of its checkpointed memory failed (a resume on its GPU, or a
    # move onto another): placement may move it elsewhere.
    restore_failed: bool = False

    def validate(self, field: str) -> None:
        if not 1 <= len(self.assignment_id) <= 128:
            raise InvalidArgument(f"{field}.assignment_id", "required (at most 128 characters)")
        for name, text in (
            ("suspended_reason", self.suspended_reason),
            ("memory_note", self.memory_note),
        ):
            if len(text) > MAX_SUSPEND_REASON_CHARS:
                raise InvalidArgument(
                    f"{field}.{name}", f"at most {MAX_SUSPEND_REASON_CHARS} characters"
                )
            if text and not self.suspended:
                raise InvalidArgument(f"{field}.{name}", "given for a process not suspended")
        if self.restore_failed and not self.memory_released:
            raise InvalidArgument(
                f"{field}.restore_failed", "only for a process whose memory is in host memory"
            )
        cycle = self.cycle
        for name, value in (
            ("minibatch_s", cycle.minibatch_s),
            ("next_low_point_unix_s", cycle.next_low_point_unix_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(
                    f"{field}.cycle.{name}", f"must be finite and >= 0, got {value}"
                )
        if cycle.low_memory_bytes > cycle.high_memory_bytes:
            raise InvalidArgument(
                f"{field}.cycle.low_memory_bytes",
                f"{cycle.low_memory_bytes} is above high_memory_bytes ({cycle.high_memory_bytes})",
            )


class TrainingPhase(enum.Enum):
    RUNNING = "running"
    SUSPENDED = "suspended"
    PACKED = "packed"
    MIGRATING = "migrating"


@dataclass(frozen=True, slots=True)
class PackingTrial:
    partner: str
    started_at: float
    solo_minibatch_s: float
    packed_minibatch_s: float = 0.0  # 0: not measured (yet)
    gain: float = 0.0  # sum over both jobs of solo / packed time; 0: not known yet
    undone: bool = False


@dataclass(frozen=True, slots=True)
class MigrationRequest:
    migration_id: str
    target_gpu_uuid: str
    target_node: str
    reason: str
    requested_at: float
    deadline: float
    gpus: int = 0  # a resize (grow-shrink): the whole GPUs it runs on next; 0: a migration


def gpus_text(n: int) -> str:
    """'1 GPU', '2 GPUs'."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


@dataclass(frozen=True, slots=True)
class TrainingState:
    """What placement shows of a training job (Job.training)."""

    phase: TrainingPhase = TrainingPhase.RUNNING
    packed_with: str = ""
    minibatch_s: float = 0.0
    solo_minibatch_s: float = 0.0
    height: int = 1
    minibatches: int = 0
    packings: tuple[PackingTrial, ...] = ()
    migrations: int = 0
    failed_migrations: int = 0
    last_hook_error: str = ""
    last_hook_error_at: float = 0.0
    migration: MigrationRequest | None = None
    resizes: int = 0  # grow-shrink: grows and shrinks completed
    # Its GPU's dispatcher frees a suspended job's memory (the driver's checkpoint API), so it
    # takes the GPU's memory in turns with the jobs it is time-sliced with; False: a suspension
    # keeps its memory resident (a driver older than r570, or switched off).
    memory_in_turns: bool = False
    memory_released: bool = False  # suspended, its device memory is in host memory now
    # Head-of-queue preemption: the job that took its GPUs; it stays suspended until that one
    # ends. "" for none.
    preempted_by: str = ""
    memory_note: str = ""  # suspended: its dispatcher's note on its memory (a failed restore)

    def memory_text(self) -> str:
        """What a suspension does with its GPU memory, in words."""
        if self.memory_released:
            return "in host memory while suspended (checkpointed); taken in turns"
        if self.memory_in_turns:
            return "freed while suspended (the driver's checkpoint API); taken in turns"
        return (
            "stays resident while suspended (its dispatcher's driver has no checkpoint API, "
            "or it is off): jobs time-sliced with it must fit beside it"
        )

    def describe(self) -> str:
        """One word or phrase for tables: running, suspended, packed with X, migrating."""
        if self.phase is TrainingPhase.PACKED and self.packed_with:
            return f"packed with {self.packed_with}"
        if self.preempted_by:
            return f"preempted by {self.preempted_by}"
        migration = self.migration
        if self.phase is TrainingPhase.MIGRATING and migration is not None and migration.gpus:
            doing = {"grow": "growing", "shrink": "shrinking"}.get(migration.reason, "moving")
            return f"{doing} to {gpus_text(migration.gpus)}"
        return self.phase.value
