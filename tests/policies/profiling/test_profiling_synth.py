import numpy as np
import pytest

from gpuloom.policies.profiling import aggregate, kernel_id, order_runs
from gpuloom.policies.profiling.synth import (
    GapModel,
    UnusableTraceError,
    parse_orion_csv,
    simulate_runs,
    synthesize,
    unusable_reason,
)

from .helpers import ORION, orion

USABLE = sorted(p.stem for p in ORION.glob("*.csv") if not p.stem.endswith("_fb0"))
PLACEHOLDERS = sorted(p.stem for p in ORION.glob("*_fb0.csv"))


def test_the_traces_are_there() -> None:
    assert len(USABLE) == 12 and len(PLACEHOLDERS) == 7


@pytest.mark.parametrize("name", PLACEHOLDERS)
def test_placeholder_traces_are_refused(name: str) -> None:
    trace = orion(name)
    assert "placeholder" in (unusable_reason(trace) or "")
    with pytest.raises(UnusableTraceError, match=name):
        synthesize(trace)


@pytest.mark.parametrize("name", USABLE)
def test_statistics_match_the_synthetic_ground_truth(name: str) -> None:
    trace = orion(name)
    assert unusable_reason(trace) is None
    # Little gap noise and no stalls: what remains to check is the aggregation.
    model = GapModel(noise=0.02, stall_probability=0.0)
    m = synthesize(trace, runs=20, gaps=model, seed=3)
    shuffled = np.random.default_rng(0).permutation(len(m.kernel_ids))
    table = aggregate(
        m.kernel_ids[shuffled],
        m.start_ns[shuffled],
        m.end_ns[shuffled],
        m.run_index[shuffled],
        runs=m.runs,
    )
    ids, occurrences = np.unique(m.sequence, return_counts=True)
    assert np.array_equal(table.kernel_ids, ids)
    assert np.array_equal(table.sample_count, occurrences * 20)
    truth = np.array([m.true_mean_duration_ns[int(k)] for k in ids])
    assert np.allclose(table.mean_duration_ns, truth, rtol=0.05)
    # Expected mean gap per kernel ID: over its positions in the sequence but the last.
    index = table.index_of(m.sequence[:-1])
    sums = np.bincount(index, weights=m.expected_gap_ns, minlength=len(ids))
    counts = np.bincount(index, minlength=len(ids))
    measured = counts > 0
    assert np.array_equal(table.gap_count[measured], counts[measured] * 20)
    assert np.allclose(
        table.mean_gap_after_ns[measured], sums[measured] / counts[measured], rtol=0.05
    )


def test_runs_are_the_trace_sequence_with_the_model_gaps() -> None:
    trace = orion("resnet50_4_fwd")
    m = synthesize(trace, runs=3, seed=1)
    runs = order_runs(m.kernel_ids, m.start_ns, m.end_ns, m.run_index, m.runs)
    for t in range(3):
        assert np.array_equal(runs.run(t), trace.kernel_ids())
    # Runs follow each other: the first kernel of a run starts after the last one ended.
    ends = m.end_ns.reshape(3, -1)[:, -1]
    starts = m.start_ns.reshape(3, -1)[:, 0]
    assert (starts[1:] > ends[:-1]).all()
    assert np.nanmin(runs.gaps_ns) >= 0
    # Pseudo launch dimensions: grid (SM_usage, 1, 1), block (1, 1, 1).
    first = trace.kernels[0]
    assert m.sequence[0] == kernel_id(first.name, (first.sm_usage, 1, 1), (1, 1, 1))


def test_synthesis_is_seeded() -> None:
    trace = orion("bert_2_fwd")
    a, b, c = (synthesize(trace, runs=4, seed=s) for s in (5, 5, 6))
    assert np.array_equal(a.start_ns, b.start_ns) and np.array_equal(a.end_ns, b.end_ns)
    assert not np.array_equal(a.start_ns, c.start_ns)


def test_gap_model_structure() -> None:
    sequence = np.array([1, 2, 1, 2, 1, 3, 1, 2], dtype=np.uint64)
    durations = np.full(len(sequence), 1000)
    kernel_only = GapModel.kernel_only()
    m = simulate_runs(sequence, durations, runs=2, gaps=kernel_only)
    by_kernel = {}
    for k, gap in zip(sequence[:-1].tolist(), m.expected_gap_ns.tolist(), strict=True):
        by_kernel.setdefault(k, set()).add(round(gap, 6))
    assert all(len(gaps) == 1 for gaps in by_kernel.values())
    pairs = simulate_runs(sequence, durations, runs=2, gaps=GapModel.pairs_only())
    after_one = {
        round(g, 6) for k, g in zip(sequence[:-1], pairs.expected_gap_ns, strict=True) if k == 1
    }
    assert len(after_one) == 2  # 1 -> 2 and 1 -> 3 differ
    boundaries = GapModel(pair_ns=0.0, boundary_every=4, stall_probability=0.0)
    gaps = simulate_runs(sequence, durations, runs=2, gaps=boundaries).expected_gap_ns
    assert np.count_nonzero(gaps > boundaries.launch_ns) == 2
    with pytest.raises(ValueError):
        GapModel(noise=-1).validate()


def test_orion_csv_parsing() -> None:
    trace = parse_orion_csv(
        "Name,Profile,Memory_footprint,SM_usage,Duration\n"
        '"void k<float, 2>",1,0,80,4032\nConv,-1,0,0,100480\n',
        name="t",
    )
    assert [k.name for k in trace.kernels] == ["void k<float, 2>", "Conv"]
    assert trace.kernels[1].grid == (1, 1, 1)  # SM_usage 0: grid dimensions start at 1
    assert trace.durations_ns.tolist() == [4032, 100480]
    with pytest.raises(ValueError, match="header"):
        parse_orion_csv("a,b\n1,2\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_orion_csv("Name,Profile,Memory_footprint,SM_usage,Duration\nk,1,0,x,5\n")
