"""The placement service end to end: real gRPC, a real database, real dispatchers on
simulated GPUs."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import placement_pb2
from tests.placement.conftest import GIB, Live, eventually, mps_spec, register_all, submit
from tests.rpc import refusal

# FaST-GShare's experiment (section 5.4): 8 pods, (SM %, quota %), the largest arriving first
# (MRA is a greedy online packer: see tests/policies/placement/test_placement_fast_experiment).
FAST_GSHARE_PODS = [("bert", 50, 60)] * 2 + [("rnnt", 24, 40)] * 2 + [("resnet", 12, 40)] * 4


async def _gpus_used(live: Live) -> set[str]:
    listing = await live.stub.ListJobs(placement_pb2.ListJobsRequest())
    return {j.assignment.gpu.gpu_uuid for j in listing.jobs if j.assignment.gpu.gpu_uuid}


@pytest.mark.parametrize(("policy", "gpus"), [("mra", 1), ("time-share", 4)])
async def test_fast_gshare_pods_fit_one_gpu_with_mra_and_need_four_time_shared(
    placement: Live, dispatchers: DispatcherApp, policy: str, gpus: int
) -> None:
    await register_all(placement.stub, dispatchers)
    for name, sm, quota in FAST_GSHARE_PODS:
        job = await submit(placement.stub, mps_spec(name, sm, quota, memory_gib=8, policy=policy))
        assert job.state == placement_pb2.JOB_STATE_ASSIGNED, job.pending_reason
        assert job.policy == policy
        env = job.assignment.environment
        assert env["GPULOOM_ASSIGNMENT_ID"] == job.job_id and env["GPULOOM_ASSIGNMENT_TOKEN"]
    assert len(await _gpus_used(placement)) == gpus
    # Every dispatcher holds exactly the jobs placement bound on it.
    held = 0
    for dispatcher in dispatchers.dispatchers:
        held += len(dispatcher.core.book.all())
    assert held == len(FAST_GSHARE_PODS)


async def test_a_job_that_does_not_fit_waits_with_its_reason_and_runs_when_room_frees(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    big = [
        await submit(placement.stub, mps_spec(f"big{i}", 100, 100, memory_gib=60)) for i in range(4)
    ]
    assert all(j.state == placement_pb2.JOB_STATE_ASSIGNED for j in big)
    waiting = await submit(placement.stub, mps_spec("late", 10, 10, memory_gib=30))
    assert waiting.state == placement_pb2.JOB_STATE_PENDING
    got = await placement.stub.GetJob(placement_pb2.GetJobRequest(job_id=waiting.job_id))
    assert got.pending_reason and "GPU" in got.pending_reason
    stream = placement.stub.WatchJob(placement_pb2.WatchJobRequest(job_id=waiting.job_id))
    first = await stream.read()
    assert first.state == placement_pb2.JOB_STATE_PENDING
    await placement.stub.CancelJob(placement_pb2.CancelJobRequest(job_id=big[0].job_id))
    states = []
    async with asyncio.timeout(10):
        while True:
            update = await stream.read()
            states.append(update.state)
            if update.state == placement_pb2.JOB_STATE_ASSIGNED:
                break
    assert states[-2:] == [placement_pb2.JOB_STATE_BINDING, placement_pb2.JOB_STATE_ASSIGNED]
    assert update.assignment.gpu.gpu_uuid == big[0].assignment.gpu.gpu_uuid
    stream.cancel()

    # The cancelled job's reservation is gone from its dispatcher, the new one is there.
    def held() -> set[str]:
        return {r.assignment_id for d in dispatchers.dispatchers for r in d.core.book.all()}

    await eventually(lambda: big[0].job_id not in held())
    assert update.job_id in held()


@pytest.mark.parametrize(
    ("spec_args", "code", "field"),
    [
        ({"memory_gib": 100}, grpc.StatusCode.INVALID_ARGUMENT, "spec.resources.memory_bytes"),
        ({"sm": 0}, grpc.StatusCode.INVALID_ARGUMENT, "spec.resources.mps.sm_percent"),
        ({"sm": 101}, grpc.StatusCode.INVALID_ARGUMENT, "spec.resources.mps.sm_percent"),
        (
            {"quota": 60, "limit": 40},
            grpc.StatusCode.INVALID_ARGUMENT,
            "spec.resources.mps.quota.request_percent",
        ),
        ({"policy": "best-guess"}, grpc.StatusCode.INVALID_ARGUMENT, "spec.policy"),
        ({"priority": 10}, grpc.StatusCode.INVALID_ARGUMENT, "spec.priority.level"),
        (
            {"kind": placement_pb2.JOB_KIND_UNSPECIFIED},
            grpc.StatusCode.INVALID_ARGUMENT,
            "spec.kind",
        ),
        ({"name": ""}, grpc.StatusCode.INVALID_ARGUMENT, "spec.name"),
    ],
)
async def test_bad_specs_are_refused_naming_the_field_and_change_nothing(
    placement: Live, dispatchers: DispatcherApp, spec_args: dict, code: grpc.StatusCode, field: str
) -> None:
    await register_all(placement.stub, dispatchers)
    got, details = await refusal(submit(placement.stub, mps_spec(**spec_args)))
    assert got == code and details.startswith(field), details
    listing = await placement.stub.ListJobs(placement_pb2.ListJobsRequest())
    assert len(listing.jobs) == 0


async def test_request_ids_make_submissions_idempotent(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    first = await submit(placement.stub, mps_spec("a"), request_id="req-1")
    again = await submit(placement.stub, mps_spec("a"), request_id="req-1")
    assert again.job_id == first.job_id and again.revision == first.revision
    got, details = await refusal(submit(placement.stub, mps_spec("a", sm=20), request_id="req-1"))
    assert got == grpc.StatusCode.ALREADY_EXISTS and "req-1" in details
    got, details = await refusal(submit(placement.stub, mps_spec("a"), request_id="bad id!"))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id")
    listing = await placement.stub.ListJobs(placement_pb2.ListJobsRequest())
    assert [j.job_id for j in listing.jobs] == [first.job_id]


async def test_finished_jobs_cannot_be_cancelled_or_finished_again(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("done"))
    done = await placement.stub.ReportJobDone(
        placement_pb2.ReportJobDoneRequest(job_id=job.job_id, succeeded=True, exit_code=0)
    )
    assert done.state == placement_pb2.JOB_STATE_SUCCEEDED
    # It still says where it ran, without the environment (its token is spent).
    assert done.assignment.gpu.gpu_uuid == job.assignment.gpu.gpu_uuid
    assert job.assignment.environment and not done.assignment.environment
    got, details = await refusal(
        placement.stub.CancelJob(placement_pb2.CancelJobRequest(job_id=job.job_id))
    )
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "succeeded" in details
    got, _ = await refusal(
        placement.stub.ReportJobDone(placement_pb2.ReportJobDoneRequest(job_id=job.job_id))
    )
    assert got == grpc.StatusCode.FAILED_PRECONDITION
    got, _ = await refusal(placement.stub.GetJob(placement_pb2.GetJobRequest(job_id="j-nope")))
    assert got == grpc.StatusCode.NOT_FOUND
    # Its capacity went back to the dispatcher.
    await eventually(lambda: not any(d.core.book.all() for d in dispatchers.dispatchers))


async def test_a_dispatcher_that_cannot_bind_leaves_the_job_pending_and_others_take_it(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    # A GPU whose dispatcher is gone, registered first so that it is tried first.
    dead = placement_pb2.GpuInfo(model="A100-80GB", memory_bytes=80 * GIB, mps_enabled=True)
    dead.ref.node, dead.ref.gpu_uuid = "n0", "GPU-0-dead"
    await placement.stub.RegisterGpu(
        placement_pb2.RegisterGpuRequest(gpu=dead, dispatcher_address="127.0.0.1:1")
    )
    job = await submit(placement.stub, mps_spec("first", policy="spread"))
    assert job.state == placement_pb2.JOB_STATE_PENDING
    assert "binding on GPU GPU-0-dead failed" in job.pending_reason
    await register_all(placement.stub, dispatchers)
    async with asyncio.timeout(10):
        while job.state != placement_pb2.JOB_STATE_ASSIGNED:
            await asyncio.sleep(0.02)
            job = await placement.stub.GetJob(placement_pb2.GetJobRequest(job_id=job.job_id))
    assert job.assignment.gpu.gpu_uuid != "GPU-0-dead"
    gpus = await placement.stub.ListGpus(placement_pb2.ListGpusRequest())
    by_id = {g.gpu.ref.gpu_uuid: g for g in gpus.gpus}
    assert not by_id["GPU-0-dead"].schedulable and by_id["GPU-0-dead"].jobs == 0


async def test_heartbeats_report_reservations_placement_no_longer_owns(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("kept"))
    gpu = job.assignment.gpu.gpu_uuid
    reply = await placement.stub.Heartbeat(
        placement_pb2.HeartbeatRequest(
            gpu_uuid=gpu, assignment_ids=[job.job_id, "j-forgotten", "manual-reservation"]
        )
    )
    assert list(reply.release_assignment_ids) == ["j-forgotten"]
    got, details = await refusal(
        placement.stub.Heartbeat(placement_pb2.HeartbeatRequest(gpu_uuid="GPU-unknown"))
    )
    assert got == grpc.StatusCode.NOT_FOUND and "register" in details


async def test_list_jobs_filters_and_pages(placement: Live, dispatchers: DispatcherApp) -> None:
    await register_all(placement.stub, dispatchers)
    ids = [
        (await submit(placement.stub, mps_spec(f"j{i}", 10, 10, task_key=f"t{i % 2}"))).job_id
        for i in range(7)
    ]
    seen, token = [], ""
    while True:
        page = await placement.stub.ListJobs(
            placement_pb2.ListJobsRequest(page_size=3, page_token=token, task_key="t0")
        )
        seen += [j.job_id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids[0::2]
    pending = await placement.stub.ListJobs(
        placement_pb2.ListJobsRequest(states=[placement_pb2.JOB_STATE_PENDING])
    )
    assert len(pending.jobs) == 0
    got, details = await refusal(
        placement.stub.ListJobs(placement_pb2.ListJobsRequest(page_token="%%%"))
    )
    assert got == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("page_token")
