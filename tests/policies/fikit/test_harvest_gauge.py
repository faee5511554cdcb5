"""The live harvest gauge's estimator (gpuloom/policies/fikit/harvest_gauge.py) against the
simulator's definition (gpuloom/sim/harvest.py): `kept / min(1, (1 - holder busy) / busy alone)`."""

from __future__ import annotations

import pytest

from gpuloom.policies.fikit.harvest_gauge import (
    MAX_LAUNCHES_PER_S,
    SEQ_MODULO,
    JobLaunches,
    LaunchProfile,
    estimate_harvest,
    launch_delta,
    launch_profile,
)

S = 10**9
US = 1000

# The inference of tests/shim/test_fikit_live.py: 300, 200, 300 us kernels, 400 us of host work
# after the first two and a 2 ms pause after the third; a training loop of 150 us kernels with
# 50 us of host work after each.
INFER = launch_profile(
    [(100, 300 * US, 400 * US), (100, 200 * US, 400 * US), (100, 300 * US, 2000 * US)]
)
TRAIN = launch_profile([(1000, 150 * US, 50 * US)])


def test_a_profile_is_weighted_by_how_often_each_kernel_runs() -> None:
    assert INFER is not None
    assert (INFER.kernel_ns, INFER.period_ns) == pytest.approx((800 / 3 * US, 3600 / 3 * US))
    assert INFER.busy_alone == pytest.approx(800 / 3600)
    # A kernel launched three times as often weighs three times as much.
    weighted = launch_profile([(300, 100 * US, 0), (100, 500 * US, 100 * US)])
    assert weighted == LaunchProfile(200 * US, 225 * US)


def test_no_profile_without_samples_durations_or_a_gap() -> None:
    assert launch_profile([]) is None
    assert launch_profile([(0, 100 * US, 10 * US)]) is None  # never sampled
    assert launch_profile([(5, 0, 10 * US)]) is None  # no device time
    assert launch_profile([(5, 100 * US, None), (5, 100 * US, 0)]) is None  # a period unknown
    assert launch_profile([(0, 100 * US, None), (5, 100 * US, 0)]) == LaunchProfile(
        100 * US, 100 * US
    )
    with pytest.raises(ValueError):
        LaunchProfile(100.0, 50.0)


def test_the_sequence_word_wraps_and_garbage_is_not_counted() -> None:
    assert launch_delta(10, 25, S) == 15
    assert launch_delta(SEQ_MODULO - 5, 3, S) == 8
    assert launch_delta(0, MAX_LAUNCHES_PER_S, S) == MAX_LAUNCHES_PER_S
    assert launch_delta(0, MAX_LAUNCHES_PER_S + 2, S) is None
    assert launch_delta(25, 10, S) is None  # backwards: a wrap of ~4e9 launches in a second


def test_the_harvest_is_kept_over_what_time_sharing_could_give() -> None:
    # Over 2 s the inference made 3,000 launches (800 us of kernels per 3 launches: busy 0.4)
    # and the training 6,000 (each 200 us alone: kept 0.6 of its 10,000 alone).
    jobs = [JobLaunches("infer", 1, 3000, INFER), JobLaunches("train", 8, 6000, TRAIN)]
    ((name, estimate),) = estimate_harvest(jobs, 2 * S).items()
    assert name == "train"
    assert estimate.kept == pytest.approx(0.6)
    assert estimate.limit == pytest.approx((1 - 0.4) / 0.75)
    assert estimate.harvest == pytest.approx(0.6 / 0.8)
    # Where the limit binds, the profile's gaps cancel out: the training's device time over the
    # holder's idle time, whatever its gap.
    gappy = launch_profile([(1000, 150 * US, 500 * US)])
    tight = launch_profile([(1000, 150 * US, 0)])
    assert gappy is not None and tight is not None
    slow = estimate_harvest([jobs[0], JobLaunches("train", 8, 6000, tight)], 2 * S)["train"]
    assert slow.harvest == pytest.approx(6000 * 150 * US / (0.6 * 2 * S))
    # With a light training the limit is 1 and the harvest its kept share.
    light = estimate_harvest([jobs[0], JobLaunches("train", 8, 2000, gappy)], 2 * S)["train"]
    assert light.limit == 1.0 and light.harvest == light.kept == pytest.approx(
        2000 * 650 * US / (2 * S)
    )


def test_several_jobs_share_the_best_priority_and_each_lower_one_is_estimated() -> None:
    jobs = [
        JobLaunches("a", 0, 1500, INFER),
        JobLaunches("b", 0, 1500, INFER),  # together busy 0.4 over 2 s
        JobLaunches("c", 3, 6000, TRAIN),
        JobLaunches("d", 8, 0, TRAIN),  # starved: harvest 0
    ]
    out = estimate_harvest(jobs, 2 * S)
    assert set(out) == {"c", "d"}
    assert out["c"].harvest == pytest.approx(0.75)
    assert out["d"].harvest == 0.0


def test_unknown_is_no_estimate_never_zero() -> None:
    holder = JobLaunches("infer", 1, 3000, INFER)
    # An unprofiled lower-priority job: nothing for it, the others still.
    out = estimate_harvest(
        [holder, JobLaunches("x", 8, 10, None), JobLaunches("t", 8, 10, TRAIN)], S
    )
    assert set(out) == {"t"}
    # An unprofiled holder: its busy share is unknown, so nobody's limit is.
    assert (
        estimate_harvest([JobLaunches("h", 1, 10, None), JobLaunches("t", 8, 10, TRAIN)], S) == {}
    )
    # A holder busy the whole window leaves no limit to harvest against.
    busy = launch_profile([(1, S, 0)])
    assert estimate_harvest([JobLaunches("h", 1, 1, busy), JobLaunches("t", 8, 10, TRAIN)], S) == {}
    # One priority only: nobody is lower.
    assert estimate_harvest([holder], S) == {}
    assert estimate_harvest([], S) == {}
    with pytest.raises(ValueError):
        estimate_harvest([holder, holder], S)
    with pytest.raises(ValueError):
        estimate_harvest([holder], 0)
