"""`Fleet`: every GPU's allocations and free space, and `place` / `release`; its parts by
responsibility are mixed in from the package's other modules."""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

from gpuloom.policies.placement.context import NO_PROFILES, PlacementContext
from gpuloom.policies.placement.fleet.gangs import Gangs
from gpuloom.policies.placement.fleet.indexes import (
    ModelIndex,
    _has_shape,
)
from gpuloom.policies.placement.fleet.indexing import Indexing
from gpuloom.policies.placement.fleet.nodes import Nodes
from gpuloom.policies.placement.fleet.policy import PlacementPolicy
from gpuloom.policies.placement.fleet.records import (
    JOURNAL_KEEP,
    REBUILD_FACTOR,
    REBUILD_SLACK,
    GpuSlot,
    HolderGroup,
    InvalidPlacementError,
    InvalidStateError,
    NodeSlot,
    _charged_in_turns,
    _load_allocations,
    _load_models,
    _member_order,
    _recharge_in_turns,
    _remove,
)
from gpuloom.policies.placement.fleet.shared_models import SharedModels
from gpuloom.policies.placement.fleet.time_slices import TimeSlices
from gpuloom.policies.placement.fleet.verification import Verification
from gpuloom.policies.placement.maxrects import (
    Box,
    FreeRects,
    box_area,
    box_of,
    rect_of,
)
from gpuloom.policies.placement.model import (
    Allocation,
    GpuState,
    InvalidRequestError,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
    describe_gib,
    describe_shape,
    gang_member_id,
)


class Fleet(TimeSlices, SharedModels, Gangs, Nodes, Verification, Indexing):
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
            if allocation.in_turns or any(
                a.in_turns for a in slot.allocations.values() if a.slice_group == group
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

    def unplaceable(self, job: JobRequest, w: int, h: int, shape_note: str = "") -> Unplaceable:
        """Why no GPU takes a w x h rectangle with the job's memory and model: the first of
        unknown model, nothing schedulable, too little memory anywhere, no room of that shape,
        no room of that shape with the memory. Only the GPUs of nodes that take the job count
        (`offers`; `_place_on_nodes` adds what the others lack)."""
        indexes = self.indexes_for(job.gpu_model)
        of_model = f" of model {job.gpu_model}" if job.gpu_model else ""
        if not indexes:
            known = ", ".join(self.models()) or "none registered"
            return Unplaceable(job.job_id, f"no GPU{of_model} (models: {known})")
        live = [index for index in indexes if index.by_id]
        offered: set[str] | None = None
        if job.needs_node:
            takers = {n.name for n in self._nodes.values() if n.takes(job)}
            offered = {g for index in live for g in index.by_id if self._gpus[g].node in takers}
            live = [index for index in live if not offered.isdisjoint(index.by_id)]
        if not live:
            return Unplaceable(job.job_id, f"no schedulable GPU{of_model}")
        if offered is None:
            largest = max(self._max_memory(index) for index in live)
        else:
            largest = max(self._gpus[g].memory_bytes for g in offered)
        if job.memory_bytes > largest:
            return Unplaceable(
                job.job_id,
                f"needs {describe_gib(job.memory_bytes)}, the largest GPU{of_model} has "
                f"{describe_gib(largest)}",
            )
        shape = describe_shape(w, h) + shape_note
        if not any(_has_shape(index.rects, w, h, offered) for index in live):
            return Unplaceable(job.job_id, f"no GPU{of_model} has {shape} free")
        return Unplaceable(
            job.job_id,
            f"no GPU{of_model} has {shape} free together with "
            f"{describe_gib(job.memory_bytes)} of memory",
        )

    # --- bookkeeping ----------------------------------------------------------------------

    def _slot(self, gpu_id: str) -> GpuSlot:
        slot = self._gpus.get(gpu_id)
        if slot is None:
            raise KeyError(f"unknown GPU {gpu_id!r}")
        return slot

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
            job.share if need == job.memory_bytes else replace(job.share, memory_bytes=need),
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
