"""`fgd-pack` (`best`): FGD's growth is the primary key; shares and CPU-only pods pack among
near-ties of FGD's own GPU model; whole-GPU pods go where FGD puts them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.fleet.fgd import FgdPolicy, FragDeltas
from gpuloom.policies.fleet.fgd_pack import (
    CPU_BOUND,
    MULTI_GPU_SHARE,
    FgdPackPolicy,
    cpu_pressure,
    multi_gpu_share,
)
from gpuloom.policies.fleet.model import Choice, FleetPolicy, FleetState, NodeSpec, PodShape
from gpuloom.sim.fleet import Workload

MODELS = ("T4", "V100M16")


def node(name: str, gpus: int, model: str = "T4", cpu: int = 64000) -> NodeSpec:
    return NodeSpec(name, cpu, 262144, gpus, model)


def share(milli: int, models: frozenset[str] | None = None) -> PodShape:
    return PodShape(1000, 1024, 1, milli, models)


def test_a_share_packs_among_top_score_ties_where_fgd_takes_the_first_node() -> None:
    # Only 500-milli shares in the workload: on a (one GPU taken whole) or on b (idle) the
    # share leaves nothing unusable: both score 50. FGD takes the first node in the run's
    # order; fgd-pack takes a, the node left with the least free GPU, whatever the order.
    shapes = [share(500), PodShape(1000, 1024, 1, 1000)]
    for rank in ([0, 1], [1, 0]):
        state = FleetState([node("a", 2), node("b", 2)], shapes, [1.0, 0.0])
        state.rank = np.array(rank)
        state.commit(0, 1, (0,))
        assert FragDeltas.of(state).scores(0).tolist() == [50, 50]
        choice = FgdPackPolicy().choose(state, 0, np.random.default_rng(0))
        assert choice is not None and choice.node == 0 and choice.gpus == (1,)
        fgd = FgdPolicy().choose(state, 0, np.random.default_rng(0))
        assert fgd is not None and fgd.node == rank.index(0)


@settings(max_examples=60, deadline=None)
@given(
    gpus=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=5),
    models=st.lists(st.sampled_from(MODELS), min_size=5, max_size=5),
    used=st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0, 1, 2])), max_size=8),
    k=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_whole_gpu_pods_go_exactly_where_fgd_puts_them(
    gpus: list[int],
    models: list[str],
    used: list[tuple[int, int]],
    k: int,
    seed: int,
) -> None:
    nodes = [node(f"n{i}", g, models[i]) for i, g in enumerate(gpus)]
    shapes = [share(300), share(700), PodShape(1000, 1024, 1, 1000), PodShape(2000, 2048, k, 1000)]
    state = FleetState(nodes, shapes, [2, 1, 3, 1])
    state.rank = np.random.default_rng(seed).permutation(len(nodes))
    for n, q in used:  # some pods placed already, so nodes differ
        if n < len(nodes) and state.fits_node(n, q):
            state.commit(n, q, state.bestfit_gpus(n, q))
    ours = FgdPackPolicy().choose(state, 3, np.random.default_rng(seed))
    theirs = FgdPolicy().choose(state, 3, np.random.default_rng(seed))
    assert ours == theirs


def placements(
    policy: FleetPolicy, nodes: list[NodeSpec], workload: Workload, seed: int
) -> list[Choice | None]:
    """Where `policy` puts the workload's pods (twice over), one at a time."""
    state = FleetState(nodes, workload.shapes, workload.weights)
    rng = np.random.default_rng(seed)
    state.rank = rng.permutation(len(nodes))
    chosen = []
    for q in rng.permutation(workload.pods * 2).tolist():
        choice = policy.choose(state, q, rng)
        if choice is not None:
            state.commit(choice.node, q, choice.gpus)
        chosen.append(choice)
    return chosen


def _as_fgd_above_packing_below(nodes: list[NodeSpec], heavy: Workload, light: Workload) -> None:
    """Above its threshold a workload is placed exactly as FGD places it; below it, packing
    moves small pods on some seed."""
    differs = False
    for seed in range(4):
        ours = placements(FgdPackPolicy(), nodes, heavy, seed)
        assert ours == placements(FgdPolicy(), nodes, heavy, seed)
        ours = placements(FgdPackPolicy(), nodes, light, seed)
        differs |= ours != placements(FgdPolicy(), nodes, light, seed)
    assert differs


def test_a_workload_heavy_in_multi_gpu_pods_is_placed_exactly_as_fgd_places_it() -> None:
    nodes = [node(f"n{i}", g, "T4" if i % 2 else "V100M16") for i, g in enumerate([8, 8, 4, 2, 2])]
    small = [share(300), share(500), share(700), PodShape(2000, 4096, 0, 0)] * 3
    whole = [PodShape(1000, 1024, 1, 1000)] * 8
    light = Workload.of(small + whole + [PodShape(4000, 8192, 2, 1000)])
    heavy = Workload.of(small + whole + [PodShape(4000, 8192, 4, 1000)] * 3)
    share_of = [multi_gpu_share(FleetState(nodes, w.shapes, w.weights)) for w in (light, heavy)]
    assert share_of[0] < MULTI_GPU_SHARE <= share_of[1]
    _as_fgd_above_packing_below(nodes, heavy, light)


def test_a_workload_asking_the_fleets_cpu_per_gpu_is_placed_exactly_as_fgd_places_it() -> None:
    # 5 nodes, 24 GPUs, 320 cores: 13.3 cores per GPU. Both workloads ask for the same GPUs;
    # the CPU-only pods of the heavy one bring its CPU per GPU to the fleet's and above.
    nodes = [node(f"n{i}", g, "T4" if i % 2 else "V100M16") for i, g in enumerate([8, 8, 4, 2, 2])]
    gpu_pods = [share(300), share(500), share(700)] * 3 + [PodShape(1000, 1024, 1, 1000)] * 4
    light = Workload.of(gpu_pods + [PodShape(2000, 4096, 0, 0)] * 3)
    heavy = Workload.of(gpu_pods + [PodShape(16000, 4096, 0, 0)] * 8)
    pressure = [cpu_pressure(FleetState(nodes, w.shapes, w.weights)) for w in (light, heavy)]
    assert pressure[0] < CPU_BOUND <= pressure[1]
    _as_fgd_above_packing_below(nodes, heavy, light)


def test_cpu_pressure_is_the_workloads_cpu_per_gpu_over_the_fleets() -> None:
    nodes = [node("a", 4, cpu=64000), node("b", 4, cpu=32000)]  # 12 cores per GPU
    # per pod on average: (6 + 0 + 30) / 3 = 12 cores and (2000 + 1000 + 0) / 3 = 1000 milli
    shapes = [PodShape(6000, 1024, 2, 1000), PodShape(0, 1024, 1, 1000), PodShape(30000, 1, 0, 0)]
    assert cpu_pressure(FleetState(nodes, shapes, [1, 1, 1])) == 1.0
    assert cpu_pressure(FleetState(nodes, shapes[2:], [1])) == float("inf")  # no GPU asked
