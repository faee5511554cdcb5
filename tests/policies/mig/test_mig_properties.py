"""Properties every planner must keep on any task set."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig import (
    InvalidPlanError,
    PlanningError,
    area_lower_bound,
    get_planner,
    verify_plan,
)
from gpuloom.policies.mig.far import plan_batches

from .helpers import gpus, task_sets

POLICIES = ["far", "far-paper", "fixpart-best", "miso"]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def gpu_and_tasks(draw: st.DrawFn, max_tasks: int = 12) -> tuple[MigGeometry, list]:
    gpu = draw(gpus)
    return gpu, draw(task_sets(gpu, max_tasks))


@pytest.mark.parametrize("policy", POLICIES)
@FAST
@given(case=gpu_and_tasks())
def test_every_plan_is_valid_and_above_the_lower_bound(policy: str, case) -> None:
    gpu, tasks = case
    try:
        plan = get_planner(policy).plan(tasks, gpu)
    except PlanningError:
        # Only a fixed partition may fail, and only when every partition lacks an instance
        # size some task can run on.
        assert policy == "fixpart-best"
        assert all(
            any(all(math.isinf(t.time(p.size)) for p in partition) for t in tasks)
            for partition in gpu.partitions
        )
        return
    verify_plan(plan, tasks, gpu)
    assert plan.makespan_s >= area_lower_bound(tasks, gpu) * (1 - 1e-9)


@settings(max_examples=15, deadline=None)
@given(case=gpu_and_tasks(max_tasks=60))
def test_far_plans_larger_batches_validly(case) -> None:
    gpu, tasks = case
    for policy in ("far", "far-paper"):
        plan = get_planner(policy).plan(tasks, gpu)
        verify_plan(plan, tasks, gpu)
        assert plan.makespan_s >= area_lower_bound(tasks, gpu) * (1 - 1e-9)


@FAST
@given(gpu=gpus, data=st.data())
def test_concatenated_batches_are_valid(gpu: MigGeometry, data: st.DataObject) -> None:
    batches = [data.draw(task_sets(gpu, 8)) for _ in range(data.draw(st.integers(1, 4)))]
    flat = [t for batch in batches for t in batch]
    for mode in ("trivial", "reverse", "reverse+refine"):
        verify_plan(plan_batches(batches, gpu, mode=mode), flat, gpu)


@FAST
@given(case=gpu_and_tasks(), data=st.data())
def test_verify_catches_a_task_moved_onto_a_busy_slice(case, data: st.DataObject) -> None:
    gpu, tasks = case
    plan = get_planner("far").plan(tasks, gpu)
    if len(plan.assignments) < 2:
        return
    assignments = list(plan.assignments)
    i, j = data.draw(
        st.lists(st.integers(0, len(assignments) - 1), min_size=2, max_size=2, unique=True)
    )
    moved, target = assignments[i], assignments[j]
    # Run task i on task j's instance, starting when task j starts: they collide.
    assignments[i] = dataclasses.replace(
        moved,
        size=target.size,
        first_slice=target.first_slice,
        start_s=target.start_s,
        end_s=target.start_s + tasks[moved.task_index].time(target.size),
    )
    broken = dataclasses.replace(plan, assignments=tuple(assignments))
    with pytest.raises(InvalidPlanError):
        verify_plan(broken, tasks, gpu)
