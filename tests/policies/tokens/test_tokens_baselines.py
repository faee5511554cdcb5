"""The exclusive and FIFO baselines: one client at a time, quotas and SMs ignored."""

import math

import pytest

from gpuloom.policies.tokens import Decision

from .helpers import only, scheduler, share


def test_exclusive_gives_the_longest_waiter_an_open_ended_lease() -> None:
    # Tiny quotas and partitions: the baseline must ignore them.
    s = scheduler("exclusive", share("a", 10, 0.01), share("b", 10, 0.01), share("c", 10, 0.01))
    a = only(s.request("a", 0.0).granted)
    assert a.expires_at == math.inf
    s.request("c", 0.1)
    s.request("b", 0.2)
    assert s.advance(1000.0) == Decision()  # nothing expires, quotas do not matter
    snap = s.snapshot(1000.0)
    assert snap.clients["a"].state == "holding"
    assert snap.waiting == ("c", "b")
    assert s.request("a", 1000.0) == Decision()
    c = only(s.release("a", a.lease_id, 999.0, None, 1000.5).granted)
    assert (c.client_id, c.granted_at, c.expires_at) == ("c", 1000.5, math.inf)
    removed = s.remove_client("c", 1001.0)
    assert removed.ended == (c,)
    assert only(removed.granted).client_id == "b"
    s.request("a", 1001.5)
    assert s.snapshot(1001.5).waiting == ("a",)


def test_exclusive_with_nothing_waiting_has_no_deadline() -> None:
    s = scheduler("exclusive", share("a"))
    s.request("a", 0.0)
    assert s.next_deadline() is None


def test_fifo_slices_round_robin_with_fixed_slices() -> None:
    s = scheduler(
        "fifo", share("a", 10, 0.01), share("b", 10, 0.01), share("c", 10, 0.01), fifo_slice_s=0.05
    )
    first = only(s.request("a", 0.0).granted)
    assert first.length_s == pytest.approx(0.05)
    s.request("b", 0.01)
    s.request("c", 0.02)
    order = [first.client_id]
    lease = first
    for _ in range(7):
        now = s.next_deadline()
        assert now == lease.expires_at
        decision = s.advance(now)
        assert decision.ended == (lease,)
        lease = only(decision.granted)
        assert lease.length_s == pytest.approx(0.05)
        order.append(lease.client_id)
        # The client whose slice ended must ask again, and so goes to the back.
        s.request(decision.ended[0].client_id, now)
    assert order == ["a", "b", "c", "a", "b", "c", "a", "b"]
    # Quotas are ignored: 0.01 of the window each, yet each ran far more.
    assert s.snapshot(0.4).clients["a"].used_s > 0.1


def test_fifo_release_hands_over_at_once() -> None:
    s = scheduler("fifo", share("a"), share("b"))
    a = only(s.request("a", 0.0).granted)
    s.request("b", 0.0)
    b = only(s.release("a", a.lease_id, 0.001, 0.001, 0.002).granted)
    assert b.granted_at == 0.002
