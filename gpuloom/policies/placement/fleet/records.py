"""The fleet's records: one GPU's (`GpuSlot`) and one node's (`NodeSlot`), the errors, and the
helpers that load stored state into them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from gpuloom.policies.placement.maxrects import (
    Box,
    FreeRects,
    box_area,
    box_of,
    overlaps,
    rect_of,
)
from gpuloom.policies.placement.model import (
    GRID_AREA,
    Allocation,
    GpuState,
    JobRequest,
    check_models,
    describe_gib,
    describe_shape,
    quota_steps,
    replica_memory,
)

# FaST-GShare rebuilds a GPU's list once it grows past a threshold; here past
# REBUILD_FACTOR * allocations + REBUILD_SLACK rectangles.
REBUILD_FACTOR = 4


REBUILD_SLACK = 8


class InvalidStateError(ValueError):
    """Allocations that cannot all be on their GPU: overlapping rectangles, too much memory,
    an id used twice."""


class InvalidPlacementError(ValueError):
    """A policy returned a placement the fleet cannot commit (a bug in the policy), or a job
    cannot join a time-slice group (`Fleet.slice_into`)."""


# Who holds a GPU for the gap-aware policy: (holder task key, holder priority, allocations of
# lower priority already filling its gaps).
HolderGroup = tuple[str, int, int]


JOURNAL_KEEP = 1 << 16  # changes the fleet remembers for `touched_since`


@dataclass(slots=True, eq=False)
class GpuSlot:
    """The fleet's live record of one GPU. Policies read it; only the fleet changes it."""

    gpu_id: str
    node: str
    model: str
    memory_bytes: int
    sm_count: int
    schedulable: bool
    free: FreeRects = field(default_factory=FreeRects)
    allocations: dict[str, Allocation] = field(default_factory=dict)
    # One per time-slice group, by its key (`Allocation.slice_group`: an allocation's own id
    # unless it joined a group): members share their group's box.
    boxes: dict[str, Box] = field(default_factory=dict)
    memory_free: int = 0  # set from memory_bytes when loaded
    area_free: int = GRID_AREA  # stored, not computed: the searches read them in their loops
    holder: HolderGroup | None = None
    models: dict[str, int] = field(default_factory=dict)  # resident in its store: name -> bytes
    store_bytes: int = 0  # their sum, part of the used memory
    # The node's figures as this GPU was registered with them (NodeSlot holds the node's).
    node_cpu_milli: int = 0
    node_memory_bytes: int = 0

    @property
    def memory_used(self) -> int:
        return self.memory_bytes - self.memory_free

    @property
    def area_used(self) -> int:
        return GRID_AREA - self.area_free

    def state(self) -> GpuState:
        return GpuState(
            self.gpu_id,
            self.node,
            self.model,
            self.memory_bytes,
            self.sm_count,
            self.schedulable,
            tuple(self.allocations.values()),
            tuple(sorted(self.models.items())),
            self.node_cpu_milli,
            self.node_memory_bytes,
        )

    def memory_need(self, job: JobRequest) -> int:
        """The memory `job` is charged here: less its shared model's weights where the model
        is resident (replica_memory), else what it asks."""
        if not job.shared_model:
            return job.memory_bytes
        return replica_memory(job.memory_bytes, self.models.get(job.shared_model, 0))


@dataclass(slots=True, eq=False)
class NodeSlot:
    """The fleet's live record of one node: its CPU and host memory (the latest registration of
    one of its GPUs sets them) and what the jobs on it hold. Read it, never change it."""

    name: str
    cpu_milli: int = 0
    memory_bytes: int = 0
    cpu_used: int = 0
    memory_used: int = 0
    gpu_ids: list[str] = field(default_factory=list)  # sorted

    @property
    def cpu_free(self) -> int:
        return self.cpu_milli - self.cpu_used

    @property
    def memory_free(self) -> int:
        return self.memory_bytes - self.memory_used

    def takes(self, job: JobRequest) -> bool:
        """Whether the node is one the job may use and has the CPU and host memory it asks
        for free."""
        return (
            (not job.nodes or self.name in job.nodes)
            and job.cpu_milli <= self.cpu_free
            and job.host_memory_bytes <= self.memory_free
        )


def _names(nodes: Iterable[str], shown: int = 3) -> str:
    """'a, b, c and 4 more'."""
    names = sorted(nodes)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _member_order(member_id: str) -> int:
    return int(member_id.rsplit("#", 1)[1])


def _load_models(slot: GpuSlot, models: Iterable[tuple[str, int]]) -> None:
    """Put the store's models on a slot its allocations are loaded on (InvalidStateError if
    they do not fit beside them)."""
    slot.models = check_models(models)
    slot.store_bytes = sum(slot.models.values())
    if slot.store_bytes > slot.memory_free:
        raise InvalidStateError(
            f"GPU {slot.gpu_id}: its store's {describe_gib(slot.store_bytes)} of models do not "
            f"fit beside its allocations"
        )
    slot.memory_free -= slot.store_bytes


def _load_allocations(
    slot: GpuSlot, allocations: Iterable[Allocation], taken: dict[str, str]
) -> list[Allocation]:
    """Put stored allocations on a fresh slot: positioned ones first, then the rest first-fit.
    Raises InvalidStateError if they cannot all be there."""
    pending: list[Allocation] = []
    placed: list[Allocation] = []
    seen: set[str] = set()
    for allocation in allocations:
        a_id = allocation.allocation_id
        if a_id in taken or a_id in seen:
            raise InvalidStateError(f"allocation {a_id} appears twice")
        seen.add(a_id)
        if allocation.rect is None:
            pending.append(allocation)
            continue
        box = box_of(allocation.rect)
        group = allocation.slice_group
        held = slot.boxes.get(group)
        if held is None:
            for other_id, other in slot.boxes.items():
                if overlaps(box, other):
                    raise InvalidStateError(
                        f"GPU {slot.gpu_id}: allocations {other_id} and {a_id} overlap"
                    )
            slot.boxes[group] = box
        elif held != box:
            raise InvalidStateError(
                f"GPU {slot.gpu_id}: allocation {a_id} of time-slice group {group} sits in "
                f"{allocation.rect.label()}, not in the group's {rect_of(held).label()}"
            )
        slot.allocations[a_id] = allocation
        placed.append(allocation)
    free = FreeRects.build(slot.boxes.values())
    # A group with no rectangle stored is placed once, in a box that holds each of its shapes.
    shapes: dict[str, tuple[int, int]] = {}
    for allocation in pending:
        w, h = shapes.get(allocation.slice_group, (0, 0))
        shapes[allocation.slice_group] = (
            max(w, quota_steps(allocation.quota_request_percent)),
            max(h, allocation.sm_percent),
        )
    for allocation in pending:
        w, h = quota_steps(allocation.quota_request_percent), allocation.sm_percent
        group = allocation.slice_group
        held = slot.boxes.get(group)
        if held is not None:
            # A member (or a group's first) without a rectangle joins its group's.
            if held[2] - held[0] < w or held[3] - held[1] < h:
                raise InvalidStateError(
                    f"GPU {slot.gpu_id}: allocation {allocation.allocation_id} "
                    f"({describe_shape(w, h)}) does not fit in its time-slice group {group}'s "
                    f"{rect_of(held).label()}"
                )
            box = held
        else:
            w, h = shapes[group]
            spot = free.first_fit(w, h)
            if spot is None:
                raise InvalidStateError(
                    f"GPU {slot.gpu_id}: no room left for allocation {allocation.allocation_id} "
                    f"({describe_shape(w, h)})"
                )
            box = (spot[0], spot[1], spot[0] + w, spot[1] + h)
            free.occupy(box)
            slot.boxes[group] = box
        allocation = replace(allocation, rect=rect_of(box))  # node figures, gang, group kept
        slot.allocations[allocation.allocation_id] = allocation
        placed.append(allocation)
    for allocation in placed:
        first = slot.allocations.get(allocation.slice_of)
        if first is not None and first.slice_of:
            raise InvalidStateError(
                f"GPU {slot.gpu_id}: allocation {allocation.allocation_id} joins time-slice "
                f"group {allocation.slice_of}, itself a member of group {first.slice_of}"
            )
    memory = sum(a.memory_bytes for a in placed)
    if memory > slot.memory_bytes:
        raise InvalidStateError(
            f"GPU {slot.gpu_id}: allocations hold {describe_gib(memory)} of "
            f"{describe_gib(slot.memory_bytes)}"
        )
    slot.memory_free = slot.memory_bytes - memory
    slot.area_free = GRID_AREA - sum(box_area(b) for b in slot.boxes.values())
    return placed


def _remove(items: list, key: object) -> None:
    i = bisect_left(items, key)
    if i == len(items) or items[i] != key:
        raise AssertionError(f"index lost {key!r}")
    del items[i]


def _turn_charge(memory_bytes: int, slot: GpuSlot, group: str) -> int:
    """What a job running with `memory_bytes` adds to time-slice group `group`'s memory when
    its members take their memory in turns: the group holds its largest member's."""
    held = sum(a.memory_bytes for a in slot.allocations.values() if a.slice_group == group)
    return max(0, memory_bytes - held)


def _spread_in_turns(members: Sequence[Allocation]) -> list[Allocation]:
    """A time-slice group's allocations charged in turns: the one running with the most memory
    is charged all of it, the others nothing (the group holds its largest member's memory)."""
    if not members:
        return []
    largest = max(members, key=lambda a: (a.runs_with_bytes, a.allocation_id))
    return [
        replace(
            a,
            turn_charge_bytes=a.runs_with_bytes if a is largest else 0,
        )
        for a in members
    ]


def _recharge_in_turns(allocations: dict[str, Allocation], group: str) -> int:
    """Charge group `group`'s allocations (in `allocations`, changed in place) in turns after
    a member left; returns the memory that comes free."""
    members = [a for a in allocations.values() if a.slice_group == group]
    before = sum(a.memory_bytes for a in members)
    for a in _spread_in_turns(members):
        allocations[a.allocation_id] = a
    return before - max((a.runs_with_bytes for a in members), default=0)


def _charged_in_turns(allocations: Iterable[Allocation]) -> list[Allocation]:
    """Stored allocations with the memory of each time-slice group that holds a member in turns
    charged once, at its largest member's (the stored charges may predate a member's end)."""
    listed = list(allocations)
    groups = {a.slice_group for a in listed if a.in_turns}
    if not groups:
        return listed
    spread = {
        a.allocation_id: a
        for group in groups
        for a in _spread_in_turns([m for m in listed if m.slice_group == group])
    }
    return [spread.get(a.allocation_id, a) for a in listed]
