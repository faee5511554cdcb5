"""Training introspection fed by the shim (Gandiva's introspection, docs/training.md).

Every shim writes its process's allocated device memory into a ring in its admission region,
at most one entry per sample period (gpuloom/shimwire.py, shim/src/memcap.c). The channel thread
reads the rings (ShimChannel._collect_samples) and feeds the samples here; a thread of this
module runs `detect_cycle` (the profiler's AnalyzeMemory code, gpuloom/policies/profiling/
cycles.py) on each process's recent samples every `analyze_s`, off the lease path, and keeps the
cycle it found for GetGpuStatus, the heartbeats to placement and the metrics.

What a shim writes is validated before it is kept: times must be CLOCK_MONOTONIC nanoseconds
not ahead of the dispatcher's clock and never going back, sizes at most MAX_SAMPLE_BYTES;
anything else is dropped and counted (gpuloom_dispatcher_memory_samples_total{outcome}).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import structlog

from gpuloom.domain.training import TrainingCycle
from gpuloom.policies.profiling.cycles import Cycle, detect_cycle
from gpuloom.services.dispatcher import metrics

log = structlog.get_logger("gpuloom.dispatcher.introspection")

# No GPU holds a pebibyte: a sample above it is garbage.
MAX_SAMPLE_BYTES = 1 << 50
# A sample from further ahead than this of the dispatcher's clock is garbage.
FUTURE_SLACK_NS = 5_000_000
# A process is at its low point while it holds at most low + this share of the cycle's swing.
LOW_BAND = 0.1


def low_point_threshold(cycle: TrainingCycle) -> int:
    """The most bytes a process may hold to count as at its cycle's low point."""
    swing = max(cycle.high_memory_bytes - cycle.low_memory_bytes, 0)
    return cycle.low_memory_bytes + int(LOW_BAND * swing)


@dataclass(frozen=True, slots=True)
class IntrospectionConfig:
    sample_period_s: float = (
        1e-3  # the shim's sample period (GPULOOM_DISPATCHER_TRAINING_SAMPLE_US)
    )
    window_s: float = 10.0  # how far back the detection looks
    analyze_s: float = 1.0  # how often it runs
    max_samples: int = 50_000  # per process (older ones go first)
    # The held series is resampled onto at most this many points (the sample period, or coarser
    # for a long window): detect_cycle's cost grows with it (about 25 ms of CPU for 4,000
    # points on the 2-vCPU VM), and a mini-batch of 100 ms or more needs no finer grid.
    max_points: int = 4000

    def validate(self) -> None:
        if not (0 < self.sample_period_s <= 1.0 and 0 < self.window_s <= 3600):
            raise ValueError("need 0 < sample_period_s <= 1 and 0 < window_s <= 3600")
        if not (0 < self.analyze_s <= 3600 and self.max_samples >= 64 and self.max_points >= 64):
            raise ValueError("need 0 < analyze_s <= 3600, max_samples >= 64, max_points >= 64")


class MemoryTrace:
    """One process's memory samples: (CLOCK_MONOTONIC ns, bytes), validated, recent ones."""

    __slots__ = ("_bytes", "_config", "_times")

    def __init__(self, config: IntrospectionConfig) -> None:
        self._config = config
        self._times: collections.deque[int] = collections.deque(maxlen=config.max_samples)
        self._bytes: collections.deque[int] = collections.deque(maxlen=config.max_samples)

    def __len__(self) -> int:
        return len(self._times)

    def add(self, samples: Iterable[tuple[int, int]], now_ns: int) -> tuple[int, int]:
        """Keeps the plausible samples; returns (accepted, rejected). An entry with the time of
        the latest one is that entry again (the shim updated its bytes): it replaces it."""
        accepted = rejected = 0
        times, values = self._times, self._bytes
        for at, allocated in samples:
            if at <= 0 or at > now_ns + FUTURE_SLACK_NS or not 0 <= allocated <= MAX_SAMPLE_BYTES:
                rejected += 1
            elif times and at == times[-1]:
                values[-1] = allocated
            elif times and at < times[-1]:
                rejected += 1  # time went back: not what a shim writes
            else:
                times.append(at)
                values.append(allocated)
                accepted += 1
        # Keep one sample older than the window: it holds the value at the window's start.
        horizon = now_ns - int(self._config.window_s * 1e9)
        while len(times) > 1 and times[1] < horizon:
            times.popleft()
            values.popleft()
        return accepted, rejected

    @property
    def latest_bytes(self) -> int | None:
        return self._bytes[-1] if self._bytes else None

    def held_series(self, now_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples as the step function they are (each value holds until the next sample,
        the last one until now), on a uniform grid of the sample period (coarser past
        max_points), from the window's start: times in seconds, bytes."""
        if not self._times:
            return np.empty(0), np.empty(0)
        times = np.fromiter(self._times, dtype=np.int64, count=len(self._times))
        values = np.fromiter(self._bytes, dtype=np.float64, count=len(self._bytes))
        start = max(int(times[0]), now_ns - int(self._config.window_s * 1e9))
        span = max(now_ns - start, 0)
        step = max(
            int(self._config.sample_period_s * 1e9), span // (self._config.max_points - 1), 1
        )
        grid = start + step * np.arange(span // step + 1, dtype=np.int64)
        index = np.searchsorted(times, grid, side="right") - 1
        keep = index >= 0
        return grid[keep] / 1e9, values[index[keep]]


@dataclass
class _Process:
    trace: MemoryTrace
    cycle: TrainingCycle | None = None
    last_low_s: float = -math.inf
    minibatches: int = 0
    frozen: bool = False  # suspended: no new samples, the last cycle stands


class TrainingIntrospector:
    """The memory traces and detected cycles of one GPU's processes. Thread-safe: the channel
    thread feeds it, its own thread analyses, the gRPC side reads."""

    def __init__(
        self,
        gpu_label: str,
        config: IntrospectionConfig | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._config = config or IntrospectionConfig()
        self._config.validate()
        self._gpu = gpu_label
        self._clock_ns = clock_ns
        self._wall = wall
        self._lock = threading.Lock()
        self._processes: dict[str, _Process] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def config(self) -> IntrospectionConfig:
        return self._config

    # ---- fed by the channel thread ----

    def feed(
        self, assignment_id: str, samples: list[tuple[int, int]], lost: int = 0
    ) -> tuple[int, int]:
        """Samples read from a process's ring; `lost`: entries overwritten before they were
        read. Returns (accepted, rejected)."""
        now = self._clock_ns()
        with self._lock:
            process = self._processes.get(assignment_id)
            if process is None:
                process = self._processes[assignment_id] = _Process(MemoryTrace(self._config))
            accepted, rejected = process.trace.add(samples, now)
        counter = metrics.MEMORY_SAMPLES
        if accepted:
            counter.labels(self._gpu, "accepted").inc(accepted)
        if rejected:
            counter.labels(self._gpu, "rejected").inc(rejected)
        if lost:
            counter.labels(self._gpu, "overrun").inc(lost)
        return accepted, rejected

    def forget(self, assignment_id: str) -> None:
        """The reservation ended."""
        with self._lock:
            self._processes.pop(assignment_id, None)
        for gauge in (metrics.TRAINING_MINIBATCH, metrics.TRAINING_LOW_MEMORY):
            with contextlib.suppress(KeyError):
                gauge.remove(self._gpu, assignment_id)

    def set_frozen(self, assignment_id: str, frozen: bool) -> None:
        """While suspended or disconnected the process writes no samples: its last cycle
        stands."""
        with self._lock:
            process = self._processes.get(assignment_id)
            if process is None and frozen:
                return
            if process is None:
                process = self._processes[assignment_id] = _Process(MemoryTrace(self._config))
            process.frozen = frozen

    # ---- read by anyone ----

    def current_bytes(self, assignment_id: str) -> int | None:
        with self._lock:
            process = self._processes.get(assignment_id)
            return None if process is None else process.trace.latest_bytes

    def cycle(self, assignment_id: str) -> TrainingCycle | None:
        with self._lock:
            process = self._processes.get(assignment_id)
            return None if process is None else process.cycle

    def cycles(self) -> dict[str, TrainingCycle]:
        with self._lock:
            return {a: p.cycle for a, p in self._processes.items() if p.cycle is not None}

    # ---- the analysis ----

    def analyze(self, assignment_id: str) -> TrainingCycle | None:
        """Runs the detection on the process's window now; the cycle it keeps (None: no
        samples; minibatch_s 0: none detected)."""
        now = self._clock_ns()
        with self._lock:
            process = self._processes.get(assignment_id)
            if process is None:
                return None
            if process.frozen and process.cycle is not None:
                return process.cycle
            times, values = process.trace.held_series(now)
        found = detect_cycle(times, values) if len(times) else None
        with self._lock:
            if self._processes.get(assignment_id) is not process:
                return None  # forgotten meanwhile
            process.cycle = self._describe(process, found, len(times), now)
            cycle = process.cycle
        metrics.TRAINING_MINIBATCH.labels(self._gpu, assignment_id).set(cycle.minibatch_s)
        metrics.TRAINING_LOW_MEMORY.labels(self._gpu, assignment_id).set(cycle.low_memory_bytes)
        return cycle

    def _describe(
        self, process: _Process, found: object, samples: int, now_ns: int
    ) -> TrainingCycle:
        if not isinstance(found, Cycle):
            return TrainingCycle(0.0, False, 0, 0, 0.0, samples, process.minibatches)
        new = [t for t in found.low_points_s if t > process.last_low_s + found.period_s / 2]
        process.minibatches += len(new)
        process.last_low_s = max(process.last_low_s, found.low_points_s[-1])
        now_s = now_ns / 1e9
        next_low = found.next_low_point(now_s)
        return TrainingCycle(
            minibatch_s=found.period_s,
            stable=found.stable,
            low_memory_bytes=max(round(found.low_memory_bytes), 0),
            high_memory_bytes=max(round(found.high_memory_bytes), 0),
            next_low_point_unix_s=self._wall() + (next_low - now_s),
            samples=samples,
            minibatches=process.minibatches,
        )

    def analyze_all(self) -> None:
        with self._lock:
            assignments = list(self._processes)
        for assignment_id in assignments:
            try:
                self.analyze(assignment_id)
            except Exception:  # a bug in one process's analysis must not stop the others
                log.exception("training introspection failed", assignment=assignment_id)

    # ---- the thread ----

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"introspection-{self._gpu}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._config.analyze_s):
            self.analyze_all()
