"""scripts/fuzz: the fuzz of tests/test_fuzz.py with a number of examples of one's choosing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUZZ = str(ROOT / "scripts" / "fuzz")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FUZZ, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_a_bad_number_of_examples_is_a_usage_error() -> None:
    for args, env in (
        (("--examples", "0"), {}),
        (("--examples",), {}),
        ((), {"GPULOOM_FUZZ_EXAMPLES": "many"}),
    ):
        result = _run(*args, **env)
        assert result.returncode == 2, (args, env, result.stderr)
        assert "scripts/fuzz:" in result.stderr and "whole number" in result.stderr
        assert "passed" not in result.stdout  # refused before any fuzzing


def test_the_longer_run_takes_the_number_of_examples_asked_for() -> None:
    result = _run("--examples", "3", "-k", "ListJobs and generated")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== fuzz: 3 examples per RPC and case" in result.stdout
    assert "1 passed" in result.stdout
