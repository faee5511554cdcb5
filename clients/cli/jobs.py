"""`gpuloom submit|jobs|job|cancel|watch|gpus|run`: submit and follow jobs through the placement
service, and run a command as a placed job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any

import click
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from gpuloom.clients.cli.table import render_table
from gpuloom.clients.placement import (
    DEFAULT_ADDRESS,
    DEFAULT_PRIORITY,
    GIB,
    KINDS,
    STATES,
    JobFileError,
    JobNotAssigned,
    PlacementClient,
    WaitTimedOut,
    file_key_for,
    is_finished,
    kind_name,
    load_job_file,
    spec_from_document,
    state_name,
)
from gpuloom.clients.shim_path import default_shim_path
from gpuloom.domain.errors import DomainError, InvalidArgument
from gpuloom.v1 import common_pb2
from gpuloom.v1 import placement_pb2 as pb

placement_option = click.option(
    "--placement",
    "address",
    envvar="GPULOOM_PLACEMENT_ADDRESS",
    default=DEFAULT_ADDRESS,
    show_default=True,
    help="Placement service address (env GPULOOM_PLACEMENT_ADDRESS).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
MAX_REASON = 60


@contextlib.contextmanager
def _placement(address: str) -> Iterator[PlacementClient]:
    """A client whose domain errors become exit status 1 with the server's message."""
    try:
        with PlacementClient(address) as client:
            yield client
    except DomainError as error:
        raise _fail(error, address) from None


def _fail(error: DomainError, address: str) -> click.ClickException:
    return click.ClickException(f"{error.message} (placement at {address})")


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
            raise click.UsageError(
                f"{file}: key {key!r}: refused by placement: {error.message}"
            ) from None
        if wait and job.state != pb.JOB_STATE_ASSIGNED and not is_finished(job):
            click.echo(_summary(job), err=True)
            try:
                job = client.wait_assigned(job.job_id)
            except JobNotAssigned as error:
                job = error.job
    if as_json:
        click.echo(_json(job, indent=2))
    else:
        click.echo(_summary(job))
    if wait and job.state != pb.JOB_STATE_ASSIGNED:
        raise click.ClickException(f"job {job.job_id} ended {state_name(job.state)}")


# ---- jobs, job, cancel, watch ----


@click.command("jobs")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(list(STATES)),
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
    """List jobs, oldest first: one table row (or one JSON object per line with --json)."""
    with _placement(address) as client:
        found = list(client.list(states, task_key, function, gpu_uuid, limit=limit))
    if _echo_json_or_nothing(found, as_json, "no jobs match"):
        return
    headers = ["ID", "NAME", "STATE", "PRIO", "GPU", "SM %", "QUOTA %", "MEMORY"]
    rows = [
        (
            job.job_id,
            job.spec.name,
            state_name(job.state),
            job.spec.priority.level,
            job.assignment.gpu.gpu_uuid or "-",
            *_sm_quota(job.spec),
            _memory(job.spec.resources.memory_bytes),
            _short(job.pending_reason if job.state == pb.JOB_STATE_PENDING else job.message),
        )
        for job in found
    ]
    click.echo(render_table([*headers, "REASON / MESSAGE"], rows))


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
    pending) until it finishes. --json prints each revision as a JSON line."""
    last: tuple[int, str] | None = None
    with _placement(address) as client:
        for job in client.watch(job_id):
            if as_json:
                click.echo(_json(job))
                continue
            seen = (job.state, job.pending_reason)
            if seen != last:
                last = seen
                click.echo(f"{_clock(job.updated_at_unix_s)}  {_summary(job)}")


# ---- gpus ----


@click.command("gpus")
@click.option("--node", default="", help="Only the GPUs of this node.")
@placement_option
@json_option
def gpus(node: str, address: str, as_json: bool) -> None:
    """List the registered GPUs: what is reserved on each and how busy it is."""
    with _placement(address) as client:
        found = list(client.gpus(node))
    if _echo_json_or_nothing(found, as_json, "no GPUs registered"):
        return
    headers = ["NODE", "UUID", "MODEL", "MEMORY", "STATUS", "JOBS", "AREA %", "MEM RESERVED"]
    rows = [
        (
            g.gpu.ref.node,
            g.gpu.ref.gpu_uuid,
            g.gpu.model,
            _memory(g.gpu.memory_bytes),
            "lost" if g.lost else "schedulable" if g.schedulable else "unschedulable",
            g.jobs,
            g.area_reserved_percent,
            _memory(g.memory_reserved_bytes),
            g.utilization_percent,
        )
        for g in found
    ]
    click.echo(render_table([*headers, "UTIL %"], rows))


# ---- run ----


@click.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option(
    "--priority",
    type=click.IntRange(0, 9),
    default=DEFAULT_PRIORITY,
    show_default=True,
    help="0 (highest) .. 9.",
)
@click.option("--task-key", default="", help="Task key (which profiles describe the job).")
@click.option("--name", default="", help="Job name (default: the command's name).")
@click.option("--sm", type=click.IntRange(1, 100), help="SM percent of an MPS share.")
@click.option(
    "--quota",
    type=click.FloatRange(0, 100, min_open=True),
    help="Time quota (percent of the window) of an MPS share.",
)
@click.option(
    "--quota-limit",
    type=click.FloatRange(0, 100, min_open=True),
    help="Time quota limit in percent (default: the quota).",
)
@click.option(
    "--memory-gib", type=click.FloatRange(0, min_open=True), help="GPU memory cap in GiB."
)
@click.option("--whole-gpu", is_flag=True, help="Ask for a whole GPU (the default).")
@click.option("--policy", default="", help="Placement policy (default: the service's).")
@click.option("--gpu-model", default="", help="Only GPUs of this model.")
@click.option(
    "--kind", type=click.Choice(list(KINDS)), default="batch", show_default=True, help="Job kind."
)
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
    priority: int,
    task_key: str,
    name: str,
    sm: int | None,
    quota: float | None,
    quota_limit: float | None,
    memory_gib: float | None,
    whole_gpu: bool,
    policy: str,
    gpu_model: str,
    kind: str,
    timeout: float | None,
    shim_path: str | None,
    no_shim: bool,
    address: str,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND as a placed job: submit, wait for the assignment, run, report the end.

    \b
        gpuloom run --sm 30 --quota 40 --memory-gib 8 -- python train.py

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
    spec = _run_spec(
        command, priority, task_key, name, sm, quota, quota_limit, memory_gib, whole_gpu
    )
    spec.kind = KINDS[kind]
    spec.policy = policy
    spec.gpu_model = gpu_model
    if no_shim:
        shim_path = None
    elif shim_path is None:
        shim_path = default_shim_path()
        if shim_path is None:
            click.echo(
                "gpuloom run: no shim found (set GPULOOM_SHIM_PATH or build shim/); running "
                "without it, so the time quota is not enforced",
                err=True,
            )
    with _placement(address) as client:
        try:
            job = client.submit(spec)
        except InvalidArgument as error:
            raise click.BadParameter(
                error.message, param_hint=_RUN_OPTIONS.get(error.field, "COMMAND")
            ) from None
        job = _await_assignment(client, job, timeout)
        code = _run_assigned(client, job, command, shim_path)
    sys.exit(code)


# Spec fields the service may refuse -> the option of `run` that sets them.
_RUN_OPTIONS = {
    "spec.name": "--name",
    "spec.task_key": "--task-key",
    "spec.policy": "--policy",
    "spec.gpu_model": "--gpu-model",
    "spec.priority.level": "--priority",
    "spec.resources.memory_bytes": "--memory-gib",
    "spec.resources.mps.sm_percent": "--sm",
    "spec.resources.mps.quota.request_percent": "--quota",
    "spec.resources.mps.quota.limit_percent": "--quota-limit",
}


def _run_spec(
    command: tuple[str, ...],
    priority: int,
    task_key: str,
    name: str,
    sm: int | None,
    quota: float | None,
    quota_limit: float | None,
    memory_gib: float | None,
    whole_gpu: bool,
) -> pb.JobSpec:
    shared = sm is not None or quota is not None
    if whole_gpu and shared:
        raise click.UsageError("--whole-gpu excludes --sm and --quota")
    if quota_limit is not None and not shared:
        raise click.UsageError("--quota-limit needs an MPS share (--sm and/or --quota)")
    if shared and memory_gib is None:
        raise click.UsageError("--sm/--quota need --memory-gib (the GPU memory cap of a share)")
    spec = pb.JobSpec(
        name=name or os.path.basename(command[0])[:128] or "run",
        task_key=task_key,
        priority=common_pb2.Priority(level=priority),
    )
    if memory_gib is not None:
        spec.resources.memory_bytes = round(memory_gib * GIB)
    if shared:
        spec.resources.mps.sm_percent = 100 if sm is None else sm
        spec.resources.mps.quota.request_percent = 100.0 if quota is None else quota
        spec.resources.mps.quota.limit_percent = quota_limit or 0.0
    else:
        spec.resources.whole_gpus = 1
    return spec


def _await_assignment(client: PlacementClient, job: pb.Job, timeout_s: float | None) -> pb.Job:
    """The job once ASSIGNED, printing why it waits; a timeout or Ctrl-C cancels it."""
    if job.state == pb.JOB_STATE_ASSIGNED:
        return job
    shown = [""]

    def show(update: pb.Job) -> None:
        if update.state == pb.JOB_STATE_PENDING and update.pending_reason != shown[0]:
            shown[0] = update.pending_reason
            reason = update.pending_reason or "waiting for capacity"
            click.echo(f"gpuloom run: job {update.job_id} pending: {reason}", err=True)

    try:
        return client.wait_assigned(job.job_id, timeout_s, on_update=show)
    except JobNotAssigned as error:
        raise click.ClickException(error.message) from None
    except WaitTimedOut as error:
        _cancel_quietly(client, job.job_id, f"gpuloom run: not assigned within {timeout_s:g} s")
        raise click.ClickException(f"{error.message}; cancelled it") from None
    except KeyboardInterrupt:
        _cancel_quietly(client, job.job_id, "gpuloom run: interrupted while waiting")
        click.echo(f"gpuloom run: interrupted; cancelled job {job.job_id}", err=True)
        sys.exit(130)


def _cancel_quietly(client: PlacementClient, job_id: str, reason: str) -> None:
    with contextlib.suppress(DomainError):
        client.cancel(job_id, reason)


def _run_assigned(
    client: PlacementClient, job: pb.Job, command: tuple[str, ...], shim_path: str | None
) -> int:
    """Run COMMAND in the assigned job, report how it ended, and return the exit code to use."""
    environment = _child_environment(job, shim_path)
    stdin = sys.stdin if _has_fd(sys.stdin) else subprocess.DEVNULL
    out = None if _has_fd(sys.stdout) else subprocess.PIPE
    err = None if _has_fd(sys.stderr) else subprocess.PIPE
    try:
        child = subprocess.Popen(command, env=environment, stdin=stdin, stdout=out, stderr=err)
    except OSError as error:
        code = 127 if isinstance(error, FileNotFoundError) else 126
        message = f"cannot start {command[0]!r}: {error.strerror or error}"
        click.echo(f"gpuloom run: {message}", err=True)
        _report(client, job.job_id, False, code, message)
        return code
    relays = [
        _relay(pipe, stream)
        for pipe, stream in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))
        if pipe is not None
    ]
    finished = threading.Event()
    threading.Thread(
        target=_stop_if_job_ends, args=(client, job.job_id, child, finished), daemon=True
    ).start()
    with _forwarding_signals(child):
        returncode = child.wait()
    finished.set()
    for relay in relays:
        relay.join()
    if returncode < 0:
        code = 128 - returncode
        message = f"{command[0]} was killed by {_signal_name(-returncode)}"
    else:
        code = returncode
        message = f"{command[0]} exited with code {code}"
    _report(client, job.job_id, code == 0, code, message)
    return code


def _child_environment(job: pb.Job, shim_path: str | None) -> dict[str, str]:
    assignment = job.assignment
    environment = {**os.environ, **assignment.environment}
    share = job.spec.resources
    if (
        share.WhichOneof("share") == "mps"
        and share.mps.sm_percent < 100
        and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in assignment.environment
    ):
        environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share.mps.sm_percent)
    if shim_path:
        preload = environment.get("LD_PRELOAD", "")
        if shim_path not in preload.replace(":", " ").split():
            environment["LD_PRELOAD"] = f"{shim_path}:{preload}" if preload else shim_path
    return environment


def _report(client: PlacementClient, job_id: str, succeeded: bool, code: int, message: str) -> None:
    try:
        client.report_done(job_id, succeeded, code, message)
    except DomainError as error:
        click.echo(f"gpuloom run: could not report job {job_id} done: {error.message}", err=True)


def _stop_if_job_ends(
    client: PlacementClient, job_id: str, child: subprocess.Popen, finished: threading.Event
) -> None:
    """SIGTERM the child if the job is cancelled or lost while it runs."""
    try:
        for job in client.watch(job_id):
            if finished.is_set():
                return
            if is_finished(job):
                detail = f": {job.message}" if job.message else ""
                click.echo(
                    f"gpuloom run: job {job_id} was {state_name(job.state)}{detail}; "
                    "stopping the command",
                    err=True,
                )
                with contextlib.suppress(ProcessLookupError):
                    child.terminate()
                return
    except (DomainError, ValueError):
        return  # the channel closed, or placement went away: the child runs on


@contextlib.contextmanager
def _forwarding_signals(child: subprocess.Popen) -> Iterator[None]:
    """Pass SIGINT and SIGTERM on to the child while it runs (signal handlers can only be set
    in the main thread; elsewhere nothing is forwarded). A Ctrl-C at a terminal we share with
    the child already reached it, so it is not sent twice."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and _terminal_reaches_child():
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _terminal_reaches_child() -> bool:
    """Whether we are in the foreground of our terminal, so its Ctrl-C goes to the child too."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _has_fd(stream: IO[Any] | None) -> bool:
    """Whether a stream is a real file the child can share (not one replaced in memory)."""
    try:
        return stream is not None and stream.fileno() >= 0
    except (OSError, ValueError, AttributeError):
        return False


def _relay(pipe: IO[bytes], stream: IO[Any]) -> threading.Thread:
    """Copy a child's output to a stream that has no file descriptor of its own."""

    def copy() -> None:
        binary = getattr(stream, "buffer", None)
        with pipe:
            while chunk := pipe.read1(65536):  # type: ignore[attr-defined]
                stream.flush()  # what was printed before goes first
                if binary is not None:
                    binary.write(chunk)
                    binary.flush()
                else:
                    stream.write(chunk.decode(errors="replace"))
                    stream.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ---- formatting ----


def _json(message: Message, indent: int | None = None) -> str:
    document = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(document, indent=indent)


def _echo_json_or_nothing(items: list, as_json: bool, empty: str) -> bool:
    """With --json print one object per line; with nothing to show say so. True: done."""
    if as_json:
        for item in items:
            click.echo(_json(item))
        return True
    if not items:
        click.echo(empty)
        return True
    return False


def _share(spec: pb.JobSpec) -> str:
    resources = spec.resources
    which = resources.WhichOneof("share")
    if which == "mps":
        quota = resources.mps.quota
        limit = (
            f" (limit {quota.limit_percent:g}%)"
            if quota.limit_percent and quota.limit_percent != quota.request_percent
            else ""
        )
        text = f"SM {resources.mps.sm_percent}%, quota {quota.request_percent:g}%{limit}"
    elif which == "whole_gpus":
        text = "whole GPU" if resources.whole_gpus == 1 else f"{resources.whole_gpus} GPUs"
    elif which == "mig":
        text = "a MIG instance (sized by the batch planner)"
    else:
        text = "no share"
    if resources.memory_bytes:
        text += f", memory {_memory(resources.memory_bytes)}"
    return text


def _sm_quota(spec: pb.JobSpec) -> tuple[object, object]:
    which = spec.resources.WhichOneof("share")
    if which == "mps":
        return spec.resources.mps.sm_percent, spec.resources.mps.quota.request_percent
    if which == "mig":
        return "MIG", "-"
    return 100, 100.0


def _memory(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size else "-"


def _short(text: str, width: int = MAX_REASON) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _clock(unix_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s)) if unix_s else "--:--:--"


def _where(job: pb.Job) -> str:
    gpu = job.assignment.gpu
    if not gpu.gpu_uuid:
        return "no GPU"
    where = f"GPU {gpu.gpu_uuid} on node {gpu.node}"
    if job.assignment.HasField("mig"):
        slot = job.assignment.mig
        where += (
            f", MIG {slot.size} slices at slice {slot.first_slice}, planned "
            f"{_clock(slot.planned_start_unix_s)}-{_clock(slot.planned_end_unix_s)}"
        )
    return where


def _summary(job: pb.Job) -> str:
    """One line: id, state, and where it runs or why it waits or how it ended."""
    state = state_name(job.state)
    if job.state == pb.JOB_STATE_PENDING:
        return f"job {job.job_id} pending: {job.pending_reason or 'waiting for capacity'}"
    if job.state in (pb.JOB_STATE_BINDING, pb.JOB_STATE_ASSIGNED):
        return f"job {job.job_id} {state} on {_where(job)}: {_share(job.spec)}"
    line = f"job {job.job_id} {state}"
    if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED):
        line += f" (exit code {job.exit_code})"
    return line + (f": {job.message}" if job.message else "")


def _details(job: pb.Job) -> str:
    spec = job.spec
    rows: list[tuple[str, object]] = [
        ("job", job.job_id),
        ("name", spec.name),
        ("state", state_name(job.state)),
        ("kind", kind_name(spec.kind)),
        ("priority", spec.priority.level),
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
    if job.state == pb.JOB_STATE_PENDING:
        rows.append(("pending", job.pending_reason or "-"))
    if job.HasField("assignment"):
        a = job.assignment
        rows += [
            ("gpu", _where(job)),
            ("dispatcher", a.dispatcher_address),
            ("offsets", f"quota {a.quota_offset_percent:g}%, SM {a.sm_offset_percent}%"),
            ("memory cap", _memory(a.memory_cap_bytes)),
        ]
        for key in sorted(a.environment):
            value = "(hidden)" if key.endswith("TOKEN") else a.environment[key]
            rows.append(("env", f"{key}={value}"))
    if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED):
        rows.append(("exit code", job.exit_code))
    if job.message:
        rows.append(("message", job.message))
    rows += [
        ("request id", job.request_id),
        ("submitted", _timestamp(job.submitted_at_unix_s)),
        ("updated", f"{_timestamp(job.updated_at_unix_s)} (revision {job.revision})"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def _timestamp(unix_s: float) -> str:
    if not unix_s:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))
