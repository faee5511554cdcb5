"""Shared models (FaST-GShare's model sharing): the models a GPU's store holds, and replicas placed
beside them, charged less."""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet.indexes import (
    ModelIndex,
)
from gpuloom.policies.placement.fleet.policy import PlacementPolicy
from gpuloom.policies.placement.fleet.records import (
    InvalidStateError,
)
from gpuloom.policies.placement.model import (
    JobRequest,
    Placement,
    check_models,
    describe_gib,
)

if TYPE_CHECKING:
    from gpuloom.policies.placement.fleet.core import Fleet


class SharedModels:
    """Part of `Fleet`: Shared models (FaST-GShare's model sharing): the models a GPU's store
    holds, and replicas placed beside them, charged less."""

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

    def memory_need(self, job: JobRequest, gpu_id: str) -> int:
        """The memory `job` would be charged on the GPU (see GpuSlot.memory_need)."""
        return self._slot(gpu_id).memory_need(job)

    def resident(self, model: str) -> list[str]:
        """The GPUs whose store holds `model`, sorted (schedulable or not)."""
        return sorted(self._resident.get(model, ()))

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
            decision = policy.place(
                replace(job, share=replace(job.share, memory_bytes=need), shared_model=""),
                view,
                context,
            )
            if isinstance(decision, Placement):
                return decision
        return None

    def _view(self, gpu_ids: Iterable[str]) -> Fleet:
        """A fleet of only these (schedulable) GPUs, for a policy to read: their live records,
        indexed anew, and copies of their nodes' records listing only these GPUs. Never
        changed: decisions are committed to this fleet."""
        view = type(self)(self.rebuild_factor, self.rebuild_slack)
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
