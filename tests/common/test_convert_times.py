"""Instants on the wire: a Timestamp (RFC 3339 in the JSON mapping) for unix seconds, unset for
0 ("never"), unchanged through a float and back."""

from __future__ import annotations

from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.convert.placement import job_from_pb, job_to_pb
from gpuloom.convert.times import timestamp, unix_s
from gpuloom.convert.training import cycle_from_pb, cycle_to_pb, training_from_pb, training_to_pb
from gpuloom.domain.training import MigrationRequest, PackingTrial, TrainingCycle, TrainingState
from gpuloom.v1 import common_pb2, dispatcher_pb2, profile_store_pb2, profiler_pb2, shim_pb2
from gpuloom.v1 import placement_pb2 as pb

# From 1970 to about 2100, in microseconds.
MICROS = st.integers(min_value=1, max_value=4_102_444_800 * 1_000_000)


@given(MICROS)
def test_a_message_time_goes_through_a_float_and_back_unchanged(micros: int) -> None:
    message = pb.MigSlot(planned_start=timestamp(micros / 1e6))
    again = pb.MigSlot(planned_start=timestamp(unix_s(message, "planned_start")))
    assert again == message
    assert message.planned_start.ToMicroseconds() == micros


def test_never_is_unset_and_left_out_of_the_json() -> None:
    assert timestamp(0.0) is None
    slot = pb.MigSlot(size=3, planned_start=timestamp(0.0))
    assert not slot.HasField("planned_start") and unix_s(slot, "planned_start") == 0.0
    assert "planned_start" not in json_format.MessageToDict(slot)


def test_a_job_in_json_has_rfc3339_times() -> None:
    message = pb.Job(
        job_id="j-1",
        state=pb.JOB_STATE_PENDING,
        submitted_at=timestamp(1_764_104_575.25),
        updated_at=timestamp(1_764_104_576.5),
    )
    document = json_format.MessageToDict(job_to_pb(job_from_pb(message)))
    assert document["submittedAt"] == "2025-11-25T21:02:55.250Z"
    assert document["updatedAt"] == "2025-11-25T21:02:56.500Z"
    assert "startedAt" not in document  # never started


def _fields(descriptor):  # type: ignore[no-untyped-def]
    for field in descriptor.fields:
        yield descriptor.full_name, field
    for nested in descriptor.nested_types:
        yield from _fields(nested)


def test_no_message_carries_an_instant_as_a_double_of_unix_seconds() -> None:
    """The rule (protos/README.md): instants are Timestamps; nothing is left as `*_unix_s`."""

    doubles = [
        f"{message}.{field.name}"
        for module in (common_pb2, dispatcher_pb2, pb, profile_store_pb2, profiler_pb2, shim_pb2)
        for descriptor in module.DESCRIPTOR.message_types_by_name.values()
        for message, field in _fields(descriptor)
        if field.name.endswith("unix_s")
    ]
    assert doubles == []


@given(MICROS, MICROS, MICROS, MICROS, MICROS)
def test_a_training_state_and_cycle_keep_their_instants_to_the_microsecond(
    started: int, error: int, requested: int, deadline: int, low_point: int
) -> None:
    state = TrainingState(
        packings=(PackingTrial("j-2", started / 1e6, 0.5, 0.6, 1.4),),
        last_hook_error="exit 3",
        last_hook_error_at=error / 1e6,
        migration=MigrationRequest("m-1", "GPU-1", "n1", "spread", requested / 1e6, deadline / 1e6),
    )
    message = training_to_pb(state)
    assert training_from_pb(message) == state
    assert message.packings[0].started_at.ToMicroseconds() == started
    assert message.last_hook_error_at.ToMicroseconds() == error
    assert message.migration.deadline.ToMicroseconds() == deadline
    document = json_format.MessageToDict(message)
    assert document["migration"]["requestedAt"].endswith("Z")
    cycle = TrainingCycle(0.1, True, 1, 2, low_point / 1e6, 40, 9)
    assert cycle_from_pb(cycle_to_pb(cycle)) == cycle
    assert not cycle_to_pb(TrainingCycle()).HasField("next_low_point")  # unknown: unset
