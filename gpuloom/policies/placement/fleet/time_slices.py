"""Time-slice groups (Gandiva's over-subscription): a job joins the group of an allocation already
on a GPU, taking turns in its rectangle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpuloom.policies.placement.fleet.records import (
    GpuSlot,
    InvalidPlacementError,
    _turn_charge,
)
from gpuloom.policies.placement.maxrects import (
    rect_of,
)
from gpuloom.policies.placement.model import (
    Allocation,
    InvalidRequestError,
    JobRequest,
    describe_gib,
    describe_shape,
    gang_member_id,
)

if TYPE_CHECKING:
    pass


class TimeSlices:
    """Part of `Fleet`: Time-slice groups (Gandiva's over-subscription): a job joins the group of
    an allocation already on a GPU, taking turns in its rectangle."""

    def slice_into(
        self, job: JobRequest, gpu_id: str, group: str, memory_in_turns: bool = False
    ) -> Allocation:
        """Commit `job` on `gpu_id` as a member of time-slice group `group` (the id of the
        group's first allocation, see Allocation.slice_group): it sits in the group's rectangle,
        taking turns with the group's jobs, and holds only its memory and its node's CPU and
        host memory. With `memory_in_turns` (the GPU's dispatcher moves a suspended member's
        memory to host memory) the group's memory is taken in turns too: the group holds its
        largest member's memory, not the sum, so the job is charged only what it needs beyond
        that (Allocation.turn_charge_bytes). Returns the allocation. InvalidRequestError for a
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
            job.share,
            job.task_key,
            rect_of(slot.boxes[group]),
            job.cpu_milli if first else 0,
            job.host_memory_bytes if first else 0,
            "" if first else job.job_id,
            slice_of=group,
            turn_charge_bytes=_turn_charge(job.memory_bytes, slot, group)
            if memory_in_turns
            else None,
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
