"""Conversion between gpuloom.v1 protobuf messages and the domain's profile types: the profile
store serves them, the profiler and placement write and read them, the client library returns
them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import UTC
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from gpuloom.convert.json_mapping import message_json
from gpuloom.domain import profiles as d
from gpuloom.domain.errors import InvalidArgument
from gpuloom.v1 import common_pb2 as common
from gpuloom.v1 import profile_store_pb2 as pb

KIND_TO_PB = {
    d.ProfileKind.KERNEL: pb.PROFILE_KIND_KERNEL,
    d.ProfileKind.THROUGHPUT: pb.PROFILE_KIND_THROUGHPUT,
    d.ProfileKind.MIG: pb.PROFILE_KIND_MIG,
    d.ProfileKind.JOB: pb.PROFILE_KIND_JOB,
}
KIND_FROM_PB = {v: k for k, v in KIND_TO_PB.items()}
BOUND_TO_PB = {
    d.KernelBound.UNKNOWN: pb.KERNEL_BOUND_UNKNOWN,
    d.KernelBound.COMPUTE: pb.KERNEL_BOUND_COMPUTE,
    d.KernelBound.MEMORY: pb.KERNEL_BOUND_MEMORY,
}
BOUND_FROM_PB = {v: k for k, v in BOUND_TO_PB.items()}


def kind_from_pb(
    value: int, field: str, *, allow_unspecified: bool = False
) -> d.ProfileKind | None:
    if value == pb.PROFILE_KIND_UNSPECIFIED and allow_unspecified:
        return None
    if value not in KIND_FROM_PB:
        known = ", ".join(pb.ProfileKind.Name(v) for v in KIND_FROM_PB)
        raise InvalidArgument(
            field, f"unknown or unspecified profile kind {value}; use one of {known}"
        )
    return KIND_FROM_PB[value]


def bound_from_pb(value: int, field: str) -> d.KernelBound:
    # Proto3 enums are open: a newer writer's value arrives as a bare number.
    if value not in BOUND_FROM_PB:
        known = ", ".join(pb.KernelBound.Name(v) for v in BOUND_FROM_PB)
        raise InvalidArgument(field, f"unknown kernel bound class {value}; use one of {known}")
    return BOUND_FROM_PB[value]


def _dim3(msg: common.Dim3) -> d.Dim3:
    return d.Dim3(msg.x, msg.y, msg.z)


def _meta(profile: d.Profile) -> pb.ProfileMeta:
    meta = pb.ProfileMeta(
        kind=KIND_TO_PB[profile.KIND],
        key=profile.key,
        gpu_model=profile.gpu_model,
        version=profile.version,
    )
    if profile.updated_at is not None:
        meta.updated_at.FromDatetime(profile.updated_at)
    return meta


def _check_meta_kind(meta: pb.ProfileMeta, expected: d.ProfileKind) -> None:
    # The kind follows from the RPC; a meta that names another kind is a client bug worth flagging.
    if meta.kind not in (pb.PROFILE_KIND_UNSPECIFIED, KIND_TO_PB[expected]):
        raise InvalidArgument(
            "profile.meta.kind", f"must be {pb.ProfileKind.Name(KIND_TO_PB[expected])} or unset"
        )


def kernel_profile_from_pb(msg: pb.KernelProfile) -> d.KernelProfile:
    _check_meta_kind(msg.meta, d.ProfileKind.KERNEL)
    return d.KernelProfile(
        key=msg.meta.key,
        gpu_model=msg.meta.gpu_model,
        measured_runs=msg.measured_runs,
        kernels=tuple(
            d.KernelStats(
                kernel_id=k.kernel_id,
                name=k.name,
                grid=_dim3(k.grid),
                block=_dim3(k.block),
                sample_count=k.sample_count,
                mean_duration_ns=k.mean_duration_ns,
                p50_duration_ns=k.p50_duration_ns,
                p95_duration_ns=k.p95_duration_ns,
                mean_gap_after_ns=k.mean_gap_after_ns,
                sm_usage=k.sm_usage,
                bound=bound_from_pb(k.bound, f"profile.kernels[{i}].bound"),
            )
            for i, k in enumerate(msg.kernels)
        ),
        gap_predictor=_gap_predictor_from_pb(msg.gap_predictor)
        if msg.HasField("gap_predictor")
        else None,
    )


def _gap_predictor_from_pb(msg: pb.GapPredictorModel) -> d.GapPredictorModel:
    return d.GapPredictorModel(
        kind=msg.kind,
        mae_ns=msg.mae_ns,
        candidates_mae_ns=dict(msg.candidates_mae_ns),
        model_json=msg.model_json,
    )


def kernel_profile_to_pb(p: d.KernelProfile) -> pb.KernelProfile:
    message = pb.KernelProfile(
        meta=_meta(p),
        measured_runs=p.measured_runs,
        kernels=[
            pb.KernelStats(
                kernel_id=k.kernel_id,
                name=k.name,
                grid=common.Dim3(x=k.grid.x, y=k.grid.y, z=k.grid.z),
                block=common.Dim3(x=k.block.x, y=k.block.y, z=k.block.z),
                sample_count=k.sample_count,
                mean_duration_ns=k.mean_duration_ns,
                p50_duration_ns=k.p50_duration_ns,
                p95_duration_ns=k.p95_duration_ns,
                mean_gap_after_ns=k.mean_gap_after_ns,
                sm_usage=k.sm_usage,
                bound=BOUND_TO_PB[k.bound],
            )
            for k in p.kernels
        ],
    )
    if p.gap_predictor is not None:
        g = p.gap_predictor
        message.gap_predictor.kind = g.kind
        message.gap_predictor.mae_ns = g.mae_ns
        message.gap_predictor.candidates_mae_ns.update(g.candidates_mae_ns)
        message.gap_predictor.model_json = g.model_json
    return message


def throughput_profile_from_pb(msg: pb.ThroughputProfile) -> d.ThroughputProfile:
    _check_meta_kind(msg.meta, d.ProfileKind.THROUGHPUT)
    return d.ThroughputProfile(
        key=msg.meta.key,
        gpu_model=msg.meta.gpu_model,
        points=tuple(
            d.ThroughputPoint(
                p.sm_percent, p.quota_percent, p.requests_per_s, p.p50_latency_ms, p.p99_latency_ms
            )
            for p in msg.points
        ),
    )


def throughput_profile_to_pb(p: d.ThroughputProfile) -> pb.ThroughputProfile:
    return pb.ThroughputProfile(
        meta=_meta(p),
        points=[
            pb.ThroughputPoint(
                sm_percent=pt.sm_percent,
                quota_percent=pt.quota_percent,
                requests_per_s=pt.requests_per_s,
                p50_latency_ms=pt.p50_latency_ms,
                p99_latency_ms=pt.p99_latency_ms,
            )
            for pt in p.points
        ],
    )


def mig_profile_from_pb(msg: pb.MigProfileRecord) -> d.MigProfile:
    _check_meta_kind(msg.meta, d.ProfileKind.MIG)
    return d.MigProfile(
        key=msg.meta.key,
        gpu_model=msg.meta.gpu_model,
        times=tuple(d.MigTime(t.slices, t.exec_time_s) for t in msg.times),
    )


def mig_profile_to_pb(p: d.MigProfile) -> pb.MigProfileRecord:
    return pb.MigProfileRecord(
        meta=_meta(p),
        times=[pb.MigTime(slices=t.slices, exec_time_s=t.exec_time_s) for t in p.times],
    )


def job_profile_from_pb(msg: pb.JobProfile) -> d.JobProfile:
    _check_meta_kind(msg.meta, d.ProfileKind.JOB)
    return d.JobProfile(
        key=msg.meta.key,
        gpu_model=msg.meta.gpu_model,
        minibatch_time_s=msg.minibatch_time_s,
        peak_memory_bytes=msg.peak_memory_bytes,
        gpu_utilization_percent=msg.gpu_utilization_percent,
        solo_throughput=msg.solo_throughput,
        colocated=tuple(
            d.ColocatedThroughput(c.with_task_key, c.throughput) for c in msg.colocated
        ),
        minibatch_cv=msg.minibatch_cv,
        low_memory_points_s=tuple(msg.low_memory_points_s),
        low_memory_bytes=msg.low_memory_bytes,
    )


def job_profile_to_pb(p: d.JobProfile) -> pb.JobProfile:
    return pb.JobProfile(
        meta=_meta(p),
        minibatch_time_s=p.minibatch_time_s,
        peak_memory_bytes=p.peak_memory_bytes,
        gpu_utilization_percent=p.gpu_utilization_percent,
        solo_throughput=p.solo_throughput,
        colocated=[
            pb.ColocatedThroughput(with_task_key=c.with_task_key, throughput=c.throughput)
            for c in p.colocated
        ],
        minibatch_cv=p.minibatch_cv,
        low_memory_points_s=p.low_memory_points_s,
        low_memory_bytes=p.low_memory_bytes,
    )


def summary_to_pb(s: d.ProfileSummary) -> pb.ProfileSummary:
    meta = pb.ProfileMeta(
        kind=KIND_TO_PB[s.id.kind], key=s.id.key, gpu_model=s.id.gpu_model, version=s.version
    )
    meta.updated_at.FromDatetime(s.updated_at)
    return pb.ProfileSummary(meta=meta, entries=s.entries)


TO_PB: dict[type, Callable[[Any], Message]] = {
    d.KernelProfile: kernel_profile_to_pb,
    d.ThroughputProfile: throughput_profile_to_pb,
    d.MigProfile: mig_profile_to_pb,
    d.JobProfile: job_profile_to_pb,
}
FROM_PB: dict[d.ProfileKind, tuple[type[Message], Callable[[Any], d.Profile]]] = {
    d.ProfileKind.KERNEL: (pb.KernelProfile, kernel_profile_from_pb),
    d.ProfileKind.THROUGHPUT: (pb.ThroughputProfile, throughput_profile_from_pb),
    d.ProfileKind.MIG: (pb.MigProfileRecord, mig_profile_from_pb),
    d.ProfileKind.JOB: (pb.JobProfile, job_profile_from_pb),
}


def stamped_from_pb(kind: d.ProfileKind, message: Any) -> d.Profile:
    """A domain profile with the store-assigned version and timestamp kept (from_pb drops them)."""
    meta = message.meta
    return replace(
        FROM_PB[kind][1](message),
        version=meta.version,
        updated_at=meta.updated_at.ToDatetime(tzinfo=UTC),
    )


# ---- JSON: the protos' JSON mapping (`gpuloom profile ... --json` prints it, `put` reads it) ----


def profile_json(profile: d.Profile) -> dict[str, Any]:
    return _json(TO_PB[type(profile)](profile))


def summary_json(summary: d.ProfileSummary) -> dict[str, Any]:
    return _json(summary_to_pb(summary))


def profile_from_json(kind: d.ProfileKind, text: str) -> d.Profile:
    """A profile of `kind` from its message in JSON (version and time, if any, are left out:
    the store sets them). Raises ValueError naming what does not parse."""
    message_type, from_pb = FROM_PB[kind]
    message = message_type()
    try:
        json_format.Parse(text, message)
    except json_format.ParseError as error:
        raise ValueError(str(error)) from None
    meta = message.meta  # type: ignore[attr-defined]
    if meta.kind not in (pb.PROFILE_KIND_UNSPECIFIED, KIND_TO_PB[kind]):
        raise ValueError(
            f"meta.kind is {pb.ProfileKind.Name(meta.kind)}, not a {kind.value} profile"
        )
    try:
        return from_pb(message)
    except InvalidArgument as error:  # a value the JSON mapping accepts but the domain has not
        raise ValueError(error.message) from None


def _json(message: Message) -> dict[str, Any]:
    return message_json(message)


class ProtobufCodec:
    """Profiles as the serialized gpuloom.v1 message the Get RPC of their kind returns."""

    def encode(self, profile: d.Profile) -> bytes:
        return TO_PB[type(profile)](profile).SerializeToString()

    def decode(self, kind: d.ProfileKind, data: bytes) -> d.Profile:
        return stamped_from_pb(kind, FROM_PB[kind][0].FromString(data))
