"""Validation of profiles before anything is written. Errors name the field as the proto does."""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterable, Sequence

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import find_model
from gpuloom.domain.profiles import (
    Dim3,
    GapPredictorModel,
    JobProfile,
    KernelBound,
    KernelProfile,
    MigProfile,
    Profile,
    ThroughputPoint,
    ThroughputProfile,
)
from gpuloom.domain.shares import validate_mig_slices

MAX_KEY_CHARS = 256
MAX_GPU_MODEL_CHARS = 128
MAX_KERNEL_NAME_CHARS = 8192
MAX_ENTRIES = 100_000
MAX_MEASURED_RUNS = 1_000_000
MAX_INT64 = 2**63 - 1
# CUDA launch limits: grid x up to 2^31-1, grid y/z up to 65535; block up to 1024x1024x64.
GRID_LIMITS = (2**31 - 1, 65_535, 65_535)
BLOCK_LIMITS = (1024, 1024, 64)
# SMs a kernel may ask for on a GPU model the catalogue does not know: far above any GPU's
# SM count (the largest today has under 200), so only a corrupt value is refused.
MAX_SM_USAGE = 1024


def check_name(field: str, value: str, max_chars: int) -> None:
    """A key, model or name: non-empty, bounded, no control characters, no outer whitespace."""
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > max_chars:
        raise InvalidArgument(field, f"is {len(value)} characters long, at most {max_chars}")
    if value != value.strip():
        raise InvalidArgument(field, "must not start or end with whitespace")
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise InvalidArgument(field, "must not contain control characters")


def check_key(field: str, value: str) -> None:
    check_name(field, value, MAX_KEY_CHARS)


def check_gpu_model(field: str, value: str) -> None:
    check_name(field, value, MAX_GPU_MODEL_CHARS)


def check_non_negative(field: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(field, f"must be a finite number >= 0, got {value}")


def check_positive(field: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(field, f"must be a finite number > 0, got {value}")


def check_range(field: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgument(field, f"must be within {low}..{high}, got {value}")


def check_entries(field: str, entries: Sequence[object]) -> None:
    if not entries:
        raise InvalidArgument(field, "must have at least one entry")
    if len(entries) > MAX_ENTRIES:
        raise InvalidArgument(field, f"has {len(entries)} entries, at most {MAX_ENTRIES}")


def check_unique(field: str, keys: Iterable[object], what: str) -> None:
    seen: set[object] = set()
    for index, key in enumerate(keys):
        if key in seen:
            raise InvalidArgument(f"{field}[{index}]", f"duplicate {what} {key}")
        seen.add(key)


def check_dim3(field: str, dim: Dim3, limits: tuple[int, int, int]) -> None:
    for axis, value, limit in zip("xyz", (dim.x, dim.y, dim.z), limits, strict=True):
        if not 1 <= value <= limit:
            raise InvalidArgument(f"{field}.{axis}", f"must be within 1..{limit}, got {value}")


def check_version(field: str, version: int | None) -> None:
    if version is not None and not 0 <= version <= MAX_INT64:
        raise InvalidArgument(field, f"must be within 0..{MAX_INT64}, got {version}")


# A CUDA graph's entry (measured and admitted as one unit, shim/src/graphs.c): this name, with
# all six dimensions 0; no kernel has either.
GRAPH_NAME = re.compile(r"<graph:[0-9a-f]{16}>")
NO_DIM = Dim3(0, 0, 0)


def _check_shape(f: str, name: str, grid: Dim3, block: Dim3) -> None:
    """A kernel's launch dimensions, or a graph's shape: its name and no dimensions."""
    if GRAPH_NAME.fullmatch(name):
        for field, dim in ((f"{f}.grid", grid), (f"{f}.block", block)):
            if dim != NO_DIM:
                raise InvalidArgument(field, f"must be 0 0 0 for a graph ({name}), got {dim}")
        return
    if name.startswith("<graph"):
        raise InvalidArgument(f"{f}.name", "a graph is named <graph:16 lowercase hex digits>")
    check_dim3(f"{f}.grid", grid, GRID_LIMITS)
    check_dim3(f"{f}.block", block, BLOCK_LIMITS)


def _check_kernel_profile(p: KernelProfile) -> None:
    check_range("profile.measured_runs", p.measured_runs, 1, MAX_MEASURED_RUNS)
    check_entries("profile.kernels", p.kernels)
    model = find_model(p.gpu_model)
    most_sms, of_what = (
        (model.sm_count, f"the {model.name}'s SMs")
        if model
        else (MAX_SM_USAGE, "a GPU model not in the catalogue")
    )
    for i, k in enumerate(p.kernels):
        f = f"profile.kernels[{i}]"
        check_range(f"{f}.kernel_id", k.kernel_id, 0, 2**64 - 1)
        check_name(f"{f}.name", k.name, MAX_KERNEL_NAME_CHARS)
        _check_shape(f, k.name, k.grid, k.block)
        check_range(f"{f}.sample_count", k.sample_count, 1, MAX_INT64)
        check_non_negative(f"{f}.mean_duration_ns", k.mean_duration_ns)
        check_non_negative(f"{f}.p50_duration_ns", k.p50_duration_ns)
        check_non_negative(f"{f}.p95_duration_ns", k.p95_duration_ns)
        check_non_negative(f"{f}.mean_gap_after_ns", k.mean_gap_after_ns)
        if k.p50_duration_ns > k.p95_duration_ns:
            raise InvalidArgument(f"{f}.p50_duration_ns", "must not exceed p95_duration_ns")
        whole = isinstance(k.sm_usage, int) and not isinstance(k.sm_usage, bool)
        if not whole or not 0 <= k.sm_usage <= most_sms:
            raise InvalidArgument(
                f"{f}.sm_usage", f"must be within 0..{most_sms} ({of_what}), got {k.sm_usage}"
            )
        if not isinstance(k.bound, KernelBound):
            known = ", ".join(b.value for b in KernelBound)
            raise InvalidArgument(
                f"{f}.bound", f"unknown bound class {k.bound!r}; use one of {known}"
            )
    check_unique("profile.kernels", (k.kernel_id for k in p.kernels), "kernel_id")
    if p.gap_predictor is not None:
        _check_gap_predictor(p.gap_predictor)


MAX_PREDICTOR_JSON_CHARS = 4 << 20


def _check_gap_predictor(g: GapPredictorModel) -> None:
    f = "profile.gap_predictor"
    check_name(f"{f}.kind", g.kind, 32)
    check_non_negative(f"{f}.mae_ns", g.mae_ns)
    for name, mae in g.candidates_mae_ns.items():
        check_name(f"{f}.candidates_mae_ns", name, 32)
        check_non_negative(f"{f}.candidates_mae_ns[{name}]", mae)
    if len(g.model_json) > MAX_PREDICTOR_JSON_CHARS:
        raise InvalidArgument(f"{f}.model_json", f"at most {MAX_PREDICTOR_JSON_CHARS} characters")
    try:
        json.loads(g.model_json)
    except ValueError:
        raise InvalidArgument(f"{f}.model_json", "must be JSON") from None


def check_throughput_point(f: str, point: ThroughputPoint) -> None:
    check_range(f"{f}.sm_percent", point.sm_percent, 1, 100)
    if not (math.isfinite(point.quota_percent) and 0 < point.quota_percent <= 100):
        raise InvalidArgument(
            f"{f}.quota_percent", f"must be in (0, 100], got {point.quota_percent}"
        )
    check_non_negative(f"{f}.requests_per_s", point.requests_per_s)
    check_non_negative(f"{f}.p50_latency_ms", point.p50_latency_ms)
    check_non_negative(f"{f}.p99_latency_ms", point.p99_latency_ms)
    if point.p50_latency_ms > point.p99_latency_ms:
        raise InvalidArgument(f"{f}.p50_latency_ms", "must not exceed p99_latency_ms")


def _check_throughput_profile(p: ThroughputProfile) -> None:
    check_entries("profile.points", p.points)
    for i, point in enumerate(p.points):
        check_throughput_point(f"profile.points[{i}]", point)
    check_unique(
        "profile.points",
        ((pt.sm_percent, pt.quota_percent) for pt in p.points),
        "(sm_percent, quota_percent)",
    )


def _check_mig_profile(p: MigProfile) -> None:
    check_entries("profile.times", p.times)
    for i, t in enumerate(p.times):
        f = f"profile.times[{i}]"
        validate_mig_slices(f"{f}.slices", t.slices)
        check_positive(f"{f}.exec_time_s", t.exec_time_s)
    check_unique("profile.times", (t.slices for t in p.times), "slices")


def _check_job_profile(p: JobProfile) -> None:
    check_positive("profile.minibatch_time_s", p.minibatch_time_s)
    check_range("profile.peak_memory_bytes", p.peak_memory_bytes, 0, MAX_INT64)
    check_range("profile.gpu_utilization_percent", p.gpu_utilization_percent, 0, 100)
    check_non_negative("profile.solo_throughput", p.solo_throughput)
    if len(p.colocated) > MAX_ENTRIES:
        raise InvalidArgument("profile.colocated", f"has more than {MAX_ENTRIES} entries")
    for i, c in enumerate(p.colocated):
        check_key(f"profile.colocated[{i}].with_task_key", c.with_task_key)
        check_non_negative(f"profile.colocated[{i}].throughput", c.throughput)
    check_unique("profile.colocated", (c.with_task_key for c in p.colocated), "with_task_key")
    check_non_negative("profile.minibatch_cv", p.minibatch_cv)
    check_range("profile.low_memory_bytes", p.low_memory_bytes, 0, MAX_INT64)
    if len(p.low_memory_points_s) > MAX_ENTRIES:
        raise InvalidArgument("profile.low_memory_points_s", f"more than {MAX_ENTRIES} points")
    for i, point in enumerate(p.low_memory_points_s):
        check_non_negative(f"profile.low_memory_points_s[{i}]", point)


_CHECKS = {
    KernelProfile: _check_kernel_profile,
    ThroughputProfile: _check_throughput_profile,
    MigProfile: _check_mig_profile,
    JobProfile: _check_job_profile,
}


def validate_profile(profile: Profile) -> None:
    """Raise InvalidArgument naming the first offending field; return None if all is well."""
    check_key("profile.meta.key", profile.key)
    check_gpu_model("profile.meta.gpu_model", profile.gpu_model)
    _CHECKS[type(profile)](profile)  # type: ignore[operator]
