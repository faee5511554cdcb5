"""Batches across a fleet of MIG GPUs: collect tasks into batches, split each batch over the
GPUs, plan every GPU's share with FAR and concatenate it after that GPU's earlier batches
(Section 4 of the FAR paper, one repartitioning tree per GPU).

Pure: tasks, GPUs and times in, decisions out. The caller owns the clock (every method that
depends on time takes `now`) and runs the plans; nothing here sleeps, reads or writes.

Times in a `FleetPlan` are of two kinds. A `GpuPlan.plan` is an ordinary `Plan` (time 0 is the
start of the first batch it holds, every instance created by the plan itself) that
`verify_plan(gpu_plan.plan, gpu_plan.tasks, geometry)` checks; `GpuPlan.now_s` says which plan
time is the moment `MigFleetPlanner.plan` was called, so a plan time t is t - now_s seconds
from then. `end_s` and `FleetPlan.makespan_s` are already seconds from then.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig.far import BatchLayout, ConcatMode, FarOptions, concatenate, far_layout
from gpuloom.policies.mig.plan import Assignment, InvalidTaskError, MigTask, Plan

DEFAULT_OPTIONS = FarOptions()
CONCAT_MODES: tuple[ConcatMode, ...] = ("trivial", "reverse", "reverse+refine")


class BatchCollector:
    """Tasks wait here until they form a batch: when the oldest has waited `window_s`
    seconds, or as soon as `max_tasks` are waiting. A batch holds at most `max_tasks` tasks,
    the oldest first; the rest keep waiting (their own arrival times count for the next one).
    Task names are unique among the waiting tasks. A task added with an earlier `now` than
    tasks already waiting (one put back) takes its place by arrival time."""

    def __init__(self, window_s: float, max_tasks: int) -> None:
        if (
            isinstance(window_s, bool)
            or not isinstance(window_s, int | float)
            or not math.isfinite(window_s)
            or window_s <= 0
        ):
            raise ValueError(f"window_s must be a finite number of seconds > 0, got {window_s!r}")
        if isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1:
            raise ValueError(f"max_tasks must be an integer >= 1, got {max_tasks!r}")
        self.window_s = float(window_s)
        self.max_tasks = max_tasks
        self._tasks: list[tuple[float, MigTask]] = []
        self._names: set[str] = set()

    @property
    def waiting(self) -> int:
        return len(self._tasks)

    def add(self, task: MigTask, now: float) -> None:
        _check_now(now)
        if task.name in self._names:
            raise ValueError(f"task {task.name!r} is already waiting; names must be unique")
        bisect.insort(self._tasks, (now, task), key=lambda entry: entry[0])
        self._names.add(task.name)

    def remove(self, name: str) -> bool:
        """Take a waiting task out (it will not be in any batch); False when none waits
        under that name."""
        if name not in self._names:
            return False
        self._tasks = [entry for entry in self._tasks if entry[1].name != name]
        self._names.discard(name)
        return True

    def due(self, now: float) -> bool:
        _check_now(now)
        if not self._tasks:
            return False
        return len(self._tasks) >= self.max_tasks or now >= self._deadline()

    def take(self, now: float) -> list[MigTask]:
        """The batch, in arrival order, when one is due; else an empty list."""
        if not self.due(now):
            return []
        batch, self._tasks = self._tasks[: self.max_tasks], self._tasks[self.max_tasks :]
        for _, task in batch:
            self._names.discard(task.name)
        return [task for _, task in batch]

    def next_due_s(self, now: float) -> float | None:
        """Seconds until a batch is due (0.0: now); None when no task is waiting."""
        _check_now(now)
        if not self._tasks:
            return None
        if len(self._tasks) >= self.max_tasks:
            return 0.0
        return max(self._deadline() - now, 0.0)

    def _deadline(self) -> float:
        return self._tasks[0][0] + self.window_s


def _check_now(now: float) -> None:
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite time in seconds, got {now!r}")


@dataclass(frozen=True)
class MigGpu:
    """One GPU of the fleet. `busy_until_s`: seconds from now until its earlier work is done
    and its instances are gone (0 or less: free now)."""

    gpu_id: str
    geometry: MigGeometry
    busy_until_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.gpu_id:
            raise ValueError("gpu_id must not be empty")
        if not math.isfinite(self.busy_until_s):
            raise ValueError(
                f"busy_until_s of {self.gpu_id} must be a finite number of seconds, "
                f"got {self.busy_until_s!r}"
            )


@dataclass(frozen=True)
class GpuPlan:
    """What one GPU runs. `plan` indexes `tasks` (each restricted to the GPU's instance sizes):
    first the earlier batches it is concatenated with, kept as planned before, then this
    batch's tasks from `first_new` on; `batch_indices[j]` is the position in the planned batch
    of `tasks[first_new + j]`. Plan time `now_s` is the moment of planning (negative when the
    plan starts later, after the GPU's earlier work)."""

    gpu_id: str
    tasks: tuple[MigTask, ...]
    plan: Plan
    first_new: int
    batch_indices: tuple[int, ...]
    now_s: float

    @property
    def concatenated(self) -> bool:
        """True when the plan continues earlier batches on this GPU."""
        return self.first_new > 0

    @property
    def new_assignments(self) -> tuple[Assignment, ...]:
        return tuple(a for a in self.plan.assignments if a.task_index >= self.first_new)

    @property
    def end_s(self) -> float:
        """Seconds from the moment of planning until this batch's last task here ends."""
        return max(a.end_s for a in self.new_assignments) - self.now_s


# Plans one GPU's share: (GPU number, batch indices) -> (its plan, the share's FAR layout).
_Evaluate = Callable[[int, tuple[int, ...]], tuple[GpuPlan, BatchLayout]]


@dataclass(frozen=True)
class FleetPlan:
    """One batch over the fleet. `plans` has the GPUs that got tasks; `task_gpu[i]` is the
    GPU of the batch's task i. `makespan_s`: seconds from planning until the batch's last task
    ends. `lower_bound_s`: every task at its least work (slices x seconds), spread over all
    the fleet's slices. `moves`: tasks moved between GPUs after the first split."""

    plans: Mapping[str, GpuPlan]
    task_gpu: tuple[str, ...]
    makespan_s: float
    lower_bound_s: float
    moves: int = 0


@dataclass(frozen=True)
class _History:
    """The batches a GPU's current plan holds, oldest first, and that plan."""

    geometry: MigGeometry
    layouts: tuple[BatchLayout, ...]
    plan: Plan

    @property
    def tasks(self) -> tuple[MigTask, ...]:
        return tuple(task for layout in self.layouts for task in layout.tasks)


@dataclass
class _Batch:
    """The batch being planned, with what the split needs per task and GPU."""

    tasks: list[MigTask]
    gpus: list[MigGpu]
    runnable: list[list[int]] = field(default_factory=list)  # GPU numbers, per task
    work: list[dict[int, float]] = field(default_factory=list)  # least slice-seconds per GPU
    restricted: dict[tuple[int, int], MigTask] = field(default_factory=dict)

    def task_on(self, task: int, gpu: int) -> MigTask:
        """The task with only the times of the GPU's instance sizes."""
        key = (task, gpu)
        if key not in self.restricted:
            sizes = self.gpus[gpu].geometry.sizes
            original = self.tasks[task]
            times = {s: t for s, t in original.times.items() if s in sizes}
            self.restricted[key] = MigTask(original.name, times)
        return self.restricted[key]


class MigFleetPlanner:
    """Splits a batch over MIG GPUs and plans each share with FAR (`far_layout`), concatenated
    after the batches planned before on the same GPU (`concatenate`, `concat_mode`).

    The split: tasks in descending order of least work each go to the GPU that can run them
    (some size with a finite time) and would finish its estimated load
    ((busy_until_s x slices + work) / slices) first. Then up to `rebalance_rounds` times the
    GPU whose batch ends last gives a task to the one that is free first, kept only if the
    later of the two ends earlier, every candidate planned with FAR (the first
    `rebalance_candidates` tasks closest to half the gap are tried).

    Concatenation: `concatenate` starts its first batch on an empty GPU and runs every other
    batch bottom-up, so a batch can only be replayed as it was planned together with all the
    batches it followed. Each GPU therefore keeps the layouts of the batches of its current
    plan (at most `max_chain`) and re-plans them with the new batch: the earlier batches come
    out exactly as before, the new one fills their idle slices. The concatenated plan is used
    only when none of the new batch's tasks or reconfigurations starts before the moment of
    planning and it ends no later than a fresh plan started after busy_until_s; otherwise (and
    when the GPU is idle, or the chain is full) the GPU starts a fresh plan of this batch
    alone.
    """

    def __init__(
        self,
        options: FarOptions = DEFAULT_OPTIONS,
        concat_mode: ConcatMode = "reverse+refine",
        *,
        max_chain: int = 8,
        rebalance_rounds: int = 4,
        rebalance_candidates: int = 3,
    ) -> None:
        if concat_mode not in CONCAT_MODES:
            raise ValueError(f"concat_mode must be one of {CONCAT_MODES}, got {concat_mode!r}")
        if max_chain < 1:
            raise ValueError(f"max_chain must be >= 1, got {max_chain}")
        if rebalance_rounds < 0:
            raise ValueError(f"rebalance_rounds must be >= 0, got {rebalance_rounds}")
        if rebalance_candidates < 1:
            raise ValueError(f"rebalance_candidates must be >= 1, got {rebalance_candidates}")
        self.options = options
        self.concat_mode = concat_mode
        self.max_chain = max_chain
        self.rebalance_rounds = rebalance_rounds
        self.rebalance_candidates = rebalance_candidates
        self._history: dict[str, _History] = {}

    def forget(self, gpu_id: str) -> None:
        """Drop a GPU's earlier batches: its next batch starts a fresh plan."""
        self._history.pop(gpu_id, None)

    def kept_batches(self, gpu_id: str) -> int:
        """How many batches the GPU's current plan holds (0: none kept)."""
        history = self._history.get(gpu_id)
        return len(history.layouts) if history else 0

    def plan(
        self,
        batch: Sequence[MigTask],
        gpus: Sequence[MigGpu],
        only_on: Sequence[Collection[str] | None] | None = None,
    ) -> FleetPlan:
        """`only_on[i]`, when given and not None, holds the ids of the GPUs task i may go to
        (e.g. those of the model it asks for); the others are never considered for it."""
        state = _prepare(batch, gpus, only_on)
        layouts: dict[tuple[int, tuple[int, ...]], BatchLayout] = {}

        def evaluate(gpu: int, share: tuple[int, ...]) -> tuple[GpuPlan, BatchLayout]:
            key = (gpu, share)
            if key not in layouts:
                tasks = [state.task_on(i, gpu) for i in share]
                layouts[key] = far_layout(tasks, state.gpus[gpu].geometry, self.options)
            return self._gpu_plan(state.gpus[gpu], layouts[key], share), layouts[key]

        shares = _split(state)
        plans = {g: evaluate(g, share) for g, share in enumerate(shares) if share}
        moves = 0
        for _ in range(self.rebalance_rounds):
            moved = self._rebalance(state, shares, plans, evaluate)
            if not moved:
                break
            moves += 1

        task_gpu = [""] * len(state.tasks)
        result: dict[str, GpuPlan] = {}
        for g, (gpu_plan, layout) in sorted(plans.items()):
            gpu = state.gpus[g]
            result[gpu.gpu_id] = gpu_plan
            for i in gpu_plan.batch_indices:
                task_gpu[i] = gpu.gpu_id
            history = self._history.get(gpu.gpu_id)
            kept = history.layouts if gpu_plan.concatenated and history else ()
            self._history[gpu.gpu_id] = _History(gpu.geometry, (*kept, layout), gpu_plan.plan)
        return FleetPlan(
            plans=MappingProxyType(result),
            task_gpu=tuple(task_gpu),
            makespan_s=max(p.end_s for p in result.values()),
            lower_bound_s=_lower_bound(state),
            moves=moves,
        )

    def _gpu_plan(self, gpu: MigGpu, layout: BatchLayout, share: tuple[int, ...]) -> GpuPlan:
        geometry = gpu.geometry
        busy = max(gpu.busy_until_s, 0.0)
        fresh = GpuPlan(
            gpu_id=gpu.gpu_id,
            tasks=layout.tasks,
            plan=self._concatenate([layout], geometry),
            first_new=0,
            batch_indices=share,
            now_s=-busy,
        )
        history = self._history.get(gpu.gpu_id)
        # An idle GPU's earlier batches are over: nothing of them can be overlapped.
        if (
            history is None
            or history.geometry != geometry
            or busy <= 0
            or len(history.layouts) >= self.max_chain
        ):
            return fresh
        joined = GpuPlan(
            gpu_id=gpu.gpu_id,
            tasks=(*history.tasks, *layout.tasks),
            plan=self._concatenate([*history.layouts, layout], geometry),
            first_new=len(history.tasks),
            batch_indices=share,
            now_s=history.plan.makespan_s - busy,
        )
        if _starts_before_now(joined, history.plan) or joined.end_s > fresh.end_s:
            return fresh
        return joined

    def _concatenate(self, layouts: Sequence[BatchLayout], geometry: MigGeometry) -> Plan:
        return concatenate(
            layouts,
            geometry,
            self.concat_mode,
            max_refine_evaluations=self.options.max_refine_evaluations,
            rules=self.options.search,
        )

    def _rebalance(
        self,
        state: _Batch,
        shares: list[tuple[int, ...]],
        plans: dict[int, tuple[GpuPlan, BatchLayout]],
        evaluate: _Evaluate,
    ) -> bool:
        """Move one task from the GPU that ends last to the one free first, if the later of
        the two then ends earlier. True when a task moved."""

        def end(g: int) -> float:
            return plans[g][0].end_s if g in plans else max(state.gpus[g].busy_until_s, 0.0)

        worst = max(plans, key=lambda g: (end(g), -g))
        others = [g for g in range(len(state.gpus)) if g != worst]
        if not others:
            return False
        target = min(others, key=lambda g: (end(g), g))
        gap = end(worst) - end(target)
        slices = state.gpus[target].geometry.slice_count
        movable = [i for i in shares[worst] if target in state.runnable[i]]
        movable.sort(key=lambda i: (abs(state.work[i][target] / slices - gap / 2), i))
        before = end(worst)
        for i in movable[: self.rebalance_candidates]:
            left = tuple(t for t in shares[worst] if t != i)
            right = tuple(sorted((*shares[target], i)))
            candidate = {target: evaluate(target, right)}
            if left:
                candidate[worst] = evaluate(worst, left)
            after = max(
                candidate[target][0].end_s,
                candidate[worst][0].end_s if left else 0.0,
            )
            if after < before - 1e-9 * max(before, 1.0):
                shares[worst], shares[target] = left, right
                plans.update(candidate)
                if not left:
                    del plans[worst]
                return True
        return False


def _prepare(
    batch: Sequence[MigTask],
    gpus: Sequence[MigGpu],
    only_on: Sequence[Collection[str] | None] | None = None,
) -> _Batch:
    tasks = list(batch)
    if not tasks:
        raise ValueError("the batch is empty")
    if only_on is not None and len(only_on) != len(tasks):
        raise ValueError(f"only_on has {len(only_on)} entries for {len(tasks)} tasks")
    fleet = list(gpus)
    if not fleet:
        raise ValueError("no GPUs to plan on")
    ids = [gpu.gpu_id for gpu in fleet]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise ValueError(f"GPU {duplicate!r} is listed twice")
    state = _Batch(tasks, fleet)
    for index, task in enumerate(tasks):
        for size, seconds in task.times.items():
            if math.isnan(seconds) or seconds <= 0:
                raise InvalidTaskError(
                    f"task {index} ({task.name}): time on size {size} must be a positive "
                    f"number of seconds or inf, got {seconds}"
                )
        work = {}
        allowed = None if only_on is None else only_on[index]
        for g, gpu in enumerate(fleet):
            if allowed is not None and gpu.gpu_id not in allowed:
                continue
            least = min(size * task.time(size) for size in gpu.geometry.sizes)
            if math.isfinite(least):
                work[g] = least
        if not work:
            among = "the fleet" if allowed is None else f"{sorted(allowed)}"
            raise InvalidTaskError(
                f"task {index} ({task.name}) cannot run on any GPU of {among}: it has times "
                f"for sizes {sorted(s for s, t in task.times.items() if math.isfinite(t))}"
            )
        state.runnable.append(sorted(work))
        state.work.append(work)
    return state


def _split(state: _Batch) -> list[tuple[int, ...]]:
    """LPT by least work: the task with the most work first, each onto the GPU that would end
    its estimated load earliest."""
    slices = [gpu.geometry.slice_count for gpu in state.gpus]
    load = [max(gpu.busy_until_s, 0.0) * s for gpu, s in zip(state.gpus, slices, strict=True)]
    shares: list[list[int]] = [[] for _ in state.gpus]
    order = sorted(range(len(state.tasks)), key=lambda i: (-min(state.work[i].values()), i))
    for i in order:
        work = state.work[i]
        best = min(state.runnable[i], key=lambda g: ((load[g] + work[g]) / slices[g], g))
        load[best] += work[best]
        shares[best].append(i)
    return [tuple(sorted(share)) for share in shares]


def _lower_bound(state: _Batch) -> float:
    total = sum(gpu.geometry.slice_count for gpu in state.gpus)
    return sum(min(work.values()) for work in state.work) / total


def _starts_before_now(joined: GpuPlan, previous: Plan) -> bool:
    """Whether a task or reconfiguration the new batch added starts before the moment of
    planning (the earlier batches' own come out of `concatenate` unchanged)."""
    added = Counter(joined.plan.reconfigurations) - Counter(previous.reconfigurations)
    starts = [a.start_s for a in joined.new_assignments]
    starts += [r.start_s for r in added.elements()]
    horizon = max(joined.plan.makespan_s, 1.0)
    return min(starts) < joined.now_s - 1e-9 * horizon
