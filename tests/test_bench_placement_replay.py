"""scripts/bench_placement_replay: a pod list at its own times through the live placement core."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_placement_replay"

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,8000,16384,1,T4\nn1,2000,16384,1,T4\n"
HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
)
PODS = (
    HEADER
    + """a,4000,1024,1,1000,,LS,Running,0,10,0
b,1000,1024,1,1000,,LS,Running,1,6,1
c,4000,1024,1,500,,LS,Running,2,5,2
d,1000,1024,0,0,,LS,Running,3,4,3
"""
)


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text(PODS)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", str(tmp_path / "nodes.csv"),
         "--pods", str(tmp_path / "pods.csv"), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_job_short_of_node_cpu_waits_for_the_node_that_has_it(tmp_path: Path) -> None:
    result = run(tmp_path, "--compress", "1", "--policies", "mra", "--json", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    (live,) = json.loads((tmp_path / "o").read_text())["live"]
    # a takes n0 (n1 has too little CPU); b fits n1 at once; c needs 4 cores: only n0 has
    # them, so it waits until a leaves at 10 (delay 8) and holds half a GPU until 13.
    # d asks for no GPU: left out.
    assert live["pods"] == 3 and live["placed_pods"] == 3
    assert live["queued_pods"] == 1
    assert live["delay_max_s"] == 8.0
    assert live["alloc_pct_peak"] == 100.0  # a and b: both GPUs
    assert "1 without GPUs left out" in result.stderr


def test_an_unknown_policy_is_refused_naming_it(tmp_path: Path) -> None:
    result = run(tmp_path, "--policies", "mra,nosuch")
    assert result.returncode == 2
    assert "--policies" in result.stderr and "nosuch" in result.stderr


def test_a_bad_pod_list_is_refused_with_file_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text(PODS.replace("a,4000,1024,1,1000", "a,4000,1024,1,1500"))
    result = run(tmp_path, "--pods", str(tmp_path / "bad.csv"))
    assert result.returncode == 2
    assert "bad.csv, line 2, column gpu_milli" in result.stderr
