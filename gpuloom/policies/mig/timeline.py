"""Timing of a MIG schedule given as instances in execution order and their total load.

A schedule for one batch is a sequence of *segments*: an instance (a placement) and the run
time of the tasks it executes back to back. A segment can start once every earlier instance
overlapping its slices is gone: that instance's tasks have finished and it has been destroyed;
then the segment's instance is created. When the only earlier instance on its slices is the
same placement, the instance is reused and nothing is reconfigured.

The GPU driver serialises instance creation and destruction (Section 2.1 of the FAR paper), so
all of them go through one reconfiguration queue, served in the order they become possible (the
time the slices were released), as Algorithm 1 of the paper does with its `reconfig_end`.

The state a schedule leaves (live instances and the reconfiguration queue's busy periods) is
the starting point of the next batch's schedule, which is how batches are concatenated.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.domain.mig_geometry import MigGeometry, Placement
from gpuloom.policies.mig.plan import Action


@dataclass(frozen=True)
class GpuState:
    """What earlier plans leave behind: live instances (with the time their last task ends),
    when each slice without a live instance became free (its last instance destroyed; empty
    tuple: all free from 0), and the busy periods of the reconfiguration queue."""

    live: tuple[tuple[Placement, float], ...] = ()
    slice_free_at: tuple[float, ...] = ()
    reconfig_busy: tuple[tuple[float, float], ...] = ()


EMPTY_GPU = GpuState()


@dataclass(frozen=True)
class ReconfigOp:
    action: Action
    placement: Placement
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """Times of one sequence of segments: when each starts its first task (NaN when it has
    no tasks), the reconfigurations, when each slice is last busy, and what is left."""

    start: tuple[float, ...]
    ops: tuple[ReconfigOp, ...]
    slice_end: tuple[float, ...]
    state: GpuState

    @property
    def makespan(self) -> float:
        return max(self.slice_end)


class _ReconfigQueue:
    """One reconfiguration at a time: each goes into the first idle gap long enough."""

    def __init__(self, busy: Sequence[tuple[float, float]]) -> None:
        self.busy = sorted(busy)

    def book(self, ready: float, duration: float) -> float:
        start = ready
        i = max(bisect_left(self.busy, (ready, -math.inf)) - 1, 0)
        for busy_start, busy_end in self.busy[i:]:
            if busy_end <= start:
                continue
            if busy_start >= start + duration:
                break
            start = busy_end
        insort(self.busy, (start, start + duration))
        return start


def simulate(
    placements: Sequence[Placement],
    loads: Sequence[float | None],
    gpu: MigGeometry,
    state: GpuState = EMPTY_GPU,
    release_s: float = 0.0,
) -> Timeline:
    """Time the segments `placements[i]` (in execution order) running `loads[i]` seconds of
    tasks; `None` marks a segment without tasks, which is skipped. No segment starts before
    `release_s`."""
    carried = len(state.live)
    owner_placement = [p for p, _ in state.live] + list(placements)
    count = len(owner_placement)
    end = [t for _, t in state.live] + [math.nan] * len(placements)
    start = [math.nan] * count

    # Who must go before each segment: the latest earlier owner of each of its slices.
    free_at = list(state.slice_free_at) or [0.0] * gpu.slice_count
    owner_of_slice = [-1] * gpu.slice_count
    for owner, (placement, _) in enumerate(state.live):
        for s in placement.slices:
            owner_of_slice[s] = owner
    reused_by = [-1] * count  # owner -> the next segment, which keeps the same instance
    destroyed_for: list[list[int]] = [[] for _ in range(count)]
    waiting_on = [0] * count
    ready_at_release: list[int] = []
    for i, placement in enumerate(placements):
        if loads[i] is None:
            continue
        seg = carried + i
        before = {owner_of_slice[s] for s in placement.slices}
        before.discard(-1)
        only = next(iter(before)) if len(before) == 1 else -1
        if only >= 0 and owner_placement[only] == placement:
            reused_by[only] = seg
        elif before:
            waiting_on[seg] = len(before)
            for owner in before:
                destroyed_for[owner].append(seg)
        else:
            ready_at_release.append(seg)
        for s in placement.slices:
            owner_of_slice[s] = seg

    queue = _ReconfigQueue(state.reconfig_busy)
    ops: list[ReconfigOp] = []
    # (ready key, destroy-before-create, owner): the queue serves what became possible first.
    pending: list[tuple[float, int, int]] = []
    not_before = [release_s] * count
    if state.slice_free_at:
        for i, placement in enumerate(placements):
            latest_free = max(free_at[s] for s in placement.slices)
            not_before[carried + i] = max(release_s, latest_free)
    create_key = list(not_before)
    destroyed_at = [math.nan] * count

    def finished(owner: int) -> None:
        chain = owner
        while True:
            if destroyed_for[chain]:
                heapq.heappush(pending, (end[chain], 0, chain))
            nxt = reused_by[chain]
            if nxt < 0:
                return
            start[nxt] = max(end[chain], release_s)
            end[nxt] = start[nxt] + loads[nxt - carried]
            chain = nxt

    for seg in ready_at_release:
        heapq.heappush(pending, (create_key[seg], 1, seg))
    for owner in range(carried):
        finished(owner)

    while pending:
        key, is_create, owner = heapq.heappop(pending)
        placement = owner_placement[owner]
        if is_create:
            duration = gpu.create_s(placement.size)
            begin = queue.book(max(key, not_before[owner]), duration)
            ops.append(ReconfigOp("create", placement, begin, begin + duration))
            start[owner] = begin + duration
            end[owner] = start[owner] + loads[owner - carried]
            finished(owner)
        else:
            duration = gpu.destroy_s(placement.size)
            begin = queue.book(key, duration)
            ops.append(ReconfigOp("destroy", placement, begin, begin + duration))
            destroyed_at[owner] = begin + duration
            for seg in destroyed_for[owner]:
                not_before[seg] = max(not_before[seg], begin + duration)
                create_key[seg] = max(create_key[seg], end[owner])
                waiting_on[seg] -= 1
                if waiting_on[seg] == 0:
                    heapq.heappush(pending, (create_key[seg], 1, seg))

    slice_end = [0.0] * gpu.slice_count
    live: dict[int, None] = {}
    for s, owner in enumerate(owner_of_slice):
        if owner < 0:
            continue
        slice_end[s] = end[owner]
        if destroyed_for[owner]:
            # Its last instance was destroyed for a neighbour: the slice is left empty.
            free_at[s] = destroyed_at[owner]
        else:
            live[owner] = None
    return Timeline(
        start=tuple(start[carried:]),
        ops=tuple(ops),
        slice_end=tuple(slice_end),
        state=GpuState(
            live=tuple((owner_placement[o], end[o]) for o in live),
            slice_free_at=tuple(free_at),
            reconfig_busy=tuple(queue.busy),
        ),
    )
