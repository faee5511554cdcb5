"""Every kind of bad profile is refused with InvalidArgument naming the offending field."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gpuloom.domain import profiles as d
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.validation import MAX_ENTRIES, MAX_SM_USAGE, validate_profile
from gpuloom.policies.profiling.kernels import GRAPH_NODE_KERNEL, graph_kernel_id, graph_name
from tests.profile_store import samples


def _kernel(**changes: object) -> d.KernelProfile:
    profile = samples.kernel_profile()
    first = replace(profile.kernels[0], **changes)
    return replace(profile, kernels=(first, *profile.kernels[1:]))


def _point(**changes: object) -> d.ThroughputProfile:
    profile = samples.throughput_profile()
    return replace(profile, points=(replace(profile.points[0], **changes), *profile.points[1:]))


NO_DIM = d.Dim3(0, 0, 0)
GRAPH = graph_name([(GRAPH_NODE_KERNEL, 1), (GRAPH_NODE_KERNEL, 2)])

BAD = {
    "empty key": (replace(samples.kernel_profile(), key=""), "profile.meta.key"),
    "over-long key": (replace(samples.kernel_profile(), key="k" * 257), "profile.meta.key"),
    "key with control char": (replace(samples.mig_profile(), key="a\nb"), "profile.meta.key"),
    "key with outer space": (replace(samples.mig_profile(), key=" a"), "profile.meta.key"),
    "empty gpu model": (replace(samples.job_profile(), gpu_model=""), "profile.meta.gpu_model"),
    "no kernels": (replace(samples.kernel_profile(), kernels=()), "profile.kernels"),
    "zero runs": (replace(samples.kernel_profile(), measured_runs=0), "profile.measured_runs"),
    "negative duration": (_kernel(mean_duration_ns=-1.0), "profile.kernels[0].mean_duration_ns"),
    "NaN duration": (_kernel(p95_duration_ns=math.nan), "profile.kernels[0].p95_duration_ns"),
    "infinite gap": (_kernel(mean_gap_after_ns=math.inf), "profile.kernels[0].mean_gap_after_ns"),
    "p50 above p95": (_kernel(p50_duration_ns=5000.0), "profile.kernels[0].p50_duration_ns"),
    "zero grid": (_kernel(grid=d.Dim3(0, 1, 1)), "profile.kernels[0].grid.x"),
    "block too large": (_kernel(block=d.Dim3(1, 1, 65)), "profile.kernels[0].block.z"),
    "no samples": (_kernel(sample_count=0), "profile.kernels[0].sample_count"),
    "graph with a grid": (
        _kernel(name=GRAPH, grid=d.Dim3(1, 1, 1), block=NO_DIM),
        "profile.kernels[0].grid",
    ),
    "graph with a block": (_kernel(name=GRAPH, grid=NO_DIM), "profile.kernels[0].block"),
    "graph name not hex": (
        _kernel(name="<graph:00000000000000zz>", grid=NO_DIM, block=NO_DIM),
        "profile.kernels[0].name",
    ),
    "kernel without dims": (_kernel(grid=NO_DIM, block=NO_DIM), "profile.kernels[0].grid.x"),
    "empty kernel name": (_kernel(name=""), "profile.kernels[0].name"),
    "duplicate kernel id": (
        replace(
            samples.kernel_profile(),
            kernels=samples.kernel_profile().kernels[:1] * 2,
        ),
        "profile.kernels[1]",
    ),
    "SM usage above the model's SMs": (
        replace(_kernel(sm_usage=133), gpu_model="H100-80GB"),
        "profile.kernels[0].sm_usage",
    ),
    "SM usage above the cap, model unknown": (
        _kernel(sm_usage=MAX_SM_USAGE + 1),
        "profile.kernels[0].sm_usage",
    ),
    "negative SM usage": (_kernel(sm_usage=-1), "profile.kernels[0].sm_usage"),
    "fractional SM usage": (_kernel(sm_usage=1.5), "profile.kernels[0].sm_usage"),
    "unknown bound class": (_kernel(bound="fast"), "profile.kernels[0].bound"),
    "SM 0": (_point(sm_percent=0), "profile.points[0].sm_percent"),
    "SM 101": (_point(sm_percent=101), "profile.points[0].sm_percent"),
    "quota 0": (_point(quota_percent=0.0), "profile.points[0].quota_percent"),
    "quota above 100": (_point(quota_percent=100.5), "profile.points[0].quota_percent"),
    "p50 above p99": (_point(p50_latency_ms=99.0), "profile.points[0].p50_latency_ms"),
    "duplicate grid point": (
        replace(samples.throughput_profile(), points=samples.throughput_profile().points[:1] * 2),
        "profile.points[1]",
    ),
    "MIG size 5": (
        replace(samples.mig_profile(), times=(d.MigTime(5, 1.0),)),
        "profile.times[0].slices",
    ),
    "MIG time 0": (
        replace(samples.mig_profile(), times=(d.MigTime(1, 0.0),)),
        "profile.times[0].exec_time_s",
    ),
    "duplicate MIG size": (
        replace(samples.mig_profile(), times=(d.MigTime(1, 2.0), d.MigTime(1, 3.0))),
        "profile.times[1]",
    ),
    "mini-batch 0": (
        replace(samples.job_profile(), minibatch_time_s=0.0),
        "profile.minibatch_time_s",
    ),
    "utilisation 120": (
        replace(samples.job_profile(), gpu_utilization_percent=120.0),
        "profile.gpu_utilization_percent",
    ),
    "memory beyond int64": (
        replace(samples.job_profile(), peak_memory_bytes=2**63),
        "profile.peak_memory_bytes",
    ),
    "too many entries": (
        replace(
            samples.mig_profile(), times=tuple(d.MigTime(1, 1.0) for _ in range(MAX_ENTRIES + 1))
        ),
        "profile.times",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_profile_is_refused_naming_the_field(case: str) -> None:
    profile, field = BAD[case]
    with pytest.raises(InvalidArgument) as refused:
        validate_profile(profile)
    assert refused.value.field == field


@pytest.mark.parametrize("make", samples.ALL_KINDS)
def test_valid_profiles_pass(make: object) -> None:
    validate_profile(make())  # type: ignore[operator]


def test_a_graph_entry_is_its_name_and_no_dimensions() -> None:
    """A CUDA graph measured as one unit: named by its structure, all six dimensions 0."""
    profile = _kernel(name=GRAPH, kernel_id=graph_kernel_id(GRAPH), grid=NO_DIM, block=NO_DIM)
    validate_profile(profile)


def test_sm_usage_may_reach_the_models_sm_count_and_the_cap() -> None:
    validate_profile(replace(_kernel(sm_usage=132), gpu_model="H100-80GB"))
    validate_profile(replace(_kernel(sm_usage=132), gpu_model="h100-80gb"))  # as find_model
    validate_profile(_kernel(sm_usage=MAX_SM_USAGE))  # "A100": not a catalogue name
    validate_profile(_kernel(sm_usage=0, bound=d.KernelBound.UNKNOWN))  # unknown, unknown
