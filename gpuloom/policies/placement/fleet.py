"""The placement state of a fleet: every GPU's allocations and free rectangles, kept
incrementally, and the indexes that make a decision cheap with thousands of GPUs.

Per model (a job's gpu_model constraint picks models, "" all of them) the fleet keeps, over
its schedulable GPUs only:

- `rects`: every free box of every GPU as (area, gpu_id, box), sorted: MRA's global best match
  (the least area that still fits) is the first fitting entry at or after the job's area;
- `by_free`: (free area, gpu_id), sorted, one list per memory class (free memory rounded
  down to a power of two): bin-packing walks them up, spreading down, and skips the classes
  with too little memory, which is what turns most GPUs away once a fleet is busy;
- `by_id`: GPU ids, sorted, for first-fit walks.

A decision touches one GPU, so it updates a handful of entries (bisect, not a rebuild). A GPU
marked unschedulable keeps its allocations and leaves the indexes.

**Shared models** (FaST-GShare's model sharing). A GPU's model store may hold models
(`set_models`): their bytes are used memory of the GPU, once. A job that is a replica of one
(`JobRequest.shared_model`) is placed first among the GPUs where its model is resident, charged
its memory less the weights there (`replica_memory`); only if none of them has room does the
policy look at the whole fleet, where the job is charged its whole footprint. The policy decides
in both rounds: in the first it sees a view of the fleet holding only those GPUs.

Nodes: every GPU belongs to a node, and the fleet keeps each node's CPU (milli) and host memory,
as its GPUs were registered with them, and what jobs hold of them. A job asking for CPU or host
memory is offered to its policy with the GPUs of the nodes short of them left out (for that
decision only), so every policy respects node resources without knowing them; the commit
checks them again. A job on several GPUs (`JobRequest.gpus > 1`) takes whole GPUs of one node,
all or none: a policy may choose them (`GangPolicy.place_gang`); otherwise the fleet packs it on
the node left with the fewest whole free GPUs (ties by node name).

Both together: a replica asking for CPU or host memory is offered, in its first round, only the
GPUs holding its model whose nodes have them free (the view carries those nodes' records), and
in its second round the fleet without the nodes short of them. A job on several GPUs takes them
whole and cannot be a replica (`JobRequest.validate` refuses the pair).

**Time-slice groups** (Gandiva's over-subscription). `slice_into` puts a job on a GPU that may be
full, as a member of the group of an allocation already there: the member takes turns with the
group's jobs in their rectangle (the driver suspends and resumes them one at a time), so it
takes no area, only its memory (memory stays resident while a job is suspended) and its node's
CPU and host memory. The group's key is its first allocation's id (`Allocation.slice_group`);
the group, and its rectangle, live while any of its allocations does, the first included or
not. A GPU's boxes are therefore one per group, keyed by the group key. `slice_gang_into` does
the same for a job on several whole GPUs, all or none: on each GPU it joins the group named for
that GPU (a running gang's groups are `host` on its first GPU, `host#1`... on the others), its
allocations' ids and `gang` as `place` gives a gang, its CPU and host memory on the first only.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from gpuloom.policies.placement.context import NO_PROFILES, PlacementContext
from gpuloom.policies.placement.maxrects import (
    Box,
    FreeRects,
    box_area,
    box_of,
    inside,
    maximal_boxes,
    overlaps,
    rect_of,
)
from gpuloom.policies.placement.model import (
    GRID_AREA,
    GRID_H,
    GRID_W,
    Allocation,
    GpuState,
    InvalidRequestError,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
    check_models,
    describe_gib,
    describe_shape,
    gang_member_id,
    model_alternatives,
    quota_steps,
    replica_memory,
)

# FaST-GShare rebuilds a GPU's list once it grows past a threshold; here past
# REBUILD_FACTOR * allocations + REBUILD_SLACK rectangles.
REBUILD_FACTOR = 4
REBUILD_SLACK = 8


class InvalidStateError(ValueError):
    """Allocations that cannot all be on their GPU: overlapping rectangles, too much memory,
    an id used twice."""


class InvalidPlacementError(ValueError):
    """A policy returned a placement the fleet cannot commit (a bug in the policy), or a job
    cannot join a time-slice group (`Fleet.slice_into`)."""


# Who holds a GPU for the gap-aware policy: (holder task key, holder priority, allocations of
# lower priority already filling its gaps).
HolderGroup = tuple[str, int, int]

JOURNAL_KEEP = 1 << 16  # changes the fleet remembers for `touched_since`


@dataclass(slots=True, eq=False)
class GpuSlot:
    """The fleet's live record of one GPU. Policies read it; only the fleet changes it."""

    gpu_id: str
    node: str
    model: str
    memory_bytes: int
    sm_count: int
    schedulable: bool
    free: FreeRects = field(default_factory=FreeRects)
    allocations: dict[str, Allocation] = field(default_factory=dict)
    # One per time-slice group, by its key (`Allocation.slice_group`: an allocation's own id
    # unless it joined a group): members share their group's box.
    boxes: dict[str, Box] = field(default_factory=dict)
    memory_free: int = 0  # set from memory_bytes when loaded
    area_free: int = GRID_AREA  # stored, not computed: the searches read them in their loops
    holder: HolderGroup | None = None
    models: dict[str, int] = field(default_factory=dict)  # resident in its store: name -> bytes
    store_bytes: int = 0  # their sum, part of the used memory
    # The node's figures as this GPU was registered with them (NodeSlot holds the node's).
    node_cpu_milli: int = 0
    node_memory_bytes: int = 0

    @property
    def memory_used(self) -> int:
        return self.memory_bytes - self.memory_free

    @property
    def area_used(self) -> int:
        return GRID_AREA - self.area_free

    def state(self) -> GpuState:
        return GpuState(
            self.gpu_id,
            self.node,
            self.model,
            self.memory_bytes,
            self.sm_count,
            self.schedulable,
            tuple(self.allocations.values()),
            tuple(sorted(self.models.items())),
            self.node_cpu_milli,
            self.node_memory_bytes,
        )

    def memory_need(self, job: JobRequest) -> int:
        """The memory `job` is charged here: less its shared model's weights where the model
        is resident (replica_memory), else what it asks."""
        if not job.shared_model:
            return job.memory_bytes
        return replica_memory(job.memory_bytes, self.models.get(job.shared_model, 0))


@dataclass(slots=True, eq=False)
class NodeSlot:
    """The fleet's live record of one node: its CPU and host memory (the latest registration of
    one of its GPUs sets them) and what the jobs on it hold. Read it, never change it."""

    name: str
    cpu_milli: int = 0
    memory_bytes: int = 0
    cpu_used: int = 0
    memory_used: int = 0
    gpu_ids: list[str] = field(default_factory=list)  # sorted

    @property
    def cpu_free(self) -> int:
        return self.cpu_milli - self.cpu_used

    @property
    def memory_free(self) -> int:
        return self.memory_bytes - self.memory_used

    def takes(self, job: JobRequest) -> bool:
        """Whether the node is one the job may use and has the CPU and host memory it asks
        for free."""
        return (
            (not job.nodes or self.name in job.nodes)
            and job.cpu_milli <= self.cpu_free
            and job.host_memory_bytes <= self.memory_free
        )


class PlacementPolicy(Protocol):
    """Chooses a GPU and a rectangle for one job. The fleet holds the free space of every GPU
    (incrementally, shared by all policies), so a policy keeps no per-GPU state and needs no
    release hook; `Fleet.place` commits what it returns. Whatever else a policy may know
    (kernel profiles) comes through `context`, the same lookups offered to every policy."""

    @property
    def name(self) -> str: ...

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        """Decide only: nothing changes until the fleet commits the placement."""
        ...


class GangPolicy(PlacementPolicy, Protocol):
    """A policy that also chooses the GPUs of a job spanning several (`job.gpus > 1`): the
    placement names them all (`extra_gpu_ids`), whole GPUs of one node."""

    def place_gang(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable: ...


def _remove(items: list, key: object) -> None:
    i = bisect_left(items, key)
    if i == len(items) or items[i] != key:
        raise AssertionError(f"index lost {key!r}")
    del items[i]


@dataclass(slots=True, eq=False)
class ModelIndex:
    """The schedulable GPUs of one model, indexed for the policies (read-only for them)."""

    model: str
    gpu_ids: set[str] = field(default_factory=set)  # all of the model, schedulable or not
    rects: list[tuple[int, str, Box]] = field(default_factory=list)
    by_free: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # by memory class
    by_id: list[str] = field(default_factory=list)
    max_memory: int = -1  # of the schedulable GPUs; -1: to be computed


class Fleet:
    """Every GPU's allocations and free space. `place` asks a policy and commits its answer;
    `release` gives the space back. Not thread-safe: the service serialises calls."""

    def __init__(
        self, rebuild_factor: int = REBUILD_FACTOR, rebuild_slack: int = REBUILD_SLACK
    ) -> None:
        if rebuild_factor < 1 or rebuild_slack < 0:
            raise ValueError("rebuild_factor must be >= 1 and rebuild_slack >= 0")
        self.rebuild_factor = rebuild_factor
        self.rebuild_slack = rebuild_slack
        self.rebuilds = 0  # free lists rebuilt past the threshold, for tests and metrics
        self._gpus: dict[str, GpuSlot] = {}
        self._models: dict[str, ModelIndex] = {}
        self._where: dict[str, str] = {}  # allocation id -> gpu id
        self._holders: dict[HolderGroup, list[str]] = {}
        self._resident: dict[str, set[str]] = {}  # shared model -> GPUs whose store holds it
        self._nodes: dict[str, NodeSlot] = {}
        self._gangs: dict[str, set[str]] = {}  # job id -> its allocations on further GPUs
        # Time-slice group key -> its members' ids (allocations with slice_of set). A group
        # key is live on one GPU at a time, so it names the group fleet-wide.
        self._slices: dict[str, set[str]] = {}
        # What changed, for readers that keep their own view of the fleet (the fleet policies'
        # adapter): the nodes touched by each change, in order, and a count of changes to
        # the set of GPUs. `touched_since` reads them.
        self.topology = 0
        self._journal: list[str] = []
        self._journal_start = 0  # the position of _journal[0] in the whole history

    # --- building -------------------------------------------------------------------------

    @classmethod
    def from_allocations(
        cls,
        gpus: Iterable[GpuState],
        rebuild_factor: int = REBUILD_FACTOR,
        rebuild_slack: int = REBUILD_SLACK,
    ) -> Fleet:
        """The fleet as a restarted service reloads it: each GPU with its stored allocations."""
        fleet = cls(rebuild_factor, rebuild_slack)
        for gpu in gpus:
            fleet.add_gpu(gpu)
        return fleet

    def add_gpu(self, gpu: GpuState) -> None:
        """Register a GPU with the allocations it already holds. Allocations with a rectangle
        keep it; those without one (old records) are placed first-fit after them."""
        gpu.validate()
        if gpu.gpu_id in self._gpus:
            raise InvalidStateError(f"GPU {gpu.gpu_id} is already registered")
        slot = GpuSlot(
            gpu.gpu_id,
            gpu.node,
            gpu.model,
            gpu.memory_bytes,
            gpu.sm_count,
            gpu.schedulable,
            node_cpu_milli=gpu.node_cpu_milli,
            node_memory_bytes=gpu.node_memory_bytes,
        )
        placed = _load_allocations(slot, _charged_in_turns(gpu.allocations), self._where)
        # A group key names one group: none of these may be live on another GPU.
        for group in {k for a in placed for k in (a.allocation_id, a.slice_group)}:
            elsewhere = self._group_gpu(group)
            if elsewhere is not None:
                raise InvalidStateError(
                    f"time-slice group {group} has allocations on GPUs {elsewhere} and {gpu.gpu_id}"
                )
        _load_models(slot, gpu.models)
        slot.free = FreeRects.build(slot.boxes.values())
        node = self._nodes.get(slot.node)
        if node is None:
            node = self._nodes[slot.node] = NodeSlot(slot.node)
        node.cpu_milli, node.memory_bytes = gpu.node_cpu_milli, gpu.node_memory_bytes
        insort(node.gpu_ids, slot.gpu_id)
        for allocation in placed:
            self._where[allocation.allocation_id] = slot.gpu_id
            node.cpu_used += allocation.cpu_milli
            node.memory_used += allocation.host_memory_bytes
            if allocation.gang:
                self._gangs.setdefault(allocation.gang, set()).add(allocation.allocation_id)
            if allocation.slice_of:
                self._slices.setdefault(allocation.slice_of, set()).add(allocation.allocation_id)
        self._gpus[slot.gpu_id] = slot
        self.topology += 1
        self._touch(slot.node)
        index = self._models.get(slot.model)
        if index is None:
            index = self._models[slot.model] = ModelIndex(slot.model)
        index.gpu_ids.add(slot.gpu_id)
        if slot.schedulable:
            self._index(slot)
        self._update_holder(slot)
        for name in slot.models:
            self._resident.setdefault(name, set()).add(slot.gpu_id)

    def remove_gpu(self, gpu_id: str) -> tuple[Allocation, ...]:
        """Forget a GPU; returns the allocations it held (now gone)."""
        slot = self._slot(gpu_id)
        if slot.schedulable:
            self._unindex(slot)
        self._set_holder(slot, None)
        index = self._models[slot.model]
        index.gpu_ids.discard(gpu_id)
        if not index.gpu_ids:
            del self._models[slot.model]
        node = self._nodes[slot.node]
        _remove(node.gpu_ids, gpu_id)
        for allocation_id, allocation in slot.allocations.items():
            del self._where[allocation_id]
            node.cpu_used -= allocation.cpu_milli
            node.memory_used -= allocation.host_memory_bytes
            if allocation.gang:
                members = self._gangs[allocation.gang]
                members.discard(allocation_id)
                if not members:
                    del self._gangs[allocation.gang]
            if allocation.slice_of:
                self._leave_slice(allocation)
        if not node.gpu_ids:
            del self._nodes[slot.node]
        self._unresident(gpu_id, slot.models)
        del self._gpus[gpu_id]
        self.topology += 1
        self._touch(slot.node)
        return tuple(slot.allocations.values())

    def set_models(self, gpu_id: str, models: Iterable[tuple[str, int]]) -> None:
        """The models the GPU's store holds now, as (name, device bytes): their bytes are used
        memory, once, and replicas of them are charged less here. InvalidRequestError for a bad
        name or size, InvalidStateError when they do not fit beside the allocations; either
        way nothing changes."""
        slot = self._slot(gpu_id)
        new = check_models(models)
        store = sum(new.values())
        allocated = slot.memory_used - slot.store_bytes
        if allocated + store > slot.memory_bytes:
            raise InvalidStateError(
                f"GPU {gpu_id}: its store's {describe_gib(store)} of models do not fit beside "
                f"the {describe_gib(allocated)} allocated of {describe_gib(slot.memory_bytes)}"
            )
        if new == slot.models:
            return
        before = self._before(slot)
        self._unresident(gpu_id, slot.models.keys() - new.keys())
        for name in new.keys() - slot.models.keys():
            self._resident.setdefault(name, set()).add(gpu_id)
        slot.memory_free += slot.store_bytes - store
        slot.models = new
        slot.store_bytes = store
        self._after(slot, before)

    def set_schedulable(self, gpu_id: str, schedulable: bool) -> None:
        """An unschedulable GPU keeps its allocations (they can be released) but takes no job."""
        slot = self._slot(gpu_id)
        if slot.schedulable == schedulable:
            return
        self._touch(slot.node)
        if schedulable:
            slot.schedulable = True
            self._index(slot)
        else:
            self._unindex(slot)
            slot.schedulable = False

    # --- deciding -------------------------------------------------------------------------

    def place(
        self,
        job: JobRequest,
        policy: PlacementPolicy,
        context: PlacementContext = NO_PROFILES,
    ) -> Placement | Unplaceable:
        """Ask `policy` where `job` goes, offering it `context`, and commit the allocation;
        Unplaceable changes nothing."""
        job.validate()
        for a_id in (job.job_id, *(gang_member_id(job.job_id, i) for i in range(1, job.gpus))):
            taken = self._id_taken(a_id)
            if taken:
                raise InvalidRequestError(taken)
        decision: Placement | Unplaceable | None = None
        if job.gpus > 1:  # whole GPUs (JobRequest.validate refuses a shared model with them)
            decision = self._place_gang(job, policy, context)
        elif job.shared_model:
            decision = self._place_beside_model(job, policy, context)
        if decision is None and job.needs_node:
            decision = self._place_on_nodes(job, policy, context)
        elif decision is None:
            decision = policy.place(job, self, context)
        if isinstance(decision, Unplaceable):
            return decision
        self._commit(job, decision)
        return decision

    def slice_into(
        self, job: JobRequest, gpu_id: str, group: str, memory_in_turns: bool = False
    ) -> Allocation:
        """Commit `job` on `gpu_id` as a member of time-slice group `group` (the id of the
        group's first allocation, see Allocation.slice_group): it sits in the group's rectangle,
        taking turns with the group's jobs, and holds only its memory and its node's CPU and
        host memory. With `memory_in_turns` (the GPU's dispatcher moves a suspended member's
        memory to host memory) the group's memory is taken in turns too: the group holds its
        largest member's memory, not the sum, so the job is charged only what it needs beyond
        that (Allocation.turn_memory_bytes). Returns the allocation. InvalidRequestError for a
        job field that makes no sense; InvalidPlacementError naming the problem when it cannot
        join (nothing changes): a job on several GPUs (see slice_gang_into) or a shared model's
        replica, an id already held (or a live group's key), an unknown or unschedulable GPU,
        no allocation of the group there, a GPU of another model, a quota x SM larger than the
        group's rectangle, too little free memory, or a node short of the job's CPU or host
        memory."""
        job.validate()
        slot = self._gpus.get(gpu_id)
        problem = ""
        if job.gpus != 1:
            problem = (
                f"it asks for {job.gpus} whole GPUs (a member takes turns on one; "
                "slice_gang_into joins a group on each)"
            )
        elif job.shared_model:
            problem = f"it is a replica of shared model {job.shared_model} (placed beside it)"
        elif taken := self._id_taken(job.job_id):
            problem = taken
        else:
            problem = self._join_problem(job, slot, group, memory_in_turns)
        if not problem and slot is not None and not self._nodes[slot.node].takes(job):
            problem = self._node_problem(job, slot.node, "has not")
        if problem or slot is None:
            raise InvalidPlacementError(
                f"job {job.job_id} cannot join time-slice group {group!r} on GPU {gpu_id}: "
                f"{problem}"
            )
        allocation = self._member(job, slot, group, job.job_id, True, memory_in_turns)
        self._occupy(slot, allocation, slot.boxes[group])
        return allocation

    def slice_gang_into(
        self, job: JobRequest, groups: Sequence[tuple[str, str]], memory_in_turns: bool = False
    ) -> tuple[Allocation, ...]:
        """Commit `job`, on `job.gpus` >= 2 whole GPUs of one node, as a member of a time-slice
        group on each: `groups` lists (gpu_id, group) pairs, the group of an allocation on that
        GPU (a running gang `host`'s are ("gpu0", "host"), ("gpu1", "host#1")...). The first
        pair's allocation has the job's id and holds its CPU and host memory; the i-th further
        one is `gang_member_id(job.job_id, i)` with `gang` the job id, as `place` gives a gang;
        each sits in its group's rectangle and holds `job.memory_bytes` of its GPU. Returns the
        allocations in the order of `groups`; `release(job.job_id)` gives them all back.
        InvalidRequestError for a job field or a pair that makes no sense; InvalidPlacementError
        naming the GPU and the problem when it cannot join (all or nothing: nothing changes):
        a one-GPU job (see slice_into), not one pair per GPU it asks for, a GPU named twice,
        GPUs of different nodes, any id of the job held (or a live group's key), and per GPU
        what slice_into refuses (unknown, unschedulable, no allocation of the group there,
        another model, a rectangle smaller than the whole GPU, too little free memory), or the
        node short of the job's CPU or host memory. `memory_in_turns`: as for slice_into, on
        each GPU."""
        job.validate()
        pairs = tuple(groups)
        for pair in pairs:
            if not (
                isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(v, str) for v in pair)
            ):
                raise InvalidRequestError(f"groups must hold (gpu_id, group) pairs, got {pair!r}")
        named = ", ".join(f"{group!r} on GPU {gpu_id}" for gpu_id, group in pairs)
        ids = [job.job_id, *(gang_member_id(job.job_id, i) for i in range(1, len(pairs)))]
        slots = [self._gpus.get(gpu_id) for gpu_id, _ in pairs]
        problem = ""
        if job.gpus < 2:
            problem = "it asks for one GPU (slice_into joins one group)"
        elif len(pairs) != job.gpus:
            problem = f"it asks for {job.gpus} GPUs, {len(pairs)} are named"
        elif len({gpu_id for gpu_id, _ in pairs}) != len(pairs):
            twice = sorted({g for g, _ in pairs if sum(g == h for h, _ in pairs) > 1})
            problem = f"GPU {', '.join(twice)} is named twice (a job takes distinct GPUs)"
        else:
            problem = next(filter(None, map(self._id_taken, ids)), "")
        for (gpu_id, group), slot in zip(pairs, slots, strict=True):
            if problem:
                break
            reason = self._join_problem(job, slot, group, memory_in_turns)
            if reason:
                problem = f"GPU {gpu_id}: {reason}"
        node = slots[0].node if slots and slots[0] is not None else ""
        for (gpu_id, _), slot in zip(pairs, slots, strict=True):
            if problem:
                break
            if slot is not None and slot.node != node:
                problem = (
                    f"GPU {gpu_id} is on node {slot.node}, GPU {pairs[0][0]} on {node} "
                    "(a job's GPUs are one node's)"
                )
        if not problem and not self._nodes[node].takes(job):
            problem = self._node_problem(job, node, "has not")
        if problem:
            raise InvalidPlacementError(
                f"job {job.job_id} cannot join time-slice groups {named}: {problem}"
            )
        joined = []
        for i, ((_, group), slot) in enumerate(zip(pairs, slots, strict=True)):
            assert slot is not None
            allocation = self._member(job, slot, group, ids[i], i == 0, memory_in_turns)
            self._occupy(slot, allocation, slot.boxes[group])
            joined.append(allocation)
        return tuple(joined)

    def _join_problem(
        self, job: JobRequest, slot: GpuSlot | None, group: str, memory_in_turns: bool
    ) -> str:
        """Why `job` cannot join time-slice group `group` on this GPU ("" when it can), its
        node's CPU and host memory aside."""
        box = slot.boxes.get(group) if slot is not None and isinstance(group, str) else None
        if slot is None:
            return "the GPU is unknown"
        if not slot.schedulable:
            return "the GPU is not schedulable"
        if box is None:
            return "the GPU holds no allocation of that group"
        if not job.allows(slot.model):
            return f"the GPU is a {slot.model}, not a {job.gpu_model}"
        if job.nodes and slot.node not in job.nodes:
            return f"the GPU's node {slot.node} is not one of the job's nodes"
        if job.w > box[2] - box[0] or job.sm_percent > box[3] - box[1]:
            return (
                f"its {describe_shape(job.w, job.sm_percent)} does not fit in the group's "
                f"{rect_of(box).label()}"
            )
        need = _turn_charge(job.memory_bytes, slot, group) if memory_in_turns else job.memory_bytes
        if need > slot.memory_free:
            beside = " beyond its group's" if memory_in_turns else ""
            return (
                f"it needs {describe_gib(need)} of memory{beside}, the GPU has "
                f"{describe_gib(slot.memory_free)} free"
            )
        return ""

    @staticmethod
    def _member(
        job: JobRequest,
        slot: GpuSlot,
        group: str,
        allocation_id: str,
        first: bool,
        memory_in_turns: bool,
    ) -> Allocation:
        """The allocation `job` holds on `slot` as a member of `group`: on a job's first GPU
        its node resources, on a further one none and `gang` the job id; its memory taken in
        turns with the group's, or beside it."""
        return Allocation(
            allocation_id,
            job.sm_percent,
            job.quota_request_percent,
            _turn_charge(job.memory_bytes, slot, group) if memory_in_turns else job.memory_bytes,
            job.priority,
            job.task_key,
            rect_of(slot.boxes[group]),
            job.cpu_milli if first else 0,
            job.host_memory_bytes if first else 0,
            "" if first else job.job_id,
            slice_of=group,
            turn_memory_bytes=job.memory_bytes if memory_in_turns else 0,
        )

    def slice_members(self, group: str) -> tuple[str, ...]:
        """The ids of the live allocations of time-slice group `group`: its first allocation
        while held, then its members, sorted; () for no such group."""
        first = self._where.get(group)
        held = first is not None and not self._gpus[first].allocations[group].slice_of
        return ((group,) if held else ()) + tuple(sorted(self._slices.get(group, ())))

    def _id_taken(self, allocation_id: str) -> str:
        """Why a new allocation cannot have this id ("" when it can): it is held, or it is the
        key of a time-slice group whose members live on (a second group of that key would make
        the key name two)."""
        gpu_id = self._where.get(allocation_id)
        if gpu_id is not None:
            return f"job {allocation_id} already holds an allocation on GPU {gpu_id}"
        gpu_id = self._group_gpu(allocation_id)
        if gpu_id is not None:
            return f"{allocation_id} is the key of a time-slice group still held on GPU {gpu_id}"
        return ""

    def _group_gpu(self, group: str) -> str | None:
        """The GPU holding the allocation `group` or a member of the time-slice group of that
        key (None: neither is held)."""
        gpu_id = self._where.get(group)
        if gpu_id is not None:
            return gpu_id
        members = self._slices.get(group)
        return self._where[next(iter(members))] if members else None

    def _leave_slice(self, allocation: Allocation) -> None:
        members = self._slices[allocation.slice_of]
        members.discard(allocation.allocation_id)
        if not members:
            del self._slices[allocation.slice_of]

    def memory_need(self, job: JobRequest, gpu_id: str) -> int:
        """The memory `job` would be charged on the GPU (see GpuSlot.memory_need)."""
        return self._slot(gpu_id).memory_need(job)

    def resident(self, model: str) -> list[str]:
        """The GPUs whose store holds `model`, sorted (schedulable or not)."""
        return sorted(self._resident.get(model, ()))

    def _place_on_nodes(
        self, job: JobRequest, policy: PlacementPolicy, context: PlacementContext
    ) -> Placement | Unplaceable:
        """Ask the policy with the GPUs of nodes short of the job's CPU or host memory left
        out of the indexes for this one decision."""
        short = [n for n in self._nodes.values() if not n.takes(job)]
        with self._hidden(job, short):
            decision = policy.place(job, self, context)
        if isinstance(decision, Unplaceable) and short:
            return Unplaceable(job.job_id, self._node_reason(job, decision.reason))
        return decision

    @contextlib.contextmanager
    def _hidden(self, job: JobRequest, nodes: Iterable[NodeSlot]) -> Iterator[None]:
        """The GPUs of `nodes` (those the job could use) out of the indexes meanwhile."""
        hidden = [
            g
            for n in nodes
            for g in n.gpu_ids
            if self._gpus[g].schedulable and job.allows(self._gpus[g].model)
        ]
        for gpu_id in hidden:
            self.set_schedulable(gpu_id, False)
        try:
            yield
        finally:
            for gpu_id in hidden:
                self.set_schedulable(gpu_id, True)

    def _node_problem(self, job: JobRequest, name: str, lead: str = "without") -> str:
        """Why node `name` does not take `job` (its GPU was named for it)."""
        if job.nodes and name not in job.nodes:
            return f"node {name}, not one of the job's nodes ({_names(job.nodes)})"
        return f"node {name} {lead} {self.describe_node_ask(job)} free"

    def _node_reason(self, job: JobRequest, reason: str) -> str:
        if job.nodes:
            shown = _names(job.nodes)
            if not any(name in self._nodes for name in job.nodes):
                return f"none of its nodes ({shown}) has a registered GPU"
            if not (job.cpu_milli or job.host_memory_bytes):
                return f"{reason}, on its nodes ({shown})" if reason else f"no room on {shown}"
        asks = self.describe_node_ask(job)
        if all(not n.takes(job) for n in self._nodes.values()):
            largest = max(
                self._nodes.values(), key=lambda n: (n.cpu_free, n.memory_free), default=None
            )
            most = (
                ""
                if largest is None
                else f" (the most free: {largest.cpu_free} milli CPU and "
                f"{describe_gib(largest.memory_free)} on node {largest.name})"
            )
            return f"no node has {asks} free{most}"
        return f"{reason}, on the nodes that have {asks} free"

    @staticmethod
    def describe_node_ask(job: JobRequest) -> str:
        parts = []
        if job.cpu_milli:
            parts.append(f"{job.cpu_milli} milli CPU")
        if job.host_memory_bytes:
            parts.append(f"{describe_gib(job.host_memory_bytes)} of host memory")
        return " and ".join(parts) or "no CPU or host memory"

    def _place_gang(
        self, job: JobRequest, policy: PlacementPolicy, context: PlacementContext
    ) -> Placement | Unplaceable:
        place_gang = getattr(policy, "place_gang", None)
        if place_gang is None:
            return self.pack_gang(job, policy.name)
        if not job.nodes:
            return place_gang(job, self, context)  # type: ignore[no-any-return]
        others = [n for n in self._nodes.values() if n.name not in job.nodes]
        with self._hidden(job, others):
            decision = place_gang(job, self, context)
        if isinstance(decision, Unplaceable):
            return self.gang_unplaceable(job)
        return decision  # type: ignore[no-any-return]

    def whole_free_gpus(self, node: NodeSlot, job: JobRequest) -> list[str]:
        """The node's GPUs a job may take whole now (schedulable, of its models, nothing on
        them, its memory), by id."""
        gpus = self._gpus
        return [
            g
            for g in node.gpu_ids
            if (slot := gpus[g]).schedulable
            and not slot.allocations
            and job.allows(slot.model)
            and slot.memory_free >= job.memory_bytes
        ]

    def pack_gang(self, job: JobRequest, policy_name: str) -> Placement | Unplaceable:
        """The default choice of `job.gpus` whole GPUs: the node left with the fewest whole
        free GPUs (ties by node name), its GPUs with the lowest ids."""
        best: tuple[int, str, list[str]] | None = None
        for name in sorted(self._nodes):
            node = self._nodes[name]
            if not node.takes(job):
                continue
            free = self.whole_free_gpus(node, job)
            if len(free) >= job.gpus and (best is None or len(free) < best[0]):
                best = (len(free), name, free)
        if best is None:
            return self.gang_unplaceable(job)
        chosen = best[2][: job.gpus]
        return Placement(
            job.job_id,
            chosen[0],
            best[1],
            Rect(0, 0, GRID_W, GRID_H),
            policy_name,
            tuple(chosen[1:]),
        )

    def gang_unplaceable(self, job: JobRequest) -> Unplaceable:
        """Why no node takes the job's whole GPUs now."""
        of_model = f" of model {job.gpu_model}" if job.gpu_model else ""
        most = max(
            (sum(job.allows(self._gpus[g].model) for g in n.gpu_ids) for n in self._nodes.values()),
            default=0,
        )
        if most < job.gpus:
            return Unplaceable(
                job.job_id,
                f"needs {job.gpus} GPUs{of_model} on one node; the largest node has {most}",
            )
        fitting = [n for n in self._nodes.values() if n.takes(job)]
        if not fitting:
            return Unplaceable(job.job_id, self._node_reason(job, ""))
        free = max(len(self.whole_free_gpus(n, job)) for n in fitting)
        where = f" of its nodes ({_names(job.nodes)})" if job.nodes else ""
        return Unplaceable(
            job.job_id,
            f"no node{where} has {job.gpus} whole GPUs{of_model} free"
            f"{' with ' + describe_gib(job.memory_bytes) if job.memory_bytes else ''} "
            f"(the most: {free})",
        )

    def max_gpus_per_node(self, gpu_model: str = "") -> int:
        """The most GPUs (of the models the constraint admits) any one node has."""
        probe = JobRequest("probe", 100, 100, 0, gpu_model=gpu_model)
        return max(
            (
                sum(probe.allows(self._gpus[g].model) for g in n.gpu_ids)
                for n in self._nodes.values()
            ),
            default=0,
        )

    def release(self, allocation_id: str) -> Allocation | None:
        """Give an allocation's space back; None when there is no such allocation (already
        released), so a retried release is harmless."""
        for member in sorted(self._gangs.pop(allocation_id, ())):
            self._release_one(member)
        return self._release_one(allocation_id)

    def _release_one(self, allocation_id: str) -> Allocation | None:
        gpu_id = self._where.pop(allocation_id, None)
        if gpu_id is None:
            return None
        slot = self._gpus[gpu_id]
        allocation = slot.allocations.pop(allocation_id)
        node = self._nodes[slot.node]
        node.cpu_used -= allocation.cpu_milli
        node.memory_used -= allocation.host_memory_bytes
        if allocation.gang:
            members = self._gangs.get(allocation.gang)
            if members is not None:
                members.discard(allocation_id)
                if not members:
                    del self._gangs[allocation.gang]
        if allocation.slice_of:
            self._leave_slice(allocation)
        group = allocation.slice_group
        if group in slot.allocations or group in self._slices:
            # Its time-slice group lives on in the same box: only the memory comes back (taken
            # in turns: the group's charge becomes its largest remaining member's).
            before = self._before(slot)
            slot.memory_free += allocation.memory_bytes
            if allocation.turn_memory_bytes or any(
                a.turn_memory_bytes for a in slot.allocations.values() if a.slice_group == group
            ):
                slot.memory_free += _recharge_in_turns(slot.allocations, group)
            self._after(slot, before)
            self._update_holder(slot)
            return allocation
        box = slot.boxes.pop(group)
        before = self._before(slot)
        slot.free.vacate(box, slot.boxes.values())
        # Only kept rectangles make the list longer than the maximal set, so only they warrant
        # a rebuild (a crowded GPU can have more maximal rectangles than the threshold).
        limit = self.rebuild_factor * len(slot.boxes) + self.rebuild_slack
        if slot.free.kept and len(slot.free) > limit:
            slot.free.rebuild(slot.boxes.values())
            self.rebuilds += 1
        slot.memory_free += allocation.memory_bytes
        slot.area_free += box_area(box)
        self._after(slot, before)
        self._update_holder(slot)
        return allocation

    # --- reading --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._gpus)

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self._gpus

    def touched_since(self, cursor: int) -> tuple[list[str] | None, int]:
        """The nodes touched (a GPU's free space, memory, schedulability or models, the node's
        CPU or host memory, a GPU added or removed) since position `cursor` of the journal,
        in order, with repeats, and the position now; None when `cursor` is older than the
        journal keeps (read everything again)."""
        end = self._journal_start + len(self._journal)
        if cursor < self._journal_start or cursor > end:
            return None, end
        return self._journal[cursor - self._journal_start :], end

    def _touch(self, node: str) -> None:
        self._journal.append(node)
        if len(self._journal) > JOURNAL_KEEP:
            drop = len(self._journal) // 2
            del self._journal[:drop]
            self._journal_start += drop

    def gpu_ids(self) -> Iterator[str]:
        return iter(self._gpus)

    @property
    def slots(self) -> Mapping[str, GpuSlot]:
        """Every GPU's live record by id, for policies' inner loops; read, never change."""
        return self._gpus

    def slot(self, gpu_id: str) -> GpuSlot:
        """The live record of a GPU (KeyError if unknown); read it, never change it."""
        return self._gpus[gpu_id]

    def gpu(self, gpu_id: str) -> GpuState:
        """A snapshot of the GPU with its allocations (what the service stores)."""
        return self._slot(gpu_id).state()

    def snapshot(self) -> list[GpuState]:
        """Every GPU as `from_allocations` takes it back."""
        return [slot.state() for slot in self._gpus.values()]

    def allocations(self, gpu_id: str) -> tuple[Allocation, ...]:
        return tuple(self._slot(gpu_id).allocations.values())

    def allocation(self, allocation_id: str) -> Allocation | None:
        gpu_id = self._where.get(allocation_id)
        return None if gpu_id is None else self._gpus[gpu_id].allocations[allocation_id]

    def gpu_of(self, allocation_id: str) -> str | None:
        return self._where.get(allocation_id)

    def gpus_of(self, allocation_id: str) -> tuple[str, ...]:
        """Every GPU a job holds: its first, then those of its further allocations (those
        still held when its first GPU is gone)."""
        first = self._where.get(allocation_id)
        members = sorted(self._gangs.get(allocation_id, ()), key=_member_order)
        rest = tuple(self._where[m] for m in members)
        return rest if first is None else (first, *rest)

    @property
    def nodes(self) -> Mapping[str, NodeSlot]:
        """Every node's live record by name; read, never change."""
        return self._nodes

    def node(self, name: str) -> NodeSlot:
        return self._nodes[name]

    def free_rects(self, gpu_id: str) -> tuple[Rect, ...]:
        """The GPU's free-rectangle list (maximal, then kept), for display and tests."""
        return tuple(rect_of(b) for b in self._slot(gpu_id).free.boxes())

    def models(self) -> list[str]:
        return sorted(self._models)

    def indexes_for(self, gpu_model: str) -> list[ModelIndex]:
        """The indexes a job's model constraint admits ("" = every model, "A|B" either)."""
        if gpu_model:
            if "|" not in gpu_model:
                index = self._models.get(gpu_model)
                return [] if index is None else [index]
            wanted = set(model_alternatives(gpu_model))
            return [self._models[m] for m in sorted(wanted) if m in self._models]
        return [self._models[m] for m in sorted(self._models)]

    def holder_groups(self) -> dict[HolderGroup, list[str]]:
        """GPUs by who holds them: (task key of the highest-priority allocation, its priority,
        lower-priority allocations there); GPU ids sorted. Only holders with a task key.
        Read-only; unschedulable GPUs included."""
        return self._holders

    def unplaceable(self, job: JobRequest, w: int, h: int, shape_note: str = "") -> Unplaceable:
        """Why no GPU takes a w x h rectangle with the job's memory and model: the first of
        unknown model, nothing schedulable, too little memory anywhere, no room of that shape,
        no room of that shape with the memory."""
        indexes = self.indexes_for(job.gpu_model)
        of_model = f" of model {job.gpu_model}" if job.gpu_model else ""
        if not indexes:
            known = ", ".join(self.models()) or "none registered"
            return Unplaceable(job.job_id, f"no GPU{of_model} (models: {known})")
        live = [index for index in indexes if index.by_id]
        if not live:
            return Unplaceable(job.job_id, f"no schedulable GPU{of_model}")
        largest = max(self._max_memory(index) for index in live)
        if job.memory_bytes > largest:
            return Unplaceable(
                job.job_id,
                f"needs {describe_gib(job.memory_bytes)}, the largest GPU{of_model} has "
                f"{describe_gib(largest)}",
            )
        shape = describe_shape(w, h) + shape_note
        if not any(_has_shape(index.rects, w, h) for index in live):
            return Unplaceable(job.job_id, f"no GPU{of_model} has {shape} free")
        return Unplaceable(
            job.job_id,
            f"no GPU{of_model} has {shape} free together with "
            f"{describe_gib(job.memory_bytes)} of memory",
        )

    def verify(self) -> None:
        """Check every invariant (for tests and simulators); raise InvalidStateError."""
        slices: dict[str, set[str]] = {}
        groups: dict[str, str] = {}  # time-slice group key -> its GPU
        for slot in self._gpus.values():
            # A box per time-slice group (a lone allocation is a group of one), its members
            # all in it, and the area below counted once per group.
            for a_id, a in slot.allocations.items():
                if a.rect is None or slot.boxes.get(a.slice_group) != box_of(a.rect):
                    raise InvalidStateError(f"{slot.gpu_id}: {a_id} lies outside its group's box")
                first = slot.allocations.get(a.slice_of)
                if first is not None and first.slice_of:
                    raise InvalidStateError(f"{slot.gpu_id}: {a_id} joins a member's group")
                if a.slice_of:
                    slices.setdefault(a.slice_of, set()).add(a_id)
            if set(slot.boxes) != {a.slice_group for a in slot.allocations.values()}:
                raise InvalidStateError(f"{slot.gpu_id}: a box without an allocation")
            for group in slot.boxes:
                if groups.setdefault(group, slot.gpu_id) != slot.gpu_id:
                    raise InvalidStateError(f"time-slice group {group} spans GPUs")
            boxes = list(slot.boxes.items())
            for i, (a_id, a) in enumerate(boxes):
                if not (0 <= a[0] < a[2] <= GRID_W and 0 <= a[1] < a[3] <= GRID_H):
                    raise InvalidStateError(f"{slot.gpu_id}: {a_id} lies outside the GPU")
                for b_id, b in boxes[i + 1 :]:
                    if overlaps(a, b):
                        raise InvalidStateError(f"{slot.gpu_id}: {a_id} overlaps {b_id}")
            if slot.store_bytes != sum(slot.models.values()):
                raise InvalidStateError(f"{slot.gpu_id}: store bytes miscounted")
            memory = sum(a.memory_bytes for a in slot.allocations.values()) + slot.store_bytes
            if memory != slot.memory_used or memory > slot.memory_bytes:
                raise InvalidStateError(f"{slot.gpu_id}: memory over-committed or miscounted")
            if sum(box_area(b) for _, b in boxes) != slot.area_used:
                raise InvalidStateError(f"{slot.gpu_id}: used area miscounted")
            exact = maximal_boxes(b for _, b in boxes)
            if sorted(exact) != sorted(slot.free.maximal):
                raise InvalidStateError(f"{slot.gpu_id}: maximal rectangles drifted")
            for k in slot.free.kept:
                if not any(inside(k, m) for m in exact) or k in exact:
                    raise InvalidStateError(f"{slot.gpu_id}: kept rectangle {k} is wrong")
        for model, index in self._models.items():
            of_model = [self._gpus[g] for g in sorted(index.gpu_ids)]
            if any(s.model != model for s in of_model):
                raise InvalidStateError(f"model {model}: index holds another model's GPU")
            live = [s for s in of_model if s.schedulable]
            rects = sorted((box_area(b), s.gpu_id, b) for s in live for b in s.free.boxes())
            if index.rects != rects:
                raise InvalidStateError(f"model {model}: rectangle index drifted")
            by_free: dict[int, list[tuple[int, str]]] = {}
            for s in live:
                by_free.setdefault(memory_class(s.memory_free), []).append((s.area_free, s.gpu_id))
            if index.by_free != {c: sorted(keys) for c, keys in by_free.items()}:
                raise InvalidStateError(f"model {model}: free-area index drifted")
            if index.by_id != [s.gpu_id for s in live]:
                raise InvalidStateError(f"model {model}: GPU id index drifted")
        holders = Fleet()
        for slot in self._gpus.values():
            copy = GpuSlot(slot.gpu_id, "", slot.model, 1, 0, False, allocations=slot.allocations)
            holders._update_holder(copy)
        if holders._holders != self._holders:
            raise InvalidStateError("holder groups drifted")
        if {a: s.gpu_id for s in self._gpus.values() for a in s.allocations} != self._where:
            raise InvalidStateError("allocation ids drifted")
        resident: dict[str, set[str]] = {}
        for slot in self._gpus.values():
            for name in slot.models:
                resident.setdefault(name, set()).add(slot.gpu_id)
        if resident != self._resident:
            raise InvalidStateError("resident models drifted")
        for name, node in self._nodes.items():
            held = [a for g in node.gpu_ids for a in self._gpus[g].allocations.values()]
            if node.gpu_ids != sorted(g for g, s in self._gpus.items() if s.node == name):
                raise InvalidStateError(f"node {name}: GPU list drifted")
            if node.cpu_used != sum(a.cpu_milli for a in held) or node.memory_used != sum(
                a.host_memory_bytes for a in held
            ):
                raise InvalidStateError(f"node {name}: CPU or host memory miscounted")
            if node.cpu_used > node.cpu_milli or node.memory_used > node.memory_bytes:
                raise InvalidStateError(f"node {name}: CPU or host memory over-committed")
        gangs: dict[str, set[str]] = {}
        for s in self._gpus.values():
            for a in s.allocations.values():
                if a.gang:
                    gangs.setdefault(a.gang, set()).add(a.allocation_id)
        if gangs != self._gangs:
            raise InvalidStateError("jobs spanning GPUs drifted")
        if slices != self._slices:
            raise InvalidStateError("time-slice groups drifted")
        for a_id, gpu_id in self._where.items():
            if groups.get(a_id, gpu_id) != gpu_id:
                raise InvalidStateError(f"{a_id} is held on {gpu_id} and a group key elsewhere")

    # --- bookkeeping ----------------------------------------------------------------------

    def _slot(self, gpu_id: str) -> GpuSlot:
        slot = self._gpus.get(gpu_id)
        if slot is None:
            raise KeyError(f"unknown GPU {gpu_id!r}")
        return slot

    def _place_beside_model(
        self, job: JobRequest, policy: PlacementPolicy, context: PlacementContext
    ) -> Placement | None:
        """The job on a GPU where its shared model is resident, charged the reduced memory:
        the policy chooses among those GPUs (the smallest charge first, when copies of the
        model differ in size); None when none of them has room."""
        groups: dict[int, list[str]] = {}
        for gpu_id in self._resident.get(job.shared_model, ()):
            slot = self._gpus[gpu_id]
            # Only GPUs of the job's models, on nodes with the CPU and host memory it asks free.
            if slot.schedulable and job.allows(slot.model) and self._nodes[slot.node].takes(job):
                groups.setdefault(slot.memory_need(job), []).append(gpu_id)
        for need in sorted(groups):
            view = self._view(groups[need])
            # The view's GPUs all charge `need`: the policy sees a plain job of that memory.
            decision = policy.place(replace(job, memory_bytes=need, shared_model=""), view, context)
            if isinstance(decision, Placement):
                return decision
        return None

    def _view(self, gpu_ids: Iterable[str]) -> Fleet:
        """A fleet of only these (schedulable) GPUs, for a policy to read: their live records,
        indexed anew, and copies of their nodes' records listing only these GPUs. Never
        changed: decisions are committed to this fleet."""
        view = Fleet(self.rebuild_factor, self.rebuild_slack)
        for gpu_id in sorted(gpu_ids):
            slot = self._gpus[gpu_id]
            view._gpus[gpu_id] = slot
            index = view._models.get(slot.model)
            if index is None:
                index = view._models[slot.model] = ModelIndex(slot.model)
            index.gpu_ids.add(gpu_id)
            view._index(slot)
            if slot.holder is not None:
                insort(view._holders.setdefault(slot.holder, []), gpu_id)
            # The node's figures and use as they are, its GPUs only those of the view.
            node = self._nodes[slot.node]
            seen = view._nodes.get(node.name)
            if seen is None:
                seen = view._nodes[node.name] = replace(node, gpu_ids=[])
            seen.gpu_ids.append(gpu_id)
        return view

    def _unresident(self, gpu_id: str, names: Iterable[str]) -> None:
        for name in names:
            gpus = self._resident[name]
            gpus.discard(gpu_id)
            if not gpus:
                del self._resident[name]

    def _commit(self, job: JobRequest, placement: Placement) -> None:
        if job.gpus > 1 or placement.extra_gpu_ids:
            self._commit_gang(job, placement)
            return
        slot = self._gpus.get(placement.gpu_id)
        rect = placement.rect
        need = 0 if slot is None else slot.memory_need(job)
        problem = ""
        if slot is None:
            problem = "an unknown GPU"
        elif not slot.schedulable:
            problem = "an unschedulable GPU"
        elif not job.allows(slot.model):
            problem = f"a {slot.model}, not a {job.gpu_model}"
        elif not self._nodes[slot.node].takes(job):
            problem = self._node_problem(job, slot.node)
        elif need > slot.memory_free:
            problem = "a GPU without that much free memory"
        elif placement.allocation_id != job.job_id:
            problem = f"the allocation id {placement.allocation_id!r}"
        if not problem:
            try:
                rect.validate()
            except InvalidRequestError as error:
                problem = str(error)
        if not problem and (rect.w < job.w or rect.h < job.sm_percent):
            problem = f"the smaller rectangle {rect.label()}"
        if problem or slot is None:
            raise InvalidPlacementError(f"policy {placement.policy} put {job.job_id} on {problem}")
        box = box_of(rect)
        if not slot.free.is_free(box):
            raise InvalidPlacementError(
                f"policy {placement.policy} put {job.job_id} on taken space {rect.label()} of "
                f"{slot.gpu_id}"
            )
        allocation = Allocation(
            job.job_id,
            job.sm_percent,
            job.quota_request_percent,
            need,
            job.priority,
            job.task_key,
            rect,
            job.cpu_milli,
            job.host_memory_bytes,
        )
        self._occupy(slot, allocation, box)

    def _occupy(self, slot: GpuSlot, allocation: Allocation, box: Box) -> None:
        """Commit a checked allocation in `box`: free space, or its time-slice group's box."""
        before = self._before(slot)
        a_id = allocation.allocation_id
        if allocation.slice_of:
            self._slices.setdefault(allocation.slice_of, set()).add(a_id)
        else:
            slot.free.occupy(box)
            slot.boxes[a_id] = box
            slot.area_free -= box_area(box)
        slot.allocations[a_id] = allocation
        slot.memory_free -= allocation.memory_bytes
        self._where[a_id] = slot.gpu_id
        node = self._nodes[slot.node]
        node.cpu_used += allocation.cpu_milli
        node.memory_used += allocation.host_memory_bytes
        if allocation.gang:
            self._gangs.setdefault(allocation.gang, set()).add(a_id)
        self._after(slot, before)
        self._update_holder(slot)

    def _commit_gang(self, job: JobRequest, placement: Placement) -> None:
        """All of a job's whole GPUs, or none (checked before anything changes)."""
        ids = placement.gpu_ids
        problem = ""
        if len(ids) != job.gpus or len(set(ids)) != len(ids):
            problem = f"{len(set(ids))} distinct GPUs, not {job.gpus}"
        elif placement.allocation_id != job.job_id:
            problem = f"the allocation id {placement.allocation_id!r}"
        elif placement.rect != Rect(0, 0, GRID_W, GRID_H):
            problem = f"a part of a GPU ({placement.rect.label()})"
        slots = [self._gpus.get(g) for g in ids]
        for gpu_id, slot in zip(ids, slots, strict=True):
            if problem:
                break
            if slot is None:
                problem = f"an unknown GPU {gpu_id}"
            elif not slot.schedulable or slot.allocations or not job.allows(slot.model):
                problem = f"GPU {gpu_id}, not whole, free and of its model"
            elif slot.memory_free < job.memory_bytes:
                problem = f"GPU {gpu_id} without that much free memory"
            elif slot.node != placement.node:
                problem = f"GPU {gpu_id} of node {slot.node}, not {placement.node}"
        if not problem and not self._nodes[placement.node].takes(job):
            problem = self._node_problem(job, placement.node)
        if problem:
            raise InvalidPlacementError(f"policy {placement.policy} put {job.job_id} on {problem}")
        box = box_of(placement.rect)
        for i, slot in enumerate(slots):
            assert slot is not None
            first = i == 0
            self._occupy(
                slot,
                Allocation(
                    job.job_id if first else gang_member_id(job.job_id, i),
                    job.sm_percent,
                    job.quota_request_percent,
                    job.memory_bytes,
                    job.priority,
                    job.task_key,
                    placement.rect,
                    job.cpu_milli if first else 0,
                    job.host_memory_bytes if first else 0,
                    "" if first else job.job_id,
                ),
                box,
            )

    def _before(self, slot: GpuSlot) -> tuple[set[Box], tuple[int, str], int] | None:
        if not slot.schedulable:
            return None
        return set(slot.free.boxes()), (slot.area_free, slot.gpu_id), slot.memory_free

    def _after(self, slot: GpuSlot, before: tuple[set[Box], tuple[int, str], int] | None) -> None:
        self._touch(slot.node)
        if before is None:
            return
        old_boxes, old_key, old_memory = before
        new_boxes = set(slot.free.boxes())
        index = self._models[slot.model]
        gpu_id = slot.gpu_id
        for box in old_boxes - new_boxes:
            _remove(index.rects, (box_area(box), gpu_id, box))
        for box in new_boxes - old_boxes:
            insort(index.rects, (box_area(box), gpu_id, box))
        _unfree(index, old_key, old_memory)
        _free(index, (slot.area_free, gpu_id), slot.memory_free)

    def _index(self, slot: GpuSlot) -> None:
        self._file(slot, insort, _free)

    def _unindex(self, slot: GpuSlot) -> None:
        self._file(slot, _remove, _unfree)

    def _file(
        self,
        slot: GpuSlot,
        put: Callable[[list, object], None],
        count: Callable[[ModelIndex, tuple[int, str], int], None],
    ) -> None:
        """Put `slot`'s free boxes, free counts and id into its model's index (insort, _free)
        or take them out (_remove, _unfree)."""
        index = self._models[slot.model]
        for box in slot.free.boxes():
            put(index.rects, (box_area(box), slot.gpu_id, box))
        count(index, (slot.area_free, slot.gpu_id), slot.memory_free)
        put(index.by_id, slot.gpu_id)
        index.max_memory = -1

    def _max_memory(self, index: ModelIndex) -> int:
        # GPUs come and go rarely; decisions that fail may come often.
        if index.max_memory < 0:
            index.max_memory = max(self._gpus[g].memory_bytes for g in index.by_id)
        return index.max_memory

    def _update_holder(self, slot: GpuSlot) -> None:
        group: HolderGroup | None = None
        if slot.allocations:
            holder = min(slot.allocations.values(), key=lambda a: (a.priority, a.allocation_id))
            if holder.task_key:
                fillers = sum(a.priority > holder.priority for a in slot.allocations.values())
                group = (holder.task_key, holder.priority, fillers)
        self._set_holder(slot, group)

    def _set_holder(self, slot: GpuSlot, group: HolderGroup | None) -> None:
        if group == slot.holder:
            return
        if slot.holder is not None:
            members = self._holders[slot.holder]
            _remove(members, slot.gpu_id)
            if not members:
                del self._holders[slot.holder]
        if group is not None:
            insort(self._holders.setdefault(group, []), slot.gpu_id)
        slot.holder = group


def _names(nodes: Iterable[str], shown: int = 3) -> str:
    """'a, b, c and 4 more'."""
    names = sorted(nodes)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _member_order(member_id: str) -> int:
    return int(member_id.rsplit("#", 1)[1])


def memory_class(memory_free: int) -> int:
    """GPUs in class c have 2**(c-1) <= free memory < 2**c bytes (class 0: none free)."""
    return memory_free.bit_length()


def memory_classes(index: ModelIndex, need: int) -> list[int]:
    """The classes that may hold `need` bytes, most memory first; all but the last surely do."""
    least = memory_class(need)
    return sorted((c for c in index.by_free if c >= least), reverse=True)


def _free(index: ModelIndex, key: tuple[int, str], memory_free: int) -> None:
    insort(index.by_free.setdefault(memory_class(memory_free), []), key)


def _unfree(index: ModelIndex, key: tuple[int, str], memory_free: int) -> None:
    c = memory_class(memory_free)
    keys = index.by_free[c]
    _remove(keys, key)
    if not keys:
        del index.by_free[c]


def _has_shape(rects: list[tuple[int, str, Box]], w: int, h: int) -> bool:
    for i in range(bisect_left(rects, (w * h,)), len(rects)):
        box = rects[i][2]
        if box[2] - box[0] >= w and box[3] - box[1] >= h:
            return True
    return False


def _load_models(slot: GpuSlot, models: Iterable[tuple[str, int]]) -> None:
    """Put the store's models on a slot its allocations are loaded on (InvalidStateError if
    they do not fit beside them)."""
    slot.models = check_models(models)
    slot.store_bytes = sum(slot.models.values())
    if slot.store_bytes > slot.memory_free:
        raise InvalidStateError(
            f"GPU {slot.gpu_id}: its store's {describe_gib(slot.store_bytes)} of models do not "
            f"fit beside its allocations"
        )
    slot.memory_free -= slot.store_bytes


def _turn_charge(memory_bytes: int, slot: GpuSlot, group: str) -> int:
    """What a job running with `memory_bytes` adds to time-slice group `group`'s memory when
    its members take their memory in turns: the group holds its largest member's."""
    held = sum(a.memory_bytes for a in slot.allocations.values() if a.slice_group == group)
    return max(0, memory_bytes - held)


def _spread_in_turns(members: Sequence[Allocation]) -> list[Allocation]:
    """A time-slice group's allocations charged in turns: the one running with the most memory
    is charged all of it, the others nothing (the group holds its largest member's memory)."""
    if not members:
        return []
    largest = max(members, key=lambda a: (a.runs_with_bytes, a.allocation_id))
    return [
        replace(
            a,
            memory_bytes=a.runs_with_bytes if a is largest else 0,
            turn_memory_bytes=a.runs_with_bytes,
        )
        for a in members
    ]


def _recharge_in_turns(allocations: dict[str, Allocation], group: str) -> int:
    """Charge group `group`'s allocations (in `allocations`, changed in place) in turns after
    a member left; returns the memory that comes free."""
    members = [a for a in allocations.values() if a.slice_group == group]
    before = sum(a.memory_bytes for a in members)
    for a in _spread_in_turns(members):
        allocations[a.allocation_id] = a
    return before - max((a.runs_with_bytes for a in members), default=0)


def _charged_in_turns(allocations: Iterable[Allocation]) -> list[Allocation]:
    """Stored allocations with the memory of each time-slice group that holds a member in turns
    charged once, at its largest member's (the stored charges may predate a member's end)."""
    listed = list(allocations)
    groups = {a.slice_group for a in listed if a.turn_memory_bytes}
    if not groups:
        return listed
    spread = {
        a.allocation_id: a
        for group in groups
        for a in _spread_in_turns([m for m in listed if m.slice_group == group])
    }
    return [spread.get(a.allocation_id, a) for a in listed]


def _load_allocations(
    slot: GpuSlot, allocations: Iterable[Allocation], taken: dict[str, str]
) -> list[Allocation]:
    """Put stored allocations on a fresh slot: positioned ones first, then the rest first-fit.
    Raises InvalidStateError if they cannot all be there."""
    pending: list[Allocation] = []
    placed: list[Allocation] = []
    seen: set[str] = set()
    for allocation in allocations:
        a_id = allocation.allocation_id
        if a_id in taken or a_id in seen:
            raise InvalidStateError(f"allocation {a_id} appears twice")
        seen.add(a_id)
        if allocation.rect is None:
            pending.append(allocation)
            continue
        box = box_of(allocation.rect)
        group = allocation.slice_group
        held = slot.boxes.get(group)
        if held is None:
            for other_id, other in slot.boxes.items():
                if overlaps(box, other):
                    raise InvalidStateError(
                        f"GPU {slot.gpu_id}: allocations {other_id} and {a_id} overlap"
                    )
            slot.boxes[group] = box
        elif held != box:
            raise InvalidStateError(
                f"GPU {slot.gpu_id}: allocation {a_id} of time-slice group {group} sits in "
                f"{allocation.rect.label()}, not in the group's {rect_of(held).label()}"
            )
        slot.allocations[a_id] = allocation
        placed.append(allocation)
    free = FreeRects.build(slot.boxes.values())
    # A group with no rectangle stored is placed once, in a box that holds each of its shapes.
    shapes: dict[str, tuple[int, int]] = {}
    for allocation in pending:
        w, h = shapes.get(allocation.slice_group, (0, 0))
        shapes[allocation.slice_group] = (
            max(w, quota_steps(allocation.quota_percent)),
            max(h, allocation.sm_percent),
        )
    for allocation in pending:
        w, h = quota_steps(allocation.quota_percent), allocation.sm_percent
        group = allocation.slice_group
        held = slot.boxes.get(group)
        if held is not None:
            # A member (or a group's first) without a rectangle joins its group's.
            if held[2] - held[0] < w or held[3] - held[1] < h:
                raise InvalidStateError(
                    f"GPU {slot.gpu_id}: allocation {allocation.allocation_id} "
                    f"({describe_shape(w, h)}) does not fit in its time-slice group {group}'s "
                    f"{rect_of(held).label()}"
                )
            box = held
        else:
            w, h = shapes[group]
            spot = free.first_fit(w, h)
            if spot is None:
                raise InvalidStateError(
                    f"GPU {slot.gpu_id}: no room left for allocation {allocation.allocation_id} "
                    f"({describe_shape(w, h)})"
                )
            box = (spot[0], spot[1], spot[0] + w, spot[1] + h)
            free.occupy(box)
            slot.boxes[group] = box
        allocation = replace(allocation, rect=rect_of(box))  # node figures, gang, group kept
        slot.allocations[allocation.allocation_id] = allocation
        placed.append(allocation)
    for allocation in placed:
        first = slot.allocations.get(allocation.slice_of)
        if first is not None and first.slice_of:
            raise InvalidStateError(
                f"GPU {slot.gpu_id}: allocation {allocation.allocation_id} joins time-slice "
                f"group {allocation.slice_of}, itself a member of group {first.slice_of}"
            )
    memory = sum(a.memory_bytes for a in placed)
    if memory > slot.memory_bytes:
        raise InvalidStateError(
            f"GPU {slot.gpu_id}: allocations hold {describe_gib(memory)} of "
            f"{describe_gib(slot.memory_bytes)}"
        )
    slot.memory_free = slot.memory_bytes - memory
    slot.area_free = GRID_AREA - sum(box_area(b) for b in slot.boxes.values())
    return placed
