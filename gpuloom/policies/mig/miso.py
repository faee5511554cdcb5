"""MISO-like: the optimiser of MISO (Li et al., SoCC 2022) as the FAR paper evaluates it.

Tasks go in FIFO order, one partition at a time: the next partition is the valid one whose
instances, given the next tasks in line, reach the largest sum of speedups (speedup: time on
the task's smallest usable size over time on the instance). Each round runs until its last
task ends; then instances not kept are destroyed and the new ones created, one at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.domain.mig_geometry import MigGeometry, Placement
from gpuloom.policies.mig.plan import (
    Action,
    Assignment,
    MigTask,
    Plan,
    PlanningError,
    Reconfiguration,
    validate_tasks,
)


def speedup(task: MigTask, size: int, gpu: MigGeometry) -> float:
    base = next(task.time(s) for s in gpu.sizes if math.isfinite(task.time(s)))
    return base / task.time(size)


def best_assignment(
    tasks: Sequence[MigTask], instances: Sequence[Placement], gpu: MigGeometry
) -> tuple[float, list[int]]:
    """Give each task a distinct instance maximising the sum of speedups; instances of one
    size are interchangeable, so search over how many of each size remain. Returns the sum
    and each task's instance position (-inf and [] when some task fits nowhere)."""
    sizes = sorted({p.size for p in instances})
    capacity = tuple(sum(p.size == s for p in instances) for s in sizes)
    gains = [
        [speedup(task, s, gpu) if math.isfinite(task.time(s)) else None for s in sizes]
        for task in tasks
    ]
    # best[state] = (sum, choices) after placing a prefix of tasks, state = sizes left.
    best: dict[tuple[int, ...], tuple[float, list[int]]] = {capacity: (0.0, [])}
    for gain in gains:
        after: dict[tuple[int, ...], tuple[float, list[int]]] = {}
        for left, (total, choices) in best.items():
            for j, room in enumerate(left):
                step = gain[j]
                if room == 0 or step is None:
                    continue
                state = (*left[:j], room - 1, *left[j + 1 :])
                candidate = (total + step, [*choices, j])
                if state not in after or candidate[0] > after[state][0]:
                    after[state] = candidate
        best = after
    if not best:
        return -math.inf, []
    total, choices = max(best.values(), key=lambda item: item[0])
    free = {s: [i for i, p in enumerate(instances) if p.size == s] for s in sizes}
    return total, [free[sizes[j]].pop(0) for j in choices]


@dataclass(frozen=True)
class MisoPlanner:
    name: str = "miso"

    def plan(self, tasks: Sequence[MigTask], gpu: MigGeometry) -> Plan:
        validate_tasks(tasks, gpu)
        assignments: list[Assignment] = []
        reconfigurations: list[Reconfiguration] = []
        live: set[Placement] = set()
        clock = 0.0
        position = 0
        while position < len(tasks):
            chosen: tuple[float, tuple[Placement, ...], list[int]] | None = None
            for partition in gpu.partitions:
                # The next tasks in line, as many as the partition has instances; fewer when
                # one of them cannot run on what is left.
                for count in range(min(len(partition), len(tasks) - position), 0, -1):
                    batch = tasks[position : position + count]
                    total, slots = best_assignment(batch, partition, gpu)
                    if slots:
                        if chosen is None or total > chosen[0]:
                            chosen = (total, partition, slots)
                        break
            if chosen is None:
                raise PlanningError(
                    f"task {position} ({tasks[position].name}) fits no instance of any partition"
                )
            _, partition, slots = chosen
            used = [partition[slot] for slot in slots]
            round_start = clock
            ready: dict[Placement, float] = {}
            for old in sorted(live - set(used), key=lambda p: p.first_slice):
                reconfigurations.append(self._op("destroy", old, clock, gpu))
                clock = reconfigurations[-1].end_s
            for new in sorted(set(used) - live, key=lambda p: p.first_slice):
                reconfigurations.append(self._op("create", new, clock, gpu))
                clock = ready[new] = reconfigurations[-1].end_s
            round_end = clock
            for offset, placement in enumerate(used):
                task = tasks[position + offset]
                start = ready.get(placement, round_start)
                end = start + task.time(placement.size)
                assignments.append(
                    Assignment(
                        position + offset,
                        task.name,
                        placement.size,
                        placement.first_slice,
                        start,
                        end,
                    )
                )
                round_end = max(round_end, end)
            live = set(used)
            clock = round_end
            position += len(used)
        return Plan(
            gpu=gpu.name,
            policy=self.name,
            assignments=tuple(assignments),
            reconfigurations=tuple(reconfigurations),
        )

    @staticmethod
    def _op(action: Action, placement: Placement, at: float, gpu: MigGeometry) -> Reconfiguration:
        size = placement.size
        seconds = gpu.create_s(size) if action == "create" else gpu.destroy_s(size)
        return Reconfiguration(action, size, placement.first_slice, at, at + seconds)
