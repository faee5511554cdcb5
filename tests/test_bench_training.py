"""scripts/bench_training on a small folder of traces: its counts are the simulator's, and bad
input exits 2 before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuloom.policies.training.registry import get_policy
from gpuloom.sim.training import Throughputs, parse_cluster, parse_trace, simulate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_training"
TABLE = {"v100": {"('C', 1)": {"null": 5.0}, "('C', 2)": {"null": 9.0}}}


def line(steps: int, arrival: float, scale: int = 1) -> str:
    return f"C\tpython3 train.py\t--steps\t1\t{steps}\t{arrival:f}\t{scale}"


def folder(tmp_path: Path) -> Path:
    (tmp_path / "simulation_throughputs.json").write_text(json.dumps(TABLE))
    # On one GPU, five short jobs (gandiva's Gittins rule sees them end), four 10-hour jobs,
    # then a short one: it waits, two ahead, and is time-sliced in.
    seen = [line(900, t) for t in range(5)]
    long = [line(180_000, t) for t in (1000, 1010, 1020, 1030)]
    (tmp_path / "burst.trace").write_text("\n".join([*seen, *long, line(900, 1040)]) + "\n")
    (tmp_path / "alone.trace").write_text(line(3_600, 0) + "\n")  # nobody waits: a tie
    (tmp_path / "philly.trace").write_text("")  # empty, as Gavel's: left out
    return tmp_path


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--workers", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_counts_are_the_simulators(tmp_path: Path) -> None:
    traces = folder(tmp_path)
    out = tmp_path / "runs.json"
    done = bench("--traces", str(traces), "--cluster", "v100:1/1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert {(r["trace"], r["cluster"]) for r in rows} == {
        ("alone", "v100:1/1"),
        ("burst", "v100:1/1"),
    }
    table = Throughputs(json.dumps(TABLE), "t")
    servers = parse_cluster("v100:1/1", table.gpu_types)
    for row in rows:
        text = (traces / f"{row['trace']}.trace").read_text()
        jobs = parse_trace(text, row["trace"], table, ["v100"])
        for policy in ("fifo", "gandiva"):
            run = simulate(jobs, servers, table, get_policy(policy))
            assert row[policy] == [run.avg_jct_h, run.avg_first_feedback_h]
    burst = next(r for r in rows if r["trace"] == "burst")
    assert burst["gandiva"][0] < burst["fifo"][0]  # the short job no longer waits 40 h
    assert "| 2 | 1 | 1 | 0 | 0 |" in done.stdout  # runs, lower, same, higher, later


def test_bad_input_exits_2_and_runs_nothing(tmp_path: Path) -> None:
    traces = folder(tmp_path)
    out = tmp_path / "runs.json"
    for args, says in [
        (("--cluster", "h100:8"), "unknown GPU type 'h100'"),
        (("--cluster", "v100:8", "--policy", "nope"), "unknown training policy 'nope'"),
    ]:
        done = bench("--traces", str(traces), "--json", str(out), *args)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert not out.exists()
    (traces / "bad.trace").write_text(line(10, 0) + "\nnot a job\n")
    done = bench("--traces", str(traces), "--cluster", "v100:8")
    assert done.returncode == 2 and "bad.trace, line 2: 1 tab-separated fields" in done.stderr
    (traces / "bad.trace").unlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    done = bench("--traces", str(empty), "--cluster", "v100:8")
    assert done.returncode == 2 and "no non-empty .trace file" in done.stderr
    done = bench("--traces", str(traces), "--workers", "0")
    assert done.returncode == 2 and "--workers" in done.stderr
