"""Shared by the placement tests: small constructors and a brute-force fit search."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from gpuloom.domain.shares import share_of
from gpuloom.policies.placement import (
    GRID_H,
    GRID_W,
    Allocation,
    Fleet,
    GpuState,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
)
from gpuloom.policies.placement.scheduler import Ask, Scheduler

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
    share = share_of(sm, quota, memory_bytes=int(memory_gib * GIB), priority=priority)
    return JobRequest(job_id, share, **kw)


def allocation_of(
    allocation_id: str, sm: int, quota: float, memory_bytes: int = 0, priority: int = 0, *a, **kw
) -> Allocation:
    """An allocation of `sm` % SM x `quota` % quota and `memory_bytes` (the rest: Allocation's
    fields after its share)."""
    share = share_of(sm, quota, memory_bytes=memory_bytes, priority=priority)
    return Allocation(allocation_id, share, *a, **kw)


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


# ---- the scheduler's property tests: a random run of events ----


def scheduler_events(submit: SearchStrategy[tuple], gpus: int, max_size: int) -> SearchStrategy:
    """Lists of `submit` events, and ends, failed bindings and decides (skipping the oldest
    waiting job or not) picked by an index, and heartbeats of one of GPUs g0..g<gpus-1>."""
    return st.lists(
        st.one_of(
            submit,
            st.tuples(st.just("end"), st.integers(0, 10_000)),
            st.tuples(st.just("bind_failed"), st.integers(0, 10_000)),
            st.tuples(st.just("heartbeat"), st.integers(0, gpus - 1)),
            st.tuples(st.just("decide"), st.booleans()),
        ),
        min_size=10,
        max_size=max_size,
    )


class SchedulerRun:
    """A scheduler over `fleet` driven through a run of events, and the jobs submitted."""

    def __init__(self, scheduler: Scheduler, fleet: Fleet) -> None:
        self.scheduler = scheduler
        self.fleet = fleet
        self.asks: dict[str, Ask] = {}

    def submit(self, a: Ask) -> None:
        self.asks[a.job_id] = a
        self.scheduler.submit(a)

    def end(self, pick: int) -> None:
        """End the job `pick` chooses among those submitted, and forget it."""
        job_id = sorted(self.asks)[pick % len(self.asks)]
        self.scheduler.end(job_id)
        del self.asks[job_id]

    def holding(self, pick: int) -> str | None:
        """The job `pick` chooses among those submitted that hold a GPU; None when none does."""
        fleet = self.fleet
        holding = sorted(job_id for job_id in self.asks if fleet.gpu_of(job_id) is not None)
        return holding[pick % len(holding)] if holding else None

    def heartbeat(self, index: int) -> None:
        """GPU g<index> heard from: schedulable again, and the scheduler told."""
        gpu_id = f"g{index}"
        self.fleet.set_schedulable(gpu_id, True)
        self.scheduler.capacity_changed(gpu_id)

    def decide(self, skip_oldest: bool) -> list[Ask]:
        """Decide, skipping the oldest submitted job if `skip_oldest`; the jobs still waiting
        but the skipped one (none of them should fit now)."""
        skip = {min(self.asks)} if skip_oldest and self.asks else set()
        self.scheduler.decide(skip)
        waiting = self.asks.items()
        return [a for job_id, a in waiting if job_id in self.scheduler and job_id not in skip]
