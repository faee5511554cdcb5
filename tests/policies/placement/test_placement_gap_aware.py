"""The gap-aware policy: FIKIT-style fill estimates, where low-priority jobs go, and the
fallback to MRA."""

import pytest

from gpuloom.policies.placement import (
    NO_PROFILES,
    GapAwarePolicy,
    InvalidRequestError,
    KernelProfiles,
    KernelTimes,
    MraPolicy,
    fill_rate,
    fillable_ns,
)

from .helpers import allocation_of, fleet_of, gpu, job, placed, rect

MS = 1_000_000.0
US = 1_000.0

SHORT_GAPS = KernelTimes("short", (1 * MS,) * 4, (300 * US,) * 4)  # shorter than the kernels
LONG_GAPS = KernelTimes("long", (1 * MS,) * 4, (3 * MS,) * 4)
MEDIUM_GAPS = KernelTimes("medium", (1 * MS,) * 4, (1.5 * MS,) * 4)
FILLER = KernelTimes("low", (500 * US, 700 * US))
HALF_MS = KernelTimes("half", (500 * US,))


def test_fillable_time_hand_worked() -> None:
    holder = KernelTimes("h", (1 * MS, 1 * MS, 1 * MS), (2 * MS, 50 * US, 1 * MS))
    filler = KernelTimes("f", (400 * US, 300 * US))
    # Gap 2 ms: 400 300 400 300 400 = 1.8 ms, the next 300 would overrun. Gap 50 us: below
    # FIKIT's 0.1 ms, skipped. Gap 1 ms: 300 400 300 = 1 ms exactly.
    assert fillable_ns(holder, filler) == pytest.approx(2.8 * MS)
    assert fill_rate(holder, filler) == pytest.approx(2.8 / 6.05)
    assert fillable_ns(holder, filler, min_gap_ns=0) == pytest.approx(2.8 * MS)
    assert fillable_ns(holder, KernelTimes("big", (5 * MS,))) == 0
    assert fillable_ns(holder, KernelTimes("none", ())) == 0
    assert fill_rate(KernelTimes("idle", ()), filler) == 0


def test_long_gaps_fill_better_than_short_ones() -> None:
    assert fill_rate(SHORT_GAPS, FILLER) == 0  # 300 us gaps, 500 us kernels
    # 3 ms gaps: 500 700 500 700 500 = 2.9 ms, then 700 500 700 500 = 2.4 ms three times.
    assert fill_rate(LONG_GAPS, FILLER) == pytest.approx((2.9 + 3 * 2.4) / 16)
    assert fill_rate(MEDIUM_GAPS, HALF_MS) == pytest.approx(0.6)
    assert fill_rate(LONG_GAPS, HALF_MS) == pytest.approx(0.75)


def holding(gpu_id: str, task: str, priority: int = 0):
    holder = allocation_of(f"{gpu_id}-holder", 50, 50, 0, priority, task, rect(0, 0, 50, 50))
    return gpu(gpu_id, allocations=(holder,))


def test_a_low_priority_job_goes_where_its_kernels_fill_the_gaps() -> None:
    fleet = fleet_of(holding("a", "short"), holding("b", "long"))
    low = job("filler", 30, 30, priority=5, task_key="low")
    # MRA alone ties the two GPUs and takes the lower id.
    assert placed(MraPolicy().place(low, fleet, NO_PROFILES)).gpu_id == "a"
    profiles = KernelProfiles([SHORT_GAPS, LONG_GAPS, FILLER])
    p = placed(fleet.place(low, GapAwarePolicy(), profiles))
    assert (p.gpu_id, p.policy) == ("b", "gap-aware")
    assert not p.rect.overlaps(rect(0, 0, 50, 50))
    fleet.verify()


def test_lower_priority_jobs_already_there_share_the_gaps() -> None:
    fleet = fleet_of(holding("a", "medium"), holding("b", "long"))
    policy, profiles = GapAwarePolicy(), KernelProfiles([MEDIUM_GAPS, LONG_GAPS, HALF_MS])
    first = placed(fleet.place(job("f1", 10, 10, priority=3, task_key="half"), policy, profiles))
    assert first.gpu_id == "b"  # 0.75 > 0.6
    second = placed(fleet.place(job("f2", 10, 10, priority=3, task_key="half"), policy, profiles))
    assert second.gpu_id == "a"  # b: 0.75 / 2 < 0.6
    assert fleet.holder_groups() == {("medium", 0, 1): ["a"], ("long", 0, 1): ["b"]}


def test_a_full_gpu_is_passed_over_for_the_next_best() -> None:
    full = allocation_of("big", 50, 100, 0, 9, "", rect(0, 50, 100, 50))
    b = holding("b", "long")
    fleet = fleet_of(holding("a", "medium"), gpu("b", allocations=(*b.allocations, full)))
    p = placed(
        fleet.place(
            job("f", 60, 10, priority=3, task_key="half"),
            GapAwarePolicy(),
            KernelProfiles([MEDIUM_GAPS, LONG_GAPS, HALF_MS]),
        )
    )
    assert p.gpu_id == "a"


@pytest.mark.parametrize(
    ("profiles", "low"),
    [
        (KernelProfiles(), job("x", 30, 30, priority=5, task_key="low")),  # no profiles
        (KernelProfiles([LONG_GAPS, FILLER]), job("x", 30, 30, priority=5)),  # no task key
        (KernelProfiles([LONG_GAPS, FILLER]), job("x", 30, 30, priority=0, task_key="low")),
        (KernelProfiles([LONG_GAPS]), job("x", 30, 30, priority=5, task_key="low")),
        (KernelProfiles([SHORT_GAPS, FILLER]), job("x", 30, 30, priority=5, task_key="low")),
    ],
    ids=["no-profiles", "no-task-key", "not-lower-priority", "job-unprofiled", "nothing-fills"],
)
def test_falls_back_to_mra(profiles: KernelProfiles, low) -> None:
    # b's holder has long gaps, but gap-aware cannot use them here: MRA's choice, a.
    fleet = fleet_of(holding("a", "short"), holding("b", "long"))
    p = placed(fleet.place(low, GapAwarePolicy(), profiles))
    assert (p.gpu_id, p.policy) == ("a", "mra")


def test_profiles_can_change() -> None:
    fleet = fleet_of(holding("a", "short"), holding("b", "long"))
    policy, profiles = GapAwarePolicy(), KernelProfiles([SHORT_GAPS, LONG_GAPS, FILLER])
    assert policy.rate(profiles, "long", "low") > 0
    profiles.set_profile(KernelTimes("long", (1 * MS,), (200 * US,)))
    assert policy.rate(profiles, "long", "low") == 0
    low = job("x", 30, 30, priority=5, task_key="low")
    assert placed(fleet.place(low, policy, profiles)).gpu_id == "a"
    profiles.forget_profile("low")
    assert "low" not in profiles.profiles
    with pytest.raises(InvalidRequestError, match="durations_ns"):
        profiles.set_profile(KernelTimes("bad", (-1.0,)))
