"""Gap-aware placement of low-priority jobs, from FIKIT (Wu et al., "FIKIT: Priority-Based
Real-time GPU Multi-tasking Scheduling with Kernel Identification", section 5, "What tasks
are suitable for sharing a GPU").

FIKIT runs a low-priority task's kernels in the idle gaps between the kernels of the task that
holds the GPU (the highest-priority one there). How much of a holder's idle time a job can use
depends on the pair: long gaps and short kernels fill well, gaps shorter than the job's kernels
not at all. FIKIT leaves choosing the GPU to a cluster-level policy; this is one.

For a job whose priority is worse than a GPU's holder, and with kernel profiles of both, the
estimate follows FIKIT's filling loop with this job as the one waiting task: in each holder gap
(gaps under 0.1 ms are skipped, as FIKIT does), the job's kernels run in their launch order
while the next one still ends inside the gap (BestPrioFit never overruns a gap); the first that
does not fit waits for the next gap. The score is the filled time per unit of the holder's run
time (its kernels plus its gaps), shared by the low-priority jobs already on that GPU: divided by
1 + their number. The job goes to a GPU with the best score that has room for its rectangle
(MRA's best match inside that GPU); ties to the lowest GPU id.

Without a profile for the job, without a profiled holder it outranks, or when no such GPU has
room or any fillable time, the job is placed by the fallback policy (MRA by default).
Profiles are plain data given by the caller (`set_profile`), e.g. from the profile store.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from types import MappingProxyType

from gpuloom.policies.placement.fleet import Fleet
from gpuloom.policies.placement.model import (
    InvalidRequestError,
    JobRequest,
    Placement,
    PlacementPolicy,
    Rect,
    Unplaceable,
)
from gpuloom.policies.placement.mra import MraPolicy

# FIKIT skips idle gaps shorter than this: a kernel launch alone costs 0.1-2 ms.
MIN_GAP_NS = 100_000.0


@dataclass(frozen=True, slots=True)
class KernelTimes:
    """A task's kernel profile: the mean duration of each kernel of one run in launch order,
    and the mean idle gap after each (FIKIT's per-kernel-ID means); all in nanoseconds. A
    histogram works too: list each duration as often as it occurs."""

    task_key: str
    durations_ns: tuple[float, ...]
    gaps_ns: tuple[float, ...] = ()

    @property
    def run_ns(self) -> float:
        return math.fsum(self.durations_ns) + math.fsum(self.gaps_ns)

    def validate(self) -> None:
        """Raise InvalidRequestError unless the key is set and every time is finite, >= 0."""
        if not isinstance(self.task_key, str) or not self.task_key:
            raise InvalidRequestError(f"task_key must be a non-empty string: {self.task_key!r}")
        for name in ("durations_ns", "gaps_ns"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf
                for v in values
            ):
                raise InvalidRequestError(f"{name} must be a tuple of finite times >= 0")


def fillable_ns(holder: KernelTimes, filler: KernelTimes, min_gap_ns: float = MIN_GAP_NS) -> float:
    """Idle time of one holder run that the filler's kernels fill, run after run of the filler
    in launch order, without overrunning any gap."""
    prefix = list(accumulate(filler.durations_ns, initial=0.0))
    cycle = prefix[-1]
    if cycle <= 0:
        return 0.0  # no kernels, or none that take time
    count = len(filler.durations_ns)
    position = 0  # the filler's next kernel
    filled = 0.0
    for gap in holder.gaps_ns:
        if gap < min_gap_ns:
            continue
        left = gap
        tail = cycle - prefix[position]
        if tail <= left:
            # The rest of this filler run, then whole runs.
            whole = (left - tail) // cycle
            filled += tail + whole * cycle
            left -= tail + whole * cycle
            position = 0
        # The kernels from `position` on that still end inside the gap.
        end = bisect_right(prefix, prefix[position] + left, lo=position) - 1
        filled += prefix[end] - prefix[position]
        position = end % count
    return filled


def fill_rate(holder: KernelTimes, filler: KernelTimes, min_gap_ns: float = MIN_GAP_NS) -> float:
    """Fillable idle seconds per second of the holder's run (0 for an empty profile)."""
    run = holder.run_ns
    return fillable_ns(holder, filler, min_gap_ns) / run if run > 0 else 0.0


class GapAwarePolicy:
    """Places low-priority jobs where their kernels fill the holder's gaps best."""

    name = "gap-aware"

    def __init__(
        self,
        profiles: Iterable[KernelTimes] = (),
        fallback: PlacementPolicy | None = None,
        min_gap_ns: float = MIN_GAP_NS,
    ) -> None:
        self.fallback: PlacementPolicy = MraPolicy() if fallback is None else fallback
        self.min_gap_ns = min_gap_ns
        self._profiles: dict[str, KernelTimes] = {}
        self._rates: dict[tuple[str, str], float] = {}  # (holder, filler) -> fill_rate
        for times in profiles:
            self.set_profile(times)

    @property
    def profiles(self) -> Mapping[str, KernelTimes]:
        return MappingProxyType(self._profiles)

    def set_profile(self, times: KernelTimes) -> None:
        times.validate()
        self._profiles[times.task_key] = times
        self._forget_rates(times.task_key)

    def forget_profile(self, task_key: str) -> None:
        self._profiles.pop(task_key, None)
        self._forget_rates(task_key)

    def rate(self, holder_key: str, filler_key: str) -> float:
        """fill_rate of the two profiles (0 if either is unknown), cached."""
        key = (holder_key, filler_key)
        rate = self._rates.get(key)
        if rate is None:
            holder = self._profiles.get(holder_key)
            filler = self._profiles.get(filler_key)
            rate = 0.0
            if holder is not None and filler is not None:
                rate = fill_rate(holder, filler, self.min_gap_ns)
            self._rates[key] = rate
        return rate

    def place(self, job: JobRequest, fleet: Fleet) -> Placement | Unplaceable:
        if job.task_key not in self._profiles:
            return self.fallback.place(job, fleet)
        groups = fleet.holder_groups()
        ranked = []
        for group in groups:
            holder_key, holder_priority, fillers = group
            if holder_priority >= job.priority:
                continue  # the job does not rank below this holder: nothing to fill
            rate = self.rate(holder_key, job.task_key)
            if rate > 0:
                ranked.append((-rate / (1 + fillers), group))
        ranked.sort()
        w, h = job.w, job.sm_percent
        i = 0
        while i < len(ranked):
            # Groups of equal score compete on GPU id.
            j = i
            while j < len(ranked) and ranked[j][0] == ranked[i][0]:
                j += 1
            best: tuple[str, tuple[int, int, int, int]] | None = None
            for _, group in ranked[i:j]:
                for gpu_id in groups[group]:
                    if best is not None and gpu_id >= best[0]:
                        break
                    slot = fleet.slot(gpu_id)
                    if (
                        not slot.schedulable
                        or (job.gpu_model and slot.model != job.gpu_model)
                        or slot.memory_free < job.memory_bytes
                    ):
                        continue
                    box = slot.free.best_fit(w, h)
                    if box is not None:
                        best = (gpu_id, box)
                        break
            if best is not None:
                gpu_id, box = best
                rect = Rect(box[0], box[1], w, h)
                return Placement(job.job_id, gpu_id, fleet.slot(gpu_id).node, rect, self.name)
            i = j
        return self.fallback.place(job, fleet)

    def _forget_rates(self, task_key: str) -> None:
        self._rates = {k: v for k, v in self._rates.items() if task_key not in k}
