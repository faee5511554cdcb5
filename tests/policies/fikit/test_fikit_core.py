"""The FIKIT decision core (shim/src/fikit.c) through its ctypes binding: every rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.fikit import MAX_TASKS, UNKNOWN, FikitConfig, FikitCore
from gpuloom.policies.fikit.core import default_config

US = 1_000
HI, LO, MID = 0, 1, 2


def make(**config: int) -> FikitCore:
    core = FikitCore(FikitConfig(**config))
    assert core.add_task(HI, 0, 0)
    assert core.add_task(LO, 5, 0)
    return core


def test_defaults_match_the_header() -> None:
    assert default_config() == FikitConfig(100 * US, 200 * US, 0, 0)


def test_bad_config_and_bad_tasks_are_refused() -> None:
    with pytest.raises(ValueError):
        FikitCore(FikitConfig(gap_threshold_ns=2**62))
    core = FikitCore()
    assert not core.add_task(MAX_TASKS, 0, 0)
    assert not core.add_task(0, 10, 0)
    assert core.add_task(0, 9, 0)
    assert not core.add_task(0, 3, 0)  # taken
    assert core.request(7, 10, 10, 0) == -1  # not a task
    assert core.counters().rejected_calls == 4


def test_holder_is_admitted_at_once_and_equal_priorities_interleave() -> None:
    core = make()
    assert core.add_task(MID, 0, 0)
    for now in range(0, 10 * US, US):
        assert core.request(HI, 50 * US, 10 * US, now) == 1
        assert core.request(MID, 50 * US, 10 * US, now) == 1


def test_a_fill_goes_only_into_a_gap_window_it_fits() -> None:
    core = make()
    assert core.request(HI, 100 * US, 500 * US, 0) == 1
    assert core.window_end() == 600 * US  # tail 100 us + gap 500 us
    assert core.request(LO, 600 * US, 0, 0) == 0  # past the window end
    assert core.decide(0)[0] == []
    core.remove_task(LO, 0)
    assert core.add_task(LO, 5, 0)
    assert core.request(LO, 400 * US, 0, 0) == 0
    assert core.decide(0)[0] == [LO]
    assert core.tail() == 500 * US
    assert core.counters().granted_window == 1


def test_a_window_fill_leaves_the_guard_free_before_the_window_ends() -> None:
    """fill_guard_ns: room for the filler's own delay between its grant and its launch."""
    core = make(fill_guard_ns=50 * US)
    assert core.request(HI, 100 * US, 500 * US, 0) == 1  # window ends at 600 us
    assert core.request(LO, 451 * US, 0, 0) == 0  # ends at 551 us: within 50 us of the end
    assert core.decide(0)[0] == []
    assert core.next_fill() == (LO, 501 * US)  # the least gap that fits it with the guard
    core.remove_task(LO, 0)
    assert core.add_task(LO, 5, 0)
    assert core.request(LO, 450 * US, 0, 0) == 0
    assert core.decide(0)[0] == [LO]
    assert core.tail() == 550 * US


def test_short_gaps_and_unknown_kernels_open_no_fill() -> None:
    core = make()
    core.request(HI, 100 * US, 50 * US, 0)  # gap below the 100 us threshold
    assert core.window_end() is None
    core.request(LO, 10 * US, 0, 0)
    assert core.decide(0)[0] == []
    core = make()
    core.request(HI, 100 * US, 500 * US, 0)
    assert core.request(LO, UNKNOWN, 0, 0) == 0
    assert core.decide(0)[0] == []  # no fill for unknown kernels
    assert core.counters().unknown_requests == 1


def test_best_priority_then_longest_waiting() -> None:
    core = make()
    for task, priority in ((2, 3), (3, 3), (4, 7)):
        assert core.add_task(task, priority, 0)
    core.request(HI, 10 * US, 10_000 * US, 0)
    core.request(4, 10 * US, 0, 1)
    core.request(3, 10 * US, 0, 2)
    core.request(2, 10 * US, 0, 3)
    core.request(LO, 10 * US, 0, 4)
    granted, _ = core.decide(5)
    assert granted == [3, 2, LO, 4]


def test_early_stop_closes_the_window() -> None:
    core = make()
    core.request(HI, 100 * US, 1_000 * US, 0)
    core.request(HI, 100 * US, 50 * US, 150 * US)  # the holder is back early
    assert core.window_end() is None
    assert core.counters().windows_closed_early == 1
    core.request(LO, 10 * US, 0, 150 * US)
    assert core.decide(150 * US)[0] == []


def test_task_switching() -> None:
    core = FikitCore()
    assert core.add_task(LO, 5, 0)
    assert core.request(LO, 100 * US, 0, 0) == 1  # alone: the holder
    assert core.add_task(HI, 0, 10)
    assert core.holder_priority() == 0
    assert core.request(LO, 100 * US, 0, 20) == 0  # now a fill candidate
    assert core.outstanding(LO) == 1  # what it had admitted stays admitted
    assert core.request(HI, 50 * US, 400 * US, 30) == 1
    assert core.decide(30)[0] == [LO]  # fits the new holder's gap
    core.remove_task(HI, 40)
    assert core.holder_priority() == 5
    assert core.request(LO, 100 * US, 0, 50) == 1


def test_idle_holder_lets_one_kernel_at_a_time() -> None:
    core = make()
    core.request(HI, 100 * US, UNKNOWN, 0)
    core.completed(HI, 1, 100 * US)
    core.request(LO, 5_000 * US, 0, 100 * US)
    granted, wake = core.decide(100 * US)
    assert granted == [] and wake == 300 * US  # the completion + margin
    assert core.decide(300 * US)[0] == [LO]
    core.request(LO, 10 * US, 0, 301 * US)
    granted, wake = core.decide(302 * US)
    assert granted == [] and wake is None  # waits for the completion, not a timer
    core.completed(LO, 1, 5_300 * US)
    assert core.decide(5_300 * US)[0] == [LO]
    assert core.counters().granted_idle == 2


def test_idle_backlog_bounds_outstanding_fill() -> None:
    core = make(idle_backlog_ns=100 * US)
    assert core.add_task(MID, 5, 0)
    core.decide(10_000 * US)  # the holder never launched: idle after the margin
    core.request(LO, 60 * US, 0, 10_000 * US)
    core.request(MID, 60 * US, 0, 10_000 * US)
    assert core.decide(10_000 * US)[0] == [LO]  # 60 + 60 > 100: only one
    core.completed(LO, 1, 10_060 * US)
    assert core.decide(10_060 * US)[0] == [MID]


def test_unknown_fill_goes_alone_when_idle() -> None:
    core = make(idle_backlog_ns=10_000 * US)
    assert core.add_task(MID, 5, 0)
    core.request(LO, UNKNOWN, 0, 1_000 * US)
    core.request(MID, 10 * US, 0, 1_001 * US)
    assert core.decide(1_001 * US)[0] == [LO]
    core.completed(LO, 1, 2_000 * US)
    assert core.decide(2_000 * US)[0] == [MID]


def test_max_wait_grants_a_starving_request() -> None:
    core = make(max_wait_ns=1_000 * US)
    core.request(HI, 100 * US, 0, 0)  # no window, holder busy
    core.request(LO, 50 * US, 0, 0)
    granted, wake = core.decide(10)
    assert granted == [] and wake == 1_000 * US
    assert core.decide(1_000 * US)[0] == [LO]
    assert core.counters().granted_starved == 1


def test_remove_drops_the_request_and_outstanding_work() -> None:
    core = make()
    core.request(LO, 50 * US, 0, 0)
    core.remove_task(LO, 1)
    assert core.has_request(LO) is False
    assert core.outstanding(LO) == 0


def test_outstanding_beyond_the_fifo_counts_as_unknown() -> None:
    core = FikitCore()
    assert core.add_task(HI, 0, 0)
    for i in range(70):
        assert core.request(HI, 10, 10, i) == 1
    assert core.outstanding(HI) == 70
    assert core.counters().overflowed == 6
    core.completed(HI, 1_000, 100)  # clamped
    assert core.outstanding(HI) == 0


# -- properties ----------------------------------------------------------------------------

ids = st.integers(min_value=-2, max_value=MAX_TASKS + 2)
times = st.integers(min_value=0, max_value=10**10)
durations = st.one_of(st.just(UNKNOWN), st.integers(0, 2 * 10**11))
calls = st.lists(
    st.one_of(
        st.tuples(st.just("add"), ids, st.integers(-1, 11), times),
        st.tuples(st.just("remove"), ids, times),
        st.tuples(st.just("request"), ids, durations, durations, times),
        st.tuples(st.just("completed"), ids, st.integers(0, 2**32 - 1), times),
        st.tuples(st.just("decide"), times),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(calls)
def test_random_calls_never_crash_and_hold_the_rules(sequence: list[tuple]) -> None:
    core = FikitCore()
    priorities: dict[int, int] = {}
    for call in sequence:
        kind, *args = call
        if kind == "add":
            task, priority, now = args
            ok = core.add_task(task % 2**32, priority % 2**32, now)
            assert ok == (0 <= task < MAX_TASKS and 0 <= priority < 10 and task not in priorities)
            if ok:
                priorities[task] = priority
        elif kind == "remove":
            core.remove_task(args[0] % 2**32, args[1])
            priorities.pop(args[0], None)
        elif kind == "request":
            task, duration, gap, now = args
            holder = core.holder_priority()
            verdict = core.request(task % 2**32, duration, gap, now)
            if task in priorities and priorities[task] == holder:
                assert verdict == 1  # a holder request is always admitted at once
        elif kind == "completed":
            core.completed(args[0] % 2**32, args[1], args[2])
        else:
            granted, wake = core.decide(args[0])
            assert all(0 <= g < MAX_TASKS and g in priorities for g in granted)
            assert len(set(granted)) == len(granted)
            assert wake is None or wake >= 0
        expected = min(priorities.values()) if priorities else None
        assert core.holder_priority() == expected


@settings(max_examples=200, deadline=None)
@given(
    gap=st.integers(100_000, 5_000_000),
    requests=st.lists(
        st.tuples(st.integers(1, 9), st.integers(1, 3_000_000)), min_size=1, max_size=20
    ),
)
def test_window_fills_fit_and_keep_priority_order(gap: int, requests: list) -> None:
    core = FikitCore()
    assert core.add_task(0, 0, 0)
    for task, (priority, _) in enumerate(requests, 1):
        assert core.add_task(task, priority, 0)
    core.request(0, 50_000, gap, 0)
    window = core.window_end()
    for task, (_, duration) in enumerate(requests, 1):
        assert core.request(task, duration, 0, 1) == 0
    granted, _ = core.decide(2)
    assert core.tail() <= window  # nothing granted past the window's end
    end = 50_000
    for task in granted:
        end += requests[task - 1][1]
    assert end == core.tail()
    # Priorities never inverted among fits: at each grant, no better waiting request fit.
    tail = 50_000
    left = {t: requests[t - 1] for t in range(1, len(requests) + 1)}
    for task in granted:
        best = min((p, t) for t, (p, d) in left.items() if tail + d <= window)
        assert requests[task - 1][0] == best[0]
        tail += left.pop(task)[1]


def test_a_launch_reported_after_the_fact_is_the_holders_or_fill_work() -> None:
    core = make()
    # The holder's launch, reported after it ran: admitted as its request would be.
    assert core.launched(HI, 100 * US, 500 * US, 0) == 1
    assert core.window_end() == 600 * US
    # A better task arrived while LO (the holder a moment ago) launched: fill work in flight.
    core.remove_task(HI, 10)
    assert core.add_task(HI, 0, 10)
    assert core.launched(LO, 50 * US, 0, 20) == 0
    assert core.outstanding(LO) == 1
    assert core.counters().launched_unadmitted == 1
    # A task with a queued request cannot also report a launch.
    assert core.request(LO, 50 * US, 0, 30) == 0
    assert core.launched(LO, 50 * US, 0, 30) == -1


# ---- the one-wake-up path: the next window's first fill, decided in advance ----


def test_next_fill_names_the_best_waiting_request_and_the_gap_it_needs() -> None:
    core = make()
    assert core.add_task(MID, 3, 0)
    assert core.add_task(3, 3, 0)
    assert core.next_fill() is None  # nobody waits
    assert core.request(HI, 100 * US, 10 * US, 0) == 1  # a gap below the threshold: no window
    assert core.request(LO, 50 * US, 0, 0) == 0
    # Below the threshold a gap opens no window: the least gap is the threshold.
    assert core.next_fill() == (LO, 100 * US)
    assert core.request(3, UNKNOWN, 0, 0) == 0  # unknown lengths never fill a window
    assert core.next_fill() == (LO, 100 * US)
    assert core.request(MID, 300 * US, 0, 0) == 0  # a better priority
    assert core.next_fill() == (MID, 300 * US)
    assert core.decide(0)[0] == []
    # The holder's next launch with that gap grants it first, as decided.
    assert core.request(HI, 100 * US, 300 * US, 10 * US) == 1
    assert core.decide(10 * US)[0][0] == MID


def test_next_fill_is_none_with_two_holders() -> None:
    core = make()
    assert core.request(LO, 50 * US, 0, 0) == 0
    assert core.next_fill() == (LO, 100 * US)
    assert core.add_task(MID, 0, 0)  # a second task of the holder priority
    assert core.next_fill() is None
    core.remove_task(MID, 0)
    assert core.next_fill() == (LO, 100 * US)


def test_release_admits_a_queued_request_as_fill() -> None:
    core = make()
    assert core.request(HI, 100 * US, 10 * US, 0) == 1
    assert core.request(LO, 50 * US, 0, 0) == 0
    assert not core.release(HI, 0)  # the holder has nothing queued, and holds
    assert core.release(LO, 5 * US)
    assert not core.has_request(LO)
    assert core.outstanding(LO) == 1
    assert core.tail() == 150 * US  # after the holder's 100 us
    assert not core.release(LO, 5 * US)  # nothing queued any more
    counters = core.counters()
    assert counters.granted_released == 1 and counters.rejected_calls == 2


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 9),
            st.sampled_from([UNKNOWN, 20 * US, 80 * US, 150 * US, 400 * US, 900 * US]),
        ),
        min_size=1,
        max_size=8,
    ),
    gap=st.sampled_from([0, 50 * US, 100 * US, 150 * US, 399 * US, 400 * US, 2_000 * US]),
    holder_kernel=st.sampled_from([1 * US, 60 * US, 500 * US]),
    guard=st.sampled_from([0, 50 * US, 250 * US]),
)
def test_next_fill_is_what_the_next_window_grants_first(
    requests: list[tuple[int, int]], gap: int, holder_kernel: int, guard: int
) -> None:
    """The arm's promise: after the holder's next launch (gap g), decide grants next_fill's
    request first exactly when g >= its least gap (the fill guard included)."""
    core = FikitCore(FikitConfig(gap_threshold_ns=100 * US, fill_guard_ns=guard))
    assert core.add_task(0, 0, 0)
    assert core.request(0, 300 * US, 10 * US, 0) == 1  # busy, no window
    for task, (priority, duration) in enumerate(requests, start=1):
        assert core.add_task(task, priority, 0)
        assert core.request(task, duration, 0, task) == 0
    assert core.decide(10)[0] == []
    planned = core.next_fill()
    if all(duration == UNKNOWN for _, duration in requests):
        assert planned is None
        return
    assert planned is not None
    task, least = planned
    assert core.request(0, holder_kernel, gap, 20 * US) == 1
    grants, _ = core.decide(20 * US)
    assert (bool(grants) and grants[0] == task) == (gap >= least)


def test_next_asker_is_the_unique_best_filler_with_nothing_queued() -> None:
    core = make()
    assert core.next_asker() == LO  # the only filler, nothing queued
    assert core.request(HI, 100 * US, 10 * US, 0) == 1
    assert core.request(LO, 50 * US, 0, 0) == 0
    assert core.next_asker() is None  # it has a request queued: next_fill's case
    assert core.next_fill() == (LO, 100 * US)
    assert core.add_task(MID, 3, 0)
    assert core.next_asker() == MID  # better than anything queued or to come
    assert core.add_task(3, 3, 0)
    assert core.next_asker() is None  # a tie: the other one may ask first
    core.remove_task(3, 0)
    assert core.add_task(3, 0, 0)  # a second holder task
    assert core.next_asker() is None
