"""Profile types stored by the profile store: plain frozen dataclasses, no I/O, no protobuf.

Every profile is identified by (kind, key, gpu_model). The key is the task key for kernel, MIG
and job profiles and the function name for throughput profiles. `version` and `updated_at` are
assigned by the store on every write; values given by a writer are ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar


class ProfileKind(enum.StrEnum):
    KERNEL = "kernel"
    THROUGHPUT = "throughput"
    MIG = "mig"
    JOB = "job"


@dataclass(frozen=True, slots=True)
class ProfileId:
    kind: ProfileKind
    key: str
    gpu_model: str

    def __str__(self) -> str:
        return f"{self.kind} profile {self.key!r} on {self.gpu_model!r}"


@dataclass(frozen=True, slots=True)
class Dim3:
    x: int
    y: int = 1
    z: int = 1


class KernelBound(enum.StrEnum):
    """What limits a kernel (Orion's profile class): co-running a compute-bound kernel beside
    a memory-bound one slows each less than two of one class. Unknown unless something
    measured it: the shim reads no hardware counters (docs/harvest.md)."""

    UNKNOWN = "unknown"
    COMPUTE = "compute"
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class KernelStats:
    """Statistics of one kernel ID (FIKIT): durations and the idle gap that follows it; and
    what spatial admission needs: the SMs its launch shape asks for on the profile's GPU model
    (0: unknown) and its bound class."""

    kernel_id: int
    name: str
    grid: Dim3
    block: Dim3
    sample_count: int
    mean_duration_ns: float
    p50_duration_ns: float
    p95_duration_ns: float
    mean_gap_after_ns: float
    sm_usage: int = 0
    bound: KernelBound = KernelBound.UNKNOWN


@dataclass(frozen=True, slots=True)
class GapPredictorModel:
    """The gap predictor the profiler chose for a task, with its held-out error."""

    kind: str
    mae_ns: float
    candidates_mae_ns: Mapping[str, float]
    model_json: str


@dataclass(frozen=True, slots=True)
class KernelProfile:
    KIND: ClassVar[ProfileKind] = ProfileKind.KERNEL
    key: str
    gpu_model: str
    measured_runs: int
    kernels: tuple[KernelStats, ...]
    version: int = 0
    updated_at: datetime | None = None
    gap_predictor: GapPredictorModel | None = None

    @property
    def entries(self) -> int:
        return len(self.kernels)


@dataclass(frozen=True, slots=True)
class ThroughputPoint:
    """Throughput of a function under one (SM percent, time quota percent) configuration."""

    sm_percent: int
    quota_percent: float
    requests_per_s: float
    p50_latency_ms: float
    p99_latency_ms: float


@dataclass(frozen=True, slots=True)
class ThroughputProfile:
    KIND: ClassVar[ProfileKind] = ProfileKind.THROUGHPUT
    key: str
    gpu_model: str
    points: tuple[ThroughputPoint, ...]
    version: int = 0
    updated_at: datetime | None = None

    @property
    def entries(self) -> int:
        return len(self.points)


@dataclass(frozen=True, slots=True)
class MigTime:
    slices: int
    exec_time_s: float


@dataclass(frozen=True, slots=True)
class MigProfile:
    """Execution time of a task on each MIG instance size it can run on (FAR).

    The times form a mapping from size to time, so they are kept sorted by size: two profiles
    with the same times are equal whatever order they were given in."""

    KIND: ClassVar[ProfileKind] = ProfileKind.MIG
    key: str
    gpu_model: str
    times: tuple[MigTime, ...]
    version: int = 0
    updated_at: datetime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "times", tuple(sorted(self.times, key=lambda t: t.slices)))

    @property
    def entries(self) -> int:
        return len(self.times)


@dataclass(frozen=True, slots=True)
class ColocatedThroughput:
    with_task_key: str
    throughput: float


@dataclass(frozen=True, slots=True)
class JobProfile:
    """What Gandiva's introspection learns about a training job."""

    KIND: ClassVar[ProfileKind] = ProfileKind.JOB
    key: str
    gpu_model: str
    minibatch_time_s: float
    peak_memory_bytes: int
    gpu_utilization_percent: float
    solo_throughput: float
    colocated: tuple[ColocatedThroughput, ...] = ()
    version: int = 0
    updated_at: datetime | None = None
    minibatch_cv: float = 0.0
    low_memory_points_s: tuple[float, ...] = ()
    low_memory_bytes: int = 0

    @property
    def entries(self) -> int:
        return len(self.colocated)


Profile = KernelProfile | ThroughputProfile | MigProfile | JobProfile
PROFILE_TYPES: dict[ProfileKind, type[Profile]] = {
    t.KIND: t for t in (KernelProfile, ThroughputProfile, MigProfile, JobProfile)
}


def profile_id(profile: Profile) -> ProfileId:
    return ProfileId(profile.KIND, profile.key, profile.gpu_model)


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    id: ProfileId
    version: int
    updated_at: datetime
    entries: int


@dataclass(frozen=True, slots=True)
class ProfileFilter:
    """Empty fields match everything."""

    key: str = ""
    kind: ProfileKind | None = None
    gpu_model: str = ""


@dataclass(frozen=True, slots=True)
class Page:
    summaries: tuple[ProfileSummary, ...]
    next_page_token: str
