"""Run a MIG batch on a GPU's dispatcher as its runner (RunMigBatch, FAR paper Algorithm 3).

The dispatcher plans the batch and creates and destroys the GPU's instances on the plan's
schedule; it starts nothing. This process is the batch's runner: it starts each task it is
handed, as itself (its uid, its environment) with CUDA_VISIBLE_DEVICES set to the task's
instance, and reports how the task ended, on the same stream; the instance then goes on to its
next task or is destroyed. If this process goes away, the dispatcher hands out nothing more, and
the tasks it started die with it (they start through `gl_task_exec` where it is built).

`gpuloom mig run` is a thin caller; a program can use `MigBatchRunner` the same way.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuloom.convert.mig import task_run_from_pb, task_start_from_pb
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.errors import InvalidArgument, Unavailable
from gpuloom.domain.mig_runs import MigRunReport, ReconfigRun, TaskRun, TaskStart
from gpuloom.policies.fikit.core import FikitLibraryMissingError, library_path
from gpuloom.transport import open_channel
from gpuloom.v1 import dispatcher_pb2 as pb
from gpuloom.v1 import dispatcher_pb2_grpc as pb_grpc

NOT_FOUND = 127  # a command that cannot be started, as a shell says
STOP_GRACE_S = 5.0  # a task left running when the run breaks: SIGTERM, then SIGKILL
MAX_ARGS = 256
MAX_ARG_CHARS = 4096


@dataclass(frozen=True, slots=True)
class MigBatchTask:
    """A task of a batch: its seconds per instance size and the command the runner starts."""

    name: str
    seconds_by_size: Mapping[int, float]
    argv: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MigBatch:
    tasks: tuple[MigBatchTask, ...]
    policy: str = ""
    create_seconds: Mapping[int, float] = field(default_factory=dict)
    destroy_seconds: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MigPlanned:
    policy: str
    planned_makespan_s: float
    tasks: int


Update = MigPlanned | TaskStart | TaskRun | MigRunReport


def parse_batch(text: str, source: str) -> MigBatch:
    """A batch file: RunMigBatch's request in JSON (docs/mig.md) with each task's `argv`.
    InvalidArgument naming the file and the key for anything else."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgument(source, f"not JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(source, "must hold a JSON object")
    unknown = set(document) - {"tasks", "policy", "create_seconds", "destroy_seconds"}
    if unknown:
        raise InvalidArgument(f"{source}: {sorted(unknown)[0]}", "unknown key")
    tasks = document.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise InvalidArgument(f"{source}: tasks", "must be a non-empty list of tasks")
    parsed = []
    for index, task in enumerate(tasks):
        where = f"{source}: tasks[{index}]"
        if not isinstance(task, dict):
            raise InvalidArgument(where, "must be an object")
        extra = set(task) - {"name", "seconds_by_size", "argv"}
        if extra:
            raise InvalidArgument(f"{where}.{sorted(extra)[0]}", "unknown key")
        name = task.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{where}.name", "must be a non-empty string")
        argv = task.get("argv")
        if (
            not isinstance(argv, list)
            or not 1 <= len(argv) <= MAX_ARGS
            or not all(isinstance(a, str) and len(a) <= MAX_ARG_CHARS for a in argv)
            or not argv[0]
        ):
            raise InvalidArgument(
                f"{where}.argv",
                f"must be 1..{MAX_ARGS} strings of at most {MAX_ARG_CHARS} characters, the "
                "first not empty (the command this runner starts in the task's instance)",
            )
        seconds = _seconds(task.get("seconds_by_size"), f"{where}.seconds_by_size")
        parsed.append(MigBatchTask(name, seconds, tuple(argv)))
    policy = document.get("policy", "")
    if not isinstance(policy, str):
        raise InvalidArgument(f"{source}: policy", "must be a string")
    return MigBatch(
        tuple(parsed),
        policy,
        _seconds(document.get("create_seconds", {}), f"{source}: create_seconds", empty=True),
        _seconds(document.get("destroy_seconds", {}), f"{source}: destroy_seconds", empty=True),
    )


def _seconds(value: Any, where: str, empty: bool = False) -> dict[int, float]:
    if not isinstance(value, dict) or (not value and not empty):
        raise InvalidArgument(where, "must be an object of instance size -> seconds")
    seconds = {}
    for size, time_s in value.items():
        if not str(size).isdigit() or isinstance(time_s, bool):
            raise InvalidArgument(where, f"{size!r}: sizes are whole numbers of slices")
        if not isinstance(time_s, int | float) or not math.isfinite(time_s) or time_s < 0:
            raise InvalidArgument(where, f"size {size}: seconds must be a finite number >= 0")
        seconds[int(size)] = float(time_s)
    return seconds


def task_launcher() -> Path | None:
    """gl_task_exec beside the native library (shim/build, or the image's lib folder): a task
    started through it dies with the thread that started it. None when it is not built."""
    try:
        where = library_path().parent / "gl_task_exec"
    except FikitLibraryMissingError:
        return None
    return where if where.is_file() and os.access(where, os.X_OK) else None


def log_name(task: str) -> str:
    """The file a task's output goes to, in the runner's log directory."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in task) + ".log"


class MigBatchRunner:
    """Runs batches on the dispatcher at `address`: each task's output goes to
    `log_dir`/TASK.log; `on_update` sees every update (from the thread calling `run`)."""

    def __init__(
        self,
        address: str,
        log_dir: Path,
        on_update: Callable[[Update], None] | None = None,
        launcher: Path | None = None,
    ) -> None:
        self.address = address
        self.log_dir = log_dir
        self._on_update = on_update or (lambda _: None)
        self._launcher = launcher if launcher is not None else task_launcher()

    def run(self, batch: MigBatch) -> MigRunReport:
        """Run `batch` to its end; its report. Raises the domain error of a refused batch or a
        broken stream (every task this runner started is then stopped)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        commands = {task.name: task.argv for task in batch.tasks}
        outbox: queue.Queue[pb.MigRunInput | None] = queue.Queue()
        running: dict[str, subprocess.Popen[bytes]] = {}
        lock = threading.Lock()

        def inputs() -> Iterator[pb.MigRunInput]:
            yield pb.MigRunInput(batch=_request(batch))
            while (message := outbox.get()) is not None:
                yield message

        def start(task: TaskStart) -> None:
            code = self._start_and_wait(task, commands.get(task.task), running, lock)
            outbox.put(pb.MigRunInput(task_end=pb.MigTaskEnd(task=task.task, exit_code=code)))

        channel = open_channel(self.address)
        report: MigRunReport | None = None
        try:
            call = pb_grpc.DispatcherStub(channel).RunMigBatch(inputs())
            for message in call:
                update = _update(message)
                self._on_update(update)
                if isinstance(update, TaskStart):
                    threading.Thread(target=start, args=(update,), daemon=True).start()
                elif isinstance(update, MigRunReport):
                    report = update
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        finally:
            outbox.put(None)
            _stop(running, lock)
            channel.close()
        if report is None:
            raise Unavailable(f"the run on dispatcher {self.address} ended without its report")
        return report

    def _start_and_wait(
        self,
        task: TaskStart,
        argv: Sequence[str] | None,
        running: dict[str, subprocess.Popen[bytes]],
        lock: threading.Lock,
    ) -> int:
        with open(self.log_dir / log_name(task.task), "wb") as output:
            if argv is None:  # the dispatcher handed out a task this batch does not hold
                output.write(f"no command for task {task.task!r}\n".encode())
                return NOT_FOUND
            prefix = [] if self._launcher is None else [str(self._launcher)]
            try:
                child = subprocess.Popen(
                    [*prefix, *argv],
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": task.instance_uuid},
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            except OSError as error:
                output.write(f"cannot start {argv[0]!r}: {error}\n".encode())
                return NOT_FOUND
            with lock:
                running[task.task] = child
            code = child.wait()
            with lock:
                running.pop(task.task, None)
        return 128 - code if code < 0 else code


def _stop(running: dict[str, subprocess.Popen[bytes]], lock: threading.Lock) -> None:
    """Stop the tasks still running (the run is over or broken: their instances are going)."""
    with lock:
        children = list(running.values())
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _request(batch: MigBatch) -> pb.RunMigBatchRequest:
    return pb.RunMigBatchRequest(
        tasks=[
            pb.MigTaskSpec(name=task.name, seconds_by_size=dict(task.seconds_by_size))
            for task in batch.tasks
        ],
        policy=batch.policy,
        create_seconds=dict(batch.create_seconds),
        destroy_seconds=dict(batch.destroy_seconds),
    )


def _update(message: pb.MigRunUpdate) -> Update:
    kind = message.WhichOneof("update")
    if kind == "planned":
        planned = message.planned
        return MigPlanned(planned.policy, planned.planned_makespan_s, planned.tasks)
    if kind == "task_started":
        return task_start_from_pb(message.task_started)
    if kind == "task_ended":
        return task_run_from_pb(message.task_ended)
    report = message.report
    return MigRunReport(
        tasks=tuple(task_run_from_pb(t) for t in report.tasks),
        reconfigurations=tuple(
            ReconfigRun(r.action, r.size, r.first_slice, r.start_s, r.end_s)
            for r in report.reconfigurations
        ),
        planned_makespan_s=report.planned_makespan_s,
        makespan_s=report.makespan_s,
    )
