"""Compact JSON encoding of profiles for the cache (lists, not objects, to keep entries small)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from gpuloom.services.profile_store.domain import (
    ColocatedThroughput,
    Dim3,
    JobProfile,
    KernelProfile,
    KernelStats,
    MigProfile,
    MigTime,
    Profile,
    ProfileKind,
    ThroughputPoint,
    ThroughputProfile,
)

FORMAT = 1  # bump when the layout below changes; entries of another format are misses


def encode(profile: Profile) -> bytes:
    assert profile.updated_at is not None, "only stored profiles are cached"
    head = [FORMAT, profile.KIND.value, profile.key, profile.gpu_model, profile.version]
    head.append(profile.updated_at.isoformat())
    body: list[Any]
    match profile:
        case KernelProfile():
            body = [
                profile.measured_runs,
                [
                    [
                        k.kernel_id,
                        k.name,
                        k.grid.x,
                        k.grid.y,
                        k.grid.z,
                        k.block.x,
                        k.block.y,
                        k.block.z,
                        k.sample_count,
                        k.mean_duration_ns,
                        k.p50_duration_ns,
                        k.p95_duration_ns,
                        k.mean_gap_after_ns,
                    ]
                    for k in profile.kernels
                ],
            ]
        case ThroughputProfile():
            body = [
                [
                    [
                        p.sm_percent,
                        p.quota_percent,
                        p.requests_per_s,
                        p.p50_latency_ms,
                        p.p99_latency_ms,
                    ]
                    for p in profile.points
                ]
            ]
        case MigProfile():
            body = [[[t.slices, t.exec_time_s] for t in profile.times]]
        case JobProfile():
            body = [
                profile.minibatch_time_s,
                profile.peak_memory_bytes,
                profile.gpu_utilization_percent,
                profile.solo_throughput,
                [[c.with_task_key, c.throughput] for c in profile.colocated],
            ]
    return json.dumps([*head, *body], separators=(",", ":")).encode()


def decode(payload: bytes) -> Profile | None:
    """Decode a cache entry; None if it was written in another format (treat as a miss)."""
    fields = json.loads(payload)
    if fields[0] != FORMAT:
        return None
    _, kind, key, gpu_model, version, stamp, *body = fields
    common = {"key": key, "gpu_model": gpu_model, "version": version}
    common["updated_at"] = datetime.fromisoformat(stamp)
    match ProfileKind(kind):
        case ProfileKind.KERNEL:
            runs, kernels = body
            return KernelProfile(
                measured_runs=runs,
                kernels=tuple(
                    KernelStats(k[0], k[1], Dim3(k[2], k[3], k[4]), Dim3(k[5], k[6], k[7]), *k[8:])
                    for k in kernels
                ),
                **common,
            )
        case ProfileKind.THROUGHPUT:
            return ThroughputProfile(points=tuple(ThroughputPoint(*p) for p in body[0]), **common)
        case ProfileKind.MIG:
            return MigProfile(times=tuple(MigTime(*t) for t in body[0]), **common)
        case ProfileKind.JOB:
            minibatch, memory, utilization, solo, colocated = body
            return JobProfile(
                minibatch_time_s=minibatch,
                peak_memory_bytes=memory,
                gpu_utilization_percent=utilization,
                solo_throughput=solo,
                colocated=tuple(ColocatedThroughput(*c) for c in colocated),
                **common,
            )
