"""`gpuloom profile`: the profile store's profiles (`list|show|put|delete`, in profiles.py),
kernel measurement sessions (`open|sessions|session|cancel`) and throughput sweeps (`sweep`: a
function's throughput over an (SM percent, time quota) grid through a dispatcher, recording each
point with the profiler, FaST-Profiler)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import click

from gpuloom.clients import profile_store as store_client
from gpuloom.clients import profiler as profiler_client
from gpuloom.clients.cli.addresses import (
    PROFILER_ENV,
    STORE_ENV,
    address_option,
    calling,
    profiler_option,
)
from gpuloom.clients.cli.profiles import delete_profile, list_profiles, put_profile, show_profile
from gpuloom.clients.cli.table import echo_table
from gpuloom.clients.profiler import ProfilerClient
from gpuloom.clients.shim_path import default_shim_path
from gpuloom.clients.sweep import DEFAULT_QUOTAS, DEFAULT_SM, Sweep, SweepError
from gpuloom.clients.times import duration, rfc3339
from gpuloom.convert.profiler import session_json
from gpuloom.domain.errors import DomainError
from gpuloom.domain.profiler import SessionState, SessionView


def _numbers(kind: type, text: str, option: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            f"a comma-separated list of numbers, got {text!r}", param_hint=option
        ) from None


@click.group()
def profile() -> None:
    """Profiles: those in the profile store (list, show, put, delete), kernel measurement
    sessions (open, sessions, session, cancel) and throughput sweeps (sweep)."""


_STORE_COMMANDS = (list_profiles, show_profile, put_profile, delete_profile)
for _command in _STORE_COMMANDS:
    profile.add_command(_command)

# `gpuloom profiles list|show|put|delete`: the old name of the store's commands, kept working
# (hidden from --help; click prints a deprecation warning to stderr).
profiles_alias = click.Group(
    "profiles",
    commands={c.name: c for c in _STORE_COMMANDS if c.name},
    help="Deprecated: use `gpuloom profile`.",
    hidden=True,
    deprecated=True,
)


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
@address_option(
    "profiler", "Profiler", PROFILER_ENV, profiler_client.DEFAULT_ADDRESS, dest="profiler"
)
@address_option(
    "profile-store", "Profile store", STORE_ENV, store_client.DEFAULT_ADDRESS, "store",
    dest="profile_store",
)  # fmt: skip
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


# ---- measurement sessions (kernel profiles, FIKIT) ----

json_option = click.option("--json", "as_json", is_flag=True, help="Print the Session as JSON.")


@profile.command("open")
@click.argument("task_key")
@click.argument("gpu_model")
@click.option(
    "--runs",
    type=click.IntRange(10, 1000),
    help="Runs to measure (T; default: the profiler's, 20).",
)
@profiler_option
@json_option
def open_session(
    task_key: str, gpu_model: str, runs: int | None, address: str, as_json: bool
) -> None:
    """Open a measurement session: the next runs of TASK_KEY on GPU_MODEL's dispatchers are
    measured, and after the last one its kernel profile goes into the profile store."""
    with _profiler(address) as client:
        session = client.open(task_key, gpu_model, runs or 0)
    _show(session, as_json)


@profile.command("sessions")
@click.option("--state", type=click.Choice([s.value for s in SessionState]))
@click.option("--task-key", default="", help="Only this task key.")
@click.option("--gpu-model", default="", help="Only this GPU model.")
@profiler_option
@click.option("--json", "as_json", is_flag=True, help="One Session as JSON per line.")
def list_sessions(
    state: str | None, task_key: str, gpu_model: str, address: str, as_json: bool
) -> None:
    """List measurement sessions: id, task, GPU model, state, runs received of T, records,
    when opened, how long it took."""
    with _profiler(address) as client:
        found = client.list(SessionState(state) if state else None, task_key, gpu_model)
    if as_json:
        for session in found:
            click.echo(json.dumps(session_json(session)))
        return
    if not found:
        click.echo("no sessions match")
        return
    now = time.time()
    rows = [
        (
            s.session_id,
            s.task_key,
            s.gpu_model,
            s.state.value,
            f"{s.runs_received}/{s.runs}",
            s.records,
            rfc3339(s.opened_at),
            duration((s.closed_at or now) - s.opened_at),
            s.error or s.predictor or "-",
        )
        for s in found
    ]
    headers = ["ID", "TASK KEY", "GPU MODEL", "STATE", "RUNS", "RECORDS", "OPENED", "FOR"]
    echo_table([*headers, "PREDICTOR / ERROR"], rows)


@profile.command("session")
@click.argument("session_id", metavar="SESSION")
@profiler_option
@json_option
def show_session(session_id: str, address: str, as_json: bool) -> None:
    """One measurement session."""
    with _profiler(address) as client:
        session = client.get(session_id)
    _show(session, as_json)


@profile.command("cancel")
@click.argument("session_id", metavar="SESSION")
@profiler_option
@json_option
def cancel_session(session_id: str, address: str, as_json: bool) -> None:
    """Cancel an open measurement session (its records are dropped)."""
    with _profiler(address) as client:
        session = client.cancel(session_id)
    _show(session, as_json)


@contextlib.contextmanager
def _profiler(address: str) -> Iterator[ProfilerClient]:
    with calling("profiler", address), ProfilerClient(address) as client:
        yield client


def _show(session: SessionView, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(session_json(session), indent=2))
        return
    line = (
        f"session {session.session_id} {session.state.value}: task {session.task_key!r} on "
        f"{session.gpu_model!r}, {session.runs_received} of {session.runs} runs, "
        f"{session.records} records, opened {rfc3339(session.opened_at)}"
    )
    if session.kernels:
        line += f"; {session.kernels} kernels, gap predictor {session.predictor!r}"
    if session.error:
        line += f"; {session.error}"
    click.echo(line)
