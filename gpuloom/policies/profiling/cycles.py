"""Training introspection (Gandiva, OSDI 2018): the mini-batch cycle in a job's GPU memory use.

A training job allocates activations during the forward pass and frees them during the
backward pass, so its memory use repeats once per mini-batch. Gandiva takes the mini-batch time
as the time between two successive memory minima, and suspends a job at a minimum, where the
least memory has to be copied out.

`detect_cycle` takes (time s, bytes) samples, irregular and noisy, and:

1. resamples them onto a uniform grid (median sampling interval) and removes a linear trend;
2. finds the period first, as the highest autocorrelation peak (of the series averaged over
   5 points) past its first zero crossing and within span / min_cycles (a cycle must repeat
   at least min_cycles times); a peak under min_autocorrelation is no cycle;
3. median-filters the series over a tenth of that period, up to a quarter when the noise
   is strong (a median keeps the sharp drops of a sawtooth or step where they are), and
   walks it with hysteresis: a minimum counts once the memory has risen `hysteresis` x the
   swing above it, then again with half the median cycle height once the cycles are known,
   and minima closer than MERGE_WITHIN periods merge, so noise cannot split a dip;
4. per minimum: its low point (the time of the smoothed minimum), its low window (where
   memory stays within max(`low_band` x swing, 3 x the filtered noise) of the cycle's floor,
   the 10th percentile between the maxima around it: the job is cheap to suspend anywhere
   in it) and the falling edge into it (where memory crosses halfway between the maximum
   before and the minimum). Cycles that run off either end of the series are dropped.

period_s is the mean interval between successive minima and cv their coefficient of
variation, each minimum timed by its falling edge: the argmin wanders over a flat floor or a
slow ramp with the noise, the edge does not. Flat, aperiodic, irregular or too short series
give NoCycle with the reason, never a made-up period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Minima closer than this many autocorrelation periods are one dip.
MERGE_WITHIN = 0.4
# Widest median filter, in grid points.
MAX_FILTER = 101
# A cycle whose intervals vary less than this (coefficient of variation) is stable.
STABLE_CV = 0.1


@dataclass(frozen=True, slots=True)
class CycleOptions:
    min_samples: int = 16
    # The period must fit this many times into the series, and as many low points be found.
    min_cycles: int = 3
    # Swing (99th - 1st percentile) under this share of the median level: flat.
    flat_fraction: float = 1e-3
    # Autocorrelation at the period below this: no periodic structure.
    min_autocorrelation: float = 0.4
    # Shares of the swing: the rise that confirms a minimum, and the low window's height.
    hysteresis: float = 0.3
    low_band: float = 0.1
    # Intervals varying more than this (coefficient of variation): irregular, not a cycle.
    max_cv: float = 0.5
    # Cap on the resampled grid (the grid coarsens past it).
    max_points: int = 20_000

    def validate(self) -> None:
        if self.min_samples < 4 or self.min_cycles < 2 or self.max_points < 64:
            raise ValueError("need min_samples >= 4, min_cycles >= 2, max_points >= 64")
        for name in ("flat_fraction", "min_autocorrelation", "hysteresis", "low_band"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must lie in (0, 1)")
        if not self.max_cv > 0:
            raise ValueError("max_cv must be > 0")


@dataclass(frozen=True, slots=True)
class Cycle:
    found: ClassVar[bool] = True
    period_s: float  # mean of intervals_s
    cv: float  # coefficient of variation of intervals_s
    intervals_s: tuple[float, ...]  # between the falling edges into successive minima
    low_points_s: tuple[float, ...]  # the minima (of the smoothed memory)
    low_windows_s: tuple[tuple[float, float], ...]  # (from, to) memory stays near a minimum
    low_memory_bytes: float  # median of the cycles' floors
    high_memory_bytes: float  # median of the maxima
    autocorrelation: float  # at the period's lag

    @property
    def stable(self) -> bool:
        return self.cv <= STABLE_CV

    def next_low_point(self, now_s: float) -> float:
        """The first low point at or after now_s, extrapolated from the last one seen."""
        last = self.low_points_s[-1]
        if now_s <= last:
            return float(next(t for t in self.low_points_s if t >= now_s))
        return last + math.ceil((now_s - last) / self.period_s) * self.period_s


@dataclass(frozen=True, slots=True)
class NoCycle:
    found: ClassVar[bool] = False
    reason: str


def _autocorrelation(y: np.ndarray) -> np.ndarray:
    """Biased autocorrelation (lag 0 = 1): its peaks fall off with the lag, so the period
    beats its multiples."""
    n = len(y)
    size = 1 << (2 * n - 1).bit_length()
    spectrum = np.fft.rfft(y, size)
    acf = np.fft.irfft(spectrum * np.conj(spectrum), size)[:n]
    return acf / acf[0]


def _median_filter(y: np.ndarray, width: int) -> np.ndarray:
    if width <= 1:
        return y
    half = width // 2
    return np.median(sliding_window_view(np.pad(y, half, mode="edge"), 2 * half + 1), axis=1)


def _smooth(y: np.ndarray, lag: int) -> tuple[np.ndarray, float]:
    """Median-filter y over a tenth of a period, wider (up to a quarter) when the noise left
    exceeds 5% of the swing; also the noise it left (standard deviation)."""
    width = min(max(lag // 10, 1), MAX_FILTER) | 1
    smooth = _median_filter(y, width)
    sigma = 1.4826 * float(np.median(np.abs(y - smooth)))  # the raw noise, robustly
    swing = float(np.percentile(smooth, 98) - np.percentile(smooth, 2))
    if swing > 0:
        # A median of w samples leaves about sigma * sqrt(pi / (2 w)).
        needed = math.ceil(math.pi / 2 * (sigma / (0.05 * swing)) ** 2)
        wider = min(needed, lag // 4, MAX_FILTER) | 1
        if wider > width:
            width = wider
            smooth = _median_filter(y, width)
    return smooth, sigma * math.sqrt(math.pi / 2 / width)


def _turning_points(y: np.ndarray, rise: float) -> tuple[list[int], list[int]]:
    """Minima and maxima, alternating, each confirmed by a move of `rise` away from it."""
    minima: list[int] = []
    maxima: list[int] = []
    low = high = 0
    direction = 0  # 0: not known yet, 1: climbing to a maximum, -1: falling to a minimum
    for i in range(1, len(y)):
        v = y[i]
        if direction == 0:
            if v > y[high]:
                high = i
            if v < y[low]:
                low = i
            if y[high] - y[low] >= rise:
                if high > low:
                    minima.append(low)
                    direction = 1
                else:
                    maxima.append(high)
                    direction, low = -1, i
        elif direction == 1:
            if v > y[high]:
                high = i
            elif y[high] - v >= rise:
                maxima.append(high)
                direction, low = -1, i
        else:
            if v < y[low]:
                low = i
            elif v - y[low] >= rise:
                minima.append(low)
                direction, high = 1, i
    return minima, maxima


def _merge_close(
    y: np.ndarray, minima: list[int], maxima: list[int], spacing: int
) -> tuple[list[int], list[int]]:
    """Two minima closer than `spacing` (MERGE_WITHIN periods) are one dip split by noise:
    keep the lower, drop the maximum between them."""
    minima, maxima = list(minima), list(maxima)
    i = 1
    while i < len(minima):
        if minima[i] - minima[i - 1] < spacing:
            lower = minima[i] if y[minima[i]] < y[minima[i - 1]] else minima[i - 1]
            maxima = [j for j in maxima if not minima[i - 1] < j < minima[i]]
            minima[i - 1 : i + 1] = [lower]
        else:
            i += 1
    return minima, maxima


def _neighbours(minima: list[int], maxima: list[int], n: int) -> list[tuple[int, int, int]]:
    """(maximum before or 0, minimum, maximum after or n - 1) for each minimum."""
    peaks = np.array(maxima, dtype=np.int64)
    result = []
    for index in minima:
        before = peaks[peaks < index]
        after = peaks[peaks > index]
        result.append(
            (
                int(before.max()) if before.size else 0,
                index,
                int(after.min()) if after.size else n - 1,
            )
        )
    return result


def detect_cycle(
    times_s: np.ndarray, memory_bytes: np.ndarray, options: CycleOptions = CycleOptions()
) -> Cycle | NoCycle:
    """The mini-batch cycle of a memory series, or NoCycle saying why there is none.
    ValueError for malformed input (lengths differ, not finite)."""
    options.validate()
    t = np.asarray(times_s, dtype=np.float64)
    m = np.asarray(memory_bytes, dtype=np.float64)
    if t.ndim != 1 or t.shape != m.shape:
        raise ValueError("times_s and memory_bytes must be 1-D and of the same length")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(m))):
        raise ValueError("times and memory must be finite")
    t, first = np.unique(t, return_index=True)
    m = m[first]
    if len(t) < options.min_samples:
        return NoCycle(f"too short: {len(t)} samples, need >= {options.min_samples}")

    swing = float(np.percentile(m, 99) - np.percentile(m, 1))
    level = float(np.median(np.abs(m)))
    if swing <= options.flat_fraction * level or swing == 0:
        return NoCycle(f"flat: memory swings {swing:.4g} bytes around {level:.4g} bytes")

    span = float(t[-1] - t[0])
    step = max(float(np.median(np.diff(t))), span / (options.max_points - 1))
    grid = t[0] + step * np.arange(int(span / step) + 1)
    y = np.interp(grid, t, m)
    trend = np.polyval(np.polyfit(grid - grid[0], y, 1), grid - grid[0])
    detrended = y - trend

    # A 5-point average first: it takes 4/5 of white noise's variance away, which would
    # otherwise drag the peak down, and leaves a cycle of >= 10 points nearly whole.
    averaged = np.convolve(detrended, np.ones(5) / 5, mode="same")
    acf = _autocorrelation(averaged - averaged.mean())
    longest = len(grid) // options.min_cycles
    below = np.flatnonzero(acf[: longest + 1] <= 0)
    if below.size == 0:
        return NoCycle(
            f"no periodic structure within {options.min_cycles} repeats: the autocorrelation "
            f"stays positive up to lag {longest * step:.4g} s (too short, or a trend)"
        )
    lag = int(below[0] + np.argmax(acf[below[0] : longest + 1]))
    peak = float(acf[lag])
    # White noise alone reaches about 1 / sqrt(n) at any lag.
    threshold = max(options.min_autocorrelation, 4 / math.sqrt(len(grid)))
    if peak < threshold:
        return NoCycle(
            f"no periodic structure repeating {options.min_cycles} times: autocorrelation "
            f"peaks at {peak:.2f} (lag {lag * step:.4g} s), below {threshold:.2f}"
        )
    if lag < 4:
        return NoCycle(f"sampled too coarsely: {lag} samples per cycle of {lag * step:.4g} s")

    smooth, noise = _smooth(detrended, lag)
    smooth_swing = float(np.percentile(smooth, 98) - np.percentile(smooth, 2))
    rise = options.hysteresis * smooth_swing
    minima, maxima = _turning_points(smooth, rise)
    if minima and maxima:
        # Again, with the rise set by the cycles found: a noise bump on a floor is far smaller
        # than the cycles' own height.
        heights = [smooth[b] - smooth[i] for b, i, _ in _neighbours(minima, maxima, len(grid))]
        minima, maxima = _turning_points(smooth, max(rise, 0.5 * float(np.median(heights))))
    minima, maxima = _merge_close(smooth, minima, maxima, int(MERGE_WITHIN * lag))
    # The band must be wider than the noise the filter left, or it only covers noise dips.
    band = max(options.low_band * smooth_swing, 3 * noise)
    edges, low_points, windows, low_values = [], [], [], []
    for before, index, after in _neighbours(minima, maxima, len(grid)):
        segment = smooth[before : after + 1]
        # The floor, not the deepest dip of noise on it.
        floor = float(np.percentile(segment, 10))
        inside = segment <= floor + band
        # The run of in-band samples around the minimum.
        out_before = np.flatnonzero(~inside[: index - before])
        out_after = np.flatnonzero(~inside[index - before :])
        if not (out_before.size and out_after.size) or before == 0 or after == len(grid) - 1:
            continue  # the cycle runs off the series: its floor or edge may lie outside
        start = before + int(out_before[-1]) + 1
        end = index + int(out_after[0]) - 1
        # The falling edge into this minimum: where memory last crossed the middle between
        # the maximum before and the minimum, interpolated between grid points.
        middle = (smooth[before] + smooth[index]) / 2
        higher = np.flatnonzero(smooth[before:index] > middle)
        if higher.size == 0:
            continue
        above = before + int(higher[-1])
        fraction = (smooth[above] - middle) / (smooth[above] - smooth[above + 1])
        edges.append(float(grid[above] + fraction * step))
        low_points.append(float(grid[index]))
        windows.append((float(grid[start]), float(grid[end])))
        low_values.append(floor + float(trend[index]))

    if len(edges) < options.min_cycles:
        return NoCycle(
            f"too few complete cycles: {len(edges)} minima, need >= {options.min_cycles}"
        )
    intervals = np.diff(edges)
    period = float(intervals.mean())
    cv = float(intervals.std() / period)
    if not 0.5 <= period / (lag * step) <= 2:
        return NoCycle(
            f"inconsistent: minima {period:.4g} s apart, autocorrelation period {lag * step:.4g} s"
        )
    if cv > options.max_cv:
        return NoCycle(f"irregular: intervals between minima vary with cv {cv:.2f}")
    highs = [float(smooth[i] + trend[i]) for i in maxima]
    return Cycle(
        period_s=period,
        cv=cv,
        intervals_s=tuple(intervals.tolist()),
        low_points_s=tuple(low_points),
        low_windows_s=tuple(windows),
        low_memory_bytes=float(np.median(low_values)),
        high_memory_bytes=float(np.median(highs)) if highs else float(np.max(m)),
        autocorrelation=peak,
    )
