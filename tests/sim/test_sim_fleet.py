"""The fleet trace simulator (`gpuloom sim fleet`) and its policies, on small synthetic lists
(behaviour) and once on the Alibaba default list (it loads, bestfit completes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.policies.fleet.fgd import FgdPolicy
from gpuloom.policies.fleet.frag import Fragmentation
from gpuloom.policies.fleet.model import FleetState, NodeSpec, PodShape
from gpuloom.policies.fleet.registry import POLICIES, get_policy
from gpuloom.sim.fleet import (
    Draws,
    FleetInputError,
    Workload,
    arrivals,
    parse_lifetimes,
    parse_nodes,
    parse_pods,
    replay,
    simulate,
)

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no ../shared/traces beside")

NODES = """sn,cpu_milli,memory_mib,gpu,model
a,64000,262144,2,V100M16
b,64000,262144,8,T4
c,32000,131072,1,V100M32
"""
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec
p0,4000,8192,1,500,
p1,8000,16384,1,1000,
p2,2000,4096,0,0,
p3,4000,8192,2,1000,V100M16|V100M32
p4,4000,8192,1,250,
"""


def node(name: str, gpus: int, model: str = "T4", cpu: int = 64000) -> NodeSpec:
    return NodeSpec(name, cpu, 262144, gpus, model)


def share(milli: int) -> PodShape:
    return PodShape(1000, 1024, 1, milli)


def run_cli(tmp_path: Path, nodes: str, pods: str, *args: str):
    (tmp_path / "n.csv").write_text(nodes)
    (tmp_path / "p.csv").write_text(pods)
    argv = ["sim", "fleet", "--nodes", str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv")]
    return CliRunner().invoke(cli, [*argv, *args])


def test_parse_small_lists() -> None:
    nodes = parse_nodes(NODES, "n.csv")
    pods = parse_pods(PODS, "p.csv", {n.model for n in nodes})
    assert [n.gpus for n in nodes] == [2, 8, 1]
    assert pods[3].models == frozenset({"V100M16", "V100M32"})
    assert pods[2].gpu_request == 0 and pods[3].gpu_request == 2000


def test_registry_has_every_policy() -> None:
    names = {"random", "bestfit", "dotprod", "gpupacking", "gpuclustering", "fgd", "fgd-pack"}
    assert names | {"best"} <= set(POLICIES)


@pytest.mark.parametrize(
    ("which", "text", "message"),
    [
        ("nodes", "sn,cpu_milli,gpu,model\na,1,1,T4\n", "n.csv, line 1, column memory_mib"),
        ("nodes", NODES.replace("64000,262144,2", "lots,262144,2"), "line 2, column cpu_milli"),
        ("nodes", "sn,cpu_milli,memory_mib,gpu,model\n", "n.csv, line 2, column sn: the node"),
        ("pods", PODS.replace(",gpu_milli,", ",milli,"), "p.csv, line 1, column gpu_milli"),
        (
            "pods",
            PODS.replace("p4,4000,8192,1,250", "p4,4000,8192,1,x"),
            "line 6, column gpu_milli",
        ),
        ("pods", PODS.replace("V100M16|V100M32", "V100M16|H800"), "line 5, column gpu_spec"),
        ("pods", PODS.replace("p0,4000,8192,1,500", "p0,4000,8192,2,500"), "line 2, column gpu_m"),
    ],
)
def test_bad_input_exits_2_naming_file_line_column(
    tmp_path: Path, which: str, text: str, message: str
) -> None:
    nodes, pods = (text, PODS) if which == "nodes" else (NODES, text)
    result = run_cli(tmp_path, nodes, pods, "--policy", "bestfit")
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_unknown_policy_exits_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, NODES, PODS, "--policy", "nope")
    assert result.exit_code == 2 and "fgd" in result.output


def test_json_one_line_per_policy_and_seed(tmp_path: Path) -> None:
    result = run_cli(
        tmp_path, NODES, PODS, "--policy", "fgd", "--policy", "best", "--repeat", "2", "--json"
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["policy"], r["seed"]) for r in lines] == [
        ("fgd", 0),
        ("fgd", 1),
        ("best", 0),
        ("best", 1),
    ]
    keys = {"policy", "seed", "inflate", "alloc_pct_at_100", "alloc_pct_at_130"}
    keys |= {"frag_pct_at_130", "failed_pods", "wall_s", "decisions_per_s"}
    assert set(lines[0]) == keys


def test_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "fleet.png"
    result = run_cli(tmp_path, NODES, PODS, "--policy", "random", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert "ALLOC% @130" in result.output and "random" in result.output
    assert out.stat().st_size > 1000


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pod_needing_more_gpus_than_any_node_fails(policy: str) -> None:
    nodes = [node("a", 2), node("b", 4)]
    workload = Workload.of([PodShape(1000, 1024, 8, 1000), share(500)])
    run = simulate(nodes, workload, get_policy(policy), seed=0, inflate=2.0)
    assert run.failed_pods >= 1
    assert run.alloc_pct_at_100 is not None


def test_constraints_cpu_memory_model() -> None:
    nodes = [node("a", 2, "T4", cpu=2000), node("b", 2, "V100M16")]
    shapes = [PodShape(4000, 1024, 1, 1000), PodShape(1000, 1024, 1, 300, frozenset({"T4"}))]
    state = FleetState(nodes, shapes, [1, 1])
    assert state.fits(0).tolist() == [False, True]  # CPU
    assert state.fits(1).tolist() == [True, False]  # model


def test_shares_pack_onto_one_gpu_and_whole_gpus_take_free_ones() -> None:
    state = FleetState([node("a", 2)], [share(300), PodShape(1000, 1024, 1, 1000)], [1, 1])
    state.commit(0, 0, state.bestfit_gpus(0, 0))
    assert state.bestfit_gpus(0, 0) == (0,)  # best fit: the used GPU again
    assert state.bestfit_gpus(0, 1) == (1,)


def test_fgd_prefers_the_node_left_with_least_unusable_capacity() -> None:
    # The workload is all 600-milli shares. Node a has one GPU with 700 free, node b one idle
    # GPU. A 600 share on a leaves 100 nobody can use but b whole; on b it leaves 400 idle
    # that a 600 share cannot use and a's 700 stays usable. FGD picks a: growth 100 vs 400.
    shapes = [share(600), share(300)]
    state = FleetState([node("a", 1), node("b", 1)], shapes, [1.0, 0.0])
    state.commit(0, 1, (0,))
    frag = Fragmentation.of(state)
    assert frag.nodes().tolist() == [0.0, 0.0]
    choice = FgdPolicy().choose(state, 0, np.random.default_rng(0))
    assert choice is not None and choice.node == 0 and choice.gpus == (0,)
    state.commit(choice.node, 0, choice.gpus)
    assert frag.nodes().tolist() == [100.0, 0.0]


def test_fragmentation_counts_all_free_gpu_for_a_pod_that_cannot_fit() -> None:
    shapes = [PodShape(1000, 1024, 4, 1000)]
    state = FleetState([node("a", 2)], shapes, [1])
    assert Fragmentation.of(state).total() == 2000.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_and_is_deterministic(policy: str) -> None:
    nodes = parse_nodes(NODES, "n.csv")
    workload = Workload.of(parse_pods(PODS, "p.csv", {n.model for n in nodes}))
    first = simulate(nodes, workload, get_policy(policy), seed=5)
    again = simulate(nodes, workload, get_policy(policy), seed=5)
    assert first.summary() | {"wall_s": 0, "decisions_per_s": 0} == again.summary() | {
        "wall_s": 0,
        "decisions_per_s": 0,
    }
    assert 0 < first.alloc_pct_at_130 <= 100


class _OrderRecorder:
    """Places nothing; keeps the node order (`FleetState.rank`) and the shapes it was asked."""

    name = "order-recorder"

    def __init__(self) -> None:
        self.rank: list[int] = []
        self.asked: list[int] = []

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> None:
        self.rank = state.rank.tolist()
        self.asked.append(q)


def test_node_order_is_drawn_after_the_arrivals_so_each_list_has_its_own() -> None:
    nodes = [node(f"n{i:02d}", 1) for i in range(40)]
    short = Workload.of([share(100 * (1 + i % 9)) for i in range(30)])
    long = Workload.of([share(100 * (1 + i % 9)) for i in range(31)])
    orders = []
    for workload in (short, short, long):
        recorder = _OrderRecorder()
        simulate(nodes, workload, recorder, seed=7)
        orders.append(recorder.rank)
        assert sorted(recorder.rank) == list(range(40))
    # One seed, one list: every policy sees the same order (and the same arrivals) ...
    assert orders[0] == orders[1]
    # ... but another list draws a different number of arrivals first, so another order.
    assert orders[0] != orders[2]
    # The arrivals are what the seed draws first, as before the order.
    recorder = _OrderRecorder()
    simulate(nodes, short, recorder, seed=7)
    capacity = 40 * 1000
    assert recorder.asked == arrivals(short, capacity, 1.3, np.random.default_rng(7)).tolist()


@needs_traces
def test_default_list_loads_and_bestfit_completes() -> None:
    nodes = parse_nodes((TRACES / "openb_node_list_gpu_node.csv").read_text(), "nodes")
    pods = parse_pods(
        (TRACES / "openb_pod_list_default.csv").read_text(), "pods", {n.model for n in nodes}
    )
    assert len(nodes) == 1213 and sum(n.gpus for n in nodes) == 6212 and len(pods) == 8152
    run = simulate(nodes, Workload.of(pods), get_policy("bestfit"), seed=0)
    assert 90 < run.alloc_pct_at_130 < 96
    assert run.failed_pods > 0


def test_errors_are_value_errors() -> None:
    with pytest.raises(FleetInputError):
        parse_nodes("sn\n", "x.csv")


# ---- replay (--replay): the list's own creation and deletion times ----

REPLAY_NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,64000,262144,2,V100M16
"""
# Two GPUs. a and b take both; c (1 GPU), g (1 GPU, behind c), d (2 GPUs) and e (half a GPU)
# wait; f needs 3 GPUs and fails. b leaves at 50: c gets its GPU (g and e are tried, refused;
# d is not tried: the freed node cannot hold 2 GPUs). c leaves at 60: g, then e refused; g
# leaves at 61: e. a leaves at 100: d.
REPLAY_PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time
a,1000,1024,1,1000,,0,100
b,1000,1024,1,1000,,10,50
f,1000,1024,3,1000,,5,6
c,1000,1024,1,1000,,20,30
g,1000,1024,1,1000,,22,23
d,1000,1024,2,1000,,25,35
e,1000,1024,1,500,,30,40
"""


class CountingPolicy:
    """bestfit, counting the placements it is asked for (a fake that counts)."""

    def __init__(self) -> None:
        self.inner = get_policy("bestfit")
        self.name = self.inner.name
        self.asked = 0

    def choose(self, state, q, rng):  # the FleetPolicy protocol
        self.asked += 1
        return self.inner.choose(state, q, rng)


def replayed(policy: object = None):
    nodes = parse_nodes(REPLAY_NODES, "n.csv")
    pods = parse_pods(REPLAY_PODS, "p.csv", {n.model for n in nodes})
    lifetimes = parse_lifetimes(REPLAY_PODS, "p.csv")
    chosen = policy if policy is not None else get_policy("bestfit")
    return replay(nodes, Workload.of(pods), lifetimes, chosen, seed=0)


def test_replay_pods_leave_and_waiting_pods_get_freed_capacity_oldest_first() -> None:
    run = replayed()
    assert (run.pods, run.placed_pods, run.failed_pods) == (7, 6, 1)
    # Delays: c 50-20, g 60-22, e 61-30, d 100-25; a and b none.
    assert run.queued_pods == 4
    assert run.delay_max_s == 75
    assert run.delay_mean_s == pytest.approx((30 + 38 + 31 + 75) / 6, abs=0.05)
    # 50% from 0, 100% from 10 until after the last arrival (30): time-weighted 83.33%.
    assert run.alloc_pct_mean == pytest.approx((10 * 50 + 20 * 100) / 30, abs=1e-3)
    assert run.alloc_pct_peak == 100
    # The curve spans the arrivals: 50% at 0, full at the last arrival (30).
    assert run.curve[0] == (0.0, 50.0) and run.curve[-1] == (30.0, 100.0)


def test_replay_tries_only_the_shapes_a_departure_can_take() -> None:
    policy = CountingPolicy()
    replayed(policy)
    # On arrival: a, b, c, d, e (g waits behind c untried, f fits nowhere). At 50: c placed,
    # g and e refused (d not tried). At 60: g placed, e refused. At 61: e. At 100: d.
    assert policy.asked == 5 + 3 + 2 + 1 + 1


def test_replay_cli_json_and_table(tmp_path: Path) -> None:
    result = run_cli(tmp_path, REPLAY_NODES, REPLAY_PODS, "--replay", "--json", "--repeat", "2")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [(line["policy"], line["seed"]) for line in lines] == [("best", 0), ("best", 1)]
    assert lines[0]["queued_pods"] == 4 and lines[0]["failed_pods"] == 1
    assert "curve" not in lines[0] and "delay_p99_s" in lines[0]
    table = run_cli(
        tmp_path, REPLAY_NODES, REPLAY_PODS, "--replay", "--plot", str(tmp_path / "r.png")
    )
    assert table.exit_code == 0, table.output
    assert "DELAY MEAN s" in table.output and (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("pods", "args", "message"),
    [
        (
            REPLAY_PODS.replace("creation_time,", "created,"),
            (),
            "p.csv, line 1, column creation_time: missing column",
        ),
        (
            REPLAY_PODS.replace(",10,50", ",10,5"),
            (),
            "line 3, column deletion_time: 5 is before its creation_time 10",
        ),
        (REPLAY_PODS.replace(",20,30", ",twenty,30"), (), "line 5, column creation_time"),
        (REPLAY_PODS, ("--inflate", "1.3"), "--inflate is for the FGD protocol"),
    ],
)
def test_replay_bad_input_exits_2(
    tmp_path: Path, pods: str, args: tuple[str, ...], message: str
) -> None:
    result = run_cli(tmp_path, REPLAY_NODES, pods, "--replay", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_replay_compress_brings_arrivals_closer_and_pods_wait() -> None:
    nodes = [node("n0", 1)]
    pods = [PodShape(1000, 1024, 1, 1000)] * 2
    lifetimes = [(0, 60), (100, 160)]  # 60 s each, 100 s apart: never together
    workload = Workload.of(pods)
    policy = get_policy("bestfit")
    own = replay(nodes, workload, lifetimes, policy, seed=0)
    assert own.queued_pods == 0 and own.alloc_pct_peak == 100
    assert own.alloc_pct_mean == pytest.approx(60.0)  # busy 60 of the 100 s of arrivals
    faster = replay(nodes, workload, lifetimes, policy, seed=0, compress=2)
    # The second pod now arrives at 50 while the first holds the GPU until 60.
    assert faster.queued_pods == 1 and faster.delay_max_s == 10
    assert faster.curve[-1] == (50.0, 100.0)  # at the second arrival the first still runs
    assert faster.delay_mean_s == 5  # 0 and 10
    with pytest.raises(ValueError, match="compress"):
        replay(nodes, workload, lifetimes, policy, seed=0, compress=0)
    result = CliRunner().invoke(
        cli, ["sim", "fleet", "--nodes", "x", "--pods", "y", "--compress", "2"]
    )
    assert result.exit_code == 2 and "--compress is for --replay" in result.output


def test_draws_file_gives_the_runs_arrivals_node_order_and_seed(tmp_path: Path) -> None:
    nodes = parse_nodes(NODES, "n.csv")
    workload = Workload.of(parse_pods(PODS, "p.csv", {n.model for n in nodes}))
    draws = {"seed": 7, "pods": [4, 0, 2, 1, 4], "rank": [2, 0, 1]}
    (tmp_path / "d.json").write_text(json.dumps(draws))
    result = run_cli(tmp_path, NODES, PODS, "--policy", "fgd", "--draws", str(tmp_path / "d.json"))
    assert result.exit_code == 0, result.output
    result = run_cli(
        tmp_path, NODES, PODS, "--policy", "fgd", "--json", "--draws", str(tmp_path / "d.json")
    )
    line = json.loads(result.output)
    expected = simulate(
        nodes, workload, get_policy("fgd"), 7, draws=Draws((4, 0, 2, 1, 4), (2, 0, 1))
    )
    assert line["seed"] == 7
    assert line["alloc_pct_at_130"] == expected.alloc_pct_at_130
    assert line["failed_pods"] == expected.failed_pods
    # Not the seed's own draws: those place more pods, and fail some.
    own = simulate(nodes, workload, get_policy("fgd"), 7)
    assert own.alloc_pct_at_130 != expected.alloc_pct_at_130


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        ("[1, 2]", (), "d.json: must be a JSON object"),
        ("{", (), "d.json: not JSON"),
        ('{"seed": 1, "pods": [0], "rank": [0, 1, 2], "x": 1}', (), "d.json, key x: unknown"),
        ('{"seed": "1", "pods": [0], "rank": [0, 1, 2]}', (), "d.json, key seed: must be an int"),
        ('{"seed": 1, "pods": [], "rank": [0, 1, 2]}', (), "d.json, key pods: must be a non-empty"),
        ('{"seed": 1, "pods": [0, 5], "rank": [0, 1, 2]}', (), "key pods[1]: 5 is not a row"),
        ('{"seed": 1, "pods": [0, true], "rank": [0, 1, 2]}', (), "key pods[1]: not an integer"),
        ('{"seed": 1, "pods": [0], "rank": [0, 1, 1]}', (), "key rank: must rank every node once"),
        ('{"seed": 1, "pods": [0], "rank": [0, 1]}', (), "it has 2 entries"),
        ('{"seed": 1, "pods": [0], "rank": [0, 1, 2]}', ("--seed", "3"), "leave out --seed"),
        ('{"seed": 1, "pods": [0], "rank": [0, 1, 2]}', ("--repeat", "2"), "leave out --seed"),
        ('{"seed": 1, "pods": [0], "rank": [0, 1, 2]}', ("--replay",), "not --replay"),
    ],
)
def test_bad_draws_file_exits_2_naming_the_key(
    tmp_path: Path, text: str, args: tuple[str, ...], message: str
) -> None:
    (tmp_path / "d.json").write_text(text)
    result = run_cli(tmp_path, NODES, PODS, "--draws", str(tmp_path / "d.json"), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
