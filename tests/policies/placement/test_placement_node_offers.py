"""Jobs that ask something of their node (CPU, host memory, a list of nodes): every policy passes
over the GPUs of the nodes that do not take the job (`Fleet.offers`), and decides exactly what
it decided when those GPUs were taken out of the fleet's indexes for the decision (the way
before: `HidingFleet` below keeps it), on random fleets and random runs of asks, releases and
GPUs going unschedulable."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import (
    POLICIES,
    Fleet,
    GpuState,
    JobRequest,
    Placement,
    PlacementContext,
    PlacementPolicy,
    Unplaceable,
    get_policy,
)
from gpuloom.policies.placement.fleet import NodeSlot

from .helpers import GIB, gpu, job


class HidingFleet(Fleet):
    """The fleet as it decided node asks before `offers`: the GPUs of the nodes that do not
    take the job left out of the indexes (marked unschedulable) for the decision."""

    def _place_on_nodes(
        self, job: JobRequest, policy: PlacementPolicy, context: PlacementContext
    ) -> Placement | Unplaceable:
        short = [n for n in self._nodes.values() if not n.takes(job)]
        with self._hidden(job, short):
            decision = policy.place(job, self, context)
        if isinstance(decision, Unplaceable) and short:
            return Unplaceable(job.job_id, self._node_reason(job, decision.reason))
        return decision

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

    @contextlib.contextmanager
    def _hidden(self, job: JobRequest, nodes: Iterable[NodeSlot]) -> Iterator[None]:
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


NODE_NAMES = ["n0", "n1", "n2", "n3", "n4"]

# A node: its GPUs' models (one model, or mixed), their memory, its CPU and host memory.
nodes_strategy = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["A", "A", "B"]), min_size=1, max_size=4),
        st.sampled_from([16, 40, 80]),  # GPU memory, GiB
        st.sampled_from([0, 4000, 8000, 16000]),  # CPU milli
        st.sampled_from([0, 16, 64]),  # host memory, GiB
    ),
    min_size=2,
    max_size=5,
)

asks = st.tuples(
    st.just("ask"),
    st.sampled_from([(20, 50), (50, 50), (33, 33.33), (100, 66.67), (100, 100), (10, 10)]),
    st.sampled_from([1, 1, 1, 2]),  # GPUs
    st.sampled_from([0, 0, 1000, 3000, 6000]),  # CPU milli
    st.sampled_from([0, 0, 4, 12, 30]),  # host memory, GiB
    st.sampled_from([1, 10, 30]),  # GPU memory, GiB
    st.sampled_from(["", "", "A", "B", "A|B"]),
    st.sampled_from([(), (), ("n0",), ("n1", "n2"), ("n4",)]),
)
events_strategy = st.lists(
    st.one_of(
        asks,
        asks,
        asks,
        st.tuples(st.just("release"), st.integers(0, 1000)),
        st.tuples(st.just("schedulable"), st.integers(0, 1000), st.booleans()),
    ),
    min_size=5,
    max_size=40,
)


def build(fleet_class: type[Fleet], nodes: list) -> Fleet:
    gpus: list[GpuState] = []
    for n, (models, memory_gib, cpu, host_gib) in enumerate(nodes):
        for i, model in enumerate(models):
            gpus.append(
                gpu(
                    f"g{n}{i}",
                    model,
                    memory_gib,
                    node=NODE_NAMES[n],
                    node_cpu_milli=cpu,
                    node_memory_bytes=host_gib * GIB,
                )
            )
    return fleet_class.from_allocations(gpus)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(POLICIES)), nodes=nodes_strategy, events=events_strategy)
def test_every_policy_decides_node_asks_as_it_did_with_the_short_nodes_hidden(
    name: str, nodes: list, events: list
) -> None:
    offering, hiding = build(Fleet, nodes), build(HidingFleet, nodes)
    policies = {id(offering): get_policy(name), id(hiding): get_policy(name)}
    gpu_ids = sorted(offering.gpu_ids())
    held: list[str] = []
    for n, event in enumerate(events):
        if event[0] == "ask":
            (sm, quota), gpus, cpu, host_gib, memory_gib, model, on = event[1:]
            if gpus > 1:
                sm, quota = 100, 100
            request = job(
                f"j{n:02}",
                sm,
                quota,
                memory_gib,
                gpus=gpus,
                cpu_milli=cpu,
                host_memory_bytes=host_gib * GIB,
                gpu_model=model,
                nodes=frozenset(on),
            )
            decisions = [fleet.place(request, policies[id(fleet)]) for fleet in (offering, hiding)]
            assert decisions[0] == decisions[1], request
            if isinstance(decisions[0], Placement):
                held.append(request.job_id)
        elif event[0] == "release" and held:
            released = held.pop(event[1] % len(held))
            assert offering.release(released) == hiding.release(released)
        elif event[0] == "schedulable":
            gpu_id = gpu_ids[event[1] % len(gpu_ids)]
            for fleet in (offering, hiding):
                fleet.set_schedulable(gpu_id, event[2])
    assert offering.snapshot() == hiding.snapshot()
    offering.verify()
