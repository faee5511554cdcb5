"""The FGD paper's simulator's rules as gpuloom's fleet policies reproduce them (docs/placement.md,
"The published rules"): FGD's integer score and its GPU choice, the typical-pod workload, the
baselines' formulas and score tiers, ties in the run's node order, and the protocol (tuning a
list to 1.3x the GPU capacity, the final figure). Small hand-made clusters with the values
worked out by hand, and hypothesis properties against a from-scratch reference written with
plain loops from the published definitions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.fleet.bestfit import bestfit_score
from gpuloom.policies.fleet.dotprod import dotprod_score
from gpuloom.policies.fleet.fgd import FgdPolicy, FragDeltas, fgd_score
from gpuloom.policies.fleet.frag import Fragmentation, frag_options
from gpuloom.policies.fleet.gpuclustering import gpuclustering_score
from gpuloom.policies.fleet.gpupacking import gpupacking_score
from gpuloom.policies.fleet.model import (
    WHOLE_GPU,
    FleetState,
    NodeSpec,
    PodShape,
    TypicalShape,
    pick_best,
    typical_workload,
)
from gpuloom.policies.fleet.registry import get_policy
from gpuloom.sim.fleet import Draws, Workload, arrivals, parse_nodes, parse_pods, simulate

RNG = np.random.default_rng(0)
DATA = Path(__file__).resolve().parent / "data"
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "alibaba-gpu-v2023"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no ../shared/traces beside")


def node(name: str, gpus: int, cpu: int = 64000, model: str = "T4") -> NodeSpec:
    return NodeSpec(name, cpu, 262144, gpus, model)


def share(milli: int, cpu: int = 1000) -> PodShape:
    return PodShape(cpu, 1024, 1, milli)


def whole(k: int, cpu: int = 1000) -> PodShape:
    return PodShape(cpu, 1024, k, WHOLE_GPU)


# ---- the workload FGD weighs ----


def test_typical_pods_key_without_memory_and_stop_at_95_percent() -> None:
    shapes = [
        PodShape(1000, 1024, 1, 500),
        PodShape(1000, 2048, 1, 500),  # the same typical pod: memory is not in the key
        PodShape(2000, 1024, 1, 1000),
        PodShape(4000, 1024, 0, 0),
    ]
    typical, weights = typical_workload(shapes, [10, 10, 5, 1])
    # 20 + 5 = 25 of 26 pods (96%) reach 95%: the CPU-only pod is left out.
    assert typical == (TypicalShape(1000, 1, 500, None), TypicalShape(2000, 1, 1000, None))
    assert weights.tolist() == [0.8, 0.2]


def test_typical_pods_of_equal_count_go_in_descending_cpu_then_gpu_order() -> None:
    # The published list is sorted by sort.Reverse of (count, CPU, GPU milli, ...) ascending:
    # equal counts come with the most CPU, then the most GPU milli, first.
    shapes = [PodShape(2000, 1, 1, 300), PodShape(1000, 1, 1, 700), PodShape(1000, 1, 1, 200)]
    typical, _ = typical_workload(shapes, [1, 1, 1], share=0.5)
    assert typical == (TypicalShape(2000, 1, 300, None), TypicalShape(1000, 1, 700, None))


def test_typical_weights_are_normalised_in_the_published_order() -> None:
    # (count / total) / (covered / total), as the published list is normalised: 1 of 5 pods
    # over 3 covered is 0.33333333333333337 there, not 1 / 3; the last bit can tip a score.
    shapes = [PodShape(4000 - 1000 * i, 1, 1, 500) for i in range(4)]
    typical, weights = typical_workload(shapes, [2, 1, 1, 1], share=0.6)
    assert [t.cpu_milli for t in typical] == [4000, 3000]
    assert weights.tolist() == [(2 / 5) / (3 / 5), (1 / 5) / (3 / 5)]
    assert weights[1] != 1 / 3


def test_typical_pods_key_the_models_as_the_list_writes_them() -> None:
    both = frozenset({"V100M16", "V100M32"})
    shapes = [
        PodShape(1000, 1, 1, 500, both, "V100M16|V100M32"),
        PodShape(1000, 1, 1, 500, both, "V100M16|V100M32|V100M32"),  # the same models
        PodShape(2000, 1, 1, 1000),
    ]
    typical, weights = typical_workload(shapes, [3, 2, 4])
    assert typical == (
        TypicalShape(2000, 1, 1000, None),
        TypicalShape(1000, 1, 500, both, "V100M16|V100M32"),
        TypicalShape(1000, 1, 500, both, "V100M16|V100M32|V100M32"),
    )
    assert weights.tolist() == [4 / 9, 3 / 9, 2 / 9]
    # parse_pods keeps the text: two spellings are two shapes.
    pods = parse_pods(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        "a,1000,1,1,500,V100M16|V100M32\nb,1000,1,1,500,V100M16|V100M32|V100M32\n",
        "p.csv",
        {"V100M16", "V100M32"},
    )
    assert [p.spec for p in pods] == ["V100M16|V100M32", "V100M16|V100M32|V100M32"]
    assert len(Workload.of(pods).shapes) == 2


def test_fragmentation_ignores_memory() -> None:
    # A node with no memory left: a pod that fits its CPU and GPUs still counts as fitting.
    state = FleetState([NodeSpec("a", 64000, 0, 2, "T4")], [share(500)], [1])
    assert Fragmentation.of(state).total() == 0.0
    assert not state.fits(0).any()  # placing still needs the memory


# ---- FGD ----


def test_fgd_score_is_the_truncated_sigmoid_of_the_fragmentation_drop() -> None:
    before = np.array([0.0, 1000.0, 0.0, 0.0, 0.0])
    after = np.array([0.0, 0.0, 1000.0, 10.0, 30.0])
    # sigmoid(0) = 0.5, sigmoid(1) = 0.731, sigmoid(-1) = 0.269, 49.75 and 49.25 truncate to 49
    assert fgd_score(before, after).tolist() == [50, 73, 26, 49, 49]


def test_fgd_ties_go_to_the_first_node_in_the_run_order() -> None:
    state = FleetState([node("a", 2), node("b", 2), node("c", 2)], [share(500)], [1])
    for rank, expected in (([2, 0, 1], 1), ([1, 2, 0], 2), ([0, 1, 2], 0)):
        state.rank = np.array(rank)
        choice = FgdPolicy().choose(state, 0, RNG)
        assert choice is not None and choice.node == expected


def test_fgd_share_takes_the_first_gpu_of_the_top_integer_score() -> None:
    # Typical pods (weights 0.03 / 0.042 / 0.928): shares of 900, 600 and 100. GPUs free
    # [1000, 700]; a 200 share on GPU 0 grows fragmentation by 800 x 0.03 = 24, on GPU 1 by
    # 500 x 0.042 - 200 x 0.03 = 15. Both score int(100 sigmoid(-0.024 or -0.015)) = 49, so the
    # published rule takes GPU 0, though GPU 1 grows it less.
    shapes = [share(900), share(600), share(100), share(300), share(200)]
    state = FleetState([node("a", 2)], shapes, [30, 42, 928, 0, 0], typical_share=1.0)
    state.commit(0, 3, (1,))  # GPU 1: 700 free
    deltas = FragDeltas.of(state)
    assert deltas.scores(4).tolist() == [49]
    _, cols, after = frag_options(state, 4, np.array([0]))
    growth = after - Fragmentation.of(state).nodes()[0]
    assert cols.tolist() == [0, 1] and np.allclose(growth, [24.0, 15.0])
    choice = FgdPolicy().choose(state, 4, RNG)
    assert choice is not None and choice.gpus == (0,)


def test_fgd_scores_are_refreshed_only_for_the_nodes_that_changed() -> None:
    state = FleetState([node("a", 2), node("b", 2)], [share(500), whole(1)], [1, 1])
    deltas = FragDeltas.of(state)
    first = deltas.scores(1).copy()
    state.commit(0, 0, (0,))
    assert deltas.version[1, 1] == state.version[1]  # b untouched: still current
    assert deltas.version[1, 0] != state.version[0]
    again = deltas.scores(1)
    assert again[1] == first[1]
    assert deltas.version[1, 0] == state.version[0]


# ---- the baselines ----


def test_bestfit_score_over_global_maxima() -> None:
    # Free 64 cores and 2 GPUs, a 4-core 1-GPU pod: left = 0.5 x 60000/128000 + 0.5 x 1000/8000
    # = 0.296875, score int(70.3125) = 70. An 8-GPU 96-core node left with 92 cores and 7
    # GPUs: 0.5 x 0.71875 + 0.5 x 0.875 = 0.796875, score 20.
    state = FleetState([node("a", 2), node("b", 8, cpu=96000)], [whole(1, cpu=4000)], [1])
    assert bestfit_score(state, 0).tolist() == [70, 20]
    choice = get_policy("bestfit").choose(state, 0, RNG)
    assert choice is not None and choice.node == 0


def test_dotprod_score_merges_gpus_over_global_maxima() -> None:
    # (64000/128000)(4000/128000) + (2000/8000)(1000/8000) = 0.046875; int(100 (1 - 0.0234)) = 97
    state = FleetState([node("a", 2)], [whole(1, cpu=4000)], [1])
    assert dotprod_score(state, 0).tolist() == [97]


def test_gpupacking_tiers() -> None:
    nodes = [node("idle8", 8), node("idle2", 2), node("used", 2), node("used_full", 2)]
    shapes = [share(300), whole(1), share(800), PodShape(1000, 1024, 0, 0)]
    state = FleetState(nodes, shapes, [1, 1, 1, 1])
    state.commit(2, 0, (0,))  # used: GPU 0 has 700 free
    state.commit(3, 1, (0,))  # used_full: GPU 0 taken whole
    # A 300 share: idle nodes max(33 - idle, idle); on "used" GPU 0 (70% free) 100 - 70 // 10;
    # on "used_full" it needs an idle GPU of a node in use: 49.
    assert gpupacking_score(state, 0).tolist() == [25, 31, 93, 49]
    # A whole GPU on a node in use: max(50 - 1, 33) = 49; an 800 share cannot use the 700.
    assert gpupacking_score(state, 1).tolist() == [25, 31, 49, 49]
    assert gpupacking_score(state, 2).tolist() == [25, 31, 49, 49]
    assert gpupacking_score(state, 3).tolist() == [0, 0, 0, 0]  # CPU-only: first fit
    state.rank = np.array([3, 2, 1, 0])
    choice = get_policy("gpupacking").choose(state, 3, RNG)
    assert choice is not None and choice.node == 3


def test_gpuclustering_tiers_by_affinity() -> None:
    nodes = [node("shares", 8), node("mixed", 8), node("idle", 8), node("other", 8)]
    shapes = [share(300), share(600), whole(1), whole(2), PodShape(1000, 1024, 0, 0)]
    state = FleetState(nodes, shapes, [1, 1, 1, 1, 1])
    state.commit(0, 0, (0,))  # a share: 7700 free, fill 25 x 300 // 8000 = 0
    state.commit(1, 0, (0,))
    state.commit(1, 2, (1,))  # mixed: a share and a 1-GPU pod, fill 25 x 1300 // 8000 = 4
    state.commit(3, 3, (0, 1))  # other: a 2-GPU pod, fill 25 x 2000 // 8000 = 6
    # Any share (600 as well as 300) has the "share" affinity.
    assert gpuclustering_score(state, 1).tolist() == [75, 54, 25, 6]
    assert gpuclustering_score(state, 2).tolist() == [0, 54, 25, 6]
    assert gpuclustering_score(state, 4).tolist() == [0, 0, 0, 0]


# ---- the protocol ----


def test_a_list_is_tuned_up_with_clones_counted_per_gpu() -> None:
    pods = [share(500), whole(4), PodShape(1000, 1024, 0, 0)]
    workload = Workload.of(pods)
    capacity = 10 * 1000
    stream = arrivals(workload, capacity, 1.3, np.random.default_rng(3))
    request = np.array([s.gpu_request for s in workload.shapes])[stream]
    per_gpu = np.array([s.gpu_milli for s in workload.shapes])[stream]
    assert sorted(stream[:3].tolist()) == [0, 1, 2]  # the list first, shuffled
    # Every clone was added while the total plus its per-GPU milli stayed within 13000.
    totals = np.cumsum(request)
    assert all(totals[i - 1] + per_gpu[i] <= 13000 for i in range(3, len(stream)))
    assert totals[-1] > 13000 - 4000  # it stopped only at a draw that would pass


def test_a_list_above_the_target_loses_random_pods_until_within() -> None:
    workload = Workload.of([whole(1)] * 30 + [share(500)] * 10)
    stream = arrivals(workload, 10_000, 1.3, np.random.default_rng(0))
    request = np.array([s.gpu_request for s in workload.shapes])[stream]
    assert 12_500 <= request.sum() <= 13_000
    assert len(stream) < 40


def test_the_figure_is_the_mean_from_129_5_percent_and_the_node_order_is_per_seed() -> None:
    nodes = [node(f"n{i}", 2) for i in range(5)]
    workload = Workload.of([share(300), whole(1), share(700)])
    run = simulate(nodes, workload, get_policy("fgd"), seed=1)
    assert run.alloc_pct_at_130 is not None and 0 < run.alloc_pct_at_130 <= 100
    again = simulate(nodes, workload, get_policy("fgd"), seed=1)
    assert again.alloc_pct_at_130 == run.alloc_pct_at_130


@pytest.mark.parametrize(
    ("rows", "rank", "failed", "pct"),
    [
        ((0, 1), (0, 1), 1, 25.0),  # the 500 ties onto a, so the 600 (2 cores) fits nowhere
        ((0, 1), (1, 0), 0, 55.0),  # b ranks first: the 500 there, the 600 on a
        ((1, 0), (0, 1), 0, 55.0),  # the 600 first: only a has its cores
        ((0, 0), (0, 1), 0, 50.0),  # a row may repeat (a clone): both 500s pack onto a
    ],
)
def test_given_draws_replace_the_seeded_arrivals_and_node_order(
    rows: tuple[int, ...], rank: tuple[int, ...], failed: int, pct: float
) -> None:
    nodes = [node("a", 1), node("b", 1, cpu=1000)]
    workload = Workload.of([share(500, cpu=1000), share(600, cpu=2000)])
    run = simulate(nodes, workload, get_policy("gpupacking"), 0, draws=Draws(rows, rank))
    assert (run.failed_pods, run.alloc_pct_at_130) == (failed, pct)


def test_draws_must_name_pod_rows_and_rank_every_node() -> None:
    nodes, workload = [node("a", 1), node("b", 1)], Workload.of([share(500)])
    with pytest.raises(ValueError, match="rank every node once"):
        simulate(nodes, workload, get_policy("bestfit"), 0, draws=Draws((0,), (0, 0)))
    with pytest.raises(ValueError, match="rows of the pod list"):
        simulate(nodes, workload, get_policy("bestfit"), 0, draws=Draws((1,), (0, 1)))


# Published runs and their figures (the 130 column of the published simulator's
# experiments/analysis/expected_results/analysis_allo_discrete.csv, tune 1.3): the five
# deterministic policies on `gpushare40` at seed 42, where our 10-seed means were furthest
# above the published ones; FGD on `gpuspec25` at seed 44, which it matches only with the
# typical pods keyed by the models as the list writes them (94.75 without).
PUBLISHED_RUNS = [
    ("gpushare40", 42, "gpupacking", 90.16),
    ("gpushare40", 42, "gpuclustering", 89.98),
    ("gpushare40", 42, "bestfit", 91.66),
    ("gpushare40", 42, "dotprod", 89.59),
    ("gpushare40", 42, "fgd", 94.24),
    ("gpuspec25", 44, "fgd", 95.01),
]


@needs_traces
@pytest.mark.parametrize(("pod_list", "seed", "policy", "figure"), PUBLISHED_RUNS)
def test_the_published_run_is_reproduced_exactly_from_its_draws(
    pod_list: str, seed: int, policy: str, figure: float
) -> None:
    """With the published simulator's arrivals and node order for a seed (data/
    published_draws.go), a deterministic policy gives its published figure to the rounding."""
    nodes = parse_nodes((TRACES / "openb_node_list_gpu_node.csv").read_text(), "nodes")
    pods = parse_pods(
        (TRACES / f"openb_pod_list_{pod_list}.csv").read_text(), "pods", {n.model for n in nodes}
    )
    drawn = json.loads((DATA / f"published_draws_{pod_list}_{seed}.json").read_text())
    draws = Draws(pods=tuple(drawn["pods"]), rank=tuple(drawn["rank"]))
    run = simulate(nodes, Workload.of(pods), get_policy(policy), seed=seed, draws=draws)
    assert run.alloc_pct_at_130 == pytest.approx(figure, abs=0.006)


# ---- properties: the policies against a plain-loop reference of the published rules ----


def ref_frag(cpu: int, gpus: list[int], model: str, typical, weights) -> float:
    """A node's fragmentation, written from the published definition with loops."""
    total = sum(gpus)
    frag = 0.0
    for t, w in zip(typical, weights, strict=True):
        if t.gpu_milli == 0:
            frag += w * total  # a CPU-only pod leaves every GPU idle
            continue
        ok_model = t.models is None or model in t.models
        usable = [g for g in gpus if g >= t.gpu_milli]
        if ok_model and len(usable) >= t.num_gpu and cpu >= t.cpu_milli:
            frag += w * sum(g for g in gpus if g < t.gpu_milli)
        else:
            frag += w * total
    return frag


def ref_fgd(state: FleetState, q: int) -> tuple[int, int] | None:
    """(node, GPU or -1) by the published FGD rule, by brute force."""
    shape = state.shapes[q]
    typical, weights = state.typical, state.t_weight.tolist()
    best: tuple[int, int, int] | None = None  # (score, -rank, ...)
    chosen = None
    for n, spec in enumerate(state.nodes):
        if not state.fits_node(n, q):
            continue
        cpu = int(state.cpu_free[n])
        gpus = [int(g) for g in state.gpu_free[n][: spec.gpus]]
        before = ref_frag(cpu, gpus, spec.model, typical, weights)
        options = []
        if shape.num_gpu == 1 and shape.gpu_milli < WHOLE_GPU:
            for j, g in enumerate(gpus):
                if g >= shape.gpu_milli:
                    after = gpus.copy()
                    after[j] -= shape.gpu_milli
                    options.append((j, after))
        else:
            after = gpus.copy()
            left = shape.num_gpu
            for j, g in enumerate(after):
                if left and g == WHOLE_GPU:
                    after[j], left = 0, left - 1
            options.append((-1, after))
        top, gpu = None, -1
        for j, after in options:
            drop = before - ref_frag(cpu - shape.cpu_milli, after, spec.model, typical, weights)
            score = int(1.0 / (1.0 + math.exp(-drop / 1000.0)) * 100)
            if top is None or score > top:
                top, gpu = score, j
        key = (top, -int(state.rank[n]))
        if best is None or key > best[:2]:
            best = (*key, n)
            chosen = (n, gpu)
    return chosen


share_st = st.sampled_from([100, 250, 300, 500, 700, 900])
shape_st = st.one_of(
    st.builds(share, share_st, st.sampled_from([1000, 4000, 16000])),
    st.builds(whole, st.sampled_from([1, 2, 4, 8]), st.sampled_from([2000, 8000, 32000])),
    st.builds(PodShape, st.sampled_from([1000, 8000]), st.just(1024), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(
    gpus=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=6),
    shapes=st.lists(shape_st, min_size=1, max_size=5, unique=True),
    weights=st.lists(st.integers(1, 20), min_size=5, max_size=5),
    arrivals_=st.lists(st.integers(0, 4), min_size=1, max_size=25),
    seed=st.integers(0, 1000),
)
def test_fgd_matches_the_reference_at_every_step(gpus, shapes, weights, arrivals_, seed) -> None:
    nodes = [node(f"n{i}", g, cpu=32000 * (1 + i % 2)) for i, g in enumerate(gpus)]
    state = FleetState(nodes, shapes, weights[: len(shapes)])
    state.rank = np.random.default_rng(seed).permutation(len(nodes))
    policy = FgdPolicy()
    for q in (a % len(shapes) for a in arrivals_):
        expected = ref_fgd(state, q)
        choice = policy.choose(state, q, RNG)
        if expected is None:
            assert choice is None
            continue
        assert choice is not None and choice.node == expected[0]
        if expected[1] >= 0:
            assert choice.gpus == (expected[1],)
        state.commit(choice.node, q, choice.gpus)
        # Fragmentation tracked incrementally equals the reference on every node.
        frag = Fragmentation.of(state).nodes()
        for n, spec in enumerate(nodes):
            gpus_n = [int(g) for g in state.gpu_free[n][: spec.gpus]]
            ref = ref_frag(
                int(state.cpu_free[n]), gpus_n, spec.model, state.typical, state.t_weight.tolist()
            )
            assert math.isclose(frag[n], ref, abs_tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    gpus=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=6),
    shapes=st.lists(shape_st, min_size=1, max_size=5, unique=True),
    arrivals_=st.lists(st.integers(0, 4), min_size=1, max_size=25),
    seed=st.integers(0, 1000),
    policy=st.sampled_from(["bestfit", "dotprod", "gpupacking", "gpuclustering"]),
)
def test_baselines_take_the_best_score_then_the_first_node(
    gpus, shapes, arrivals_, seed, policy
) -> None:
    nodes = [node(f"n{i}", g, cpu=32000 * (1 + i % 3)) for i, g in enumerate(gpus)]
    state = FleetState(nodes, shapes, [1] * len(shapes))
    state.rank = np.random.default_rng(seed).permutation(len(nodes))
    score = {
        "bestfit": bestfit_score,
        "dotprod": dotprod_score,
        "gpupacking": gpupacking_score,
        "gpuclustering": gpuclustering_score,
    }[policy]
    chooser = get_policy(policy)
    for q in (a % len(shapes) for a in arrivals_):
        fits = [n for n in range(len(nodes)) if state.fits_node(n, q)]
        choice = chooser.choose(state, q, RNG)
        if not fits:
            assert choice is None
            continue
        s = score(state, q)
        expected = max(fits, key=lambda n: (s[n], -state.rank[n]))
        assert choice is not None and choice.node == expected
        assert choice.gpus == state.bestfit_gpus(expected, q)
        state.commit(choice.node, q, choice.gpus)


def test_pick_best_refuses_when_nothing_fits() -> None:
    assert pick_best(np.array([-np.inf, -np.inf]), np.array([0, 1])) is None


def test_fgd_scores_hold_when_node_states_are_forgotten_and_renumbered() -> None:
    # Scores are kept per node state; past a limit, the states no node is in are forgotten and
    # the rest renumbered. Kept scores must equal scores computed from scratch throughout.
    shapes = [share(300), share(700), whole(1), whole(2), share(100)]
    state = FleetState([node(f"n{i}", 4) for i in range(5)], shapes, [5, 4, 3, 2, 1])
    deltas = FragDeltas.of(state)
    deltas._states.limit = 6
    rng = np.random.default_rng(3)
    placed: list[tuple[int, int, tuple[int, ...]]] = []
    renumbered = 0
    for _ in range(200):
        if placed and rng.random() < 0.45:
            state.release(*placed.pop(int(rng.integers(len(placed)))))
        else:
            q = int(rng.integers(len(shapes)))
            choice = FgdPolicy().choose(state, q, RNG)
            if choice is not None:
                state.commit(choice.node, q, choice.gpus)
                placed.append((choice.node, q, choice.gpus))
        known = len(deltas._states.ids)
        for q in range(len(shapes)):
            kept = deltas.scores(q).copy()
            assert kept.tolist() == FragDeltas(state).scores(q).tolist()
        renumbered += len(deltas._states.ids) < known
    assert renumbered  # the limit was reached and states were forgotten


# ---- FGD's fragmentation to the last bit, and whole published runs replayed ----


def ref_frag_published(cpu: int, gpus: list[int], model: str, typical, weights) -> float:
    """A node's fragmentation in the published order of floating-point operations, with
    loops: per typical pod in order, weight x milli added to its FragAmount bucket (0 Q1 lacks
    both, 1 Q2 lacks GPU, 2 Q3 satisfied, 3 Q4 lacks CPU, 4 XL, 5 XR, 6 no access; a pod that
    fits adds the milli of its too-full GPUs to Q2), then every bucket but Q3 in index order."""
    buckets = [0.0] * 7
    total = sum(gpus)
    for t, w in zip(typical, weights, strict=True):
        cpu_ok = cpu >= t.cpu_milli
        if t.num_gpu == 0:
            buckets[4 if cpu_ok else 5] += w * total
        elif t.models is not None and model not in t.models:
            buckets[6] += w * total
        elif sum(g >= t.gpu_milli for g in gpus) >= t.num_gpu:
            if cpu_ok:
                buckets[1] += w * sum(g for g in gpus if g < t.gpu_milli)
            else:
                buckets[3] += w * total
        else:
            buckets[1 if cpu_ok else 0] += w * total
    out = 0.0
    for i in (0, 1, 3, 4, 5, 6):
        out += buckets[i]
    return out


def test_fragmentation_is_summed_bucket_by_bucket_as_published() -> None:
    # Typical pods (7, 3 and 1 of 11): an 800 share, a CPU-only pod, a 900 share; GPUs free
    # [700, 1000]. The shares cannot use the 700 (Q2), the CPU-only pod none of the 1700 (XL).
    # Published: Q2 (w1 700 + w3 700), then XL; in pod order the sum is one bit lower.
    shapes = [share(800), PodShape(1000, 1024, 0, 0), share(900), share(300)]
    state = FleetState([node("a", 2)], shapes, [7, 3, 1, 0], typical_share=1.0)
    state.commit(0, 3, (0,))
    w1, w2, w3 = state.t_weight.tolist()
    assert w1 == (7 / 11) / (11 / 11) and state.gpu_free[0, :2].tolist() == [700, 1000]
    published = (w1 * 700 + w3 * 700) + w2 * 1700
    assert published != (w1 * 700 + w2 * 1700) + w3 * 700
    assert Fragmentation.of(state).nodes()[0] == published == 972.7272727272727
    # The share's options weighed through frag_moves (counts updated, not recounted) too.
    _, cols, after = frag_options(state, 3, np.array([0]))
    assert cols.tolist() == [0, 1]
    assert after.tolist() == [
        ref_frag_published(62000, [400, 1000], "T4", state.typical, [w1, w2, w3]),
        ref_frag_published(62000, [700, 700], "T4", state.typical, [w1, w2, w3]),
    ]


def test_one_node_whose_pods_all_fall_in_one_bucket_is_summed_in_pod_order() -> None:
    # Twenty typical shares of 510-700 milli, every one fitting the GPU free at 800 and none
    # the one at 400: all twenty add to Q2, one node at a time. numpy sums a lone axis of
    # twenty pairwise, not in pod order, and the last bit differs from the published sum.
    shapes = [share(510 + 10 * i) for i in range(20)] + [share(200), share(600)]
    weights = [3 + (7 * i) % 11 for i in range(20)] + [0, 0]
    state = FleetState([node("a", 2)], shapes, weights, typical_share=1.0)
    state.commit(0, 20, (0,))
    state.commit(0, 21, (1,))
    assert state.gpu_free[0, :2].tolist() == [800, 400]
    assert len(state.typical) == 20
    expected = ref_frag_published(62000, [800, 400], "T4", state.typical, state.t_weight.tolist())
    pairwise = float(np.sum(state.t_weight * 400))
    assert expected != pairwise  # the order shows in the last bit here
    assert Fragmentation.of(state).nodes()[0] == expected


@settings(max_examples=60, deadline=None)
@given(
    gpus=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=6),
    shapes=st.lists(shape_st, min_size=2, max_size=8, unique=True),
    weights=st.lists(st.integers(1, 97), min_size=8, max_size=8),
    arrivals_=st.lists(st.integers(0, 7), min_size=1, max_size=30),
)
def test_fragmentation_equals_the_published_sum_to_the_last_bit(
    gpus, shapes, weights, arrivals_
) -> None:
    nodes = [
        node(f"n{i}", g, cpu=16000 * (1 + i % 3), model=("T4", "V100")[i % 2])
        for i, g in enumerate(gpus)
    ]
    shapes = [*shapes, PodShape(1000, 1024, 1, 500, frozenset({"V100"}))]
    state = FleetState(nodes, shapes, [*weights[: len(shapes) - 1], 5], typical_share=1.0)
    tracker = Fragmentation.of(state)
    for q in (a % len(shapes) for a in arrivals_):
        fits = np.flatnonzero(state.fits(q))
        if fits.size:
            n = int(fits[0])
            state.commit(n, q, state.bestfit_gpus(n, q))
        frag = tracker.nodes()
        for n, spec in enumerate(nodes):
            free = [int(g) for g in state.gpu_free[n][: spec.gpus]]
            ref = ref_frag_published(
                int(state.cpu_free[n]), free, spec.model, state.typical, state.t_weight.tolist()
            )
            assert frag[n] == ref


def published_columns(
    nodes: list[NodeSpec], workload: Workload, policy: str, draws: dict[str, list[int]]
) -> list[float]:
    """A run's published curve: per column k of 0-130, the mean over the arrivals whose
    arrived GPU request rounds to k% of the capacity of the allocated % at each (to 2
    decimals), as the published analysis tabulates it."""
    state = FleetState(nodes, workload.shapes, workload.weights)
    state.rank = np.asarray(draws["rank"], dtype=np.int64)
    stream = np.asarray(workload.pods, dtype=np.int64)[draws["pods"]]
    request = state.s_k * state.s_d
    chooser, rng = get_policy(policy), np.random.default_rng(0)
    allocated, alloc = np.empty(len(stream)), 0
    for i, q in enumerate(stream.tolist()):
        choice = chooser.choose(state, q, rng)
        if choice is not None:
            state.commit(choice.node, q, choice.gpus)
            alloc += int(request[q])
        allocated[i] = alloc
    pct = np.round(100 * allocated / state.gpu_capacity, 2)
    # From the integer milli: an arrival at exactly k + 0.5% rounds half to even.
    column = np.round(100 * np.cumsum(request[stream]) / state.gpu_capacity)
    return [float(pct[column == k].mean()) for k in range(131)]


@needs_traces
@pytest.mark.parametrize(("pod_list", "seed"), [("gpuspec10", 42), ("cpu250", 43)])
def test_fgd_replays_the_published_fgd_curve_at_every_point(pod_list: str, seed: int) -> None:
    """Given the published draws, our `fgd` places every pod as the published FGD did: its
    curve is the published one at all 131 columns (within the two-decimal rounding). Runs
    where a sum in another order than the published one diverges (by 0.03 and 0.17 at
    130%)."""
    nodes = parse_nodes((TRACES / "openb_node_list_gpu_node.csv").read_text(), "nodes")
    pods = parse_pods(
        (TRACES / f"openb_pod_list_{pod_list}.csv").read_text(), "pods", {n.model for n in nodes}
    )
    draws = json.loads((DATA / f"published_draws_{pod_list}_{seed}.json").read_text())
    published = json.loads((DATA / "published_fgd_curves.json").read_text())["curves"]
    ours = published_columns(nodes, Workload.of(pods), "fgd", draws)
    off = {
        k: (round(o, 4), p)
        for k, (o, p) in enumerate(zip(ours, published[f"{pod_list}/{seed}"], strict=True))
        if abs(o - p) > 0.005 + 1e-9
    }
    assert off == {}
