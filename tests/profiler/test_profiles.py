"""End to end: T measured runs streamed in column batches become a kernel profile in the real
profile store, with durations and gaps matching what was measured."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpuloom.domain.profiles import Dim3, KernelBound
from gpuloom.domain.validation import validate_profile
from gpuloom.policies.profiling.gaps import load_predictor
from gpuloom.policies.profiling.kernels import (
    GRAPH_NODE_KERNEL,
    graph_kernel_id,
    graph_name,
    kernel_id,
)
from gpuloom.services.profiler.convert import pack
from gpuloom.services.profiler.domain import KernelName, Session
from gpuloom.services.profiler.profile import build_kernel_profile
from gpuloom.v1 import (
    common_pb2,
    profile_store_pb2,
    profile_store_pb2_grpc,
    profiler_pb2,
    profiler_pb2_grpc,
)

RUNS = 12
# A run: these kernels in this order; each has a true duration, and the gap after it depends
# on which kernel comes next, so "relu" is followed by 15 us before conv2 but 1 us before pool
# (structure a context predictor can use and the per-kernel mean cannot).
SEQUENCE = ["conv1", "relu", "conv2", "relu", "pool", "fc", "softmax"]
DURATION_NS = {"conv1": 80_000, "relu": 6_000, "conv2": 120_000, "pool": 9_000, "fc": 40_000,
               "softmax": 4_000}  # fmt: skip
GRID, BLOCK = (64, 1, 1), (256, 1, 1)
GRAPH = graph_name([(GRAPH_NODE_KERNEL, 1)])


def _runs(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    ids = np.array([kernel_id(n, GRID, BLOCK) for n in SEQUENCE], dtype=np.uint64)
    runs = []
    for _ in range(RUNS):
        durations = np.array([DURATION_NS[n] for n in SEQUENCE]) * rng.normal(1, 0.02, len(ids))
        following = np.array([SEQUENCE[i + 1] if i + 1 < len(SEQUENCE) else "" for i in
                              range(len(SEQUENCE))])  # fmt: skip
        base = np.select([following == "relu", following == "pool"], [2_000, 1_000], 15_000)
        gaps = base * rng.normal(1, 0.05, len(ids))
        starts = np.cumsum(np.concatenate([[1_000], (durations + gaps)[:-1]]))
        runs.append((ids, starts.astype(np.uint64), (starts + durations).astype(np.uint64)))
    return runs


async def test_t_runs_become_a_stored_kernel_profile(
    profiler: profiler_pb2_grpc.ProfilerStub, stub: profile_store_pb2_grpc.ProfileStoreStub
) -> None:
    session = await profiler.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key="tiny-cnn", gpu_model="A100-80GB", runs=RUNS)
    )
    kernels = [
        profiler_pb2.KernelInfo(
            kernel_id=kernel_id(n, GRID, BLOCK),
            name=n,
            grid=common_pb2.Dim3(x=GRID[0], y=GRID[1], z=GRID[2]),
            block=common_pb2.Dim3(x=BLOCK[0], y=BLOCK[1], z=BLOCK[2]),
        )
        for n in dict.fromkeys(SEQUENCE)
    ]

    async def uploads():  # type: ignore[no-untyped-def]
        for run, (ids, starts, ends) in enumerate(_runs(np.random.default_rng(7))):
            half = len(ids) // 2  # a run split over two messages, completed by the second
            for lo, hi, done in ((0, half, []), (half, len(ids), [run])):
                yield profiler_pb2.MeasurementUpload(
                    session_id=session.session_id,
                    kernels=kernels if run == 0 and lo == 0 else [],
                    kernel_ids=pack(ids[lo:hi], "<u8"),
                    start_ns=pack(starts[lo:hi], "<u8"),
                    end_ns=pack(ends[lo:hi], "<u8"),
                    run_index=pack([run] * (hi - lo), "<u4"),
                    completed_runs=done,
                )

    summary = await profiler.UploadMeasurements(uploads())
    assert summary.records == RUNS * len(SEQUENCE)
    assert list(summary.completed_sessions) == [session.session_id]
    done = await profiler.GetSession(profiler_pb2.GetSessionRequest(session_id=session.session_id))
    assert done.state == profiler_pb2.SESSION_STATE_COMPLETE and done.kernels == 6
    assert done.runs_received == RUNS
    # Gaps depend on the next kernel: a context predictor beats the paper's per-kernel mean.
    assert done.predictor.chosen != "mean"
    assert done.predictor.mae_ns[done.predictor.chosen] < done.predictor.mae_ns["mean"] / 2

    stored = await stub.GetKernelProfile(
        profile_store_pb2.GetProfileRequest(key="tiny-cnn", gpu_model="A100-80GB")
    )
    assert stored.measured_runs == RUNS
    # The chosen predictor is stored with the profile and predicts the gaps it was chosen for.
    predictor = stored.gap_predictor
    assert predictor.kind == done.predictor.chosen
    assert predictor.mae_ns == pytest.approx(done.predictor.mae_ns[predictor.kind])
    fitted = load_predictor(json.loads(predictor.model_json))
    relu, pool, conv2 = (kernel_id(n, GRID, BLOCK) for n in ("relu", "pool", "conv2"))
    assert fitted.gap_after(relu, pool) == pytest.approx(1_000, rel=0.1)
    assert fitted.gap_after(relu, conv2) == pytest.approx(15_000, rel=0.1)
    by_name = {k.name: k for k in stored.kernels}
    for name, true_ns in DURATION_NS.items():
        assert by_name[name].mean_duration_ns == pytest.approx(true_ns, rel=0.05)
        assert by_name[name].grid.x == 64 and by_name[name].block.x == 256
        # 64 blocks of 8 warps; an A100 SM holds 8 of them (64 warps): 8 SMs. No counters
        # measured, so the bound class stays unknown.
        assert by_name[name].sm_usage == 8
        assert by_name[name].bound == profile_store_pb2.KERNEL_BOUND_UNKNOWN
    assert by_name["relu"].sample_count == 2 * RUNS
    assert by_name["softmax"].mean_gap_after_ns == 0  # last in every run: no gap after it
    assert by_name["conv1"].mean_gap_after_ns == pytest.approx(2_000, rel=0.05)
    assert by_name["pool"].mean_gap_after_ns == pytest.approx(15_000, rel=0.05)
    assert by_name["relu"].mean_gap_after_ns == pytest.approx(8_000, rel=0.05)


def _session(gpu_model: str) -> Session:
    return Session("s-1", "task", gpu_model, runs=2, opened_at_unix_s=0.0)


def _columns(ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each kernel once per run, 1 us each, back to back."""
    n = len(ids)
    starts = np.arange(2 * n, dtype=np.int64) * 1_000
    return (
        np.array(ids * 2, dtype=np.uint64),
        starts,
        starts + 1_000,
        np.repeat(np.arange(2), n),
    )


LAUNCHES = {
    "sgemm": (Dim3(264, 1, 1), Dim3(128, 2, 1)),  # 8 warps: 8 per SM, 33 SMs on an H100
    "huge": (Dim3(100_000, 1, 1), Dim3(64, 1, 1)),  # more than a wave: every SM
    GRAPH: (Dim3(0, 0, 0), Dim3(0, 0, 0)),  # a graph has no shape: unknown
}


def _names() -> dict[int, KernelName]:
    names = {}
    for name, (grid, block) in LAUNCHES.items():
        as_tuples = (grid.x, grid.y, grid.z), (block.x, block.y, block.z)
        kid = graph_kernel_id(name) if name == GRAPH else kernel_id(name, *as_tuples)
        names[kid] = KernelName(kid, name, grid, block)
    return names


@pytest.mark.parametrize(
    ("gpu_model", "expected"),
    [
        ("H100-80GB", {"sgemm": 33, "huge": 132, GRAPH: 0}),
        ("t4-16gb", {"sgemm": 40, "huge": 40, GRAPH: 0}),  # T4: 4 such blocks per SM, 40 SMs
        ("A100", {"sgemm": 0, "huge": 0, GRAPH: 0}),  # not a catalogue model: unknown
    ],
)
def test_the_profile_carries_each_kernels_sm_usage_on_the_sessions_model(
    gpu_model: str, expected: dict[str, int]
) -> None:
    names = _names()
    profile, _ = build_kernel_profile(_session(gpu_model), _columns(list(names)), names)
    assert {k.name: k.sm_usage for k in profile.kernels} == expected
    assert {k.bound for k in profile.kernels} == {KernelBound.UNKNOWN}
    validate_profile(profile)


def test_a_launch_shape_that_cannot_run_fails_the_profile_naming_it() -> None:
    names = {
        7: KernelName(7, "wide", Dim3(4, 1, 1), Dim3(1024, 2, 1)),
        8: KernelName(8, "fine", Dim3(4, 1, 1), Dim3(1024, 1, 1)),
    }
    with pytest.raises(ValueError, match="block 1024x2x1 has 2048 threads"):
        build_kernel_profile(_session("H100-80GB"), _columns([7, 8]), names)
