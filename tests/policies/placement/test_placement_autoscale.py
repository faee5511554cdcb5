"""FaST-GShare's Algorithm 1: scale up with the most efficient configuration plus one minimal
one for the remainder, scale down least efficient first, never below the target."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import (
    InvalidRequestError,
    Replica,
    ThroughputPoint,
    plan_scaling,
)
from gpuloom.policies.placement.autoscale import RELATIVE_TOLERANCE

BIG = ThroughputPoint(50, 100.0, 500.0)  # RPR 0.1
EFFICIENT = ThroughputPoint(12, 40.0, 60.0)  # RPR 0.125, the best
SMALL = ThroughputPoint(6, 20.0, 10.0)  # RPR 0.083
MEDIUM = ThroughputPoint(12, 20.0, 25.0)  # RPR 0.104
PROFILE = [BIG, EFFICIENT, SMALL, MEDIUM]


def test_scale_up_uses_the_most_efficient_configuration_and_one_minimal_remainder() -> None:
    plan = plan_scaling(PROFILE, [], 200.0)
    # 3 x 60 = 180; the remaining 20 needs >= 20 req/s: MEDIUM (240) is the smallest resource
    # that covers it (SMALL serves only 10, EFFICIENT and BIG are larger).
    assert plan.add == (EFFICIENT, EFFICIENT, EFFICIENT, MEDIUM)
    assert plan.remove == ()
    assert (plan.gap_rps, plan.capacity_rps) == (200.0, 205.0)


def test_scale_up_counts_what_replicas_serve_already() -> None:
    replicas = [Replica("r1", 12, 40.0), Replica("r2", 6, 20.0, requests_per_s=12.0)]
    plan = plan_scaling(PROFILE, replicas, 90.0)
    assert plan.gap_rps == pytest.approx(18.0)
    assert plan.add == (MEDIUM,)  # 18 < 60: no EFFICIENT one; the smallest that covers 18
    # 28 is more than MEDIUM serves: EFFICIENT is the smallest that covers it.
    assert plan_scaling(PROFILE, replicas, 100.0).add == (EFFICIENT,)
    assert plan_scaling(PROFILE, [], 120.0).add == (EFFICIENT, EFFICIENT)  # no remainder


def test_scale_down_removes_least_efficient_first_and_keeps_the_target() -> None:
    replicas = [
        Replica("e1", 12, 40.0),
        Replica("e2", 12, 40.0),
        Replica("m", 12, 20.0),
        Replica("s", 6, 20.0),
    ]  # 155 req/s
    plan = plan_scaling(PROFILE, replicas, 100.0)
    # Surplus 55: s (RPR 0.083, 10) goes, m (0.104, 25) goes, e1 (60) would drop below 100.
    assert plan.remove == ("s", "m")
    assert plan.add == ()
    assert plan.capacity_rps == 120.0
    # A replica too big to remove is skipped, smaller more efficient ones may still go.
    skip = plan_scaling(PROFILE, [Replica("big", 50, 100.0), Replica("e", 12, 40.0)], 450.0)
    assert skip.remove == ("e",)
    assert skip.capacity_rps == 500.0


def test_zero_target_removes_every_replica() -> None:
    replicas = [Replica(f"r{i}", p.sm_percent, p.quota_percent) for i, p in enumerate(PROFILE)]
    plan = plan_scaling(PROFILE, replicas, 0.0)
    assert sorted(plan.remove) == ["r0", "r1", "r2", "r3"]
    assert plan.capacity_rps == 0.0
    assert plan_scaling(PROFILE, [], 0.0).add == ()


def test_arguments_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="not in the profile"):
        plan_scaling(PROFILE, [Replica("r", 24, 40.0)], 10.0)
    with pytest.raises(InvalidRequestError, match="no configuration that serves"):
        plan_scaling([ThroughputPoint(10, 10.0, 0.0)], [], 10.0)
    with pytest.raises(InvalidRequestError, match="target"):
        plan_scaling(PROFILE, [], math.nan)
    with pytest.raises(InvalidRequestError, match="appears twice"):
        plan_scaling(PROFILE, [Replica("r", 12, 40.0), Replica("r", 12, 40.0)], 10.0)


points = st.builds(
    ThroughputPoint,
    st.integers(1, 100),
    st.integers(1, 100).map(float),
    st.floats(0.5, 500.0),
)


@st.composite
def cases(draw: st.DrawFn):
    profile = draw(st.lists(points, min_size=1, max_size=8))
    replicas = [
        Replica(f"r{i}", p.sm_percent, p.quota_percent, p.requests_per_s)
        for i, p in enumerate(draw(st.lists(st.sampled_from(profile), max_size=10)))
    ]
    targets = sorted(draw(st.lists(st.floats(0.0, 3000.0), min_size=2, max_size=6)))
    return profile, replicas, targets


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_capacity_covers_the_target_and_grows_with_it(case) -> None:
    profile, replicas, targets = case
    current = {r.replica_id: r.requests_per_s for r in replicas}
    last_capacity = -1.0
    for target in targets:
        plan = plan_scaling(profile, replicas, target)
        assert not (plan.add and plan.remove)
        kept = [rate for rid, rate in current.items() if rid not in plan.remove]
        capacity = math.fsum(kept) + math.fsum(p.requests_per_s for p in plan.add)
        assert capacity == pytest.approx(plan.capacity_rps)
        # Within the planner's tolerance, relative to the rates at hand: a target a billionth
        # of the capacity (1.9e-9 rps against 237 rps replicas) is no target at all.
        before = math.fsum(current.values())
        assert capacity >= target - RELATIVE_TOLERANCE * max(1.0, target, before)
        assert capacity >= last_capacity * (1 - 1e-9)  # monotone in the target
        last_capacity = capacity
        if plan.add:
            # All but the last are the most efficient configuration; the last covers the rest.
            best = max(p.rpr for p in profile if p.requests_per_s > 0)
            assert all(p.rpr == best for p in plan.add[:-1])
            assert len(plan.add) - 1 <= plan.gap_rps / plan.add[0].requests_per_s
        if target == 0:
            assert sorted(plan.remove) == sorted(current)
