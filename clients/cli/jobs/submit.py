"""`gpuloom submit FILE` and `gpuloom scale FUNCTION RATE --template FILE`: a job file sent to
placement, a value placement refuses named by the file's key."""

from __future__ import annotations

import json
import uuid
from typing import Any

import click

from gpuloom.clients.cli.addresses import placement_option
from gpuloom.clients.cli.jobs.common import job_json, json_option, placement_client, summary
from gpuloom.clients.placement import (
    JobFileError,
    JobNotAssigned,
    file_key_for,
    load_job_file,
    spec_from_document,
)
from gpuloom.convert import placement as convert
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.placement import JobState
from gpuloom.v1 import placement_pb2 as pb


@click.command("submit")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--wait/--no-wait",
    default=False,
    show_default=True,
    help="Wait until a pending job is assigned (exit 1 if it ends instead).",
)
@placement_option
@json_option
def submit(file: str, wait: bool, address: str, as_json: bool) -> None:
    """Submit the job described in FILE (YAML, or JSON for *.json; see docs/jobs.md) and print
    its id, state, GPU and share, or why it is pending."""
    document, spec = _read(file, require_resources=True)
    request_id = document.get("request_id") or uuid.uuid4().hex
    with placement_client(address) as client:
        try:
            job = client.submit(spec, request_id)
        except InvalidArgument as error:
            raise _refusal(file, document, error, error.field) from None
        if wait and job.state is not JobState.ASSIGNED and not job.state.finished:
            click.echo(summary(job), err=True)
            try:
                job = client.wait_assigned(job.job_id)
            except JobNotAssigned as error:
                job = error.job
    if as_json:
        click.echo(job_json(job, indent=2))
    else:
        click.echo(summary(job))
    if wait and job.state is not JobState.ASSIGNED:
        raise click.ClickException(f"job {job.job_id} ended {job.state.value}")


@click.command("scale")
@click.argument("function")
@click.argument("requests_per_s", metavar="REQUESTS_PER_S", type=click.FloatRange(min=0))
@click.option(
    "--template",
    "template_file",
    type=click.Path(dir_okay=False),
    required=True,
    help="Job file of the replicas (YAML, or JSON for *.json): name, kind, priority, memory, "
    "policy, GPU model; `resources` may be left out (the share is the scaler's).",
)
@placement_option
@json_option
def scale(
    function: str, requests_per_s: float, template_file: str, address: str, as_json: bool
) -> None:
    """Auto-scale FUNCTION to serve REQUESTS_PER_S (FaST-GShare, SetFunctionLoad): placement
    adds or cancels replicas, each at the most efficient share of the function's throughput
    profile. Prints the replicas added and removed and what they serve together."""
    document, _ = _read(template_file, require_resources=False)
    with placement_client(address) as client:
        try:
            scaling = client.set_function_load(function, requests_per_s, document)
        except InvalidArgument as error:
            field = error.field.replace("template.", "spec.", 1)
            raise _refusal(template_file, document, error, field) from None
    if as_json:
        click.echo(json.dumps(convert.scaling_json(scaling), indent=2))
        return
    best = scaling.most_efficient
    line = (
        f"function {function}: {len(scaling.added)} replicas added, {len(scaling.removed)} "
        f"removed; they serve {scaling.capacity_requests_per_s:g} requests/s"
    )
    if best is not None:
        line += (
            f" (most efficient: SM {best.sm_percent}%, quota {best.quota_percent:g}%, "
            f"{best.requests_per_s:g} requests/s each)"
        )
    click.echo(line)
    for label, jobs in (("added", scaling.added), ("removed", scaling.removed)):
        for job in jobs:
            click.echo(f"{label:<8} {summary(job)}")


def _read(path: str, require_resources: bool) -> tuple[dict[str, Any], pb.JobSpec]:
    """The job file's document and the spec it makes; what is wrong with it is a usage error
    (exit 2), before anything is sent."""
    try:
        document = load_job_file(path)
        return document, spec_from_document(document, path, require_resources)
    except JobFileError as error:
        raise click.UsageError(str(error)) from None


def _refusal(
    path: str, document: dict[str, Any], error: InvalidArgument, field: str
) -> click.ClickException | InvalidArgument:
    """A value of the file the service refused: one line naming the file's key, exit 1 like any
    refusal. The service's own error where the field is no key of the file."""
    key = file_key_for(field, document)
    if key is None:
        return error
    return click.ClickException(f"{path}: key {key!r}: refused by placement: {error.message}")
