"""FixPartBest: FixPart with whichever valid partition gives the shortest makespan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig.fixpart import fixed_partition_plan
from gpuloom.policies.mig.plan import MigTask, Plan, PlanningError, validate_tasks


@dataclass(frozen=True)
class FixPartBestPlanner:
    name: str = "fixpart-best"

    def plan(self, tasks: Sequence[MigTask], gpu: MigGeometry) -> Plan:
        validate_tasks(tasks, gpu)
        best: Plan | None = None
        for partition in gpu.partitions:
            try:
                plan = fixed_partition_plan(tasks, gpu, partition, self.name)
            except PlanningError:
                continue
            if best is None or plan.makespan_s < best.makespan_s:
                best = plan
        if best is None:
            raise PlanningError(f"no fixed {gpu.name} partition can run every task")
        return best
