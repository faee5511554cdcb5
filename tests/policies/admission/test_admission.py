"""The admission policies as pure modules: the registry, shares validated by field, the
composed policy's rules on small call sequences, and invariants under random call sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.admission import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION,
    ComposedAdmission,
    Kernel,
    TaskShare,
    make_admission,
)
from gpuloom.policies.registry import UnknownPolicyError

MS = 1_000_000
KERNEL = Kernel(200_000, 300_000)  # 0.2 ms, then a 0.3 ms gap: opens a window


def test_registry_finds_every_policy_and_names_them_when_asked_for_another() -> None:
    assert DEFAULT_ADMISSION == "composed"
    for name in ADMISSION_POLICIES:
        assert make_admission(name).name == name
    with pytest.raises(UnknownPolicyError) as caught:
        make_admission("fastest")
    assert "unknown admission policy 'fastest'" in str(caught.value)
    assert "composed" in str(caught.value) and "fikit" in str(caught.value)


@pytest.mark.parametrize(
    ("share", "field"),
    [
        (TaskShare(10), "priority"),
        (TaskShare(True), "priority"),
        (TaskShare(0, sm_percent=0), "sm_percent"),
        (TaskShare(0, quota_request=0.0), "quota_request"),
        (TaskShare(0, quota_limit=1.5), "quota_limit"),
        (TaskShare(0, quota_request=0.6, quota_limit=0.5), "quota_limit (0.5) must be >="),
    ],
)
def test_a_bad_share_is_refused_naming_the_field(share: TaskShare, field: str) -> None:
    policy = ComposedAdmission()
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        policy.add_task(0, share, 0)
    # Nothing was added: the same slot takes a good share afterwards.
    policy.add_task(0, TaskShare(0), 0)


def test_the_best_level_launches_at_once_and_a_lower_one_waits_for_its_gap() -> None:
    policy = ComposedAdmission()
    policy.add_task(0, TaskShare(1), 0)
    policy.add_task(1, TaskShare(8), 0)
    assert policy.launch(0, KERNEL, 1_000)  # the holder: at once
    assert not policy.launch(1, Kernel(100_000, None), 1_000)  # a filler: into a gap
    # The holder's kernel ends (the window is re-based on its real end): the fill fits.
    policy.completed(0, 200_000, 201_000)
    granted, _ = policy.decide(201_000)
    assert list(granted) == [1]
    assert policy.counters()["granted_window"] == 1


def test_a_spent_limit_stops_even_the_best_level_until_the_next_window() -> None:
    policy = ComposedAdmission()
    policy.add_task(0, TaskShare(0, quota_request=0.1, quota_limit=0.1), 0)
    assert policy.launch(0, KERNEL, 0)
    # It ran its whole limit (100 ms of a 1 s window) on the device.
    policy.completed(0, 100 * MS, 100 * MS)
    granted, wake = policy.decide(100 * MS)
    # Its first lease (20 ms) has lapsed and been charged what the kernel ran: no new one.
    assert not policy.launch(0, KERNEL, 101 * MS)
    granted, wake = policy.decide(101 * MS)
    assert list(granted) == [] and wake is not None and wake <= 1_000 * MS
    granted, _ = policy.decide(1_000 * MS)
    assert list(granted) == [0]


def test_equal_levels_take_turns_by_lease_as_token_sharing_does() -> None:
    policy = ComposedAdmission()
    policy.add_task(0, TaskShare(3), 0)
    policy.add_task(1, TaskShare(3), 0)
    assert policy.launch(0, KERNEL, 0)
    assert not policy.launch(1, KERNEL, 0)  # one lease at a time (SM 100 each)
    policy.idle(0, 5 * MS)  # task 0 is done: its lease goes back, task 1 gets one
    granted, _ = policy.decide(5 * MS)
    assert list(granted) == [1]
    assert policy.core.counters().queued == 0  # one level: FIKIT admits every kernel at once


def test_add_task_add_twice_is_refused() -> None:
    policy = ComposedAdmission()
    policy.add_task(0, TaskShare(0), 0)
    with pytest.raises(ValueError, match="already exists"):
        policy.add_task(0, TaskShare(1), 0)


def test_guarantee_slack_is_checked() -> None:
    with pytest.raises(ValueError, match="guarantee_slack"):
        ComposedAdmission(guarantee_slack=2.0)


# -- random call sequences ----------------------------------------------------------------

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
priorities = st.sampled_from([0, 3, 3, 8])
fractions = st.sampled_from([0.05, 0.2, 0.5, 1.0])
share_of = st.builds(
    lambda p, sm, q: TaskShare(p, sm, min(q), max(q)),
    priorities,
    st.sampled_from([30, 50, 100]),
    st.tuples(fractions, fractions),
)
operations = st.lists(
    st.tuples(
        st.sampled_from(["launch", "launch", "complete", "idle", "decide"]),
        st.integers(0, 3),
        st.integers(0, 30 * MS),  # time step
        st.sampled_from([None, 50_000, 200_000, 2 * MS]),  # duration predicted
        st.sampled_from([None, 10_000, 300_000]),  # gap predicted
    ),
    max_size=80,
)


@FAST
@given(shares=st.lists(share_of, min_size=1, max_size=4), ops=operations)
def test_composed_never_launches_without_a_lease_nor_grants_one_not_waiting(
    shares: list[TaskShare], ops: list
) -> None:
    policy = ComposedAdmission()
    for task, share in enumerate(shares):
        policy.add_task(task, share, 0)
    one_level = len({s.priority for s in shares}) == 1
    now = 0
    waiting: set[int] = set()
    in_flight = dict.fromkeys(range(len(shares)), 0)
    for op, task, step, duration, gap in ops:
        now += step
        task %= len(shares)
        level = policy._levels[shares[task].priority]
        if op == "launch" and task not in waiting:
            if policy.launch(task, Kernel(duration, gap), now):
                assert level.holds(task) or policy.promoted(task, now)
                in_flight[task] += 1
            else:
                waiting.add(task)
        elif op == "complete" and in_flight[task]:
            in_flight[task] -= 1
            policy.completed(task, duration or 100_000, now)
        elif op == "idle" and task not in waiting and not in_flight[task]:
            policy.idle(task, now)
        granted, wake = policy.decide(now)
        assert len(set(granted)) == len(granted)
        assert set(granted) <= waiting
        waiting -= set(granted)
        for t in granted:
            in_flight[t] += 1
        assert wake is None or wake >= now
        if one_level:
            # With one level it is token sharing: FIKIT never queues a request.
            assert policy.core.counters().queued == 0


@pytest.mark.parametrize(("backlog_ns", "second_at_once"), [(150_000, True), (0, False)])
def test_while_the_holder_idles_a_fillers_next_kernel_is_granted_before_its_last_one_ends(
    backlog_ns: int, second_at_once: bool
) -> None:
    policy = ComposedAdmission(idle_backlog_ns=backlog_ns)
    policy.add_task(0, TaskShare(1), 0)  # the holder: never launches, idle after its margin
    policy.add_task(1, TaskShare(8), 0)
    assert not policy.launch(1, Kernel(100_000, 10_000), 300_000)
    granted, _ = policy.decide(300_000)
    assert list(granted) == [1]  # the holders idle: one kernel always may go
    # Its next kernel asks while the first still runs: within 150 us of fill work it goes now,
    # so no launch gap opens between the two; with no backlog it waits for the first to end.
    assert not policy.launch(1, Kernel(40_000, 10_000), 310_000)
    granted, _ = policy.decide(310_000)
    assert (list(granted) == [1]) is second_at_once
    policy.completed(1, 100_000, 400_000)
    granted, _ = policy.decide(400_000)
    assert list(granted) == ([] if second_at_once else [1])
