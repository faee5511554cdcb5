"""`gpuloom dispatcher status|release|evict|suspend|resume|mig`: one GPU's dispatcher, found
through placement by the GPU's UUID (`--gpu`) or reached directly (`--dispatcher HOST:PORT`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click
from rich.console import Console

from gpuloom.clients.cli.addresses import calling, placement_option
from gpuloom.clients.cli.top import PIPE_WIDTH, by_priority, gib_or_dash, process_table
from gpuloom.clients.dispatcher import DispatcherClient
from gpuloom.clients.placement import PlacementClient
from gpuloom.convert.dispatcher import status_json
from gpuloom.domain.dispatcher import DispatcherStatus

F = TypeVar("F", bound=Callable[..., Any])


def _target_options(command: F) -> F:
    command = click.option(
        "--dispatcher",
        "dispatcher_address",
        metavar="HOST:PORT",
        help="The dispatcher's address (instead of --gpu).",
    )(command)
    command = click.option(
        "--gpu",
        "gpu_uuid",
        metavar="UUID",
        help="The GPU (as `gpuloom gpus` lists it); its dispatcher is asked of placement.",
    )(command)
    return placement_option(command)


@click.group("dispatcher")
def dispatcher() -> None:
    """One GPU's dispatcher: its status, releasing, evicting, suspending or resuming a
    reservation there, its MIG mode."""


@dispatcher.command("status")
@_target_options
@click.option("--json", "as_json", is_flag=True, help="Print the GpuStatus message as JSON.")
def status(
    gpu_uuid: str | None, dispatcher_address: str | None, address: str, as_json: bool
) -> None:
    """The GPU as its dispatcher sees it: policy, window, what it handed out and charged, and
    every reservation with its process (as in `gpuloom top`)."""
    with _dispatcher(gpu_uuid, dispatcher_address, address) as (client, where):
        found = _call(client.status, where)
    if as_json:
        click.echo(json.dumps(status_json(found), indent=2))
        return
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    for line in _summary(found):
        console.print(line, highlight=False, markup=False)
    processes = [(f"{found.gpu.node}/{found.gpu.index}", p) for p in by_priority(found)]
    if processes:
        console.print(process_table(processes))
    else:
        console.print("no reservations", highlight=False)


@dispatcher.command("release")
@click.argument("assignment_id", metavar="ASSIGNMENT")
@_target_options
def release(
    assignment_id: str, gpu_uuid: str | None, dispatcher_address: str | None, address: str
) -> None:
    """Release a reservation (idempotent): its process, if connected, is told and disconnected.
    A placement job's reservation is its job id; cancel the job instead (`gpuloom cancel`)."""
    with _dispatcher(gpu_uuid, dispatcher_address, address) as (client, where):
        released = _call(lambda: client.release(assignment_id), where)
    click.echo(
        f"released {assignment_id}"
        if released
        else f"{assignment_id} was not reserved there (already released)"
    )


@dispatcher.command("evict")
@click.argument("assignment_id", metavar="ASSIGNMENT")
@click.option("--reason", default="", help="Told to the process, and logged.")
@_target_options
def evict(
    assignment_id: str,
    reason: str,
    gpu_uuid: str | None,
    dispatcher_address: str | None,
    address: str,
) -> None:
    """Disconnect the process holding a reservation and release the reservation (exit 1 if
    there is no such reservation)."""
    with _dispatcher(gpu_uuid, dispatcher_address, address) as (client, where):
        _call(lambda: client.evict(assignment_id, reason), where)
    click.echo(f"evicted {assignment_id}")


@dispatcher.command("suspend")
@click.argument("assignment_id", metavar="ASSIGNMENT")
@click.option(
    "--max-wait-ms",
    type=click.FloatRange(0, 600_000),
    default=0.0,
    help="How long to wait for the process's next low-memory point (0: the dispatcher's "
    "GPULOOM_DISPATCHER_SUSPEND_MAX_WAIT_MS).",
)
@click.option("--reason", default="", help="Logged, and shown while suspended.")
@_target_options
def suspend(
    assignment_id: str,
    max_wait_ms: float,
    reason: str,
    gpu_uuid: str | None,
    dispatcher_address: str | None,
    address: str,
) -> None:
    """Stop admitting a reservation's kernels at its process's next low-memory point (a
    training job's mini-batch boundary; at once when none is known); its GPU memory goes to
    host memory where the driver has the checkpoint API (else it stays resident: the line
    says which). Idempotent; exit 1 if there is no such reservation."""
    with _dispatcher(gpu_uuid, dispatcher_address, address) as (client, where):
        state = _call(lambda: client.suspend(assignment_id, max_wait_ms, reason), where)
    if not state.suspended:  # resumed or released while it waited for its low point
        click.echo(f"{assignment_id} was resumed before it reached its suspension point")
        return
    memory = "memory released to host memory" if state.memory_released else state.memory_note
    click.echo(
        f"suspended {assignment_id} ({state.outcome.replace('_', ' ')}, after "
        f"{state.wait_ms:.0f} ms, holding {gib_or_dash(state.memory_bytes)})"
        + (f"; {memory}" if memory else "")
    )


@dispatcher.command("resume")
@click.argument("assignment_id", metavar="ASSIGNMENT")
@_target_options
def resume(
    assignment_id: str, gpu_uuid: str | None, dispatcher_address: str | None, address: str
) -> None:
    """Admit a suspended reservation's kernels again (its memory restored first, if it was
    released). Idempotent; exit 1 if there is no such reservation, or if its memory could not
    be restored (it stays suspended; the reason is printed)."""
    with _dispatcher(gpu_uuid, dispatcher_address, address) as (client, where):
        state = _call(lambda: client.resume(assignment_id), where)
    if state.suspended:
        click.echo(f"{assignment_id} stays suspended: {state.memory_note}", err=True)
        raise SystemExit(1)
    click.echo(f"resumed {assignment_id}")


@dispatcher.command("mig")
@click.argument("mode", type=click.Choice(["on", "off"]))
@_target_options
def mig(mode: str, gpu_uuid: str | None, dispatcher_address: str | None, address: str) -> None:
    """Turn the GPU's MIG mode on or off (for MIG batches, docs/mig.md). The dispatcher tells
    placement, which then gives the GPU MIG batch tasks and no shares (or shares again). Refused
    (exit 1) on a GPU that is not MIG-capable, when turning MIG on while reservations are held
    there, and when turning it off while MIG instances exist or a batch runs."""
    with _dispatcher(gpu_uuid, dispatcher_address, address) as (client, where):
        enabled = _call(lambda: client.set_mig_mode(mode == "on"), where)
    click.echo(f"MIG {'on' if enabled else 'off'} (dispatcher at {where})")


@contextlib.contextmanager
def _dispatcher(
    gpu_uuid: str | None, dispatcher_address: str | None, placement_address: str
) -> Iterator[tuple[DispatcherClient, str]]:
    if (gpu_uuid is None) == (dispatcher_address is None):
        raise click.UsageError("give either --gpu UUID or --dispatcher HOST:PORT")
    if dispatcher_address is None:
        assert gpu_uuid is not None
        dispatcher_address = find_dispatcher(gpu_uuid, placement_address)
    with DispatcherClient(dispatcher_address) as client:
        yield client, dispatcher_address


def find_dispatcher(gpu_uuid: str, placement_address: str) -> str:
    """The address of the dispatcher of the GPU `gpu_uuid`, as placement knows it."""
    with calling("placement", placement_address), PlacementClient(placement_address) as placement:
        entry = next((g for g in placement.gpus() if g.gpu.gpu_uuid == gpu_uuid), None)
    if entry is None:
        raise click.ClickException(f"no GPU {gpu_uuid} registered with placement")
    if not entry.dispatcher_address:
        raise click.ClickException(f"GPU {gpu_uuid} has no dispatcher address")
    return entry.dispatcher_address


T = TypeVar("T")


def _call(function: Callable[[], T], where: str) -> T:
    with calling("dispatcher", where):
        return function()


def _summary(found: DispatcherStatus) -> list[str]:
    gpu = found.gpu
    return [
        f"GPU {gpu.index} {gpu.gpu_uuid} on node {gpu.node}: {gpu.model}, "
        f"{found.backend}, MIG {'on' if gpu.mig_enabled else 'off'}",
        f"policy {found.policy}, window {found.window_ms:g} ms "
        f"({found.window_elapsed_ms:.0f} ms in), running SM {found.running_sm_percent}%",
        f"time quota reserved {found.quota_reserved_percent:.1f}%, used in this window "
        f"{found.quota_used_percent:.1f}%; memory reserved "
        f"{gib_or_dash(found.memory_reserved_bytes)}, in use {gib_or_dash(found.memory_used_bytes)}"
        f"; utilisation {found.utilization_percent:.0f}%",
        f"waiting for a lease: {', '.join(found.waiting) or 'none'}",
    ]
