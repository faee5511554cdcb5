"""Shared by the placement tests: small constructors and a brute-force fit search."""

from __future__ import annotations

from itertools import pairwise

from gpuloom.policies.placement import (
    GRID_H,
    GRID_W,
    Fleet,
    GpuState,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
)

GIB = 1 << 30
STEPS = 100  # grid steps per quota percent


def gpu(gpu_id: str, model: str = "H100-80GB", memory_gib: float = 80, **kw) -> GpuState:
    node = kw.pop("node", f"node-{gpu_id}")
    return GpuState(gpu_id, node, model, int(memory_gib * GIB), 132, **kw)


def fleet_of(*gpus: GpuState, **options: int) -> Fleet:
    return Fleet.from_allocations(gpus, **options)


def job(
    job_id: str, sm: int, quota: float, memory_gib: float = 1, priority: int = 0, **kw
) -> JobRequest:
    return JobRequest(job_id, sm, quota, int(memory_gib * GIB), priority=priority, **kw)


def rect(quota_at: float, sm_at: int, quota: float, sm: int) -> Rect:
    """A rectangle in percent (quota offset, SM offset, quota, SM)."""
    return Rect(round(quota_at * STEPS), sm_at, round(quota * STEPS), sm)


def placed(decision: Placement | Unplaceable) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def fits_somewhere(taken: list[Rect], w: int, h: int) -> bool:
    """Whether a w x h rectangle fits beside `taken` anywhere. Any free position slides left
    and down until it meets an edge, so trying x in {0, right edges} and y in {0, top edges}
    is exhaustive."""
    xs = {0} | {r.x + r.w for r in taken}
    ys = {0} | {r.y + r.h for r in taken}
    for x in xs:
        for y in ys:
            if x + w <= GRID_W and y + h <= GRID_H:
                candidate = Rect(x, y, w, h)
                if not any(candidate.overlaps(r) for r in taken):
                    return True
    return False


def fits_on_grid(taken: list[Rect], w: int, h: int, step_x: int, step_y: int) -> bool:
    """The same question by scanning every position of a coarse grid."""
    for x in range(0, GRID_W - w + 1, step_x):
        for y in range(0, GRID_H - h + 1, step_y):
            candidate = Rect(x, y, w, h)
            if not any(candidate.overlaps(r) for r in taken):
                return True
    return False


def union_area(boxes: list[tuple[int, int, int, int]]) -> int:
    """Area covered by possibly overlapping boxes (coordinate compression)."""
    xs = sorted({b[0] for b in boxes} | {b[2] for b in boxes})
    total = 0
    for x0, x1 in pairwise(xs):
        spans = sorted((b[1], b[3]) for b in boxes if b[0] <= x0 and x1 <= b[2])
        covered, top = 0, None
        for y0, y1 in spans:
            if top is None or y0 > top:
                covered += y1 - y0
                top = y1
            elif y1 > top:
                covered += y1 - top
                top = y1
        total += covered * (x1 - x0)
    return total
