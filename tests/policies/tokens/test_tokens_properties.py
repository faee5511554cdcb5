"""Invariants under random sequences of calls, for every policy."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpuloom.policies.tokens import (
    EPSILON_S,
    ClientShare,
    Decision,
    Lease,
    TokenConfig,
    TokenScheduler,
)
from gpuloom.policies.tokens.simulate import SimClient, Workload, simulate

POLICIES = ["spatiotemporal", "exclusive", "fifo"]
IDS = ["a", "b", "c", "d", "e"]
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

fractions = st.sampled_from([0.02, 0.05, 0.1, 0.3, 1.0]) | st.floats(0.01, 1.0)
quotas = st.tuples(fractions, fractions).map(sorted)
shares = st.builds(
    lambda client_id, sm, q: ClientShare.of(client_id, sm, q[0], q[1]),
    st.sampled_from(IDS),
    st.sampled_from([20, 30, 50, 60, 100]) | st.integers(1, 100),
    quotas,
)
measures = st.floats(0.0, 0.3, allow_nan=False)
bursts = st.none() | st.floats(0.0, 0.5, allow_nan=False)
# Mostly forward, sometimes a clock stepping back, sometimes a jump over windows.
steps = st.one_of(
    st.floats(0.0, 0.02),
    st.floats(0.0, 0.02),
    st.floats(-0.05, 0.0),
    st.floats(0.05, 3.0),
    st.just(0.0),
)
operations = st.one_of(
    st.tuples(st.just("add"), shares),
    st.tuples(st.just("remove"), st.sampled_from(IDS)),
    st.tuples(st.just("withdraw"), st.sampled_from(IDS)),
    st.tuples(st.just("request"), st.sampled_from(IDS)),
    st.tuples(st.just("request"), st.sampled_from(IDS)),
    st.tuples(st.just("request"), st.sampled_from(IDS)),
    st.tuples(
        st.just("release"),
        st.sampled_from(IDS),
        st.sampled_from(["current", "older", "random"]),
        measures,
        bursts,
    ),
    st.tuples(
        st.just("report"),
        st.sampled_from(IDS),
        st.sampled_from(["current", "older", "random"]),
        measures,
        bursts,
    ),
    st.tuples(st.just("advance")),
    st.tuples(st.just("deadline")),
)
configs = st.builds(
    TokenConfig,
    window_s=st.sampled_from([0.1, 0.5, 1.0]),
    lease_min_s=st.just(0.002),
    lease_max_s=st.sampled_from([0.02, 0.1]),
    lease_initial_s=st.just(0.01),
    smoothing=st.sampled_from([0.3, 1.0]),
    fifo_slice_s=st.sampled_from([0.01, 0.05]),
    sm_global_limit=st.sampled_from([100, 100, 60]),
)


class Ledger:
    """Replays the decisions and checks each against the rules of the policy."""

    def __init__(self, policy: str, config: TokenConfig) -> None:
        self.policy = policy
        self.config = config
        self.open: dict[str, Lease] = {}
        self.issued: dict[str, list[int]] = {}
        self.last_id = 0

    def apply(self, s: TokenScheduler, decision: Decision, now: float) -> None:
        for lease in decision.ended:
            assert self.open.pop(lease.client_id) == lease
            assert lease.expires_at > lease.granted_at
        snap = s.snapshot(now)
        for lease in decision.granted:
            assert lease.client_id not in self.open, "two leases for one client"
            assert lease.lease_id > self.last_id
            self.last_id = lease.lease_id
            assert lease.granted_at == snap.now
            self.open[lease.client_id] = lease
            self.issued.setdefault(lease.client_id, []).append(lease.lease_id)
            length = lease.expires_at - lease.granted_at
            if self.policy == "exclusive":
                assert length == math.inf
            elif self.policy == "fifo":
                assert length == pytest.approx(self.config.fifo_slice_s)
            else:
                assert 0 < length <= self.config.lease_max_s + 1e-12
                client = snap.clients[lease.client_id]
                limit = client.share.quota_limit * self.config.window_s
                # Charged in full at grant: what it had used before must have been under
                # its limit, and the lease must fit in what was left.
                assert client.used_s - length < limit - EPSILON_S + 1e-9
                assert client.used_s <= limit + 1e-9

    def check(self, s: TokenScheduler, last_now: float, decided: bool) -> None:
        snap = s.snapshot(last_now)
        held = {cid: c.lease for cid, c in snap.clients.items() if c.lease is not None}
        assert held == self.open
        sm = sum(snap.clients[cid].share.sm_percent for cid in held)
        assert snap.running_sm_percent == sm
        if self.policy == "spatiotemporal":
            assert sm <= self.config.sm_global_limit
        else:
            assert len(held) <= 1
        waiting = [cid for cid, c in snap.clients.items() if c.state in ("waiting", "blocked")]
        assert set(snap.waiting) <= set(waiting)
        assert not set(waiting) & set(held)
        if decided and snap.waiting:
            # Nothing that could be granted is left waiting.
            if self.policy == "spatiotemporal":
                head = snap.clients[snap.waiting[0]].share.sm_percent
                assert sm + head > self.config.sm_global_limit
            else:
                assert len(held) == 1
        deadline = s.next_deadline()
        finite = [lease.expires_at for lease in held.values() if math.isfinite(lease.expires_at)]
        if waiting or finite:
            assert deadline is not None
            assert deadline >= last_now
            if finite:
                assert deadline <= max(min(finite), last_now)
        if not waiting and not finite:
            assert deadline is None


def run_sequence(
    policy: str, config: TokenConfig, initial: list[ClientShare], ops: list, times: list[float]
) -> dict[str, int]:
    now = 100.0
    s = TokenScheduler(policy, config, now)
    ledger = Ledger(policy, config)
    last_now = now
    seen = {"grants": 0, "together": 0, "blocked": 0}
    for share in initial:
        if share.sm_percent <= config.sm_global_limit:
            s.add_client(share, now)
    for op, step in zip(ops, times, strict=False):
        now += step
        last_now = max(last_now, now)
        kind = op[0]
        decided = kind in ("remove", "withdraw", "request", "release", "advance")
        decision = Decision()
        present = set(s.snapshot(last_now).clients)
        if kind == "add":
            share = op[1]
            if share.client_id in present or share.sm_percent > config.sm_global_limit:
                with pytest.raises(ValueError):
                    s.add_client(share, now)
            else:
                s.add_client(share, now)
                assert s.snapshot(last_now).clients[share.client_id].used_s == 0.0
        elif kind == "advance":
            decision = s.advance(now)
        elif kind == "deadline":
            deadline = s.next_deadline()
            if deadline is not None:
                now = deadline
                last_now = max(last_now, now)
                decision = s.advance(now)
                decided = True
        else:
            client_id = op[1]
            if client_id not in present:
                with pytest.raises(KeyError):
                    if kind == "remove":
                        s.remove_client(client_id, now)
                    elif kind == "withdraw":
                        s.withdraw(client_id, now)
                    elif kind == "request":
                        s.request(client_id, now)
                    else:
                        s.release(client_id, 1, 0.0, None, now)
                continue
            if kind == "remove":
                decision = s.remove_client(client_id, now)
                ledger.issued.pop(client_id, None)
            elif kind == "withdraw":
                decision = s.withdraw(client_id, now)
                assert s.snapshot(last_now).clients[client_id].state == "idle"
            elif kind == "request":
                decision = s.request(client_id, now)
            else:
                _, _, which, used, burst = op
                issued = ledger.issued.get(client_id, [])
                if which == "current" and client_id in ledger.open:
                    lease_id = ledger.open[client_id].lease_id
                elif which == "older" and issued:
                    lease_id = issued[0]
                else:
                    lease_id = 10_000 + len(issued)
                if kind == "release":
                    decision = s.release(client_id, lease_id, used, burst, now)
                else:
                    s.report_usage(client_id, lease_id, used, burst, now)
                q = s.snapshot(last_now).clients[client_id].q_s
                assert config.lease_min_s <= q <= config.lease_max_s
        if kind in ("remove", "withdraw") and client_id in ledger.open:
            assert ledger.open[client_id] in decision.ended
        ledger.apply(s, decision, last_now)
        ledger.check(s, last_now, decided)
        snap = s.snapshot(last_now)
        seen["grants"] += len(decision.granted)
        seen["together"] += len(ledger.open) > 1
        seen["blocked"] += any(c.state == "blocked" for c in snap.clients.values())
    return seen


@pytest.mark.parametrize("policy", POLICIES)
@FAST
@given(
    config=configs,
    initial=st.lists(shares, min_size=2, max_size=5, unique_by=lambda share: share.client_id),
    ops=st.lists(operations, min_size=30, max_size=100),
    times=st.lists(steps, min_size=100, max_size=100),
)
def test_random_call_sequences_keep_every_invariant(
    policy: str, config: TokenConfig, initial: list[ClientShare], ops: list, times: list[float]
) -> None:
    seen = run_sequence(policy, config, initial, ops, times)
    event(f"granted some: {seen['grants'] > 0}")
    event(f"several held at once: {seen['together'] > 0}")
    event(f"some blocked: {seen['blocked'] > 0}")


@settings(max_examples=200, deadline=None)
@given(
    q=st.floats(0.002, 0.1),
    burst=st.floats(0.0, 10.0),
    smoothing=st.floats(0.01, 1.0),
)
def test_each_burst_moves_the_lease_length_toward_it_within_bounds(
    q: float, burst: float, smoothing: float
) -> None:
    config = TokenConfig(smoothing=smoothing, lease_initial_s=q, window_s=10.0)
    s = TokenScheduler("spatiotemporal", config, 0.0)
    s.add_client(ClientShare.of("a", 100, 1.0, 1.0), 0.0)
    lease = s.request("a", 0.0).granted[0]
    s.release("a", lease.lease_id, 0.0, burst, 0.001)
    new = s.snapshot(0.001).clients["a"].q_s
    assert 0.002 <= new <= 0.1
    assert abs(new - burst) <= abs(q - burst) + 1e-12
    assert new == pytest.approx(min(max(q + smoothing * (burst - q), 0.002), 0.1))


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(10, 100), quotas, st.floats(0.0, 0.01), st.booleans()),
        min_size=1,
        max_size=4,
    )
)
def test_simulated_clients_never_run_past_their_limits(specs: list) -> None:
    clients = [
        SimClient(
            ClientShare.of(f"c{i}", sm, q[0], q[1]),
            Workload.saturating(burst_s=0.01) if busy else Workload.idle(),
        )
        for i, (sm, q, _, busy) in enumerate(specs)
    ]
    result = simulate(clients, duration_s=3.0, config=TokenConfig(window_s=0.5))
    for client in clients:
        share = client.share
        # Leases straddling a window edge shift time between neighbours, never add any.
        assert result.total[share.client_id] <= share.quota_limit * 3.0 + 0.02
        for used in result.per_window[share.client_id]:
            assert used <= share.quota_limit * 0.5 + 0.02
