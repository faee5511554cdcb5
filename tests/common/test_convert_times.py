"""Instants on the wire: a Timestamp (RFC 3339 in the JSON mapping) for unix seconds, unset for
0 ("never"), unchanged through a float and back."""

from __future__ import annotations

from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.convert.placement import job_from_pb, job_to_pb
from gpuloom.convert.times import timestamp, unix_s
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
