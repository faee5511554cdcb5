"""FAR (Family of Allocations and Repartitioning), Villarrubia et al., JPDC 2025.

Phase 1 builds the family of allocations (how many slices each task gets); phase 2 list-
schedules each allocation on the repartitioning tree (LPT order, the first instance to free
up takes the next task, reconfigurations one at a time); phase 3 refines the best schedule by
moving and swapping tasks. Batches are concatenated by running every other batch's tree in
reverse and moving/swapping its tasks to overlap the previous batch.

Speed: phase 2 runs the allocations in ascending order of their lower bound
max(area / slices, longest task) and stops at the first one whose bound cannot beat the best
makespan found (with `patience`, also after a run of allocations that did not beat it), so a
1,000-task batch needs a handful of phase-2 runs, not thousands.

`FarOptions.paper()` is the published algorithm; the defaults add what docs/mig.md measures:
more families of allocations, refinement of the three best schedules, moves between
instances of different sizes, and 4g@0 instead of 3g@0 when a task is no slower there.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.policies.mig.plan import (
    Assignment,
    MigTask,
    Plan,
    Reconfiguration,
    validate_tasks,
)
from gpuloom.policies.mig.refine import NodeTasks, SearchRules, SearchSpace, improve
from gpuloom.policies.mig.timeline import EMPTY_GPU, GpuState, Timeline, simulate

ConcatMode = Literal["trivial", "reverse", "reverse+refine"]
RANDOM_ALLOCATION_BUDGET = 2000
# How sharply random allocations prefer sizes close to a task's least work.
RANDOM_ALLOCATION_SHARPNESS = 4.0


@dataclass(frozen=True)
class FarOptions:
    """Knobs of FAR. `FarOptions.paper()` is the algorithm exactly as published; the
    defaults add the measured extras documented in docs/mig.md."""

    refine: bool = True
    # Phase 3 runs on this many of the best phase-2 schedules; the paper refines only one.
    refine_top: int = 3
    # Besides the paper's family (every task starts at its least-work size), also grow
    # families whose tasks start at their least-work size no larger than each instance size.
    capped_families: bool = True
    # How widely phase 3 (and concatenation) search; SearchRules.paper() is Algorithm 2.
    search: SearchRules = field(default_factory=SearchRules)
    # Run a task placed on the 3-slice instance at slice 0 on the 4-slice instance over the
    # same slices instead when it is no slower there (slice 3 is blocked either way).
    use_wider_instance: bool = True
    # Also list-schedule this many random allocations (fixed seed, sizes drawn with weight
    # exp(-4 (work / least work - 1))), fewer on big batches: at most
    # RANDOM_ALLOCATION_BUDGET / tasks of them, since each costs a phase-2 run.
    random_allocations: int = 32
    # At most this many allocations go through phase 2 (lowest lower bound first)...
    max_allocations: int = 512
    # ... and phase 2 stops after this many runs in a row that did not beat the best (None:
    # run every allocation whose lower bound could still win, as the paper does).
    patience: int | None = 8
    # Each refinement stops after timing this many candidate changes.
    max_refine_evaluations: int = 300

    @classmethod
    def paper(cls) -> FarOptions:
        return cls(
            refine_top=1,
            capped_families=False,
            search=SearchRules.paper(),
            use_wider_instance=False,
            random_allocations=0,
            patience=None,
        )


@dataclass(frozen=True)
class BatchLayout:
    """FAR's answer for one batch before timing: the tasks each tree node runs, by index."""

    tasks: tuple[MigTask, ...]
    node_tasks: tuple[tuple[int, ...], ...]
    phase2_makespan_s: float
    allocations: int
    allocations_run: int
    moves: int
    swaps: int


@dataclass(frozen=True)
class FarPlanner:
    """The FAR policy behind the MigPlanner protocol."""

    options: FarOptions = FarOptions()
    name: str = "far"

    def plan(self, tasks: Sequence[MigTask], gpu: MigGeometry) -> Plan:
        layout = far_layout(tasks, gpu, self.options)
        plan = concatenate([layout], gpu, policy=self.name)
        return Plan(
            gpu=plan.gpu,
            policy=plan.policy,
            assignments=plan.assignments,
            reconfigurations=plan.reconfigurations,
            stats={
                "allocations": layout.allocations,
                "allocations_run": layout.allocations_run,
                "phase2_makespan_s": layout.phase2_makespan_s,
                "moves": layout.moves,
                "swaps": layout.swaps,
            },
        )


class _Problem:
    """The batch as arrays: run time per task and size, and per-size LPT orders."""

    def __init__(self, tasks: Sequence[MigTask], gpu: MigGeometry) -> None:
        self.gpu = gpu
        self.times = np.array([[t.time(s) for s in gpu.sizes] for t in tasks], dtype=float)
        self.work = self.times * np.array(gpu.sizes)
        self.size_index = {size: j for j, size in enumerate(gpu.sizes)}
        self.durations = [self.times[:, j].tolist() for j in range(len(gpu.sizes))]
        # Longest first; ties keep input order.
        self.lpt_order = [
            np.argsort(-self.times[:, j], kind="stable") for j in range(len(gpu.sizes))
        ]
        tree = gpu.tree
        self.node_size = [self.size_index[n.placement.size] for n in tree]
        # Each task's time on each tree node (lists shared between nodes of one size).
        self.node_durations = [self.durations[j] for j in self.node_size]
        self.node_create = [gpu.create_s(n.placement.size) for n in tree]
        self.node_destroy = [gpu.destroy_s(n.placement.size) for n in tree]
        self.node_children = [n.children for n in tree]
        self.placements = [n.placement for n in tree]
        # The parent covering exactly the same slices (4g@0 over 3g@0), else -1.
        self.wider_parent = [
            -1
            if n.parent is None or tree[n.parent].placement.slices != n.placement.slices
            else n.parent
            for n in tree
        ]


@dataclass
class _Family:
    """Phase 1: allocation k is the first one with its first k size increases applied."""

    first: np.ndarray  # size index per task
    increased_task: list[int]
    increased_to: list[int]
    lower_bound: list[float]

    def allocation(self, k: int) -> np.ndarray:
        alloc = self.first.copy()
        # Sizes only grow along the family, so the largest index seen per task is its size.
        np.maximum.at(alloc, self.increased_task[:k], self.increased_to[:k])
        return alloc


def _first_allocations(problem: _Problem, capped: bool) -> list[np.ndarray]:
    """Where families start: every task at its least-work size, smaller on ties (the paper);
    with `capped`, also at its least-work size no larger than each instance size."""
    work = problem.work
    starts = [np.argmin(work, axis=1)]
    if capped:
        for cap in range(work.shape[1] - 1):
            limited = work.copy()
            limited[:, cap + 1 :] = np.inf
            start = np.where(
                np.isfinite(limited.min(axis=1)), np.argmin(limited, axis=1), starts[0]
            )
            if not any(np.array_equal(start, seen) for seen in starts):
                starts.append(start)
    return starts


def _random_allocations(problem: _Problem, count: int) -> list[np.ndarray]:
    """Allocations drawn around the least-work sizes, from a fixed seed (same input, same
    plan)."""
    rng = np.random.default_rng(0)
    relative = problem.work / problem.work.min(axis=1, keepdims=True)
    weights = np.exp(-RANDOM_ALLOCATION_SHARPNESS * (relative - 1))
    cumulative = (weights / weights.sum(axis=1, keepdims=True)).cumsum(axis=1)
    least_work = np.argmin(problem.work, axis=1)
    draws = []
    for _ in range(count):
        alloc = (rng.random((len(relative), 1)) < cumulative).argmax(axis=1)
        # Rounding can land on a size the task cannot use: fall back to its least work.
        unusable = np.isinf(problem.times[np.arange(len(alloc)), alloc])
        draws.append(np.where(unusable, least_work, alloc))
    return draws


def _allocation_family(problem: _Problem, first: np.ndarray, stop_area: float) -> _Family:
    """The family of allocations (Section 3.1): from `first`, repeatedly give the longest
    task its least-work larger size, until the longest task cannot grow. Generation stops
    early once area / slices reaches `stop_area`: no later allocation can then beat it."""
    work, times = problem.work, problem.times
    n, k = work.shape
    slices = problem.gpu.slice_count
    next_size = np.full((n, k), -1, dtype=int)
    for j in range(k - 1):
        larger = work[:, j + 1 :]
        best = np.argmin(larger, axis=1)
        finite = np.isfinite(larger[np.arange(n), best])
        next_size[:, j] = np.where(finite, best + j + 1, -1)
    next_of = next_size.tolist()
    time_of = times.tolist()
    work_of = work.tolist()
    current = first.tolist()
    heap = [(-time_of[i][current[i]], i) for i in range(n)]
    heapq.heapify(heap)
    area = float(work[np.arange(n), first].sum())
    family = _Family(first, [], [], [max(area / slices, -heap[0][0])])
    while area / slices < stop_area:
        _, i = heap[0]
        grown = next_of[i][current[i]]
        if grown < 0:
            break
        area += work_of[i][grown] - work_of[i][current[i]]
        current[i] = grown
        heapq.heapreplace(heap, (-time_of[i][grown], i))
        family.increased_task.append(i)
        family.increased_to.append(grown)
        family.lower_bound.append(max(area / slices, -heap[0][0]))
    return family


def _list_schedule(problem: _Problem, alloc: np.ndarray) -> list[list[int]]:
    """Phase 2 (Algorithm 1): LPT list scheduling on the repartitioning tree.

    The instance that frees up first takes the longest task left for its size; with none
    left it is destroyed (if it ran tasks) and split into its children. Creations and
    destructions are sequential (`reconfig_end`). Returns the tasks of each tree node.
    """
    groups: dict[int, list[int]] = {}
    for j, order in enumerate(problem.lpt_order):
        group = order[alloc[order] == j]
        if len(group):
            groups[j] = group.tolist()
    taken = dict.fromkeys(groups, 0)
    left = len(alloc)
    node_size, durations = problem.node_size, problem.durations
    node_tasks: list[list[int]] = [[] for _ in node_size]
    heap: list[tuple[float, int]] = [(0.0, 0)]
    reconfig_end = 0.0
    while heap:
        end, node = heapq.heappop(heap)
        j = node_size[node]
        group = groups.get(j)
        if group is not None and taken[j] < len(group):
            tasks = node_tasks[node]
            if not tasks:
                reconfig_end = max(reconfig_end, end) + problem.node_create[node]
                end = reconfig_end
            times = durations[j]
            next_free = heap[0][0] if heap else math.inf
            i = taken[j]
            # Keep feeding this instance while it stays the first to free up.
            while True:
                task = group[i]
                tasks.append(task)
                end += times[task]
                i += 1
                if i == len(group) or end >= next_free:
                    break
            left -= i - taken[j]
            taken[j] = i
            heapq.heappush(heap, (end, node))
        elif left:
            if node_tasks[node]:
                reconfig_end = max(reconfig_end, end) + problem.node_destroy[node]
            for child in problem.node_children[node]:
                heapq.heappush(heap, (end, child))
    return node_tasks


def _use_wider_instances(problem: _Problem, node_tasks: list[list[int]]) -> None:
    """Move tasks to the parent over the same slices when they run no slower there: the
    3-slice instance at slice 0 blocks slice 3 anyway, and skipping it can save the
    reconfiguration 4g -> 3g."""
    durations, node_size = problem.durations, problem.node_size
    for node, parent in enumerate(problem.wider_parent):
        if parent < 0:
            continue
        here, wider = durations[node_size[node]], durations[node_size[parent]]
        lifted = [t for t in node_tasks[node] if wider[t] <= here[t]]
        if lifted:
            node_tasks[parent].extend(lifted)
            node_tasks[node] = [t for t in node_tasks[node] if wider[t] > here[t]]


def _node_lists(problem: _Problem, node_tasks: Sequence[Sequence[int]]) -> list[NodeTasks]:
    durations = problem.node_durations
    return [sorted((durations[node][t], t) for t in tasks) for node, tasks in enumerate(node_tasks)]


def _timed(
    problem: _Problem,
    loads: Sequence[float | None],
    reverse: bool,
    state: GpuState = EMPTY_GPU,
    release_s: float = 0.0,
) -> Timeline:
    """Time a batch laid out on the tree; node i's load is loads[i] (tree order)."""
    order = _execution_order(len(loads), reverse)
    return simulate(
        [problem.placements[i] for i in order],
        [loads[i] for i in order],
        problem.gpu,
        state,
        release_s,
    )


def _execution_order(node_count: int, reverse: bool) -> list[int]:
    # The tree is numbered breadth-first, so parents come first; reversed, leaves come first.
    order = list(range(node_count))
    return order[::-1] if reverse else order


def _search_space(problem: _Problem, reverse: bool, any_size: bool) -> SearchSpace:
    """Tasks move between instances of the same size (the paper) or, with `any_size`, to
    any other instance they can run on, at that instance's speed."""
    placements = problem.placements
    order = _execution_order(len(placements), reverse)
    return SearchSpace(
        node_slices=[p.slices for p in placements],
        node_times=problem.node_durations,
        alternatives=[
            [
                j
                for j, other in enumerate(placements)
                if j != i and (any_size or other.size == p.size)
            ]
            for i, p in enumerate(placements)
        ],
        chains=[
            [node for node in reversed(order) if s in placements[node].slices]
            for s in range(problem.gpu.slice_count)
        ],
    )


def _loads(nodes: Sequence[NodeTasks]) -> list[float | None]:
    return [sum(seconds for seconds, _ in tasks) if tasks else None for tasks in nodes]


class _Ranking:
    """Phase 2 over many allocations, keeping the best schedules: (makespan, order found,
    tasks per tree node), best first."""

    def __init__(self, problem: _Problem, options: FarOptions) -> None:
        self.problem = problem
        self.options = options
        self.keep = max(options.refine_top if options.refine else 1, 1)
        self.entries: list[tuple[float, int, list[list[int]]]] = []
        self.seen: set[bytes] = set()

    @property
    def best(self) -> float:
        return self.entries[0][0] if self.entries else math.inf

    def run(self, alloc: np.ndarray) -> bool:
        """List-schedule an allocation not seen before; True if it beat the best."""
        key = alloc.tobytes()
        if key in self.seen:
            return False
        self.seen.add(key)
        before = self.best
        node_tasks = _list_schedule(self.problem, alloc)
        if self.options.use_wider_instance:
            _use_wider_instances(self.problem, node_tasks)
        durations = self.problem.node_durations
        loads = [
            sum(durations[node][t] for t in tasks) if tasks else None
            for node, tasks in enumerate(node_tasks)
        ]
        makespan = _timed(self.problem, loads, reverse=False).makespan
        self.entries.append((makespan, len(self.seen), node_tasks))
        self.entries.sort(key=lambda entry: entry[:2])
        del self.entries[self.keep :]
        return self.best < before


def _run_families(ranking: _Ranking, families: Sequence[_Family], options: FarOptions) -> None:
    """Run the families' allocations in ascending order of lower bound while one could still
    beat the best schedule (and, with `patience`, while they keep beating it)."""
    candidates = sorted(
        (family.lower_bound[k], f, k)
        for f, family in enumerate(families)
        for k in range(1, len(family.lower_bound))
    )
    since_improved = 0
    for bound, f, k in candidates:
        if len(ranking.seen) >= options.max_allocations or bound >= ranking.best:
            return
        if options.patience is not None and since_improved >= options.patience:
            return
        alloc = families[f].allocation(k)
        if alloc.tobytes() in ranking.seen:
            continue
        since_improved = 0 if ranking.run(alloc) else since_improved + 1


def far_layout(
    tasks: Sequence[MigTask], gpu: MigGeometry, options: FarOptions = FarOptions()
) -> BatchLayout:
    """Phases 1-3 of FAR for one batch."""
    validate_tasks(tasks, gpu)
    problem = _Problem(tasks, gpu)
    ranking = _Ranking(problem, options)
    starts = _first_allocations(problem, options.capped_families)
    for start in starts:
        ranking.run(start)
    families = [_allocation_family(problem, start, ranking.best) for start in starts]
    _run_families(ranking, families, options)
    count = min(options.random_allocations, RANDOM_ALLOCATION_BUDGET // len(tasks))
    for alloc in _random_allocations(problem, count):
        ranking.run(alloc)

    best_nodes = _node_lists(problem, ranking.entries[0][2])
    best_makespan, moves, swaps = ranking.best, 0, 0
    if options.refine:
        space = _search_space(problem, reverse=False, any_size=options.search.any_size)
        best_makespan = math.inf
        for _, _, node_tasks in ranking.entries:
            nodes = _node_lists(problem, node_tasks)
            stats = improve(
                nodes,
                space,
                lambda loads: _timed(problem, loads, reverse=False).slice_end,
                options.max_refine_evaluations,
                options.search,
            )
            makespan = _timed(problem, _loads(nodes), reverse=False).makespan
            if makespan < best_makespan:
                best_nodes, best_makespan = nodes, makespan
                moves, swaps = stats.moves, stats.swaps

    return BatchLayout(
        tasks=tuple(tasks),
        node_tasks=tuple(tuple(t for _, t in reversed(node)) for node in best_nodes),
        phase2_makespan_s=ranking.best,
        allocations=sum(len(family.lower_bound) for family in families),
        allocations_run=len(ranking.seen),
        moves=moves,
        swaps=swaps,
    )


def concatenate(
    layouts: Sequence[BatchLayout],
    gpu: MigGeometry,
    mode: ConcatMode = "reverse+refine",
    policy: str = "far",
    max_refine_evaluations: int = 300,
    rules: SearchRules | None = None,
) -> Plan:
    """One plan running the batches one after another on the same GPU.

    trivial: each batch starts when the previous batch's last task ends.
    reverse: every other batch runs its tree bottom-up (smallest instances first), and each
      instance starts as soon as the previous batch frees its slices (Section 4.2).
    reverse+refine: as reverse, then tasks of the new batch are moved and swapped (as in
      phase 3) to overlap the previous batch better (Section 4.3).
    """
    rules = rules or SearchRules()
    state = EMPTY_GPU
    assignments: list[Assignment] = []
    reconfigurations: list[Reconfiguration] = []
    offset = 0
    makespan = 0.0
    for number, layout in enumerate(layouts):
        problem = _Problem(layout.tasks, gpu)
        reverse = mode != "trivial" and number % 2 == 1
        release = makespan if mode == "trivial" else 0.0
        nodes = _node_lists(problem, layout.node_tasks)
        if mode == "reverse+refine" and number > 0:
            improve(
                nodes,
                _search_space(problem, reverse, any_size=rules.any_size),
                lambda loads, p=problem, s=state, r=reverse: _timed(p, loads, r, s).slice_end,
                max_refine_evaluations,
                rules,
            )
        timeline = _timed(problem, _loads(nodes), reverse, state, release)
        order = _execution_order(len(nodes), reverse)
        for position, node in enumerate(order):
            # Longest first going down the tree; shortest first when the tree runs upwards.
            queue = nodes[node] if reverse else reversed(nodes[node])
            clock = timeline.start[position]
            placement = problem.placements[node]
            for seconds, task in queue:
                assignments.append(
                    Assignment(
                        task_index=offset + task,
                        task=layout.tasks[task].name,
                        size=placement.size,
                        first_slice=placement.first_slice,
                        start_s=clock,
                        end_s=clock + seconds,
                    )
                )
                clock += seconds
        reconfigurations.extend(
            Reconfiguration(
                op.action,
                op.placement.size,
                op.placement.first_slice,
                op.start_s,
                op.end_s,
            )
            for op in timeline.ops
        )
        makespan = max(makespan, max(a.end_s for a in assignments))
        state = timeline.state
        offset += len(layout.tasks)
    assignments.sort(key=lambda a: (a.start_s, a.first_slice))
    reconfigurations.sort(key=lambda r: r.start_s)
    return Plan(
        gpu=gpu.name,
        policy=policy,
        assignments=tuple(assignments),
        reconfigurations=tuple(reconfigurations),
    )


def plan_batches(
    batches: Sequence[Sequence[MigTask]],
    gpu: MigGeometry,
    options: FarOptions = FarOptions(),
    mode: ConcatMode = "reverse+refine",
) -> Plan:
    """Plan each batch with FAR and concatenate them; task indices count across batches."""
    layouts = [far_layout(batch, gpu, options) for batch in batches]
    return concatenate(
        layouts,
        gpu,
        mode,
        max_refine_evaluations=options.max_refine_evaluations,
        rules=options.search,
    )
