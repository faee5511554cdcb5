"""`gpuloom profile list|show|put|delete`: the profile store's profiles (the `profile` group is
in profile.py)."""

from __future__ import annotations

import json
from datetime import datetime
from itertools import islice
from typing import Any

import click

from gpuloom.clients.cli.addresses import calling, store_option
from gpuloom.clients.cli.table import echo_table
from gpuloom.clients.times import rfc3339
from gpuloom.convert import profiles as convert
from gpuloom.domain import profiles as d

KINDS = [k.value for k in d.ProfileKind]
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _client(address: str) -> Any:
    from gpuloom.clients.profile_store import ProfileStoreClient

    return ProfileStoreClient(address)


@click.command("list")
@click.option("--kind", type=click.Choice(KINDS), help="Only profiles of this kind.")
@click.option("--key", default="", help="Only this task key (function name for throughput).")
@click.option("--gpu-model", default="", help="Only this GPU model.")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@store_option
@json_option
def list_profiles(
    kind: str | None, key: str, gpu_model: str, limit: int, address: str, as_json: bool
) -> None:
    """List stored profiles, one line each."""
    with calling("profile store", address), _client(address) as client:
        found = list(
            islice(client.list(d.ProfileKind(kind) if kind else None, key, gpu_model), limit)
        )
    if as_json:
        for s in found:
            click.echo(json.dumps(convert.summary_json(s)))
        return
    if not found:
        click.echo("no profiles match")
        return
    rows = [
        (s.id.kind.value, s.id.key, s.id.gpu_model, s.version, s.entries, _when(s.updated_at))
        for s in found
    ]
    echo_table(["KIND", "KEY", "GPU MODEL", "VERSION", "ENTRIES", "UPDATED"], rows)


@click.command("show")
@click.argument("kind", type=click.Choice(KINDS))
@click.argument("key")
@click.argument("gpu_model")
@store_option
@json_option
def show_profile(kind: str, key: str, gpu_model: str, address: str, as_json: bool) -> None:
    """Show one profile in full: KIND KEY GPU_MODEL (KEY is the task key or function name)."""
    with calling("profile store", address), _client(address) as client:
        profile = client.get(d.ProfileKind(kind), key, gpu_model)
    if as_json:
        click.echo(json.dumps(convert.profile_json(profile), indent=2))
        return
    click.echo(
        f"{profile.KIND.value} profile {profile.key!r} on {profile.gpu_model!r}, "
        f"version {profile.version}, updated {_when(profile.updated_at)}"
    )
    headers, rows, extra = _details(profile)
    if extra:
        click.echo(extra)
    echo_table(headers, rows)


@click.command("put")
@click.argument("kind", type=click.Choice(KINDS))
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--expected-version",
    type=click.IntRange(min=0),
    help="Write only if the stored version is this one (0: only if there is none yet).",
)
@store_option
def put_profile(kind: str, file: str, expected_version: int | None, address: str) -> None:
    """Store the profile of KIND in FILE: its message in JSON, as `profile show KIND ... --json`
    prints it (meta.version and meta.updated_at, if there, are ignored: the store sets them).
    For instance a MIG profile (FAR): {"meta": {"key": "lud", "gpu_model": "A100-80GB"},
    "times": [{"slices": 1, "exec_time_s": 40}, {"slices": 7, "exec_time_s": 9}]}."""
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
        profile = convert.profile_from_json(d.ProfileKind(kind), text)
    except (OSError, UnicodeDecodeError) as error:
        raise click.UsageError(f"{file}: cannot read it: {error}") from None
    except ValueError as error:
        raise click.UsageError(f"{file}: not a {kind} profile: {error}") from None
    with calling("profile store", address), _client(address) as client:
        stored = client.put(profile, expected_version)
    click.echo(
        f"stored {kind} profile {stored.key!r} on {stored.gpu_model!r} (version {stored.version})"
    )


@click.command("delete")
@click.argument("kind", type=click.Choice(KINDS))
@click.argument("key")
@click.argument("gpu_model")
@click.option(
    "--expected-version",
    type=click.IntRange(min=0),
    help="Delete only if the stored version is this one (exit 1 otherwise).",
)
@store_option
def delete_profile(
    kind: str, key: str, gpu_model: str, expected_version: int | None, address: str
) -> None:
    """Delete one profile: KIND KEY GPU_MODEL. Its version still counts on: a profile put
    again later gets the next version."""
    with calling("profile store", address), _client(address) as client:
        version = client.delete(d.ProfileKind(kind), key, gpu_model, expected_version)
    click.echo(f"deleted {kind} profile {key!r} on {gpu_model!r} (version {version})")


def _details(p: d.Profile) -> tuple[list[str], list[tuple[object, ...]], str]:
    match p:
        case d.KernelProfile():
            headers = ["KERNEL ID", "NAME", "GRID", "BLOCK", "SAMPLES"]
            headers += ["MEAN us", "P50 us", "P95 us", "GAP AFTER us", "SMs", "BOUND"]
            rows = [
                (
                    str(k.kernel_id),  # as the protos' JSON mapping writes a uint64
                    _short(k.name),
                    f"{k.grid.x}x{k.grid.y}x{k.grid.z}",
                    f"{k.block.x}x{k.block.y}x{k.block.z}",
                    k.sample_count,
                    k.mean_duration_ns / 1000,
                    k.p50_duration_ns / 1000,
                    k.p95_duration_ns / 1000,
                    k.mean_gap_after_ns / 1000,
                    k.sm_usage or "-",  # 0: unknown
                    k.bound.value,
                )
                for k in p.kernels
            ]
            return headers, rows, f"measured runs: {p.measured_runs}"
        case d.ThroughputProfile():
            headers = ["SM %", "QUOTA %", "REQUESTS/S", "P50 ms", "P99 ms"]
            rows = [
                (
                    pt.sm_percent,
                    pt.quota_percent,
                    pt.requests_per_s,
                    pt.p50_latency_ms,
                    pt.p99_latency_ms,
                )
                for pt in p.points
            ]
            return headers, rows, ""
        case d.MigProfile():
            rows = [(t.slices, t.exec_time_s) for t in p.times]
            return ["SLICES", "EXEC TIME s"], rows, ""
        case d.JobProfile():
            extra = (
                f"mini-batch {p.minibatch_time_s * 1000:.2f} ms, peak memory "
                f"{p.peak_memory_bytes / 2**30:.2f} GiB, GPU utilisation "
                f"{p.gpu_utilization_percent:.1f}%, solo throughput {p.solo_throughput:.2f}/s"
            )
            rows = [(c.with_task_key, c.throughput) for c in p.colocated]
            return ["CO-LOCATED WITH", "THROUGHPUT/S"], rows, extra


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _when(moment: datetime | None) -> str:
    return rfc3339(moment.timestamp()) if moment else "-"
