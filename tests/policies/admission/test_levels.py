"""The per-level token schedulers of the live composed policy: levels never wait for each
other's leases, one level shares by quota, and an uncontended level leases until further
notice until a peer of the level asks."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.admission.levels import LevelScheduler
from gpuloom.policies.tokens import ClientShare, TokenConfig, UnknownPolicyError


def _levels() -> LevelScheduler:
    return LevelScheduler("spatiotemporal", TokenConfig(window_s=1.0), 0.0)


def test_levels_do_not_wait_for_each_other() -> None:
    levels = _levels()
    levels.add_client(ClientShare.of("hp", 100, 0.5, 0.5), 0.0, priority=1)
    levels.add_client(ClientShare.of("lp", 100, 0.5, 0.5), 0.0, priority=8)
    low = levels.request("lp", 0.0).granted
    high = levels.request("hp", 0.0).granted
    # Both hold a lease at once, though each asks for all the SMs: the arbiter, not the
    # leases, decides between the levels.
    assert [lease.client_id for lease in (*low, *high)] == ["lp", "hp"]
    assert levels.snapshot(0.0).running_sm_percent == 200
    assert levels.priority_of("hp") == 1


def test_a_level_of_one_holds_open_ended_until_a_second_client_joins() -> None:
    levels = _levels()
    assert not levels.add_client(ClientShare.of("a", 100, 0.5, 1.0), 0.0, priority=5)
    first = levels.request("a", 0.0).granted
    assert len(first) == 1 and first[0].expires_at == math.inf  # alone: no renewals
    # A second client joins the level: the open-ended lease ends at once.
    joined = levels.add_client(ClientShare.of("b", 100, 0.5, 1.0), 0.001, priority=5)
    assert [lease.client_id for lease in joined.ended] == ["a"]
    (second,) = levels.request("b", 0.001).granted
    assert second.expires_at < math.inf  # the level leases by quota from now on
    assert not levels.request("a", 0.002).granted  # b holds all the SMs: a waits its turn
    assert levels.has_waiting
    # Another level's lone client is not touched.
    levels.add_client(ClientShare.of("c", 100, 0.5, 1.0), 0.003, priority=1)
    assert levels.request("c", 0.003).granted[0].expires_at == math.inf


def test_a_limit_below_the_window_is_leased_in_bounded_leases_even_alone() -> None:
    levels = _levels()
    levels.add_client(ClientShare.of("a", 100, 0.3, 0.3), 0.0, priority=2)
    (lease,) = levels.request("a", 0.0).granted
    assert lease.expires_at <= 0.3
    assert levels.next_deadline() == lease.expires_at


def test_removed_clients_and_unknown_names() -> None:
    levels = _levels()
    levels.add_client(ClientShare.of("a", 50, 0.5, 0.5), 0.0, priority=2)
    with pytest.raises(ValueError, match="already exists"):
        levels.add_client(ClientShare.of("a", 50, 0.5, 0.5), 0.0, priority=3)
    levels.remove_client("a", 0.1)
    with pytest.raises(KeyError, match="unknown client 'a'"):
        levels.request("a", 0.2)
    assert levels.snapshot(0.2).clients == {}
    with pytest.raises(UnknownPolicyError):
        LevelScheduler("nope", TokenConfig(), 0.0)


# -- random call sequences ----------------------------------------------------------------

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IDS = ["a", "b", "c", "d"]
calls = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "request", "request", "release", "advance"]),
        st.sampled_from(IDS),
        st.sampled_from([0, 3, 3, 8]),  # priority of an added client
        st.sampled_from([30, 60, 100]),  # its SM percent
        st.sampled_from([0.2, 0.5, 1.0]),  # its limit (request: half of it)
        st.floats(0.0, 0.3),  # time step
    ),
    max_size=60,
)


@FAST
@given(calls=calls)
def test_each_level_keeps_its_sm_limit_and_open_ended_leases_go_only_to_a_sole_client(
    calls: list,
) -> None:
    levels = _levels()
    now = 0.0
    added: dict[str, int] = {}
    for op, client, priority, sm, limit, step in calls:
        now += step
        if op == "add" and client not in added:
            levels.add_client(ClientShare.of(client, sm, limit / 2, limit), now, priority)
            added[client] = priority
        elif op == "remove" and client in added:
            levels.remove_client(client, now)
            del added[client]
        elif op == "request" and client in added:
            levels.request(client, now)
        elif op == "release" and client in added:
            lease = levels.lease_of(client)
            if lease is not None:
                levels.release(client, lease.lease_id, 0.001, None, now)
        else:
            levels.advance(now)
        snapshot = levels.snapshot(now)
        by_level: dict[int, list] = {}
        for client_id, state in snapshot.clients.items():
            by_level.setdefault(added[client_id], []).append(state)
        for members in by_level.values():
            held = [m for m in members if m.lease is not None and m.lease.expires_at > now]
            assert sum(m.share.sm_percent for m in held) <= 100
            for m in held:
                if m.lease.expires_at == math.inf:
                    # Open-ended: the level's only client, with a 100% limit.
                    assert len(members) == 1 and m.share.quota_limit == 1.0
