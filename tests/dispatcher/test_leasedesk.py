"""The native lease desk driven through regions, as shims drive it (gpuloom.shimwire's DeskPort is
the Python reference of the C shim's gl_post_lease_request): renewals from standing terms, what
is forwarded, the budget, and what garbage and floods get."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator

import pytest

from gpuloom.services.dispatcher.admission_engine import (
    FOREVER,
    AdmissionEngine,
    DeskEvent,
    DeskEventKind,
)
from gpuloom.shimwire import (
    OFF_LR_SEQ,
    REGION_BYTES,
    AdmissionRegion,
    AdmissionState,
    DeskPort,
)
from tests.polling import holds_within

MS = 1e-3
NATIVE_BIT = 1 << 62


class Process:
    """One shim's region, registered with the desk."""

    def __init__(self, desk: AdmissionEngine) -> None:
        self.region, self.fd = AdmissionRegion.create("p")
        self.slot = desk.add_leased(self.fd)
        self.mapping = mmap.mmap(self.fd, REGION_BYTES)
        self.port = DeskPort(self.mapping, desk.doorbell_fd)

    def close(self) -> None:
        self.mapping.close()
        self.region.close()
        os.close(self.fd)


@pytest.fixture
def desk() -> Iterator[AdmissionEngine]:
    desk = AdmissionEngine()
    yield desk
    desk.stop()


def taken(desk: AdmissionEngine, count: int) -> list[DeskEvent]:
    """Events until `count` have come (the thread answers asynchronously)."""
    events: list[DeskEvent] = []
    assert holds_within(lambda: events.extend(desk.take()) or len(events) >= count), events
    return events


def give(
    desk: AdmissionEngine, process: Process, lease_s=10 * MS, budget_s=1.0, min_s=2 * MS
) -> None:
    """Terms in a 60 s window (limit 1 s, or the budget if larger)."""
    limit = max(budget_s, 1.0)
    desk.set_terms(process.slot, lease_s, budget_s, min_s, limit, 60.0, time.monotonic() + 60)


def test_without_terms_a_request_is_forwarded_with_its_report_and_nothing_is_written(
    desk: AdmissionEngine,
) -> None:
    process = Process(desk)
    try:
        epoch = process.region.epoch
        process.port.post(report_lease_id=7, gpu_time_ns=3000, longest_burst_ns=2000)
        (event,) = taken(desk, 1)
        assert event.kind is DeskEventKind.FORWARDED and event.slot == process.slot
        assert event.report == (7, 3000, 2000, False) and not event.invalid
        assert process.region.epoch == epoch and process.region.lease_id == 0
        assert desk.lease_stats().forwarded == 1
    finally:
        process.close()


def test_with_terms_the_desk_renews_at_once_and_journals_it(desk: AdmissionEngine) -> None:
    process = Process(desk)
    try:
        give(desk, process, lease_s=10 * MS)
        epoch = process.region.epoch
        before = time.monotonic_ns()
        process.port.post()
        assert holds_within(lambda: process.region.epoch != epoch)
        lease_id = process.region.lease_id
        assert lease_id & NATIVE_BIT and process.region.state is AdmissionState.LEASED
        assert process.region.admitted()
        (event,) = taken(desk, 1)
        assert event.kind is DeskEventKind.RENEWED and event.lease_id == lease_id
        assert event.until_ns == process.region.admit_until_ns
        assert before + 10_000_000 <= event.until_ns <= time.monotonic_ns() + 10_000_000
    finally:
        process.close()


def test_the_budget_bounds_the_leases_and_a_report_gives_back_what_was_not_used(
    desk: AdmissionEngine,
) -> None:
    process = Process(desk)
    try:
        # 25 ms of budget, 10 ms leases, 2 ms at least: 10, 10, 5, then Python decides.
        give(desk, process, lease_s=10 * MS, budget_s=25 * MS)
        lengths = []
        for _ in range(4):
            process.port.post()
            (event,) = taken(desk, 1)
            lengths.append(event.until_ns - event.at_ns if event.lease_id else 0)
        assert [round(n / 1e6) for n in lengths] == [10, 10, 5, 0]
        # New terms; a lease that used 1 ms of its 10 gives 9 back: 10 + 10 + 9 + 1 used.
        give(desk, process, lease_s=10 * MS, budget_s=20 * MS)
        process.port.post()
        (first,) = taken(desk, 1)
        process.port.post(report_lease_id=first.lease_id, gpu_time_ns=1_000_000)
        (second,) = taken(desk, 1)
        assert second.kind is DeskEventKind.RENEWED
        assert round((second.until_ns - second.at_ns) / 1e6) == 10
        process.port.post(report_lease_id=second.lease_id, gpu_time_ns=10_000_000)
        (third,) = taken(desk, 1)
        # 20 - 10 (first) + 9 (its unused part) - 10 (second) = 9 ms left
        assert round((third.until_ns - third.at_ns) / 1e6) == 9
    finally:
        process.close()


def test_open_ended_terms(desk: AdmissionEngine) -> None:
    process = Process(desk)
    try:
        inf = float("inf")
        desk.set_terms(process.slot, inf, inf, 2 * MS, 1.0, 1.0, time.monotonic() + 1)
        process.port.post()
        (event,) = taken(desk, 1)
        assert event.until_ns == FOREVER and process.region.admit_until_ns == FOREVER
    finally:
        process.close()


def test_a_window_end_gives_the_budget_back_as_the_scheduler_does(desk: AdmissionEngine) -> None:
    """Limit 20 ms per 100 ms window, 3 ms left: one 3 ms lease, then nothing until the window
    ends; then the limit is back (used falls by the limit, not below 0)."""
    process = Process(desk)
    try:
        window_end = time.monotonic() + 0.1
        desk.set_terms(process.slot, 10 * MS, 3 * MS, 2 * MS, 20 * MS, 0.1, window_end)
        process.port.post()
        process_lengths = [taken(desk, 1)[0]]
        process.port.post()
        process_lengths += taken(desk, 1)
        assert [e.kind for e in process_lengths] == [DeskEventKind.RENEWED, DeskEventKind.FORWARDED]
        assert round((process_lengths[0].until_ns - process_lengths[0].at_ns) / 1e6) == 3
        time.sleep(max(window_end - time.monotonic(), 0) + 0.005)
        for _ in range(2):  # 10 + 10 of the 20 ms limit
            process.port.post()
            (event,) = taken(desk, 1)
            assert event.kind is DeskEventKind.RENEWED
            assert round((event.until_ns - event.at_ns) / 1e6) == 10
        process.port.post()
        assert taken(desk, 1)[0].kind is DeskEventKind.FORWARDED
    finally:
        process.close()


def test_terms_given_while_events_are_untaken_count_what_those_charged(
    desk: AdmissionEngine,
) -> None:
    """Python computed the budget from the events it took: a renewal it has not taken yet
    comes off the new budget, or the client would be granted that lease twice."""
    process = Process(desk)
    try:
        give(desk, process, lease_s=10 * MS, budget_s=30 * MS)
        process.port.post()
        assert holds_within(lambda: desk.lease_stats().renewed == 1)
        give(desk, process, lease_s=10 * MS, budget_s=30 * MS)  # as if that lease were unknown
        lengths = []
        for _ in range(3):
            process.port.post()
            (event,) = taken(desk, 2 if not lengths else 1)[-1:]
            lengths.append(round((event.until_ns - event.at_ns) / 1e6) if event.lease_id else 0)
        assert lengths == [10, 10, 0]  # 30 - 10 untaken: two more leases, not three
    finally:
        process.close()


def test_after_revoke_all_the_desk_writes_nothing(desk: AdmissionEngine) -> None:
    a, b = Process(desk), Process(desk)
    try:
        give(desk, a)
        give(desk, b)
        desk.revoke_all()
        epochs = (a.region.epoch, b.region.epoch)
        a.port.post()
        b.port.post()
        events = taken(desk, 2)
        assert {e.kind for e in events} == {DeskEventKind.FORWARDED}
        assert (a.region.epoch, b.region.epoch) == epochs
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "garbage",
    [
        {"flags": 0xFFFF_FFFF},
        {"report_lease_id": 3, "gpu_time_ns": 10**19},
        {"report_lease_id": 3, "longest_burst_ns": 2 * 3600 * 10**9},
    ],
    ids=["flags", "gpu-time", "burst"],
)
def test_garbage_request_words_are_forwarded_as_invalid_and_spend_nothing(
    desk: AdmissionEngine, garbage: dict
) -> None:
    bad, good = Process(desk), Process(desk)
    try:
        give(desk, bad)
        give(desk, good)
        epoch = bad.region.epoch
        bad.port.post(**garbage)
        (event,) = taken(desk, 1)
        assert event.kind is DeskEventKind.FORWARDED and event.invalid
        assert bad.region.epoch == epoch  # no lease for garbage
        assert desk.lease_stats().invalid_writes == 1
        good.port.post()
        (event,) = taken(desk, 1)
        assert event.kind is DeskEventKind.RENEWED and event.slot == good.slot
    finally:
        bad.close()
        good.close()


def test_random_bytes_over_the_request_words_never_stop_the_desk(desk: AdmissionEngine) -> None:
    bad, good = Process(desk), Process(desk)
    try:
        give(desk, good)
        for _ in range(200):
            bad.mapping[OFF_LR_SEQ : OFF_LR_SEQ + 40] = os.urandom(40)
            os.eventfd_write(desk.doorbell_fd, 1)
        good.port.post()
        assert holds_within(lambda: good.region.lease_id & NATIVE_BIT)
        assert desk.lease_stats().slots == 2
    finally:
        bad.close()
        good.close()


def test_a_flooding_process_is_throttled_alone(desk: AdmissionEngine) -> None:
    """Python takes no events meanwhile: the flooder's are capped, the other's still come."""
    flood, other = Process(desk), Process(desk)
    try:
        give(desk, flood, budget_s=float("inf"))
        give(desk, other)
        for _ in range(600):
            seen = desk.lease_stats().requests
            flood.port.post()
            assert holds_within(
                lambda seen=seen: desk.lease_stats().requests > seen or desk.lease_stats().throttled
            )
        assert desk.lease_stats().throttled > 0
        other.port.post()
        assert holds_within(lambda: other.region.lease_id & NATIVE_BIT)
        assert desk.lease_stats().pending == 512 + 1  # the flooder's cap, and the other's renewal
        events = desk.take()
        assert any(e.slot == other.slot for e in events)
    finally:
        flood.close()
        other.close()


def test_a_removed_process_takes_its_events_and_its_region_with_it(desk: AdmissionEngine) -> None:
    gone, stays = Process(desk), Process(desk)
    try:
        give(desk, gone)
        give(desk, stays)
        gone.port.post()
        stays.port.post()
        assert holds_within(lambda: desk.lease_stats().requests == 2)
        desk.remove_leased(gone.slot)
        events = desk.take()
        assert [e.slot for e in events] == [stays.slot]
        assert desk.lease_stats().slots == 1
        # Its words no longer reach the desk.
        gone.port.post()
        stays.port.post()
        assert [e.slot for e in taken(desk, 1)] == [stays.slot]
    finally:
        gone.close()
        stays.close()
