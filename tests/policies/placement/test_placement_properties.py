"""Properties every policy keeps over random arrivals, releases and schedulability changes:
no GPU is over-committed (memory, overlapping or out-of-bounds rectangles), a job is turned
away only when it fits nowhere (brute force), and the incremental free lists equal a rebuild
from the allocations."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import (
    GRID_AREA,
    GRID_H,
    POLICIES,
    Fleet,
    KernelProfiles,
    KernelTimes,
    Placement,
    Unplaceable,
    get_policy,
)
from gpuloom.policies.placement.maxrects import box_of

from .helpers import STEPS, fits_on_grid, fits_somewhere, gpu, job, union_area

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = ("A", "B")
TASKS = ("t0", "t1", "t2", "")


# Profiles with long and short gaps, so gap-aware's gap path and its fallback both run (the
# other policies are offered them too, and ignore them).
PROFILES = KernelProfiles(
    [
        KernelTimes("t0", (200_000.0, 50_000.0), (1_000_000.0, 30_000.0)),
        KernelTimes("t1", (400_000.0,), (150_000.0, 2_000_000.0)),
        KernelTimes("t2", (20_000.0, 900_000.0), (120_000.0,)),
    ]
)


@st.composite
def scenarios(draw: st.DrawFn, coarse: bool):
    gpus = [
        gpu(
            f"g{i}",
            draw(st.sampled_from(MODELS)),
            draw(st.sampled_from((16, 40, 80))),
        )
        for i in range(draw(st.integers(1, 4)))
    ]
    # Mostly small jobs, so GPUs fill up and fragment; now and then a large one.
    if coarse:
        steps = st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(1, 10))
        shape = st.tuples(steps.map(lambda s: 10 * s), steps.map(lambda s: 10.0 * s))
    else:
        sm = st.one_of(st.integers(1, 40), st.integers(1, 100))
        quota = st.one_of(
            st.integers(1, 40).map(float), st.floats(0.01, 40.0), st.floats(0.01, 100.0)
        )
        shape = st.tuples(sm, quota)
    arrival = st.tuples(
        st.just("arrive"),
        shape,
        st.one_of(st.integers(0, 6), st.integers(0, 6), st.integers(0, 90)),  # GiB
        st.sampled_from(("", "", "", *MODELS)),
        st.integers(0, 9),
        st.sampled_from(TASKS),
    )
    release = st.tuples(st.just("release"), st.integers(0, 1000))
    toggle = st.tuples(st.just("toggle"), st.integers(0, 3))
    ops = draw(
        st.lists(
            st.one_of(arrival, arrival, arrival, arrival, release, release, toggle),
            min_size=5,
            max_size=60,
        )
    )
    return gpus, ops


def check_nowhere(fleet: Fleet, decision: Unplaceable, job_, h: int, coarse: bool) -> None:
    w = job_.w
    for gpu_id in fleet.gpu_ids():
        slot = fleet.slot(gpu_id)
        if not slot.schedulable or slot.memory_free < job_.memory_bytes:
            continue
        if job_.gpu_model and slot.model != job_.gpu_model:
            continue
        taken = [a.rect for a in slot.allocations.values()]
        assert not fits_somewhere(taken, w, h), (decision.reason, gpu_id, taken)
        if coarse:
            assert not fits_on_grid(taken, w, h, 10 * STEPS, 1)


def eligible(fleet: Fleet, job_, h: int) -> list:
    """The GPUs that can take the job, by brute force over positions."""
    out = []
    for gpu_id in sorted(fleet.gpu_ids()):
        slot = fleet.slot(gpu_id)
        if not slot.schedulable or slot.memory_free < job_.memory_bytes:
            continue
        if job_.gpu_model and slot.model != job_.gpu_model:
            continue
        if fits_somewhere([a.rect for a in slot.allocations.values()], job_.w, h):
            out.append(slot)
    return out


def expected_gpu(policy_name: str, fleet: Fleet, job_) -> str | None:
    """What binpack, spread and time-share must choose; None for the others."""
    if policy_name == "binpack":
        slots = eligible(fleet, job_, job_.sm_percent)
        return min(slots, key=lambda s: (s.area_free, s.gpu_id)).gpu_id if slots else None
    if policy_name == "spread":
        slots = eligible(fleet, job_, job_.sm_percent)
        return min(slots, key=lambda s: (-s.area_free, s.gpu_id)).gpu_id if slots else None
    if policy_name == "time-share":
        slots = eligible(fleet, job_, GRID_H)
        return slots[0].gpu_id if slots else None
    return None


def expected_mra(fleet: Fleet, job_) -> tuple[str, int, int] | None:
    """MRA's best match: the least-area free rectangle that fits, over the eligible GPUs."""
    best = None
    for slot in eligible(fleet, job_, job_.sm_percent):
        for b in slot.free.boxes():
            if b[2] - b[0] >= job_.w and b[3] - b[1] >= job_.sm_percent:
                key = ((b[2] - b[0]) * (b[3] - b[1]), slot.gpu_id, b)
                best = key if best is None or key < best else best
    return None if best is None else (best[1], best[2][0], best[2][1])


def run_scenario(policy_name: str, scenario, coarse: bool) -> None:
    gpus, ops = scenario
    fleet = Fleet.from_allocations(gpus)
    policy = get_policy(policy_name)
    live: list[str] = []
    for n, op in enumerate(ops):
        if op[0] == "arrive":
            _, (sm, quota), gib, model, priority, task = op
            j = job(f"j{n}", sm, quota, gib, priority, gpu_model=model, task_key=task)
            want = expected_gpu(policy_name, fleet, j)
            want_mra = expected_mra(fleet, j) if policy_name == "mra" else None
            decision = fleet.place(j, policy, PROFILES)
            if want is not None:
                assert decision.gpu_id == want
            if want_mra is not None:
                assert (decision.gpu_id, decision.rect.x, decision.rect.y) == want_mra
            if isinstance(decision, Placement):
                live.append(j.job_id)
                slot = fleet.slot(decision.gpu_id)
                assert slot.schedulable and (not model or slot.model == model)
                assert decision.rect.w >= j.w and decision.rect.h >= sm
            else:
                h = GRID_H if policy_name == "time-share" else sm
                check_nowhere(fleet, decision, j, h, coarse)
        elif op[0] == "release" and live:
            assert fleet.release(live.pop(op[1] % len(live))) is not None
        elif op[0] == "toggle" and op[1] < len(gpus):
            gpu_id = gpus[op[1]].gpu_id
            fleet.set_schedulable(gpu_id, not fleet.slot(gpu_id).schedulable)
        fleet.verify()  # no overlap, inside the GPU, memory, exact maximal lists, indexes
    rebuilt = Fleet.from_allocations(fleet.snapshot())
    rebuilt.verify()
    for gpu_id in fleet.gpu_ids():
        mine, theirs = fleet.slot(gpu_id), rebuilt.slot(gpu_id)
        assert sorted(mine.free.maximal) == sorted(theirs.free.maximal)
        assert mine.area_free == theirs.area_free
        used = [box_of(a.rect) for a in mine.allocations.values()]
        assert union_area(used) == GRID_AREA - mine.area_free  # disjoint
        assert union_area(mine.free.boxes()) == mine.area_free  # the list covers the free area
        assert sum(a.memory_bytes for a in mine.allocations.values()) <= mine.memory_bytes


@pytest.mark.parametrize("policy", sorted(POLICIES))
@FAST
@given(scenario=scenarios(coarse=True))
def test_coarse_grid_sequences(policy: str, scenario) -> None:
    run_scenario(policy, scenario, coarse=True)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@FAST
@given(scenario=scenarios(coarse=False))
def test_any_shape_sequences(policy: str, scenario) -> None:
    run_scenario(policy, scenario, coarse=False)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [1, 2])
def test_long_random_runs_on_crowded_gpus(policy: str, seed: int) -> None:
    # Hypothesis keeps sequences short; this one fills three GPUs with a dozen or more small
    # jobs each, then churns, so the lists fragment and rebuild.
    rng = random.Random(seed)
    coarse = seed == 1
    gpus = [gpu("g0", "A", 80), gpu("g1", "A", 40), gpu("g2", "B", 80)]
    ops: list[tuple] = []
    for n in range(300):
        if rng.random() < (0.8 if n < 60 else 0.5):
            if coarse:
                shape = (10 * rng.randint(1, 4), 10.0 * rng.randint(1, 4))
            else:
                shape = (rng.randint(1, 35), round(rng.uniform(0.01, 35.0), 2))
            model = rng.choice(("", "", "", "A", "B"))
            task = rng.choice(TASKS)
            ops.append(("arrive", shape, rng.randint(0, 5), model, rng.randint(0, 9), task))
        elif rng.random() < 0.97:
            ops.append(("release", rng.randrange(1000)))
        else:
            ops.append(("toggle", rng.randrange(3)))
    run_scenario(policy, (gpus, ops), coarse)
