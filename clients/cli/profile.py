"""`gpuloom profile sweep`: measure a function's throughput over an (SM percent, time quota)
grid through a dispatcher, recording each point with the profiler (FaST-Profiler)."""

from __future__ import annotations

import click

from gpuloom.clients.shim_path import default_shim_path
from gpuloom.clients.sweep import DEFAULT_QUOTAS, DEFAULT_SM, Sweep, SweepError
from gpuloom.domain.errors import DomainError


def _numbers(kind: type, text: str, option: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            f"a comma-separated list of numbers, got {text!r}", param_hint=option
        ) from None


@click.group()
def profile() -> None:
    """Measure jobs and functions (throughput sweeps)."""


@profile.command("sweep", context_settings={"ignore_unknown_options": True})
@click.option("--function", "function", required=True, help="Function (profile key) to measure.")
@click.option(
    "--sm",
    "sm_text",
    default=",".join(map(str, DEFAULT_SM)),
    show_default=True,
    help="SM percents, comma-separated (1..100).",
)
@click.option(
    "--quotas",
    "quota_text",
    default=",".join(f"{q:g}" for q in DEFAULT_QUOTAS),
    show_default=True,
    help="Time quotas in percent of the window, comma-separated.",
)
@click.option("--dispatcher", default="localhost:50060", show_default=True)
@click.option("--profiler", default="localhost:50053", show_default=True)
@click.option("--profile-store", default="localhost:50052", show_default=True)
@click.option(
    "--shim",
    "shim_path",
    type=click.Path(dir_okay=False),
    help="Launch shim to preload (default: GPULOOM_SHIM_PATH, else the checkout's "
    "shim/build/libgpuloom.so if built).",
)
@click.option("--no-shim", is_flag=True, help="Do not preload the shim.")
@click.option("--memory-gib", type=click.FloatRange(min=0.001), default=4.0, show_default=True)
@click.option(
    "--point-timeout",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds one grid point may run.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def sweep(
    function: str,
    sm_text: str,
    quota_text: str,
    dispatcher: str,
    profiler: str,
    profile_store: str,
    shim_path: str | None,
    no_shim: bool,
    memory_gib: float,
    point_timeout: float,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND (a load generator printing JSON lines with requests_per_s, p50_latency_ms,
    p99_latency_ms) once per grid point, under that SM share and time quota, and store each
    point. Points already stored are skipped: rerun to resume. Example:

        gpuloom profile sweep --function resnet50 -- python loadgen.py --model resnet50
    """
    sm_percents = _numbers(int, sm_text, "--sm")
    quotas = _numbers(float, quota_text, "--quotas")
    if no_shim:
        shim_path = None
    elif shim_path is None:
        shim_path = default_shim_path()
    runner = Sweep(
        function=function,
        command=command,
        dispatcher=dispatcher,
        profiler=profiler,
        profile_store=profile_store,
        shim_path=shim_path,
        memory_bytes=int(memory_gib * (1 << 30)),
        point_timeout_s=point_timeout,
        progress=lambda line: click.echo(line, err=True),
    )
    try:
        measured = runner.run(sm_percents, quotas)
    except (SweepError, DomainError) as error:
        raise click.ClickException(
            f"{error} (points measured so far are stored; rerun to resume)"
        ) from None
    click.echo(f"sweep of {function!r} complete: {measured} points measured", err=True)
