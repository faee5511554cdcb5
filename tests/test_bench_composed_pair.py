"""scripts/lib/composed_pair.py's figures (the live pair of scripts/bench_fikit): busy shares
from the fake GPU's log, the harvest, and the kernel profiles the pair runs with."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "lib"))
from composed_pair import (
    GAP_US,
    HIGH,
    HIGH_US,
    LOW,
    LOW_US,
    PAUSE_US,
    busy_share,
    gap_delays,
    harvest,
    measured,
    nominal,
    run_pair,
)


def test_busy_share_counts_overlapping_kernels_once_over_the_span() -> None:
    # 0-10 and 5-15 overlap (15 covered), 20-30 after a gap of 5; span 0-40 with 30-40 idle.
    assert busy_share([(20, 30), (0, 10), (5, 15), (39, 40)]) == pytest.approx(26 / 40)
    assert busy_share([(0, 10), (2, 4)]) == 1.0  # one inside another
    with pytest.raises(ValueError, match="no kernel"):
        busy_share([])


def test_harvest_is_the_kept_share_over_what_time_sharing_could_give() -> None:
    # The holder busy 20% of the time leaves 80%; a filler busy 90% alone could keep 0.8/0.9.
    assert harvest(0.4, 0.2, 0.9) == pytest.approx(0.4 / (0.8 / 0.9))
    # A light filler fits in the idle time: the limit is 1, the harvest its kept share.
    assert harvest(0.7, 0.2, 0.5) == pytest.approx(0.7)
    for high, low in ((1.0, 0.5), (0.2, 0.0), (0.2, 1.5), (-0.1, 0.5)):
        with pytest.raises(ValueError, match="busy shares"):
            harvest(0.5, high, low)


def test_a_measured_profile_is_the_logs_durations_and_gaps_per_kernel() -> None:
    # One process's log (kernel, start ns, end ns), in order: a, b, a, b.
    log = [("a", 0, 100), ("b", 150, 350), ("a", 1000, 1120), ("b", 1200, 1400)]
    profile = {k.name: k for k in measured(log)}
    assert profile["a"].sample_count == 2 and profile["b"].sample_count == 2
    assert profile["a"].mean_duration_ns == pytest.approx(110)
    assert profile["b"].mean_duration_ns == pytest.approx(200)
    assert profile["a"].mean_gap_after_ns == pytest.approx((50 + 80) / 2)
    assert profile["b"].mean_gap_after_ns == pytest.approx(650)  # the last has no gap after
    # A kernel that started before the previous one ended leaves no gap, not a negative one.
    overlapping = {k.name: k for k in measured([("a", 0, 100), ("b", 90, 200)])}
    assert overlapping["a"].mean_gap_after_ns == 0
    with pytest.raises(ValueError, match="no kernel"):
        measured([])


def test_measured_and_nominal_profiles_key_the_same_kernels() -> None:
    # The dispatcher looks kernels up by ID: a measured profile must price the kernels the
    # names' profile prices, only with other durations.
    for task, names in (("infer", HIGH), ("train", (LOW,))):
        log, t = [], 0
        for name in names * 3:
            log.append((name, t, t + 400_000))
            t += 900_000
        ids = {k.name: k.kernel_id for k in measured(log)}
        assert ids == {k.name: k.kernel_id for k in nominal(task)}
        assert len(set(ids.values())) == len(names)
    infer = nominal("infer")
    assert [k.mean_duration_ns for k in infer] == [us * 1e3 for us in HIGH_US]
    assert [k.mean_gap_after_ns for k in infer] == [GAP_US * 1e3, GAP_US * 1e3, PAUSE_US * 1e3]
    assert [k.mean_duration_ns for k in nominal("train")] == [LOW_US * 1e3]
    with pytest.raises(ValueError, match="no task"):
        nominal("serve")


def test_the_inferences_gaps_beside_the_training_split_by_whether_it_waited() -> None:
    h1, h2, h3 = HIGH
    alone = [(h1, 0, 300_000), (h2, 800_000, 1_000_000), (h3, 1_500_000, 1_800_000)]
    paired = [
        (h1, 0, 300_000),
        (LOW, 300_000, 850_000),  # running when h2 would have started alone (800 us): waited
        (h2, 850_000, 1_050_000),
        (LOW, 1_100_000, 1_300_000),  # ended before h3 was due (1,550 us): h3 is 30 us late
        (h3, 1_580_000, 1_880_000),
    ]
    delays = gap_delays(alone, paired)
    assert delays["overrun_share"] == pytest.approx(0.5)
    assert delays["overrun_us"] == pytest.approx(50)
    assert delays["clean_us"] == pytest.approx(30)
    with pytest.raises(ValueError, match="fewer than two"):
        gap_delays(alone, [(h1, 0, 300_000)])


@pytest.mark.parametrize(
    ("profiles", "controls", "named"),
    [
        (("measured",), ("solo", "nope"), "controls"),
        (("measured",), ("apart", "apart"), "controls"),
        (("guessed",), (), "profiles"),
        ((), ("solo",), "profiles"),
    ],
)
def test_the_pair_refuses_unknown_or_repeated_phases_before_starting_a_plane(
    profiles: tuple[str, ...], controls: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ValueError, match=f"^{named}: "):
        run_pair(1, 10, 1.0, profiles=profiles, controls=controls)
