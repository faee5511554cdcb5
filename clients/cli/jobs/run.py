"""`gpuloom run [OPTIONS] -- COMMAND`: run a command as a placed job (submit, wait for the
assignment, run, report the end). Its options make the job's spec; a value placement refuses is
named by the option that set it."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from gpuloom.clients.cli.addresses import placement_option
from gpuloom.clients.cli.jobs.common import placement_client, summary
from gpuloom.clients.placement import GIB, JobNotAssigned, WaitTimedOut
from gpuloom.clients.run import JobRunner
from gpuloom.clients.shim_path import default_shim_path
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.placement import JobKind, JobSpec
from gpuloom.domain.shares import DEFAULT_PRIORITY, LOWEST_PRIORITY, share_of
from gpuloom.domain.training import CheckpointHook

F = TypeVar("F", bound=Callable[..., Any])


# The options of `run` that make its job's spec, in the order --help shows them: each with the
# spec field the service names when it refuses the value (None: checked here, or by click).
_SPEC_OPTIONS: tuple[tuple[str | None, tuple[str, ...], dict[str, Any]], ...] = (
    (
        "spec.priority.level",
        ("--priority",),
        {
            "type": click.IntRange(0, LOWEST_PRIORITY),
            "help": f"0 (highest) .. {LOWEST_PRIORITY}  [default: {DEFAULT_PRIORITY}]",
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
        "spec.resources.mig.slices",
        ("--mig-size",),
        {
            "type": click.IntRange(1, 7),
            "help": "With --mig: the instance size in compute slices (1, 2, 3, 4 or 7); "
            "default: the batch planner chooses one from the task's MIG profile.",
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
    with placement_client(address) as client:
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
        _say(summary(job))  # where it landed
        code = runner.run_assigned(job, command).exit_code
    sys.exit(code)


def _say(message: str) -> None:
    click.echo(f"gpuloom run: {message}", err=True)


def _run_spec(
    command: tuple[str, ...],
    *,
    priority: int | None,
    task_key: str,
    name: str,
    sm: int | None,
    quota: float | None,
    quota_limit: float | None,
    memory_gib: float | None,
    whole_gpu: bool,
    mig: bool,
    mig_size: int | None,
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
    if mig_size is not None and not mig:
        raise click.UsageError("--mig-size goes with --mig")
    if mig:
        return JobSpec(
            name=name or os.path.basename(command[0])[:128] or "run",
            kind=JobKind(kind),
            share=share_of(priority=priority),
            mig_slices=1,
            mig_size=mig_size or 0,
            task_key=task_key,
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
    memory_bytes = 0 if memory_gib is None else round(memory_gib * GIB)
    return JobSpec(
        name=name or os.path.basename(command[0])[:128] or "run",
        kind=JobKind(kind),
        share=share_of(sm, quota, quota_limit, memory_bytes, priority),
        mps=shared,
        whole_gpus=0 if shared else gpus or 1,
        task_key=task_key,
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
