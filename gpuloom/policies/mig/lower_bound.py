"""The area lower bound of the FAR paper (Section 6.4): every task at its least-work size,
the total work spread evenly over all slices. No schedule can finish earlier."""

from __future__ import annotations

from collections.abc import Sequence

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig.plan import MigTask


def min_work(task: MigTask, gpu: MigGeometry) -> float:
    """The least slice-seconds the task needs on any instance size."""
    return min(size * task.time(size) for size in gpu.sizes)


def area_lower_bound(tasks: Sequence[MigTask], gpu: MigGeometry) -> float:
    return sum(min_work(task, gpu) for task in tasks) / gpu.slice_count
