"""Standing terms (what the lease desk may grant without asking) and renewals taken into the
books: what each policy gives, and, under random interleavings of native renewals and calls,
that nothing is ever over-committed."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.tokens import TokenConfig, TokenScheduler

from .helpers import scheduler, share

NATIVE = 1 << 62


def test_nobody_gets_terms_while_somebody_waits() -> None:
    s = scheduler("spatiotemporal", share("a", sm=60), share("b", sm=60))
    s.request("a", 0.0)
    assert set(s.standing_terms(0.0)) == {"a"}  # b (60) would not fit beside a
    s.request("b", 0.001)  # b waits for a
    assert s.standing_terms(0.001) == {}


def test_spatiotemporal_terms_fit_together_within_the_sm_limit() -> None:
    s = scheduler(
        "spatiotemporal",
        share("a", sm=50, request=0.2, limit=0.5),
        share("b", sm=30, request=0.2, limit=0.5),
        share("c", sm=40, request=0.2, limit=0.5),
        window_s=1.0,
        lease_initial_s=0.02,
    )
    lease = s.request("a", 0.0).granted[0]
    terms = s.standing_terms(0.01)
    # a renews its own lease; b (30) fits beside it; c (40) would not fit beside both.
    assert set(terms) == {"a", "b"}
    assert terms["a"].lease_s == pytest.approx(0.02)
    assert terms["a"].budget_s == pytest.approx(0.5 - lease.length_s)
    assert terms["b"].budget_s == pytest.approx(0.5)
    assert terms["a"].limit_s == pytest.approx(0.5)
    assert terms["a"].window_end == pytest.approx(1.0)


def test_a_client_without_quota_left_gets_no_terms() -> None:
    s = scheduler("spatiotemporal", share("a", sm=50, request=0.01, limit=0.01), window_s=1.0)
    s.request("a", 0.0)  # a 10 ms lease: the whole limit, charged at grant
    assert "a" not in s.standing_terms(0.001)


@pytest.mark.parametrize("policy", ["exclusive", "fifo"])
def test_one_at_a_time_gives_terms_to_one_client(policy: str) -> None:
    s = scheduler(policy, share("a"), share("b"), fifo_slice_s=0.05)
    assert list(s.standing_terms(0.0)) == ["a"]  # nobody holds: the first may take it
    s.request("b", 0.0)
    terms = s.standing_terms(0.001)
    assert list(terms) == ["b"]  # the holder renews; nobody else may
    assert terms["b"].lease_s == (math.inf if policy == "exclusive" else 0.05)


def test_a_renewal_replaces_the_lease_and_its_report_replaces_the_charge() -> None:
    s = scheduler("spatiotemporal", share("a", sm=50, request=0.2, limit=0.5), window_s=1.0)
    first = s.request("a", 0.0).granted[0]
    decision = s.renewed("a", NATIVE | 1, 0.03, 0.01, report=(first.lease_id, 0.004, 0.004))
    renewal = decision.granted[0]
    assert decision.ended == (first,)
    assert (renewal.lease_id, renewal.granted_at, renewal.expires_at) == (NATIVE | 1, 0.01, 0.03)
    snapshot = s.snapshot(0.01)
    # 4 ms measured for the first lease, 20 ms provisional for the renewal.
    assert snapshot.clients["a"].used_s == pytest.approx(0.004 + 0.02)
    assert snapshot.running_sm_percent == 50
    s.release("a", NATIVE | 1, 0.001, None, 0.02)
    assert s.snapshot(0.02).clients["a"].used_s == pytest.approx(0.005)


def test_a_renewal_id_the_scheduler_issued_is_refused() -> None:
    s = scheduler("spatiotemporal", share("a", sm=50))
    lease = s.request("a", 0.0).granted[0]
    with pytest.raises(ValueError, match="collides"):
        s.renewed("a", lease.lease_id, 0.05, 0.01)


IDS = ["a", "b", "c", "d"]
operations = st.one_of(
    st.tuples(st.just("renew"), st.sampled_from(IDS)),
    st.tuples(st.just("renew"), st.sampled_from(IDS)),
    st.tuples(st.just("request"), st.sampled_from(IDS)),
    st.tuples(st.just("release"), st.sampled_from(IDS), st.floats(0.0, 0.05)),
    st.tuples(
        st.just("advance"),
    ),
    st.tuples(st.just("remove"), st.sampled_from(IDS)),
)


@pytest.mark.parametrize("policy", ["spatiotemporal", "exclusive", "fifo"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sms=st.lists(st.sampled_from([20, 30, 50, 60, 100]), min_size=4, max_size=4),
    steps=st.lists(st.tuples(operations, st.floats(0.0, 0.03)), max_size=60),
)
def test_native_renewals_from_standing_terms_never_over_commit(
    policy: str, sms: list[int], steps: list
) -> None:
    """The desk's model: terms are computed after every call the channel makes; a renewal uses
    them (min(lease, budget left) >= lease_min; at a window's end the budget grows by the limit,
    to at most the limit) and is then taken into the books. Whatever the interleaving, the SMs
    held stay within the limit, one-at-a-time policies have one holder at most, and nobody is
    charged past its quota limit by more than a lease."""
    config = TokenConfig(window_s=0.2, lease_initial_s=0.01, fifo_slice_s=0.02)
    s = TokenScheduler(policy, config, 0.0)
    for client_id, sm in zip(IDS, sms, strict=True):
        s.add_client(share(client_id, sm=sm, request=0.1, limit=0.3), 0.0)
    present = set(IDS)
    now, native = 0.0, 0
    terms = s.standing_terms(now)
    budget = {cid: t.budget_s for cid, t in terms.items()}
    window_end = {cid: t.window_end for cid, t in terms.items()}
    for operation, step in steps:
        now += step
        kind = operation[0]
        if kind == "renew":
            client_id = operation[1]
            given_terms = terms.get(client_id)
            if given_terms is None:
                continue
            while now >= window_end[client_id]:
                window_end[client_id] += config.window_s
                if budget[client_id] != math.inf:
                    budget[client_id] = min(
                        budget[client_id] + given_terms.limit_s, given_terms.limit_s
                    )
            length = min(given_terms.lease_s, budget[client_id])
            if length < config.lease_min_s:
                continue
            native += 1
            if length != math.inf:
                budget[client_id] -= length
            expires = math.inf if length == math.inf else now + length
            held = s.lease_of(client_id)
            report = None if held is None else (held.lease_id, 0.0, None)
            s.renewed(client_id, NATIVE | native, expires, now, report)
        else:
            if kind == "request" and operation[1] in present:
                s.request(operation[1], now)
            elif kind == "release" and operation[1] in present:
                held = s.lease_of(operation[1])
                if held is not None:
                    s.release(operation[1], held.lease_id, operation[2], None, now)
            elif kind == "advance":
                s.advance(now)
            elif kind == "remove" and operation[1] in present:
                present.discard(operation[1])
                s.remove_client(operation[1], now)
            terms = s.standing_terms(now)  # the channel gives new terms after each call
            budget = {cid: t.budget_s for cid, t in terms.items()}
            window_end = {cid: t.window_end for cid, t in terms.items()}
        snapshot = s.snapshot(now)
        holding = [c for c in snapshot.clients.values() if c.state == "holding"]
        assert snapshot.running_sm_percent <= config.sm_global_limit
        assert sum(c.share.sm_percent for c in holding) == snapshot.running_sm_percent
        if policy != "spatiotemporal":
            assert len(holding) <= 1
        for client in snapshot.clients.values():
            # Charged at grant in full: over the limit only by a report larger than its lease.
            assert client.used_s <= client.share.quota_limit * config.window_s + 0.05 + 1e-9


def test_only_candidates_get_terms_and_the_others_leases_still_count() -> None:
    """The desk serves some clients only (others ask over the socket): an idle non-candidate
    takes no room from the candidates; a non-candidate's lease still does."""
    s = scheduler("spatiotemporal", share("a", sm=60), share("b", sm=60), share("c", sm=30))
    assert set(s.standing_terms(0.0, candidates={"b"})) == {"b"}  # idle a takes no room
    s.request("a", 0.0)  # a (60) holds, over the socket
    assert set(s.standing_terms(0.001, candidates={"b", "c"})) == {"c"}  # b (60) cannot fit


def test_a_lease_shorter_than_the_minimum_gets_no_terms() -> None:
    """1 ms of quota left, leases of at least 2 ms: the desk could never grant it natively."""
    s = scheduler(
        "spatiotemporal", share("a", sm=50, request=0.011, limit=0.011), window_s=1.0,
        lease_initial_s=0.01, lease_min_s=0.002,
    )  # fmt: skip
    s.request("a", 0.0)  # a 10 ms lease: 1 ms of the 11 ms limit left
    assert "a" not in s.standing_terms(0.001)
