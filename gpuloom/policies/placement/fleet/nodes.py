"""Node resources: a job's CPU and host memory, charged once on its node; policies pass over the
GPUs of the nodes short of them (`Fleet.offers`)."""

from __future__ import annotations

from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet.policy import PlacementPolicy
from gpuloom.policies.placement.fleet.records import (
    GpuSlot,
    _names,
)
from gpuloom.policies.placement.model import (
    JobRequest,
    Placement,
    Unplaceable,
    describe_gib,
)


class Nodes:
    """Part of `Fleet`: Node resources: a job's CPU and host memory, charged once on its node;
    policies pass over the GPUs of the nodes short of them (`offers`)."""

    def _place_on_nodes(
        self, job: JobRequest, policy: PlacementPolicy, context: PlacementContext
    ) -> Placement | Unplaceable:
        """Ask the policy for a job that asks something of its node; the policy passes over
        the GPUs of nodes that do not take it (`offers`), so nothing in the indexes changes
        for the decision. An Unplaceable says what the nodes lack when some node is short."""
        decision = policy.place(job, self, context)
        if isinstance(decision, Unplaceable) and any(
            not n.takes(job) for n in self._nodes.values()
        ):
            return Unplaceable(job.job_id, self._node_reason(job, decision.reason))
        return decision

    def offers(self, slot: GpuSlot, job: JobRequest) -> bool:
        """Whether the GPU's node takes the job: one of its nodes, with the CPU and host memory
        it asks free. Every policy checks it for each GPU it would choose (the fleet commits
        nothing else); always True for a job that asks nothing of its node."""
        return not job.needs_node or self._nodes[slot.node].takes(job)

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
