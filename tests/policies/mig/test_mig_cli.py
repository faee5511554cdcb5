"""`gpuloom mig plan` and `gpuloom mig synth` through click's test runner."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.clients.cli.mig import mig
from gpuloom.domain.mig_geometry import A30, A100
from gpuloom.policies.mig import area_lower_bound, verify_plan

from .helpers import TRACES, rodinia

GOOD_A30 = "# a comment\nalpha 4 2.5 1.5\n\nbeta 3 2 inf  # cannot use 4 slices\ngamma 1 1 1\n"


def run(*args: str):
    return CliRunner().invoke(mig, list(args))


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def plans(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_registered_under_the_gpuloom_command(tmp_path: Path) -> None:
    path = write(tmp_path, "t.txt", GOOD_A30)
    result = CliRunner().invoke(cli, ["mig", "plan", "--gpu", "A30", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert plans(result.stdout)[0]["file"] == str(path)


@pytest.mark.parametrize("policy", ["far", "fixpart-best", "fixpart:2,1,1", "miso", "far-paper"])
def test_json_contract(tmp_path: Path, policy: str) -> None:
    path = write(tmp_path, "t.txt", GOOD_A30)
    result = run("plan", "--gpu", "A30", "--policy", policy, "--json", str(path))
    assert result.exit_code == 0, result.output
    (plan,) = plans(result.stdout)
    assert plan["file"] == str(path)
    assert plan["policy"] == policy
    assert plan["plan_ms"] >= 0
    assert plan["tasks"] == 3
    assert sorted(a["task"] for a in plan["assignments"]) == ["alpha", "beta", "gamma"]
    for a in plan["assignments"]:
        assert set(a) == {"task", "index", "size", "first_slice", "start_s", "end_s"}
        assert A30.is_legal(a["size"], a["first_slice"])
    for r in plan["reconfigurations"]:
        assert set(r) == {"action", "size", "first_slice", "start_s", "end_s"}
        assert r["action"] in ("create", "destroy")
    assert plan["makespan_s"] == max(a["end_s"] for a in plan["assignments"])
    assert plan["makespan_s"] >= plan["lower_bound_s"] > 0
    beta = next(a for a in plan["assignments"] if a["task"] == "beta")
    assert beta["size"] != 4  # inf there


def test_json_plan_for_rodinia_matches_the_library() -> None:
    path = TRACES / "rodinia16_A100.txt"
    result = run("plan", "--gpu", "A100", "--json", str(path))
    assert result.exit_code == 0, result.output
    (plan,) = plans(result.stdout)
    tasks = rodinia(A100)
    assert plan["lower_bound_s"] == pytest.approx(area_lower_bound(tasks, A100))
    assert plan["makespan_s"] <= 1.217 * plan["lower_bound_s"]
    assert len(plan["assignments"]) == 16


def test_text_output_lists_tasks_and_reconfigurations(tmp_path: Path) -> None:
    path = write(tmp_path, "t.txt", GOOD_A30)
    result = run("plan", "--gpu", "a30", str(path))
    assert result.exit_code == 0, result.output
    assert "makespan" in result.stdout and "lower bound" in result.stdout
    for name in ("alpha", "beta", "gamma"):
        assert name in result.stdout
    assert "create" in result.stdout


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("a 1 2 3\nb 1 2\n", 2, "expected 3 times"),
        ("a 1 2 3 4 5\n", 1, "expected 3 times"),
        ("# header\na 1 -2 3\n", 2, "positive"),
        ("a 1 nan 3\n", 1, "positive"),
        ("a 1 two 3\n", 1, "not a number"),
        ("a 1 2 3\n\nb inf inf inf\n", 3, "cannot run on any instance size"),
    ],
)
def test_bad_rows_name_file_and_line_and_other_files_are_still_planned(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    good = write(tmp_path, "good.txt", GOOD_A30)
    bad = write(tmp_path, "bad.txt", text)
    result = run("plan", "--gpu", "A30", "--json", str(bad), str(good))
    assert result.exit_code == 2
    assert f"{bad}:{line}:" in result.stderr
    assert message in result.stderr
    assert [p["file"] for p in plans(result.stdout)] == [str(good)]


@pytest.mark.parametrize("text", ["", "# only a comment\n\n   \n"])
def test_empty_files_are_errors(tmp_path: Path, text: str) -> None:
    empty = write(tmp_path, "empty.txt", text)
    good = write(tmp_path, "good.txt", GOOD_A30)
    result = run("plan", "--gpu", "A30", "--json", str(good), str(empty))
    assert result.exit_code == 2
    assert f"{empty}: no tasks" in result.stderr
    assert [p["file"] for p in plans(result.stdout)] == [str(good)]


def test_unreadable_files_are_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    good = write(tmp_path, "good.txt", GOOD_A30)
    result = run(
        "plan", "--gpu", "A30", "--json", str(missing), str(tmp_path), str(binary), str(good)
    )
    assert result.exit_code == 2
    assert f"{missing}: cannot read" in result.stderr
    assert f"{tmp_path}: cannot read" in result.stderr
    assert f"{binary}: cannot read: not a UTF-8 text file" in result.stderr
    assert [p["file"] for p in plans(result.stdout)] == [str(good)]


def test_a_fixed_partition_that_cannot_run_a_task_is_an_error_for_that_file(tmp_path):
    needs_four = write(tmp_path, "four.txt", "big inf inf 2\n")
    good = write(tmp_path, "good.txt", GOOD_A30)
    result = run(
        "plan", "--gpu", "A30", "--policy", "fixpart:2,2", "--json", str(needs_four), str(good)
    )
    assert result.exit_code == 2
    assert f"{needs_four}: " in result.stderr and "partition 2,2" in result.stderr
    assert [p["file"] for p in plans(result.stdout)] == [str(good)]


def test_unknown_gpu_and_policy_are_usage_errors(tmp_path: Path) -> None:
    path = write(tmp_path, "t.txt", GOOD_A30)
    result = run("plan", "--gpu", "V100", str(path))
    assert result.exit_code == 2
    assert "V100" in result.stderr
    result = run("plan", "--gpu", "A30", "--policy", "sjf", str(path))
    assert result.exit_code == 2
    assert "unknown MIG policy" in result.stderr


def test_a_partition_the_gpu_does_not_have_is_an_error_per_file(tmp_path: Path) -> None:
    path = write(tmp_path, "t.txt", GOOD_A30)
    result = run("plan", "--gpu", "A30", "--policy", "fixpart:3", "--json", str(path))
    assert result.exit_code == 2
    assert f"{path}: no valid A30 partition has instances of sizes 3" in result.stderr
    assert result.stdout == ""


def test_gantt_one_file(tmp_path: Path) -> None:
    path = write(tmp_path, "t.txt", GOOD_A30)
    out = tmp_path / "plan.png"
    result = run("plan", "--gpu", "A30", "--gantt", str(out), str(path))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gantt_several_files_one_png_each(tmp_path: Path) -> None:
    first = write(tmp_path, "first.txt", GOOD_A30)
    second = write(tmp_path, "second.txt", GOOD_A30)
    out = tmp_path / "plan.png"
    result = run("plan", "--gpu", "A30", "--gantt", str(out), str(first), str(second))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.glob("plan*.png")) == [
        "plan-1-first.png",
        "plan-2-second.png",
    ]


def test_synth_writes_a_file_that_plans(tmp_path: Path) -> None:
    out = tmp_path / "batch.txt"
    result = run(
        "synth",
        "--gpu",
        "A100",
        "--workload",
        "good",
        "--tasks",
        "12",
        "--seed",
        "4",
        "-o",
        str(out),
    )
    assert result.exit_code == 0, result.output
    again = run("synth", "--gpu", "A100", "--workload", "good", "--tasks", "12", "--seed", "4")
    assert again.stdout == out.read_text()
    planned = run("plan", "--gpu", "A100", "--json", str(out))
    assert planned.exit_code == 0, planned.output
    (plan,) = plans(planned.stdout)
    assert plan["tasks"] == 12


def test_synth_plans_verify_in_the_library(tmp_path: Path) -> None:
    from gpuloom.policies.mig import get_planner
    from gpuloom.policies.mig.taskfile import parse_tasks

    result = run(
        "synth",
        "--gpu",
        "A30",
        "--workload",
        "mixed",
        "--times",
        "narrow",
        "--memory-bound",
        "0.5",
        "--tasks",
        "9",
    )
    assert result.exit_code == 0, result.output
    tasks = parse_tasks(result.stdout, A30)
    assert len(tasks) == 9
    verify_plan(get_planner("far").plan(tasks, A30), tasks, A30)
