"""The harvest gauge of one GPU (docs/harvest.md, "The harvest gauge"): each FIKIT process's
launches counted from its shim's sequence word, summed per job over consecutive windows, and
at each window's end the estimate of gpuloom.policies.fikit.harvest_gauge exported as
`gpuloom_dispatcher_harvest_ratio` and `gpuloom_dispatcher_harvest_kept_ratio` (a job with no
estimate: no sample, not 0). Driven by the shim channel's thread (its housekeeping reads the
words); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from gpuloom.policies.fikit.harvest_gauge import (
    HarvestEstimate,
    JobLaunches,
    LaunchProfile,
    estimate_harvest,
    launch_delta,
    launch_profile,
)
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.admission_engine import KernelTiming

log = structlog.get_logger("gpuloom.dispatcher.harvest_gauge")


def launch_profile_of(table: Sequence[KernelTiming]) -> LaunchProfile | None:
    """A FIKIT kernel table's launch profile (None: no gauge for its job)."""
    return launch_profile((k.samples, k.duration_ns, k.gap_after_ns) for k in table)


@dataclass(frozen=True, slots=True)
class HarvestWindow:
    """One window the gauge estimated over (CLOCK_MONOTONIC ns) and what it exported."""

    start_ns: int
    end_ns: int
    estimates: dict[str, HarvestEstimate]


RECENT_WINDOWS = 32  # how many past windows `recent` keeps


@dataclass(slots=True)
class _Process:
    job: str
    priority: int
    seq: int  # the sequence word as read last
    read_ns: int  # when


@dataclass(slots=True)
class _Job:
    priority: int
    launches: int = 0


class HarvestGauge:
    """Launch counts per job over windows of `window_s`, and the gauges at each window's end."""

    def __init__(
        self,
        gpu: str,
        window_s: float,
        export: Callable[[dict[str, HarvestEstimate]], None] | None = None,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self._gpu = gpu
        self._window_ns = int(window_s * 1e9)
        self._export = export or self._set_metrics
        self._processes: dict[str, _Process] = {}  # assignment id -> its process
        self._profiles: dict[str, LaunchProfile | None] = {}  # job -> its launch profile
        self._jobs: dict[str, _Job] = {}  # job -> this window's counts (departed ones too)
        self._window_start: int | None = None
        self._exported: set[str] = set()
        self.rejected = 0  # implausible deltas dropped
        # The latest windows, oldest first (introspection and the live test).
        self.recent: collections.deque[HarvestWindow] = collections.deque(maxlen=RECENT_WINDOWS)

    def add(self, assignment_id: str, job: str, priority: int, seq: int, now_ns: int) -> None:
        """A FIKIT process registered; `seq` its region's sequence word now."""
        self._processes[assignment_id] = _Process(job, priority, seq, now_ns)
        self._join(job, priority)
        if self._window_start is None:
            self._window_start = now_ns

    def set_profile(self, job: str, profile: LaunchProfile | None) -> None:
        self._profiles[job] = profile

    def observe(self, assignment_id: str, seq: int, now_ns: int) -> None:
        """Its sequence word as read now: the launches since the last read count to its job."""
        process = self._processes.get(assignment_id)
        if process is None:
            return
        delta = launch_delta(process.seq, seq, now_ns - process.read_ns)
        process.seq, process.read_ns = seq, now_ns
        if delta is None:
            self.rejected += 1
            log.warning("implausible launch count dropped", gpu=self._gpu, assignment=assignment_id)
            return
        self._join(process.job, process.priority).launches += delta

    def remove(self, assignment_id: str, seq: int | None, now_ns: int) -> None:
        """The process left (`seq`: its word read a last time, if its region is still there);
        its launches stay in this window's counts."""
        if seq is not None:
            self.observe(assignment_id, seq, now_ns)
        self._processes.pop(assignment_id, None)

    def roll(self, now_ns: int) -> dict[str, HarvestEstimate] | None:
        """At a window's end (`window_s` after its start): the estimates over it, exported, and
        a new window; before it, None."""
        start = self._window_start
        if start is None or now_ns - start < self._window_ns:
            return None
        jobs = [
            JobLaunches(name, job.priority, job.launches, self._profiles.get(name))
            for name, job in self._jobs.items()
        ]
        estimates = estimate_harvest(jobs, now_ns - start)
        self._export(estimates)
        self.recent.append(HarvestWindow(start, now_ns, estimates))
        self._jobs = {}
        for process in self._processes.values():  # the next window: the jobs still here
            self._join(process.job, process.priority)
        self._profiles = {n: p for n, p in self._profiles.items() if n in self._jobs}
        self._window_start = now_ns if self._processes else None
        return estimates

    def close(self) -> None:
        """Take every exported sample back (the GPU's channel stops)."""
        self._export({})

    def _join(self, job: str, priority: int) -> _Job:
        entry = self._jobs.get(job)
        if entry is None:
            entry = self._jobs[job] = _Job(priority)
        entry.priority = min(entry.priority, priority)
        return entry

    def _set_metrics(self, estimates: dict[str, HarvestEstimate]) -> None:
        for job in self._exported - estimates.keys():
            metrics.HARVEST_RATIO.remove(self._gpu, job)
            metrics.HARVEST_KEPT.remove(self._gpu, job)
        for job, estimate in estimates.items():
            metrics.HARVEST_RATIO.labels(self._gpu, job).set(estimate.harvest)
            metrics.HARVEST_KEPT.labels(self._gpu, job).set(estimate.kept)
        self._exported = set(estimates)
