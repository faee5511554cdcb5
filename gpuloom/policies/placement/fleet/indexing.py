"""Keeping the per-model indexes (free boxes, free area by memory class, ids) and the gap-aware
holders in step with a GPU's changes."""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuloom.policies.placement.fleet.indexes import (
    ModelIndex,
    _free,
    _unfree,
)
from gpuloom.policies.placement.fleet.records import (
    GpuSlot,
    HolderGroup,
    _remove,
)
from gpuloom.policies.placement.maxrects import (
    Box,
    box_area,
)
from gpuloom.policies.placement.model import (
    model_alternatives,
)

if TYPE_CHECKING:
    pass


class Indexing:
    """Part of `Fleet`: Keeping the per-model indexes (free boxes, free area by memory class, ids)
    and the gap-aware holders in step with a GPU's changes."""

    def _before(self, slot: GpuSlot) -> tuple[set[Box], tuple[int, str], int] | None:
        if not slot.schedulable:
            return None
        return set(slot.free.boxes()), (slot.area_free, slot.gpu_id), slot.memory_free

    def _after(self, slot: GpuSlot, before: tuple[set[Box], tuple[int, str], int] | None) -> None:
        self._touch(slot.node)
        if before is None:
            return
        old_boxes, old_key, old_memory = before
        new_boxes = set(slot.free.boxes())
        index = self._models[slot.model]
        gpu_id = slot.gpu_id
        for box in old_boxes - new_boxes:
            _remove(index.rects, (box_area(box), gpu_id, box))
        for box in new_boxes - old_boxes:
            insort(index.rects, (box_area(box), gpu_id, box))
        _unfree(index, old_key, old_memory)
        _free(index, (slot.area_free, gpu_id), slot.memory_free)

    def _index(self, slot: GpuSlot) -> None:
        self._file(slot, insort, _free)

    def _unindex(self, slot: GpuSlot) -> None:
        self._file(slot, _remove, _unfree)

    def _file(
        self,
        slot: GpuSlot,
        put: Callable[[list, object], None],
        count: Callable[[ModelIndex, tuple[int, str], int], None],
    ) -> None:
        """Put `slot`'s free boxes, free counts and id into its model's index (insort, _free)
        or take them out (_remove, _unfree)."""
        index = self._models[slot.model]
        for box in slot.free.boxes():
            put(index.rects, (box_area(box), slot.gpu_id, box))
        count(index, (slot.area_free, slot.gpu_id), slot.memory_free)
        put(index.by_id, slot.gpu_id)
        index.max_memory = -1

    def _max_memory(self, index: ModelIndex) -> int:
        # GPUs come and go rarely; decisions that fail may come often.
        if index.max_memory < 0:
            index.max_memory = max(self._gpus[g].memory_bytes for g in index.by_id)
        return index.max_memory

    def _update_holder(self, slot: GpuSlot) -> None:
        group: HolderGroup | None = None
        if slot.allocations:
            holder = min(slot.allocations.values(), key=lambda a: (a.priority, a.allocation_id))
            if holder.task_key:
                fillers = sum(a.priority > holder.priority for a in slot.allocations.values())
                group = (holder.task_key, holder.priority, fillers)
        self._set_holder(slot, group)

    def _set_holder(self, slot: GpuSlot, group: HolderGroup | None) -> None:
        if group == slot.holder:
            return
        if slot.holder is not None:
            members = self._holders[slot.holder]
            _remove(members, slot.gpu_id)
            if not members:
                del self._holders[slot.holder]
        if group is not None:
            insort(self._holders.setdefault(group, []), slot.gpu_id)
        slot.holder = group

    def indexes_for(self, gpu_model: str) -> list[ModelIndex]:
        """The indexes a job's model constraint admits ("" = every model, "A|B" either)."""
        if gpu_model:
            if "|" not in gpu_model:
                index = self._models.get(gpu_model)
                return [] if index is None else [index]
            wanted = set(model_alternatives(gpu_model))
            return [self._models[m] for m in sorted(wanted) if m in self._models]
        return [self._models[m] for m in sorted(self._models)]

    def holder_groups(self) -> dict[HolderGroup, list[str]]:
        """GPUs by who holds them: (task key of the highest-priority allocation, its priority,
        lower-priority allocations there); GPU ids sorted. Only holders with a task key.
        Read-only; unschedulable GPUs included."""
        return self._holders
