"""The fleet policies' kept view (fleet_model._Kept): the fleet's journal of touched nodes, and
a view kept in step through placements, releases and schedulability changes that always equals
one read afresh from the fleet."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import Placement, fleet_model, get_policy
from gpuloom.policies.placement.fleet_model import (
    MIB,
    FleetModelPolicy,
    _free_boxes,
    _gpu_free_milli,
    _widest,
)
from gpuloom.policies.placement.model import GRID_AREA, quota_steps

from .helpers import GIB, fleet_of, gpu, job


def node_gpu(
    gpu_id: str, node: str, model: str = "A", cpu: int = 8000, memory_gib: float = 40, **kw
):
    return gpu(
        gpu_id, model, memory_gib, node=node, node_cpu_milli=cpu, node_memory_bytes=64 * GIB, **kw
    )


def small_fleet():
    return fleet_of(
        node_gpu("a0", "n1"),
        node_gpu("a1", "n1"),
        node_gpu("b0", "n2", "B"),
        node_gpu("b1", "n2", "B"),
        node_gpu("b2", "n2", "B"),
        node_gpu("c0", "n3"),
    )


def test_the_journal_names_the_nodes_touched_since_a_cursor() -> None:
    fleet = small_fleet()
    _, cursor = fleet.touched_since(0)
    decision = fleet.place(job("j", 50, 50), get_policy("mra"))
    assert isinstance(decision, Placement)
    touched, cursor2 = fleet.touched_since(cursor)
    assert touched and set(touched) == {decision.node}
    fleet.release("j")
    touched, _ = fleet.touched_since(cursor2)
    assert touched == [decision.node]
    fleet.set_schedulable("b1", False)
    assert fleet.touched_since(cursor2)[0][-1] == "n2"
    assert fleet.touched_since(-1)[0] is None  # older than the journal: read everything
    topology = fleet.topology
    fleet.remove_gpu("c0")
    assert fleet.topology == topology + 1


def assert_kept_equals_fresh(policy: FleetModelPolicy, fleet) -> None:
    kept = policy._live.get(fleet)
    assert kept is not None and kept.state is not None
    # The view is as the last decision left it: bring it up to date as a decision would.
    touched, end = fleet.touched_since(kept.cursor)
    assert touched is not None
    for i in {kept.node_index[n] for n in touched if n in kept.node_index}:
        kept._refresh_row(fleet, i)
    kept.cursor = end
    state = kept.state
    for i, name in enumerate(kept.nodes):
        node = fleet.node(name)
        assert state.cpu_free[i] == node.cpu_free
        assert state.mem_free[i] == node.memory_free // MIB
        for j, gpu_id in enumerate(kept.gpu_ids[i]):
            assert state.gpu_free[i, j] == _gpu_free_milli(fleet.slot(gpu_id))
            assert (kept.widest[:, i, j] == _widest(_free_boxes(fleet.slot(gpu_id)))).all()


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["fgd", "best", "bestfit", "gpuclustering"]),
    seed=st.integers(0, 10_000),
    steps=st.integers(5, 60),
)
def test_the_kept_view_always_equals_the_fleet(name: str, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    fleet = small_fleet()
    policy = FleetModelPolicy(name)
    live: list[str] = []
    for n in range(steps):
        action = rng.random()
        if action < 0.6 or not live:
            ask = job(
                f"j{n}",
                rng.choice((10, 25, 50, 100)),
                rng.choice((20, 50, 100)),
                memory_gib=rng.choice((1, 10, 30)),
                gpu_model=rng.choice(("", "", "A", "B")),
                cpu_milli=rng.choice((0, 0, 1000)),
                gpus=rng.choice((1, 1, 1, 2)),
            )
            if ask.gpus > 1:
                ask = job(f"j{n}", 100, 100, 1, gpus=2)
            decision = fleet.place(ask, policy)
            if isinstance(decision, Placement):
                live.append(decision.allocation_id)
        elif action < 0.9:
            fleet.release(live.pop(rng.randrange(len(live))))
        else:
            g = rng.choice(("a0", "a1", "b0", "b1", "b2", "c0"))
            fleet.set_schedulable(g, not fleet.slot(g).schedulable)
        fleet.verify()
    if fleet.touched_since(0)[1] and policy._live.get(fleet) is not None:
        assert_kept_equals_fresh(policy, fleet)


def test_a_share_the_view_rounds_down_still_fits_exactly() -> None:
    # 66.67% of the quota taken: 333 milli shown free, a 33.33% x 100% job asks 334; the kept
    # view shows that GPU the share for this decision because its rectangle fits.
    fleet = fleet_of(node_gpu("a0", "n1"))
    policy = FleetModelPolicy("fgd")
    assert isinstance(fleet.place(job("big", 100, 66.67), policy), Placement)
    decision = fleet.place(job("third", 100, 33.33), policy)
    assert isinstance(decision, Placement) and decision.gpu_id == "a0"
    kept = policy._live[fleet]
    assert kept.state is not None and int(kept.state.gpu_free[0, 0]) == 333  # put back after


def test_a_gpu_short_of_memory_is_left_out_for_that_job_only() -> None:
    fleet = fleet_of(node_gpu("a0", "n1"), node_gpu("a1", "n2"))
    policy = FleetModelPolicy("fgd")
    assert isinstance(fleet.place(job("hog", 10, 10, memory_gib=35), policy), Placement)
    where = fleet.gpu_of("hog")
    other = "a1" if where == "a0" else "a0"
    # 5 GiB left where the hog is: a 10 GiB job goes to the other GPU, a 1 GiB one may not.
    decision = fleet.place(job("ten", 10, 10, memory_gib=10), policy)
    assert isinstance(decision, Placement) and decision.gpu_id == other
    # The view is the fleet's, and nothing of the job's limits is left in it.
    assert_kept_equals_fresh(policy, fleet)
    kept = policy._live[fleet]
    assert kept.state is not None and kept.state.usable is None and kept.state.allowed is None
    assert sorted(kept.gpu_mem[:, 0].tolist()) == [5 * GIB, 30 * GIB]


@pytest.mark.parametrize("name", ["fgd", "fgd-pack", "best", "bestfit", "gpupacking"])
def test_a_gpu_with_the_area_but_no_rectangle_of_the_jobs_shape_is_not_chosen(name: str) -> None:
    # A 60% SM x 50% quota job on a0 leaves 70% of its area free, but no 50% SM x 60% quota
    # rectangle (40% SM above it, 50% of the quota beside it); a1 is idle. Every policy here
    # prefers a used GPU that the share's area fits: the job goes to a1, in one decision.
    fleet = fleet_of(node_gpu("a0", "n1"), node_gpu("a1", "n1"))
    assert isinstance(fleet.place(job("low", 60, 50), get_policy("mra")), Placement)
    low = fleet.slot(fleet.gpu_of("low"))
    assert low.area_free * 10 == 7 * GRID_AREA and not low.free.fits(quota_steps(60), 50)
    decision = fleet.place(job("wide", 50, 60), FleetModelPolicy(name))
    assert isinstance(decision, Placement) and decision.gpu_id != low.gpu_id


def rich_fleet(nodes: int):
    """Nodes of 4 or 8 GPUs of two models, small GPU memory: a node's preferred GPU often lacks
    the memory or a free rectangle of the job's shape (on a few nodes, often every node's)."""
    gpus = []
    for n in range(nodes):
        model = "A" if n % 3 else "B"
        for g in range(4 if n % 2 else 8):
            gpus.append(
                gpu(
                    f"n{n}g{g}",
                    model,
                    16,
                    node=f"n{n}",
                    node_cpu_milli=64000,
                    node_memory_bytes=256 * GIB,
                )
            )
    return fleet_of(*gpus)


def takers(fleet, ask) -> set[str]:
    """Every GPU that can take a share `ask`, read from the fleet one GPU at a time."""
    return {
        gpu_id
        for gpu_id, slot in fleet.slots.items()
        if slot.schedulable
        and (not ask.models or slot.model in ask.models)
        and slot.memory_free >= ask.memory_bytes
        and slot.free.fits(ask.w, ask.sm_percent)
        and fleet.offers(slot, ask)
    }


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["fgd", "fgd-pack", "best", "gpupacking", "random"]),
    seed=st.integers(0, 10_000),
    nodes=st.sampled_from([2, 3, 12]),
)
def test_a_fleet_policy_takes_a_gpu_that_fits_and_refuses_only_when_none_does(
    name: str, seed: int, nodes: int
) -> None:
    # Small GPU memory and rectangles that fill: many GPUs cannot take a job. The one decision
    # of the kept view lands on a GPU that takes the job, and refuses a share only when no GPU
    # of the fleet can take it.
    rng = random.Random(seed)
    fleet = rich_fleet(nodes)
    policy = FleetModelPolicy(name)
    live: list[str] = []
    placed = 0
    for n in range(160):
        if rng.random() < 0.65 or not live:
            ask = job(
                f"j{n}",
                rng.choice((6, 12, 25, 50, 60, 100)),
                rng.choice((10, 20, 40, 60, 100)),
                memory_gib=rng.choice((1, 2, 4, 8, 12)),
                gpu_model=rng.choice(("", "", "A", "B")),
                cpu_milli=rng.choice((0, 0, 2000)),
            )
            can = takers(fleet, ask)
            decision = fleet.place(ask, policy)
            if isinstance(decision, Placement):
                assert decision.gpu_id in can
                live.append(decision.allocation_id)
                placed += 1
            else:
                assert not can, (n, sorted(can))
        else:
            fleet.release(live.pop(rng.randrange(len(live))))
    fleet.verify()
    assert placed


def test_the_kept_view_weighs_its_workload_early_then_rarely() -> None:
    due = [d for d in range(1, 30_001) if fleet_model.weighing_due(d)]
    assert due == [64, 128, 256, 512, 1024, 2048, 4096, 8192, 10_000, 20_000, 30_000]


def test_the_workload_a_fleet_policy_weighs_is_every_job_it_placed_not_the_first() -> None:
    # The view is built at the first job, when that job is the whole workload; at the first
    # weighing the workload is every job placed so far.
    fleet = fleet_of(*(node_gpu(f"g{i}", f"n{i // 2}", memory_gib=80) for i in range(8)))
    policy = FleetModelPolicy("fgd")
    for n in range(fleet_model.FIRST_WEIGHING):
        decision = fleet.place(job(f"j{n}", (25, 50)[n % 2], 10), policy)
        assert isinstance(decision, Placement)
        fleet.release(decision.allocation_id)
    state = policy._live[fleet].state
    assert state is not None
    weights = zip(state.shapes, state.s_weight.tolist(), strict=True)
    weighed = {s.gpu_milli: w for s, w in weights if w}
    assert weighed == {25: 0.5, 50: 0.5}  # normalised: 32 jobs of each
