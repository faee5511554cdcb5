"""What every kernel-admission policy of one GPU shares: a task's share and the small
interface the simulator (and the benchmarks) drive, kernel by kernel.

Times are integer nanoseconds on the caller's clock; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PRIORITIES = 10  # 0 (highest) .. 9


@dataclass(frozen=True, slots=True)
class TaskShare:
    """What a task is entitled to on the GPU: its priority level, its SM partition and its time
    quota per window (request: guaranteed; limit: never exceeded), quotas as fractions."""

    priority: int
    sm_percent: int = 100
    quota_request: float = 1.0
    quota_limit: float = 1.0

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes no sense."""
        p = self.priority
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < PRIORITIES:
            raise ValueError(f"priority must be an integer in 0..{PRIORITIES - 1}, got {p!r}")
        sm = self.sm_percent
        if not isinstance(sm, int) or isinstance(sm, bool) or not 1 <= sm <= 100:
            raise ValueError(f"sm_percent must be an integer in 1..100, got {sm!r}")
        for name in ("quota_request", "quota_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
        if self.quota_limit < self.quota_request:
            raise ValueError(
                f"quota_limit ({self.quota_limit}) must be >= quota_request ({self.quota_request})"
            )


@dataclass(frozen=True, slots=True)
class Kernel:
    """A launch as the task's profile predicts it (None: the profile does not know)."""

    duration_ns: int | None
    gap_after_ns: int | None


class KernelAdmission(Protocol):
    """Who may launch a kernel now. The driver calls `launch` when a task's host wants to
    launch; a task told to wait launches when a later `decide` lists it among the grants (its
    waiting kernel is the one it asked with). `completed` reports one kernel's end and its
    device time; `idle` says the task has no work (nothing more to launch until it calls
    `launch` again). `decide` returns the waiting tasks that may launch now, in grant order,
    and the time to call it again with no new event (None: only events change anything)."""

    @property
    def name(self) -> str: ...

    def add_task(self, task: int, share: TaskShare, now_ns: int) -> None: ...

    def launch(self, task: int, kernel: Kernel, now_ns: int) -> bool:
        """True: launch now; False: wait for a grant from decide."""
        ...

    def completed(self, task: int, device_ns: int, now_ns: int) -> None: ...

    def idle(self, task: int, now_ns: int) -> None: ...

    def decide(self, now_ns: int) -> tuple[Sequence[int], int | None]: ...

    def counters(self) -> dict[str, int]:
        """What the policy counted (the FIKIT core's counters, promotions...)."""
        ...
