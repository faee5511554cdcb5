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
    FleetInputError,
    Workload,
    arrivals,
    parse_nodes,
    parse_pods,
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


def test_inflation_stops_at_the_target() -> None:
    pods = [share(500), PodShape(1000, 1024, 1, 1000), PodShape(1000, 1024, 0, 0)]
    workload = Workload.of(pods)
    capacity = 10 * 1000
    stream = arrivals(workload, capacity, 1.3, np.random.default_rng(3))
    request = np.array([s.gpu_request for s in workload.shapes])[stream]
    assert request.sum() >= 1.3 * capacity > request[:-1].sum()
    assert sorted(stream[:3].tolist()) == [0, 1, 2]  # the list first, shuffled


def test_a_list_beyond_the_target_is_cut() -> None:
    workload = Workload.of([PodShape(1000, 1024, 1, 1000)] * 50)
    stream = arrivals(workload, 10_000, 1.3, np.random.default_rng(0))
    assert len(stream) == 13


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pod_needing_more_gpus_than_any_node_fails(policy: str) -> None:
    nodes = [node("a", 2), node("b", 4)]
    workload = Workload.of([PodShape(1000, 1024, 8, 1000), share(500)])
    run = simulate(nodes, workload, get_policy(policy), seed=0, inflate=1.0)
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
