"""Helpers of the deployment checks: the tools the test extra installs, run as programs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tool(name: str, *args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run `name` from the venv (check-jsonschema, hadolint, kubernetes-validate)."""
    program = BIN / name
    assert program.exists(), f"{program} missing: install the test extra (scripts/test does)"
    return subprocess.run(
        [str(program), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def broken_copy(source: Path, into: Path, broken: str, replacement: str) -> Path:
    """A copy of `source` in `into` (same name) with the first `broken` replaced; `broken` must
    be in it, so that the copy really differs."""
    text = source.read_text()
    assert broken in text
    copy = into / source.name
    copy.write_text(text.replace(broken, replacement, 1))
    return copy
