"""Spatial harvesting: the pure rule (gpuloom.policies.harvest) and the simulator's `harvest`
mode and figures (gpuloom.sim.harvest)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from clients.cli.sim import sim
from gpuloom.policies.harvest import (
    HARVEST_POLICIES,
    Candidate,
    HarvestConfig,
    Running,
    SpatialHarvest,
)
from gpuloom.sim.harvest import harvest_figures, time_sharing_ceiling
from gpuloom.sim.kernels import DEFAULT_MODE, ModeResult, simulate
from gpuloom.sim.scenario import ScenarioError, load_scenario

HOLDER = Running(priority=0, demand=40, profile="compute")
FITS = Candidate(priority=5, demand=4, profile="memory", duration_ns=10_000)


def test_the_rule_admits_a_kernel_that_fits_beside_the_holder() -> None:
    assert SpatialHarvest().admit(0, FITS, [HOLDER], 20_000, 80)


@pytest.mark.parametrize(
    ("candidate", "running", "next_launch", "why"),
    [
        (FITS, [], 20_000, "no holder kernel running: time admission decides"),
        (FITS, [Running(5, 10, "memory")], 20_000, "only a peer runs"),
        (Candidate(5, 41, "memory", 10_000), [HOLDER], 20_000, "SMs: 40 + 41 > 80"),
        (Candidate(5, 30, "memory", 10_000), [HOLDER], 20_000, "holder 1 + 0.5 * 30/80 slower"),
        (FITS, [HOLDER, Running(5, 2, "memory")], 20_000, "with the other filler: 6 SMs"),
        (Candidate(5, 4, "compute", 10_000), [HOLDER], 20_000, "same bound class"),
        (FITS, [HOLDER], 12_000, "would outlast the holder's next launch (x1.3)"),
        (Candidate(5, 4, "memory", None), [HOLDER], 20_000, "never measured"),
        (FITS, [HOLDER], None, "the holder's next launch unknown"),
        (Candidate(5, 4, "memory", 10_000, quota_left_ns=9_999), [HOLDER], 20_000, "quota"),
        (Candidate(5, 4, "memory", 10_000, queued_ns=8_000), [HOLDER], 20_000, "backlog"),
        (Candidate(0, 4, "memory", 10_000), [HOLDER], 20_000, "not below the holder"),
    ],
)
def test_the_rule_refuses(candidate, running, next_launch, why) -> None:
    assert not SpatialHarvest().admit(0, candidate, running, next_launch, 80), why


def test_unknown_classes_pass_only_when_allowed_and_the_registry_knows_the_rule() -> None:
    unknown = Candidate(5, 2, "unknown", 10_000)
    assert SpatialHarvest().admit(0, unknown, [HOLDER], 20_000, 80)
    strict = SpatialHarvest(HarvestConfig(allow_unknown=False))
    assert not strict.admit(0, unknown, [HOLDER], 20_000, 80)
    assert not HARVEST_POLICIES.create("off").admit(0, FITS, [HOLDER], 20_000, 80)
    with pytest.raises(ValueError, match="sm_limit"):
        HarvestConfig(sm_limit=1.5)


def _scenario(tmp_path: Path, **top: object) -> Path:
    """A holder whose kernels use a quarter of the SMs, compute-bound, with host gaps too short
    to fill, beside a closed loop of short memory-bound kernels on 4 SMs each, on a GPU under
    MPS (spatial harvesting's; the simulator's default GPU has none)."""
    data = {
        "seed": 3,
        "duration_s": 1.0,
        "gpu": {"mps": True},
        "tasks": [
            {
                "name": "infer",
                "priority": 0,
                "arrival": {"rate_per_s": 200},
                "host": "sync",
                "host_gap_us": 15,
                "kernels": [
                    {"name": f"h{i}", "duration_us": 300, "sm_usage": 20, "profile": "compute"}
                    for i in range(8)
                ],
            },
            {
                "name": "train",
                "priority": 5,
                "arrival": {"closed_loop": True},
                "host": "async",
                "host_gap_us": 5,
                "kernels": [
                    {"name": f"l{i}", "duration_us": 60, "sm_usage": 4, "profile": "memory"}
                    for i in range(10)
                ],
            },
        ],
        **top,
    }
    path = tmp_path / f"h-{len(top)}.json"
    path.write_text(json.dumps(data))
    return path


def test_the_default_policy_harvests_beside_the_holder_and_keeps_its_p99(
    tmp_path: Path,
) -> None:
    on = load_scenario(_scenario(tmp_path))
    off = load_scenario(_scenario(tmp_path, harvest="off"))
    alone = simulate(on, "exclusive")
    with_rule, without = simulate(on, DEFAULT_MODE), simulate(off, DEFAULT_MODE)
    assert with_rule.counters["harvested"] > 100
    # Kernels beside the holder's are not fill of its idle time: the share stays a share.
    assert 0 <= with_rule.fill_efficiency <= 1
    assert without.counters["harvested"] == 0
    got = harvest_figures(on, [alone, with_rule])[DEFAULT_MODE]
    base = harvest_figures(off, [alone, without])[DEFAULT_MODE]
    assert got["harvest"]["train"]["harvest"] > base["harvest"]["train"]["harvest"] + 0.2
    assert got["high"]["infer"]["p99_over_alone"] <= 1.05
    # Co-running: kernels of the two tasks overlap in time.
    spans = sorted(with_rule.kernels)
    assert any(b[0] < a[1] and a[2] != b[2] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("gpu", [{"mps": False}, {}], ids=["mps-off", "default-gpu"])
def test_without_mps_nothing_is_harvested(tmp_path: Path, gpu: dict) -> None:
    # The simulator's default GPU is the default deployment's: no MPS, contexts time-slice.
    scenario = load_scenario(_scenario(tmp_path, gpu=gpu))
    assert not scenario.gpu.mps
    result = simulate(scenario, DEFAULT_MODE)
    assert result.counters["harvested"] == 0
    spans = sorted(result.kernels)
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans))  # one at a time


def test_the_mps_mode_co_runs_and_sharing_time_slices_whatever_the_gpu_says(
    tmp_path: Path,
) -> None:
    # The calibration modes name their GPU: plain MPS, and the plain GPU without it.
    for gpu in ({}, {"mps": False}, {"mps": True}):
        scenario = load_scenario(_scenario(tmp_path, gpu=gpu))
        free = sorted(simulate(scenario, "mps").kernels)
        assert any(b[0] < a[1] and a[2] != b[2] for a, b in itertools.pairwise(free))
        sliced = sorted(simulate(scenario, "sharing").kernels)
        assert all(b[0] >= a[1] for a, b in itertools.pairwise(sliced))


def test_an_unknown_harvest_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"\$\.harvest: unknown harvest policy 'greedy'"):
        load_scenario(_scenario(tmp_path, harvest="greedy"))


def test_the_json_reports_the_harvest_beside_the_p99(tmp_path: Path) -> None:
    path = _scenario(tmp_path)
    result = CliRunner().invoke(sim, ["kernels", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    figures = data["modes"][DEFAULT_MODE]["figures"]
    assert figures["hp_p99_x_alone"] <= 1.05 and figures["harvest"] > 0
    out = data["harvest"]
    assert set(out) == {
        "busy_alone",
        "ceiling",
        *(m for m in data["modes"] if m != "exclusive"),
    }
    assert set(out["ceiling"]) == {"train"}
    entry = out[DEFAULT_MODE]
    assert set(entry["high"]["infer"]) == {"p99_over_alone", "mean_over_alone"}
    assert set(entry["harvest"]["train"]) == {"kept", "limit", "harvest"}
    assert figures["harvest"] == entry["harvest"]["train"]["harvest"]
    busy = out["busy_alone"]
    limit = min(1.0, (1 - busy["infer"]) / busy["train"])
    assert entry["harvest"]["train"]["limit"] == pytest.approx(limit, abs=1e-3)


def test_the_ceiling_packs_the_fillers_kernels_in_order_into_the_holders_idle_stretches(
    tmp_path: Path,
) -> None:
    data = {
        "seed": 1,
        "duration_s": 0.001,
        "tasks": [
            {
                "name": "infer",
                "priority": 0,
                "arrival": {"rate_per_s": 10},
                "kernels": [{"name": "h", "duration_us": 100}],
            },
            {
                "name": "train",
                "priority": 5,
                "arrival": {"closed_loop": True},
                "kernels": [{"name": "a", "duration_us": 60}, {"name": "b", "duration_us": 80}],
            },
        ],
    }
    path = tmp_path / "ceiling.json"
    path.write_text(json.dumps(data))
    scenario = load_scenario(path)
    us = 1_000
    # The holder alone: busy 0-200, 300-350 and 900-1000 us; the filler alone: 700 us.
    spans = ((0, 200 * us, 0), (300 * us, 350 * us, 0), (900 * us, 1000 * us, 0))
    exclusive = ModeResult("exclusive", (), 0.0, 0.0, (*spans, (0, 700 * us, 1)))
    got = time_sharing_ceiling(scenario, exclusive, [0.35, 0.7])
    # 200-300: a (60) fits, b (80) does not and blocks the stream; 350-900: b a b a b a b
    # (80 + 60 + ... = 500), then a would end at 910, after the holder's kernel at 900.
    kept = (60 + 500) / 700
    assert got["train"]["kept"] == pytest.approx(kept, abs=1e-4)
    assert got["train"]["harvest"] == pytest.approx(kept / min(1, 0.65 / 0.7), abs=1e-4)
