import pytest

from gpuloom.domain.mig_geometry import A30, A100
from gpuloom.policies.mig import (
    PLANNERS,
    PlanningError,
    UnknownPolicyError,
    area_lower_bound,
    get_planner,
    verify_plan,
)
from gpuloom.policies.mig.fixpart import FixPartPlanner, fixed_partition_plan, layout
from gpuloom.policies.mig.fixpart_best import FixPartBestPlanner
from gpuloom.policies.mig.miso import MisoPlanner

from .helpers import rodinia, task

INF = float("inf")


def labels(placements) -> list[str]:
    return [p.label for p in placements]


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ((4, 2, 1), ["4g@0", "2g@4", "1g@6"]),
        ((1, 1, 2, 3), ["1g@0", "1g@1", "2g@2", "3g@4"]),
        ((3, 3), ["3g@0", "3g@4"]),
        ((2, 1, 4), ["4g@0", "2g@4", "1g@6"]),  # sizes in another order: any valid layout
        ((4,), ["4g@0"]),  # part of a partition: the rest of the GPU stays unused
    ],
)
def test_partition_sizes_map_to_legal_instances(sizes, expected) -> None:
    assert labels(layout(sizes, A100)) == expected


@pytest.mark.parametrize(("sizes", "gpu"), [((4, 4), A100), ((3,), A30), ((2, 2, 2, 2), A100)])
def test_impossible_partitions_are_refused(sizes, gpu) -> None:
    with pytest.raises(ValueError, match="no valid"):
        layout(sizes, gpu)


def test_fixpart_runs_fifo_on_the_first_free_instance() -> None:
    tasks = [
        task("a", A30, 9, 3, 9),
        task("b", A30, 9, 1, 9),
        task("c", A30, 9, 1, 9),
        task("d", A30, 9, 1, 9),
    ]
    plan = FixPartPlanner((2, 2)).plan(tasks, A30)
    verify_plan(plan, tasks, A30)
    placed = {a.task: (a.first_slice, a.start_s, a.end_s) for a in plan.assignments}
    assert placed == {"a": (0, 0, 3), "b": (2, 0, 1), "c": (2, 1, 2), "d": (2, 2, 3)}
    assert plan.reconfigurations == ()
    assert labels(plan.initial_instances) == ["2g@0", "2g@2"]


def test_fixpart_skips_instances_a_task_cannot_use_and_fails_when_none_fits() -> None:
    tasks = [task("big", A30, INF, INF, 2), task("small", A30, 1, INF, 5)]
    plan = FixPartPlanner((4,)).plan(tasks, A30)
    verify_plan(plan, tasks, A30)
    with pytest.raises(PlanningError, match="cannot run on any instance of partition 2,2"):
        FixPartPlanner((2, 2)).plan(tasks, A30)


def test_fixpart_best_is_the_best_fixed_partition() -> None:
    tasks = rodinia(A100)
    best = FixPartBestPlanner().plan(tasks, A100)
    verify_plan(best, tasks, A100)
    every = [fixed_partition_plan(tasks, A100, p, "x").makespan_s for p in A100.partitions]
    assert best.makespan_s == min(every)


def test_miso_picks_the_partition_with_the_largest_sum_of_speedups() -> None:
    # Speedups 1, 2.5, 3.3 on 1, 2, 4 slices: two 2g instances (5.0) beat one 4g (3.3) and
    # 2g + 1g + 1g (2.5 + 1 with two tasks).
    tasks = [task("a", A30, 10, 4, 3), task("b", A30, 10, 4, 3)]
    plan = MisoPlanner().plan(tasks, A30)
    verify_plan(plan, tasks, A30)
    assert sorted((a.size, a.first_slice) for a in plan.assignments) == [(2, 0), (2, 2)]
    assert plan.makespan_s == pytest.approx(2 * A30.create_s(2) + 4)


def test_miso_waits_for_a_whole_round_before_the_next_partition() -> None:
    tasks = [task("long", A30, 10, 5.5, 3)] + [task(f"s{i}", A30, 1, 0.9, 0.8) for i in range(4)]
    plan = MisoPlanner().plan(tasks, A30)
    verify_plan(plan, tasks, A30)
    first_round = [a for a in plan.assignments if a.task_index < 4]
    last = next(a for a in plan.assignments if a.task_index == 4)
    assert {a.size for a in first_round} == {1}
    assert last.start_s >= max(a.end_s for a in first_round)


def test_miso_takes_fewer_tasks_when_the_next_ones_fit_no_instance_left() -> None:
    tasks = [task("one", A100, 1, INF, INF, INF, INF), task("seven", A100, INF, INF, INF, INF, 1)]
    plan = MisoPlanner().plan(tasks, A100)
    verify_plan(plan, tasks, A100)


def test_area_lower_bound_spreads_least_work_over_all_slices() -> None:
    tasks = [task("a", A30, 4, 2.5, 1), task("b", A30, 1, 1, 1)]  # least work 4 and 1
    assert area_lower_bound(tasks, A30) == pytest.approx((4 + 1) / 4)


def test_registry_names() -> None:
    assert set(PLANNERS) == {"far", "far-paper", "fixpart", "fixpart-best", "miso"}
    assert get_planner("far").name == "far"
    assert get_planner("far-paper").name == "far-paper"
    assert get_planner("fixpart:4,2,1").name == "fixpart:4,2,1"
    assert get_planner("miso").name == "miso"
    assert get_planner(" fixpart-best ").name == "fixpart-best"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sjf", "unknown MIG policy"),
        ("fixpart", "needs instance sizes"),
        ("fixpart:4,x", "separated by commas"),
        ("fixpart:0", "positive"),
        ("far:fast", "takes no"),
    ],
)
def test_bad_policy_names_are_refused(spec: str, message: str) -> None:
    with pytest.raises(UnknownPolicyError, match=message):
        get_planner(spec)


@pytest.mark.parametrize("policy", ["far", "far-paper", "fixpart-best", "miso", "fixpart:1,1,1,1"])
def test_rodinia_a30_plans_are_valid(policy: str) -> None:
    tasks = rodinia(A30)
    plan = get_planner(policy).plan(tasks, A30)
    verify_plan(plan, tasks, A30)
    assert plan.makespan_s >= area_lower_bound(tasks, A30)
