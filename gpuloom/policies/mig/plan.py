"""Tasks in, plans out: the data every MIG planner shares, and the checker of plans."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gpuloom.domain.mig_geometry import MigGeometry, Placement

Action = Literal["create", "destroy"]


class InvalidTaskError(ValueError):
    """A task cannot be planned: bad times, or no instance size it can run on."""


class PlanningError(ValueError):
    """The policy cannot place these tasks (e.g. a task runs on no instance of a partition)."""


class InvalidPlanError(ValueError):
    """A plan breaks a MIG rule; the message says which and where."""


@dataclass(frozen=True)
class MigTask:
    """A task with its measured run time on an instance of each size (math.inf: cannot run)."""

    name: str
    times: Mapping[int, float] = field(hash=False)

    def time(self, size: int) -> float:
        return self.times.get(size, math.inf)


@dataclass(frozen=True)
class Assignment:
    """Task number `task_index` of the input runs on one instance from start_s to end_s."""

    task_index: int
    task: str
    size: int
    first_slice: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Reconfiguration:
    action: Action
    size: int
    first_slice: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Plan:
    """A schedule for one GPU. Instances in `initial_instances` exist before time 0 (a fixed
    partition set up beforehand); every other instance is created by a reconfiguration."""

    gpu: str
    policy: str
    assignments: tuple[Assignment, ...]
    reconfigurations: tuple[Reconfiguration, ...]
    initial_instances: tuple[Placement, ...] = ()
    stats: Mapping[str, float] = field(default_factory=dict)

    @property
    def makespan_s(self) -> float:
        return max((a.end_s for a in self.assignments), default=0.0)


class MigPlanner(Protocol):
    """A MIG planning policy: a batch of tasks and a GPU in, a plan out."""

    name: str

    def plan(self, tasks: Sequence[MigTask], gpu: MigGeometry) -> Plan: ...


def validate_tasks(tasks: Sequence[MigTask], gpu: MigGeometry) -> None:
    """Raise InvalidTaskError naming the first task a planner could not use."""
    if not tasks:
        raise InvalidTaskError("no tasks to plan")
    for index, task in enumerate(tasks):
        unknown = sorted(set(task.times) - set(gpu.sizes))
        if unknown:
            raise InvalidTaskError(
                f"task {index} ({task.name}): {gpu.name} has no instance size {unknown[0]}"
            )
        for size, seconds in task.times.items():
            if math.isnan(seconds) or seconds <= 0:
                raise InvalidTaskError(
                    f"task {index} ({task.name}): time on size {size} must be a positive "
                    f"number of seconds or inf, got {seconds}"
                )
        if all(math.isinf(task.time(size)) for size in gpu.sizes):
            raise InvalidTaskError(f"task {index} ({task.name}) cannot run on any instance size")


def verify_plan(plan: Plan, tasks: Sequence[MigTask], gpu: MigGeometry) -> None:
    """Check a plan against the MIG rules; raise InvalidPlanError on the first violation.

    Every task runs exactly once, for its own time, on a legal instance that exists (created
    and not yet being destroyed) for the whole run; no two tasks share a slice at once;
    reconfigurations take their Table-1 time and run one at a time; instances that coexist
    never overlap.
    """
    horizon = max(plan.makespan_s, max((r.end_s for r in plan.reconfigurations), default=0.0), 1.0)
    eps = 1e-9 * horizon

    _check_assignments(plan, tasks, gpu, eps)
    lifetimes = _instance_lifetimes(plan, gpu, eps)
    for a in plan.assignments:
        placement = gpu.placement(a.size, a.first_slice)
        if not any(
            ready - eps <= a.start_s and a.end_s <= gone + eps
            for ready, gone in lifetimes.get(placement, [])
        ):
            raise InvalidPlanError(
                f"task {a.task_index} ({a.task}) runs on {placement.label} during "
                f"[{a.start_s:.6f}, {a.end_s:.6f}] s, when that instance does not exist"
            )
    _check_slices_used_once(plan, gpu, eps)


def _check_assignments(plan: Plan, tasks: Sequence[MigTask], gpu: MigGeometry, eps: float) -> None:
    seen: set[int] = set()
    for a in plan.assignments:
        if not 0 <= a.task_index < len(tasks):
            raise InvalidPlanError(f"assignment for unknown task number {a.task_index}")
        if a.task_index in seen:
            raise InvalidPlanError(f"task {a.task_index} ({a.task}) is planned twice")
        seen.add(a.task_index)
        task = tasks[a.task_index]
        if a.task != task.name:
            raise InvalidPlanError(f"task {a.task_index} is {task.name!r}, plan says {a.task!r}")
        if not gpu.is_legal(a.size, a.first_slice):
            raise InvalidPlanError(
                f"task {a.task_index} ({a.task}) on an illegal instance: "
                f"{a.size} slices at slice {a.first_slice}"
            )
        expected = task.time(a.size)
        if math.isinf(expected):
            raise InvalidPlanError(
                f"task {a.task_index} ({a.task}) cannot run on a {a.size}-slice instance"
            )
        if a.start_s < -eps or abs((a.end_s - a.start_s) - expected) > eps:
            raise InvalidPlanError(
                f"task {a.task_index} ({a.task}) runs [{a.start_s}, {a.end_s}] s, "
                f"expected a run of {expected} s from a time >= 0"
            )
    missing = sorted(set(range(len(tasks))) - seen)
    if missing:
        raise InvalidPlanError(f"task {missing[0]} ({tasks[missing[0]].name}) is never planned")


def _instance_lifetimes(
    plan: Plan, gpu: MigGeometry, eps: float
) -> dict[Placement, list[tuple[float, float]]]:
    """Replay the reconfigurations; return, per instance, the intervals it can run tasks."""
    live: dict[Placement, float] = {}
    for placement in plan.initial_instances:
        if not gpu.is_legal(placement.size, placement.first_slice):
            raise InvalidPlanError(f"initial instance {placement.label} is not legal")
        _claim(live, gpu.placement(placement.size, placement.first_slice), 0.0, "initial")

    lifetimes: dict[Placement, list[tuple[float, float]]] = defaultdict(list)
    previous_end = -math.inf
    previous: Reconfiguration | None = None
    for r in sorted(plan.reconfigurations, key=lambda r: (r.start_s, r.end_s)):
        if not gpu.is_legal(r.size, r.first_slice):
            raise InvalidPlanError(f"{r.action} of an illegal instance {r.size}g@{r.first_slice}")
        placement = gpu.placement(r.size, r.first_slice)
        expected = gpu.create_s(r.size) if r.action == "create" else gpu.destroy_s(r.size)
        if r.start_s < -eps or abs((r.end_s - r.start_s) - expected) > eps:
            raise InvalidPlanError(
                f"{r.action} {placement.label} takes [{r.start_s}, {r.end_s}] s, "
                f"expected {expected} s from a time >= 0"
            )
        if r.start_s < previous_end - eps:
            raise InvalidPlanError(
                f"{r.action} {placement.label} at {r.start_s:.6f} s overlaps "
                f"{previous.action if previous else ''} ending at {previous_end:.6f} s: "
                "reconfigurations run one at a time"
            )
        previous_end, previous = r.end_s, r
        if r.action == "create":
            _claim(live, placement, r.end_s, f"create at {r.start_s:.6f} s")
        else:
            if placement not in live:
                raise InvalidPlanError(
                    f"destroy {placement.label} at {r.start_s:.6f} s: it does not exist"
                )
            ready = live.pop(placement)
            if ready > r.start_s + eps:
                raise InvalidPlanError(
                    f"destroy {placement.label} at {r.start_s:.6f} s before its creation ended"
                )
            lifetimes[placement].append((ready, r.start_s))
    for placement, ready in live.items():
        lifetimes[placement].append((ready, math.inf))
    return lifetimes


def _claim(live: dict[Placement, float], placement: Placement, ready: float, when: str) -> None:
    clash = next((other for other in live if other.overlaps(placement)), None)
    if clash is not None:
        raise InvalidPlanError(
            f"{when}: {placement.label} overlaps {clash.label}, which still exists"
        )
    live[placement] = ready


def _check_slices_used_once(plan: Plan, gpu: MigGeometry, eps: float) -> None:
    per_slice: dict[int, list[Assignment]] = defaultdict(list)
    for a in plan.assignments:
        for slice_ in gpu.placement(a.size, a.first_slice).slices:
            per_slice[slice_].append(a)
    for slice_, runs in per_slice.items():
        runs.sort(key=lambda a: a.start_s)
        for before, after in itertools.pairwise(runs):
            if after.start_s < before.end_s - eps:
                raise InvalidPlanError(
                    f"slice {slice_}: task {before.task_index} ({before.task}) and task "
                    f"{after.task_index} ({after.task}) run at the same time"
                )
