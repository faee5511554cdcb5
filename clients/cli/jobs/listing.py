"""`gpuloom jobs`: the table of jobs, one row each."""

from __future__ import annotations

import time

import click

from gpuloom.clients.cli.addresses import placement_option
from gpuloom.clients.cli.jobs.common import (
    echo_json_or_nothing,
    elastic_text,
    job_json,
    json_option,
    memory_text,
    placement_client,
    runtime_text,
)
from gpuloom.clients.cli.table import echo_table
from gpuloom.clients.times import duration, rfc3339
from gpuloom.domain.placement import JobSpec, JobState, JobView

MAX_REASON = 60


@click.command("jobs")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([state.value for state in JobState]),
    help="Only jobs in this state (repeatable).",
)
@click.option("--task-key", default="", help="Only jobs with this task key.")
@click.option("--function", default="", help="Only replicas of this auto-scaled function.")
@click.option("--gpu", "gpu_uuid", default="", help="Only jobs on this GPU (UUID).")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@placement_option
@json_option
def list_jobs(
    states: tuple[str, ...],
    task_key: str,
    function: str,
    gpu_uuid: str,
    limit: int,
    address: str,
    as_json: bool,
) -> None:
    """List jobs, oldest first: one table row (or one JSON object per line with --json).

    SUBMITTED is when placement took the job (RFC 3339, UTC), AGE how long ago that was,
    RUNTIME how long it has run: since it was assigned, until it ended."""
    with placement_client(address) as client:
        found = list(client.list(states, task_key, function, gpu_uuid, limit=limit))
    if echo_json_or_nothing(found, job_json, as_json, "no jobs match"):
        return
    headers = ["ID", "NAME", "STATE", "PRIO", "GPU", "SM %", "QUOTA %", "MEMORY"]
    headers += ["SUBMITTED", "AGE", "RUNTIME", "TRAINING"]
    now = time.time()
    rows = [
        (
            job.job_id,
            job.spec.name,
            job.state.value,
            job.spec.priority,
            (",".join(job.assignment.gpu_uuids) if job.assignment else "") or "-",
            *_sm_quota(job.spec),
            memory_text(job.spec.memory_bytes),
            rfc3339(job.submitted_at),
            duration(now - job.submitted_at),
            runtime_text(job, now),
            training_cell(job),
            _short(job.pending_reason if job.state is JobState.PENDING else job.message),
        )
        for job in found
    ]
    echo_table([*headers, "REASON / MESSAGE"], rows)


def _sm_quota(spec: JobSpec) -> tuple[object, object]:
    if spec.is_mig_batch:
        return "MIG", "-"
    return spec.share.sm_percent, spec.share.quota.request_percent


def _short(text: str, width: int = MAX_REASON) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def training_cell(job: JobView) -> str:
    """The TRAINING column: its phase and mini-batch time, and an elastic job's GPU count
    ("-" for other jobs)."""
    state = job.training
    parts = []
    if state is not None:
        minibatch = f" {state.minibatch_s:.3g} s/mb" if state.minibatch_s else ""
        parts.append(f"{state.describe()}{minibatch}")
    elastic = elastic_text(job)
    if elastic:
        parts.append(elastic)
    return ", ".join(parts) or "-"
