"""A job's share keeps one form from the client to the dispatcher's reservation: its defaults
are applied by share_of alone, and each message that carries it has one converter, so what the
CLI, a job file or the client library asks is what the dispatcher reserves."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.clients.placement import spec_from_document
from gpuloom.convert.placement import spec_from_pb, spec_to_pb
from gpuloom.convert.shares import reservation_share, reservation_share_fields
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import DEFAULT_PRIORITY, Share, TimeQuota, share_of
from gpuloom.policies.placement import (
    Allocation,
    Fleet,
    GpuState,
    JobRequest,
    Placement,
    get_policy,
)
from gpuloom.services.placement.decisions import ask_of
from gpuloom.services.placement.dispatchers import bind_request
from gpuloom.services.placement.domain import Binding, Job
from gpuloom.v1 import common_pb2, dispatcher_pb2, placement_pb2

GIB = 1 << 30


def test_what_is_left_unsaid_gets_the_defaults_in_one_place() -> None:
    assert share_of() == Share(100, TimeQuota(100.0, 100.0), 0, DEFAULT_PRIORITY)
    assert share_of(30, 40.0).quota == TimeQuota(40.0, 40.0)  # the limit is the request
    assert share_of(30, 40.0, 60.0, GIB, 0) == Share(30, TimeQuota(40.0, 60.0), GIB, 0)
    assert share_of().whole and not share_of(30, 40.0).whole


def test_a_limit_below_the_request_is_refused_naming_the_field() -> None:
    # Moved from the placement policy's JobRequest, which no longer carries the limit.
    with pytest.raises(InvalidArgument) as refused:
        share_of(10, 20.0, 10.0).partition.validate("spec.resources.mps")
    assert refused.value.field == "spec.resources.mps.quota.request_percent"


def test_a_submitted_spec_and_a_reserve_default_their_unset_fields_alike() -> None:
    unset = common_pb2.SpatioTemporalShare(
        sm_percent=30, quota=common_pb2.TimeQuota(request_percent=40)
    )
    submitted = placement_pb2.JobSpec(
        name="a",
        kind=placement_pb2.JOB_KIND_BATCH,
        resources=common_pb2.Resources(memory_bytes=GIB, mps=unset),
    )
    reserved = dispatcher_pb2.ReserveRequest(memory_cap_bytes=GIB, share=unset)
    expected = Share(30, TimeQuota(40.0, 40.0), GIB, DEFAULT_PRIORITY)
    assert spec_from_pb(submitted).share == expected
    assert reservation_share(reserved) == expected


def test_a_job_file_and_the_library_send_the_same_spec() -> None:
    document = {
        "name": "a",
        "kind": "batch",
        "resources": {"memory_gib": 1, "mps": {"sm_percent": 30, "quota_request_percent": 40}},
    }
    spec = JobSpec(name="a", kind=JobKind.BATCH, share=share_of(30, 40, memory_bytes=GIB), mps=True)
    assert spec_from_pb(spec_from_document(document, "a.yaml")) == spec
    assert spec_from_pb(spec_to_pb(spec)) == spec


def test_an_unknown_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as refused:
        spec_from_pb(placement_pb2.JobSpec(name="a", kind=99), "template")
    assert refused.value.field == "template.kind"


@given(
    st.integers(1, 100),
    st.floats(0.01, 100),
    st.floats(0.01, 100),
    st.integers(0, 1 << 40),
    st.integers(0, 9),
)
def test_the_share_placement_binds_is_the_share_the_dispatcher_reads(
    sm: int, a: float, b: float, memory: int, priority: int
) -> None:
    """Through placement's view of the job and the fleet's allocation, which hold the same
    `Share` (the fleet decides only a replica's memory), to the dispatcher's message."""
    asked = share_of(sm, min(a, b), max(a, b), memory, priority)
    spec = JobSpec(name="j", kind=JobKind.INFERENCE, share=asked, mps=True)
    job = Job("j-1", "r", spec_from_pb(spec_to_pb(spec)), JobState.BINDING, 0.0, 0.0)
    fleet = Fleet.from_allocations([GpuState("GPU-0", "n", "H100-80GB", 1 << 41)])
    assert isinstance(fleet.place(ask_of(job).request, get_policy("mra")), Placement)
    held = fleet.allocation("j-1")
    assert held is not None
    binding = Binding("GPU-0", "n", "h:1", (0, 0, 1, 1), held.share, "t" * 32)
    request = bind_request(job, binding)
    message = dispatcher_pb2.ReserveRequest(**reservation_share_fields(request.share))
    assert reservation_share(message) == Share(sm, asked.quota, memory, priority)


def test_a_replica_beside_its_model_binds_its_share_less_the_weights() -> None:
    spec = JobSpec(
        name="r",
        kind=JobKind.INFERENCE,
        share=share_of(10, 10.0, memory_bytes=8 * GIB, priority=2),
        mps=True,
        shared_model="bert",
    )
    job = Job("j-1", "r", spec, JobState.BINDING, 0.0, 0.0)
    fleet = Fleet.from_allocations([GpuState("GPU-0", "n", "H100-80GB", 80 * GIB)])
    fleet.set_models("GPU-0", [("bert", 3 * GIB)])
    assert isinstance(fleet.place(ask_of(job).request, get_policy("mra")), Placement)
    held = fleet.allocation("j-1")
    assert held is not None and held.share == replace(spec.share, memory_bytes=5 * GIB)


@pytest.mark.parametrize("record", [JobRequest, Allocation, Binding])
def test_placement_holds_the_share_itself_not_copies_of_its_fields(record: type) -> None:
    """docs/architecture.md's walks count none of these as a shape of its own."""
    names = {f.name: f.type for f in fields(record)}
    assert names.get("share") == "Share"
    copies = {"sm_percent", "quota_request_percent", "quota_percent", "memory_bytes", "priority"}
    assert not copies & names.keys() and "memory_cap_bytes" not in names
