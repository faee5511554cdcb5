"""The bin-packing baseline, "binpack": among the GPUs that can take the job, the one with the
least free area, so used GPUs fill up first (Kubernetes' "MostAllocated" scoring on the quota x
SM rectangle). Ties go to the lowest GPU id; the search is area_search.py's.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from gpuloom.policies.placement.area_search import CHUNK, STEP, Key, Search, place_by_area
from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet import Fleet, ModelIndex, memory_classes
from gpuloom.policies.placement.model import JobRequest, Placement, Unplaceable


def _walk(fleet: Fleet, index: ModelIndex, job: JobRequest, w: int, h: int) -> Search:
    """Up each memory class's GPUs by free area to the first that fits; the best of those."""
    slots = fleet.slots
    need = job.memory_bytes
    node_ask = job.needs_node
    best: Key | None = None
    for memory_class in memory_classes(index, need):
        keys = index.by_free[memory_class]
        # A GPU with less free area than the job cannot take it.
        for i in range(bisect_left(keys, (w * h,)), len(keys)):
            key = keys[i]
            if best is not None and key >= best:
                break
            slot = slots[key[1]]
            if (
                slot.memory_free >= need
                and slot.free.fits(w, h)
                and (not node_ask or fleet.offers(slot, job))
            ):
                best = key
                break
            if not i % CHUNK:
                yield STEP
    yield (best,)


@dataclass(frozen=True, slots=True)
class BinPackPolicy:
    name: str = "binpack"

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        return place_by_area(self.name, job, fleet, _walk, 1)
