import numpy as np
import pytest

from gpuloom.policies.profiling import Cycle, NoCycle, detect_cycle

from .helpers import memory_series


def found(t: np.ndarray, memory: np.ndarray) -> Cycle:
    result = detect_cycle(t, memory)
    assert isinstance(result, Cycle), result
    return result


@pytest.mark.parametrize("shape", ["saw", "step", "triangle"])
@pytest.mark.parametrize("noise", [0.05, 0.2])
def test_finds_the_period_and_the_low_points(shape: str, noise: float) -> None:
    t, memory, starts = memory_series(shape, period_s=0.5, cycles=20, noise=noise, seed=1)
    cycle = found(t, memory)
    assert cycle.found and cycle.period_s == pytest.approx(0.5, rel=0.03)
    assert cycle.cv < 0.1
    assert len(cycle.low_points_s) >= 17  # 20 cycles, those cut by the series' ends dropped
    # Memory is lowest at each cycle start: every low window holds one, and every low point
    # lies within a quarter period of one.
    for (begin, end), low in zip(cycle.low_windows_s, cycle.low_points_s, strict=True):
        assert begin <= low <= end
        assert np.any((starts >= begin - 0.025) & (starts <= end + 0.025))
        assert np.min(np.abs(starts - low)) < 0.125
    assert cycle.low_memory_bytes == pytest.approx(4e9, abs=0.15 * 2e9)
    assert cycle.high_memory_bytes > cycle.low_memory_bytes + 1e9


@pytest.mark.parametrize("shape", ["saw", "step", "triangle"])
def test_irregular_sampling_jittered_cycles_and_a_leak(shape: str) -> None:
    t, memory, starts = memory_series(
        shape,
        period_s=2.0,
        cycles=15,
        rate_hz=25,
        sampling_jitter=1.5,
        period_jitter=0.1,
        seed=2,
    )
    memory = memory + 2e7 * t  # a slow leak: 20 MB/s under a 2 GB swing
    cycle = found(t, memory)
    lengths = np.diff(starts)
    assert cycle.period_s == pytest.approx(lengths.mean(), rel=0.05)
    # The cycles do vary by about 10%, and the detector sees by how much.
    assert cycle.cv == pytest.approx(lengths.std() / lengths.mean(), abs=0.04)


def test_next_low_point_extrapolates_by_whole_periods() -> None:
    t, memory, _ = memory_series("saw", period_s=1.0, cycles=12, rate_hz=50, seed=3)
    cycle = found(t, memory)
    last = cycle.low_points_s[-1]
    assert cycle.next_low_point(last + 0.01) == pytest.approx(last + cycle.period_s)
    assert cycle.next_low_point(last + 2.5 * cycle.period_s) == pytest.approx(
        last + 3 * cycle.period_s
    )
    assert cycle.next_low_point(cycle.low_points_s[1] - 0.01) == cycle.low_points_s[1]
    assert cycle.stable


def reason(t: np.ndarray, memory: np.ndarray) -> str:
    result = detect_cycle(t, memory)
    assert isinstance(result, NoCycle), result
    assert not result.found
    return result.reason


def test_flat_memory_has_no_cycle() -> None:
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 30, 3000))
    assert reason(t, np.full(3000, 8e9)).startswith("flat")
    assert reason(t, 8e9 + 1e4 * rng.standard_normal(3000)).startswith("flat")


@pytest.mark.parametrize("seed", range(5))
def test_random_memory_has_no_cycle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, 30, 3000))
    assert "no periodic structure" in reason(t, 8e9 + 1e9 * rng.standard_normal(3000))
    walk = 8e9 + 2e7 * np.cumsum(rng.standard_normal(3000))
    assert detect_cycle(t, walk).found is False


def test_too_short_series_have_no_cycle() -> None:
    t, memory, _ = memory_series("saw", period_s=0.5, cycles=20, seed=4)
    assert reason(t[:10], memory[:10]).startswith("too short")
    # Two and a half cycles: the period cannot repeat three times.
    assert "repeat" in reason(t[:250], memory[:250])


def test_sampling_slower_than_the_cycle_finds_none() -> None:
    # 1 Hz sampling of a 0.5 s cycle: whatever aliases out is not the mini-batch.
    t, memory, _ = memory_series("saw", period_s=0.5, cycles=400, rate_hz=200, seed=5)
    coarse = np.arange(0, len(t), 200)
    assert detect_cycle(t[coarse], memory[coarse]).found is False


def test_malformed_input_is_an_error() -> None:
    with pytest.raises(ValueError):
        detect_cycle(np.arange(20.0), np.arange(19.0))
    with pytest.raises(ValueError):
        detect_cycle(np.arange(20.0), np.full(20, np.nan))
