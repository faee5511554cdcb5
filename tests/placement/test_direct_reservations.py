"""Shares reserved on a dispatcher directly, as its registration and heartbeats report them:
placement counts them as taken space, frees it when they go, and never asks to release them."""

from __future__ import annotations

import asyncio

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import common_pb2
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import GIB, Live, gpu_info, mps_spec, submit


def reservation(
    assignment_id: str, sm: int, quota: float, memory_gib: int
) -> pb.DispatcherReservation:
    return pb.DispatcherReservation(
        assignment_id=assignment_id,
        priority=common_pb2.Priority(level=3),
        memory_cap_bytes=memory_gib * GIB,
        share=common_pb2.SpatioTemporalShare(
            sm_percent=sm, quota=common_pb2.TimeQuota(request_percent=quota, limit_percent=quota)
        ),
    )


async def entry(live: Live, gpu_uuid: str) -> pb.GpuEntry:
    gpus = (await live.stub.ListGpus(pb.ListGpusRequest())).gpus
    return next(g for g in gpus if g.gpu.ref.gpu_uuid == gpu_uuid)


async def test_direct_reservations_take_space_until_the_dispatcher_drops_them(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    info = gpu_info(dispatchers, 0)
    uuid = info.ref.gpu_uuid
    address = f"127.0.0.1:{dispatchers.dispatchers[0].port}"
    held = [reservation("notebook", 100, 60, 70), reservation("j-not-ours-to-count", 10, 10, 1)]
    await placement.stub.RegisterGpu(
        pb.RegisterGpuRequest(gpu=info, dispatcher_address=address, reservations=held)
    )
    seen = await entry(placement, uuid)
    # "j-..." ids are placement's own jobs' (this one unknown): not counted as direct.
    assert (seen.direct_reservations, seen.jobs) == (1, 0)
    assert seen.area_reserved_percent == 60 and seen.memory_reserved_bytes == 70 * GIB

    # No room for a 50% quota share or 20 GiB beside it on the only GPU: the job waits.
    job = await submit(placement.stub, mps_spec("share", 50, 50, memory_gib=20))
    assert job.state == pb.JOB_STATE_PENDING

    answer = await placement.stub.Heartbeat(
        pb.HeartbeatRequest(
            gpu_uuid=uuid,
            assignment_ids=[r.assignment_id for r in held],
            reservations=held,
        )
    )
    assert list(answer.release_assignment_ids) == ["j-not-ours-to-count"]  # never "notebook"

    # The dispatcher released it: the space is free again and the waiting job gets it.
    await placement.stub.Heartbeat(pb.HeartbeatRequest(gpu_uuid=uuid))
    assert (await entry(placement, uuid)).direct_reservations == 0
    got = await placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    for _ in range(200):
        if got.state == pb.JOB_STATE_ASSIGNED:
            break
        await asyncio.sleep(0.05)
        got = await placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert got.state == pb.JOB_STATE_ASSIGNED and got.assignment.gpu.gpu_uuid == uuid
