"""The MobileNetV2 scenario on orion's kernel lists (../shared/traces beside the checkout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuloom.sim.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "orion-model-kernels"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no ../shared/traces beside")


def mobilenet_on_orion(tmp_path: Path) -> Scenario:
    """benchmarks/fikit_mobilenetv2.json (10 s, 92 requests), its kernel lists from TRACES."""
    scenario = json.loads((ROOT / "benchmarks" / "fikit_mobilenetv2.json").read_text())
    for task in scenario["tasks"]:
        task["kernels_csv"] = str(TRACES / Path(task["kernels_csv"]).name)
    path = tmp_path / "short.json"
    path.write_text(json.dumps(scenario))
    return load_scenario(path)
