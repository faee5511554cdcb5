"""Shared by the profiling tests: the Orion traces beside the checkout, slow reference
implementations, and synthetic memory series."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpuloom.policies.profiling.synth import OrionTrace, read_orion_trace

# CI checks the repository out with shared/ beside it.
ORION = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "orion-model-kernels"


def orion(name: str) -> OrionTrace:
    path = ORION / f"{name}.csv"
    assert path.is_file(), f"missing trace {path}: shared/ must sit beside the checkout"
    return read_orion_trace(path)


def reference_stats(ids, start, end, run) -> dict[int, dict[str, float]]:
    """Per kernel ID, one record at a time: what kernels.aggregate must compute."""
    records = sorted(zip(run.tolist(), start.tolist(), end.tolist(), ids.tolist(), strict=True))
    durations: dict[int, list[int]] = {}
    gaps: dict[int, list[int]] = {}
    for i, (r, s, e, k) in enumerate(records):
        durations.setdefault(k, []).append(e - s)
        gaps.setdefault(k, [])
        if i + 1 < len(records) and records[i + 1][0] == r:
            gaps[k].append(max(records[i + 1][1] - e, 0))
    return {
        k: {
            "count": len(d),
            "mean": sum(d) / len(d),
            "p50": float(np.percentile(d, 50)),
            "p95": float(np.percentile(d, 95)),
            "gap_count": len(gaps[k]),
            "gap": sum(gaps[k]) / len(gaps[k]) if gaps[k] else 0.0,
        }
        for k, d in durations.items()
    }


def memory_series(
    shape: str,
    period_s: float = 0.5,
    cycles: int = 20,
    rate_hz: float = 200.0,
    noise: float = 0.1,
    sampling_jitter: float = 0.5,
    period_jitter: float = 0.0,
    low_bytes: float = 4e9,
    swing_bytes: float = 2e9,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, bytes, cycle starts): memory lowest at each cycle start. Sampling intervals
    vary by +-sampling_jitter / 2, cycle lengths by period_jitter (relative standard
    deviation); Gaussian noise of noise x swing. Shapes: "saw" (ramps up, drops at the cycle
    start), "step" (high for the middle half of the cycle), "triangle"."""
    rng = np.random.default_rng(seed)
    count = int(period_s * cycles * rate_hz)
    t = np.cumsum((1 + sampling_jitter * (rng.random(count) - 0.5)) / rate_hz)
    lengths = period_s * np.maximum(1 + period_jitter * rng.standard_normal(cycles + 10), 0.5)
    first = 0.37 * period_s
    starts = first + np.concatenate(([0.0], np.cumsum(lengths)))
    k = np.searchsorted(starts, t, side="right") - 1
    before = k < 0
    k = np.maximum(k, 0)
    phase = np.where(before, 1 - (first - t) / lengths[0], (t - starts[k]) / lengths[k])
    if shape == "saw":
        level = phase
    elif shape == "step":
        level = ((phase > 0.25) & (phase < 0.75)).astype(float)
    elif shape == "triangle":
        level = 1 - np.abs(2 * phase - 1)
    else:
        raise ValueError(shape)
    memory = low_bytes + swing_bytes * (level + noise * rng.standard_normal(count))
    return t, memory, starts[starts <= t[-1]]
