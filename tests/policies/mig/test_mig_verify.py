"""verify_plan must reject every way a plan can break the MIG rules."""

import dataclasses

import pytest

from gpuloom.domain.mig_geometry import A30, A100, MigGeometry
from gpuloom.policies.mig import (
    Assignment,
    InvalidPlanError,
    MigTask,
    Plan,
    Reconfiguration,
    verify_plan,
)

from .helpers import task

TASKS = [task("a", A30, 4.0, 2.0, 1.0), task("b", A30, 3.0, 2.0, 1.5)]


def valid_plan() -> Plan:
    """4g@0 runs a, is destroyed, then 1g@0 runs b."""
    return Plan(
        gpu="A30",
        policy="hand",
        assignments=(
            Assignment(0, "a", 4, 0, 0.13, 1.13),
            Assignment(1, "b", 1, 0, 1.34, 4.34),
        ),
        reconfigurations=(
            Reconfiguration("create", 4, 0, 0.0, 0.13),
            Reconfiguration("destroy", 4, 0, 1.13, 1.23),
            Reconfiguration("create", 1, 0, 1.23, 1.34),
        ),
    )


def with_assignment(plan: Plan, index: int, **changes: object) -> Plan:
    assignments = list(plan.assignments)
    assignments[index] = dataclasses.replace(assignments[index], **changes)
    return dataclasses.replace(plan, assignments=tuple(assignments))


def with_reconfigurations(plan: Plan, *reconfigurations: Reconfiguration) -> Plan:
    return dataclasses.replace(plan, reconfigurations=reconfigurations)


def test_a_valid_plan_passes() -> None:
    verify_plan(valid_plan(), TASKS, A30)


def test_initial_instances_exist_from_time_zero() -> None:
    plan = Plan(
        gpu="A30",
        policy="hand",
        assignments=(Assignment(0, "a", 2, 0, 0.0, 2.0), Assignment(1, "b", 2, 2, 0.0, 2.0)),
        reconfigurations=(),
        initial_instances=(A30.placement(2, 0), A30.placement(2, 2)),
    )
    verify_plan(plan, TASKS, A30)
    with pytest.raises(InvalidPlanError, match="does not exist"):
        verify_plan(dataclasses.replace(plan, initial_instances=()), TASKS, A30)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (dataclasses.replace(valid_plan(), assignments=valid_plan().assignments[:1]), "never"),
        (
            dataclasses.replace(
                valid_plan(), assignments=(*valid_plan().assignments, valid_plan().assignments[0])
            ),
            "twice",
        ),
        (with_assignment(valid_plan(), 0, task="b"), "plan says"),
        (with_assignment(valid_plan(), 1, task_index=7), "unknown task"),
        (with_assignment(valid_plan(), 1, size=2, first_slice=1), "illegal instance"),
        (with_assignment(valid_plan(), 0, end_s=1.0), "expected a run of 1.0"),
        (with_assignment(valid_plan(), 1, start_s=1.30, end_s=4.30), "does not exist"),
        (with_assignment(valid_plan(), 0, start_s=0.1, end_s=1.1), "does not exist"),
    ],
)
def test_broken_assignments_are_rejected(plan: Plan, message: str) -> None:
    with pytest.raises(InvalidPlanError, match=message):
        verify_plan(plan, TASKS, A30)


def test_a_task_cannot_run_where_its_time_is_inf() -> None:
    tasks = [task("a", A30, 4.0, 2.0, float("inf")), TASKS[1]]
    with pytest.raises(InvalidPlanError, match="cannot run on a 4-slice instance"):
        verify_plan(valid_plan(), tasks, A30)


R = Reconfiguration


@pytest.mark.parametrize(
    ("reconfigurations", "message"),
    [
        pytest.param(
            (R("create", 4, 0, 0.0, 0.13), R("destroy", 4, 0, 1.13, 1.23),
             R("create", 1, 0, 1.20, 1.31)),
            "one at a time",
            id="they-run-one-at-a-time",
        ),
        pytest.param(
            (R("create", 4, 0, 0.0, 0.10), R("destroy", 4, 0, 1.13, 1.23),
             R("create", 1, 0, 1.23, 1.34)),
            r"expected 0\.13 s",
            id="each-takes-its-table-time",
        ),
        pytest.param(
            (R("create", 4, 0, 0.0, 0.13), R("create", 1, 0, 1.13, 1.24),
             R("destroy", 4, 0, 1.24, 1.34)),
            "overlaps 4g@0",
            id="instances-that-coexist-never-overlap",
        ),
        pytest.param(
            (R("create", 4, 0, 0.0, 0.13), R("destroy", 2, 0, 1.13, 1.23)),
            r"destroy 2g@0 .* does not exist",
            id="only-existing-instances-are-destroyed",
        ),
        pytest.param(
            (*valid_plan().reconfigurations, R("destroy", 1, 0, 2.0, 2.1)),
            "does not exist",
            id="a-task-may-not-outlive-its-instance",  # b still runs on 1g@0
        ),
    ],
)  # fmt: skip
def test_broken_reconfigurations_are_rejected(
    reconfigurations: tuple[Reconfiguration, ...], message: str
) -> None:
    plan = with_reconfigurations(valid_plan(), *reconfigurations)
    with pytest.raises(InvalidPlanError, match=message):
        verify_plan(plan, TASKS, A30)


@pytest.mark.parametrize(
    ("plan", "tasks", "geometry", "message"),
    [
        pytest.param(
            Plan(
                gpu="A30",
                policy="hand",
                assignments=(
                    Assignment(0, "a", 4, 0, 0.0, 1.0),
                    Assignment(1, "b", 4, 0, 0.5, 2.0),
                ),
                reconfigurations=(),
                initial_instances=(A30.placement(4, 0),),
            ),
            TASKS,
            A30,
            "run at the same time",
            id="two-tasks-never-share-a-slice",
        ),
        pytest.param(
            Plan(
                gpu="A100",
                policy="hand",
                assignments=(),
                reconfigurations=(),
                initial_instances=(A100.placement(7, 0), A100.placement(3, 0)),
            ),
            [],
            A100,
            "overlaps 7g@0",
            id="initial-instances-may-not-overlap",
        ),
    ],
)
def test_plans_that_overlap_on_a_slice_are_rejected(
    plan: Plan, tasks: list[MigTask], geometry: MigGeometry, message: str
) -> None:
    with pytest.raises(InvalidPlanError, match=message):
        verify_plan(plan, tasks, geometry)
