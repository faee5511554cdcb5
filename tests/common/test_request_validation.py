"""The first check of every request: text fields with NUL bytes are named, wherever they sit in
the message (the interceptor itself is tested against live services in
tests/placement/test_bad_input.py and tests/test_bad_bytes.py)."""

from __future__ import annotations

import pytest

from gpuloom.domain.errors import InvalidArgument
from gpuloom.services.common.validation import check_text_fields
from gpuloom.v1 import dispatcher_pb2, placement_pb2


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (placement_pb2.GetJobRequest(job_id="j\x00"), "job_id"),
        (
            placement_pb2.SubmitJobRequest(spec=placement_pb2.JobSpec(name="n\x00ame")),
            "spec.name",
        ),
        (
            placement_pb2.SubmitJobRequest(
                spec=placement_pb2.JobSpec(command=["python", "x\x00.py"])
            ),
            "spec.command[1]",
        ),
        (
            dispatcher_pb2.MigRunInput(
                batch=dispatcher_pb2.RunMigBatchRequest(
                    tasks=[
                        dispatcher_pb2.MigTaskSpec(name="ok"),
                        dispatcher_pb2.MigTaskSpec(name="n\x00"),
                    ]
                )
            ),
            "batch.tasks[1].name",
        ),
        (
            placement_pb2.Job(assignment=placement_pb2.JobAssignment(environment={"A": "\x00"})),
            "assignment.environment['A']",
        ),
        (
            placement_pb2.Job(assignment=placement_pb2.JobAssignment(environment={"\x00": "v"})),
            "assignment.environment['\\x00']",
        ),
    ],
)
def test_a_nul_byte_is_named_by_its_field_path(message: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_text_fields(message)  # type: ignore[arg-type]
    assert raised.value.field == field
    assert "NUL" in raised.value.message


def test_unicode_without_nul_passes() -> None:
    spec = placement_pb2.JobSpec(name="名前 ✓ \U0001f600", command=["é", ""])
    check_text_fields(placement_pb2.SubmitJobRequest(spec=spec))
