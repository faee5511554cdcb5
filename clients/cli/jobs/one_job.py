"""`gpuloom job|cancel|watch JOB`: one job in detail, cancelled, or followed until it ends."""

from __future__ import annotations

import time

import click

from gpuloom.clients.cli.addresses import placement_option
from gpuloom.clients.cli.jobs.common import (
    elastic_text,
    job_json,
    json_option,
    memory_text,
    placement_client,
    runtime_text,
    share_text,
    summary,
    where_text,
)
from gpuloom.clients.times import rfc3339
from gpuloom.domain.placement import JobState, JobView
from gpuloom.domain.training import TrainingState, gpus_text


@click.command("job")
@click.argument("job_id", metavar="JOB")
@placement_option
@json_option
def show_job(job_id: str, address: str, as_json: bool) -> None:
    """Show one job in detail: its spec, state, and where and how it runs."""
    with placement_client(address) as client:
        job = client.get(job_id)
    click.echo(job_json(job, indent=2) if as_json else details(job))


@click.command("cancel")
@click.argument("job_id", metavar="JOB")
@click.option("--reason", default="", help="Recorded as the job's message.")
@placement_option
@json_option
def cancel(job_id: str, reason: str, address: str, as_json: bool) -> None:
    """Cancel a pending or assigned job; what it holds is released."""
    with placement_client(address) as client:
        job = client.cancel(job_id, reason)
    click.echo(job_json(job, indent=2) if as_json else summary(job))


@click.command("watch")
@click.argument("job_id", metavar="JOB")
@placement_option
@json_option
def watch(job_id: str, address: str, as_json: bool) -> None:
    """Print the job's state now, then a line for each change (of state, or of the reason it is
    pending) until it finishes. --json prints each revision as a JSON line. Exits 0 if the job
    succeeded, 1 if it failed, was cancelled or was lost."""
    last: tuple[JobState, str] | None = None
    job: JobView | None = None
    with placement_client(address) as client:
        for job in client.watch(job_id):
            if as_json:
                click.echo(job_json(job))
                continue
            seen = (job.state, job.pending_reason)
            if seen != last:
                last = seen
                click.echo(f"{rfc3339(job.updated_at)}  {summary(job)}")
    if job is not None and job.state is not JobState.SUCCEEDED:
        detail = f": {job.message}" if job.message else ""
        raise click.ClickException(f"job {job.job_id} ended {job.state.value}{detail}")


def details(job: JobView) -> str:
    spec = job.spec
    rows: list[tuple[str, object]] = [
        ("job", job.job_id),
        ("name", spec.name),
        ("state", job.state.value),
        ("kind", spec.kind.value if spec.kind else "unspecified"),
        ("priority", spec.priority),
        ("resources", share_text(spec)),
        ("task key", spec.task_key or "-"),
        ("function", job.function or "-"),
        ("policy", job.policy or spec.policy or "(service default)"),
        ("gpu model", spec.gpu_model or "any"),
    ]
    if spec.slo.p99_latency_ms or spec.slo.target_requests_per_s:
        rows.append(
            (
                "slo",
                f"p99 {spec.slo.p99_latency_ms:g} ms, {spec.slo.target_requests_per_s:g} req/s",
            )
        )
    if job.state is JobState.PENDING:
        rows.append(("pending", job.pending_reason or "-"))
    a = job.assignment
    if a is not None:
        rows += [
            ("gpu", where_text(job)),
            ("dispatcher", a.dispatcher_address),
            ("offsets", f"quota {a.quota_offset_percent:g}%, SM {a.sm_offset_percent}%"),
            ("memory cap", memory_text(a.memory_cap_bytes)),
        ]
        if a.time_slice_of:
            rows.append(("time-sliced", f"in the rectangle of {a.time_slice_of}, taking turns"))
        for key in sorted(a.environment):
            value = "(hidden)" if key.endswith("TOKEN") else a.environment[key]
            rows.append(("env", f"{key}={value}"))
        for extra in a.extra_gpus:
            rows.append(("also", f"GPU {extra.gpu_uuid} via {extra.dispatcher_address}"))
    if spec.checkpoint is not None:
        hook = spec.checkpoint
        how = " ".join(hook.command) if hook.command else f"signal {hook.signal}"
        rows.append(("checkpoint", f"{how} (within {hook.effective_timeout_s:g} s)"))
    if spec.max_gpus:
        rows.append(("elastic", elastic_text(job)))
    if job.training is not None:
        rows += _training_rows(job.training)
    if job.state in (JobState.SUCCEEDED, JobState.FAILED):
        rows.append(("exit code", job.exit_code))
    if job.message:
        rows.append(("message", job.message))
    rows += [
        ("request id", job.request_id),
        ("submitted", rfc3339(job.submitted_at)),
        ("started", rfc3339(job.started_at)),
        ("runtime", runtime_text(job, time.time())),
        ("updated", f"{rfc3339(job.updated_at)} (revision {job.revision})"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def _training_rows(state: TrainingState) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        ("training", state.describe()),
        (
            "mini-batch",
            f"{state.minibatch_s:.4g} s now, {state.solo_minibatch_s:.4g} s not packed "
            f"({state.minibatches} seen)"
            if state.minibatch_s
            else "not measured yet",
        ),
        ("height", f"{state.height} training job(s) on its GPU"),
        ("GPU memory", state.memory_text()),
    ]
    if state.memory_note:
        rows.append(("memory note", state.memory_note))
    if state.preempted_by:
        rows.append(("preempted", f"by {state.preempted_by}: suspended until it ends"))
    for trial in state.packings:
        result = (
            f"gain {trial.gain:.3f} ({trial.solo_minibatch_s:.4g} s alone, "
            f"{trial.packed_minibatch_s:.4g} s packed)"
            if trial.gain
            else "trial running"
        )
        undone = ", undone" if trial.undone else ""
        rows.append(
            ("packing", f"with {trial.partner} at {rfc3339(trial.started_at)}: {result}{undone}")
        )
    if state.migration is not None:
        m = state.migration
        where = (
            f"to {gpus_text(m.gpus)} from {m.target_gpu_uuid}"
            if m.gpus
            else f"to {m.target_gpu_uuid} on {m.target_node}"
        )
        rows.append(
            (
                "resizing" if m.gpus else "migrating",
                f"{where} ({m.reason}), hook due by {rfc3339(m.deadline)}",
            )
        )
    rows.append(("migrations", f"{state.migrations} done, {state.failed_migrations} failed"))
    if state.resizes:
        rows.append(("resizes", f"{state.resizes} done (grow-shrink)"))
    if state.last_hook_error:
        rows.append(
            ("hook error", f"{state.last_hook_error} ({rfc3339(state.last_hook_error_at)})")
        )
    return rows
