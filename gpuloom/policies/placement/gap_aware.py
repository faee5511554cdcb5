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
Profiles come from the placement context (`context.kernel_times`), loaded beforehand by the
caller, e.g. from the profile store.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

from gpuloom.policies.placement.context import KernelTimes, PlacementContext
from gpuloom.policies.placement.fleet import Fleet, PlacementPolicy
from gpuloom.policies.placement.model import (
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
)
from gpuloom.policies.placement.mra import MraPolicy

# FIKIT skips idle gaps shorter than this: a kernel launch alone costs 0.1-2 ms.
MIN_GAP_NS = 100_000.0


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
        self, fallback: PlacementPolicy | None = None, min_gap_ns: float = MIN_GAP_NS
    ) -> None:
        self.fallback: PlacementPolicy = MraPolicy() if fallback is None else fallback
        self.min_gap_ns = min_gap_ns
        # (holder, filler) -> the two profiles a rate was computed from, and the rate: a
        # context that hands out a new profile for a key makes its rates stale.
        self._rates: dict[tuple[str, str], tuple[KernelTimes, KernelTimes, float]] = {}

    def rate(self, context: PlacementContext, holder_key: str, filler_key: str) -> float:
        """fill_rate of the two tasks' profiles in `context` (0 if either is unknown), cached."""
        holder = context.kernel_times(holder_key)
        filler = context.kernel_times(filler_key)
        if holder is None or filler is None:
            return 0.0
        cached = self._rates.get((holder_key, filler_key))
        if cached is not None and cached[0] is holder and cached[1] is filler:
            return cached[2]
        rate = fill_rate(holder, filler, self.min_gap_ns)
        self._rates[(holder_key, filler_key)] = (holder, filler, rate)
        return rate

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        if not job.task_key or context.kernel_times(job.task_key) is None:
            return self.fallback.place(job, fleet, context)
        groups = fleet.holder_groups()
        ranked = []
        for group in groups:
            holder_key, holder_priority, fillers = group
            if holder_priority >= job.priority:
                continue  # the job does not rank below this holder: nothing to fill
            rate = self.rate(context, holder_key, job.task_key)
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
                        or not job.allows(slot.model)
                        or slot.memory_free < job.memory_bytes
                        or not fleet.offers(slot, job)
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
        return self.fallback.place(job, fleet, context)
