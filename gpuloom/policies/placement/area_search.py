"""The search the area-scored baselines share ("binpack" and "spread", the usual Kubernetes
"MostAllocated" and "LeastAllocated" scoring applied to FaST-GShare's 2D GPU resource).

Among the GPUs that can take the job (model, memory, schedulable, a free rectangle of its
shape, a node that takes it: `Fleet.offers`) a policy scores each by its free area; ties go to
the lowest GPU id. Inside the chosen GPU the job takes the bottom-left-most free position
(first fit over the maximal free rectangles the fleet keeps).

Two searches give the same answer and run in step, the first to finish wins: the policy's own
walk over the GPUs by free area (fast while the first GPUs fit) and `scan`, every free rectangle
large enough for the job (fast when few are, as in a crowded, fragmented fleet).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from gpuloom.policies.placement.fleet import Fleet, ModelIndex
from gpuloom.policies.placement.model import JobRequest, Placement, Rect, Unplaceable

Key = tuple[int, str]  # (free area, or minus it for spread; gpu id): smaller is better
# Yields None per step taken, then (best key or None,) when done.
Search = Iterator[tuple[Key | None] | None]
# A walk over one model's GPUs: (fleet, index, job, w, h) -> search.
Walk = Callable[[Fleet, ModelIndex, JobRequest, int, int], Search]

STEP = None
# Searches take turns every CHUNK steps: switching generators costs more than a step.
CHUNK = 32


def scan(fleet: Fleet, index: ModelIndex, job: JobRequest, w: int, h: int, sign: int) -> Search:
    """Every free rectangle large enough, for the best GPU among theirs."""
    rects = index.rects
    slots = fleet.slots
    node_ask = job.needs_node
    best: Key | None = None
    for i in range(bisect_left(rects, (w * h,)), len(rects)):
        _, gpu_id, box = rects[i]
        if box[2] - box[0] >= w and box[3] - box[1] >= h:
            slot = slots[gpu_id]
            if slot.memory_free >= job.memory_bytes and (not node_ask or fleet.offers(slot, job)):
                key = (sign * slot.area_free, gpu_id)
                if best is None or key < best:
                    best = key
        if not i % CHUNK:
            yield STEP
    yield (best,)


def _race(first: Search, second: Search) -> Key | None:
    """The answer of whichever search ends first (both give the same one)."""
    while True:
        for search in (first, second):
            step = next(search)
            if step is not None:
                return step[0]


def place_by_area(
    name: str, job: JobRequest, fleet: Fleet, walk: Walk, sign: int
) -> Placement | Unplaceable:
    """The GPU with the smallest `sign` x free area that takes the job, by `walk` raced with
    `scan`; the job at its first fit there."""
    w, h = job.w, job.sm_percent
    best: Key | None = None
    for index in fleet.indexes_for(job.gpu_model):
        key = _race(walk(fleet, index, job, w, h), scan(fleet, index, job, w, h, sign))
        if key is not None and (best is None or key < best):
            best = key
    if best is None:
        return fleet.unplaceable(job, w, h)
    slot = fleet.slot(best[1])
    box = slot.free.first_fit(w, h)
    assert box is not None  # the search checked it fits
    return Placement(job.job_id, slot.gpu_id, slot.node, Rect(box[0], box[1], w, h), name)
