"""Domain types of the profiler: sessions and measurement batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpuloom.domain.profiler import SessionState
from gpuloom.domain.profiles import Dim3

DEFAULT_RUNS = 20
MIN_RUNS = 10
MAX_RUNS = 1000


@dataclass(frozen=True, slots=True)
class PredictorSummary:
    chosen: str
    mae_ns: dict[str, float]


@dataclass(slots=True)
class Session:
    session_id: str
    task_key: str
    gpu_model: str
    runs: int
    opened_at_unix_s: float
    state: SessionState = SessionState.OPEN
    runs_completed: set[int] = field(default_factory=set)
    records: int = 0
    closed_at_unix_s: float = 0.0
    error: str = ""
    predictor: PredictorSummary | None = None
    kernels: int = 0


@dataclass(frozen=True, slots=True)
class KernelName:
    kernel_id: int
    name: str
    grid: Dim3
    block: Dim3


@dataclass(frozen=True, slots=True)
class MeasurementBatch:
    """Records in columns; validated as a whole before any of it is applied."""

    session_id: str
    kernels: tuple[KernelName, ...]
    kernel_ids: np.ndarray  # uint64
    start_ns: np.ndarray  # uint64
    end_ns: np.ndarray  # uint64
    run_index: np.ndarray  # uint32
    completed_runs: tuple[int, ...]
