"""Run a MIG plan on a GPU (FAR paper, Section 3.4, Algorithm 3).

The plan's instances form a repartitioning tree. Each instance that has tasks is created,
runs its tasks one after another, and is destroyed; then its children run the same way,
concurrently, each in its own thread. An instance without tasks hands over to its children at
once. Creation and destruction go through the GPU backend, which serialises them as the driver
does (and takes the paper's Table 1 times on the simulated GPU). Every task's real start and end
are reported beside the planned ones, relative to the start of the run.

The dispatcher starts no task itself: each one is handed, in its turn, to the runner of the
batch (`TaskHandoff`: the caller of RunMigBatch, who starts it with its own identity and
environment in the instance it is handed), and the instance waits for the end it reports.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import structlog

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.mig_geometry import MigGeometry, Placement
from gpuloom.domain.mig_runs import NOT_REPORTED, MigRunReport, ReconfigRun, TaskRun, TaskStart
from gpuloom.domain.validation import check_name
from gpuloom.policies.mig.plan import (
    Assignment,
    InvalidTaskError,
    MigTask,
    Plan,
    validate_tasks,
)
from gpuloom.services.dispatcher.gpu.backend import GpuBackend

log = structlog.get_logger("gpuloom.dispatcher.mig")

# Has one task run in the instance it names: its exit code, or None when the run was stopped
# before the task started (it is then not reported).
TaskRunner = Callable[[TaskStart], int | None]


@dataclass
class _Node:
    placement: Placement
    tasks: list[Assignment] = field(default_factory=list)
    children: list[_Node] = field(default_factory=list)


def instance_tree(plan: Plan, geometry: MigGeometry) -> _Node:
    """The plan's instances as a tree under the whole GPU: each instance hangs under the
    smallest other one whose slices contain its own."""
    by_placement: dict[Placement, _Node] = {}
    for assignment in sorted(plan.assignments, key=lambda a: a.start_s):
        placement = geometry.placement(assignment.size, assignment.first_slice)
        by_placement.setdefault(placement, _Node(placement)).tasks.append(assignment)
    whole = max(geometry.placements, key=lambda p: p.span)
    root = by_placement.setdefault(whole, _Node(whole))
    for placement, node in by_placement.items():
        if node is root:
            continue
        parent = root
        for candidate, candidate_node in by_placement.items():
            if candidate is placement or candidate_node is root:
                continue
            contains = set(placement.slices) <= set(candidate.slices)
            if contains and candidate.span < parent.placement.span:
                parent = candidate_node
        parent.children.append(node)
    return root


class MigExecutor:
    """Executes plans on one MIG-enabled GPU of `backend`."""

    def __init__(
        self,
        backend: GpuBackend,
        gpu_index: int,
        geometry: MigGeometry,
        run_task: TaskRunner,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._gpu = gpu_index
        self._geometry = geometry
        self._run_task = run_task
        self._clock = clock
        self._lock = threading.Lock()

    def check_ready(self) -> None:
        """MIG is on and no instance exists: a plan starts from an empty GPU."""
        if not self._backend.gpu(self._gpu).mig_enabled:
            raise FailedPrecondition(f"MIG mode is off on GPU {self._gpu}")
        existing = self._backend.mig_instances(self._gpu)
        if existing:
            raise FailedPrecondition(
                f"GPU {self._gpu} already has {len(existing)} MIG instances; a plan starts "
                "from an empty GPU"
            )

    def execute(
        self,
        plan: Plan,
        on_task: Callable[[TaskRun], None] | None = None,
        stop: threading.Event | None = None,
    ) -> MigRunReport:
        """Run every task of `plan`; blocks until the last one ends. `on_task` is called (from
        worker threads) as each task ends. Once `stop` is set, no further instance is created
        and no further task run (the tasks left out are not in the report)."""
        stop = stop or threading.Event()
        self.check_ready()
        root = instance_tree(plan, self._geometry)
        _check_follows_tree(root)
        tasks: list[TaskRun] = []
        reconfigurations: list[ReconfigRun] = []
        errors: list[BaseException] = []
        started = self._clock()

        def elapsed() -> float:
            return self._clock() - started

        def run_node(node: _Node) -> None:
            if stop.is_set():
                return
            try:
                if node.tasks:
                    run_instance(node)
                threads = [
                    threading.Thread(target=run_node, args=(child,), daemon=True)
                    for child in node.children
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            except BaseException as error:  # reported once the whole tree is done
                with self._lock:
                    errors.append(error)

        def run_instance(node: _Node) -> None:
            placement = node.placement
            began = elapsed()
            instance = self._backend.create_mig_instance(
                self._gpu, placement.size, placement.first_slice
            )
            record(ReconfigRun("create", placement.size, placement.first_slice, began, elapsed()))
            try:
                for assignment in node.tasks:
                    started = TaskStart(
                        task=assignment.task,
                        size=placement.size,
                        first_slice=placement.first_slice,
                        instance_uuid=instance.uuid,
                        planned_start_s=assignment.start_s,
                        planned_end_s=assignment.end_s,
                        start_s=elapsed(),
                    )
                    code = self._run_task(started)
                    if code is None:
                        break  # stopped: the rest of this instance's tasks are not run
                    run = TaskRun(**asdict(started), end_s=elapsed(), exit_code=code)
                    with self._lock:
                        tasks.append(run)
                    if on_task is not None:
                        on_task(run)
            finally:
                began = elapsed()
                self._backend.destroy_mig_instance(self._gpu, instance.uuid)
                record(
                    ReconfigRun("destroy", placement.size, placement.first_slice, began, elapsed())
                )

        def record(run: ReconfigRun) -> None:
            with self._lock:
                reconfigurations.append(run)

        log.info("mig plan started", gpu=self._gpu, tasks=len(plan.assignments))
        run_node(root)
        if errors:
            raise errors[0]
        tasks.sort(key=lambda t: t.start_s)
        report = MigRunReport(
            tasks=tuple(tasks),
            reconfigurations=tuple(sorted(reconfigurations, key=lambda r: r.start_s)),
            planned_makespan_s=plan.makespan_s,
            makespan_s=max((t.end_s for t in tasks), default=0.0),
        )
        log.info(
            "mig plan finished",
            gpu=self._gpu,
            planned_makespan_s=round(report.planned_makespan_s, 3),
            makespan_s=round(report.makespan_s, 3),
        )
        return report


def _check_follows_tree(node: _Node, parent_end: float = 0.0) -> None:
    """Algorithm 3 runs an instance's children after the instance is gone; a plan that uses a
    child before its parent (a merge, as MISO-like plans do) cannot be run this way."""
    starts = [task.start_s for task in node.tasks]
    if starts and min(starts) < parent_end - 1e-9:
        raise InvalidArgument(
            "policy",
            f"the plan uses {node.placement.label} before its parent instance is done; only "
            "plans that follow the repartitioning tree (far, far-paper, fixpart) can be run",
        )
    end = max((task.end_s for task in node.tasks), default=parent_end)
    for child in node.children:
        _check_follows_tree(child, max(end, parent_end))


@dataclass(frozen=True, slots=True)
class MigBatchTask:
    """A task of a batch: its times per instance size (its runner holds its command)."""

    name: str
    seconds_by_size: Mapping[int, float]


MAX_BATCH_TASKS = 1000


def validate_batch(tasks: Sequence[MigBatchTask], geometry: MigGeometry) -> list[MigTask]:
    """Check a batch from outside; the MigTasks to plan."""
    if not tasks:
        raise InvalidArgument("tasks", "a batch needs at least one task")
    if len(tasks) > MAX_BATCH_TASKS:
        raise InvalidArgument("tasks", f"at most {MAX_BATCH_TASKS} tasks per batch")
    seen: set[str] = set()
    for index, task in enumerate(tasks):
        field_name = f"tasks[{index}]"
        check_name(f"{field_name}.name", task.name, 256)
        if task.name in seen:
            raise InvalidArgument(f"{field_name}.name", f"{task.name!r} appears twice")
        seen.add(task.name)
        for size, seconds in task.seconds_by_size.items():
            if size not in geometry.sizes:
                sizes = ", ".join(map(str, geometry.sizes))
                raise InvalidArgument(
                    f"{field_name}.seconds_by_size",
                    f"{geometry.name} has instance sizes {sizes}, not {size}",
                )
            if not (math.isfinite(seconds) and seconds > 0):
                raise InvalidArgument(
                    f"{field_name}.seconds_by_size", f"size {size}: must be > 0 s, got {seconds}"
                )
    planned = [MigTask(t.name, dict(t.seconds_by_size)) for t in tasks]
    try:
        validate_tasks(planned, geometry)
    except InvalidTaskError as error:
        raise InvalidArgument("tasks", str(error)) from None
    return planned


class TaskHandoff:
    """The `TaskRunner` of a batch whose tasks its caller runs: `run` (an executor thread)
    announces the task and waits until `end` (the caller's report) says how it ended. After
    `stop` (the caller hung up, or stopped sending) nothing more is announced, and a task that
    was started counts as ended with NOT_REPORTED."""

    def __init__(self, announce: Callable[[TaskStart], None]) -> None:
        self._announce = announce
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[threading.Event, list[int]]] = {}
        self.stopped = threading.Event()

    def run(self, start: TaskStart) -> int | None:
        done, code = threading.Event(), [NOT_REPORTED]
        with self._lock:
            if self.stopped.is_set():
                return None
            self._waiting[start.task] = (done, code)
        self._announce(start)
        done.wait()
        return code[0]

    def end(self, task: str, exit_code: int) -> None:
        """The caller's report; InvalidArgument for a task that is not waiting for one."""
        with self._lock:
            waiting = self._waiting.pop(task, None)
        if waiting is None:
            raise InvalidArgument(
                "task_end.task", f"{task[:256]!r} is not a task of this batch that started and runs"
            )
        done, code = waiting
        code[0] = exit_code
        done.set()

    def stop(self) -> None:
        with self._lock:
            self.stopped.set()
            waiting, self._waiting = self._waiting, {}
        for done, _ in waiting.values():
            done.set()
