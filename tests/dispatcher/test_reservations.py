"""The reservation book: admission control, idempotency, one-time tokens, persistence."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.domain.errors import AlreadyExists, FailedPrecondition, ResourceExhausted
from gpuloom.domain.shares import share_of
from gpuloom.services.dispatcher.domain import BoundProcess, ReserveSpec
from gpuloom.services.dispatcher.reservations import ReservationBook
from gpuloom.shimwire import ShimMode

GIB = 1 << 30


def spec(
    assignment_id: str = "a",
    memory_gib: int = 1,
    request: float = 20,
    limit: float | None = None,
    sm: int = 50,
    mode: ShimMode = ShimMode.SHARE,
) -> ReserveSpec:
    share = share_of(sm, request, limit, memory_gib * GIB, priority=3)
    return ReserveSpec(assignment_id, "job", share, mode)


def test_memory_zero_means_the_whole_gpu_and_leaves_nothing_for_others() -> None:
    book = ReservationBook(16 * GIB, None)
    whole, created = book.reserve(spec("whole", memory_gib=0))
    assert created and whole.memory_cap_bytes == 16 * GIB
    with pytest.raises(ResourceExhausted, match="not enough GPU memory"):
        book.reserve(spec("more", memory_gib=1))


def test_only_share_mode_counts_against_the_gpu_area() -> None:
    book = ReservationBook(16 * GIB, None)
    book.reserve(spec("s", request=90, sm=100))
    book.reserve(spec("m", request=90, sm=100, mode=ShimMode.MEASURE))
    with pytest.raises(ResourceExhausted, match="over-committed"):
        book.reserve(spec("t", request=20, sm=100))
    assert book.quota_reserved_percent() == 90


def test_shares_on_disjoint_sms_may_each_hold_most_of_the_window() -> None:
    # FaST-GShare: two 50 % SM partitions can both run 90 % of the time; a third cannot.
    book = ReservationBook(16 * GIB, None)
    book.reserve(spec("left", request=90, sm=50))
    book.reserve(spec("right", request=90, sm=50))
    with pytest.raises(ResourceExhausted, match=r"10% of its \(SM x time quota\) area is free"):
        book.reserve(spec("third", request=30, sm=50))
    book.reserve(spec("small", request=20, sm=50))


def test_a_token_binds_to_its_first_process_only() -> None:
    book = ReservationBook(16 * GIB, None)
    reservation, _ = book.reserve(spec())
    first = BoundProcess(pid=100, start_ticks=5, uid=1000)
    assert book.bind(reservation.assignment_id, first).bound == first
    assert book.bind(reservation.assignment_id, first).bound == first  # reconnect
    with pytest.raises(FailedPrecondition, match="already used by pid 100"):
        book.bind(reservation.assignment_id, BoundProcess(pid=101, start_ticks=5, uid=1000))
    # A recycled pid is a different process.
    with pytest.raises(FailedPrecondition):
        book.bind(reservation.assignment_id, BoundProcess(pid=100, start_ticks=9, uid=1000))


def test_a_token_of_an_exited_process_goes_to_a_restart_of_the_same_user_only() -> None:
    book = ReservationBook(16 * GIB, None)
    reservation, _ = book.reserve(spec())
    first = BoundProcess(pid=100, start_ticks=5, uid=1000)
    book.bind(reservation.assignment_id, first)
    restart = BoundProcess(pid=200, start_ticks=8, uid=1000)
    with pytest.raises(FailedPrecondition, match="already used by pid 100"):
        book.bind(reservation.assignment_id, restart, alive=lambda p: True)  # still runs
    stranger = BoundProcess(pid=300, start_ticks=9, uid=1001)
    with pytest.raises(FailedPrecondition, match="same user"):
        book.bind(reservation.assignment_id, stranger, alive=lambda p: False)
    assert book.bind(reservation.assignment_id, restart, alive=lambda p: False).bound == restart
    # The restart holds it now: the first process's pid back (recycled) is another process.
    with pytest.raises(FailedPrecondition, match="already used by pid 200"):
        book.bind(reservation.assignment_id, first, alive=lambda p: p == restart)


def test_tokens_are_unique_across_assignments() -> None:
    book = ReservationBook(16 * GIB, None)
    first, _ = book.reserve(spec("a"))
    second, _ = book.reserve(spec("b"))
    assert first.token != second.token and len(first.token) >= 32
    with pytest.raises(AlreadyExists, match="assignment_token"):
        book.reserve(ReserveSpec("c", "", first.share, ShimMode.SHARE, first.token))


def test_the_book_survives_a_restart_with_its_bindings(tmp_path: Path) -> None:
    path = tmp_path / "reservations.json"
    book = ReservationBook(16 * GIB, path)
    kept, _ = book.reserve(spec("kept", request=30, limit=60, sm=25))
    gone, _ = book.reserve(spec("gone"))
    book.bind("kept", BoundProcess(42, 7, 1000))
    book.release("gone")

    again = ReservationBook(16 * GIB, path)
    (restored,) = again.all()
    assert restored.assignment_id == "kept" and restored.share == kept.share
    assert restored.bound == BoundProcess(42, 7, 1000)
    assert again.by_token(kept.token) == restored and again.by_token(gone.token) is None
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "content", ["{not json", '{"version": 99, "reservations": []}', '{"version": 1}']
)
def test_a_damaged_file_stops_the_dispatcher_instead_of_forgetting(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "reservations.json"
    path.write_text(content)
    with pytest.raises(RuntimeError, match="cannot read the reservations file"):
        ReservationBook(16 * GIB, path)


def test_a_file_with_impossible_values_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "reservations.json"
    book = ReservationBook(16 * GIB, path)
    book.reserve(spec("a"))
    document = json.loads(path.read_text())
    document["reservations"][0]["share"]["sm_percent"] = 250
    path.write_text(json.dumps(document))
    with pytest.raises(RuntimeError, match="sm_percent"):
        ReservationBook(16 * GIB, path)


operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release"]),
        st.integers(0, 7),  # assignment id
        st.integers(0, 20),  # memory GiB
        st.floats(1, 100),  # quota request
        st.integers(1, 100),  # SM percent
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_never_over_commits_memory_or_gpu_area(ops: list[tuple[str, int, int, float, int]]) -> None:
    book = ReservationBook(40 * GIB, None)
    for action, number, memory, request, sm in ops:
        before = book.all()
        if action == "release":
            book.release(f"a{number}")
            continue
        try:
            book.reserve(spec(f"a{number}", memory_gib=memory, request=request, sm=sm))
        except (ResourceExhausted, AlreadyExists):
            assert book.all() == before  # refused: nothing changed
        assert book.memory_reserved_bytes() <= 40 * GIB
        area = sum(r.share.sm_percent * r.share.quota.request_percent for r in book.all())
        assert area <= 100 * 100 * (1 + 1e-6)


def test_the_file_of_tokens_is_private_to_the_dispatcher_user(tmp_path: Path) -> None:
    """Every token is in the file: 0600 in a 0700 directory, even where an older dispatcher
    left a world-readable file and directory, and under a permissive umask."""
    state_dir = tmp_path / "gpu-0"
    state_dir.mkdir(mode=0o755)
    path = state_dir / "reservations.json"
    ReservationBook(16 * GIB, path).reserve(spec("old"))
    path.chmod(0o644)
    state_dir.chmod(0o755)
    previous = os.umask(0)
    try:
        book = ReservationBook(16 * GIB, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        book.reserve(spec("new"))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert {r.assignment_id for r in ReservationBook(16 * GIB, path).all()} == {"old", "new"}


def test_a_new_state_directory_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "dispatcher" / "gpu-0" / "reservations.json"
    ReservationBook(16 * GIB, path).reserve(spec("a"))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
