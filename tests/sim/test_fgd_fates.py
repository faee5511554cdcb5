"""`fgd-fates` (`best`): a share goes where the expected final waste grows least, by a table of
what became of each gap on fills of the fleet with pods drawn from the workload; every other
pod, and every pod of a workload `fgd-pack` places as FGD does, as `fgd-pack` places it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.fleet import gap_fates
from gpuloom.policies.fleet.fgd import FgdPolicy, FragDeltas, fgd_score
from gpuloom.policies.fleet.fgd_fates import FgdFatesPolicy, _LeastGrowth
from gpuloom.policies.fleet.fgd_pack import FgdPackPolicy
from gpuloom.policies.fleet.frag import frag_moves
from gpuloom.policies.fleet.gap_fates import MIN_SAMPLES, GapFates, calibrate
from gpuloom.policies.fleet.model import WHOLE_GPU, FleetState, NodeSpec, PodShape
from gpuloom.policies.fleet.registry import get_policy
from gpuloom.sim.fleet import Workload
from tests.sim.test_fgd_pack import placements


def node(name: str, gpus: int, cpu: int = 64000) -> NodeSpec:
    return NodeSpec(name, cpu, 262144, gpus, "T4")


def share(milli: int) -> PodShape:
    return PodShape(1000, 1024, 1, milli)


WHOLE = PodShape(4000, 1024, 1, WHOLE_GPU)


def table(known: dict[int, float], opening_cost: float = 80, cpu: float = 1000) -> GapFates:
    """A table where each gap ends as it is, but for `known`; every gap of 100 milli or more
    takes a share that asks for `cpu`."""
    final = np.arange(WHOLE_GPU + 1, dtype=np.float64)
    for gap, value in known.items():
        final[gap] = value
    least = np.where(np.arange(WHOLE_GPU + 1) >= 100, cpu, np.inf)
    return GapFates(final, np.zeros(WHOLE_GPU + 1, dtype=np.int64), least, opening_cost)


def fleet_with_470_and_650() -> FleetState:
    """Three one-GPU nodes: a 470 share on a, a 650 on b, c idle; the workload asks for the
    three share sizes and whole GPUs."""
    shapes = [share(320), share(470), share(650), WHOLE]
    state = FleetState([node("a", 1), node("b", 1), node("c", 1)], shapes, [3, 3, 3, 1])
    state.commit(0, 1, (0,))
    state.commit(1, 2, (0,))
    return state


def test_a_share_goes_where_the_expected_final_waste_grows_least() -> None:
    # 320 next to the 470 leaves 210, which nothing fills here: growth 210 - 80 = 130; next
    # to the 650 it leaves 30: 30 - 40 = -10; alone it leaves 680, which ends at 100:
    # 100 - 80 (opening) = 20. So b.
    state = fleet_with_470_and_650()
    state.memo["gap_fates"] = table({530: 80, 350: 40, 680: 100})
    choice = FgdFatesPolicy().choose(state, 0, np.random.default_rng(0))
    assert choice is not None and choice.node == 1 and choice.gpus == (0,)
    # Where the 350 gap is known to end badly and a lone 320's 680 gap well, c.
    state = fleet_with_470_and_650()
    state.memo["gap_fates"] = table({530: 80, 350: 0, 680: 10})
    choice = FgdFatesPolicy().choose(state, 0, np.random.default_rng(0))
    assert choice is not None and choice.node == 2


def test_growth_charges_opening_a_free_gpu_and_refuses_what_does_not_fit() -> None:
    fates = table({530: 80, 60: 60}, opening_cost=50)
    growth = fates.growth(np.array([[1000, 530, 100]]), 470, np.array([5000]))
    assert growth.tolist() == [[80 - 50, 60 - 80, np.inf]]


def test_opening_a_free_gpu_is_never_a_gain() -> None:
    # A 320 share alone leaves 680, here known to end at 10, below the opening cost of 80:
    # opening the GPU still grows the waste by 0, as much as joining the 650 (whose 350 gap
    # ends at 30, as the 30 it leaves), not by -70, which would send every share to a free GPU.
    fates = table({680: 10, 350: 30}, opening_cost=80)
    growth = fates.growth(np.array([[1000, 350]]), 320, np.array([5000]))
    assert growth.tolist() == [[0, 0]]
    # A gap that ends above the opening cost is charged as before: 680 ending at 100, +20.
    assert table({680: 100}).growth(np.array([[1000]]), 320, np.array([5000])).tolist() == [[20]]


def test_a_gap_on_a_node_left_without_cpu_for_any_share_that_fits_it_ends_as_it_is() -> None:
    # A 320 share on a free GPU leaves 680, which ends at 100 on a node with CPU to spare;
    # on a node left with less than the 2000 milli every share asks for, it stays 680.
    fates = table({680: 100}, opening_cost=80, cpu=2000)
    free = np.array([[1000], [1000]])
    assert fates.growth(free, 320, np.array([2000, 1999])).tolist() == [[20], [600]]
    # The policy then opens the GPU of the node with CPU left, though the other comes first.
    shapes = [PodShape(2000, 1024, 1, 320), WHOLE]
    state = FleetState([node("a", 1, cpu=3000), node("b", 1, cpu=8000)], shapes, [1, 1])
    state.memo["gap_fates"] = fates
    choice = FgdFatesPolicy().choose(state, 0, np.random.default_rng(0))
    assert choice is not None and choice.node == 1


def test_least_cpu_is_per_gap_the_least_asked_by_a_share_that_fits() -> None:
    shapes = (PodShape(4000, 1, 1, 300), PodShape(1000, 1, 1, 500), PodShape(500, 1, 1, 1000))
    least = gap_fates.least_cpu(shapes, np.array([1.0, 1.0, 1.0]))
    assert least[299] == np.inf and least[300] == least[499] == 4000 and least[500] == 1000
    assert least[1000] == 1000  # the whole-GPU pod is not a share


def test_the_calibration_measures_what_became_of_each_gap() -> None:
    # Only 500 shares, and enough of them to fill the fleet: each share either opens a GPU
    # (leaving 500, which the next one fills) or fills one (leaving 0).
    nodes = (node("a", 2), node("b", 2), node("c", 4))
    shapes = (share(500),)
    fates = calibrate(nodes, shapes, np.array([1.0]), runs=3)
    assert fates.samples[500] == 3 * 8  # 8 GPUs a fill, 3 fills
    assert fates.final[500] == 0
    # A full GPU has no gap for a share to fill: it is not measured, and ends full.
    assert fates.samples[0] == 0 and fates.final[0] == 0
    # Gaps never seen: one a 500 share fits ends as the gap it leaves; others stay.
    assert fates.final[700] == fates.final[200] == 200
    assert fates.final[300] == 300


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([110, 230, 320, 470, 650, 810, 1000]), min_size=1, max_size=4),
    counts=st.lists(st.integers(1, 5), min_size=4, max_size=4),
    gpus=st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=4),
)
def test_no_gap_ends_larger_than_it_was(
    sizes: list[int], counts: list[int], gpus: list[int]
) -> None:
    # Pods never leave a fill, so a GPU's free space only shrinks: whatever was measured or
    # filled in, a gap ends at most as large as it was, and exactly so when nothing fits.
    shapes = tuple(share(d) if d < WHOLE_GPU else WHOLE for d in sizes)
    nodes = tuple(node(f"n{i}", g) for i, g in enumerate(gpus))
    fates = calibrate(nodes, shapes, np.array(counts[: len(shapes)], dtype=float), runs=2)
    gaps = np.arange(WHOLE_GPU + 1)
    assert (fates.final <= gaps + 1e-9).all()
    smallest = min(sizes)
    assert (fates.final[:smallest] == gaps[:smallest]).all()
    seen = fates.samples >= MIN_SAMPLES
    assert (fates.final[seen] >= 0).all()


def test_the_table_is_measured_once_per_fleet_and_typical_shapes(monkeypatch) -> None:
    calls = []
    real = gap_fates.calibrate

    def counting(*args, **kwargs):
        calls.append(args[2].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(gap_fates, "calibrate", counting)
    monkeypatch.setattr(gap_fates, "_CACHE", type(gap_fates._CACHE)())
    nodes = [node("a", 2), node("b", 2)]
    two = [share(300), share(600)]
    for shapes, weights in (
        (two, [1, 1]),
        (two, [1, 1]),
        (two, [1, 3]),
        ([*two, WHOLE], [1, 1, 1]),
    ):
        state = FleetState(nodes, shapes, weights)
        GapFates.of(state)
        GapFates.of(state)
    # The second and third states found the first's table (the same typical shapes); the
    # fourth has a shape more.
    assert calls == [[0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]
    bigger = FleetState([*nodes, node("c", 1)], two, [1, 1])
    GapFates.of(bigger)
    assert len(calls) == 3  # another fleet, another table


def test_a_large_fleet_is_calibrated_on_every_kth_node_within_the_pod_budget() -> None:
    nodes = tuple(node(f"n{i}", 8) for i in range(100))  # 800 GPUs
    shapes = (share(500),)
    # 3 fills x 1.3 x 800 GPUs / 0.5 GPU a pod = 6,240 pods: within 10,000 all nodes, within
    # 2,000 every 4th (1,560 pods).
    assert gap_fates.sample_nodes(nodes, shapes, np.array([1.0]), 3, 10_000) == nodes
    assert gap_fates.sample_nodes(nodes, shapes, np.array([1.0]), 3, 2_000) == nodes[::4]


def test_whole_gpu_and_cpu_only_pods_go_where_fgd_pack_puts_them() -> None:
    # Every pod the same as fgd-pack on a state both have built, unless it is a share.
    nodes = [node(f"n{i}", g) for i, g in enumerate([8, 4, 2, 2, 1])]
    pods = [share(320), share(470), share(650), share(810)] * 3
    pods += [WHOLE] * 6 + [PodShape(2000, 4096, 0, 0)] * 3 + [PodShape(4000, 4096, 2, 1000)]
    workload = Workload.of(pods)
    for seed in range(3):
        state = FleetState(nodes, workload.shapes, workload.weights)
        rng = np.random.default_rng(seed)
        state.rank = rng.permutation(len(nodes))
        ours, pack = FgdFatesPolicy(), FgdPackPolicy()
        for q in rng.permutation(workload.pods * 2).tolist():
            choice = ours.choose(state, q, rng)
            if state.s_k[q] != 1 or state.s_d[q] == WHOLE_GPU:
                assert choice == pack.choose(state, q, rng)
            if choice is not None:
                state.commit(choice.node, q, choice.gpus)


def test_a_workload_fgd_pack_places_as_fgd_is_placed_as_fgd_without_a_table() -> None:
    nodes = [node(f"n{i}", g) for i, g in enumerate([8, 8, 4, 2, 2])]
    small = [share(300), share(500), share(700), PodShape(2000, 4096, 0, 0)] * 3
    heavy = Workload.of(small + [WHOLE] * 8 + [PodShape(4000, 8192, 4, 1000)] * 3)
    for seed in range(3):
        assert placements(FgdFatesPolicy(), nodes, heavy, seed) == placements(
            FgdPolicy(), nodes, heavy, seed
        )
    state = FleetState(nodes, heavy.shapes, heavy.weights)
    FgdFatesPolicy().choose(state, 0, np.random.default_rng(0))
    assert "gap_fates" not in state.memo


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), fates=st.booleans())
def test_gpus_a_share_may_not_take_are_left_out_of_its_scores(seed: int, fates: bool) -> None:
    # The live adapter marks the GPUs a job may not take (`FleetState.usable`): each node is
    # then scored over its other GPUs, its fragmentation as it is. Against the options computed
    # afresh: FGD's top score and first GPU reaching it (read for every node or a few), the
    # least growth, and the GPU chosen.
    nodes = [node(f"n{i}", g) for i, g in enumerate([4, 2, 2, 1, 8])]
    workload = Workload.of([share(230), share(320), share(470), share(650), WHOLE] * 2)
    rng = np.random.default_rng(seed)
    state = FleetState(nodes, workload.shapes, workload.weights)
    policy = FgdFatesPolicy() if fates else FgdPolicy()
    for q in rng.choice(workload.pods, 12).tolist():
        choice = policy.choose(state, q, rng)
        if choice is not None:
            state.commit(choice.node, q, choice.gpus)
    usable = rng.random(state.gpu_free.shape) < 0.5
    every = np.arange(len(nodes))
    for q in range(4):  # the shares
        state.usable = None
        policy.choose(state, q, rng)  # the caches as they are without the limits
        state.usable = usable
        kept = FragDeltas.of(state).read(q)
        rows, cols, after, before = frag_moves(state, q, every)
        options = np.full(state.gpu_free.shape, -np.inf)
        options[rows, cols] = fgd_score(before[rows], after)
        fits = state.fits_rows(q, every)
        left = np.where(usable & fits[:, None], options, -np.inf)
        top = left.max(axis=1)
        assert kept["score"].tolist() == top.tolist()
        placed = top > -np.inf
        assert (kept["gpu"][placed] == (left == top[:, None]).argmax(axis=1)[placed]).all()
        some = every[rng.random(len(nodes)) < 0.5]
        assert FragDeltas.of(state).read(q, some)["score"].tolist() == top[some].tolist()
        choice = policy.choose(state, q, rng)
        assert (choice is None) == (not placed.any())
        if choice is None:
            continue
        assert usable[choice.node, choice.gpus[0]]
        if fates:
            growth = GapFates.of(state, policy.calibration_pods).growth(
                state.gpu_free, int(state.s_d[q]), state.cpu_free - state.s_cpu[q]
            )
            growth = np.where(usable & fits[:, None], growth, np.inf)
            least = growth.min(axis=1)
            kept_least = _LeastGrowth.of(state, policy._fates(state)).read(q)
            assert kept_least.tolist() == least.tolist()
            assert least[choice.node] == least.min()
            assert growth[choice.node, choice.gpus[0]] == least[choice.node]
    state.usable = None


def test_best_is_fgd_fates() -> None:
    assert get_policy("best").name == "fgd-fates"


def test_live_placement_measures_the_table_on_the_smaller_budget() -> None:
    from gpuloom.policies.placement.fleet_model import LIVE_CALIBRATION_PODS, FleetModelPolicy

    live = FleetModelPolicy("best")._policy
    assert isinstance(live, FgdFatesPolicy) and live.calibration_pods == LIVE_CALIBRATION_PODS
    assert LIVE_CALIBRATION_PODS < gap_fates.CALIBRATION_PODS


def test_the_kept_least_growth_and_scores_equal_ones_computed_afresh() -> None:
    # Placements, releases, a row changed and GPUs left out for one decision (as the live
    # adapter does), FGD read for a few nodes at a time, and node states forgotten and
    # renumbered past a (small) limit: the kept least growth and FGD's score and GPU of every
    # share on every node equal a fresh computation throughout.
    nodes = [node(f"n{i}", g) for i, g in enumerate([4, 2, 2, 1, 8])]
    workload = Workload.of([share(230), share(320), share(470), share(810), WHOLE] * 2)
    rng = np.random.default_rng(7)
    state = FleetState(nodes, workload.shapes, workload.weights)
    policy = FgdFatesPolicy()
    policy.choose(state, 0, rng)
    fates = policy._fates(state)
    kept_growth = _LeastGrowth.of(state, fates)
    kept_deltas = FragDeltas.of(state)
    kept_deltas._states.limit = 12
    renumbered = 0
    placed = []
    for step in range(60):
        q = int(rng.choice(workload.pods))
        if placed and rng.random() < 0.3:
            state.release(*placed.pop(int(rng.integers(len(placed)))))
        choice = policy.choose(state, q, rng)
        if choice is not None:
            state.commit(choice.node, q, choice.gpus)
            placed.append((choice.node, q, choice.gpus))
        if step % 7 == 0:  # a row changed and GPUs left out for one decision, then put back
            saved = state.gpu_free[1].copy()
            state.gpu_free[1] = 0
            state.touch(1)
            state.usable = rng.random(state.gpu_free.shape) < 0.5
            policy.choose(state, 0, rng)
            state.usable = None
            state.gpu_free[1] = saved
            state.touch(1)
        known = len(kept_deltas._states.ids)
        for shape in range(len(workload.shapes)):
            if int(state.s_d[shape]) == WHOLE_GPU:
                continue
            assert (
                kept_growth.read(shape).tolist() == _LeastGrowth(state, fates).read(shape).tolist()
            )
            kept = kept_deltas.read(shape)
            fresh = FragDeltas(state).read(shape)
            fits = fresh["score"] > -np.inf
            assert kept["score"].tolist() == fresh["score"].tolist()
            assert kept["gpu"][fits].tolist() == fresh["gpu"][fits].tolist()
        renumbered += len(kept_deltas._states.ids) < known
    assert state.memo["frag_deltas"] is kept_deltas and state.memo["least_growth"] is kept_growth
    assert renumbered  # the limit was reached and states were forgotten
