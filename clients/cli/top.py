"""`gpuloom top`: the fleet at a glance, like nvidia-smi but for shares. One table of GPUs (what
placement reserved, what each dispatcher hands out and charges), one of the processes holding
reservations; refreshed in place on a terminal."""

from __future__ import annotations

import json
import os
import time

import click
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpuloom.clients.cli.addresses import placement_option, service_error
from gpuloom.clients.placement import GIB, PlacementClient
from gpuloom.clients.times import rfc3339
from gpuloom.clients.top import (
    LIVE_STATES,
    FleetSnapshot,
    FleetView,
    GpuTop,
    mig_layout,
    one_line,
)
from gpuloom.domain.dispatcher import DispatcherStatus, LeaseState, ProcessStatus
from gpuloom.domain.errors import DomainError

# Width of a frame printed to a pipe or file (a terminal's own width is used otherwise).
PIPE_WIDTH = 200
STATE_STYLES = {
    LeaseState.HOLDING: "green",
    LeaseState.WAITING: "yellow",
    LeaseState.BLOCKED: "red",
    LeaseState.IDLE: "",
}


@click.command("top")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object and exit (implies --once)."
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@placement_option
def top(once: bool, as_json: bool, interval: float, address: str) -> None:
    """The fleet at a glance: per GPU its model, MIG layout, reserved area and time quota, and
    each process holding a share there (pid, job, priority, memory cap and use, share, GPU
    time used in the current window, how long it has waited for its lease).

    On a terminal the view refreshes in place until Ctrl-C; with --once, or when stdout is not
    a terminal, it prints one frame. Placement must be reachable (exit 1 otherwise); the GPU
    of a dispatcher that does not answer says "no status", and why is printed below.
    """
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    with PlacementClient(address, timeout_s=10.0) as placement, FleetView(placement) as view:
        try:
            snapshot = view.snapshot()
        except DomainError as error:
            raise service_error(error, "placement", address) from None
        if as_json:
            click.echo(json.dumps(snapshot.to_json(), indent=2))
            return
        if once or not console.is_terminal:
            console.print(render(snapshot))
            return
        try:
            with Live(render(snapshot), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    try:
                        frame = render(view.snapshot())
                    except DomainError as error:
                        frame = Text(
                            f"{rfc3339(time.time(), millis=True)}  placement at {address}: "
                            f"{one_line(error.message)} (retrying)",
                            style="red",
                        )
                    live.update(frame, refresh=True)
        except KeyboardInterrupt:
            return


# ---- rendering ----


def render(snapshot: FleetSnapshot) -> RenderableType:
    parts: list[RenderableType] = [_header(snapshot), _gpu_table(snapshot)]
    processes = [
        (_gpu_label(gpu), p) for gpu in snapshot.gpus if gpu.status for p in by_priority(gpu.status)
    ]
    if processes:
        parts.append(process_table(processes))
    else:
        parts.append(Text("no processes hold a share"))
    for gpu in snapshot.gpus:
        if gpu.error:
            parts.append(Text(f"{_gpu_label(gpu)}: {gpu.error}", style="red"))
    return Group(*parts)


def _header(snapshot: FleetSnapshot) -> Text:
    jobs = ", ".join(f"{snapshot.jobs[state]} {state.value}" for state in LIVE_STATES)
    return Text.assemble(
        ("gpuloom top", "bold"),
        f"  {rfc3339(snapshot.taken_at, millis=True)}  placement {snapshot.placement}  "
        f"{len(snapshot.gpus)} GPUs  jobs: {jobs}",
    )


def _gpu_label(gpu: GpuTop) -> str:
    index = "?" if gpu.status is None else str(gpu.status.gpu.index)
    return f"{gpu.entry.gpu.node}/{index}"


def _gpu_table(snapshot: FleetSnapshot) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, right in (
        ("GPU", False),
        ("UUID", False),
        ("MODEL", False),
        ("STATE", False),
        ("MIG", False),
        ("POLICY", False),
        ("JOBS", True),
        ("DIRECT", True),
        ("AREA %", True),
        ("QUOTA %", True),
        ("USED %", True),
        ("MEM RESERVED", True),
        ("MEM USED", True),
        ("UTIL %", True),
    ):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for gpu in snapshot.gpus:
        entry, status = gpu.entry, gpu.status
        state, style = _gpu_state(gpu)
        _add_row(
            table,
            _gpu_label(gpu),
            entry.gpu.gpu_uuid,
            entry.gpu.model,
            Text(state, style=style),
            mig_layout(entry),
            "-" if status is None else status.policy,
            str(entry.jobs),
            str(entry.direct_reservations),
            f"{entry.area_reserved_percent:.1f}",
            "-" if status is None else f"{status.quota_reserved_percent:.1f}",
            "-" if status is None else f"{status.quota_used_percent:.1f}",
            f"{gib(entry.memory_reserved_bytes)}/{gib(entry.gpu.memory_bytes)} GiB",
            gib_or_dash(entry.memory_used_bytes if status is None else status.memory_used_bytes),
            f"{entry.utilization_percent if status is None else status.utilization_percent:.0f}",
        )
    return table


def _gpu_state(gpu: GpuTop) -> tuple[str, str]:
    if gpu.entry.lost:
        return "lost", "red"
    if gpu.status is None:
        return "no status", "red"
    if gpu.entry.gpu.mig_enabled:
        return "MIG", "cyan"
    return ("schedulable", "green") if gpu.entry.schedulable else ("unschedulable", "yellow")


def by_priority(status: DispatcherStatus) -> list[ProcessStatus]:
    """The GPU's processes by priority (0 first), then age of the reservation."""
    return sorted(status.processes, key=lambda p: (p.share.priority, p.reserved_at))


def process_table(processes: list[tuple[str, ProcessStatus]]) -> Table:
    """One line per (GPU label, process)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, right in (
        ("GPU", False),
        ("PID", True),
        ("JOB", False),
        ("NAME", False),
        ("PRIO", True),
        ("MODE", False),
        ("STATE", False),
        ("SM %", True),
        ("QUOTA %", True),
        ("USED %", True),
        ("MEM CAP", True),
        ("MEM USE", True),
        ("WAITING", True),
    ):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for label, p in processes:
        state = Text(p.state.value, style=STATE_STYLES[p.state]) if p.connected else "-"
        if p.suspension is not None:  # SuspendClient: its kernels are held
            state = Text("suspended", style="magenta")
        quota = p.share.quota
        _add_row(
            table,
            label,
            str(p.pid) if p.pid else "-",
            p.assignment_id,
            p.client_name or "-",
            str(p.share.priority),
            p.mode,
            state,
            str(p.share.sm_percent),
            f"{quota.request_percent:g}"
            + (f"-{quota.limit_percent:g}" if quota.limit_percent > quota.request_percent else ""),
            f"{p.used_percent:.1f}",
            gib_or_dash(p.share.memory_bytes),
            gib_or_dash(p.memory_allocated_bytes),
            _duration(p.waiting_s) if p.state.asking and p.connected else "-",
        )
    return table


def _add_row(table: Table, *cells: str | Text) -> None:
    """Cells as plain text: names come from users, and must not be read as rich markup."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def gib(size: int) -> str:
    return f"{size / GIB:.1f}"


def gib_or_dash(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size else "-"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
