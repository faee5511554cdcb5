"""Training introspection over real gRPC: a noisy memory sawtooth gives its mini-batch time and
low-memory points, stored in the job profile; noise gives "no cycle", and nothing is stored."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc, profiler_pb2, profiler_pb2_grpc

GIB = 1 << 30


def _training_memory(period_s: float, seconds: float, rng: np.random.Generator):
    """Memory of a training job: activations pile up in the forward pass, are freed in the
    backward pass; samples every ~10 ms with jitter, plus noise."""
    times = np.cumsum(rng.uniform(0.007, 0.013, int(seconds / 0.01)))
    phase = (times % period_s) / period_s
    memory = 2 * GIB + 6 * GIB * np.where(phase < 0.6, phase / 0.6, (1 - phase) / 0.4)
    return times, memory + rng.normal(0, 0.05 * GIB, len(times))


async def test_a_memory_cycle_becomes_the_job_profile(
    profiler: profiler_pb2_grpc.ProfilerStub, stub: profile_store_pb2_grpc.ProfileStoreStub
) -> None:
    times, memory = _training_memory(0.4, 8.0, np.random.default_rng(3))
    analysis = await profiler.AnalyzeMemory(
        profiler_pb2.AnalyzeMemoryRequest(
            job_key="resnet50-train",
            gpu_model="A100-80GB",
            times_s=times.tolist(),
            memory_bytes=memory.tolist(),
            store=True,
        )
    )
    assert analysis.cycle_found and analysis.stable and analysis.stored
    assert analysis.minibatch_time_s == pytest.approx(0.4, rel=0.05)
    assert len(analysis.low_points_s) >= 15
    # The low points sit where memory is lowest: at the end of each backward pass.
    for point in analysis.low_points_s:
        assert (point % 0.4) == pytest.approx(0.0, abs=0.05) or (point % 0.4) > 0.35

    job = await stub.GetJobProfile(
        profile_store_pb2.GetProfileRequest(key="resnet50-train", gpu_model="A100-80GB")
    )
    assert job.minibatch_time_s == pytest.approx(0.4, rel=0.05)
    assert job.minibatch_cv == pytest.approx(analysis.cv)
    assert len(job.low_memory_points_s) == len(analysis.low_points_s)
    assert job.peak_memory_bytes >= 7.8 * GIB
    assert job.solo_throughput == pytest.approx(1 / 0.4, rel=0.05)


async def test_noise_is_not_a_cycle_and_bad_series_are_refused(
    profiler: profiler_pb2_grpc.ProfilerStub, stub: profile_store_pb2_grpc.ProfileStoreStub
) -> None:
    rng = np.random.default_rng(4)
    times = np.arange(0, 5, 0.01)
    analysis = await profiler.AnalyzeMemory(
        profiler_pb2.AnalyzeMemoryRequest(
            job_key="noise",
            gpu_model="A100-80GB",
            times_s=times.tolist(),
            memory_bytes=(4 * GIB + rng.normal(0, GIB, len(times))).tolist(),
            store=True,
        )
    )
    assert not analysis.cycle_found and analysis.reason and not analysis.stored
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetJobProfile(
            profile_store_pb2.GetProfileRequest(key="noise", gpu_model="A100-80GB")
        )
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await profiler.AnalyzeMemory(
            profiler_pb2.AnalyzeMemoryRequest(
                job_key="x", gpu_model="A100", times_s=[0.0, 1.0], memory_bytes=[1.0]
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("memory_bytes")
