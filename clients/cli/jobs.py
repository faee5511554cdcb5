"""`gpuloom submit|jobs|job|cancel|watch|gpus|run`: submit and follow jobs through the placement
service, and run a command as a placed job."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from gpuloom.clients.cli.addresses import placement_option, service_error
from gpuloom.clients.cli.table import echo_table
from gpuloom.clients.placement import (
    DEFAULT_PRIORITY,
    GIB,
    JobFileError,
    JobNotAssigned,
    PlacementClient,
    WaitTimedOut,
    file_key_for,
    load_job_file,
    spec_from_document,
)
from gpuloom.clients.run import JobRunner
from gpuloom.clients.shim_path import default_shim_path
from gpuloom.clients.times import duration, rfc3339
from gpuloom.convert import placement as convert
from gpuloom.domain.errors import DomainError, InvalidArgument
from gpuloom.domain.placement import GpuEntry, JobKind, JobSpec, JobState, JobView
from gpuloom.domain.shares import SpatioTemporalShare, TimeQuota
from gpuloom.domain.training import CheckpointHook, TrainingState, gpus_text

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
MAX_REASON = 60
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


@contextlib.contextmanager
def _placement(address: str) -> Iterator[PlacementClient]:
    """A client whose domain errors become exit status 1 with the server's message."""
    try:
        with PlacementClient(address) as client:
            yield client
    except DomainError as error:
        raise _fail(error, address) from None


def _fail(error: DomainError, address: str) -> click.ClickException:
    return service_error(error, "placement", address)


# ---- submit ----


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
    try:
        document = load_job_file(file)
        spec = spec_from_document(document, file)
    except JobFileError as error:
        raise click.UsageError(str(error)) from None
    request_id = document.get("request_id") or uuid.uuid4().hex
    with _placement(address) as client:
        try:
            job = client.submit(spec, request_id)
        except InvalidArgument as error:
            key = file_key_for(error.field, document)
            if key is None:
                raise
            # The service refused a value: exit 1 with one line, like any refusal (2 is for
            # what is wrong before anything is sent).
            raise click.ClickException(
                f"{file}: key {key!r}: refused by placement: {error.message}"
            ) from None
        if wait and job.state is not JobState.ASSIGNED and not job.state.finished:
            click.echo(_summary(job), err=True)
            try:
                job = client.wait_assigned(job.job_id)
            except JobNotAssigned as error:
                job = error.job
    if as_json:
        click.echo(_json(job, indent=2))
    else:
        click.echo(_summary(job))
    if wait and job.state is not JobState.ASSIGNED:
        raise click.ClickException(f"job {job.job_id} ended {job.state.value}")


# ---- jobs, job, cancel, watch ----


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
    with _placement(address) as client:
        found = list(client.list(states, task_key, function, gpu_uuid, limit=limit))
    if _echo_json_or_nothing(found, _json, as_json, "no jobs match"):
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
            _memory(job.spec.memory_bytes),
            rfc3339(job.submitted_at),
            duration(now - job.submitted_at),
            _runtime(job, now),
            _training_cell(job),
            _short(job.pending_reason if job.state is JobState.PENDING else job.message),
        )
        for job in found
    ]
    echo_table([*headers, "REASON / MESSAGE"], rows)


@click.command("job")
@click.argument("job_id", metavar="JOB")
@placement_option
@json_option
def show_job(job_id: str, address: str, as_json: bool) -> None:
    """Show one job in detail: its spec, state, and where and how it runs."""
    with _placement(address) as client:
        job = client.get(job_id)
    click.echo(_json(job, indent=2) if as_json else _details(job))


@click.command("cancel")
@click.argument("job_id", metavar="JOB")
@click.option("--reason", default="", help="Recorded as the job's message.")
@placement_option
@json_option
def cancel(job_id: str, reason: str, address: str, as_json: bool) -> None:
    """Cancel a pending or assigned job; what it holds is released."""
    with _placement(address) as client:
        job = client.cancel(job_id, reason)
    click.echo(_json(job, indent=2) if as_json else _summary(job))


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
    with _placement(address) as client:
        for job in client.watch(job_id):
            if as_json:
                click.echo(_json(job))
                continue
            seen = (job.state, job.pending_reason)
            if seen != last:
                last = seen
                click.echo(f"{rfc3339(job.updated_at)}  {_summary(job)}")
    if job is not None and job.state is not JobState.SUCCEEDED:
        detail = f": {job.message}" if job.message else ""
        raise click.ClickException(f"job {job.job_id} ended {job.state.value}{detail}")


# ---- scale ----


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
    try:
        document = load_job_file(template_file)
        spec_from_document(document, template_file, require_resources=False)
    except JobFileError as error:
        raise click.UsageError(str(error)) from None
    with _placement(address) as client:
        try:
            scaling = client.set_function_load(function, requests_per_s, document)
        except InvalidArgument as error:
            key = file_key_for(error.field.replace("template.", "spec.", 1), document)
            if key is None:
                raise
            raise click.ClickException(
                f"{template_file}: key {key!r}: refused by placement: {error.message}"
            ) from None
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
            click.echo(f"{label:<8} {_summary(job)}")


# ---- gpus ----


@click.command("gpus")
@click.option("--node", default="", help="Only the GPUs of this node.")
@placement_option
@json_option
def gpus(node: str, address: str, as_json: bool) -> None:
    """List the registered GPUs: what is reserved on each and how busy it is."""
    with _placement(address) as client:
        found = list(client.gpus(node))
    if _echo_json_or_nothing(found, _gpu_json, as_json, "no GPUs registered"):
        return
    headers = [
        "NODE",
        "UUID",
        "MODEL",
        "MEMORY",
        "STATUS",
        "JOBS",
        "DIRECT",
        "AREA %",
        "MEM RESERVED",
        "NODE CPU",
        "NODE MEM",
    ]
    rows = [
        (
            g.gpu.node,
            g.gpu.gpu_uuid,
            g.gpu.model,
            _memory(g.gpu.memory_bytes),
            "lost" if g.lost else "schedulable" if g.schedulable else "unschedulable",
            g.jobs,
            g.direct_reservations,
            g.area_reserved_percent,
            _memory(g.memory_reserved_bytes),
            f"{g.gpu.node_cpu_milli / 1000:g}" if g.gpu.node_cpu_milli else "-",
            _memory(g.gpu.node_memory_bytes),
            g.utilization_percent,
        )
        for g in found
    ]
    echo_table([*headers, "UTIL %"], rows)


# ---- run ----

# The options of `run` that make its job's spec, in the order --help shows them: each with the
# spec field the service names when it refuses the value (None: checked here, or by click).
_SPEC_OPTIONS: tuple[tuple[str | None, tuple[str, ...], dict[str, Any]], ...] = (
    (
        "spec.priority.level",
        ("--priority",),
        {
            "type": click.IntRange(0, 9),
            "default": DEFAULT_PRIORITY,
            "show_default": True,
            "help": "0 (highest) .. 9.",
        },
    ),
    (
        "spec.task_key",
        ("--task-key",),
        {"default": "", "help": "Task key (which profiles describe the job)."},
    ),
    ("spec.name", ("--name",), {"default": "", "help": "Job name (default: the command's name)."}),
    (
        "spec.resources.mps.sm_percent",
        ("--sm",),
        {"type": click.IntRange(1, 100), "help": "SM percent of an MPS share."},
    ),
    (
        "spec.resources.mps.quota.request_percent",
        ("--quota",),
        {
            "type": click.FloatRange(0, 100, min_open=True),
            "help": "Time quota (percent of the window) of an MPS share.",
        },
    ),
    (
        "spec.resources.mps.quota.limit_percent",
        ("--quota-limit",),
        {
            "type": click.FloatRange(0, 100, min_open=True),
            "help": "Time quota limit in percent (default: the quota).",
        },
    ),
    (
        "spec.resources.memory_bytes",
        ("--memory-gib",),
        {"type": click.FloatRange(0, min_open=True), "help": "GPU memory cap in GiB."},
    ),
    (None, ("--whole-gpu",), {"is_flag": True, "help": "Ask for a whole GPU (the default)."}),
    (
        "spec.resources",
        ("--mig",),
        {
            "is_flag": True,
            "help": "A MIG batch task (needs --task-key, with a MIG profile): COMMAND starts when "
            "the task's batch hands it its MIG instance (docs/placement.md, MIG batches).",
        },
    ),
    (
        "spec.resources.whole_gpus",
        ("--gpus",),
        {
            "type": click.IntRange(1, 64),
            "help": "Whole GPUs, all on one node (reserved all or none); excludes --sm/--quota.",
        },
    ),
    (
        "spec.max_gpus",
        ("--max-gpus",),
        {
            "type": click.IntRange(1, 64),
            "help": "Training jobs with a checkpoint hook: an elastic range --gpus..M; the job may "
            "grow onto idle GPUs of its node and shrink back (docs/training.md).",
        },
    ),
    (
        "spec.cpu_milli",
        ("--cpu-milli",),
        {
            "type": click.IntRange(min=0),
            "default": 0,
            "help": "CPU of the node, in thousandths of a core.",
        },
    ),
    (
        "spec.host_memory_bytes",
        ("--host-memory-gib",),
        {"type": click.FloatRange(min=0), "default": 0.0, "help": "Memory of the node in GiB."},
    ),
    (
        "spec.policy",
        ("--policy",),
        {"default": "", "help": "Placement policy (default: the service's)."},
    ),
    (
        "spec.gpu_model",
        ("--gpu-model", "--gpu-spec"),
        {"default": "", "help": "Only GPUs of this model; alternatives as A|B."},
    ),
    (
        "spec.shared_model",
        ("--shared-model",),
        {
            "default": "",
            "help": "A replica of this model: placed first where a model store holds it, with "
            "--memory-gib less the weights as its cap there.",
        },
    ),
    (
        "spec.checkpoint.signal",
        ("--checkpoint-signal",),
        {
            "default": "",
            "help": "Training jobs: the signal COMMAND answers by saving its state and exiting 0 "
            "(e.g. SIGUSR1); it may then be migrated (docs/training.md).",
        },
    ),
    (
        "spec.checkpoint.command",
        ("--checkpoint-command",),
        {
            "default": "",
            "help": "Training jobs: a command (split like a shell line) that saves COMMAND's "
            "state; GPULOOM_JOB_PID names COMMAND's process.",
        },
    ),
    (
        "spec.checkpoint.timeout_s",
        ("--checkpoint-timeout",),
        {
            "type": click.FloatRange(0, 3600, min_open=True),
            "help": "Seconds the checkpoint hook may take (default 60).",
        },
    ),
    (
        None,
        ("--kind",),
        {
            "type": click.Choice([kind.value for kind in JobKind]),
            "default": JobKind.BATCH.value,
            "show_default": True,
            "help": "Job kind.",
        },
    ),
)
# Spec fields the service may refuse -> the option of `run` that sets them.
_RUN_OPTIONS = {field: decls[0] for field, decls, _ in _SPEC_OPTIONS if field is not None}


def _spec_options(command: F) -> F:
    for _, decls, settings in reversed(_SPEC_OPTIONS):
        command = click.option(*decls, **settings)(command)
    return command


@click.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@_spec_options
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    help="Seconds to wait for an assignment (default: no limit); the job is then cancelled.",
)
@click.option(
    "--shim",
    "shim_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Launch shim to preload (default: GPULOOM_SHIM_PATH, else the checkout's "
    "shim/build/libgpuloom.so if built).",
)
@click.option("--no-shim", is_flag=True, help="Do not preload the shim.")
@placement_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    timeout: float | None,
    shim_path: str | None,
    no_shim: bool,
    address: str,
    command: tuple[str, ...],
    **spec_options: Any,
) -> None:
    """Run COMMAND as a placed job: submit, wait for the assignment, run, report the end.

    \b
        gpuloom run --sm 30 --quota 40 --memory-gib 8 -- python examples/serve.py

    Without --sm and --quota the job gets a whole GPU; with either, it gets an MPS share (SM
    percent and time quota, each 100 when not given) and needs --memory-gib. While the job is
    pending, the reason is printed to stderr.

    COMMAND runs as a child process (not exec'd), so that its end can be reported: it gets the
    assignment's environment (dispatcher socket, token, ...), CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    for a share, and the shim in front of LD_PRELOAD. SIGINT and SIGTERM sent to gpuloom are
    passed on to it. If the job is cancelled or lost meanwhile, COMMAND gets SIGTERM. When it
    ends, the job is reported SUCCEEDED (exit code 0) or FAILED, and gpuloom exits with
    COMMAND's exit code (128 + the signal number if a signal killed it; 127 if COMMAND was not
    found, 126 if it could not be started otherwise; 1 if the job ended before it was
    assigned or the wait timed out).
    """
    spec = _run_spec(command, **spec_options)
    if no_shim:
        shim_path = None
    elif shim_path is None:
        shim_path = default_shim_path()
        if shim_path is None:
            _say(
                "no shim found (set GPULOOM_SHIM_PATH or build shim/); running without it, so "
                "the time quota is not enforced"
            )
    with _placement(address) as client:
        runner = JobRunner(client, shim_path, on_message=_say)
        try:
            job = client.submit(spec)
        except InvalidArgument as error:
            option = _RUN_OPTIONS.get(error.field, "COMMAND")
            raise click.ClickException(f"{option}: refused by placement: {error.message}") from None
        try:
            job = runner.wait_assigned(job, timeout)
        except JobNotAssigned as error:
            raise click.ClickException(error.message) from None
        except WaitTimedOut as error:
            raise click.ClickException(f"{error.message}; cancelled it") from None
        except KeyboardInterrupt:
            _say(f"interrupted; cancelled job {job.job_id}")
            sys.exit(130)
        _say(_summary(job))  # where it landed
        code = runner.run_assigned(job, command).exit_code
    sys.exit(code)


def _say(message: str) -> None:
    click.echo(f"gpuloom run: {message}", err=True)


def _run_spec(
    command: tuple[str, ...],
    *,
    priority: int,
    task_key: str,
    name: str,
    sm: int | None,
    quota: float | None,
    quota_limit: float | None,
    memory_gib: float | None,
    whole_gpu: bool,
    mig: bool,
    gpus: int | None,
    max_gpus: int | None,
    cpu_milli: int,
    host_memory_gib: float,
    policy: str,
    gpu_model: str,
    shared_model: str,
    kind: str,
    checkpoint_signal: str,
    checkpoint_command: str,
    checkpoint_timeout: float | None,
) -> JobSpec:
    shared = sm is not None or quota is not None
    if mig and (shared or whole_gpu or gpus is not None or max_gpus is not None):
        raise click.UsageError("--mig excludes --sm, --quota, --whole-gpu, --gpus and --max-gpus")
    if mig:
        return JobSpec(
            name=name or os.path.basename(command[0])[:128] or "run",
            kind=JobKind(kind),
            memory_bytes=0,
            mig_slices=1,
            task_key=task_key,
            priority=priority,
            policy=policy,
            gpu_model=gpu_model,
            command=tuple(command),
        )
    if whole_gpu and shared:
        raise click.UsageError("--whole-gpu excludes --sm and --quota")
    if gpus is not None and shared:
        raise click.UsageError("--gpus excludes --sm and --quota (a share is of one GPU)")
    if gpus is not None and gpus > 1 and shared_model:
        raise click.UsageError("--shared-model takes one GPU: not with --gpus above 1")
    if max_gpus is not None and shared:
        raise click.UsageError("--max-gpus needs whole GPUs: not with --sm or --quota")
    if max_gpus is not None and max_gpus < (gpus or 1):
        raise click.UsageError(f"--max-gpus {max_gpus} is below --gpus {gpus or 1}")
    if quota_limit is not None and not shared:
        raise click.UsageError("--quota-limit needs an MPS share (--sm and/or --quota)")
    if shared and memory_gib is None:
        raise click.UsageError("--sm/--quota need --memory-gib (the GPU memory cap of a share)")
    share = None
    if shared:
        request = 100.0 if quota is None else quota
        share = SpatioTemporalShare(
            100 if sm is None else sm, TimeQuota(request, quota_limit or request)
        )
    return JobSpec(
        name=name or os.path.basename(command[0])[:128] or "run",
        kind=JobKind(kind),
        memory_bytes=0 if memory_gib is None else round(memory_gib * GIB),
        share=share,
        whole_gpus=0 if shared else gpus or 1,
        task_key=task_key,
        priority=priority,
        policy=policy,
        gpu_model=gpu_model,
        shared_model=shared_model,
        checkpoint=_hook(checkpoint_signal, checkpoint_command, checkpoint_timeout),
        max_gpus=max_gpus or 0,
        cpu_milli=cpu_milli,
        host_memory_bytes=round(host_memory_gib * GIB),
    )


def _hook(signal_name: str, command: str, timeout_s: float | None) -> CheckpointHook | None:
    if signal_name and command:
        raise click.UsageError("give --checkpoint-signal or --checkpoint-command, not both")
    if not (signal_name or command):
        if timeout_s is not None:
            raise click.UsageError(
                "--checkpoint-timeout needs --checkpoint-signal or --checkpoint-command"
            )
        return None
    try:
        argv = tuple(shlex.split(command))
    except ValueError as error:
        raise click.UsageError(f"--checkpoint-command: {error}") from None
    return CheckpointHook(argv, signal_name.upper(), timeout_s or 0.0)


# ---- formatting ----


def _json(job: JobView, indent: int | None = None) -> str:
    return json.dumps(convert.job_json(job), indent=indent)


def _gpu_json(entry: GpuEntry) -> str:
    return json.dumps(convert.gpu_entry_json(entry))


def _echo_json_or_nothing(
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


def _share(spec: JobSpec) -> str:
    if spec.share is not None:
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
        text += f", memory {_memory(spec.memory_bytes)}"
    if spec.cpu_milli:
        text += f", CPU {spec.cpu_milli} milli"
    if spec.host_memory_bytes:
        text += f", host memory {_memory(spec.host_memory_bytes)}"
    return text


def _sm_quota(spec: JobSpec) -> tuple[object, object]:
    if spec.share is not None:
        return spec.share.sm_percent, spec.share.quota.request_percent
    if spec.is_mig_batch:
        return "MIG", "-"
    return 100, 100.0


def _runtime(job: JobView, now: float) -> str:
    """Since it was assigned; until it ended, for a finished job. '-': it never ran."""
    if not job.started_at:
        return "-"
    end = job.updated_at if job.state.finished else now
    return duration(end - job.started_at)


def _memory(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size else "-"


def _short(text: str, width: int = MAX_REASON) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _where(job: JobView) -> str:
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


def _summary(job: JobView) -> str:
    """One line: id, state, and where it runs or why it waits or how it ended."""
    state = job.state.value
    if job.state is JobState.PENDING:
        return f"job {job.job_id} pending: {job.pending_reason or 'waiting for capacity'}"
    if job.state.holds_capacity:
        return f"job {job.job_id} {state} on {_where(job)}: {_share(job.spec)}"
    line = f"job {job.job_id} {state}"
    if job.state in (JobState.SUCCEEDED, JobState.FAILED):
        line += f" (exit code {job.exit_code})"
    return line + (f": {job.message}" if job.message else "")


def _training_cell(job: JobView) -> str:
    """The TRAINING column: its phase and mini-batch time, and an elastic job's GPU count
    ("-" for other jobs)."""
    state = job.training
    parts = []
    if state is not None:
        minibatch = f" {state.minibatch_s:.3g} s/mb" if state.minibatch_s else ""
        parts.append(f"{state.describe()}{minibatch}")
    elastic = _elastic(job)
    if elastic:
        parts.append(elastic)
    return ", ".join(parts) or "-"


def _elastic(job: JobView) -> str:
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
    ]
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


def _details(job: JobView) -> str:
    spec = job.spec
    rows: list[tuple[str, object]] = [
        ("job", job.job_id),
        ("name", spec.name),
        ("state", job.state.value),
        ("kind", spec.kind.value if spec.kind else "unspecified"),
        ("priority", spec.priority),
        ("resources", _share(spec)),
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
            ("gpu", _where(job)),
            ("dispatcher", a.dispatcher_address),
            ("offsets", f"quota {a.quota_offset_percent:g}%, SM {a.sm_offset_percent}%"),
            ("memory cap", _memory(a.memory_cap_bytes)),
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
        rows.append(("elastic", _elastic(job)))
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
        ("runtime", _runtime(job, time.time())),
        ("updated", f"{rfc3339(job.updated_at)} (revision {job.revision})"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)
