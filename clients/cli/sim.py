"""`gpuloom sim`: offline simulators. `gpuloom sim kernels SCENARIO.json` runs the kernel-level
model of one GPU under exclusive, sharing, token and FIKIT admission (docs/fikit.md); `gpuloom
sim fleet` places a node/pod list such as the Alibaba GPU trace with fleet policies
(docs/placement.md); `gpuloom sim training` runs Gavel's Philly-derived training traces under
FIFO and Gandiva (docs/training.md)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import click

from gpuloom.clients.cli.table import echo_table
from gpuloom.policies.fikit.core import FikitLibraryMissingError
from gpuloom.policies.fleet.registry import POLICIES as FLEET_POLICIES
from gpuloom.policies.fleet.registry import get_policy as get_fleet_policy
from gpuloom.policies.registry import UnknownPolicyError
from gpuloom.policies.training.registry import POLICIES as TRAINING_POLICIES
from gpuloom.policies.training.registry import get_policy as get_training_policy
from gpuloom.sim.fleet import (
    FleetInputError,
    FleetRun,
    ReplayRun,
    Workload,
    parse_draws,
    parse_lifetimes,
    parse_nodes,
    parse_pods,
    replay,
)
from gpuloom.sim.fleet import simulate as simulate_fleet
from gpuloom.sim.harvest import harvest_figures, least_harvest
from gpuloom.sim.kernels import DEFAULT_MODE, MODES, ModeResult, figures, simulate
from gpuloom.sim.scenario import ScenarioError, load_scenario
from gpuloom.sim.training import (
    THROUGHPUTS_NAME,
    Throughputs,
    TrainingInputError,
    TrainingRun,
    find_throughputs,
    parse_cluster,
    parse_trace,
)
from gpuloom.sim.training import simulate as simulate_training

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
    help=f"Admission mode to simulate (the dispatcher's default: {DEFAULT_MODE}).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--timeline",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw 20 ms of device activity per mode into this PNG.",
)
def kernels(scenario: Path, mode: str, as_json: bool, timeline: Path | None) -> None:
    """Simulate SCENARIO.json: one GPU (time slices; MPS with gpu.mps), kernels from real lists."""
    try:
        loaded = load_scenario(scenario)
    except ScenarioError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    modes = MODES if mode == "all" else (mode,)
    try:
        results = [simulate(loaded, m) for m in modes]
        # The figures compare each mode with the tasks alone.
        alone = next((r for r in results if r.mode == "exclusive"), None)
        alone = alone or simulate(loaded, "exclusive")
    except FikitLibraryMissingError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(1)
    harvest = harvest_figures(loaded, [alone, *[r for r in results if r is not alone]])
    shown = {
        r.mode: {**r.to_dict(), "figures": {**figures(r, alone), **least_harvest(harvest, r.mode)}}
        for r in results
    }
    if as_json:
        out = {"default_mode": DEFAULT_MODE, "modes": shown, "harvest": harvest}
        click.echo(json.dumps(out, indent=2))
    else:
        _print(results, shown)
    if timeline is not None:
        _draw(results, loaded.duration_s, [t.name for t in loaded.tasks], timeline)


def _fmt(value: float | int | None) -> str:
    return "-" if value is None else f"{value:g}"


def _print(results: list[ModeResult], shown: dict[str, dict]) -> None:
    rows = []
    for result in results:
        summary = shown[result.mode]
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
                    _fmt(summary["figures"]["hp_p99_x_alone"]),
                    _fmt(summary["figures"]["be_work_share"]),
                    _fmt(summary["figures"]["harvest"]),
                ]
            )
    header = ["MODE", "TASK", "PRIO", "DONE", "JCT MEAN ms", "P50 ms", "P99 ms", "CV"]
    echo_table([*header, "GPU BUSY", "FILL", "HP P99 xALONE", "BE WORK", "HARVEST"], rows)
    click.echo(f"(the dispatcher's default policy: {DEFAULT_MODE})")


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


@sim.command("fleet")
@click.option(
    "--nodes", "nodes_csv", required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option("--pods", "pods_csv", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--policy",
    "policies",
    multiple=True,
    default=("best",),
    show_default=True,
    help=f"Fleet policy (repeatable): {FLEET_POLICIES.known}.",
)
@click.option("--seed", default=0, show_default=True, help="First seed.")
@click.option("--repeat", default=1, show_default=True, help="Seeds seed..seed+K-1.")
@click.option(
    "--inflate",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Tune the list's GPU requests to this x the GPU capacity.  [default: 1.3]",
)
@click.option(
    "--replay",
    "replay_times",
    is_flag=True,
    help="Replay the pods' creation and deletion times instead (pods leave; pods that do not "
    "fit wait): allocation over time and queueing delay.",
)
@click.option(
    "--compress",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="With --replay: divide the creation times by this (arrivals this many times faster, "
    "lifetimes kept).  [default: 1]",
)
@click.option(
    "--draws",
    "draws_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Instead of drawing from --seed: the arrival and node orders of this JSON file "
    "(seed, pods, rank; tests/sim/data/published_draws.go writes the published simulator's), "
    "one run per file (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (policy, seed).")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw allocation against arrived demand (with --replay: against time) per policy "
    "into this PNG.",
)
def fleet(
    nodes_csv: Path,
    pods_csv: Path,
    policies: tuple[str, ...],
    seed: int,
    repeat: int,
    inflate: float | None,
    replay_times: bool,
    compress: float | None,
    draws_files: tuple[Path, ...],
    as_json: bool,
    plot: Path | None,
) -> None:
    """Place the pods of POD list on the NODES list, one at a time, none leaving (the FGD
    paper's simulator's protocol: shuffled list, tuned to INFLATE x GPU capacity by clones or
    random removal; ties in a node order drawn from the seed; the published seeds are 42-51);
    with --replay, at the list's own creation times, each leaving after its lifetime."""
    if replay_times and inflate is not None:
        click.echo("error: --inflate is for the FGD protocol; --replay takes no clones", err=True)
        sys.exit(2)
    if compress is not None and not replay_times:
        click.echo("error: --compress is for --replay", err=True)
        sys.exit(2)
    if draws_files and replay_times:
        click.echo("error: --draws is for the FGD protocol, not --replay", err=True)
        sys.exit(2)
    context = click.get_current_context()
    seeded = any(
        context.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT
        for p in ("seed", "repeat")
    )
    if draws_files and seeded:
        click.echo("error: --draws gives each run's seed; leave out --seed and --repeat", err=True)
        sys.exit(2)
    try:
        chosen = [get_fleet_policy(name) for name in policies]
        nodes = parse_nodes(_read(nodes_csv), str(nodes_csv))
        pods_text = _read(pods_csv)
        pods = parse_pods(pods_text, str(pods_csv), {n.model for n in nodes})
        lifetimes = parse_lifetimes(pods_text, str(pods_csv)) if replay_times else []
        given = [parse_draws(_read(path), str(path), len(pods), len(nodes)) for path in draws_files]
    except (FleetInputError, UnknownPolicyError) as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    workload = Workload.of(pods)
    if replay_times:
        replays = []
        for name, policy in zip(policies, chosen, strict=True):
            for s in range(seed, seed + max(repeat, 1)):
                run = replay(nodes, workload, lifetimes, policy, s, compress or 1.0)
                replays.append(run)
                if as_json:
                    click.echo(json.dumps({**run.summary(), "policy": name}))
        if not as_json:
            _print_replays(replays, policies)
        if plot is not None:
            _plot_replays(replays, policies, plot)
        return
    inflate = 1.3 if inflate is None else inflate
    runs = []
    plan = given or [(s, None) for s in range(seed, seed + max(repeat, 1))]
    for name, policy in zip(policies, chosen, strict=True):
        for s, draws in plan:
            run = simulate_fleet(nodes, workload, policy, s, inflate, draws)
            runs.append(run)
            if as_json:
                click.echo(json.dumps({**run.summary(), "policy": name}))
    if not as_json:
        _print_fleet(runs, policies)
    if plot is not None:
        _plot_fleet(runs, policies, plot)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise FleetInputError(f"{path}, line 0, column -: {error.strerror}") from None


def _print_fleet(runs: list[FleetRun], names: tuple[str, ...]) -> None:
    rows = []
    for name, run in zip(_labels(runs, names), runs, strict=True):
        rows.append(
            [
                name,
                str(run.seed),
                _fmt(run.alloc_pct_at_100),
                _fmt(run.alloc_pct_at_130),
                _fmt(run.frag_pct_at_130),
                str(run.failed_pods),
                f"{run.wall_s:.2f}",
                f"{run.decisions_per_s:.0f}",
            ]
        )
    header = ["POLICY", "SEED", "ALLOC% @100", "ALLOC% @130", "FRAG% @130", "FAILED", "WALL s"]
    echo_table([*header, "DECISIONS/s"], rows)


R = TypeVar("R")


def _labels(runs: Sequence[object], names: tuple[str, ...]) -> list[str]:
    """The name each run was asked by (an alias such as "best" shows as given)."""
    per_policy = len(runs) // max(len(names), 1)
    return [names[i // per_policy] for i in range(len(runs))]


def _by_name(runs: list[R], names: tuple[str, ...]) -> dict[str, list[R]]:
    """The runs of each policy, under the name it was asked by."""
    grouped: dict[str, list[R]] = {}
    for name, run in zip(_labels(runs, names), runs, strict=True):
        grouped.setdefault(name, []).append(run)
    return grouped


def _plot_fleet(runs: list[FleetRun], names: tuple[str, ...], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    by_name = _by_name(runs, names)
    finals = []
    for name, group in by_name.items():
        length = min(len(r.curve) for r in group)
        x = [group[0].curve[i][0] for i in range(length)]
        y = [sum(r.curve[i][1] for r in group) / len(group) for i in range(length)]
        axes.plot(x, y, label=f"{name} ({y[-1]:.2f}%)" if y else name)
        finals.extend(y[-1:])
    axes.plot([0, 100], [0, 100], color="grey", linewidth=0.6, linestyle=":")
    # Where the policies part: from a little below the lowest final allocation.
    low = max(0.0, min(finals, default=0.0) - 10)
    axes.set_xlim(left=low)
    axes.set_ylim(bottom=low)
    axes.set_xlabel("arrived GPU demand, % of GPU capacity")
    axes.set_ylabel("GPU allocated, % of capacity")
    axes.set_title(f"mean over {len(next(iter(by_name.values())))} seed(s)")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


@sim.command("training")
@click.option(
    "--trace",
    "traces",
    required=True,
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Gavel job trace (repeatable).",
)
@click.option(
    "--cluster",
    required=True,
    help="GPUs: TYPE:COUNT[/PER_SERVER],... such as v100:32 or v100:16,p100:16"
    " (4 GPUs per server unless /N).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    default=("fifo", "gandiva"),
    show_default=True,
    help=f"Training policy (repeatable): {TRAINING_POLICIES.known}.",
)
@click.option(
    "--throughputs",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"Gavel's throughput table [default: {THROUGHPUTS_NAME} in the trace's folder or"
    " the one above it].",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    help="Orders the jobs that arrive at the same time.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (trace, policy).")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw GPUs in use over time and the JCT distribution per run into this PNG.",
)
def training(
    traces: tuple[Path, ...],
    cluster: str,
    policies: tuple[str, ...],
    throughputs: Path | None,
    seed: int,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Run training-job TRACEs on a cluster under each policy (discrete-event; every input is
    checked before anything runs)."""
    try:
        for name in policies:
            get_training_policy(name)
        table_path = throughputs or find_throughputs(traces[0])
        table = Throughputs(_read_training(table_path), str(table_path))
        servers = parse_cluster(cluster, table.gpu_types)
        types = sorted({s.gpu_type for s in servers})
        loaded = [
            (path, parse_trace(_read_training(path), str(path), table, types)) for path in traces
        ]
    except (TrainingInputError, UnknownPolicyError) as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    runs = []
    for path, jobs in loaded:
        for name in policies:
            run = simulate_training(
                jobs, servers, table, get_training_policy(name), path.name, seed=seed
            )
            runs.append(run)
            if as_json:
                click.echo(json.dumps(run.summary()))
        if runs and runs[-1].unschedulable:
            click.echo(
                f"note: {path}: {runs[-1].unschedulable} job(s) fit no GPU type of {cluster}"
                " (wider than its GPUs of a type where the table's throughput is above 0);"
                " not run",
                err=True,
            )
    if not as_json:
        _print_training(runs)
    if plot is not None:
        _plot_training(runs, plot)


def _read_training(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise TrainingInputError(f"{path}, line 0: {reason}") from None


def _print_training(runs: list[TrainingRun]) -> None:
    rows = [
        [
            run.trace,
            run.policy,
            str(run.jobs),
            _fmt(run.avg_jct_h),
            _fmt(run.p95_jct_h),
            _fmt(run.avg_first_feedback_h),
            _fmt(run.makespan_h),
            _fmt(run.gpu_util),
            str(run.packings),
            str(run.undone),
            str(run.migrations),
            str(run.resizes),
            str(run.suspensions),
        ]
        for run in runs
    ]
    header = ["TRACE", "POLICY", "JOBS", "AVG JCT h", "P95 JCT h", "1ST FEEDBACK h", "MAKESPAN h"]
    echo_table([*header, "GPU UTIL", "PACKED", "UNDONE", "MIGRATED", "RESIZED", "SUSPENDED"], rows)


def _plot_training(runs: list[TrainingRun], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (used, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    traces = {run.trace for run in runs}
    for run in runs:
        label = run.policy if len(traces) == 1 else f"{run.trace} {run.policy}"
        if run.in_use:
            hours, gpus = zip(*run.in_use, strict=True)
            used.step(hours, gpus, where="post", label=label, linewidth=0.8)
        jct = sorted(run.jct_h)
        if jct:
            share = [(i + 1) / len(jct) for i in range(len(jct))]
            cdf.step(jct, share, where="post", label=f"{label} (mean {run.avg_jct_h:g} h)")
    used.set_xlabel("hours since the first arrival")
    used.set_ylabel("GPUs in use")
    cdf.set_xscale("log")
    cdf.set_xlabel("job completion time, h")
    cdf.set_ylabel("share of jobs")
    for axes in (used, cdf):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


def _print_replays(runs: list[ReplayRun], names: tuple[str, ...]) -> None:
    rows = []
    for name, run in zip(_labels(runs, names), runs, strict=True):
        rows.append(
            [
                name,
                str(run.seed),
                f"{run.alloc_pct_mean:.2f}",
                f"{run.alloc_pct_peak:.2f}",
                f"{run.queued_pods}",
                f"{run.delay_mean_s:g}",
                f"{run.delay_p99_s:g}",
                f"{run.delay_max_s:g}",
                str(run.failed_pods),
                f"{run.wall_s:.2f}",
            ]
        )
    header = ["POLICY", "SEED", "ALLOC% MEAN", "ALLOC% PEAK", "QUEUED", "DELAY MEAN s"]
    header += ["DELAY P99 s", "DELAY MAX s", "FAILED", "WALL s"]
    echo_table(header, rows)


def _plot_replays(runs: list[ReplayRun], names: tuple[str, ...], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    by_name = _by_name(runs, names)
    span = max((r.curve[-1][0] - r.curve[0][0] for r in runs if r.curve), default=0.0)
    unit, seconds = next(
        (u, s) for u, s in (("days", 86400), ("hours", 3600), ("s", 1)) if span >= 2 * s or s == 1
    )
    for name, group in by_name.items():
        x = [t / seconds for t, _ in group[0].curve]
        y = [sum(r.curve[i][1] for r in group) / len(group) for i in range(len(x))]
        mean = sum(r.alloc_pct_mean for r in group) / len(group)
        axes.plot(x, y, label=f"{name} (mean {mean:.2f}%)")
    axes.set_xlabel(f"time, {unit} (creation times divided by --compress)")
    axes.set_ylabel("GPU allocated, % of capacity")
    axes.set_title(f"replay, mean over {len(next(iter(by_name.values())))} seed(s)")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)
