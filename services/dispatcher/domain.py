"""Domain types of the dispatcher: reservations, the processes bound to them, events."""

from __future__ import annotations

import enum
import hashlib
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuloom.domain.dispatcher import LeaseState
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.shares import Share, validate_priority
from gpuloom.domain.training import TrainingCycle
from gpuloom.domain.validation import MAX_KEY_CHARS, check_name
from gpuloom.shimwire import ShimMode

ASSIGNMENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
TOKEN = re.compile(r"^[A-Za-z0-9_-]{32,128}$")
GPU_UUID = re.compile(
    r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)
MAX_SOCKET_PATH_BYTES = 107


@dataclass(frozen=True, slots=True)
class MoveTarget:
    """Where a suspended client moves (docs/training.md, "Migration without a hook"): another
    GPU of this node, of the same chip type, whose dispatcher holds a reservation for it."""

    gpu_uuid: str  # as NVML writes it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    socket_path: str  # the target dispatcher's shim socket
    token: str  # the target reservation's assignment token

    def validate(self, own_gpu_uuid: str) -> None:
        if not GPU_UUID.match(self.gpu_uuid):
            raise InvalidArgument(
                "target_gpu_uuid", "must be a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
            )
        if self.gpu_uuid.lower() == own_gpu_uuid.lower():
            raise InvalidArgument("target_gpu_uuid", "is this dispatcher's own GPU")
        path = self.socket_path.encode()
        if not path.startswith(b"/") or len(path) > MAX_SOCKET_PATH_BYTES or b"\0" in path:
            raise InvalidArgument(
                "target_socket_path",
                f"must be an absolute path of at most {MAX_SOCKET_PATH_BYTES} bytes",
            )
        if not TOKEN.match(self.token):
            raise InvalidArgument(
                "target_token", "must be 32..128 URL-safe characters (A-Z a-z 0-9 _ -)"
            )


MAX_CLIENT_NAME_CHARS = 256


def check_assignment_id(value: str, field: str = "assignment_id") -> str:
    if not ASSIGNMENT_ID.match(value):
        raise InvalidArgument(field, "must be 1..128 characters of A-Z a-z 0-9 . _ : -")
    return value


@dataclass(frozen=True, slots=True)
class ReserveSpec:
    """What a caller asks for; validated before anything changes. The share's memory cap 0
    asks for the GPU's whole memory."""

    assignment_id: str
    client_name: str
    share: Share
    mode: ShimMode = ShimMode.SHARE
    token: str = ""
    task_key: str = ""
    # Gandiva's time-slicing: the group it joins (the assignment id of the group's first
    # reservation on this GPU); "" for a reservation of its own. See Reservation.group.
    time_slice_of: str = ""

    def validate(self) -> None:
        check_assignment_id(self.assignment_id)
        if self.client_name:
            check_name("client_name", self.client_name, MAX_CLIENT_NAME_CHARS)
        validate_priority("priority.level", self.share.priority)
        if self.share.memory_bytes < 0:
            raise InvalidArgument("memory_cap_bytes", "must not be negative")
        self.share.partition.validate("share")
        if self.task_key:
            check_name("task_key", self.task_key, MAX_KEY_CHARS)
        if self.token and not TOKEN.match(self.token):
            raise InvalidArgument(
                "assignment_token", "must be 32..128 URL-safe characters (A-Z a-z 0-9 _ -)"
            )
        if self.time_slice_of:
            check_assignment_id(self.time_slice_of, "time_slice_of")
            if self.time_slice_of == self.assignment_id:
                raise InvalidArgument(
                    "time_slice_of", "must name another reservation's group, not its own id"
                )
            if self.mode is not ShimMode.SHARE:
                raise InvalidArgument(
                    "time_slice_of",
                    f"only SHARE reservations are time-sliced, this one is {self.mode.name}",
                )


def new_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class BoundProcess:
    """The process a token was first presented by: pid plus its start time, so that a recycled
    pid is not mistaken for the original process."""

    pid: int
    start_ticks: int
    uid: int


@dataclass(frozen=True, slots=True)
class Reservation:
    assignment_id: str
    client_name: str
    share: Share  # its memory cap resolved: never 0
    mode: ShimMode
    token: str
    reserved_at_unix_s: float
    bound: BoundProcess | None = None
    task_key: str = ""
    time_slice_of: str = ""

    @property
    def priority(self) -> int:
        return self.share.priority

    @property
    def memory_cap_bytes(self) -> int:
        return self.share.memory_bytes

    @property
    def group(self) -> str:
        """Its time-slice group: the members of one group run one at a time (suspended and
        resumed by placement), so the group takes one SM x quota rectangle, its largest
        member's. A reservation of its own is a group of one, keyed by its own id; the key
        outlives the member it came from."""
        return self.time_slice_of or self.assignment_id

    def same_request(self, spec: ReserveSpec, memory_cap_bytes: int) -> bool:
        """Would `spec` have produced this reservation? (for idempotent retries)"""
        return (
            spec.client_name == self.client_name
            and replace(spec.share, memory_bytes=memory_cap_bytes) == self.share
            and spec.mode == self.mode
            and spec.task_key == self.task_key
            and spec.time_slice_of == self.time_slice_of
            and (not spec.token or spec.token == self.token)
        )


class EventKind(enum.Enum):
    RESERVED = "reserved"
    RELEASED = "released"
    REGISTERED = "registered"
    DISCONNECTED = "disconnected"
    EVICTED = "evicted"
    REFUSED = "refused"
    LEASE_GRANTED = "lease-granted"
    LEASE_ENDED = "lease-ended"


LEASE_EVENTS = frozenset({EventKind.LEASE_GRANTED, EventKind.LEASE_ENDED})


@dataclass(frozen=True, slots=True)
class DispatcherEvent:
    kind: EventKind
    time_unix_s: float
    assignment_id: str = ""
    detail: str = ""
    lease_id: int = 0
    lease_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientStatus:
    reservation: Reservation
    connected: bool
    pid: int
    state: LeaseState
    used_fraction: float
    lease_remaining_s: float
    lease_length_s: float
    leases_granted: int
    gpu_time_s: float
    waiting_s: float = 0.0  # since the lease request it waits on (WAITING/BLOCKED)
    allocated_bytes: int = 0  # device memory, as the shim last reported or sampled it
    training: TrainingCycle | None = None  # the detected mini-batch cycle
    suspension: Suspension | None = None  # set while suspended (SuspendClient)


class SuspendOutcome(enum.Enum):
    """How a suspension point was reached."""

    LOW_POINT = "low_point"  # the process's memory was at its cycle's low
    TIMEOUT = "timeout"  # no low point within max_wait_ms: suspended where it was
    NO_CYCLE = "no_cycle"  # no mini-batch cycle detected: suspended at once
    NOT_RUNNING = "not_running"  # no process connected: suspended at once


@dataclass(frozen=True, slots=True)
class Suspension:
    """A suspended client: its kernels are not admitted until ResumeClient."""

    reason: str
    at_unix_s: float
    at_monotonic_s: float
    wait_s: float  # how long it waited for the suspension point
    outcome: SuspendOutcome
    memory_bytes: int  # device memory it held when suspended (its last sample; 0: unknown)
    # Its device memory is in host memory (the driver's checkpoint API): the GPU's is free.
    memory_released: bool = False
    # Why it is not released (no checkpoint API, a lock that timed out...), or why a resume
    # could not restore it (it stays suspended); "" otherwise.
    memory_note: str = ""


@dataclass(frozen=True, slots=True)
class GpuStatusView:
    policy: str
    window_s: float
    clients: tuple[ClientStatus, ...]
    waiting: tuple[str, ...]
    running_sm_percent: int
    memory_reserved_bytes: int
    quota_reserved_percent: float
    window_elapsed_s: float


MAX_ARGV = 64
MAX_ARG_CHARS = 4096


def derive_task_key(process_name: str, argv: Sequence[str]) -> str:
    """A task key for a process whose reservation names none: its program's name and a digest
    of its whole command line, so reruns of the same command are the same task (FIKIT
    measures a task once and shares it afterwards). '' when the process said nothing."""
    words = [w[:MAX_ARG_CHARS] for w in argv[:MAX_ARGV]] or ([process_name] if process_name else [])
    if not words:
        return ""
    program = os.path.basename(words[0]) or "task"
    program = "".join(c if c.isalnum() or c in "._-" else "_" for c in program)[:64]
    digest = hashlib.sha256("\0".join(words).encode("utf-8", "replace")).hexdigest()[:16]
    return f"{program}-{digest}"
