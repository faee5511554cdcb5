"""scripts/bench_fikit_torch's own logic (it needs a GPU to run; its parts that need none)."""

import argparse
import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_fikit_torch"


def load():  # a script without .py: loaded by path
    loader = importlib.machinery.SourceFileLoader("bench_fikit_torch", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


bench = load()


def test_a_variant_names_dispatcher_settings_only() -> None:
    assert bench.parse_variant("guard:GPULOOM_DISPATCHER_POLICY_ARGS=fikit.fill_guard_ns=8") == (
        "guard",
        {"GPULOOM_DISPATCHER_POLICY_ARGS": "fikit.fill_guard_ns=8"},
    )
    # A comma inside policy arguments belongs to them; one before a setting separates.
    args = "fikit.fill_guard_ns=8,tokens.lease_max_s=0.05"
    assert bench.parse_variant(
        f"x:GPULOOM_DISPATCHER_POLICY_ARGS={args},GPULOOM_DISPATCHER_A=1"
    ) == (
        "x",
        {"GPULOOM_DISPATCHER_POLICY_ARGS": args, "GPULOOM_DISPATCHER_A": "1"},
    )
    two = bench.parse_variant("x:GPULOOM_DISPATCHER_A=1,GPULOOM_DISPATCHER_B=2")
    assert two == ("x", {"GPULOOM_DISPATCHER_A": "1", "GPULOOM_DISPATCHER_B": "2"})
    for bad in ("noname", ":GPULOOM_DISPATCHER_A=1", "x:GPULOOM_SHIM_WAIT_MS=5", "x:A", "x:A="):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_variant(bad)


def infer(mean_ms: float) -> dict:
    return {"mean_ms": mean_ms, "p50_ms": mean_ms, "p99_ms": 2 * mean_ms}


def test_the_table_compares_each_round_with_its_own_exclusive() -> None:
    rounds = [
        {
            "exclusive": infer(5.0),
            "fikit": {"infer": infer(5.5), "low": {"iterations_per_s": 30.0}},
        },
        {
            # A slower round: its own exclusive is the yardstick.
            "fikit": {"infer": infer(7.0), "low": {"iterations_per_s": 28.0}},
            "exclusive": infer(7.0),
        },
    ]
    rows = {row.split("|")[1].strip(): row for row in bench.table(rounds, None).splitlines()}
    fikit = [cell.strip() for cell in rows["fikit"].split("|")]
    assert fikit[7] == "1.100, 1.000"  # per round
    assert fikit[6] == f"{6.25 / 6.0:.3f} / {12.5 / 12.0:.3f}"  # means over the rounds
    assert fikit[8] == "30.00 it/s / 28.00 it/s"
    assert fikit[9:11] == ["1.050", "-"]  # hp p99 x alone (median of 1.1, 1.0); no share alone
    alone = bench.table(rounds, {"requests_per_s": 12.5}).splitlines()[-1]
    assert "12.50 req/s" in alone


def test_the_two_figures_are_each_rounds_own_ratios() -> None:
    rounds = [
        {
            "exclusive": infer(5.0),
            "fikit": {"infer": infer(6.0), "low": {"iterations_per_s": 15.0}},
        },
        {
            "exclusive": infer(4.0),
            "fikit": {"infer": infer(4.0), "low": {"iterations_per_s": 27.0}},
        },
        {
            "exclusive": infer(5.0),
            "fikit": {"infer": infer(5.5), "low": {"iterations_per_s": 21.0}},
        },
        {"exclusive": infer(5.0)},  # a round cut off before its fikit phase
    ]
    # p99 x alone: 1.2, 1.0, 1.1 -> median 1.1; work share against 30 it/s alone: 0.5, 0.9, 0.7.
    assert bench.figures(rounds, "fikit", {"iterations_per_s": 30.0}) == ("1.100", "0.700")
    assert bench.figures(rounds, "fikit", None) == ("1.100", "-")
    assert bench.figures(rounds, "exclusive", None) == ("1.000", "-")
