"""A profiler measurement session as its clients see it (gpuloom.v1.Profiler): a task measured
for T runs on a GPU model, until its kernel profile is in the profile store."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SessionState(enum.Enum):
    OPEN = "open"  # collecting runs
    COMPLETE = "complete"  # the profile is in the profile store
    CANCELLED = "cancelled"
    FAILED = "failed"  # could not compute or store the profile; see `error`


@dataclass(frozen=True, slots=True)
class SessionView:
    session_id: str
    task_key: str
    gpu_model: str
    runs: int  # T
    runs_received: int
    records: int
    state: SessionState
    opened_at: float  # unix seconds
    closed_at: float = 0.0  # 0: still open
    error: str = ""
    predictor: str = ""  # the gap predictor chosen, once complete
    predictor_mae_ns: dict[str, float] = field(default_factory=dict)
    kernels: int = 0  # distinct kernel IDs, once complete
