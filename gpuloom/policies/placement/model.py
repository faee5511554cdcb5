"""The data placement works on: GPUs with their allocations, job requests, the rectangles they
take, and decisions. Plain data: it imports nothing of the rest of placement (the policy
protocol, which takes a `Fleet`, lives beside the fleet, in fleet/policy.py).

A GPU's compute capacity is FaST-GShare's rectangle (Gu et al., section 3.4.2): width = time
quota, height = SM percent, 100 % x 100 %. An allocation takes a quota x SM rectangle of it and
some memory. Rectangles live on an integer grid so that splitting and merging them is exact:
the quota axis has GRID_W steps of 0.01 % of the window, the SM axis GRID_H steps of 1 %.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuloom.domain.shares import Share

QUOTA_STEPS_PER_PERCENT = 100
GRID_W = 100 * QUOTA_STEPS_PER_PERCENT  # the whole time window
GRID_H = 100  # all SMs
GRID_AREA = GRID_W * GRID_H
MAX_PRIORITY = 9  # 0 is the highest
GIB = 1 << 30
# A replica of a model resident on its GPU is charged its memory less the model's weights,
# but never less than this: it still needs room of its own (activations, buffers), and a
# memory cap of 0 would mean "the whole GPU" to the dispatcher.
MIN_REPLICA_BYTES = 1 << 20
MAX_MODEL_NAME = 128
_MODEL_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class InvalidRequestError(ValueError):
    """A GPU, allocation or job field that makes no sense."""


def model_alternatives(gpu_model: str) -> tuple[str, ...]:
    """The GPU models a constraint admits: "V100M16|V100M32" -> ("V100M16", "V100M32");
    "" (any model) -> ()."""
    return tuple(part.strip() for part in gpu_model.split("|")) if gpu_model else ()


def _check_gpu_model(value: object) -> None:
    if not isinstance(value, str):
        raise InvalidRequestError(f"gpu_model must be a string, got {value!r}")
    if value and not all(model_alternatives(value)):
        raise InvalidRequestError(
            f"gpu_model {value!r} has an empty alternative (write models as A|B)"
        )


def _check_count(name: str, value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidRequestError(f"{name} must be an integer >= 0, got {value!r}")


def quota_steps(percent: float) -> int:
    """Grid steps for a quota in percent, rounded up: a reservation is never smaller than asked.
    The inner round() keeps 33.33 (3332.9999... steps in binary) at 3333."""
    return math.ceil(round(percent * QUOTA_STEPS_PER_PERCENT, 6))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")


def _check_sm(value: object) -> None:
    if not _is_int(value) or not 1 <= value <= 100:  # type: ignore[operator]
        raise InvalidRequestError(f"sm_percent must be an integer in 1..100, got {value!r}")


def _check_quota(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= 100
        or quota_steps(value) < 1
    ):
        raise InvalidRequestError(f"{name} must lie in (0, 100] (at least 0.01), got {value!r}")


def _check_memory(value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidRequestError(f"memory_bytes must be an integer >= 0, got {value!r}")


def _check_priority(value: object) -> None:
    if not _is_int(value) or not 0 <= value <= MAX_PRIORITY:  # type: ignore[operator]
        raise InvalidRequestError(
            f"priority must be an integer in 0..{MAX_PRIORITY} (0 highest), got {value!r}"
        )


def _check_share(value: object) -> None:
    """A share's SM percent, memory and priority as placement takes them (its quota request is
    checked against the grid by the caller, naming its own field)."""
    if not isinstance(value, Share):
        raise InvalidRequestError(f"share must be a Share, got {value!r}")
    _check_sm(value.sm_percent)
    _check_memory(value.memory_bytes)
    _check_priority(value.priority)


def check_model_name(name: str, value: object) -> None:
    """A shared model's name as the model store takes it: [A-Za-z0-9._:-]{1,128}."""
    if not isinstance(value, str) or not _MODEL_NAME.fullmatch(value):
        raise InvalidRequestError(
            f"{name} must match [A-Za-z0-9._:-]{{1,{MAX_MODEL_NAME}}}, got {str(value)[:140]!r}"
        )


def check_models(models: Iterable[tuple[str, int]]) -> dict[str, int]:
    """The models a GPU's store holds, as (name, device bytes) pairs: names valid and each once,
    sizes positive integers no larger than a GPU could hold (2**63 - 1)."""
    checked: dict[str, int] = {}
    for name, nbytes in models:
        check_model_name("model name", name)
        if not _is_int(nbytes) or not 0 < nbytes < 1 << 63:
            raise InvalidRequestError(f"model {name}: bytes must be a positive integer")
        if name in checked:
            raise InvalidRequestError(f"model {name} is listed twice")
        checked[name] = nbytes
    return checked


def replica_memory(memory_bytes: int, shared_bytes: int) -> int:
    """What a replica that asks `memory_bytes` (its whole footprint, weights included) is
    charged on a GPU whose model store holds its model's `shared_bytes` (0: not there): the
    footprint less the weights, never below MIN_REPLICA_BYTES and never above what it asked.
    The weights are charged once, to the store."""
    if shared_bytes <= 0:
        return memory_bytes
    return min(memory_bytes, max(memory_bytes - shared_bytes, MIN_REPLICA_BYTES))


def describe_gib(n_bytes: int) -> str:
    """90 GiB, 1.5 GiB, 0.25 GiB: short and exact enough for a reason string."""
    gib = n_bytes / GIB
    return f"{gib:.0f} GiB" if gib == int(gib) else f"{gib:.3g} GiB"


def describe_shape(w: int, h: int) -> str:
    """'40% quota x 50% SM' for a w x h rectangle in grid steps."""
    return f"{w / QUOTA_STEPS_PER_PERCENT:g}% quota x {h}% SM"


@dataclass(frozen=True, slots=True, order=True)
class Rect:
    """A rectangle of one GPU: x = quota offset and w = quota, in steps of 0.01 % of the window;
    y = SM offset and h = SM, in percent. Ends are exclusive: x + w <= GRID_W."""

    x: int
    y: int
    w: int
    h: int

    @property
    def area(self) -> int:
        return self.w * self.h

    @property
    def quota_offset_percent(self) -> float:
        return self.x / QUOTA_STEPS_PER_PERCENT

    @property
    def quota_percent(self) -> float:
        return self.w / QUOTA_STEPS_PER_PERCENT

    def overlaps(self, other: Rect) -> bool:
        return (
            self.x < other.x + other.w
            and other.x < self.x + self.w
            and self.y < other.y + other.h
            and other.y < self.y + self.h
        )

    def label(self) -> str:
        return (
            f"quota {self.quota_percent:g}%@{self.quota_offset_percent:g}% x SM {self.h}%@{self.y}%"
        )

    def validate(self) -> None:
        """Raise InvalidRequestError unless the rectangle is non-empty and inside the GPU."""
        if not all(_is_int(v) for v in (self.x, self.y, self.w, self.h)):
            raise InvalidRequestError(f"rectangle fields must be integers, got {self!r}")
        if self.w < 1 or self.h < 1:
            raise InvalidRequestError(f"rectangle {self!r} is empty")
        if self.x < 0 or self.y < 0 or self.x + self.w > GRID_W or self.y + self.h > GRID_H:
            raise InvalidRequestError(
                f"rectangle {self!r} is outside the GPU ({GRID_W} quota steps x {GRID_H}% SM)"
            )


class _HoldsShare:
    """What placement reads of a job's `share` (a field of the dataclass below it): its SM
    percent, its time quota's request (the guaranteed part, which placement reserves: the
    rectangle's width) and its priority."""

    __slots__ = ()
    share: Share

    @property
    def sm_percent(self) -> int:
        return self.share.sm_percent

    @property
    def quota_request_percent(self) -> float:
        return self.share.quota.request_percent

    @property
    def priority(self) -> int:
        return self.share.priority


@dataclass(frozen=True, slots=True)
class Allocation(_HoldsShare):
    """Resources held on one GPU. `share` is the job's share as it runs there: its SM percent,
    its time quota (the fleet reserves the request), its priority and its memory cap (for a
    replica beside its model, less the weights: what the fleet decided). `rect` is where it
    sits in the GPU's quota x SM rectangle; the service stores it with the allocation so that
    a restart rebuilds the same free space. None (an old record) is placed first-fit when the
    GPU is loaded."""

    allocation_id: str
    share: Share
    task_key: str = ""
    rect: Rect | None = None
    # The node's CPU (milli) and host memory the job holds; a job spanning GPUs charges them
    # on its first GPU's allocation only.
    cpu_milli: int = 0
    host_memory_bytes: int = 0
    # A job on several GPUs: each further GPU holds an allocation `gang_member_id(job, i)`
    # whose `gang` is the job id (the first GPU's allocation is the job id itself).
    gang: str = ""
    # A member of a time-slice group (Gandiva's over-subscription): the allocation id of the
    # group's first allocation, released or not. A member takes turns with the group's other
    # jobs in the group's rectangle (it runs only while they are suspended), so it holds that
    # rectangle, not one of its own, plus its memory and node resources. "" = none. A further
    # GPU of a job (`gang` set) may be a member too: a gang time-sliced with another on its GPUs
    # joins on each the group there (each GPU's group has its own key).
    slice_of: str = ""
    # A member of a time-slice group whose memory is taken in turns (its dispatcher moves a
    # suspended member's device memory to host memory through the driver's checkpoint API):
    # its part of the group's charge, which is the largest member's memory, not the sum (the
    # fleet spreads it). None: not in turns (charged the memory it runs with).
    turn_charge_bytes: int | None = None

    @property
    def runs_with_bytes(self) -> int:
        """The memory the allocation's job runs with (its cap)."""
        return self.share.memory_bytes

    @property
    def memory_bytes(self) -> int:
        """The GPU memory the fleet charges it: what it runs with, or in turns its part."""
        return self.share.memory_bytes if self.turn_charge_bytes is None else self.turn_charge_bytes

    @property
    def in_turns(self) -> bool:
        return self.turn_charge_bytes is not None

    @property
    def slice_group(self) -> str:
        """The key of the time-slice group whose rectangle the allocation sits in: the first
        allocation's id (its own, unless it joined one)."""
        return self.slice_of or self.allocation_id

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that makes no sense."""
        _check_id("allocation_id", self.allocation_id)
        _check_count("cpu_milli", self.cpu_milli)
        _check_count("host_memory_bytes", self.host_memory_bytes)
        if not isinstance(self.gang, str):
            raise InvalidRequestError(f"gang must be a string, got {self.gang!r}")
        if self.slice_of != "":
            _check_id("slice_of", self.slice_of)
            if self.slice_of == self.allocation_id:
                raise InvalidRequestError(
                    f"allocation {self.allocation_id}: slice_of names the allocation itself "
                    "(a group's first allocation leaves it empty)"
                )
        _check_share(self.share)
        _check_quota("quota_request_percent", self.quota_request_percent)
        if self.turn_charge_bytes is not None:
            _check_count("turn_charge_bytes", self.turn_charge_bytes)
            if self.turn_charge_bytes > self.runs_with_bytes:
                raise InvalidRequestError(
                    f"allocation {self.allocation_id}: turn_charge_bytes "
                    f"{self.turn_charge_bytes} is more than the {self.runs_with_bytes} it runs with"
                )
        if not isinstance(self.task_key, str):
            raise InvalidRequestError(f"task_key must be a string, got {self.task_key!r}")
        if self.rect is not None:
            self.rect.validate()
            # The time-share baseline widens the SM side to 100 %, never narrows either side.
            if (
                self.rect.w < quota_steps(self.quota_request_percent)
                or self.rect.h < self.sm_percent
            ):
                raise InvalidRequestError(
                    f"allocation {self.allocation_id}: rectangle {self.rect.label()} is smaller "
                    f"than its {self.quota_request_percent:g}% quota x {self.sm_percent}% SM"
                )


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as registered, with the allocations on it (for add_gpu and restarts)."""

    gpu_id: str
    node: str
    model: str
    memory_bytes: int
    sm_count: int = 0  # informative: shapes are in percent of the SMs
    schedulable: bool = True
    allocations: tuple[Allocation, ...] = ()
    # The models its store holds, (name, device bytes): used memory, charged once (see
    # replica_memory).
    models: tuple[tuple[str, int], ...] = ()
    # What the GPU's node has for jobs besides GPUs, as its dispatcher reported it (the latest
    # registration of any GPU of the node sets the node's figures); 0: none (or not reported),
    # so jobs asking for CPU or host memory do not go there.
    node_cpu_milli: int = 0
    node_memory_bytes: int = 0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that makes no sense."""
        _check_id("gpu_id", self.gpu_id)
        _check_count("node_cpu_milli", self.node_cpu_milli)
        _check_count("node_memory_bytes", self.node_memory_bytes)
        if not isinstance(self.node, str):
            raise InvalidRequestError(f"node must be a string, got {self.node!r}")
        _check_id("model", self.model)
        if not _is_int(self.memory_bytes) or self.memory_bytes < 1:
            raise InvalidRequestError(
                f"memory_bytes must be a positive integer, got {self.memory_bytes!r}"
            )
        if not _is_int(self.sm_count) or self.sm_count < 0:
            raise InvalidRequestError(f"sm_count must be an integer >= 0, got {self.sm_count!r}")
        if not isinstance(self.schedulable, bool):
            raise InvalidRequestError(f"schedulable must be a bool, got {self.schedulable!r}")
        for allocation in self.allocations:
            allocation.validate()
        check_models(self.models)


@dataclass(frozen=True, slots=True)
class JobRequest(_HoldsShare):
    """What a job asks of the fleet: its `share` (SM percent, time quota, memory, priority), of
    which placement reserves the time quota's request, the guaranteed part (FaST-GShare's
    Q_request); the limit is the dispatcher's business, carried on in the same share."""

    job_id: str
    share: Share
    gpu_model: str = ""  # "" = any model; "A|B": either model
    task_key: str = ""
    # A replica of this model: where the model is resident (a GPU's store holds it) the job is
    # placed first, charged memory_bytes less the weights (replica_memory). "" = none.
    shared_model: str = ""
    # Whole GPUs on one node (1: one GPU, whatever its share). More than 1 asks for whole GPUs:
    # sm_percent 100 and quota 100 %, on `gpus` GPUs of one node, all or none.
    gpus: int = 1
    cpu_milli: int = 0  # of the node's CPU, in thousandths of a core
    host_memory_bytes: int = 0  # of the node's memory
    # Only GPUs of these nodes (a Kubernetes scheduler's candidates); empty = any node.
    nodes: frozenset[str] = frozenset()

    @property
    def memory_bytes(self) -> int:
        return self.share.memory_bytes

    @property
    def models(self) -> tuple[str, ...]:
        """The GPU models the job may use; () = any."""
        return model_alternatives(self.gpu_model)

    def allows(self, model: str) -> bool:
        return not self.gpu_model or model in self.models

    @property
    def needs_node(self) -> bool:
        """Whether the job asks anything of its node besides GPUs: CPU, host memory, or to be
        one of `nodes`."""
        return bool(self.cpu_milli or self.host_memory_bytes or self.nodes)

    @property
    def w(self) -> int:
        return quota_steps(self.quota_request_percent)

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that makes no sense."""
        _check_id("job_id", self.job_id)
        _check_share(self.share)
        _check_quota("quota_request_percent", self.quota_request_percent)
        _check_gpu_model(self.gpu_model)
        if not isinstance(self.task_key, str):
            raise InvalidRequestError("task_key must be a string")
        _check_count("cpu_milli", self.cpu_milli)
        _check_count("host_memory_bytes", self.host_memory_bytes)
        if not isinstance(self.nodes, frozenset) or not all(
            isinstance(n, str) and n for n in self.nodes
        ):
            raise InvalidRequestError(f"nodes must be a frozenset of names, got {self.nodes!r}")
        if not _is_int(self.gpus) or self.gpus < 1:
            raise InvalidRequestError(f"gpus must be an integer >= 1, got {self.gpus!r}")
        if self.gpus > 1 and (self.sm_percent != GRID_H or self.w != GRID_W):
            raise InvalidRequestError(
                f"a job on {self.gpus} GPUs takes them whole (sm_percent 100, quota 100 %)"
            )
        if self.shared_model != "":
            check_model_name("shared_model", self.shared_model)
            if self.gpus > 1:
                raise InvalidRequestError(
                    f"a job on {self.gpus} whole GPUs is not a shared model's replica "
                    "(replicas take one GPU)"
                )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a job goes: a GPU and the rectangle it takes there; a job on several GPUs takes
    `extra_gpu_ids` too, whole, on the same node."""

    allocation_id: str  # the job id
    gpu_id: str
    node: str
    rect: Rect
    policy: str
    extra_gpu_ids: tuple[str, ...] = ()

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return (self.gpu_id, *self.extra_gpu_ids)


def gang_member_id(job_id: str, i: int) -> str:
    """The fleet's id of the allocation a job spanning GPUs holds on its (i+1)-th GPU."""
    return f"{job_id}#{i}"


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """No GPU can take the job now; `reason` is for people."""

    job_id: str
    reason: str
