"""Node resources: a job's CPU and host memory, charged once on its node; policies offered the
fleet without the nodes short of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.fleet.policy import PlacementPolicy
from gpuloom.policies.placement.fleet.records import (
    NodeSlot,
    _names,
)
from gpuloom.policies.placement.model import (
    JobRequest,
    Placement,
    Unplaceable,
    describe_gib,
)

if TYPE_CHECKING:
    pass


class Nodes:
    """Part of `Fleet`: Node resources: a job's CPU and host memory, charged once on its node;
    policies offered the fleet without the nodes short of them."""

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
