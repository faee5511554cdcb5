"""Malformed requests are answered INVALID_ARGUMENT naming the field before they reach the
database (PostgreSQL refuses NUL bytes in text: that used to surface as INTERNAL or UNAVAILABLE),
and change nothing."""

from __future__ import annotations

import grpc
import pytest

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import Live, mps_spec, register_all, submit

NUL_ID = "job-\x00-1"


async def _refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return raised.value


async def test_a_nul_in_job_id_is_invalid_argument_for_every_job_rpc(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("kept", 20, 20))
    calls = [
        placement.stub.GetJob(pb.GetJobRequest(job_id=NUL_ID)),
        placement.stub.CancelJob(pb.CancelJobRequest(job_id=NUL_ID)),
        placement.stub.ReportJobDone(pb.ReportJobDoneRequest(job_id=NUL_ID, succeeded=True)),
        placement.stub.CancelJob(pb.CancelJobRequest(job_id=job.job_id, reason="why\x00")),
    ]
    for call in calls:
        error = await _refused(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "NUL" in error.details()
    stream = placement.stub.WatchJob(pb.WatchJobRequest(job_id=NUL_ID))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stream.read()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("job_id:")
    # Nothing changed: the job is still assigned, and placement still answers.
    got = await placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert got.state == pb.JOB_STATE_ASSIGNED and got.revision == job.revision


async def test_a_nul_in_a_nested_field_of_a_submission_is_named(placement: Live) -> None:
    spec = mps_spec("ok")
    spec.command.extend(["python", "train\x00.py"])
    error = await _refused(
        placement.stub.SubmitJob(pb.SubmitJobRequest(request_id="r1", spec=spec))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("spec.command[1]:")
    listing = await placement.stub.ListJobs(pb.ListJobsRequest())
    assert not listing.jobs
