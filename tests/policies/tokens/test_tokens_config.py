"""Configuration, shares, the registry and argument checks: errors name what is wrong."""

import math
from dataclasses import fields

import pytest

from gpuloom.domain.shares import Share, TimeQuota, share_of
from gpuloom.policies.tokens import (
    POLICIES,
    ClientShare,
    TokenConfig,
    TokenScheduler,
    get_policy,
)

from .helpers import scheduler, share


def test_the_defaults_are_valid_and_the_default_policy_is_spatiotemporal() -> None:
    TokenConfig().validate()
    assert get_policy("spatiotemporal").name == "spatiotemporal"
    assert TokenScheduler("spatiotemporal", TokenConfig(), 0.0).policy_name == "spatiotemporal"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_s", 0.0),
        ("window_s", -1.0),
        ("window_s", math.inf),
        ("window_s", math.nan),
        ("lease_min_s", 0.0),
        ("lease_min_s", math.nan),
        ("lease_max_s", math.inf),
        ("lease_max_s", 0.001),  # below lease_min_s
        ("lease_initial_s", 0.5),  # above lease_max_s
        ("lease_initial_s", 0.001),  # below lease_min_s
        ("smoothing", 0.0),
        ("smoothing", 1.5),
        ("smoothing", math.nan),
        ("fifo_slice_s", 0.0),
        ("fifo_slice_s", "0.05"),
        ("sm_global_limit", 0),
        ("sm_global_limit", 50.5),
        ("sm_global_limit", True),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    config = TokenConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        config.validate()
    with pytest.raises(ValueError, match=field):
        TokenScheduler("fifo", config, 0.0)


def test_the_edges_of_the_config_ranges_are_accepted() -> None:
    TokenConfig(smoothing=1.0, lease_min_s=0.02, lease_max_s=0.02, lease_initial_s=0.02).validate()


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (ClientShare.of("", 50, 0.2, 0.3), "client_id"),
        (ClientShare("a", TimeQuota(20.0, 30.0)), "share must be a Share"),  # type: ignore[arg-type]
        (ClientShare.of("a", 0, 0.2, 0.3), "share.sm_percent"),
        (ClientShare.of("a", 101, 0.2, 0.3), "share.sm_percent"),
        (ClientShare.of("a", 50.5, 0.2, 0.3), "share.sm_percent"),  # type: ignore[arg-type]
        (ClientShare.of("a", True, 0.2, 0.3), "share.sm_percent"),
        (ClientShare("a", share_of(50, "20", 30.0)), "share.quota.request_percent"),  # type: ignore[arg-type]
        (ClientShare("a", Share(50, TimeQuota(20.0, None), 0, 5)), "share.quota.limit_percent"),  # type: ignore[arg-type]
        (ClientShare.of("a", 50, 0.0, 0.3), "share.quota.request_percent"),
        (ClientShare.of("a", 50, math.nan, 0.3), "share.quota.request_percent"),
        # The domain names the request as the one over its limit.
        (ClientShare.of("a", 50, 0.4, 0.3), "share.quota.request_percent"),
        (ClientShare.of("a", 50, 0.2, 1.5), "share.quota.limit_percent"),
        (ClientShare.of("a", 50, 0.2, math.inf), "share.quota.limit_percent"),
    ],
)
def test_add_client_rejects_a_bad_share_by_field(bad: ClientShare, field: str) -> None:
    s = scheduler()
    with pytest.raises(ValueError, match=field):
        s.add_client(bad, 0.0)
    assert s.snapshot(0.0).clients == {}


def test_a_client_share_holds_the_reservations_share_itself_not_copies_of_its_fields() -> None:
    """docs/architecture.md's time-quota walk counts no shape of its own for ClientShare: the
    scheduler reads the reservation's Share, its quotas as fractions through properties."""
    assert {f.name: f.type for f in fields(ClientShare)} == {"client_id": "str", "share": "Share"}
    held = share_of(30, 20.0, 50.0, memory_bytes=1 << 30, priority=2)
    client = ClientShare("r-1", held)
    assert client.share is held
    assert (client.sm_percent, client.quota_request, client.quota_limit) == (30, 0.2, 0.5)
    s = scheduler()
    s.add_client(client, 0.0)
    assert s.snapshot(0.0).clients["r-1"].share is client


def test_add_client_rejects_a_duplicate_and_a_partition_over_the_global_limit() -> None:
    s = scheduler("spatiotemporal", share("a", sm=50), sm_global_limit=60)
    with pytest.raises(ValueError, match="already exists"):
        s.add_client(share("a", sm=10), 0.0)
    with pytest.raises(ValueError, match="sm_global_limit"):
        s.add_client(share("b", sm=70), 0.0)


def test_get_policy_lists_the_known_names() -> None:
    with pytest.raises(ValueError, match="exclusive, fifo, spatiotemporal"):
        get_policy("round-robin")
    assert sorted(POLICIES) == ["exclusive", "fifo", "spatiotemporal"]
    for name in POLICIES:
        assert get_policy(name).name == name


def test_unknown_clients_raise_key_error_and_change_nothing() -> None:
    s = scheduler("spatiotemporal", share("a"))
    for call in (
        lambda: s.request("x", 0.0),
        lambda: s.release("x", 1, 0.0, None, 0.0),
        lambda: s.report_usage("x", 1, 0.0, None, 0.0),
        lambda: s.remove_client("x", 0.0),
    ):
        with pytest.raises(KeyError, match="x"):
            call()
    assert s.next_deadline() is None


@pytest.mark.parametrize("value", [-0.001, math.nan, math.inf])
def test_bad_measurements_name_the_argument(value: float) -> None:
    s = scheduler("spatiotemporal", share("a"))
    lease = s.request("a", 0.0).granted[0]
    with pytest.raises(ValueError, match="used_gpu_s"):
        s.release("a", lease.lease_id, value, None, 0.001)
    with pytest.raises(ValueError, match="burst_s"):
        s.release("a", lease.lease_id, 0.001, value, 0.001)
    with pytest.raises(ValueError, match="used_gpu_s"):
        s.report_usage("a", lease.lease_id, value, 0.01, 0.001)
    with pytest.raises(ValueError, match="burst_s"):
        s.report_usage("a", lease.lease_id, 0.001, value, 0.001)
    # Nothing was charged or ended by the rejected calls.
    snap = s.snapshot(0.001)
    assert snap.clients["a"].lease == lease
    assert snap.clients["a"].used_s == pytest.approx(0.02)
    assert snap.clients["a"].q_s == 0.02


def test_now_must_be_finite() -> None:
    with pytest.raises(ValueError, match="now"):
        TokenScheduler("fifo", TokenConfig(), math.nan)
    s = scheduler("fifo", share("a"))
    with pytest.raises(ValueError, match="now"):
        s.advance(math.inf)
    with pytest.raises(ValueError, match="now"):
        s.request("a", math.nan)
