"""The spatio-temporal policy driven call by call: SM packing, head of line, quotas, lengths."""

import pytest

from gpuloom.policies.tokens import Decision

from .helpers import holders, only, scheduler, share


def test_two_half_gpu_clients_run_together_and_a_third_waits_for_room() -> None:
    s = scheduler("spatiotemporal", share("a", 50, 0.3), share("b", 50, 0.3), share("c", 30, 0.3))
    a = only(s.request("a", 0.0).granted)
    b = only(s.request("b", 0.001).granted)
    assert s.request("c", 0.002) == Decision()
    snap = s.snapshot(0.002)
    assert snap.running_sm_percent == 100
    assert [snap.clients[c].state for c in "abc"] == ["holding", "holding", "waiting"]
    assert a.expires_at > b.granted_at  # both hold at once

    done = s.release("a", a.lease_id, 0.001, None, 0.003)
    assert done.ended == (a,)
    c = only(done.granted)
    assert (c.client_id, c.granted_at) == ("c", 0.003)
    assert s.snapshot(0.003).running_sm_percent == 80


def test_the_head_of_the_queue_blocks_smaller_clients_behind_it() -> None:
    # d misses more quota than e, so d is the head; it does not fit beside a, and e, which
    # would fit, must not overtake it.
    s = scheduler(
        "spatiotemporal",
        share("a", 50, 0.1),
        share("d", 60, 0.5),
        share("e", 20, 0.1),
    )
    a = only(s.request("a", 0.0).granted)
    assert s.request("d", 0.001) == Decision()
    # e alone would fit beside a (see the next test): it waits only because d is ahead.
    assert s.request("e", 0.002) == Decision()
    assert s.snapshot(0.002).waiting == ("d", "e")
    decision = s.release("a", a.lease_id, 0.002, None, 0.004)
    assert [lease.client_id for lease in decision.granted] == ["d", "e"]
    assert s.snapshot(0.004).running_sm_percent == 80


def test_e_is_served_at_once_when_nothing_is_ahead_of_it() -> None:
    # The control for the test above: the same e fits beside a on its own.
    s = scheduler("spatiotemporal", share("a", 50, 0.1), share("e", 20, 0.1))
    s.request("a", 0.0)
    assert only(s.request("e", 0.001).granted).client_id == "e"


def test_the_queue_is_ordered_by_missing_quota_then_request_time_then_id() -> None:
    s = scheduler(
        "spatiotemporal",
        share("hog", 100, 0.1),
        share("small", 100, 0.1),
        share("big", 100, 0.6),
        share("b-same", 100, 0.3),
        share("a-same", 100, 0.3),
        share("late", 100, 0.3),
    )
    hog = only(s.request("hog", 0.0).granted)
    s.request("small", 0.001)
    s.request("b-same", 0.002)
    s.request("a-same", 0.002)
    s.request("late", 0.003)
    s.request("big", 0.004)
    assert s.snapshot(0.004).waiting == ("big", "a-same", "b-same", "late", "small")
    order = []
    lease = hog
    now = 0.005
    for _ in range(5):
        decision = s.release(lease.client_id, lease.lease_id, 0.0, None, now)
        lease = only(decision.granted)
        order.append(lease.client_id)
        now += 0.001
    assert order == ["big", "a-same", "b-same", "late", "small"]


def test_a_client_at_its_limit_is_blocked_until_the_next_window() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.05), lease_initial_s=0.02)
    lengths = []
    now = 0.0
    while True:
        granted = s.request("a", now).granted
        if not granted:
            break
        lease = only(granted)
        lengths.append(lease.length_s)
        now = lease.expires_at
        s.advance(now)
    assert lengths == pytest.approx([0.02, 0.02, 0.01])  # the last one capped by the limit
    snap = s.snapshot(now)
    assert snap.clients["a"].state == "blocked"
    assert snap.waiting == ()
    assert s.next_deadline() == pytest.approx(1.0)  # the window end
    assert s.advance(0.9) == Decision()
    lease = only(s.advance(1.0).granted)
    assert (lease.granted_at, lease.length_s) == (1.0, pytest.approx(0.02))


def test_overrun_is_carried_into_the_next_window() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.1), share("b", 100, 0.1))
    lease = only(s.request("a", 0.0).granted)
    s.advance(lease.expires_at)
    # A kernel ran 0.25 s past a 0.02 s lease: 0.15 s over the 0.1 s limit.
    s.report_usage("a", lease.lease_id, 0.25, None, 0.3)
    assert s.snapshot(0.3).clients["a"].used_s == pytest.approx(0.25)
    assert s.request("a", 0.3) == Decision()
    assert s.snapshot(0.3).clients["a"].state == "blocked"
    # Next window: 0.15 s still owed, more than its limit, so still blocked.
    assert s.advance(1.0) == Decision()
    assert s.snapshot(1.0).clients["a"].used_s == pytest.approx(0.15)
    # The window after: 0.05 s owed, 0.05 s left of its limit.
    lease = only(s.advance(2.0).granted)
    assert s.snapshot(2.0).clients["a"].used_s == pytest.approx(0.07)
    assert lease.length_s == pytest.approx(0.02)


def test_windows_tumble_from_the_start_time_and_skipped_windows_forgive_overrun() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.1), now=10.0, window_s=0.5)
    lease = only(s.request("a", 10.0).granted)
    s.report_usage("a", lease.lease_id, 0.4, None, 10.1)  # 0.35 s over its 0.05 s limit
    snap = s.snapshot(11.26)  # two windows later: 0.05 s forgiven for each
    assert (snap.window_start, snap.window_end) == (11.0, 11.5)
    assert snap.clients["a"].used_s == pytest.approx(0.3)
    assert s.snapshot(12.0).clients["a"].used_s == pytest.approx(0.2)


def test_elastic_leases_are_marked_and_run_only_on_free_sms() -> None:
    # a has used its request but not its limit; b still misses quota: b goes first.
    s = scheduler("spatiotemporal", share("a", 100, 0.02, 0.5), share("b", 100, 0.2))
    first = only(s.request("a", 0.0).granted)
    assert not first.elastic
    s.request("b", 0.001)
    s.advance(first.expires_at)
    s.request("a", first.expires_at)
    assert s.snapshot(first.expires_at).clients["b"].state == "holding"
    b = s.snapshot(first.expires_at).clients["b"].lease
    assert b is not None
    second = only(s.advance(b.expires_at).granted)
    assert second.client_id == "a" and second.elastic


def test_lease_length_follows_reported_bursts_smoothly_within_bounds() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 1.0), window_s=100.0, smoothing=0.3)
    now = 0.0

    def cycle(burst: float) -> float:
        nonlocal now
        lease = only(s.request("a", now).granted)
        now += 0.001
        s.release("a", lease.lease_id, 0.001, burst, now)
        return s.snapshot(now).clients["a"].q_s

    q = 0.02
    for _ in range(30):
        new = cycle(0.05)
        assert q < new <= 0.05
        assert new == pytest.approx(q + 0.3 * (0.05 - q))
        q = new
    assert q == pytest.approx(0.05, abs=1e-4)
    for _ in range(30):
        q = cycle(5.0)
        assert q <= 0.1
    assert q == 0.1
    lease = only(s.request("a", now).granted)
    assert lease.length_s == pytest.approx(0.1)
    s.release("a", lease.lease_id, 0.0, 0.0, now + 0.001)
    now += 0.001
    for _ in range(30):
        q = cycle(0.0)
        assert q >= 0.002
    assert q == 0.002
    # A release without a burst leaves q alone.
    lease = only(s.request("a", now).granted)
    s.release("a", lease.lease_id, 0.001, None, now + 0.001)
    assert s.snapshot(now + 0.001).clients["a"].q_s == 0.002


def test_removing_a_holder_ends_its_lease_and_lets_the_next_client_in() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.3), share("b", 100, 0.3))
    log = [s.request("a", 0.0), s.request("b", 0.001)]
    a = log[0].granted[0]
    gone = s.remove_client("a", 0.005)
    log.append(gone)
    assert gone.ended == (a,)
    b = only(gone.granted)
    assert b.client_id == "b" and b.granted_at == 0.005
    assert holders(log) == {"b": b}
    snap = s.snapshot(0.005)
    assert set(snap.clients) == {"b"}
    assert snap.running_sm_percent == 100
    with pytest.raises(KeyError):
        s.request("a", 0.006)
    with pytest.raises(KeyError):
        s.report_usage("a", a.lease_id, 0.001, None, 0.006)
    # The id can be used again, by a new client that starts from scratch.
    s.add_client(share("a", 100, 0.3), 0.006)
    assert s.snapshot(0.006).clients["a"].used_s == 0.0
    assert s.request("a", 0.006) == Decision()  # b still holds the GPU
    assert only(s.advance(b.expires_at).granted).client_id == "a"


def test_removing_a_waiting_head_lets_the_clients_behind_it_go() -> None:
    s = scheduler("spatiotemporal", share("a", 50, 0.1), share("d", 60, 0.5), share("e", 20, 0.1))
    s.request("a", 0.0)
    s.request("d", 0.001)
    s.request("e", 0.002)
    decision = s.remove_client("d", 0.003)
    assert decision.ended == ()
    assert only(decision.granted).client_id == "e"


def test_many_clients_coming_and_going_leak_no_lease_records() -> None:
    s = scheduler("spatiotemporal", window_s=0.1)
    now = 0.0
    for i in range(2000):
        s.add_client(share(f"c{i}", 100, 0.5), now)
        lease = only(s.request(f"c{i}", now).granted)
        if i % 2:
            s.release(f"c{i}", lease.lease_id, 0.001, 0.001, now + 0.001)
        now += 0.01
        s.remove_client(f"c{i}", now)
    assert s.next_deadline() is None
    snap = s.snapshot(now)
    assert snap.clients == {} and snap.running_sm_percent == 0
    # Only the leases of the last couple of windows are remembered for late reports.
    assert len(s._charges) <= 30


def test_a_withdrawn_holder_keeps_its_share_and_its_charge() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.3), share("b", 100, 0.3))
    a = only(s.request("a", 0.0).granted)
    s.request("b", 0.001)
    gone = s.withdraw("a", 0.004)
    assert gone.ended == (a,)
    assert only(gone.granted).client_id == "b"
    snap = s.snapshot(0.004).clients["a"]
    assert snap.state == "idle"
    assert snap.used_s == pytest.approx(0.004)  # the time it held the lease, not 0.02
    # Back again, it queues like anyone else and its quota was not reset.
    assert s.request("a", 0.005) == Decision()
    assert s.snapshot(0.005).waiting == ("a",)


def test_a_withdrawn_waiting_client_leaves_the_queue() -> None:
    s = scheduler("spatiotemporal", share("a", 100, 0.3), share("b", 100, 0.3))
    a = only(s.request("a", 0.0).granted)
    s.request("b", 0.001)
    assert s.withdraw("b", 0.002) == Decision()
    assert s.snapshot(0.002).waiting == ()
    assert s.advance(a.expires_at).granted == ()
    with pytest.raises(KeyError):
        s.withdraw("x", 0.03)
