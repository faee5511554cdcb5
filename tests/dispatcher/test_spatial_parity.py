"""Parity: the engine's C spatial rule (shim/src/spatial.c, gl_sp_admit) and the pure policy
(gpuloom/policies/harvest/spatial.py, which the simulator asks) give the same verdict on every
generated case: same conditions, same knobs, the same arithmetic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.harvest import Candidate, HarvestConfig, Running, SpatialHarvest
from gpuloom.services.dispatcher.admission_engine import native_spatial_admit

PROFILES = ("compute", "memory", "unknown")
MS = 1_000_000

# Knobs near their defaults, demands small beside the GPU's SMs, durations short beside the
# holder's next launch: about half the cases are admitted, and every check decides some.
factors = st.floats(min_value=1.0, max_value=3.0)
configs = st.builds(
    HarvestConfig,
    sm_limit=st.one_of(st.just(1.0), st.floats(min_value=0.05, max_value=1.0)),
    allow_unknown=st.booleans(),
    stretch=factors,
    max_holder_slowdown=st.floats(min_value=1.0, max_value=3.0),
    other_factor=factors,
    unknown_factor=factors,
)


def maybe(values: st.SearchStrategy[int]) -> st.SearchStrategy[int | None]:
    """A value, or now and then None (not known)."""
    return st.tuples(st.integers(0, 7), values).map(lambda pair: pair[1] if pair[0] else None)


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    sms = draw(st.integers(1, 200))
    demands = st.integers(0, max(1, sms // 6))
    profiles = st.sampled_from(PROFILES)
    # A holder kernel (better than the candidate's 3..9), and now and then others, any priority.
    holder = Running(draw(st.integers(0, 2)), draw(demands), draw(profiles))
    others = draw(st.lists(st.builds(Running, st.integers(0, 9), demands, profiles), max_size=2))
    candidate = Candidate(
        draw(st.integers(3, 9)),
        draw(demands),
        draw(profiles),
        draw(maybe(st.integers(0, 10 * MS))),
        draw(st.integers(0, 2 * MS)),
        draw(st.one_of(st.none(), st.none(), st.integers(0, 10 * MS))),
    )
    now = draw(st.integers(0, 1 << 50))
    next_in = draw(maybe(st.integers(0, 40 * MS)))
    on_gpu = [holder, *others] if draw(st.integers(0, 15)) else others
    return sms, now, candidate, on_gpu, None if next_in is None else now + next_in


@settings(max_examples=3000, deadline=None)
@given(config=configs, case=cases())
def test_the_c_rule_and_the_policy_give_the_same_verdict(
    config: HarvestConfig, case: tuple
) -> None:
    sms, now, candidate, on_gpu, next_launch = case
    expected = SpatialHarvest(config).admit(now, candidate, on_gpu, next_launch, sms)
    assert native_spatial_admit(config, sms, now, candidate, on_gpu, next_launch) == expected


HOLDER = Running(0, 40, "compute")
FITS = Candidate(5, 20, "memory", 2 * MS)


def both(candidate: Candidate, on_gpu: list[Running], next_launch: int | None) -> set[bool]:
    config = HarvestConfig(max_holder_slowdown=1.1)
    return {
        SpatialHarvest(config).admit(0, candidate, on_gpu, next_launch, 100),
        native_spatial_admit(config, 100, 0, candidate, on_gpu, next_launch),
    }


def test_each_condition_refuses_in_both() -> None:
    # Admitted: 20 SMs beside the holder's 40, memory beside compute, 1.1 * 2 ms before 10 ms.
    assert both(FITS, [HOLDER], 10 * MS) == {True}
    # No holder on the GPU: time admission decides.
    assert both(FITS, [Running(7, 40, "compute")], 10 * MS) == {False}
    # Too wide: 70 + 40 SMs > 100.
    assert both(Candidate(5, 70, "memory", 2 * MS), [HOLDER], 10 * MS) == {False}
    # A class clash: compute beside compute.
    assert both(Candidate(5, 20, "compute", 2 * MS), [HOLDER], 10 * MS) == {False}
    # The holder slowed too much: 1 + 0.5 * 30/100 > 1.1.
    assert both(Candidate(5, 30, "memory", 2 * MS), [HOLDER], 10 * MS) == {False}
    # It would still run at the holder's next launch (2 ms * 1.3 > 2.5 ms).
    assert both(FITS, [HOLDER], 2_500_000) == {False}
    # Never profiled, or the holder's next launch not predictable: it waits.
    assert both(Candidate(5, 20, "memory", None), [HOLDER], 10 * MS) == {False}
    assert both(FITS, [HOLDER], None) == {False}
    # Its quota limit has less left than its kernel needs.
    assert both(Candidate(5, 20, "memory", 2 * MS, quota_left_ns=MS), [HOLDER], 10 * MS) == {False}
