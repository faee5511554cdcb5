"""FixPart: one partition set up before the batch and never changed; tasks in input (FIFO)
order each take the instance that frees up first among those they can run on."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.domain.mig_geometry import MigGeometry, Placement
from gpuloom.policies.mig.plan import Assignment, MigTask, Plan, PlanningError, validate_tasks


def parse_sizes(text: str) -> tuple[int, ...]:
    """ "4,2,1" -> (4, 2, 1)."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"partition {text!r} must be instance sizes separated by commas") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise ValueError(f"partition {text!r} must list positive instance sizes")
    return sizes


def layout(sizes: Sequence[int], gpu: MigGeometry) -> tuple[Placement, ...]:
    """Legal, disjoint instances with these sizes: a valid partition (or part of one) whose
    instances, in slice order, come in the order given, else in any order."""
    wanted = Counter(sizes)
    fallback: tuple[Placement, ...] | None = None
    for partition in gpu.partitions:
        chosen: list[Placement] = []
        left = Counter(wanted)
        for placement in partition:
            if left[placement.size] > 0:
                left[placement.size] -= 1
                chosen.append(placement)
        if +left:
            continue
        if [p.size for p in chosen] == list(sizes):
            return tuple(chosen)
        fallback = fallback or tuple(chosen)
    if fallback is None:
        listed = ",".join(map(str, sizes))
        raise PlanningError(f"no valid {gpu.name} partition has instances of sizes {listed}")
    return fallback


def fixed_partition_plan(
    tasks: Sequence[MigTask], gpu: MigGeometry, instances: Sequence[Placement], policy: str
) -> Plan:
    validate_tasks(tasks, gpu)
    free_at = [0.0] * len(instances)
    assignments = []
    for index, task in enumerate(tasks):
        usable = [p for p, inst in enumerate(instances) if math.isfinite(task.time(inst.size))]
        if not usable:
            sizes = ",".join(str(p.size) for p in instances)
            raise PlanningError(
                f"task {index} ({task.name}) cannot run on any instance of partition {sizes}"
            )
        position = min(usable, key=lambda p: (free_at[p], p))
        placement = instances[position]
        start = free_at[position]
        free_at[position] = start + task.time(placement.size)
        assignments.append(
            Assignment(
                index, task.name, placement.size, placement.first_slice, start, free_at[position]
            )
        )
    return Plan(
        gpu=gpu.name,
        policy=policy,
        assignments=tuple(assignments),
        reconfigurations=(),
        initial_instances=tuple(instances),
    )


@dataclass(frozen=True)
class FixPartPlanner:
    """FixPart(partition): e.g. sizes (4, 2, 1) is 4g@0, 2g@4 and 1g@6 on an A100."""

    sizes: tuple[int, ...]

    @property
    def name(self) -> str:
        return "fixpart:" + ",".join(map(str, self.sizes))

    def plan(self, tasks: Sequence[MigTask], gpu: MigGeometry) -> Plan:
        return fixed_partition_plan(tasks, gpu, layout(self.sizes, gpu), self.name)
