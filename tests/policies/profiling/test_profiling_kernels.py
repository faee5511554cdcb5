import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.policies.profiling import KernelAccumulator, aggregate, kernel_id, order_runs
from gpuloom.policies.profiling.kernels import FNV_OFFSET, FNV_PRIME, Runs, summarise

from .helpers import reference_stats


def fnv1a_by_hand(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) % 2**64
    return h


def test_kernel_id_is_fnv1a_over_the_name_then_six_little_endian_u32() -> None:
    assert (FNV_OFFSET, FNV_PRIME) == (0xCBF29CE484222325, 0x100000001B3)
    # Empty name, all dimensions 0: FNV-1a over 24 zero bytes.
    assert kernel_id("", (0, 0, 0), (0, 0, 0)) == fnv1a_by_hand(bytes(24))
    assert kernel_id("", (0, 0, 0), (0, 0, 0)) == 0x81D23FD7003C2305
    data = b"sgemm" + struct.pack("<6I", 1, 2, 3, 256, 1, 1)
    assert data[5:9] == b"\x01\x00\x00\x00" and data[17:21] == b"\x00\x01\x00\x00"
    assert kernel_id("sgemm", (1, 2, 3), (256, 1, 1)) == fnv1a_by_hand(data)
    # The value the C shim's kernel_id() gives for the same launch.
    assert kernel_id("sgemm", (1, 2, 3), (256, 1, 1)) == 0x31404C702F5B6CD7


def test_kernel_id_hashes_utf8_and_tells_grid_from_block() -> None:
    assert kernel_id("ü", (1, 1, 1), (1, 1, 1)) == fnv1a_by_hand(
        "ü".encode() + struct.pack("<6I", *[1] * 6)
    )
    assert kernel_id("k", (2, 1, 1), (1, 1, 1)) != kernel_id("k", (1, 1, 1), (2, 1, 1))
    assert kernel_id("k", (2**32 - 1, 1, 1), (1, 1, 1)) < 2**64


@pytest.mark.parametrize(
    ("name", "grid", "block"),
    [("a\0b", (1, 1, 1), (1, 1, 1)), ("k", (2**32, 1, 1), (1, 1, 1)), ("k", (-1, 1, 1), (1, 1, 1))],
)
def test_kernel_id_refuses_what_the_shim_cannot_hash(name, grid, block) -> None:
    with pytest.raises(ValueError):
        kernel_id(name, grid, block)


@st.composite
def record_sets(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    """Few kernel IDs (some above 2^63), several runs, overlapping and tied timestamps."""
    n = draw(st.integers(1, 60))
    vocabulary = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=5, unique=True))
    ids = draw(st.lists(st.sampled_from(vocabulary), min_size=n, max_size=n))
    start = draw(st.lists(st.integers(0, 400), min_size=n, max_size=n))
    duration = draw(st.lists(st.integers(0, 80), min_size=n, max_size=n))
    run = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    start_ns = np.array(start, dtype=np.int64)
    return (
        np.array(ids, dtype=np.uint64),
        start_ns,
        start_ns + np.array(duration, dtype=np.int64),
        np.array(run, dtype=np.uint32),
    )


def assert_matches_reference(table, ids, start, end, run) -> None:
    expected = reference_stats(ids, start, end, run)
    assert sorted(expected) == [int(k) for k in table.kernel_ids]
    for row in table.rows():
        want = expected[row.kernel_id]
        assert row.sample_count == want["count"]
        assert row.gap_count == want["gap_count"]
        assert row.mean_duration_ns == pytest.approx(want["mean"])
        assert row.p50_duration_ns == pytest.approx(want["p50"])
        assert row.p95_duration_ns == pytest.approx(want["p95"])
        assert row.mean_gap_after_ns == pytest.approx(want["gap"])


@settings(max_examples=150, deadline=None)
@given(record_sets())
def test_aggregate_matches_a_record_by_record_reference(records) -> None:
    table = aggregate(*records, runs=4)
    assert_matches_reference(table, *records)


@settings(max_examples=60, deadline=None)
@given(record_sets(), st.randoms(use_true_random=False), st.integers(1, 6))
def test_accumulator_result_does_not_depend_on_batch_order_or_split(records, rnd, batches):
    ids, start, end, run = records
    order = list(range(len(ids)))
    rnd.shuffle(order)
    accumulator = KernelAccumulator(runs=4)
    for part in np.array_split(np.array(order, dtype=np.int64), batches):
        accumulator.add(ids[part], start[part], end[part], run[part])
    for r in range(4):
        accumulator.complete(r)
    assert accumulator.records == len(ids)
    assert_matches_reference(accumulator.result(), ids, start, end, run)


def test_gaps_skip_the_last_kernel_of_each_run_and_never_cross_runs() -> None:
    # Run 1 happens inside run 0's time span: ordering by time alone would mix them.
    ids = np.array([1, 2, 3, 1, 2, 3], dtype=np.uint64)
    start = np.array([0, 100, 1000, 10, 20, 30])
    end = np.array([50, 200, 1100, 15, 25, 35])
    run = np.array([0, 0, 0, 1, 1, 1])
    table = aggregate(ids, start, end, run)
    by_id = {row.kernel_id: row for row in table.rows()}
    assert by_id[1].mean_gap_after_ns == pytest.approx((50 + 5) / 2)
    assert by_id[2].mean_gap_after_ns == pytest.approx((800 + 5) / 2)
    # Kernel 3 is last in both runs: no gap at all, and the stats say so.
    assert (by_id[3].gap_count, by_id[3].mean_gap_after_ns) == (0, 0.0)
    runs = order_runs(ids, start, end, run)
    assert runs.offsets.tolist() == [0, 3, 6]
    assert np.isnan(runs.gaps_ns[[2, 5]]).all()


def test_overlapping_kernels_have_gap_zero_and_order_is_by_start() -> None:
    # Given out of order; kernel 2 overlaps kernel 1 (concurrent streams).
    ids = np.array([2, 1, 3], dtype=np.uint64)
    start = np.array([40, 0, 200], dtype=np.uint64)
    end = np.array([60, 100, 210], dtype=np.uint64)
    runs = order_runs(ids, start, end, np.zeros(3, np.uint32))
    assert runs.kernel_ids.tolist() == [1, 2, 3]
    assert runs.gaps_ns[:2].tolist() == [0.0, 140.0]
    assert runs.durations_ns.tolist() == [100, 20, 10]


def test_percentiles_interpolate_linearly() -> None:
    durations = np.array([10, 20, 30, 40, 1000])
    start = np.arange(5) * 10_000
    table = aggregate(np.full(5, 7, np.uint64), start, start + durations, np.zeros(5, np.int64))
    row = table.get(7)
    assert row is not None and table.get(8) is None
    assert row.p50_duration_ns == 30
    assert row.p95_duration_ns == pytest.approx(40 + 0.8 * 960)
    assert row.mean_duration_ns == pytest.approx(220)


def test_end_before_start_names_the_record() -> None:
    ids = np.array([1, 1, 1], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"record 2: end_ns 5 < start_ns 9"):
        aggregate(ids, np.array([0, 3, 9]), np.array([1, 4, 5]), np.zeros(3, np.int64))


def test_accumulator_validates_whole_batches_and_names_records() -> None:
    accumulator = KernelAccumulator(runs=2)
    ids = np.array([5, 6], dtype=np.uint64)
    accumulator.add(ids, np.array([0, 10]), np.array([5, 20]), np.array([0, 0]))
    with pytest.raises(ValueError, match=r"record 1 of the batch \(3 overall\): end_ns 1 < "):
        accumulator.add(ids, np.array([0, 10]), np.array([5, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"record 0 of the batch \(2 overall\): run_index 2 is"):
        accumulator.add(ids, np.array([0, 10]), np.array([5, 20]), np.array([2, 1]))
    with pytest.raises(ValueError, match=r"run_index -1 is outside \[0, 2\)"):
        accumulator.add(ids, np.array([0, 10]), np.array([5, 20]), np.array([1, -1]))
    assert accumulator.records == 2  # the refused batches left nothing behind
    with pytest.raises(ValueError, match="same length"):
        accumulator.add(ids, np.array([0]), np.array([5, 20]), np.array([1, 1]))
    with pytest.raises(ValueError, match="integers"):
        accumulator.add(ids, np.array([0.5, 1.0]), np.array([5, 20]), np.array([1, 1]))
    accumulator.complete(0)
    with pytest.raises(ValueError, match="run 0 is already complete"):
        accumulator.add(ids, np.array([30, 40]), np.array([35, 45]), np.array([0, 0]))
    with pytest.raises(ValueError):
        accumulator.complete(2)
    with pytest.raises(ValueError):
        KernelAccumulator(runs=0)


def test_accumulator_leaves_out_runs_never_completed() -> None:
    accumulator = KernelAccumulator(runs=3)
    one = np.ones(2, np.uint64)
    accumulator.add(one, np.array([0, 100]), np.array([10, 110]), np.array([0, 0]))
    accumulator.add(one * 2, np.array([0, 5000]), np.array([10, 5010]), np.array([1, 1]))
    accumulator.complete(0)
    table = accumulator.result()
    assert table.kernel_ids.tolist() == [1]
    assert table.mean_gap_after_ns.tolist() == [90.0]
    assert accumulator.completed_runs == 1
    assert accumulator.measured_runs().count == 3
    accumulator.complete(1)
    assert accumulator.result().kernel_ids.tolist() == [1, 2]


def test_empty_input_gives_an_empty_table() -> None:
    empty = np.zeros(0, np.int64)
    assert len(aggregate(empty.astype(np.uint64), empty, empty, empty)) == 0
    assert len(KernelAccumulator(runs=1).result()) == 0


def test_runs_select_and_positions() -> None:
    runs = Runs.from_sequences([[1, 2, 3], [], [4, 5]], [[10, 20], [], [30]])
    assert runs.positions().tolist() == [0, 1, 2, 0, 1]
    picked = runs.select([2, 0])
    assert picked.kernel_ids.tolist() == [4, 5, 1, 2, 3]
    assert picked.offsets.tolist() == [0, 2, 5]
    assert np.array_equal(picked.gaps_ns, [30, np.nan, 10, 20, np.nan], equal_nan=True)
    assert summarise(runs).gap_count.tolist() == [1, 1, 0, 1, 0]
