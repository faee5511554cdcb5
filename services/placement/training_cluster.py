"""What Gandiva's live driver (services/placement/training.py) may read and change of
placement's state, and nothing more: the jobs (Decisions) and the GPUs' capacity (the
Inventory's fleet). The driver holds this narrow interface, not Decisions and the Inventory:
every change of the fleet it makes goes through `hold`, `release`, `join_time_slice` and
`bind_time_sliced`, every change of a job through `update_live` and `set_training`, and the
GPUs a move is taking through `note_moving` / `done_moving`. Each call runs under the
decisions' lock, which the caller holds (`lock`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

from gpuloom.domain.training import TrainingState
from gpuloom.policies.placement import Allocation
from gpuloom.policies.placement.fleet import GpuSlot, InvalidStateError, NodeSlot
from gpuloom.policies.placement.model import JobRequest
from gpuloom.services.placement.decisions import Decisions
from gpuloom.services.placement.domain import GpuRecord, Job
from gpuloom.services.placement.inventory import Inventory, gpu_state


class TrainingCluster:
    def __init__(self, decisions: Decisions, inventory: Inventory) -> None:
        self._decisions = decisions
        self._inventory = inventory

    # ---- reading ----

    @property
    def lock(self) -> asyncio.Lock:
        """The decisions' lock: held around every change."""
        return self._decisions.lock

    def job(self, job_id: str) -> Job | None:
        """A live job (pending, binding, assigned), or None."""
        return self._decisions.job(job_id)

    async def get(self, job_id: str) -> Job:
        """Any job, ended ones from the database (NotFound if none)."""
        return await self._decisions.get(job_id)

    def live_jobs(self) -> Iterable[Job]:
        return self._decisions.live.values()

    def waiting(self, job_id: str) -> bool:
        """Whether the job is in the scheduler's queue."""
        return job_id in self._decisions.scheduler

    def records(self) -> Iterable[GpuRecord]:
        return self._inventory.records()

    def record(self, gpu_uuid: str) -> GpuRecord:
        return self._inventory.record(gpu_uuid)

    def has_gpu(self, gpu_uuid: str) -> bool:
        """Whether the GPU is registered and in the fleet."""
        return gpu_uuid in self._inventory and gpu_uuid in self._inventory.fleet

    def is_down(self, record: GpuRecord) -> bool:
        return self._inventory.is_down(record)

    def slot(self, gpu_uuid: str) -> GpuSlot:
        """The fleet's view of a GPU (read only: change it through the calls below)."""
        return self._inventory.fleet.slot(gpu_uuid)

    def allocation(self, allocation_id: str) -> Allocation | None:
        return self._inventory.fleet.allocation(allocation_id)

    @property
    def nodes(self) -> Mapping[str, NodeSlot]:
        return self._inventory.fleet.nodes

    # ---- changing ----

    def hold(self, gpu_uuid: str, wanted: Allocation) -> Allocation | None:
        """Add an allocation to a GPU of the fleet (first-fit without a rect); None when it
        does not fit, on the GPU or in its node's CPU and host memory (nothing changes)."""
        fleet = self._inventory.fleet
        if gpu_uuid not in fleet:
            return None
        record = self._inventory.record(gpu_uuid)
        slot = fleet.slot(gpu_uuid)
        node = fleet.node(slot.node)
        if wanted.cpu_milli > node.cpu_free or wanted.host_memory_bytes > node.memory_free:
            return None
        schedulable = slot.schedulable
        models = tuple(slot.models.items())  # the store's models stay counted
        held = list(fleet.remove_gpu(gpu_uuid))
        try:
            fleet.add_gpu(gpu_state(record, [*held, wanted], models))
        except (InvalidStateError, ValueError):
            fleet.add_gpu(gpu_state(record, held, models))
            fleet.set_schedulable(gpu_uuid, schedulable)
            return None
        fleet.set_schedulable(gpu_uuid, schedulable)
        return fleet.allocation(wanted.allocation_id)

    def release(self, allocation_id: str, gpu_uuid: str | None = None) -> None:
        """Give an allocation's capacity back; with `gpu_uuid`, the scheduler hears that the
        GPU has room again."""
        self._inventory.fleet.release(allocation_id)
        if gpu_uuid is not None:
            self._decisions.capacity_changed(gpu_uuid)

    def join_time_slice(
        self, request: JobRequest, groups: Sequence[tuple[str, str]], memory_in_turns: bool
    ) -> tuple[Allocation, ...]:
        """A pending job joins the time-slice group on each of its GPUs (Fleet.slice_into, or
        slice_gang_into for several); InvalidPlacementError when it cannot (nothing changes)."""
        fleet = self._inventory.fleet
        if len(groups) == 1:
            return (fleet.slice_into(request, *groups[0], memory_in_turns=memory_in_turns),)
        return fleet.slice_gang_into(request, groups, memory_in_turns=memory_in_turns)

    def bind_time_sliced(self, job: Job) -> None:
        """The job, placed by joining time-slice groups, leaves the queue and is bound like any
        job the scheduler placed (`job`: its BINDING revision)."""
        self._decisions.scheduler.end(job.job_id)
        self._decisions.bind_placed(job)

    def note_moving(self, job_id: str, gpus: tuple[str, ...]) -> None:
        """A move is taking these GPUs: their dispatchers' heartbeats listing the job are not
        stale."""
        self._decisions.moving[job_id] = gpus

    def done_moving(self, job_id: str) -> None:
        self._decisions.moving.pop(job_id, None)

    def update_live(self, job: Job) -> None:
        """A job's next revision (a move or a resize committed)."""
        self._decisions.update_live(job)

    def set_training(self, job_id: str, state: TrainingState, publish: bool) -> None:
        """Put an assigned job's training state on it (`publish`: as a new revision)."""
        self._decisions.set_training(job_id, state, publish=publish)

    def wake(self) -> None:
        """Capacity came free: the scheduler tries the waiting jobs."""
        self._decisions.wake()
