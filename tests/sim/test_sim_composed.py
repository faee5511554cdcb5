"""The default admission policy (`composed`) in the kernel simulator: equal priorities share
by their quotas, every job is bounded by its quota limit, a feasible quota request is a
guarantee across levels, and with requests left at their defaults it gives what FIKIT gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuloom.sim.kernels import figures, simulate
from gpuloom.sim.scenario import load_scenario
from tests.sim.orion import mobilenet_on_orion, needs_traces

ROOT = Path(__file__).resolve().parents[2]


def _kernels(*durations_us: int, gap_us: int | None = None) -> list[dict]:
    kernels = [{"name": f"k{i}-{d}", "duration_us": d} for i, d in enumerate(durations_us)]
    if gap_us is not None:
        for kernel in kernels:
            kernel["gap_after_us"] = gap_us
    return kernels


def _training(name: str, priority: int, **share: float) -> dict:
    return {
        "name": name,
        "priority": priority,
        "kernels": _kernels(300, 500, 200, 900),
        "arrival": {"closed_loop": True},
        "host": "async",
        **share,
    }


def _serving(name: str, priority: int, **share: float) -> dict:
    # A busy synchronous host: 0.8 ms of kernels, 0.3 ms of host gaps, closed loop (~72% busy).
    return {
        "name": name,
        "priority": priority,
        "kernels": _kernels(300, 500, gap_us=150),
        "arrival": {"closed_loop": True},
        "host": "sync",
        **share,
    }


def _load(
    tmp_path: Path, tasks: list[dict], duration_s: float = 3.0, gpu: dict | None = None
) -> object:
    path = tmp_path / "scenario.json"
    data = {"seed": 5, "duration_s": duration_s, "tasks": tasks, "gpu": gpu or {}}
    path.write_text(json.dumps(data))
    return load_scenario(path)


def _shares(result: object) -> dict[str, float]:
    return {t.name: t.device_share for t in result.tasks}


def test_equal_priorities_share_by_their_quotas(tmp_path: Path) -> None:
    scenario = _load(
        tmp_path,
        [
            _training("a", 2, quota_request_percent=30, quota_limit_percent=30),
            _training("b", 2, quota_request_percent=70, quota_limit_percent=70),
        ],
    )
    shares = _shares(simulate(scenario, "composed"))
    assert shares["a"] == pytest.approx(0.30, abs=0.02)
    assert shares["b"] == pytest.approx(0.70, abs=0.02)
    # FIKIT alone knows no quotas: the two split the queue by their launch rates.
    fikit = _shares(simulate(scenario, "fikit"))
    assert abs(fikit["a"] - 0.30) > 0.05


def test_every_job_is_bounded_by_its_quota_limit_the_high_priority_too(tmp_path: Path) -> None:
    scenario = _load(
        tmp_path,
        [
            _serving("hp", 0, quota_request_percent=40, quota_limit_percent=40),
            _training("lp", 5, quota_request_percent=40),
        ],
    )
    alone = simulate(scenario, "exclusive")
    composed = simulate(scenario, "composed")
    shares = _shares(composed)
    assert _shares(alone)["hp"] > 0.6  # it would take more
    assert shares["hp"] <= 0.40 + 0.01
    # The time it leaves goes to the filler.
    assert shares["lp"] > 0.4
    fikit = _shares(simulate(scenario, "fikit"))
    assert fikit["hp"] > 0.6 and fikit["lp"] < 0.05


# Under MPS (co-running) and on a GPU that time-slices between contexts: there a preempted
# kernel is charged only its own slices, not the slices the other context held meanwhile
# (charged those, the filler looked on pace at 0.30 of the GPU and was not promoted).
@pytest.mark.parametrize("mps", [True, False], ids=["mps", "time-sliced"])
def test_a_feasible_request_is_a_guarantee_across_levels(tmp_path: Path, mps: bool) -> None:
    scenario = _load(
        tmp_path,
        [_serving("hp", 0, quota_request_percent=50), _training("lp", 5, quota_request_percent=40)],
        gpu={"mps": mps},
    )
    composed = simulate(scenario, "composed")
    fikit = simulate(scenario, "fikit")
    # The busy high priority leaves no gap to fill: under FIKIT the filler starves.
    assert _shares(fikit)["lp"] < 0.01
    # Under the default policy it gets its request, less the pace slack (2% of the window).
    assert _shares(composed)["lp"] >= 0.40 - 0.03
    assert composed.counters["promoted"] > 0
    assert _shares(composed)["hp"] >= 0.45


def test_oversubscribed_requests_guarantee_nothing_and_priority_decides(tmp_path: Path) -> None:
    # No quotas given: each asks for the whole GPU, as a reservation without one does.
    scenario = _load(tmp_path, [_serving("hp", 0), _training("lp", 5)], duration_s=1.0)
    composed, fikit = simulate(scenario, "composed"), simulate(scenario, "fikit")
    assert composed.counters["promoted"] == 0
    assert composed.to_dict() == fikit.to_dict()


@needs_traces
def test_on_orion_lists_the_default_keeps_hp_p99_and_the_fill_work(tmp_path: Path) -> None:
    loaded = mobilenet_on_orion(tmp_path)
    alone = simulate(loaded, "exclusive")
    composed = figures(simulate(loaded, "composed"), alone)
    fikit = figures(simulate(loaded, "fikit"), alone)
    assert composed["hp_p99_x_alone"] <= 1.05
    # The default GPU time-slices (no MPS, as deployed): nothing runs beside the holder, and
    # the idle backlog only adds fill work (0.897 against fikit's 0.845).
    assert composed["be_work_share"] >= fikit["be_work_share"]
    assert fikit["be_work_share"] > 0.5
