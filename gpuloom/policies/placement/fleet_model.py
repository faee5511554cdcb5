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
)
from gpuloom.policies.fleet.registry import POLICIES as FLEET_POLICIES
from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet import Fleet, GpuSlot
from gpuloom.policies.placement.maxrects import Box
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
# `fgd-fates` measures its gap table on at most this many pods when the view is built or the
# workload weighed again (0.3-1 s at 8,000 GPUs), not the simulator's 50,000 (seconds).
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


def _free_boxes(slot: GpuSlot) -> tuple[Box, ...]:
    """The GPU's maximal free rectangles as a job may take them (none: unschedulable)."""
    return tuple(slot.free.maximal) if slot.schedulable else ()


def _widest(boxes: tuple[Box, ...]) -> np.ndarray:
    """Per height h (at index h - 1): the width of the widest of the free rectangles `boxes`
    at least h tall (0: none). A w x h share fits on the GPU when it is at least w:
    `FreeRects.fits` for every GPU of the fleet at once."""
    widest = np.zeros(GRID_H, dtype=np.int16)
    for x0, y0, x1, y1 in boxes:
        tall = widest[: y1 - y0]
        np.maximum(tall, x1 - x0, out=tall)
    return widest


def _gpu_free_milli(slot: GpuSlot) -> int:
    """A GPU's free share in milli, as the view shows it before any job's own limits."""
    if not slot.schedulable:
        return 0
    if not slot.boxes:
        return WHOLE_GPU
    return min(WHOLE_GPU - 1, slot.area_free * WHOLE_GPU // GRID_AREA)


class _Kept:
    """The view of one live `Fleet`, kept in step with it instead of rebuilt per decision: a
    `FleetState` whose rows are refreshed for the nodes the fleet's journal says were touched
    (`Fleet.touched_since`), so FGD's per-node cache survives from one decision to the next
    and a decision costs what a simulated one does. Per job: a GPU model it names is the fleet
    model's own model rule; the GPUs without its memory free or without a free rectangle of
    its shape (`widest`) are ones it may not take (`FleetState.usable`), and the nodes without
    enough GPUs it may take are left out (`FleetState.allowed`): both leave the rows and the
    policies' caches as they are (FGD keeps a share's score per GPU and scores the node over
    the others), and the policy is asked once: the GPU it chooses takes the job. Rows changed
    for a decision (`_show_near`) are put back with their versions. What it cannot keep
    (nodes with GPUs of several models, a shared model, a list of nodes) goes the rebuilding
    way (`decide` answers None)."""

    def __init__(self, policy: FleetPolicy, counts_hosted: bool) -> None:
        self.policy = policy
        self.counts_hosted = counts_hosted
        self.state: FleetState | None = None
        self.topology = -1
        self.cursor = 0
        self.shapes: list[PodShape] = []
        self.index: dict[PodShape, int] = {}
        self.decisions = 0
        self.mixed = False
        self.saved: dict[int, tuple[np.ndarray, int]] = {}  # rows changed for one decision

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
        q, d, k = self.index[asked], asked.gpu_milli, asked.num_gpu
        w, h = (GRID_W, GRID_H) if d == WHOLE_GPU else (job.w, job.sm_percent)
        state.usable = (self.gpu_mem >= job.memory_bytes) & (self.widest[h - 1] >= w)
        self.saved = {}
        try:
            # For this decision only: a GPU one milli short (free area rounds down, the share
            # up) that the job may take shows the share (rows changed for the decision are put
            # back with their versions after it, so the policies' caches hold).
            if d < WHOLE_GPU:
                self._show_near(d)
            state.allowed = state.open_gpus(d).sum(axis=1) >= k
            choice = self.policy.choose(state, q, rng)
            if choice is None:
                return Unplaceable(job.job_id, "")
            node, ids = self.nodes[choice.node], self.gpu_ids[choice.node]
            gpus = [ids[j] for j in choice.gpus]
            if d == WHOLE_GPU:
                whole = Rect(0, 0, GRID_W, GRID_H)
                return Placement(job.job_id, gpus[0], node, whole, name, tuple(gpus[1:]))
            box = fleet.slot(gpus[0]).free.best_fit(w, h)
            assert box is not None  # a GPU the job may take has a rectangle of its shape
            return Placement(job.job_id, gpus[0], node, Rect(box[0], box[1], w, h), name)
        finally:
            state.usable = state.allowed = None
            for i, (row, version) in self.saved.items():
                state.gpu_free[i] = row
                state.version[i] = version

    def _show_near(self, d: int) -> None:
        state = self.state
        assert state is not None and state.usable is not None
        near = np.flatnonzero((state.gpu_free == d - 1) & state.usable)
        for i in np.unique(near // state.gpu_free.shape[1]).tolist():
            self.saved[i] = (state.gpu_free[i].copy(), int(state.version[i]))
        state.gpu_free.ravel()[near] = d
        for i in self.saved:
            state.touch(i)

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
        # Per height, node and GPU (a decision reads one height); each GPU's boxes as last read.
        self.widest = np.zeros((GRID_H, *self.state.gpu_free.shape), dtype=np.int16)
        self.boxes: list[list[tuple[Box, ...] | None]] = [[None] * len(n.gpu_ids) for n in nodes]
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
        for j, g in enumerate(ids):  # by the boxes: the same free area may lie elsewhere now
            boxes = _free_boxes(slots[g])
            if boxes != self.boxes[i][j]:
                self.boxes[i][j] = boxes
                self.widest[:, i, j] = _widest(boxes)
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
