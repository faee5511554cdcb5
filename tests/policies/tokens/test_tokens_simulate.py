"""Whole runs in virtual time through the simulator: shares over many windows."""

import pytest

from gpuloom.policies.tokens import ClientShare, TokenConfig
from gpuloom.policies.tokens.simulate import SimClient, Workload, simulate

REQUESTS = {"a": 0.2, "b": 0.3, "c": 0.5}


def clients(limits: dict[str, float], workloads: dict[str, Workload], sm: int = 100):
    return [
        SimClient(ClientShare.of(name, sm, REQUESTS[name], limits[name]), workloads[name])
        for name in REQUESTS
    ]


@pytest.mark.parametrize(
    "bursts",
    [
        {"a": 0.01, "b": 0.01, "c": 0.01},
        {"a": 0.002, "b": 0.03, "c": 0.1},  # very different lease lengths
        {"a": 0.1, "b": None, "c": 0.002},
    ],
)
def test_saturating_clients_get_their_requests(bursts: dict[str, float | None]) -> None:
    work = {name: Workload.saturating(burst_s=bursts[name]) for name in REQUESTS}
    result = simulate(clients(REQUESTS, work), duration_s=10.0)
    for name, request in REQUESTS.items():
        assert result.share(name) == pytest.approx(request, abs=0.02)
        assert len(result.per_window[name]) == 10


def test_fifo_does_not_keep_the_requests() -> None:
    # The control for the fairness test: the quota-blind baseline splits evenly.
    work = {name: Workload.saturating(burst_s=0.01) for name in REQUESTS}
    result = simulate(clients(REQUESTS, work), duration_s=10.0, policy="fifo")
    for name in REQUESTS:
        assert result.share(name) == pytest.approx(1 / 3, abs=0.02)


@pytest.mark.parametrize("limits", [{"a": 0.3, "b": 0.4}, {"a": 0.6, "b": 0.7}])
def test_idle_time_goes_to_the_others_up_to_their_limits(limits: dict[str, float]) -> None:
    work = {
        "a": Workload.saturating(burst_s=0.01),
        "b": Workload.saturating(burst_s=0.01),
        "c": Workload.idle(),
    }
    result = simulate(clients({**limits, "c": 0.5}, work), duration_s=10.0)
    assert result.total["c"] == 0.0
    for name in ("a", "b"):
        assert max(result.per_window[name]) <= limits[name] + 1e-6
        assert result.share(name) > REQUESTS[name] + 0.05  # it took some of the idle time
    # Together they use what their limits allow of the idle GPU.
    absorbed = result.share("a") + result.share("b")
    assert absorbed == pytest.approx(min(1.0, limits["a"] + limits["b"]), abs=0.01)


def test_elastic_limits_do_not_cost_anyone_their_request() -> None:
    work = {name: Workload.saturating(burst_s=0.01) for name in REQUESTS}
    result = simulate(clients({"a": 0.6, "b": 0.7, "c": 0.5}, work), duration_s=10.0)
    for name, request in REQUESTS.items():
        assert result.share(name) == pytest.approx(request, abs=0.02)


def test_on_off_clients_share_while_on_and_leave_their_time_when_off() -> None:
    work = {
        "a": Workload.saturating(burst_s=0.01),
        "b": Workload.on_off([(0.0, 3.0), (6.0, 8.0)], burst_s=0.01),
        "c": Workload.idle(),
    }
    result = simulate(clients({"a": 1.0, "b": 1.0, "c": 0.5}, work), duration_s=10.0)
    b = result.per_window["b"]
    a = result.per_window["a"]
    assert b[3:6] == (0.0, 0.0, 0.0) and b[8:] == (0.0, 0.0)
    for window in (1, 2, 6, 7):
        assert b[window] == pytest.approx(0.5, abs=0.03)  # fair split while both work
    for window in (3, 4, 5, 8, 9):
        assert a[window] == pytest.approx(1.0, abs=0.001)  # a alone takes the GPU


def test_overrun_is_charged_so_the_overrunning_client_gets_fewer_leases() -> None:
    work = {
        "a": Workload.saturating(burst_s=0.01, overrun_s=0.01),
        "b": Workload.saturating(burst_s=0.01),
        "c": Workload.saturating(burst_s=0.01),
    }
    result = simulate(clients(REQUESTS, work), duration_s=10.0)
    # Each lease of a costs twice its length, so it gets half as many.
    assert result.leases["a"] == pytest.approx(100, abs=5)
    assert result.share("a") == pytest.approx(0.2, abs=0.02)


def test_partitions_let_clients_run_side_by_side() -> None:
    work = {name: Workload.saturating(burst_s=0.01) for name in REQUESTS}
    limits = {"a": 1.0, "b": 1.0, "c": 1.0}
    result = simulate(clients(limits, work, sm=30), duration_s=5.0)
    for name in REQUESTS:  # 90 of 100 SM percent: all three hold the GPU all the time
        assert result.share(name) == pytest.approx(1.0, abs=0.01)


def test_exclusive_hands_over_after_each_job() -> None:
    work = {name: Workload.saturating(max_hold_s=0.5) for name in REQUESTS}
    result = simulate(clients(REQUESTS, work), duration_s=6.0, policy="exclusive")
    for name in REQUESTS:
        assert result.share(name) == pytest.approx(1 / 3, abs=0.01)
        assert result.leases[name] == 4


def test_the_run_starts_at_start_s_and_rejects_a_bad_duration() -> None:
    work = {name: Workload.saturating(burst_s=0.01) for name in REQUESTS}
    config = TokenConfig(window_s=0.5)
    result = simulate(clients(REQUESTS, work), 2.0, config=config, start_s=100.0)
    assert len(result.per_window["a"]) == 4
    assert result.share("c") == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError, match="duration_s"):
        simulate(clients(REQUESTS, work), 0.0)
