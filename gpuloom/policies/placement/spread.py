"""The spreading baseline, "spread": among the GPUs that can take the job, the one with the most
free area, so load spreads over the fleet (Kubernetes' "LeastAllocated" scoring on the quota x
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
    """Down each memory class's GPUs by free area (equal areas from the lowest GPU id) to the
    first that fits; the best of those, as (-free area, gpu id)."""
    slots = fleet.slots
    need = job.memory_bytes
    node_ask = job.needs_node
    best: Key | None = None
    for memory_class in memory_classes(index, need):
        keys = index.by_free[memory_class]
        end = len(keys)
        while end > 0 and keys[end - 1][0] >= w * h:
            area = keys[end - 1][0]
            if best is not None and -area > best[0]:
                break
            start = bisect_left(keys, (area,))
            hit = None
            for i in range(start, end):
                key = (-area, keys[i][1])
                if best is not None and key >= best:
                    break
                slot = slots[keys[i][1]]
                if (
                    slot.memory_free >= need
                    and slot.free.fits(w, h)
                    and (not node_ask or fleet.offers(slot, job))
                ):
                    hit = key
                    break
                if not i % CHUNK:
                    yield STEP
            if hit is not None:
                best = hit
                break
            end = start
    yield (best,)


@dataclass(frozen=True, slots=True)
class SpreadPolicy:
    name: str = "spread"

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        return place_by_area(self.name, job, fleet, _walk, -1)
