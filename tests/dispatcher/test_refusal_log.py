"""The refusal log's rate per user (services/dispatcher/refusal_log.py): a burst, then the
refill rate; what is left out is counted and said with the next line; users apart."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuloom.services.dispatcher.refusal_log import RefusalLog


def test_a_burst_then_the_refill_rate_and_the_left_out_said_with_the_next_line() -> None:
    log = RefusalLog(burst=3, per_s=1.0)
    assert [log.admit(7, 0.0) for _ in range(5)] == [0, 0, 0, None, None]
    assert log.admit(8, 0.0) == 0  # another user has a bucket of its own
    assert log.admit(7, 0.5) is None
    assert log.admit(7, 1.0) == 3  # one token refilled: logged, saying 3 were left out
    assert log.admit(7, 1.1) is None
    assert log.admit(7, 100.0) == 1  # refilled, to the burst at most
    assert [log.admit(7, 100.0) for _ in range(3)] == [0, 0, None]


def test_users_beyond_the_limit_are_forgotten_least_recent_first() -> None:
    log = RefusalLog(burst=1, per_s=0.0, max_users=2)
    assert log.admit(1, 0.0) == 0 and log.admit(1, 0.0) is None
    log.admit(2, 0.0)
    log.admit(3, 0.0)  # user 1 is forgotten: it starts again with a full bucket
    assert log.admit(1, 0.0) == 0


@given(
    times=st.lists(st.floats(0, 60, allow_nan=False), min_size=1, max_size=400),
    burst=st.integers(1, 10),
    per_s=st.floats(0.01, 5),
)
def test_lines_never_exceed_the_burst_plus_the_refill(
    times: list[float], burst: int, per_s: float
) -> None:
    log = RefusalLog(burst=burst, per_s=per_s)
    times.sort()
    answers = [log.admit(42, t) for t in times]
    logged = [a for a in answers if a is not None]
    assert len(logged) <= burst + per_s * (times[-1] - times[0]) + 1e-9
    # Every refusal is either logged or said later, none lost: what the lines say adds up to
    # the refusals left out before the last line.
    last = max(i for i, a in enumerate(answers) if a is not None)
    left_out_before_last = sum(1 for a in answers[:last] if a is None)
    assert sum(logged) == left_out_before_last
