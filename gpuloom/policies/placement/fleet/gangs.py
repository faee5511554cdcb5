"""Jobs on several whole GPUs of one node, all or none."""

from __future__ import annotations

from gpuloom.domain.shares import share_of
from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet.policy import PlacementPolicy
from gpuloom.policies.placement.fleet.records import (
    InvalidPlacementError,
    NodeSlot,
    _names,
)
from gpuloom.policies.placement.maxrects import (
    box_of,
)
from gpuloom.policies.placement.model import (
    GRID_H,
    GRID_W,
    Allocation,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
    describe_gib,
    gang_member_id,
)


class Gangs:
    """Part of `Fleet`: Jobs on several whole GPUs of one node, all or none."""

    def _place_gang(
        self, job: JobRequest, policy: PlacementPolicy, context: PlacementContext
    ) -> Placement | Unplaceable:
        place_gang = getattr(policy, "place_gang", None)
        if place_gang is None:
            return self.pack_gang(job, policy.name)
        # The policy passes over the nodes that do not take the job (`offers`).
        decision = place_gang(job, self, context)
        if job.nodes and isinstance(decision, Unplaceable):
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
        probe = JobRequest("probe", share_of(), gpu_model=gpu_model)
        return max(
            (
                sum(probe.allows(self._gpus[g].model) for g in n.gpu_ids)
                for n in self._nodes.values()
            ),
            default=0,
        )

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
                    job.share,
                    job.task_key,
                    placement.rect,
                    job.cpu_milli if first else 0,
                    job.host_memory_bytes if first else 0,
                    "" if first else job.job_id,
                ),
                box,
            )
