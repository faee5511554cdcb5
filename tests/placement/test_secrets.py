"""Assignment tokens go to the job's submitter only: SubmitJob's answer and GetJob by the job's
id carry them, listings, watches and logs never do; the client library reads them by GetJob."""

from __future__ import annotations

import asyncio

import structlog
import structlog.testing

from gpuloom.clients.placement import PlacementClient
from gpuloom.domain.placement import ASSIGNMENT_TOKEN_VARIABLE, JobState
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import Live, mps_spec, register_all, submit


async def test_only_the_submitters_answers_carry_the_token(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    with structlog.testing.capture_logs() as logged:
        job = await submit(placement.stub, mps_spec("secret", 30, 30))
        assert job.state == pb.JOB_STATE_ASSIGNED
        token = job.assignment.environment[ASSIGNMENT_TOKEN_VARIABLE]
        got = await placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
        await placement.stub.CancelJob(pb.CancelJobRequest(job_id=job.job_id, reason="done"))
    assert got.assignment.environment[ASSIGNMENT_TOKEN_VARIABLE] == token
    # Neither placement nor the dispatcher logged it while binding, answering or releasing.
    assert logged and token not in repr(logged)

    job = await submit(placement.stub, mps_spec("listed", 30, 30))
    token = job.assignment.environment[ASSIGNMENT_TOKEN_VARIABLE]
    listing = await placement.stub.ListJobs(pb.ListJobsRequest())
    (listed,) = [j for j in listing.jobs if j.job_id == job.job_id]
    assert listed.assignment.environment["GPULOOM_ASSIGNMENT_ID"] == job.job_id
    assert ASSIGNMENT_TOKEN_VARIABLE not in listed.assignment.environment
    assert token not in str(listing)

    stream = placement.stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id))
    watched = await stream.read()
    stream.cancel()
    assert watched.state == pb.JOB_STATE_ASSIGNED
    assert ASSIGNMENT_TOKEN_VARIABLE not in watched.assignment.environment


async def test_a_job_assigned_after_waiting_reaches_its_submitter_with_its_token(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    blockers = [
        await submit(placement.stub, mps_spec(f"b{i}", 100, 100, memory_gib=60)) for i in range(4)
    ]
    with PlacementClient(f"127.0.0.1:{placement.app.port}") as client:
        waiting = await asyncio.to_thread(client.submit, mps_spec("late", 10, 10, memory_gib=30))
        assert waiting.state is JobState.PENDING
        wait = asyncio.create_task(asyncio.to_thread(client.wait_assigned, waiting.job_id, 10.0))
        await asyncio.sleep(0.2)
        await placement.stub.CancelJob(pb.CancelJobRequest(job_id=blockers[0].job_id))
        assigned = await wait
    assert assigned.state is JobState.ASSIGNED and assigned.assignment is not None
    assert len(assigned.assignment.environment[ASSIGNMENT_TOKEN_VARIABLE]) >= 32
