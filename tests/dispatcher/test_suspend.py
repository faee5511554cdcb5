"""Suspend and resume with the Python reference client (the C shim's side is
tests/shim/test_training.py): a suspended SHARE client gets no lease, however long it waits, and
its wait is not bounded by its own timeout; resumed, it asks again and is granted."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuloom.clients.shim import ShimClient
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import LiveDispatcher


async def test_a_suspended_client_gets_no_lease_until_resumed(live: LiveDispatcher) -> None:
    assignment = await live.reserve()
    request = dispatcher_pb2.SuspendClientRequest(assignment_id=assignment.assignment_id)
    suspended = await live.stub.SuspendClient(request)
    assert suspended.suspended and suspended.suspend_outcome == "not_running"

    def work() -> tuple[float, int, bool]:
        with ShimClient.connect(assignment.socket_path, assignment.assignment_token) as shim:
            assert shim.suspended()  # a process registering while suspended starts suspended
            started = time.monotonic()
            lease = shim.acquire(timeout_s=0.2)  # far shorter than the suspension
            return time.monotonic() - started, lease.until_ns, shim.suspended()

    job = asyncio.ensure_future(asyncio.to_thread(work))
    await asyncio.sleep(0.8)
    assert not job.done()
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    (client,) = status.clients
    assert client.connected and client.suspended
    assert client.state != dispatcher_pb2.LEASE_STATE_HOLDING
    resumed = await live.stub.ResumeClient(
        dispatcher_pb2.ResumeClientRequest(assignment_id=assignment.assignment_id)
    )
    assert not resumed.suspended
    waited, until_ns, still = await asyncio.wait_for(job, 10)
    assert waited >= 0.7 and until_ns > 0 and not still


@pytest.mark.parametrize("live", [{"policy": "exclusive"}], indirect=True)
async def test_a_waiting_client_that_is_suspended_leaves_the_queue(live: LiveDispatcher) -> None:
    """Suspended while it waits behind an exclusive holder: it is not granted when the holder
    lets go, and it is once resumed."""
    holder, waiter = [await live.reserve(request=50.0) for _ in range(2)]
    with ShimClient.connect(holder.socket_path, holder.assignment_token) as first:
        first.acquire()

        def wait_for_lease() -> float:
            with ShimClient.connect(waiter.socket_path, waiter.assignment_token) as shim:
                shim.acquire(timeout_s=5.0)
                return time.monotonic()  # when it was granted

        job = asyncio.ensure_future(asyncio.to_thread(wait_for_lease))
        await asyncio.sleep(0.2)
        await live.stub.SuspendClient(
            dispatcher_pb2.SuspendClientRequest(assignment_id=waiter.assignment_id)
        )
        first.release()
    await asyncio.sleep(0.5)
    assert not job.done()
    resumed_at = time.monotonic()
    await live.stub.ResumeClient(
        dispatcher_pb2.ResumeClientRequest(assignment_id=waiter.assignment_id)
    )
    # Granted only once resumed (a loaded machine may start the waiting thread late, so the
    # time it waited says less than when its grant came).
    assert await asyncio.wait_for(job, 10) >= resumed_at
