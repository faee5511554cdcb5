"""Charging: provisional at grant, replaced by the measured usage once; stale and late reports;
requests are idempotent; a clock that steps back corrupts nothing."""

import math

import pytest

from gpuloom.policies.tokens import Decision

from .helpers import only, scheduler, share


def used(s, client_id: str, now: float) -> float:
    return s.snapshot(now).clients[client_id].used_s


def test_a_grant_is_charged_in_full_until_the_usage_replaces_it_once() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.5))
    lease = only(s.request("a", 0.0).granted)
    assert used(s, "a", 0.0) == pytest.approx(0.02)
    s.release("a", lease.lease_id, 0.005, None, 0.01)
    assert used(s, "a", 0.01) == pytest.approx(0.005)
    # A second report for the same lease changes nothing.
    s.report_usage("a", lease.lease_id, 0.5, None, 0.011)
    s.release("a", lease.lease_id, 0.5, None, 0.012)
    snap = s.snapshot(0.012).clients["a"]
    assert snap.used_s == pytest.approx(0.005)
    assert snap.total_gpu_s == pytest.approx(0.005)
    assert snap.leases_granted == 1


def test_an_expired_lease_keeps_its_charge_until_a_late_report_adjusts_it() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.5))
    lease = only(s.request("a", 0.0).granted)
    assert s.advance(lease.expires_at).ended == (lease,)
    assert used(s, "a", 0.03) == pytest.approx(0.02)
    # A release arriving after expiry is stale: it ends nothing but still charges.
    stale = s.release("a", lease.lease_id, 0.03, None, 0.04)
    assert stale == Decision()
    assert used(s, "a", 0.04) == pytest.approx(0.03)


def test_a_report_in_the_next_window_adjusts_the_carried_charge() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.02))
    lease = only(s.request("a", 0.99).granted)  # charged 0.02, all of its limit
    s.advance(1.0)
    assert used(s, "a", 1.0) == 0.0
    s.report_usage("a", lease.lease_id, 0.05, None, 1.001)  # 0.03 more than charged
    assert used(s, "a", 1.001) == pytest.approx(0.03)
    s.report_usage("a", lease.lease_id + 7, 0.003, None, 1.002)  # unknown: charged in full
    assert used(s, "a", 1.002) == pytest.approx(0.033)


def test_a_report_that_lowers_the_charge_unblocks_the_client_at_once() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.02))
    lease = only(s.request("a", 0.0).granted)
    s.advance(lease.expires_at)
    assert s.request("a", 0.03) == Decision()
    assert s.snapshot(0.03).clients["a"].state == "blocked"
    assert s.next_deadline() == 1.0
    s.report_usage("a", lease.lease_id, 0.005, None, 0.04)
    assert s.next_deadline() == 0.04  # advance now: it is no longer blocked
    again = only(s.advance(0.04).granted)
    assert again.length_s == pytest.approx(0.015)


def test_open_ended_leases_are_charged_their_usage_or_their_elapsed_time() -> None:
    s = scheduler("exclusive", share("a"), share("b"))
    a = only(s.request("a", 0.0).granted)
    assert a.expires_at == math.inf
    assert used(s, "a", 0.0) == 0.0
    s.request("b", 0.1)
    b = only(s.release("a", a.lease_id, 0.25, None, 0.4).granted)
    assert used(s, "a", 0.4) == pytest.approx(0.25)
    s.remove_client("b", 0.7)
    # b is gone; a later report for its lease is for an unknown client.
    with pytest.raises(KeyError):
        s.report_usage("b", b.lease_id, 0.1, None, 0.8)


def test_remove_charges_the_elapsed_time_of_the_lease() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.5), share("b", 100, 0.5))
    s.request("a", 0.0)
    lease = s.snapshot(0.0).clients["a"].lease
    assert lease is not None
    s.request("b", 0.0)
    decision = s.remove_client("a", 0.005)
    assert decision.ended == (lease,)
    # The charge record of a removed lease says 5 ms, not the 20 ms granted.
    assert s._charges[lease.lease_id].provisional == pytest.approx(0.005)


def test_requests_are_idempotent_while_waiting_or_holding() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.5), share("b", 100, 0.5))
    a = only(s.request("a", 0.0).granted)
    assert s.request("a", 0.001) == Decision()
    s.request("b", 0.002)
    assert s.request("b", 0.003) == Decision()
    snap = s.snapshot(0.003)
    assert snap.waiting == ("b",)
    assert snap.clients["a"].leases_granted == 1
    assert snap.clients["a"].used_s == pytest.approx(0.02)
    # Once its lease has expired, a request is an ordinary one: it queues behind b.
    decision = s.request("a", a.expires_at)
    assert decision.ended == (a,)
    assert only(decision.granted).client_id == "b"
    assert s.snapshot(a.expires_at).waiting == ("a",)


def test_a_client_may_appear_in_ended_and_granted_of_one_decision() -> None:
    s = scheduler("spatiotemporal", share("a", 50, 0.5))
    a = only(s.request("a", 0.0).granted)
    decision = s.request("a", a.expires_at + 0.001)
    assert decision.ended == (a,)
    again = only(decision.granted)
    assert again.client_id == "a" and again.lease_id == a.lease_id + 1


def test_a_clock_stepping_back_is_taken_as_the_latest_time() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.5), share("b", 100, 0.5))
    a = only(s.request("a", 5.0).granted)
    s.request("b", 4.0)
    assert s.advance(1.0) == Decision()
    assert s.next_deadline() == pytest.approx(a.expires_at)
    assert a.granted_at == 5.0
    b = only(s.release("a", a.lease_id, 0.001, None, 2.0).granted)
    assert b.granted_at == 5.0
    assert s.snapshot(0.0).now == 5.0
    assert s.snapshot(0.0).window_start == 5.0


def test_next_deadline_covers_expiries_and_the_window_end() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.5), share("b", 100, 0.5))
    assert s.next_deadline() is None
    a = only(s.request("a", 0.0).granted)
    assert s.next_deadline() == a.expires_at
    s.release("a", a.lease_id, 0.001, None, 0.001)
    assert s.next_deadline() is None
    s.request("a", 0.002)
    s.request("b", 0.003)  # waits: the window end matters too, but the expiry comes first
    assert s.next_deadline() == pytest.approx(0.022)
