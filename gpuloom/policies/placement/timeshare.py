"""The time-sharing-only baseline: every job takes all SMs (h = 100 %) for its time quota, so
GPUs are shared in time alone, the way KubeShare and Gemini share them. This is the "time
sharing" scheduler FaST-GShare is compared with (Gu et al., section 5.4: 4 ResNet, 2 RNNT and
2 BERT pods need 4 GPUs this way and 1 with MRA).

First fit: the lowest GPU id that has the quota (a full-height free rectangle of its width)
and the memory, on a node that takes the job; the job takes the earliest free quota there.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet import Fleet
from gpuloom.policies.placement.model import GRID_H, JobRequest, Placement, Rect, Unplaceable


@dataclass(frozen=True, slots=True)
class TimeSharePolicy:
    name: str = "time-share"

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        w = job.w
        area = w * GRID_H
        best: str | None = None
        spot = None
        slots = fleet.slots
        for index in fleet.indexes_for(job.gpu_model):
            for gpu_id in index.by_id:
                if best is not None and gpu_id >= best:
                    break
                slot = slots[gpu_id]
                if (
                    slot.area_free < area
                    or slot.memory_free < job.memory_bytes
                    or not fleet.offers(slot, job)
                ):
                    continue
                box = slot.free.first_fit(w, GRID_H)
                if box is not None:
                    best, spot = gpu_id, box
                    break
        if best is None or spot is None:
            return fleet.unplaceable(job, w, GRID_H, " (time sharing takes all SMs)")
        rect = Rect(spot[0], 0, w, GRID_H)
        return Placement(job.job_id, best, fleet.slot(best).node, rect, self.name)
