"""Jobs on several whole GPUs of one node (all or none), node CPU and host memory, GPU model
alternatives ("A|B"), and the simulator's fleet policies placing live jobs: on the fleet, through
the scheduler, and over random event sequences (no GPU, CPU or host memory over-committed, no
waiting job left that would fit)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import (
    NO_PROFILES,
    POLICIES,
    Fleet,
    InvalidPlacementError,
    InvalidRequestError,
    JobRequest,
    Placement,
    PlacementContext,
    Rect,
    Unplaceable,
    get_policy,
)
from gpuloom.policies.placement.fleet_model import FleetModelPolicy, pod_shape, share_milli
from gpuloom.policies.placement.model import GRID_H, GRID_W
from gpuloom.policies.placement.registry import FLEET_MODEL_POLICIES
from gpuloom.policies.placement.scheduler import Ask, Placed, Scheduler, Waiting

from .helpers import GIB, SchedulerRun, fleet_of, gpu, job, placed, scheduler_events

ALL = {name: get_policy(name) for name in POLICIES}
WHOLE = Rect(0, 0, GRID_W, GRID_H)


def node_gpu(gpu_id: str, node: str, model: str = "A", cpu: int = 8000, mem_gib: int = 64):
    return gpu(gpu_id, model, 40, node=node, node_cpu_milli=cpu, node_memory_bytes=mem_gib * GIB)


def whole(job_id: str, gpus: int, **kw) -> JobRequest:
    return job(job_id, 100, 100, 1, gpus=gpus, **kw)


def two_nodes() -> Fleet:
    """n1: 2 GPUs of model A; n2: 4 GPUs of model B."""
    return fleet_of(
        node_gpu("a0", "n1"),
        node_gpu("a1", "n1"),
        *(node_gpu(f"b{i}", "n2", "B", cpu=16000, mem_gib=128) for i in range(4)),
    )


# ---- the fleet ----


def test_a_job_on_two_gpus_takes_both_of_one_node_and_gives_both_back() -> None:
    fleet = two_nodes()
    decision = placed(fleet.place(whole("j", 2, cpu_milli=1000), get_policy("mra")))
    # Packed: the node left with the fewest whole free GPUs (n1 has exactly 2).
    assert decision.gpu_ids == ("a0", "a1") and decision.node == "n1"
    assert fleet.gpus_of("j") == ("a0", "a1")
    assert fleet.node("n1").cpu_used == 1000  # charged once, not per GPU
    fleet.verify()
    # n1 is full now: the next pair goes to n2, still whole GPUs of one node.
    assert placed(fleet.place(whole("k", 2), get_policy("binpack"))).node == "n2"
    fleet.release("j")
    assert fleet.gpus_of("j") == () and not fleet.slot("a1").allocations
    assert fleet.node("n1").cpu_used == 0
    fleet.verify()


def test_a_job_needing_more_gpus_than_any_node_has_says_so() -> None:
    fleet = two_nodes()
    decision = fleet.place(whole("j", 5), get_policy("mra"))
    assert isinstance(decision, Unplaceable)
    assert "needs 5 GPUs on one node; the largest node has 4" in decision.reason
    assert fleet.max_gpus_per_node() == 4 and fleet.max_gpus_per_node("A") == 2
    # One busy GPU on each node: two whole GPUs remain on n2 only.
    fleet.place(job("s", 10, 10), get_policy("mra"))
    fleet.place(job("t", 10, 10, gpu_model="B"), get_policy("mra"))
    decision = fleet.place(whole("m", 4, gpu_model="B"), get_policy("mra"))
    assert isinstance(decision, Unplaceable)
    assert decision.reason == "no node has 4 whole GPUs of model B free with 1 GiB (the most: 3)"
    assert placed(fleet.place(whole("n", 3, gpu_model="B"), get_policy("spread"))).node == "n2"


class Greedy:
    """A gang policy that names GPUs that are not free (a bug the fleet must refuse)."""

    name = "greedy"

    def place(self, job_: JobRequest, fleet: Fleet, context: PlacementContext):
        raise AssertionError("not asked for a single GPU")

    def place_gang(self, job_: JobRequest, fleet: Fleet, context: PlacementContext):
        return Placement(job_.job_id, "a0", "n1", WHOLE, self.name, ("b0",))


def test_a_gang_placement_is_committed_all_or_none() -> None:
    fleet = two_nodes()
    with pytest.raises(InvalidPlacementError, match="node n2, not n1"):
        fleet.place(whole("j", 2), Greedy())
    assert not fleet.slot("a0").allocations and fleet.gpu_of("j") is None
    fleet.verify()
    with pytest.raises(InvalidRequestError, match="takes them whole"):
        fleet.place(job("half", 50, 100, gpus=2), get_policy("mra"))


def test_cpu_and_host_memory_are_never_over_committed() -> None:
    fleet = two_nodes()  # n1: 8000 milli, 64 GiB; n2: 16000 milli, 128 GiB
    big = dict(cpu_milli=6000, host_memory_bytes=40 * GIB)
    first = placed(fleet.place(job("a", 10, 10, **big), get_policy("mra")))
    second = placed(fleet.place(job("b", 10, 10, **big), get_policy("mra")))
    third = placed(fleet.place(job("c", 10, 10, **big), get_policy("mra")))
    # Each node takes as many as its CPU allows, GPU space notwithstanding.
    assert sorted([first.node, second.node, third.node]) == ["n1", "n2", "n2"]
    refused = fleet.place(job("d", 10, 10, **big), get_policy("mra"))
    assert isinstance(refused, Unplaceable)
    assert refused.reason.startswith("no node has 6000 milli CPU and 40 GiB of host memory free")
    fleet.verify()
    fleet.release(first.allocation_id)
    assert placed(fleet.place(job("d", 10, 10, **big), get_policy("mra"))).node == first.node
    # A node that reported no CPU takes only jobs that ask for none.
    bare = fleet_of(gpu("x", "A", 40, node="bare"))
    assert isinstance(bare.place(job("e", 10, 10, cpu_milli=1), get_policy("mra")), Unplaceable)
    placed(bare.place(job("f", 10, 10), get_policy("mra")))


def test_model_alternatives_admit_either_model_and_no_other() -> None:
    fleet = fleet_of(node_gpu("a", "n1", "V100M16"), node_gpu("c", "n3", "T4"))
    either = placed(fleet.place(job("j", 50, 50, gpu_model="V100M16|V100M32"), get_policy("mra")))
    assert either.gpu_id == "a"
    decision = fleet.place(job("k", 60, 60, gpu_model="V100M16|V100M32"), get_policy("mra"))
    assert isinstance(decision, Unplaceable)  # the T4 has room, but is neither model
    with pytest.raises(InvalidRequestError, match="empty alternative"):
        fleet.place(job("m", 10, 10, gpu_model="V100M16|"), get_policy("mra"))


def test_a_restarted_fleet_rebuilds_gangs_and_node_usage() -> None:
    fleet = two_nodes()
    fleet.place(whole("j", 3, cpu_milli=500, host_memory_bytes=GIB), get_policy("mra"))
    fleet.place(job("s", 30, 30, cpu_milli=200), get_policy("mra"))
    again = Fleet.from_allocations(fleet.snapshot())
    again.verify()
    assert again.gpus_of("j") == fleet.gpus_of("j")
    assert again.node("n2").cpu_used == fleet.node("n2").cpu_used
    again.release("j")
    assert again.gpus_of("j") == () and again.node("n2").memory_used == 0


# ---- the fleet policies of the simulator, live ----


def test_a_share_becomes_a_pod_of_its_area_and_whole_gpus_a_multi_gpu_pod() -> None:
    assert pod_shape(job("j", 50, 40, host_memory_bytes=3 * (1 << 20) + 1)).gpu_milli == 200
    assert pod_shape(job("j", 50, 40, host_memory_bytes=3 * (1 << 20) + 1)).memory_mib == 4
    assert pod_shape(whole("j", 3)).num_gpu == 3 and pod_shape(whole("j", 1)).gpu_milli == 1000
    assert share_milli(1, 1) == 1


@pytest.mark.parametrize("name", sorted(FLEET_MODEL_POLICIES))
def test_every_fleet_policy_places_shares_gangs_and_respects_constraints(name: str) -> None:
    fleet = two_nodes()
    policy = get_policy(name)
    share = placed(fleet.place(job("s", 50, 50, 10, gpu_model="A", cpu_milli=100), policy))
    assert share.node == "n1" and share.policy == name
    gang = placed(fleet.place(whole("g", 3, cpu_milli=1000), policy))
    assert gang.node == "n2" and len(set(gang.gpu_ids)) == 3
    # Only one whole B GPU is left: a second 3-GPU job waits, with the fleet's reason.
    refused = fleet.place(whole("h", 3), policy)
    assert isinstance(refused, Unplaceable) and "3 whole GPUs" in refused.reason
    too_big = fleet.place(job("c", 10, 10, cpu_milli=100_000), policy)
    assert isinstance(too_big, Unplaceable) and "100000 milli CPU" in too_big.reason
    fleet.verify()


@pytest.mark.parametrize("name", ["fgd", "best", "bestfit"])
def test_rounding_to_milli_never_hides_room_that_fits_exactly(name: str) -> None:
    fleet = fleet_of(node_gpu("a0", "n1"))
    policy = get_policy(name)
    placed(fleet.place(job("two-thirds", 100, 66.67), policy))
    # 33.33% x 100% is 333.3 milli, asked as 334; the GPU has exactly that rectangle free.
    last = placed(fleet.place(job("third", 100, 33.33), policy))
    assert last.gpu_id == "a0"
    fleet.verify()


def test_fgd_keeps_a_whole_node_free_for_a_later_gang() -> None:
    """With the workload made of 1-GPU shares and 2-GPU jobs, FGD (through the adapter) puts a
    small share on the node already in use rather than breaking the idle 2-GPU node."""
    fleet = fleet_of(
        node_gpu("a0", "n1"), node_gpu("a1", "n1"), node_gpu("b0", "n2"), node_gpu("b1", "n2")
    )
    fgd = FleetModelPolicy("fgd")
    placed(fleet.place(job("first", 50, 100, 1), fgd))
    used = fleet.slot(fleet.gpu_of("first") or "").node
    for i in range(3):  # the workload the policy has seen: mostly 2-GPU jobs
        fgd.place(whole(f"seen{i}", 2), fleet, NO_PROFILES)
    second = placed(fleet.place(job("second", 50, 100, 1), fgd))
    assert second.node == used
    assert placed(fleet.place(whole("pair", 2), fgd)).node != used


def test_a_job_restricted_to_nodes_goes_only_there_and_says_why_it_waits() -> None:
    fleet = two_nodes()
    policy = get_policy("mra")
    # mra packs onto n1 unrestricted; restricted to n2, it goes there.
    assert placed(fleet.place(job("free", 10, 10), policy)).node == "n1"
    assert placed(fleet.place(job("s", 10, 10, nodes=frozenset({"n2"})), policy)).node == "n2"
    assert placed(fleet.place(whole("g", 2, nodes=frozenset({"n2"})), policy)).node == "n2"
    nowhere = fleet.place(job("x", 10, 10, nodes=frozenset({"n9", "n8"})), policy)
    assert isinstance(nowhere, Unplaceable)
    assert nowhere.reason == "none of its nodes (n8, n9) has a registered GPU"
    full = fleet.place(whole("h", 2, nodes=frozenset({"n1"})), policy)  # a0 is taken
    assert isinstance(full, Unplaceable)
    assert full.reason.startswith("no node of its nodes (n1) has 2 whole GPUs free")
    fleet.verify()
    with pytest.raises(InvalidPlacementError, match="not one of the job's nodes"):
        fleet.slice_into(job("t", 10, 10, nodes=frozenset({"n2"})), "a0", "free")
    with pytest.raises(InvalidRequestError, match="nodes"):
        fleet.place(job("y", 10, 10, nodes=("n1",)), policy)  # type: ignore[arg-type]


# ---- the scheduler ----


def test_a_job_waiting_for_its_nodes_is_tried_again_only_when_they_free() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=two_nodes())
    held = [
        scheduler.submit(Ask(whole(f"b{i}", 1, gpu_model="B"), submitted_at=i)) for i in range(4)
    ]
    assert all(isinstance(h, Placed) for h in held)
    waiting = scheduler.submit(Ask(job("w", 10, 10, nodes=frozenset({"n2"})), submitted_at=9))
    assert isinstance(waiting, Waiting) and "on its nodes (n2)" in waiting.reason
    assert isinstance(scheduler.submit(Ask(whole("a", 2), submitted_at=10)), Placed)  # on n1
    scheduler.end("a")  # n1 frees: nothing there for `w`
    assert not scheduler.decide().placed and "w" in scheduler
    scheduler.end("b2")  # a GPU of n2 frees: `w` goes there
    assert [p.ask.job_id for p in scheduler.decide().placed] == ["w"]
    assert scheduler.fleet.slot(scheduler.fleet.gpu_of("w") or "").node == "n2"


def test_a_waiting_gang_is_placed_when_a_node_frees_and_a_failed_bind_frees_every_gpu() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=two_nodes())
    hold = scheduler.submit(Ask(whole("hold", 4), submitted_at=0))
    assert isinstance(hold, Placed) and hold.placement.node == "n2"
    pair = scheduler.submit(Ask(whole("pair", 2, gpu_model="B"), submitted_at=1))
    assert isinstance(pair, Waiting) and "2 whole GPUs of model B" in pair.reason
    scheduler.end("hold")  # every GPU of n2 comes back: the pair is due
    assert scheduler.wants_decide
    (got,) = scheduler.decide().placed
    assert got.ask.job_id == "pair" and len(got.placement.gpu_ids) == 2
    scheduler.bind_failed(got.ask, "binding failed")
    fleet = scheduler.fleet
    assert all(not fleet.slot(f"b{i}").allocations for i in range(4))
    assert "pair" in scheduler and scheduler.wants_decide


def test_cpu_freed_by_a_job_on_another_gpu_of_the_node_lets_a_waiting_job_in() -> None:
    fleet = fleet_of(node_gpu("a0", "n1", "A", cpu=4000), node_gpu("b0", "n1", "B", cpu=4000))
    scheduler = Scheduler(ALL, "mra", fleet=fleet)
    assert isinstance(scheduler.submit(Ask(job("cpu", 100, 100, cpu_milli=3000))), Placed)
    assert fleet.gpu_of("cpu") == "a0"
    waiting = scheduler.submit(Ask(job("next", 10, 10, cpu_milli=2000, gpu_model="B")))
    assert isinstance(waiting, Waiting) and "2000 milli CPU" in waiting.reason
    scheduler.end("cpu")  # frees a0 (model A) and 3000 milli of n1: `next` fits on b0 now
    assert scheduler.wants_decide
    assert [p.ask.job_id for p in scheduler.decide().placed] == ["next"]
    assert fleet.gpu_of("next") == "b0"


def test_host_memory_given_back_by_a_failed_binding_lets_a_waiting_job_onto_the_node() -> None:
    # Found by the property below: the failed GPU takes no work, but its job's host memory
    # came back to the node, and a waiting job that asked for it fits the node's other GPU.
    fleet = fleet_of(node_gpu("a0", "n1", "A", mem_gib=32), node_gpu("b0", "n1", "B", mem_gib=32))
    scheduler = Scheduler(ALL, "mra", fleet=fleet)
    first = Ask(job("first", 100, 100, host_memory_bytes=24 * GIB, gpu_model="A"))
    assert isinstance(scheduler.submit(first), Placed)
    waiting = scheduler.submit(Ask(job("next", 10, 10, host_memory_bytes=24 * GIB)))
    assert isinstance(waiting, Waiting)
    fleet.set_schedulable("a0", False)
    scheduler.bind_failed(first, "binding failed")
    assert scheduler.wants_decide
    assert [p.ask.job_id for p in scheduler.decide().placed] == ["next"]
    assert fleet.gpu_of("next") == "b0"


# ---- properties ----

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICY_NAMES = ["mra", "binpack", "spread", "time-share", "fgd", "best", "bestfit", "random"]

submits = st.tuples(
    st.just("submit"),
    st.sampled_from([(20, 50), (50, 50), (33, 33.33), (100, 66.67), (100, 100)]),
    st.sampled_from([1, 1, 2, 3]),  # GPUs
    st.sampled_from([0, 1500, 4000]),  # CPU milli
    st.sampled_from([0, 8, 24]),  # host memory, GiB
    st.sampled_from(["", "A", "B", "A|B"]),
    st.sampled_from(POLICY_NAMES),
    # The nodes it may use (n3 has no GPU): a Kubernetes scheduler's candidates.
    st.sampled_from([frozenset(), frozenset({"n1"}), frozenset({"n2"}), frozenset({"n3"})]),
)
events = scheduler_events(submits, gpus=5, max_size=50)


@FAST
@given(events=events)
def test_nothing_is_over_committed_and_no_waiting_job_fits_after_decide(events: list) -> None:
    fleet = fleet_of(
        node_gpu("g0", "n1", "A", cpu=6000, mem_gib=32),
        node_gpu("g1", "n1", "A", cpu=6000, mem_gib=32),
        node_gpu("g2", "n2", "B", cpu=8000, mem_gib=48),
        node_gpu("g3", "n2", "B", cpu=8000, mem_gib=48),
        node_gpu("g4", "n2", "A", cpu=8000, mem_gib=48),
    )
    run = SchedulerRun(Scheduler(ALL, "mra", fleet=fleet), fleet)
    scheduler, asks = run.scheduler, run.asks
    for n, event in enumerate(events):
        kind = event[0]
        if kind == "submit":
            (sm, quota), gpus, cpu, mem, model, policy, nodes = event[1:]
            if gpus > 1:
                sm, quota = 100, 100
            request = job(
                f"j{n:03}",
                sm,
                quota,
                4,
                gpus=gpus,
                cpu_milli=cpu,
                host_memory_bytes=mem * GIB,
                gpu_model=model,
                nodes=nodes,
            )
            run.submit(Ask(request, policy=policy, submitted_at=n))
        elif kind == "end" and asks:
            run.end(event[1])
        elif kind == "bind_failed" and (job_id := run.holding(event[1])):
            failed = fleet.gpus_of(job_id)[-1]
            fleet.set_schedulable(failed, False)
            scheduler.bind_failed(asks[job_id], "binding failed")
            assert fleet.gpus_of(job_id) == ()  # every GPU of it given back
        elif kind == "heartbeat":
            run.heartbeat(event[1])
        elif kind == "decide":
            for a in run.decide(event[1]):
                answer = fleet.place(
                    JobRequest(**{**_fields(a.request), "job_id": "probe"}),
                    ALL[scheduler.policy_name(a)],
                )
                assert isinstance(answer, Unplaceable), (a.job_id, answer)
        fleet.verify()  # GPUs, CPU and host memory within capacity, every index exact
        for job_id, a in asks.items():
            holds = fleet.gpus_of(job_id)
            assert (job_id in scheduler) != bool(holds), job_id
            if holds:
                assert len(holds) == a.request.gpus
                assert len({fleet.slot(g).node for g in holds}) == 1
                assert all(a.request.allows(fleet.slot(g).model) for g in holds)
                assert not a.request.nodes or fleet.slot(holds[0]).node in a.request.nodes


def _fields(request: JobRequest) -> dict:
    return {name: getattr(request, name) for name in JobRequest.__slots__}
