"""Valid profiles of every kind, for tests to store, corrupt and compare."""

from __future__ import annotations

from dataclasses import replace

from gpuloom.domain import profiles as d

BOUNDS = (d.KernelBound.COMPUTE, d.KernelBound.MEMORY, d.KernelBound.UNKNOWN)


def kernel_profile(
    key: str = "resnet50-train", gpu_model: str = "A100", n: int = 3
) -> d.KernelProfile:
    return d.KernelProfile(
        key=key,
        gpu_model=gpu_model,
        measured_runs=20,
        kernels=tuple(
            d.KernelStats(
                kernel_id=0xFEED_0000_0000_0000 + i,  # above 2^63: exercises unsigned handling
                name=f"void sgemm_kernel<{i}>(float*, float const*)",
                grid=d.Dim3(128 + i, 2, 1),
                block=d.Dim3(256, 1, 1),
                sample_count=19,
                mean_duration_ns=1000.0 + i,
                p50_duration_ns=950.0 + i,
                p95_duration_ns=1400.0 + i,
                mean_gap_after_ns=35.5,
                sm_usage=16 + i,
                bound=BOUNDS[i % len(BOUNDS)],
            )
            for i in range(n)
        ),
    )


THROUGHPUT_POINTS = (
    d.ThroughputPoint(12, 40.0, 180.0, 8.0, 21.0),
    d.ThroughputPoint(24, 40.0, 330.0, 6.5, 15.0),
    d.ThroughputPoint(100, 100.0, 1500.0, 2.0, 4.0),
)


def throughput_profile(
    key: str = "resnet-infer",
    gpu_model: str = "A100",
    points: tuple[d.ThroughputPoint, ...] = THROUGHPUT_POINTS,
) -> d.ThroughputProfile:
    """(SM %, quota %, requests/s, p50 ms, p99 ms) points of `key` on `gpu_model`."""
    return d.ThroughputProfile(key=key, gpu_model=gpu_model, points=points)


def mig_profile(key: str = "rodinia-lud", gpu_model: str = "A100") -> d.MigProfile:
    return d.MigProfile(
        key=key,
        gpu_model=gpu_model,
        times=(d.MigTime(1, 40.0), d.MigTime(2, 21.0), d.MigTime(3, 15.0), d.MigTime(7, 7.5)),
    )


def job_profile(key: str = "bert-finetune", gpu_model: str = "V100") -> d.JobProfile:
    return d.JobProfile(
        key=key,
        gpu_model=gpu_model,
        minibatch_time_s=0.215,
        peak_memory_bytes=11 * 2**30,
        gpu_utilization_percent=87.5,
        solo_throughput=4.65,
        colocated=(d.ColocatedThroughput("resnet50-train", 3.1),),
        minibatch_cv=0.04,
        low_memory_points_s=(0.05, 0.265, 0.48),
        low_memory_bytes=3 * 2**30,
    )


def kernel_profile_with_predictor(
    key: str = "bert-infer", gpu_model: str = "A100"
) -> d.KernelProfile:
    return replace(
        kernel_profile(key, gpu_model),
        gap_predictor=d.GapPredictorModel(
            kind="pair",
            mae_ns=812.5,
            candidates_mae_ns={"mean": 4100.0, "pair": 812.5, "position": 830.0},
            model_json='{"name": "pair", "pairs": [["feed0000000000", "feed0000000001", 35.5]]}',
        ),
    )


ALL_KINDS = (
    kernel_profile,
    kernel_profile_with_predictor,
    throughput_profile,
    mig_profile,
    job_profile,
)
