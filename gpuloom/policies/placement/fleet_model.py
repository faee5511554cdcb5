"""The trace simulator's fleet policies (gpuloom/policies/fleet/: random, bestfit, dotprod,
gpupacking, gpuclustering, fgd, fgd-pack = best) placing live jobs: the same `choose` code,
fed a node view of the live `Fleet`.

One adapter serves them all. For each decision it builds the fleet model's `FleetState` from the
live fleet, one model node per live node:

- CPU and host memory: the node's capacity and what its jobs hold (host memory in MiB, asks
  rounded up, free space down; a node that reported no CPU has none to give);
- each GPU's free share in milli of a GPU: 1000 when nothing is on it, else its free area of the
  (quota x SM) rectangle, rounded down and below 1000 (but at least the job's share where the
  job fits, since its share is rounded up);
- a GPU this job cannot use (unschedulable, another model than the job's `gpu_model`, too little
  free GPU memory, or no free rectangle of the job's shape) counts as having less free than the
  job's share (1 milli less, never more than it has), so the policy's own `fits` sees only the
  GPUs the job can really take; unschedulable GPUs, and those of nodes that do not take the job
  (`Fleet.offers`: not one of its `nodes`, or short of its CPU or host memory), count as full;
- the pods each node hosts per GPU affinity (what GPU clustering groups by): each allocation
  of a share counts as a share pod, each whole-GPU job as a 1-GPU pod (a job on several GPUs
  too: the view does not count its GPUs), filled for `gpuclustering` only, the one policy
  that reads it.

The job becomes a pod: N whole GPUs (`gpus` > 1, or a share of the whole rectangle) or a share
of one GPU whose `gpu_milli` is its rectangle's area (sm_percent x quota, in milli of the GPU).
The workload the policies weigh (FGD's distribution of pod shapes) is the shapes of the last
WORKLOAD_WINDOW jobs this policy was asked to place, each job once, the current one included:
online, it knows only the past (the kept view weighs it again on a schedule, `weighing_due`).
Ties go to the first node in the fleet's order (the view's `rank` is the identity); `random`
draws from a generator seeded once per policy (the same decisions for the same sequence of
asks).

What the fleet model cannot express: where in the GPU's rectangle a share goes (the adapter
puts it at the bottom-left of the GPU's best-fitting free rectangle), and memory per GPU (the
clamping above). MIG batch tasks never reach placement policies (mig_batches.py plans them).
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from gpuloom.policies.fleet.fgd_fates import FgdFatesPolicy
from gpuloom.policies.fleet.model import (
    WHOLE_GPU,
    FleetPolicy,
    FleetState,
    NodeSpec,
    PodShape,
    RankedFleetPolicy,
)
from gpuloom.policies.fleet.registry import POLICIES as FLEET_POLICIES
from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet import Fleet, GpuSlot
from gpuloom.policies.placement.model import (
    GRID_AREA,
    GRID_H,
    GRID_W,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
)

MIB = 1 << 20
WORKLOAD_WINDOW = 10_000  # jobs whose shapes make the workload distribution
MAX_SHAPES = 64  # distinct shapes weighed at most (the most frequent; the asked one always)
SEED = 0
# The kept view weighs its workload again at 64, 128, 256, ... decisions, then every 10,000.
FIRST_WEIGHING = 64
WORKLOAD_REFRESH = 10_000
WALK_BATCH = 16  # nodes checked ahead at first when walking a ranked policy's order (doubling)
# `fgd-fates` measures its gap table on at most this many pods when the view is built or the
# workload weighed again (0.1-0.3 s at 8,000 GPUs), not the simulator's 50,000 (seconds).
LIVE_CALIBRATION_PODS = 3_000


def share_milli(w: int, h: int) -> int:
    """A w x h rectangle as milli of one GPU, rounded up (never less than it takes)."""
    return min(WHOLE_GPU, max(1, math.ceil(w * h * WHOLE_GPU / GRID_AREA)))


def pod_shape(job: JobRequest) -> PodShape:
    """The fleet model's pod for a live job."""
    memory_mib = -(-job.host_memory_bytes // MIB)
    if job.gpus > 1:
        return PodShape(job.cpu_milli, memory_mib, job.gpus, WHOLE_GPU)
    return PodShape(job.cpu_milli, memory_mib, 1, share_milli(job.w, job.sm_percent))


@dataclass(frozen=True, slots=True)
class _View:
    state: FleetState
    q: int
    node_names: tuple[str, ...]
    gpu_ids: tuple[tuple[str, ...], ...]  # per model node, its GPUs in column order


class FleetModelPolicy:
    """A fleet policy of the simulator as a live placement policy (and gang policy)."""

    def __init__(self, fleet_policy: str, seed: int = SEED) -> None:
        self._policy: FleetPolicy = FLEET_POLICIES.create(fleet_policy)
        if isinstance(self._policy, FgdFatesPolicy):
            self._policy.calibration_pods = LIVE_CALIBRATION_PODS
        self._name = fleet_policy
        self._counts_hosted = fleet_policy == "gpuclustering"
        self._rng = np.random.default_rng(seed)
        self._recent: OrderedDict[str, PodShape] = OrderedDict()
        self._counts: Counter[PodShape] = Counter()
        self._live: weakref.WeakKeyDictionary[Fleet, _Kept] = weakref.WeakKeyDictionary()

    @property
    def name(self) -> str:
        return self._name

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        return self._decide(job, fleet)

    def place_gang(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        return self._decide(job, fleet)

    # ---- inside ----

    def _note(self, job_id: str, shape: PodShape) -> None:
        if job_id in self._recent:
            return
        self._recent[job_id] = shape
        self._counts[shape] += 1
        if len(self._recent) > WORKLOAD_WINDOW:
            _, old = self._recent.popitem(last=False)
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]

    def _decide(self, job: JobRequest, fleet: Fleet) -> Placement | Unplaceable:
        shape = pod_shape(job)
        self._note(job.job_id, shape)
        if not job.shared_model and not job.nodes:
            live = self._live.get(fleet)
            if live is None:
                live = self._live[fleet] = _Kept(self._policy, self._counts_hosted)
            decided = live.decide(job, shape, fleet, self._counts, self._rng, self.name)
            if decided is not None:
                return decided if isinstance(decided, Placement) else self._unplaceable(job, fleet)
        view = self._view(job, shape, fleet)
        choice = None if view is None else self._policy.choose(view.state, view.q, self._rng)
        if view is None or choice is None:
            return self._unplaceable(job, fleet)
        node = view.node_names[choice.node]
        gpus = [view.gpu_ids[choice.node][j] for j in choice.gpus]
        whole = Rect(0, 0, GRID_W, GRID_H)
        if shape.gpu_milli == WHOLE_GPU:
            return Placement(job.job_id, gpus[0], node, whole, self.name, tuple(gpus[1:]))
        slot = fleet.slot(gpus[0])
        box = slot.free.best_fit(job.w, job.sm_percent)
        if box is None:  # cannot be: the view counts such a GPU as too full
            return self._unplaceable(job, fleet)
        rect = Rect(box[0], box[1], job.w, job.sm_percent)
        return Placement(job.job_id, gpus[0], node, rect, self.name)

    def _unplaceable(self, job: JobRequest, fleet: Fleet) -> Unplaceable:
        """Why the job has no GPU; the fleet adds what its nodes lack (as for every policy)."""
        if job.gpus > 1:
            return fleet.gang_unplaceable(job)
        return fleet.unplaceable(job, job.w, job.sm_percent)

    def _view(self, job: JobRequest, shape: PodShape, fleet: Fleet) -> _View | None:
        nodes = [n for n in fleet.nodes.values() if n.gpu_ids]
        if not nodes:
            return None
        common = [s for s, _ in self._counts.most_common(MAX_SHAPES)]
        if shape not in common:
            common.append(shape)
        weights = [float(self._counts[s]) for s in common]
        specs = [
            NodeSpec(n.name, max(n.cpu_milli, 1), max(n.memory_bytes // MIB, 1), len(n.gpu_ids), "")
            for n in nodes
        ]
        state = FleetState(specs, common, weights)
        d = shape.gpu_milli
        w, h = (GRID_W, GRID_H) if d == WHOLE_GPU else (job.w, job.sm_percent)
        allowed = set(job.models) or None
        need = job.memory_bytes
        slots = fleet.slots
        # Pods hosted per GPU affinity (share, whole GPUs): only GPU clustering reads them.
        tags = state.hosted.shape[1] if self._counts_hosted else 0
        gpu_free = state.gpu_free
        gpu_ids: list[tuple[str, ...]] = []
        for i, node in enumerate(nodes):
            state.cpu_free[i] = node.cpu_free
            state.mem_free[i] = node.memory_free // MIB
            ids = tuple(node.gpu_ids)
            gpu_ids.append(ids)
            taken = not job.needs_node or node.takes(job)
            for j, gpu_id in enumerate(ids):
                slot = slots[gpu_id]
                if not slot.schedulable or not taken:
                    gpu_free[i, j] = 0
                    continue
                boxes = slot.boxes
                free = (
                    min(WHOLE_GPU - 1, slot.area_free * WHOLE_GPU // GRID_AREA)
                    if boxes
                    else WHOLE_GPU
                )
                usable = (
                    (allowed is None or slot.model in allowed)
                    and slot.memory_free >= need
                    and (free == WHOLE_GPU if d == WHOLE_GPU else slot.free.fits(w, h))
                )
                # Rounding must not hide room: a usable GPU shows at least the job's share.
                gpu_free[i, j] = max(free, d) if usable else min(free, d - 1)
                if tags:
                    for group, box in boxes.items():
                        # One pod per box: a time-slice group's members share their box (its
                        # first allocation may be gone); a gang counts on its first GPU.
                        first = slot.allocations.get(group)
                        if first is None or not first.gang:
                            whole = share_milli(box[2] - box[0], box[3] - box[1]) == WHOLE_GPU
                            tag = 2 if whole else 1  # "1-gpu" or "share"
                            if tag < tags:
                                state.hosted[i, tag] += 1
        return _View(state, common.index(shape), tuple(n.name for n in nodes), tuple(gpu_ids))


def weighing_due(decisions: int) -> bool:
    """Whether the kept view weighs its workload again at this decision: at FIRST_WEIGHING
    and each doubling of it, then every WORKLOAD_REFRESH. The view is built at the first
    decision, when the policy has seen one job; the workload is then weighed again often while
    each job still changes it much, and rarely after, as each weighing starts the policies'
    caches over (and `best` measures its table again when FGD's typical shapes changed).
    Weighed only every 10,000 decisions, the replay of the trace's default list (7,064 jobs)
    ran with one job's shape as its workload: `best` queued 270 jobs, `fgd` 290; weighed at
    64, 128, ..., 209 and 211 (docs/benchmarks.md, "Replay through the live core")."""
    if decisions >= WORKLOAD_REFRESH:
        return decisions % WORKLOAD_REFRESH == 0
    return decisions >= FIRST_WEIGHING and decisions & (decisions - 1) == 0


def _gpu_free_milli(slot: GpuSlot) -> int:
    """A GPU's free share in milli, as the view shows it before any job's own limits."""
    if not slot.schedulable:
        return 0
    if not slot.boxes:
        return WHOLE_GPU
    return min(WHOLE_GPU - 1, slot.area_free * WHOLE_GPU // GRID_AREA)


@dataclass(frozen=True, slots=True)
class _Ask:
    """One decision of the kept view: the job, its shape's index, its per-GPU share (milli) and
    GPU count, the policy's name, the live fleet."""

    job: JobRequest
    q: int
    d: int
    k: int
    name: str
    fleet: Fleet
    w: int  # the job's rectangle: quota steps by SM percent
    h: int


class _Kept:
    """The view of one live `Fleet`, kept in step with it instead of rebuilt per decision: a
    `FleetState` whose rows are refreshed for the nodes the fleet's journal says were touched
    (`Fleet.touched_since`), so FGD's per-node cache survives from one decision to the next
    and a decision costs what a simulated one does. Per job: a GPU model it names is the fleet
    model's own model rule; nodes without enough GPUs with its memory free are left out
    (`FleetState.allowed`, which leaves the rows and the policies' caches as they are); the
    chosen GPU is checked for its memory and whether the share's rectangle fits (one that
    fails: that node's GPUs that cannot take the job are hidden for this decision and the
    policy asked again, until a GPU takes it or no node fits; a ranked policy's order is
    walked instead, to the same node, `_walk`). Rows changed for a decision are put back with
    their versions. What it cannot keep (nodes with GPUs of several models, a shared model, a
    list of nodes) goes the rebuilding way (`decide` answers None)."""

    def __init__(self, policy: FleetPolicy, counts_hosted: bool) -> None:
        self.policy = policy
        self.ranked = policy if isinstance(policy, RankedFleetPolicy) else None
        self.counts_hosted = counts_hosted
        self.state: FleetState | None = None
        self.topology = -1
        self.cursor = 0
        self.shapes: list[PodShape] = []
        self.index: dict[PodShape, int] = {}
        self.decisions = 0
        self.mixed = False
        self.roomy = np.zeros((0, 0), dtype=bool)  # per decision: GPUs with the job's memory free
        self.saved: dict[int, tuple[np.ndarray, int]] = {}  # rows changed for one decision
        self.slots: dict[str, GpuSlot] = {}  # the fleet's, for the decision

    def decide(
        self,
        job: JobRequest,
        shape: PodShape,
        fleet: Fleet,
        counts: Counter[PodShape],
        rng: np.random.Generator,
        name: str,
    ) -> Placement | Unplaceable | None:
        asked = replace(shape, models=frozenset(job.models) or None)
        if not self._sync(fleet, counts, asked):
            return None
        state = self.state
        assert state is not None
        ask = _Ask(
            job,
            self.index[asked],
            asked.gpu_milli,
            asked.num_gpu,
            name,
            fleet,
            job.w,
            job.sm_percent,
        )
        self.slots = fleet.slots
        self.roomy = self.gpu_mem >= job.memory_bytes
        self.saved = {}
        try:
            # For this decision only: a GPU one milli short (free area rounds down, the share
            # up) whose rectangles fit the job shows the share; the nodes without enough GPUs
            # that have the job's memory free are not allowed (rows changed for the decision
            # are put back with their versions after it, so the policies' caches hold).
            if ask.d < WHOLE_GPU:
                self._show_near(ask)
            state.allowed = ((state.gpu_free >= ask.d) & self.roomy).sum(axis=1) >= ask.k
            if ask.d == WHOLE_GPU:
                choice = self.policy.choose(state, ask.q, rng)
                if choice is None:
                    return Unplaceable(job.job_id, "")
                i = choice.node
                cols = np.flatnonzero((state.gpu_free[i] == WHOLE_GPU) & self.roomy[i])[: ask.k]
                gpus = [self.gpu_ids[i][j] for j in cols]
                whole = Rect(0, 0, GRID_W, GRID_H)
                return Placement(job.job_id, gpus[0], self.nodes[i], whole, name, tuple(gpus[1:]))
            if self.ranked is not None:
                return self._walk(self.ranked, ask)
            return self._ask(ask, rng)
        finally:
            state.allowed = None
            for i, (row, version) in self.saved.items():
                state.gpu_free[i] = row
                state.version[i] = version

    def _ask(self, ask: _Ask, rng: np.random.Generator) -> Placement | Unplaceable:
        """A share: ask the policy; while the GPU it chooses cannot take the job (too little
        memory, or no free rectangle of the job's shape), hide that node's GPUs that cannot
        and ask again."""
        state = self.state
        assert state is not None
        while True:
            choice = self.policy.choose(state, ask.q, rng)
            if choice is None:
                return Unplaceable(ask.job.job_id, "")
            placed = self._place_share(ask, choice.node, choice.gpus[0])
            if placed is not None:
                return placed
            self._hide(self.policy, ask, [(choice.node, choice.gpus[0])])

    def _walk(self, policy: RankedFleetPolicy, ask: _Ask) -> Placement | Unplaceable:
        """`_ask`'s decision, for a policy that ranks nodes by their own keys: the nodes in
        the policy's order, each node whose GPU fails hidden and put back in the order with
        its keys read again (what `_ask` would choose next), without asking again. The
        nodes' GPUs are checked, hidden and re-read in batches of growing size ahead of the
        walk: a node's keys are its own, so hiding one the walk has not reached changes
        nothing it reads before it."""
        state = self.state
        assert state is not None
        keys = policy.keys(state, ask.q, None)
        order = np.flatnonzero(keys[0] > -np.inf)
        rank = state.rank
        order = order[np.lexsort((rank[order], *(-key[order] for key in reversed(keys))))]
        again: list[tuple[tuple[float, ...], int, int]] = []  # hidden nodes, read again
        pos, batch = 0, WALK_BATCH
        while pos < len(order):
            ahead = order[pos : pos + batch]
            pos += len(ahead)
            batch *= 2
            gpus = policy.share_gpus(state, ask.q, ahead)
            fits = self.roomy[ahead, gpus].tolist()
            gpus = gpus.tolist()
            # Checked up to the first node that takes the job: the walk ends there (or at a
            # hidden node read again before it), so the nodes after it stay as they are.
            reached = len(ahead)
            for n, (i, j) in enumerate(zip(ahead.tolist(), gpus, strict=True)):
                fits[n] = fits[n] and self._fits(ask, i, j)
                if fits[n]:
                    reached = n + 1
                    break
            ahead, gpus, fits = ahead[:reached], gpus[:reached], fits[:reached]
            negated = zip(*((-key[ahead]).tolist() for key in keys), strict=True)
            entries = list(zip(negated, rank[ahead].tolist(), ahead.tolist(), strict=True))
            failed = [(e[2], j) for e, j, ok in zip(entries, gpus, fits, strict=True) if not ok]
            read = self._hide(policy, ask, failed)
            for entry, j, ok in zip(entries, gpus, fits, strict=True):
                while again and again[0] < entry:
                    placed = self._take_again(policy, ask, again)
                    if placed is not None:
                        return placed
                if ok:
                    placed = self._place_share(ask, entry[2], j)
                    assert placed is not None  # it has the memory and a rectangle
                    return placed
                if read[entry[2]] is not None:
                    heapq.heappush(again, read[entry[2]])
        while again:
            placed = self._take_again(policy, ask, again)
            if placed is not None:
                return placed
        return Unplaceable(ask.job.job_id, "")

    def _take_again(
        self, policy: RankedFleetPolicy, ask: _Ask, again: list[tuple[tuple[float, ...], int, int]]
    ) -> Placement | None:
        """The best of the hidden nodes: placed there, or (should its GPU still fail) hidden
        further and put back."""
        state = self.state
        assert state is not None
        _, _, i = heapq.heappop(again)
        j = int(policy.share_gpus(state, ask.q, np.array([i]))[0])
        placed = self._place_share(ask, i, j)
        if placed is None:
            entry = self._hide(policy, ask, [(i, j)])[i]
            if entry is not None:
                heapq.heappush(again, entry)
        return placed

    def _show_near(self, ask: _Ask) -> None:
        state = self.state
        assert state is not None
        # The few GPUs one milli short first, then their memory (cheaper than a mask of all).
        near = np.flatnonzero(state.gpu_free.ravel() == ask.d - 1)
        near = near[self.roomy.ravel()[near]]
        changed: set[int] = set()
        for i, j in zip(*np.divmod(near, state.gpu_free.shape[1]), strict=True):
            slot = ask.fleet.slot(self.gpu_ids[i][j])
            if slot.schedulable and slot.free.fits(ask.w, ask.h):
                self._save(int(i))
                state.gpu_free[i, j] = ask.d
                changed.add(int(i))
        for i in changed:
            state.touch(i)

    def _save(self, i: int) -> None:
        state = self.state
        assert state is not None
        if i not in self.saved:
            self.saved[i] = (state.gpu_free[i].copy(), int(state.version[i]))

    def _fits(self, ask: _Ask, i: int, j: int) -> bool:
        """Whether GPU j of node i has a free rectangle of the job's shape."""
        return self.slots[self.gpu_ids[i][j]].free.fits(ask.w, ask.h)

    def _place_share(self, ask: _Ask, i: int, j: int) -> Placement | None:
        if not self.roomy[i, j]:
            return None
        gpu_id = self.gpu_ids[i][j]
        box = self.slots[gpu_id].free.best_fit(ask.w, ask.h)
        if box is None:
            return None
        rect = Rect(box[0], box[1], ask.w, ask.h)
        return Placement(ask.job.job_id, gpu_id, self.nodes[i], rect, ask.name)

    def _hide(
        self, policy: FleetPolicy, ask: _Ask, failed: list[tuple[int, int]]
    ) -> dict[int, tuple[tuple[float, ...], int, int] | None]:
        """For this decision: every GPU of each node i of `failed` (with the GPU j that was
        chosen there and cannot take the job) that cannot take the job shows less than its
        share, and whether node i is allowed is read again. A ranked policy's walk entries of
        those nodes, read again (None: the job no longer goes there)."""
        state = self.state
        assert state is not None and state.allowed is not None
        if not failed:
            return {}
        rows = np.array([i for i, _ in failed], dtype=np.int64)
        free = state.gpu_free[rows]
        versions = state.version[rows].tolist()
        saved = self.saved
        for r, i in enumerate(rows.tolist()):
            if i not in saved:
                saved[i] = (free[r].copy(), versions[r])
        room = self.roomy[rows]
        open_ = free >= ask.d
        hide = open_ & ~room
        hide[np.arange(len(rows)), [j for _, j in failed]] = True
        ids = self.gpu_ids
        slots = self.slots
        for r, jj in zip(*np.nonzero(open_ & ~hide), strict=True):
            if not slots[ids[failed[r][0]][jj]].free.fits(ask.w, ask.h):
                hide[r, jj] = True
        free = np.where(hide, np.minimum(free, ask.d - 1), free)
        state.gpu_free[rows] = free
        state.touch_rows(rows)
        state.allowed[rows] = ((free >= ask.d) & room).sum(axis=1) >= ask.k
        if policy is not self.ranked or self.ranked is None:
            return {}
        keys = self.ranked.keys(state, ask.q, rows)
        negated = zip(*((-key).tolist() for key in keys), strict=True)
        return {
            i: (neg, r, i) if neg[0] < np.inf else None
            for neg, r, i in zip(negated, state.rank[rows].tolist(), rows.tolist(), strict=True)
        }

    # ---- keeping the view ----

    def _sync(self, fleet: Fleet, counts: Counter[PodShape], asked: PodShape) -> bool:
        """Bring the view up to date; False when this fleet cannot be kept."""
        touched, end = fleet.touched_since(self.cursor)
        self.decisions += 1
        stale_workload = weighing_due(self.decisions)
        if touched is None or fleet.topology != self.topology or self.state is None:
            self.cursor = end
            return self._rebuild(fleet, counts, asked)
        self.cursor = end
        for i in {self.node_index[n] for n in touched if n in self.node_index}:
            self._refresh_row(fleet, i)
        if stale_workload:
            self._reweigh(counts)
        if asked not in self.index:
            self.index[asked] = self.state.add_shape(asked)
            self.shapes.append(asked)
        return True

    def _reweigh(self, counts: Counter[PodShape]) -> None:
        """A new FleetState with the workload's weights now and the same rows (FGD's cache
        starts over: the typical pods may have changed)."""
        old = self.state
        assert old is not None
        for shape, _ in counts.most_common(MAX_SHAPES):
            if shape not in self.index:
                self.index[shape] = len(self.shapes)
                self.shapes.append(shape)
        weights = [float(counts.get(s, 0)) for s in self.shapes]
        state = FleetState(old.nodes, self.shapes, weights)
        state.cpu_free[:], state.mem_free[:] = old.cpu_free, old.mem_free
        state.gpu_free[:] = old.gpu_free
        width = min(old.hosted.shape[1], state.hosted.shape[1])
        state.hosted[:, :width] = old.hosted[:, :width]
        self.state = state

    def _rebuild(self, fleet: Fleet, counts: Counter[PodShape], asked: PodShape) -> bool:
        nodes = [n for n in fleet.nodes.values() if n.gpu_ids]
        self.topology = fleet.topology
        slots = fleet.slots
        models = [{slots[g].model for g in n.gpu_ids} for n in nodes]
        self.mixed = any(len(m) > 1 for m in models)
        if self.mixed or not nodes:
            self.state = None
            return False
        for shape in (*(s for s, _ in counts.most_common(MAX_SHAPES)), asked):
            if shape not in self.index:
                self.index[shape] = len(self.shapes)
                self.shapes.append(shape)
        weights = [float(counts.get(s, 0)) for s in self.shapes]
        specs = [
            NodeSpec(
                n.name,
                max(n.cpu_milli, 1),
                max(n.memory_bytes // MIB, 1),
                len(n.gpu_ids),
                next(iter(m)),
            )
            for n, m in zip(nodes, models, strict=True)
        ]
        self.state = FleetState(specs, self.shapes, weights)
        self.nodes = [n.name for n in nodes]
        self.node_index = {name: i for i, name in enumerate(self.nodes)}
        self.gpu_ids = [tuple(n.gpu_ids) for n in nodes]
        self.gpu_mem = np.zeros(self.state.gpu_free.shape, dtype=np.int64)
        for i in range(len(nodes)):
            self._refresh_row(fleet, i)
        return True

    def _refresh_row(self, fleet: Fleet, i: int) -> None:
        """Node i's row from the live fleet (its version moves only when something did)."""
        state = self.state
        assert state is not None
        node = fleet.nodes.get(self.nodes[i])
        if node is None:
            return
        slots = fleet.slots
        ids = self.gpu_ids[i]
        free = [_gpu_free_milli(slots[g]) for g in ids]
        mem = [slots[g].memory_free if slots[g].schedulable else 0 for g in ids]
        cpu, host = node.cpu_free, node.memory_free // MIB
        row = state.gpu_free[i, : len(ids)]
        if (
            state.cpu_free[i] == cpu
            and state.mem_free[i] == host
            and row.tolist() == free
            and self.gpu_mem[i, : len(ids)].tolist() == mem
            and not self.counts_hosted
        ):
            return
        state.cpu_free[i] = cpu
        state.mem_free[i] = host
        row[:] = free
        self.gpu_mem[i, : len(ids)] = mem
        if self.counts_hosted:
            state.hosted[i] = 0
            tags = state.hosted.shape[1]
            for g in ids:
                slot = slots[g]
                for group, box in slot.boxes.items():
                    first = slot.allocations.get(group)
                    if first is None or not first.gang:
                        whole = share_milli(box[2] - box[0], box[3] - box[1]) == WHOLE_GPU
                        tag = 2 if whole else 1
                        if tag < tags:
                            state.hosted[i, tag] += 1
        state.touch(i)
