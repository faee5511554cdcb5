"""Bin-packing and spreading baselines for the quota x SM rectangle (the usual Kubernetes
"MostAllocated" and "LeastAllocated" scoring, applied to FaST-GShare's 2D GPU resource).

- "binpack": among the GPUs that can take the job (model, memory, schedulable, a free
  rectangle of its shape), the one with the least free area, so used GPUs fill up first;
- "spread": the one with the most free area, so load spreads over the fleet.

Ties go to the lowest GPU id. Inside the chosen GPU the job takes the bottom-left-most free
position (first fit over the maximal free rectangles the fleet keeps).

Two searches give the same answer and run in step, the first to finish wins: walking the GPUs
by free area (fast while the first GPUs fit) and scanning every free rectangle large enough
for the job (fast when few are, as in a crowded, fragmented fleet).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from gpuloom.policies.placement.fleet import Fleet, ModelIndex, memory_classes
from gpuloom.policies.placement.model import JobRequest, Placement, Rect, Unplaceable

Key = tuple[int, str]  # (free area, or minus it for spread; gpu id): smaller is better
# Yields None per step taken, then (best key or None,) when done.
Search = Iterator[tuple[Key | None] | None]

STEP = None
# Searches take turns every CHUNK steps: switching generators costs more than a step.
CHUNK = 32


def _walk(fleet: Fleet, index: ModelIndex, job: JobRequest, w: int, h: int) -> Search:
    """Up each memory class's GPUs by free area to the first that fits; the best of those."""
    slots = fleet.slots
    need = job.memory_bytes
    best: Key | None = None
    for memory_class in memory_classes(index, need):
        keys = index.by_free[memory_class]
        # A GPU with less free area than the job cannot take it.
        for i in range(bisect_left(keys, (w * h,)), len(keys)):
            key = keys[i]
            if best is not None and key >= best:
                break
            slot = slots[key[1]]
            if slot.memory_free >= need and slot.free.fits(w, h):
                best = key
                break
            if not i % CHUNK:
                yield STEP
    yield (best,)


def _walk_down(fleet: Fleet, index: ModelIndex, job: JobRequest, w: int, h: int) -> Search:
    """Down each memory class's GPUs by free area (equal areas from the lowest GPU id) to the
    first that fits; the best of those, as (-free area, gpu id)."""
    slots = fleet.slots
    need = job.memory_bytes
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
                if slot.memory_free >= need and slot.free.fits(w, h):
                    hit = key
                    break
                if not i % CHUNK:
                    yield STEP
            if hit is not None:
                best = hit
                break
            end = start
    yield (best,)


def _scan(fleet: Fleet, index: ModelIndex, job: JobRequest, w: int, h: int, sign: int) -> Search:
    """Every free rectangle large enough, for the best GPU among theirs."""
    rects = index.rects
    slots = fleet.slots
    best: Key | None = None
    for i in range(bisect_left(rects, (w * h,)), len(rects)):
        _, gpu_id, box = rects[i]
        if box[2] - box[0] >= w and box[3] - box[1] >= h:
            slot = slots[gpu_id]
            if slot.memory_free >= job.memory_bytes:
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


def _place(name: str, job: JobRequest, fleet: Fleet, spread: bool) -> Placement | Unplaceable:
    w, h = job.w, job.sm_percent
    best: Key | None = None
    for index in fleet.indexes_for(job.gpu_model):
        if spread:
            key = _race(_walk_down(fleet, index, job, w, h), _scan(fleet, index, job, w, h, -1))
        else:
            key = _race(_walk(fleet, index, job, w, h), _scan(fleet, index, job, w, h, 1))
        if key is not None and (best is None or key < best):
            best = key
    if best is None:
        return fleet.unplaceable(job, w, h)
    slot = fleet.slot(best[1])
    box = slot.free.first_fit(w, h)
    assert box is not None  # the search checked it fits
    return Placement(job.job_id, slot.gpu_id, slot.node, Rect(box[0], box[1], w, h), name)


@dataclass(frozen=True, slots=True)
class BinPackPolicy:
    name: str = "binpack"

    def place(self, job: JobRequest, fleet: Fleet) -> Placement | Unplaceable:
        return _place(self.name, job, fleet, spread=False)


@dataclass(frozen=True, slots=True)
class SpreadPolicy:
    name: str = "spread"

    def place(self, job: JobRequest, fleet: Fleet) -> Placement | Unplaceable:
        return _place(self.name, job, fleet, spread=True)
