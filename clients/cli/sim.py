"""`gpuloom sim`: offline simulators. `gpuloom sim kernels SCENARIO.json` runs the kernel-level
model of one GPU under exclusive, sharing, token and FIKIT admission (docs/fikit.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gpuloom.clients.cli.table import render_table
from gpuloom.policies.fikit.core import FikitLibraryMissingError
from gpuloom.sim.kernels import MODES, ModeResult, simulate
from gpuloom.sim.scenario import ScenarioError, load_scenario

TIMELINE_SPAN_NS = 20_000_000  # 20 ms of the run, from its middle


@click.group()
def sim() -> None:
    """Offline simulators (no services needed)."""


@sim.command("kernels")
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--mode",
    type=click.Choice([*MODES, "all"]),
    default="all",
    show_default=True,
    help="Admission mode to simulate.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--timeline",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw 20 ms of device activity per mode into this PNG.",
)
def kernels(scenario: Path, mode: str, as_json: bool, timeline: Path | None) -> None:
    """Simulate SCENARIO.json: one GPU, one FIFO device queue, kernels from real lists."""
    try:
        loaded = load_scenario(scenario)
    except ScenarioError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    modes = MODES if mode == "all" else (mode,)
    try:
        results = [simulate(loaded, m) for m in modes]
    except FikitLibraryMissingError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"modes": {r.mode: r.to_dict() for r in results}}, indent=2))
    else:
        _print(results)
    if timeline is not None:
        _draw(results, loaded.duration_s, [t.name for t in loaded.tasks], timeline)


def _fmt(value: float | int | None) -> str:
    return "-" if value is None else f"{value:g}"


def _print(results: list[ModeResult]) -> None:
    rows = []
    for result in results:
        summary = result.to_dict()
        for name, stats in summary["tasks"].items():
            rows.append(
                [
                    result.mode,
                    name,
                    str(stats["priority"]),
                    str(stats["completed"]),
                    _fmt(stats["jct_mean_ms"]),
                    _fmt(stats["jct_p50_ms"]),
                    _fmt(stats["jct_p99_ms"]),
                    _fmt(stats["jct_cv"]),
                    _fmt(summary["gpu_busy"]),
                    _fmt(summary["fill_efficiency"]),
                ]
            )
    header = ["MODE", "TASK", "PRIO", "DONE", "JCT MEAN ms", "P50 ms", "P99 ms", "CV"]
    click.echo(render_table([*header, "GPU BUSY", "FILL"], rows))


def _draw(results: list[ModeResult], duration_s: float, names: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = max(0, round(duration_s * 1e9 / 2) - TIMELINE_SPAN_NS // 2)
    stop = start + TIMELINE_SPAN_NS
    colors = plt.get_cmap("tab10")
    figure, axes = plt.subplots(figsize=(10, 0.6 + 0.5 * len(results)))
    for lane, result in enumerate(results):
        spans: dict[int, list[tuple[float, float]]] = {}
        for begin, end, task in result.kernels:
            if end > start and begin < stop:
                spans.setdefault(task, []).append(((begin - start) / 1e6, (end - begin) / 1e6))
        for task, bars in spans.items():
            axes.broken_barh(bars, (lane - 0.4, 0.8), color=colors(task % 10), linewidth=0)
    axes.set_yticks(range(len(results)), [r.mode for r in results])
    axes.invert_yaxis()
    axes.set_xlim(0, TIMELINE_SPAN_NS / 1e6)
    axes.set_xlabel(f"ms from t = {start / 1e9:g} s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i % 10)) for i in range(len(names))]
    axes.legend(handles, names, loc="upper right", fontsize="small", ncol=len(names))
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    plt.close(figure)
