"""The live harvest gauge's estimator (docs/harvest.md, "The harvest gauge"): pure, no I/O.

The simulator's harvest (gpuloom/sim/harvest.py) of a lower-priority task is `kept / limit`:
`kept` its throughput over its throughput alone, `limit = min(1, (1 - holder busy share) / its
busy share alone)`. Live, the dispatcher knows how many kernels each process launched (a FIKIT
shim's sequence word moves by one at every launch or kernel request, whatever its role) and,
for a profiled job, its kernels' mean durations and gaps measured alone. Over a window:

- a job's throughput over its throughput alone is its launches over the launches it makes
  alone in the same time: `launches * period / window`, with `period` the profile's mean time
  from one launch to the next alone (duration plus the gap after it, weighted by how often
  each kernel runs);
- its busy share alone is the profile's `kernel / period`;
- the holder's (the best priority's jobs') busy share is their device time over the window,
  `launches * kernel` summed over them: what they keep busy at the load they serve now.

Where `limit < 1` the gauge is the job's estimated device time over the holder's idle time,
`launches * kernel / ((1 - holder busy) * window)`, so the profile's gaps cancel out; where
`limit = 1` it is `kept`, as exact as the profile's gaps. Only profiled jobs have it: a job
with no profile (or a holder with none) gets no estimate, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEQ_MODULO = 1 << 32  # the shim's sequence word is a u32 that wraps
# More launches per second than this from one process is not a count but garbage: the driver
# takes microseconds per launch. A delta above it (a shim writing its word at will, a region
# replaced) is dropped, not counted.
MAX_LAUNCHES_PER_S = 2_000_000


@dataclass(frozen=True, slots=True)
class LaunchProfile:
    """A job's launches alone, from its kernel profile (means per launch, in ns)."""

    kernel_ns: float  # mean duration of a launch
    period_ns: float  # mean time from a launch's start to the next one's: duration + gap after

    def __post_init__(self) -> None:
        if not (math.isfinite(self.kernel_ns) and self.kernel_ns > 0):
            raise ValueError(f"kernel_ns must be positive, got {self.kernel_ns}")
        if not (math.isfinite(self.period_ns) and self.period_ns >= self.kernel_ns):
            raise ValueError(f"period_ns must be at least kernel_ns, got {self.period_ns}")

    @property
    def busy_alone(self) -> float:
        """The share of the time its kernels keep the GPU busy alone."""
        return self.kernel_ns / self.period_ns


def launch_profile(kernels: Iterable[tuple[int, float, float | None]]) -> LaunchProfile | None:
    """The launch profile of a kernel profile's (sample count, mean duration ns, mean gap
    after ns or None) rows, each weighted by its sample count (its launches in the measured
    runs). None when no row has samples, the durations add up to nothing, or a sampled row has
    no gap (its period is then unknown)."""
    launches = kernel = period = 0.0
    for samples, duration_ns, gap_ns in kernels:
        if samples <= 0:
            continue
        if gap_ns is None or not (math.isfinite(gap_ns) and gap_ns >= 0):
            return None
        if not (math.isfinite(duration_ns) and duration_ns >= 0):
            return None
        launches += samples
        kernel += samples * duration_ns
        period += samples * (duration_ns + gap_ns)
    if launches == 0 or kernel <= 0:
        return None
    return LaunchProfile(kernel / launches, period / launches)


def launch_delta(previous: int, current: int, elapsed_ns: int) -> int | None:
    """Launches between two reads of a shim's sequence word `elapsed_ns` apart (the word
    wraps at 2**32); None when the count is not plausible (above MAX_LAUNCHES_PER_S)."""
    delta = (current - previous) % SEQ_MODULO
    if delta > max(elapsed_ns, 0) * MAX_LAUNCHES_PER_S / 1e9 + 1:
        return None
    return delta


@dataclass(frozen=True, slots=True)
class JobLaunches:
    """One job over a window: its best priority, its processes' launches, its profile."""

    job: str
    priority: int
    launches: int
    profile: LaunchProfile | None


@dataclass(frozen=True, slots=True)
class HarvestEstimate:
    kept: float  # its throughput over its throughput alone
    limit: float  # what time sharing alone could give it: min(1, (1 - holder busy) / busy alone)
    harvest: float  # kept / limit


def estimate_harvest(jobs: Sequence[JobLaunches], window_ns: int) -> dict[str, HarvestEstimate]:
    """Each lower-priority job's harvest over a window of `window_ns` (module docstring). The
    holder is the jobs of the best priority present; none is estimated when one of them has no
    profile (its busy share is unknown) or they kept the GPU busy the whole window (no limit to
    harvest against). A job's name appears once in `jobs`."""
    if window_ns <= 0:
        raise ValueError(f"window_ns must be positive, got {window_ns}")
    names = [job.job for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError("a job appears twice")
    if not jobs:
        return {}
    best = min(job.priority for job in jobs)
    holder_ns = 0.0
    for job in jobs:
        if job.priority == best:
            if job.profile is None:
                return {}
            holder_ns += job.launches * job.profile.kernel_ns
    holder_busy = holder_ns / window_ns
    if holder_busy >= 1.0:
        return {}
    out: dict[str, HarvestEstimate] = {}
    for job in jobs:
        if job.priority == best or job.profile is None:
            continue
        kept = job.launches * job.profile.period_ns / window_ns
        limit = min(1.0, (1.0 - holder_busy) / job.profile.busy_alone)
        out[job.job] = HarvestEstimate(kept, limit, kept / limit)
    return out
