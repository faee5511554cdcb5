"""What several job commands share: the placement client they open (its refusals exit 1 with the
server's message), `--json`, and the one-line summary of a job with its parts (where it runs,
its share, memory, runtime)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TypeVar

import click

from gpuloom.clients.cli.addresses import calling
from gpuloom.clients.placement import GIB, PlacementClient
from gpuloom.clients.times import duration, rfc3339
from gpuloom.convert import placement as convert
from gpuloom.domain.placement import JobSpec, JobState, JobView

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


T = TypeVar("T")


@contextlib.contextmanager
def placement_client(address: str) -> Iterator[PlacementClient]:
    """A client whose domain errors become exit status 1 with the server's message."""
    with calling("placement", address), PlacementClient(address) as client:
        yield client


def job_json(job: JobView, indent: int | None = None) -> str:
    return json.dumps(convert.job_json(job), indent=indent)


def echo_json_or_nothing(
    items: list[T], to_json: Callable[[T], str], as_json: bool, empty: str
) -> bool:
    """With --json print one object per line; with nothing to show say so. True: done."""
    if as_json:
        for item in items:
            click.echo(to_json(item))
        return True
    if not items:
        click.echo(empty)
        return True
    return False


def summary(job: JobView) -> str:
    """One line: id, state, and where it runs or why it waits or how it ended."""
    state = job.state.value
    if job.state is JobState.PENDING:
        return f"job {job.job_id} pending: {job.pending_reason or 'waiting for capacity'}"
    if job.state.holds_capacity:
        return f"job {job.job_id} {state} on {where_text(job)}: {share_text(job.spec)}"
    line = f"job {job.job_id} {state}"
    if job.state in (JobState.SUCCEEDED, JobState.FAILED):
        line += f" (exit code {job.exit_code})"
    return line + (f": {job.message}" if job.message else "")


def where_text(job: JobView) -> str:
    assignment = job.assignment
    if assignment is None or not assignment.gpu_uuid:
        return "no GPU"
    if assignment.extra_gpus:
        where = f"GPUs {', '.join(assignment.gpu_uuids)} on node {assignment.node}"
    else:
        where = f"GPU {assignment.gpu_uuid} on node {assignment.node}"
    slot = assignment.mig
    if slot is not None:
        where += (
            f", MIG {slot.size} slices at slice {slot.first_slice}, planned "
            f"{rfc3339(slot.planned_start)} to {rfc3339(slot.planned_end)}"
        )
    return where


def share_text(spec: JobSpec) -> str:
    if spec.mps:
        quota = spec.share.quota
        limit = (
            f" (limit {quota.limit_percent:g}%)"
            if quota.limit_percent and quota.limit_percent != quota.request_percent
            else ""
        )
        text = f"SM {spec.share.sm_percent}%, quota {quota.request_percent:g}%{limit}"
    elif spec.max_gpus:
        text = f"{spec.whole_gpus}..{spec.max_gpus} whole GPUs (elastic)"
    elif spec.whole_gpus:
        text = "whole GPU" if spec.whole_gpus == 1 else f"{spec.whole_gpus} GPUs"
    elif spec.is_mig_batch:
        text = "a MIG instance (sized by the batch planner)"
    else:
        text = "no share"
    if spec.memory_bytes:
        text += f", memory {memory_text(spec.memory_bytes)}"
    if spec.cpu_milli:
        text += f", CPU {spec.cpu_milli} milli"
    if spec.host_memory_bytes:
        text += f", host memory {memory_text(spec.host_memory_bytes)}"
    return text


def elastic_text(job: JobView) -> str:
    """An elastic job's GPUs now within its range: "grown to 2 of 1..4", "1 of 1..4 GPUs"
    ("" for other jobs)."""
    spec = job.spec
    if not spec.max_gpus:
        return ""
    low = max(spec.whole_gpus, 1)
    held = job.assignment is not None and job.state.holds_capacity
    now = len(job.assignment.gpu_uuids) if held and job.assignment else 0
    if not now:
        return f"{low}..{spec.max_gpus} GPUs"
    if now > low:
        return f"grown to {now} of {low}..{spec.max_gpus}"
    return f"{now} of {low}..{spec.max_gpus} GPUs"


def runtime_text(job: JobView, now: float) -> str:
    """Since it was assigned; until it ended, for a finished job. '-': it never ran."""
    if not job.started_at:
        return "-"
    end = job.updated_at if job.state.finished else now
    return duration(end - job.started_at)


def memory_text(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size else "-"
