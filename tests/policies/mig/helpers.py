"""Shared by the MIG planner tests: the Rodinia traces beside the checkout, random tasks."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import strategies as st

from gpuloom.domain.mig_geometry import GEOMETRIES, MigGeometry
from gpuloom.policies.mig import MigTask
from gpuloom.policies.mig.taskfile import parse_tasks

# CI checks the repository out with shared/ beside it.
TRACES = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "rodinia-mig"


def rodinia(gpu: MigGeometry) -> list[MigTask]:
    path = TRACES / f"rodinia16_{gpu.name}.txt"
    assert path.is_file(), f"missing trace {path}: shared/ must sit beside the checkout"
    return parse_tasks(path.read_text(), gpu)


def task(name: str, gpu: MigGeometry, *times: float) -> MigTask:
    return MigTask(name, dict(zip(gpu.sizes, times, strict=True)))


gpus = st.sampled_from([GEOMETRIES[name] for name in ("A30", "A100", "H100")])


@st.composite
def task_sets(draw: st.DrawFn, gpu: MigGeometry, max_tasks: int = 12) -> list[MigTask]:
    """Tasks with times from 0.01 s to 100 s, any scaling (even slower with more slices),
    some sizes unusable (inf), but every task runnable somewhere."""
    count = draw(st.integers(1, max_tasks))
    tasks = []
    for number in range(count):
        times = [draw(st.one_of(st.floats(0.01, 100.0), st.just(math.inf))) for _ in gpu.sizes]
        if all(math.isinf(t) for t in times):
            times[draw(st.integers(0, len(times) - 1))] = draw(st.floats(0.01, 100.0))
        tasks.append(task(f"t{number}", gpu, *times))
    return tasks
