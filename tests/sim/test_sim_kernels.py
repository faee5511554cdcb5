"""The kernel-level simulator: bad scenarios answer exit code 2 naming the place; the FIKIT
mode keeps the high-priority p99 near exclusive on a short orion scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.policies.admission import DEFAULT_ADMISSION
from gpuloom.sim.kernels import simulate
from gpuloom.sim.scenario import load_scenario
from tests.sim.orion import ROOT, mobilenet_on_orion, needs_traces


def inline(**task: object) -> dict:
    base = {
        "name": "a",
        "priority": 0,
        "kernels": [{"name": "k", "duration_us": 10, "gap_after_us": 5}],
        "arrival": {"closed_loop": True},
    }
    return {"seed": 1, "duration_s": 0.01, "tasks": [{**base, **task}]}


def run(tmp_path: Path, scenario: dict | str, *args: str) -> tuple[int, str]:
    path = tmp_path / "s.json"
    path.write_text(scenario if isinstance(scenario, str) else json.dumps(scenario))
    result = CliRunner().invoke(cli, ["sim", "kernels", str(path), *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ({**inline(), "bogus": 1}, "$.bogus: unknown field"),
        (inline(extra=1), "$.tasks[0].extra: unknown field"),
        (inline(priority=10), "$.tasks[0].priority: must be an integer in 0..9"),
        (inline(priority=-1), "$.tasks[0].priority"),
        (
            inline(kernels=[{"name": "k", "duration_us": -1}]),
            "$.tasks[0].kernels[0].duration_us: must be >= 0",
        ),
        (inline(kernels=[]), "$.tasks[0].kernels: must be a non-empty list"),
        (
            {"seed": 1, "duration_s": 1, "tasks": [{"name": "a", "priority": 0, "arrival": {}}]},
            "needs exactly one of kernels_csv and kernels",
        ),
        (inline(kernels_csv="x.csv"), "needs exactly one of kernels_csv and kernels"),
        (inline(sm_percent=0), "$.tasks[0].sm_percent: must be an integer in 1..100"),
        (inline(quota_request_percent=0), "$.tasks[0].quota_request_percent: must be > 0.0"),
        (inline(quota_limit_percent=101), "$.tasks[0].quota_limit_percent: must be > 0.0"),
        (
            inline(quota_request_percent=50, quota_limit_percent=40),
            "$.tasks[0].quota_request_percent: must not exceed quota_limit_percent (50 > 40)",
        ),
        (inline(quota_request_percent="a"), "$.tasks[0].quota_request_percent: must be a"),
        ("{not json", "line 1, column 2: not JSON"),
    ],
)
def test_bad_scenarios_exit_2_naming_the_place(
    tmp_path: Path, scenario: dict | str, message: str
) -> None:
    code, output = run(tmp_path, scenario)
    assert code == 2
    assert message in output and "s.json" in output
    assert len(output.strip().splitlines()) == 1


def test_missing_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["sim", "kernels", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "none.json: no such file" in result.output
    task = inline()["tasks"][0]
    del task["kernels"]
    task["kernels_csv"] = "missing.csv"
    code, output = run(tmp_path, {"seed": 1, "duration_s": 1, "tasks": [task]})
    assert code == 2 and "$.tasks[0].kernels_csv: no such file" in output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Name,Duration,Color\nk,10,red\n", "line 1, column 3: unknown column 'Color'"),
        ("Name,Duration\nk,-5\n", "line 2, column 2: the duration must be a number >= 0"),
        ("Name,Duration\nk,abc\n", "line 2, column 2"),
        ("Name,Duration\n", "no kernels"),
    ],
)
def test_bad_kernel_lists(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "k.csv").write_text(text)
    task = inline()["tasks"][0]
    del task["kernels"]
    task["kernels_csv"] = "k.csv"
    code, output = run(tmp_path, {"seed": 1, "duration_s": 1, "tasks": [task]})
    assert code == 2 and message in output and "k.csv" in output


def test_json_output_has_every_mode_and_field(tmp_path: Path) -> None:
    scenario = inline()
    scenario["tasks"].append({**scenario["tasks"][0], "name": "b", "priority": 3})
    code, output = run(tmp_path, scenario, "--json")
    assert code == 0
    data = json.loads(output)
    # The dispatcher's default policy is named, and simulated among the modes.
    assert data["default_mode"] == DEFAULT_ADMISSION == "composed"
    modes = data["modes"]
    assert set(modes) == {"exclusive", "sharing", "token", "fifo", "fikit", "composed"}
    for result in modes.values():
        assert set(result) == {"tasks", "gpu_busy", "fill_efficiency", "figures"}
        assert set(result["figures"]) == {"hp_p99_x_alone", "be_work_share", "harvest"}
        assert set(result["tasks"]["a"]) == {
            "priority",
            "completed",
            "jct_mean_ms",
            "jct_p50_ms",
            "jct_p99_ms",
            "jct_cv",
            "device_share",
        }
    alone = {"hp_p99_x_alone": 1.0, "be_work_share": 1.0, "harvest": None}  # (none alone)
    assert modes["exclusive"]["figures"] == alone
    # Sharing the one queue slows the priority-0 task down.
    assert modes["sharing"]["figures"]["hp_p99_x_alone"] > 1.0


@needs_traces
def test_benchmark_scenarios_load_from_the_checkout() -> None:
    # ../../shared/... from benchmarks/ reaches /work/shared beside the checkout.
    for path in sorted((ROOT / "benchmarks").glob("fikit_*.json")):
        assert load_scenario(path).tasks


@needs_traces
def test_fikit_keeps_high_priority_p99_near_exclusive(tmp_path: Path) -> None:
    loaded = mobilenet_on_orion(tmp_path)  # 10 s, 92 requests: over fewer, p99 is one request
    p99 = {}
    low_done = 0
    for mode in ("exclusive", "sharing", "fikit"):
        stats = simulate(loaded, mode).to_dict()["tasks"]
        p99[mode] = stats["mobilenetv2-4-fwd"]["jct_p99_ms"]
        if mode == "fikit":
            low_done = stats["mobilenetv2-32-fb1"]["completed"]
    assert p99["exclusive"] <= p99["fikit"] < p99["sharing"]
    assert p99["fikit"] <= 1.05 * p99["exclusive"]
    assert low_done > 0


def test_same_seed_same_result(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    scenario = inline()
    scenario["tasks"].append({**scenario["tasks"][0], "name": "b", "priority": 3})
    path.write_text(json.dumps(scenario))
    loaded = load_scenario(path)
    assert simulate(loaded, "fikit").to_dict() == simulate(loaded, "fikit").to_dict()


def test_a_late_filler_overruns_the_window_and_the_fill_guard_keeps_it_clear(
    tmp_path: Path,
) -> None:
    """grant_latency_us: a granted filler launches that long after its grant, as a live shim
    wakes after its grant; its fill can then land on the holder's next kernel. The core's
    fill_guard_us leaves that much of each window free."""
    scenario = json.loads((ROOT / "benchmarks" / "fikit_fake_driver.json").read_text())
    scenario["duration_s"] = 2

    def holder_mean_ms(grant_latency_us: float, guard_us: float) -> float:
        path = tmp_path / f"late-{grant_latency_us}-{guard_us}.json"
        path.write_text(
            json.dumps(
                {
                    **scenario,
                    "grant_latency_us": grant_latency_us,
                    "fikit": {"fill_guard_us": guard_us},
                    # One kernel at a time (no MPS): a late fill holds the GPU.
                    "gpu": {"mps": False},
                }
            )
        )
        stats = simulate(load_scenario(path), "fikit").to_dict()["tasks"]
        assert stats["train"]["completed"] > 0
        return stats["infer"]["jct_mean_ms"]

    on_time = holder_mean_ms(0, 0)
    late = holder_mean_ms(200, 0)
    guarded = holder_mean_ms(200, 200)
    assert late > on_time * 1.02  # late fills delay the holder ...
    assert guarded < late  # ... and a guard as long as the lateness takes most of it back
    assert guarded <= on_time * 1.02
