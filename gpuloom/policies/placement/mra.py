"""FaST-GShare's Maximal Rectangles Algorithm, MRA (Gu et al., "FaST-GShare: Enabling
Efficient Spatio-Temporal GPU Sharing in Serverless Computing for Deep Learning Inference",
ICPP 2023, section 3.4.2, Algorithm 2).

Each GPU is a 100 % quota x 100 % SM rectangle with a list of maximal free rectangles (kept by
the fleet, see maxrects.py). A job is a w x h rectangle (w = quota request, h = SM percent).
Among the free rectangles of every GPU the job may use (model, memory, schedulable, a node that
takes it), MRA takes
the one whose area exceeds the job's by the least (the global best match, so a job goes to a
GPU already in use before an empty one) and puts the job in its bottom-left corner. The fleet
then splits the free rectangles the job cuts and drops the redundant ones; a release keeps the
freed rectangle and restructures the list ("keep-restructure").

Ties (same area) go to the lowest GPU id, then the rectangle's position.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet import Fleet
from gpuloom.policies.placement.maxrects import Box
from gpuloom.policies.placement.model import JobRequest, Placement, Rect, Unplaceable


def best_match(fleet: Fleet, job: JobRequest, w: int, h: int) -> tuple[str, Box] | None:
    """Algorithm 2, line 1: argmin over free rectangles R that fit of Area(R) - Area(job),
    across every GPU the job may use; (gpu id, free box) or None."""
    best: tuple[int, str, Box] | None = None
    need = job.memory_bytes
    slots = fleet.slots
    node_ask = job.needs_node
    for index in fleet.indexes_for(job.gpu_model):
        rects = index.rects
        # Entries are sorted by area: the first that fits is this model's best match.
        for i in range(bisect_left(rects, (w * h,)), len(rects)):
            entry = rects[i]
            if best is not None and entry >= best:
                break
            box = entry[2]
            if (
                box[2] - box[0] >= w
                and box[3] - box[1] >= h
                and slots[entry[1]].memory_free >= need
                and (not node_ask or fleet.offers(slots[entry[1]], job))
            ):
                best = entry
                break
    return None if best is None else (best[1], best[2])


@dataclass(frozen=True, slots=True)
class MraPolicy:
    name: str = "mra"

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        w, h = job.w, job.sm_percent
        found = best_match(fleet, job, w, h)
        if found is None:
            return fleet.unplaceable(job, w, h)
        gpu_id, box = found
        rect = Rect(box[0], box[1], w, h)  # PlaceAndNewJointRect(..., "BottomLeft")
        return Placement(job.job_id, gpu_id, fleet.slot(gpu_id).node, rect, self.name)
