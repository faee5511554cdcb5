"""Synthetic measurement runs built from an Orion kernel trace (eth-easl/orion, V100).

An Orion CSV lists one iteration's kernels in launch order (Name, Profile, Memory_footprint,
SM_usage, Duration in ns) and records no idle gaps. From it `synthesize` makes T runs of
the same sequence as the shim would report them (kernel ID, start, end, run index):

- duration = trace duration x (1 + duration_noise x N(0, 1)), at least 1 ns;
- kernel ID: Orion records no grid or block, so the stand-ins are grid = (SM_usage, 1, 1)
  (at least 1) and block = (1, 1, 1): SM_usage grows with the launch's grid, so launches of
  one kernel at different sizes get different IDs, as real grids would give them;
- the gap after kernel i (to kernel i + 1) follows `GapModel`:

      gap = (launch + K(k_i) + P(k_i, k_i+1) + B(i)) x max(0, 1 + noise x N(0, 1)) + stall

  K and P are fixed per kernel ID and per (kernel ID, next kernel ID) pair, drawn once from
  an exponential of mean kernel_ns and pair_ns (seeded hashes of the IDs): a kernel followed
  by a cheap elementwise op waits a little, one followed by a kernel whose inputs the CPU
  still prepares waits longer. B(i) is boundary_ns x U(0.5, 1.5) at fixed random
  positions of the sequence, one per boundary_every launches (phase boundaries such as layer
  blocks or forward/backward), and 0 elsewhere: only a predictor that knows the launch index
  can learn it. stall is a CPU-side hiccup, exponential of mean stall_ns with probability
  stall_probability: nothing can predict it.

Reading the CSV is the only I/O of the profiling package. Some Orion files (the *_fb0 ones)
hold placeholder durations (7 ns for every kernel): `unusable_reason` says so, and
`synthesize` refuses them.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from gpuloom.policies.profiling.kernels import kernel_id, mix64

ORION_COLUMNS = ("Name", "Profile", "Memory_footprint", "SM_usage", "Duration")
# No real kernel launch takes under 100 ns on a V100; a trace made only of such values is
# placeholders.
MIN_REAL_DURATION_NS = 100
BLOCK = (1, 1, 1)
# Runs follow each other with this much time between the last kernel of one and the next.
RUN_SPACING_NS = 1_000_000


class UnusableTraceError(ValueError):
    """A trace that cannot stand for a measurement."""


@dataclass(frozen=True, slots=True)
class OrionKernel:
    name: str
    profile: int
    memory_footprint: int
    sm_usage: int
    duration_ns: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (max(self.sm_usage, 1), 1, 1)

    @property
    def kernel_id(self) -> int:
        return kernel_id(self.name, self.grid, BLOCK)


@dataclass(frozen=True, slots=True)
class OrionTrace:
    name: str
    kernels: tuple[OrionKernel, ...]

    def __len__(self) -> int:
        return len(self.kernels)

    @property
    def durations_ns(self) -> np.ndarray:
        return np.array([k.duration_ns for k in self.kernels], dtype=np.int64)

    def kernel_ids(self) -> np.ndarray:
        """The kernel ID of each launch (hashing each distinct launch once)."""
        ids = {(k.name, k.grid): 0 for k in self.kernels}
        for name, grid in ids:
            ids[(name, grid)] = kernel_id(name, grid, BLOCK)
        return np.array([ids[(k.name, k.grid)] for k in self.kernels], dtype=np.uint64)


def parse_orion_csv(text: str, name: str = "") -> OrionTrace:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != ORION_COLUMNS:
        raise ValueError(f"{name or 'trace'}: expected the header {','.join(ORION_COLUMNS)}")
    kernels = []
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) != len(ORION_COLUMNS):
            raise ValueError(f"{name or 'trace'} line {line}: expected 5 fields, got {len(row)}")
        try:
            profile, memory, sm, duration = (int(v) for v in row[1:])
        except ValueError:
            raise ValueError(f"{name or 'trace'} line {line}: non-integer field") from None
        if duration < 0:
            raise ValueError(f"{name or 'trace'} line {line}: negative duration")
        kernels.append(OrionKernel(row[0], profile, memory, sm, duration))
    if not kernels:
        raise ValueError(f"{name or 'trace'}: no kernels")
    return OrionTrace(name, tuple(kernels))


def read_orion_trace(path: str | Path) -> OrionTrace:
    path = Path(path)
    return parse_orion_csv(path.read_text(encoding="utf-8"), name=path.stem)


def unusable_reason(trace: OrionTrace) -> str | None:
    """Why the trace cannot stand for a measurement, or None when it can."""
    longest = int(trace.durations_ns.max())
    if longest < MIN_REAL_DURATION_NS:
        return (
            f"every duration is below {MIN_REAL_DURATION_NS} ns (longest {longest} ns): "
            "placeholder values, not a measurement"
        )
    return None


@dataclass(frozen=True, slots=True)
class GapModel:
    """The synthetic idle gap after each kernel, in ns (formula in the module docstring)."""

    launch_ns: float = 2_000.0
    kernel_ns: float = 0.0
    pair_ns: float = 8_000.0
    boundary_ns: float = 60_000.0
    # One phase boundary per this many launches (at least one per run; 0: none).
    boundary_every: int = 40
    noise: float = 0.1
    stall_probability: float = 0.005
    stall_ns: float = 200_000.0

    @classmethod
    def kernel_only(cls, kernel_ns: float = 8_000.0) -> GapModel:
        """Gaps that depend on the kernel ID alone: FIKIT's mean predictor is right here."""
        return cls(kernel_ns=kernel_ns, pair_ns=0.0, boundary_ns=0.0, boundary_every=0)

    @classmethod
    def pairs_only(cls, pair_ns: float = 8_000.0) -> GapModel:
        """Gaps that depend on the (kernel, next kernel) pair, no phase boundaries."""
        return cls(pair_ns=pair_ns, boundary_ns=0.0, boundary_every=0)

    def validate(self) -> None:
        for field in ("launch_ns", "kernel_ns", "pair_ns", "boundary_ns", "noise", "stall_ns"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{field} must be finite and >= 0, got {value!r}")
        if not 0 <= self.stall_probability <= 1:
            raise ValueError("stall_probability must lie in [0, 1]")
        if self.boundary_every < 0:
            raise ValueError("boundary_every must be >= 0")


def _exponential(keys: np.ndarray, mean: float) -> np.ndarray:
    """A fixed exponential draw of the given mean per key."""
    unit = (mix64(keys) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return -mean * np.log1p(-unit)


def expected_gaps(sequence: np.ndarray, model: GapModel, seed: int = 0) -> np.ndarray:
    """The expected gap after each kernel of the sequence but the last (len - 1 values)."""
    model.validate()
    first = np.asarray(sequence, dtype=np.uint64)[:-1]
    second = np.asarray(sequence, dtype=np.uint64)[1:]
    salt = mix64(np.array([seed], dtype=np.uint64))[0]
    kernel = _exponential(first ^ salt, model.kernel_ns)
    pair = _exponential(mix64(first ^ salt) ^ second, model.pair_ns)
    boundary = np.zeros(len(first))
    count = 0
    if model.boundary_every and model.boundary_ns and len(first):
        count = max(1, round(len(first) / model.boundary_every))
    if count:
        rng = np.random.default_rng([seed, 1])
        where = rng.choice(len(first), size=count, replace=False)
        boundary[where] = model.boundary_ns * rng.uniform(0.5, 1.5, size=count)
    base = model.launch_ns + kernel + pair + boundary
    return base + model.stall_probability * model.stall_ns


@dataclass(frozen=True, slots=True, eq=False)
class Measurements:
    """T synthetic runs as the shim reports them, with the ground truth they were made from."""

    kernel_ids: np.ndarray  # uint64, run after run, launch order
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    run_index: np.ndarray  # uint32
    runs: int
    sequence: np.ndarray  # uint64: the kernel IDs of one run
    expected_gap_ns: np.ndarray  # mean (stalls included) after each kernel but the last
    true_mean_duration_ns: Mapping[int, float]  # per kernel ID, noise-free


def simulate_runs(
    sequence: np.ndarray,
    durations_ns: np.ndarray,
    runs: int = 20,
    gaps: GapModel = GapModel(),
    duration_noise: float = 0.03,
    seed: int = 0,
    start_ns: int = 1_000_000_000,
) -> Measurements:
    """T runs of `sequence` with the given mean durations and `gaps` between kernels."""
    sequence = np.asarray(sequence, dtype=np.uint64)
    base = np.asarray(durations_ns, dtype=np.float64)
    n = len(sequence)
    if n < 1 or len(base) != n:
        raise ValueError("need a non-empty sequence and one duration per kernel")
    if runs < 1:
        raise ValueError("runs must be >= 1")
    gaps.validate()
    rng = np.random.default_rng([seed, 0])
    durations = np.maximum(
        np.rint(base * (1 + duration_noise * rng.standard_normal((runs, n)))), 1
    ).astype(np.int64)
    expected = expected_gaps(sequence, gaps, seed)
    structural = expected - gaps.stall_probability * gaps.stall_ns
    factor = np.maximum(1 + gaps.noise * rng.standard_normal((runs, n - 1)), 0)
    stalls = np.where(
        rng.random((runs, n - 1)) < gaps.stall_probability,
        gaps.stall_ns * rng.exponential(1.0, (runs, n - 1)),
        0.0,
    )
    gap = np.rint(structural * factor + stalls).astype(np.int64)
    # Start of kernel i = run start + durations and gaps before it.
    steps = np.concatenate((np.zeros((runs, 1), np.int64), durations[:, :-1] + gap), axis=1)
    offset = np.cumsum(steps, axis=1)
    run_length = offset[:, -1] + durations[:, -1]
    run_start = start_ns + np.concatenate(([0], np.cumsum(run_length[:-1] + RUN_SPACING_NS)))
    start = run_start[:, None] + offset
    truth: dict[int, list[float]] = {}
    for kid, duration in zip(sequence.tolist(), base.tolist(), strict=True):
        truth.setdefault(kid, []).append(duration)
    return Measurements(
        kernel_ids=np.tile(sequence, runs),
        start_ns=start.reshape(-1),
        end_ns=(start + durations).reshape(-1),
        run_index=np.repeat(np.arange(runs, dtype=np.uint32), n),
        runs=runs,
        sequence=sequence,
        expected_gap_ns=expected,
        true_mean_duration_ns=MappingProxyType({k: float(np.mean(v)) for k, v in truth.items()}),
    )


def synthesize(
    trace: OrionTrace,
    runs: int = 20,
    gaps: GapModel = GapModel(),
    duration_noise: float = 0.03,
    seed: int = 0,
) -> Measurements:
    """T synthetic measurement runs of an Orion trace (UnusableTraceError for placeholders)."""
    reason = unusable_reason(trace)
    if reason is not None:
        raise UnusableTraceError(f"{trace.name}: {reason}")
    return simulate_runs(
        trace.kernel_ids(), trace.durations_ns, runs, gaps, duration_noise, seed=seed
    )
