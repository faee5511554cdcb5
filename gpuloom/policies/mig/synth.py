"""Synthetic task times of the FAR paper, Section 6.3.

A share p_s of the tasks scales well up to s slices (near- or super-linearly) and sub-linearly
beyond. Of the tasks that scale past one slice, a share p_sup starts memory-bound: super-linear
from 1 to 2 slices, and still super-linear over each next span of slices with probability
(1 - 0.3) per slice added, after which it is compute-bound and sub-linear. The others scale
near-linearly up to their size. Tasks "scaling up to 1 slice" are sub-linear throughout.

t(1) ~ U(t_min, t_max), and t(s + 1) = (s + r) / (s + 1) * t(s), with r drawn from a normal
clipped to a range per kind of step: super-linear N(-0.25, 0.25) in [-0.5, 0], near-linear
N(0.1, 0.1) in [0, 0.2], sub-linear N(0.75, 0.25) in [0.5, 1]. r <= 1 keeps times from growing
with more slices. Sizes that are not instance sizes (5 and 6 on a 7-slice GPU) are generated
and dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig.plan import MigTask

MEMORY_TO_COMPUTE_PER_SLICE = 0.3

# (mean, standard deviation, low, high) of r per kind of step.
StepKind = tuple[float, float, float, float]
_SUPER = (-0.25, 0.25, -0.5, 0.0)
_NEAR = (0.1, 0.1, 0.0, 0.2)
_SUB = (0.75, 0.25, 0.5, 1.0)

TIME_RANGES: Mapping[str, tuple[float, float]] = MappingProxyType(
    {"wide": (1.0, 100.0), "narrow": (90.0, 100.0)}
)
WORKLOADS = ("poor", "mixed", "good")


@dataclass(frozen=True)
class SynthSpec:
    """What to generate: the share of tasks scaling well up to each instance size, the share
    of memory-bound tasks among those scaling past one slice, and the range of t(1)."""

    scaling: Mapping[int, float]
    memory_bound_share: float = 0.0
    t_min: float = 1.0
    t_max: float = 100.0

    def __post_init__(self) -> None:
        if not math.isclose(sum(self.scaling.values()), 1.0, abs_tol=1e-9):
            raise ValueError("scaling shares must add up to 1")
        if any(share < 0 for share in self.scaling.values()):
            raise ValueError("scaling shares must be >= 0")
        if not 0 <= self.memory_bound_share <= 1:
            raise ValueError("memory_bound_share must be in [0, 1]")
        if not 0 < self.t_min <= self.t_max:
            raise ValueError("need 0 < t_min <= t_max")


def workload(
    gpu: MigGeometry, name: str, times: str = "wide", memory_bound_share: float = 0.0
) -> SynthSpec:
    """The paper's workloads. On a 7-slice GPU: poor = 50% up to 1 and 50% up to 2 slices,
    mixed = 20% up to each size, good = 50% up to 4 and 50% up to 7. On the A30 (sizes 1, 2,
    4) the same idea: the two smallest sizes, all sizes evenly, the two largest sizes.

    The paper does not give p_sup for these workloads; 0 (every well-scaling task
    near-linear) reproduces its FAR numbers, so it is the default here. Figure 11 of the
    paper illustrates the generator with 0.5."""
    sizes = gpu.sizes
    if name == "poor":
        scaling = {s: 0.5 if s in sizes[:2] else 0.0 for s in sizes}
    elif name == "mixed":
        scaling = {s: 1 / len(sizes) for s in sizes}
    elif name == "good":
        scaling = {s: 0.5 if s in sizes[-2:] else 0.0 for s in sizes}
    else:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if times not in TIME_RANGES:
        raise ValueError(f"unknown time range {times!r}; known: {', '.join(TIME_RANGES)}")
    t_min, t_max = TIME_RANGES[times]
    return SynthSpec(
        scaling=MappingProxyType(scaling),
        memory_bound_share=memory_bound_share,
        t_min=t_min,
        t_max=t_max,
    )


def task_counts(n: int, scaling: Mapping[int, float]) -> dict[int, int]:
    """floor(n * p_s) tasks per size, then one more to the size farthest below its exact
    share until there are n (footnote 8 of the paper)."""
    counts = {size: math.floor(n * share) for size, share in scaling.items()}
    while sum(counts.values()) < n:
        size = max(scaling, key=lambda s: n * scaling[s] - counts[s])
        counts[size] += 1
    return counts


def generate(n: int, gpu: MigGeometry, spec: SynthSpec, rng: np.random.Generator) -> list[MigTask]:
    """n tasks named task000, task001, ... in random order."""
    if n < 1:
        raise ValueError("need at least one task")
    unknown = set(spec.scaling) - set(gpu.sizes)
    if unknown:
        raise ValueError(f"{gpu.name} has no instance size {min(unknown)}")
    steps: list[list[StepKind]] = []
    for scales_to, count in task_counts(n, spec.scaling).items():
        memory_bound = math.ceil(spec.memory_bound_share * count) if scales_to > 1 else 0
        for number in range(count):
            steps.append(_step_kinds(gpu, scales_to, number < memory_bound, rng))
    order = rng.permutation(len(steps))
    tasks = []
    for position, index in enumerate(order):
        times = [float(rng.uniform(spec.t_min, spec.t_max))]
        for s, (mean, sd, low, high) in enumerate(steps[index], start=1):
            r = float(np.clip(rng.normal(mean, sd), low, high))
            times.append((s + r) / (s + 1) * times[-1])
        tasks.append(
            MigTask(
                name=f"task{position:03d}",
                times=MappingProxyType({size: times[size - 1] for size in gpu.sizes}),
            )
        )
    return tasks


def _step_kinds(
    gpu: MigGeometry, scales_to: int, memory_bound: bool, rng: np.random.Generator
) -> list[StepKind]:
    """The kind of each step s -> s + 1 for s = 1 .. slices - 1."""
    kinds: list[StepKind] = []
    sizes: Sequence[int] = gpu.sizes
    bound = "memory" if memory_bound else "compute"
    for low, high in itertools.pairwise(sizes):
        if high > scales_to or bound == "saturated":
            kind = _SUB
        elif bound == "compute":
            kind = _NEAR
        elif low == 1 or rng.random() < (1 - MEMORY_TO_COMPUTE_PER_SLICE) ** (high - low):
            kind = _SUPER
        else:
            # Memory-bound until here; from now on compute-bound and past its best scaling.
            bound, kind = "saturated", _SUB
        kinds.extend([kind] * (high - low))
    return kinds
