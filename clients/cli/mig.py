"""`gpuloom mig`: plan MIG partitions and task placement offline (FAR and its baselines),
generate synthetic task files (FAR paper, Section 6.3), and run a batch on a MIG GPU as its
runner (`mig run`: the dispatcher reconfigures the GPU on the plan's schedule, this process starts
each task in the instance it is handed)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import click
import numpy as np

from gpuloom.clients.cli.addresses import placement_option
from gpuloom.clients.cli.dispatcher import find_dispatcher
from gpuloom.clients.mig_run import MigBatchRunner, MigPlanned, Update, log_name, parse_batch
from gpuloom.domain.errors import DomainError
from gpuloom.domain.mig_geometry import MigGeometry, get_geometry
from gpuloom.domain.mig_runs import MigRunReport, TaskRun, TaskStart
from gpuloom.policies.mig import (
    InvalidTaskError,
    Plan,
    PlanningError,
    UnknownPolicyError,
    area_lower_bound,
    get_planner,
    verify_plan,
)
from gpuloom.policies.mig import synth as synthetic
from gpuloom.policies.mig.taskfile import TaskFileError, format_tasks, parse_tasks

GPUS = ("A30", "A100", "H100")


gpu_option = click.option(
    "--gpu",
    "gpu_name",
    required=True,
    type=click.Choice(GPUS, case_sensitive=False),
    metavar="[" + "|".join(GPUS) + "]",
)


@click.group()
def mig() -> None:
    """Plan MIG partitions and task placement (FAR and baselines)."""


@mig.command("plan")
@gpu_option
@click.option(
    "--policy",
    default="far",
    show_default=True,
    help="far, far-paper (FAR exactly as published), fixpart-best, fixpart:SIZES "
    "(e.g. fixpart:4,2,1) or miso.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per FILE, one per line.")
@click.option(
    "--gantt",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the instance timeline to this PNG. With several FILEs, one PNG each: "
    "OUT-<n>-<file stem>.png, n counting FILEs from 1.",
)
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def plan_command(
    gpu_name: str, policy: str, as_json: bool, gantt: Path | None, files: tuple[Path, ...]
) -> None:
    """Plan each FILE of tasks on one MIG-capable GPU.

    A FILE has one task per line: `name t1 t2 t3 t4 t7` on A100/H100, `name t1 t2 t4` on
    A30, the seconds the task takes on an instance of that many slices (`inf`: cannot run
    there); `#` starts a comment. A FILE that cannot be read or planned gets an error on
    stderr and no plan; the other FILEs are still planned, and the exit code is 2.
    """
    gpu = get_geometry(gpu_name)
    try:
        planner = get_planner(policy)
    except UnknownPolicyError as error:
        raise click.BadParameter(str(error), param_hint="--policy") from None

    failed = False
    for number, path in enumerate(files, start=1):
        try:
            tasks = parse_tasks(path.read_text(encoding="utf-8"), gpu)
            started = time.perf_counter()
            plan = planner.plan(tasks, gpu)
            plan_ms = (time.perf_counter() - started) * 1000
        except TaskFileError as error:
            where = f"{path}:{error.line}" if error.line else str(path)
            click.echo(f"error: {where}: {error.message}", err=True)
            failed = True
            continue
        except (OSError, UnicodeDecodeError) as error:
            click.echo(f"error: {path}: cannot read: {_reason(error)}", err=True)
            failed = True
            continue
        except (InvalidTaskError, PlanningError) as error:
            click.echo(f"error: {path}: {error}", err=True)
            failed = True
            continue
        # A plan that breaks a MIG rule is a bug in a policy: fail loudly rather than print it.
        verify_plan(plan, tasks, gpu)
        lower_bound = area_lower_bound(tasks, gpu)
        if as_json:
            click.echo(json.dumps(_as_json(path, plan, lower_bound, plan_ms)))
        else:
            click.echo(_as_text(path, gpu, plan, lower_bound, plan_ms))
        if gantt is not None:
            out = gantt if len(files) == 1 else _numbered(gantt, number, path)
            draw_gantt(plan, gpu, f"{path.name}: {plan.policy} on {gpu.name}", out)
    if failed:
        raise SystemExit(2)


@mig.command("synth")
@gpu_option
@click.option(
    "--workload",
    type=click.Choice(synthetic.WORKLOADS),
    default="mixed",
    show_default=True,
    help="poor: tasks scale well to the two smallest sizes; good: to the two largest; "
    "mixed: evenly to every size.",
)
@click.option(
    "--times",
    "time_range",
    type=click.Choice(tuple(synthetic.TIME_RANGES)),
    default="wide",
    show_default=True,
    help="Range of a task's time on one slice: wide 1-100 s, narrow 90-100 s.",
)
@click.option("--tasks", "count", type=click.IntRange(min=1), default=15, show_default=True)
@click.option(
    "--memory-bound",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Share of the well-scaling tasks that start memory-bound (super-linear).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write here instead of stdout.",
)
def synth_command(
    gpu_name: str,
    workload: str,
    time_range: str,
    count: int,
    memory_bound: float,
    seed: int,
    output: Path | None,
) -> None:
    """Write a synthetic batch of tasks in the `mig plan` file format."""
    gpu = get_geometry(gpu_name)
    spec = synthetic.workload(gpu, workload, time_range, memory_bound_share=memory_bound)
    tasks = synthetic.generate(count, gpu, spec, np.random.default_rng(seed))
    header = (
        f"gpuloom mig synth --gpu {gpu.name} --workload {workload} --times {time_range} "
        f"--tasks {count} --memory-bound {memory_bound:g} --seed {seed}"
    )
    text = format_tasks(tasks, gpu, header)
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)


@mig.command("run")
@click.option(
    "--dispatcher", "dispatcher_address", metavar="HOST:PORT", help="The GPU's dispatcher."
)
@click.option(
    "--gpu", "gpu_uuid", metavar="UUID", help="The GPU (its dispatcher is asked of placement)."
)
@placement_option
@click.option(
    "--logs",
    "log_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("mig-logs"),
    show_default=True,
    help="Directory for each task's output (TASK.log).",
)
@click.option("--json", "as_json", is_flag=True, help="Each update as a JSON line.")
@click.argument("batch_file", type=click.Path(dir_okay=False, path_type=Path))
def run_command(
    dispatcher_address: str | None,
    gpu_uuid: str | None,
    address: str,
    log_dir: Path,
    as_json: bool,
    batch_file: Path,
) -> None:
    """Run the batch in BATCH_FILE on a MIG GPU, as its runner.

    The GPU's dispatcher plans the batch (FAR unless it names a policy) and creates and
    destroys the instances on the plan's schedule; this command starts each task's command, as
    you and with your environment, with CUDA_VISIBLE_DEVICES set to the instance it is handed,
    and reports its end. BATCH_FILE is RunMigBatch's request in JSON with each task's argv
    (docs/mig.md). Exits 0 when every task exited 0, 1 otherwise.
    """
    if (gpu_uuid is None) == (dispatcher_address is None):
        raise click.UsageError("give either --gpu UUID or --dispatcher HOST:PORT")
    try:
        batch = parse_batch(batch_file.read_text(encoding="utf-8"), str(batch_file))
    except (OSError, UnicodeDecodeError) as error:
        raise click.UsageError(f"{batch_file}: cannot read: {_reason(error)}") from None
    except DomainError as error:
        raise click.UsageError(error.message) from None
    where = dispatcher_address or find_dispatcher(str(gpu_uuid), address)
    show = _show_json if as_json else _show_text
    runner = MigBatchRunner(where, log_dir, on_update=show)
    try:
        report = runner.run(batch)
    except DomainError as error:
        raise click.ClickException(f"dispatcher {where}: {error}") from None
    failed = [t.task for t in report.tasks if t.exit_code != 0]
    if failed or len(report.tasks) != len(batch.tasks):
        raise SystemExit(1)


def _show_json(update: Update) -> None:
    kind = {
        MigPlanned: "planned",
        TaskStart: "task_started",
        TaskRun: "task_ended",
        MigRunReport: "report",
    }[type(update)]
    click.echo(json.dumps({kind: dataclasses.asdict(update)}))


def _show_text(update: Update) -> None:
    if isinstance(update, MigPlanned):
        click.echo(
            f"planned with {update.policy}: {update.tasks} tasks, makespan "
            f"{update.planned_makespan_s:.2f} s"
        )
    elif isinstance(update, TaskStart):
        click.echo(
            f"{update.task}: started on {update.instance_uuid} ({update.size} slices at slice "
            f"{update.first_slice}) at {update.start_s:.2f} s, planned "
            f"{update.planned_start_s:.2f}-{update.planned_end_s:.2f} s; output "
            f"{log_name(update.task)}"
        )
    elif isinstance(update, TaskRun):
        click.echo(f"{update.task}: exit code {update.exit_code} at {update.end_s:.2f} s")
    else:
        creates = sum(r.action == "create" for r in update.reconfigurations)
        click.echo(
            f"done: {len(update.tasks)} tasks, makespan {update.makespan_s:.2f} s (planned "
            f"{update.planned_makespan_s:.2f} s), {len(update.reconfigurations)} "
            f"reconfigurations ({creates} creations)"
        )


def _reason(error: OSError | UnicodeDecodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return "not a UTF-8 text file"
    return error.strerror or str(error)


def _numbered(out: Path, number: int, source: Path) -> Path:
    return out.with_name(f"{out.stem}-{number}-{source.stem}{out.suffix or '.png'}")


def _as_json(path: Path, plan: Plan, lower_bound: float, plan_ms: float) -> dict[str, object]:
    return {
        "file": str(path),
        "gpu": plan.gpu,
        "policy": plan.policy,
        "tasks": len(plan.assignments),
        "makespan_s": plan.makespan_s,
        "lower_bound_s": lower_bound,
        "ratio": plan.makespan_s / lower_bound,
        "plan_ms": plan_ms,
        "initial_instances": [
            {"size": p.size, "first_slice": p.first_slice} for p in plan.initial_instances
        ],
        "assignments": [
            {
                "task": a.task,
                "index": a.task_index,
                "size": a.size,
                "first_slice": a.first_slice,
                "start_s": a.start_s,
                "end_s": a.end_s,
            }
            for a in plan.assignments
        ],
        "reconfigurations": [
            {
                "action": r.action,
                "size": r.size,
                "first_slice": r.first_slice,
                "start_s": r.start_s,
                "end_s": r.end_s,
            }
            for r in plan.reconfigurations
        ],
    }


def _as_text(path: Path, gpu: MigGeometry, plan: Plan, lower_bound: float, plan_ms: float) -> str:
    lines = [
        f"{path}: {len(plan.assignments)} tasks, policy {plan.policy} on {gpu.name}",
        f"  makespan {plan.makespan_s:.3f} s, lower bound {lower_bound:.3f} s "
        f"(ratio {plan.makespan_s / lower_bound:.3f}), planned in {plan_ms:.1f} ms",
    ]
    if plan.initial_instances:
        fixed = ", ".join(_instance(p.size, p.first_slice) for p in plan.initial_instances)
        lines.append(f"  instances set up before the start: {fixed}")
    lines.append("")
    lines += _table(
        ("task", "instance", "start_s", "end_s"),
        [
            (a.task, _instance(a.size, a.first_slice), f"{a.start_s:.3f}", f"{a.end_s:.3f}")
            for a in plan.assignments
        ],
    )
    if plan.reconfigurations:
        lines.append("")
        lines += _table(
            ("reconfiguration", "instance", "start_s", "end_s"),
            [
                (r.action, _instance(r.size, r.first_slice), f"{r.start_s:.3f}", f"{r.end_s:.3f}")
                for r in plan.reconfigurations
            ],
        )
    return "\n".join(lines) + "\n"


def _instance(size: int, first_slice: int) -> str:
    return f"{size}g@{first_slice}"


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Two text columns left-aligned, the rest (numbers) right-aligned."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: tuple[str, ...]) -> str:
        return "  " + "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        )

    return [line(headers), line(tuple("-" * w for w in widths)), *map(line, rows)]


def draw_gantt(plan: Plan, gpu: MigGeometry, title: str, out: Path) -> None:
    """Slices down, time across: tasks as bars over their instance's slices, creations
    (cyan) and destructions (red) as shaded periods."""
    # Imported here: matplotlib takes long to load and only --gantt needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 1.2 + 0.55 * gpu.slice_count))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for r in plan.reconfigurations:
        placement = gpu.placement(r.size, r.first_slice)
        axes.broken_barh(
            [(r.start_s, r.end_s - r.start_s)],
            (placement.first_slice, placement.span),
            facecolors="tab:cyan" if r.action == "create" else "tab:red",
            alpha=0.6,
        )
    colours = [f"C{i}" for i in range(10)]
    for a in plan.assignments:
        axes.broken_barh(
            [(a.start_s, a.end_s - a.start_s)],
            (a.first_slice + 0.08, a.size - 0.16),
            facecolors=colours[a.task_index % len(colours)],
            edgecolors="black",
            linewidth=0.5,
        )
        axes.text(
            (a.start_s + a.end_s) / 2,
            a.first_slice + a.size / 2,
            a.task,
            ha="center",
            va="center",
            fontsize=7,
            clip_on=True,
        )
    axes.set_ylim(gpu.slice_count, 0)
    axes.set_yticks([s + 0.5 for s in range(gpu.slice_count)])
    axes.set_yticklabels([f"S{s}" for s in range(gpu.slice_count)])
    axes.set_xlim(0, max(plan.makespan_s, 1e-9) * 1.01)
    axes.set_xlabel("time (s)")
    axes.set_title(f"{title}: makespan {plan.makespan_s:.3f} s")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
