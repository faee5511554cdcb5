"""Every invariant of the fleet, checked (`verify`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuloom.policies.placement.fleet.indexes import (
    memory_class,
)
from gpuloom.policies.placement.fleet.records import (
    GpuSlot,
    InvalidStateError,
)
from gpuloom.policies.placement.maxrects import (
    box_area,
    box_of,
    inside,
    maximal_boxes,
    overlaps,
)
from gpuloom.policies.placement.model import (
    GRID_H,
    GRID_W,
)

if TYPE_CHECKING:
    pass


class Verification:
    """Part of `Fleet`: Every invariant of the fleet, checked (`verify`)."""

    def verify(self) -> None:
        """Check every invariant (for tests and simulators); raise InvalidStateError."""
        slices: dict[str, set[str]] = {}
        groups: dict[str, str] = {}  # time-slice group key -> its GPU
        for slot in self._gpus.values():
            # A box per time-slice group (a lone allocation is a group of one), its members
            # all in it, and the area below counted once per group.
            for a_id, a in slot.allocations.items():
                if a.rect is None or slot.boxes.get(a.slice_group) != box_of(a.rect):
                    raise InvalidStateError(f"{slot.gpu_id}: {a_id} lies outside its group's box")
                first = slot.allocations.get(a.slice_of)
                if first is not None and first.slice_of:
                    raise InvalidStateError(f"{slot.gpu_id}: {a_id} joins a member's group")
                if a.slice_of:
                    slices.setdefault(a.slice_of, set()).add(a_id)
            if set(slot.boxes) != {a.slice_group for a in slot.allocations.values()}:
                raise InvalidStateError(f"{slot.gpu_id}: a box without an allocation")
            for group in slot.boxes:
                if groups.setdefault(group, slot.gpu_id) != slot.gpu_id:
                    raise InvalidStateError(f"time-slice group {group} spans GPUs")
            boxes = list(slot.boxes.items())
            for i, (a_id, a) in enumerate(boxes):
                if not (0 <= a[0] < a[2] <= GRID_W and 0 <= a[1] < a[3] <= GRID_H):
                    raise InvalidStateError(f"{slot.gpu_id}: {a_id} lies outside the GPU")
                for b_id, b in boxes[i + 1 :]:
                    if overlaps(a, b):
                        raise InvalidStateError(f"{slot.gpu_id}: {a_id} overlaps {b_id}")
            if slot.store_bytes != sum(slot.models.values()):
                raise InvalidStateError(f"{slot.gpu_id}: store bytes miscounted")
            memory = sum(a.memory_bytes for a in slot.allocations.values()) + slot.store_bytes
            if memory != slot.memory_used or memory > slot.memory_bytes:
                raise InvalidStateError(f"{slot.gpu_id}: memory over-committed or miscounted")
            if sum(box_area(b) for _, b in boxes) != slot.area_used:
                raise InvalidStateError(f"{slot.gpu_id}: used area miscounted")
            exact = maximal_boxes(b for _, b in boxes)
            if sorted(exact) != sorted(slot.free.maximal):
                raise InvalidStateError(f"{slot.gpu_id}: maximal rectangles drifted")
            for k in slot.free.kept:
                if not any(inside(k, m) for m in exact) or k in exact:
                    raise InvalidStateError(f"{slot.gpu_id}: kept rectangle {k} is wrong")
        for model, index in self._models.items():
            of_model = [self._gpus[g] for g in sorted(index.gpu_ids)]
            if any(s.model != model for s in of_model):
                raise InvalidStateError(f"model {model}: index holds another model's GPU")
            live = [s for s in of_model if s.schedulable]
            rects = sorted((box_area(b), s.gpu_id, b) for s in live for b in s.free.boxes())
            if index.rects != rects:
                raise InvalidStateError(f"model {model}: rectangle index drifted")
            by_free: dict[int, list[tuple[int, str]]] = {}
            for s in live:
                by_free.setdefault(memory_class(s.memory_free), []).append((s.area_free, s.gpu_id))
            if index.by_free != {c: sorted(keys) for c, keys in by_free.items()}:
                raise InvalidStateError(f"model {model}: free-area index drifted")
            if index.by_id != [s.gpu_id for s in live]:
                raise InvalidStateError(f"model {model}: GPU id index drifted")
        holders = type(self)()
        for slot in self._gpus.values():
            copy = GpuSlot(slot.gpu_id, "", slot.model, 1, 0, False, allocations=slot.allocations)
            holders._update_holder(copy)
        if holders._holders != self._holders:
            raise InvalidStateError("holder groups drifted")
        if {a: s.gpu_id for s in self._gpus.values() for a in s.allocations} != self._where:
            raise InvalidStateError("allocation ids drifted")
        resident: dict[str, set[str]] = {}
        for slot in self._gpus.values():
            for name in slot.models:
                resident.setdefault(name, set()).add(slot.gpu_id)
        if resident != self._resident:
            raise InvalidStateError("resident models drifted")
        for name, node in self._nodes.items():
            held = [a for g in node.gpu_ids for a in self._gpus[g].allocations.values()]
            if node.gpu_ids != sorted(g for g, s in self._gpus.items() if s.node == name):
                raise InvalidStateError(f"node {name}: GPU list drifted")
            if node.cpu_used != sum(a.cpu_milli for a in held) or node.memory_used != sum(
                a.host_memory_bytes for a in held
            ):
                raise InvalidStateError(f"node {name}: CPU or host memory miscounted")
            if node.cpu_used > node.cpu_milli or node.memory_used > node.memory_bytes:
                raise InvalidStateError(f"node {name}: CPU or host memory over-committed")
        gangs: dict[str, set[str]] = {}
        for s in self._gpus.values():
            for a in s.allocations.values():
                if a.gang:
                    gangs.setdefault(a.gang, set()).add(a.allocation_id)
        if gangs != self._gangs:
            raise InvalidStateError("jobs spanning GPUs drifted")
        if slices != self._slices:
            raise InvalidStateError("time-slice groups drifted")
        for a_id, gpu_id in self._where.items():
            if groups.get(a_id, gpu_id) != gpu_id:
                raise InvalidStateError(f"{a_id} is held on {gpu_id} and a group key elsewhere")
