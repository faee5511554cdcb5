"""The Gittins index of the training policies (`ServiceHistory`) and gandiva's rule on it:
a waiting job is time-sliced into a group only when it is the likelier to end soon."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.policies.training.gandiva import BET_MIN_ENDED, GandivaPolicy
from gpuloom.policies.training.model import (
    ClusterView,
    Group,
    Job,
    Server,
    ServiceHistory,
    Slice,
)

HOUR = 3600.0


def history(gpus: int, *totals_h: float) -> ServiceHistory:
    ended = ServiceHistory()
    for total in totals_h:
        ended.add(gpus, total * HOUR)
    return ended


def test_the_index_is_the_best_chance_to_end_per_service_spent() -> None:
    ended = history(1, 1.0, 10.0)
    # At 0: serving 1 h ends half the jobs for an expected 1 h spent (0.5 / h); serving
    # 10 h ends both for an expected 5.5 h (0.18 / h).
    assert ended.gittins_index(1, 0.0) == pytest.approx(1 / (2 * HOUR))
    # Past the short one, only the 10 h job is left: 1 / 9 h.
    assert ended.gittins_index(1, 1.0 * HOUR) == pytest.approx(1 / (9 * HOUR))
    assert ended.gittins_index(1, 10.0 * HOUR) == 0.0  # ran longer than any ended job
    assert ended.ended(1) == 2 and ended.ended(2) == 0
    with pytest.raises(ValueError, match="no job of 2 GPU"):
        ended.gittins_index(2, 0.0)


@pytest.mark.parametrize(("gpus", "service"), [(0, 1.0), (1, -1.0), (1, math.nan), (1, math.inf)])
def test_an_ended_job_with_a_bad_count_or_service_is_refused(gpus: int, service: float) -> None:
    ended = history(1, 2.0)
    with pytest.raises(ValueError, match="an ended job needs"):
        ended.add(gpus, service)
    assert ended.ended(1) == 1  # nothing changed


@given(
    totals=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=40),
    window=st.integers(1, 8),
    attained=st.floats(0.0, 1e6, allow_nan=False),
)
def test_only_the_latest_ended_jobs_of_a_count_are_kept(
    totals: list[float], window: int, attained: float
) -> None:
    bounded, latest = ServiceHistory(window), ServiceHistory()
    for total in totals:
        bounded.add(1, total)
    for total in totals[-window:]:
        latest.add(1, total)
    bounded.add(2, 5.0)  # another count keeps its own window
    assert bounded.ended(1) == min(window, len(totals)) and bounded.ended(2) == 1
    assert bounded.gittins_index(1, attained) == latest.gittins_index(1, attained)


def test_a_history_that_keeps_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 job per GPU count, not 0"):
        ServiceHistory(0)


def _ratio(totals: list[float], attained: float, quantum: float) -> float:
    """P(end within `quantum`) / E[service spent within it], among jobs longer than
    `attained`, straight from the definition."""
    longer = [t - attained for t in totals if t > attained]
    ends = sum(1 for left in longer if left <= quantum)
    spent = sum(min(left, quantum) for left in longer)
    return ends / spent if spent > 0 else 0.0


@given(
    totals=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=30),
    attained=st.floats(0.0, 1e6, allow_nan=False),
    quanta=st.lists(st.floats(1e-3, 2e6, allow_nan=False), min_size=1, max_size=10),
)
def test_the_index_is_the_supremum_over_every_quantum(
    totals: list[float], attained: float, quanta: list[float]
) -> None:
    ended = ServiceHistory()
    for total in totals:
        ended.add(1, total)
    index = ended.gittins_index(1, attained)
    # No quantum does better, and one that ends a longer job reaches it.
    for quantum in quanta:
        assert _ratio(totals, attained, quantum) <= index * (1 + 1e-9) + 1e-15
    ends = [t - attained for t in totals if t > attained]
    best = max((_ratio(totals, attained, q) for q in ends), default=0.0)
    assert index == pytest.approx(best, rel=1e-9, abs=1e-15)


def _view(ended: ServiceHistory, attained: dict[int, float]) -> ClusterView:
    """One GPU held by job 7, which has run 2 h; jobs 1, 2 and 3 have waited past the hour
    (the third has two of its count ahead of it, so the older rules let it slice in)."""
    jobs = [Job(7, "A", 1, 0.0, 0.5), *(Job(i, "A", 1, float(i), 0.5) for i in (1, 2, 3))]
    return ClusterView(
        now_s=3 * HOUR,
        servers=(Server("v100", 1),),
        jobs=MappingProxyType({j.id: j for j in jobs}),
        groups=(Group(0, ((0, 0),), (7,)),),
        waiting=(1, 2, 3),
        slice_efficiency=60 / 61,
        packable=frozenset(),
        attained_s=MappingProxyType(attained),
        ended=ended,
    )


def test_gandiva_slices_in_only_a_job_likelier_to_end_soon_than_the_group() -> None:
    served = {7: 2.0 * HOUR}
    # Most one-GPU jobs ended within 1.5 h, one ran 100 h: job 7, at 2 h, is likely a long
    # one, the newcomer likely short. It is time-sliced in.
    short = history(1, 0.5, 1.0, 1.5, 1.5, 100.0)
    assert GandivaPolicy().decide(_view(short, served)) == [Slice(3, 0)]
    # Every one-GPU job so far ran 100 h: job 7, 2 h into its 100, is nearer its end than a
    # newcomer. Time-slicing would only delay it.
    long = history(1, *[100.0] * BET_MIN_ENDED)
    assert GandivaPolicy().decide(_view(long, served)) == []
    # Among five ended jobs, one that outlived them all is an outlier of a heavy tail: the
    # newcomer is likely the shorter.
    five = history(1, 0.5, 1.0, 1.5, 1.5, 1.5)
    assert GandivaPolicy().decide(_view(five, served)) == [Slice(3, 0)]


def test_gandiva_makes_no_bet_until_enough_jobs_of_its_count_ended() -> None:
    """Four ended one-GPU jobs, three of them short: a newcomer looks likely short, but four
    are too few to say (51b7ef's lost bets: two 8-GPU jobs of three ended within 0.4 h, and
    the five that came next each ran 5 h or more). No job is time-sliced in until
    BET_MIN_ENDED of its count ended; with that rule off, the older rules alone decide."""
    served = {7: 2.0 * HOUR}
    four = history(1, 0.5, 1.0, 1.5, 100.0)
    assert BET_MIN_ENDED == 5
    assert GandivaPolicy().decide(_view(four, served)) == []
    assert GandivaPolicy(bet_min_ended=4).decide(_view(four, served)) == [Slice(3, 0)]
    none = ServiceHistory()
    assert GandivaPolicy().decide(_view(none, served)) == []
    assert GandivaPolicy(bet_min_ended=0).decide(_view(none, served)) == [Slice(3, 0)]
    # Only jobs of its own GPU count are evidence.
    two_gpus = history(2, 0.5, 0.5, 0.5, 0.5, 0.5)
    assert GandivaPolicy().decide(_view(two_gpus, served)) == []
    five = history(1, 0.5, 1.0, 1.5, 100.0, 100.0)
    assert GandivaPolicy().decide(_view(five, served)) == [Slice(3, 0)]
