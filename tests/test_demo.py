"""scripts/demo runs its scripted day to the end on the embedded plane, as CI runs it: the fleet,
a profile through grpcurl, two jobs sharing one GPU through the shim, a MIG batch."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_runs_to_the_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--state", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.rstrip().endswith("demo done: every step did what it showed")
    assert "1 kernel(s): sgemm" in out
    assert re.search(r"both assigned at once, on SIM-A100-80GB-1-[0-9a-f]{8}\n", out)
    assert len(re.findall(r"served \d+ requests on a \d+% SM share: .* failures 0", out)) == 2
    mig = re.findall(r"(\w+): started on MIG-SIM-A100-80GB-0-\S+ ", out)
    assert sorted(mig) == ["bfs", "lud", "nw", "srad"]
    assert sorted(re.findall(r"(\w+): exit code 0 at", out)) == sorted(mig)
    # The task ran as the demo's runner, in the instance it was handed.
    log = (tmp_path / "demo" / "mig-logs" / "bfs.log").read_text()
    assert log.startswith("bfs on MIG-SIM-A100-80GB-0-")


def test_a_step_that_fails_ends_the_demo_with_exit_code_1(tmp_path: Path) -> None:
    # A state directory too deep for the dispatchers' Unix sockets (107 bytes): no plane starts.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    result = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--state", str(deep)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "demo failed: gpuloom up did not start" in result.stdout
    assert "demo done" not in result.stdout
