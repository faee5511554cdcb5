"""gpuloom.v1.Dispatcher over real gRPC: what good and bad requests get, status and events."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest

from gpuloom.clients.shim import ShimClient
from gpuloom.services.dispatcher.convert import reserve_spec_from_pb
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import GIB, LiveDispatcher, reserve_request
from tests.profile_store.test_grpcurl import grpcurl_binary
from tests.rpc import refusal


@pytest.mark.parametrize(
    ("request_args", "code", "field"),
    [
        ({"request": 60, "limit": 40}, grpc.StatusCode.INVALID_ARGUMENT, "share.quota.request"),
        ({"sm": 101}, grpc.StatusCode.INVALID_ARGUMENT, "share.sm_percent"),
        ({"sm": 0}, grpc.StatusCode.INVALID_ARGUMENT, "share.sm_percent"),
        ({"request": 0}, grpc.StatusCode.INVALID_ARGUMENT, "share.quota.request_percent"),
        ({"limit": 100.5}, grpc.StatusCode.INVALID_ARGUMENT, "share.quota.limit_percent"),
        ({"assignment_id": "no spaces"}, grpc.StatusCode.INVALID_ARGUMENT, "assignment_id"),
        ({"mode": 7}, grpc.StatusCode.INVALID_ARGUMENT, "mode"),
        ({"memory_gib": 81}, grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the GPU"),
    ],
)
async def test_bad_reservations_are_refused_and_change_nothing(
    live: LiveDispatcher, request_args: dict, code: grpc.StatusCode, field: str
) -> None:
    got, details = await refusal(live.stub.Reserve(reserve_request(**request_args)))
    assert got == code
    assert field in details
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert len(status.clients) == 0 and status.memory_reserved_bytes == 0


async def test_capacity_is_never_over_committed(live: LiveDispatcher) -> None:
    await live.reserve(request=60, memory_gib=50)
    got, details = await refusal(live.stub.Reserve(reserve_request(request=50)))
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "over-committed" in details
    got, details = await refusal(live.stub.Reserve(reserve_request(request=10, memory_gib=40)))
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "not enough GPU memory" in details
    # What still fits is admitted; SM shares may add up past 100% (they take turns in time).
    await live.reserve(sm=100, request=40, memory_gib=30)
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert status.quota_reserved_percent == pytest.approx(100)
    assert status.memory_reserved_bytes == 80 * GIB


async def test_reserve_is_idempotent_by_assignment_id(live: LiveDispatcher) -> None:
    request = reserve_request(sm=30, request=20, assignment_id="svc-a.1")
    first = await live.stub.Reserve(request)
    again = await live.stub.Reserve(request)
    assert again.assignment_token == first.assignment_token
    changed = reserve_request(sm=40, request=20, assignment_id="svc-a.1")
    got, details = await refusal(live.stub.Reserve(changed))
    assert got == grpc.StatusCode.ALREADY_EXISTS and "svc-a.1" in details
    listed = await live.stub.ListClients(dispatcher_pb2.ListClientsRequest())
    assert [c.assignment.share.sm_percent for c in listed.clients] == [30]
    assert listed.clients[0].assignment.assignment_token == ""  # never listed


async def test_a_caller_supplied_token_is_used_and_must_be_well_formed(
    live: LiveDispatcher,
) -> None:
    request = reserve_request()
    request.assignment_token = "short"
    got, details = await refusal(live.stub.Reserve(request))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "assignment_token" in details
    request.assignment_token = "T" * 40
    assignment = await live.stub.Reserve(request)
    assert assignment.assignment_token == "T" * 40


async def test_status_shows_clients_quotas_usage_and_queue(live: LiveDispatcher) -> None:
    assignment = await live.reserve(sm=60, request=25, limit=50, memory_gib=4)
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
        shim.acquire(timeout_s=2)
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert status.gpu.model == "A100-80GB" and status.gpu.backend == "simulated"
    assert status.gpu.memory_bytes == 80 * GIB and status.gpu.sm_count == 108
    assert status.policy == "spatiotemporal" and status.window_ms == pytest.approx(200)
    assert 0 <= status.window_elapsed_ms < 200
    (client,) = status.clients
    assert client.connected and client.state == dispatcher_pb2.LEASE_STATE_HOLDING
    assert client.assignment.share.quota.request_percent == 25
    assert client.used_percent > 0  # the provisional charge of the lease
    assert status.running_sm_percent == 60


async def test_evict_disconnects_and_unknown_is_not_found(live: LiveDispatcher) -> None:
    assignment = await live.reserve()
    shim = ShimClient.connect(live.socket_path, assignment.assignment_token)
    await live.stub.EvictClient(
        dispatcher_pb2.EvictClientRequest(assignment_id=assignment.assignment_id, reason="drain")
    )
    assert shim.region.state.name == "EVICTED"
    shim.close()
    got, _ = await refusal(
        live.stub.EvictClient(dispatcher_pb2.EvictClientRequest(assignment_id="nobody"))
    )
    assert got == grpc.StatusCode.NOT_FOUND
    got, details = await refusal(
        live.stub.EvictClient(
            dispatcher_pb2.EvictClientRequest(
                assignment_id=assignment.assignment_id, reason="x" * 2000
            )
        )
    )
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "reason" in details


async def test_events_stream_reservations_connections_and_leases(live: LiveDispatcher) -> None:
    call = live.stub.WatchEvents(dispatcher_pb2.WatchEventsRequest(include_leases=True))
    received: list[dispatcher_pb2.DispatcherEvent] = []

    async def collect() -> None:
        async for event in call:
            received.append(event)

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0.1)  # the stream is subscribed
    assignment = await live.reserve()
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
        shim.acquire(timeout_s=2)
    await live.stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id))
    for _ in range(100):
        if any(e.kind == dispatcher_pb2.DISPATCHER_EVENT_KIND_RELEASED for e in received):
            break
        await asyncio.sleep(0.02)
    call.cancel()
    collector.cancel()
    kinds = [dispatcher_pb2.DispatcherEventKind.Name(e.kind) for e in received]
    for expected in ("RESERVED", "REGISTERED", "LEASE_GRANTED", "DISCONNECTED", "RELEASED"):
        assert f"DISPATCHER_EVENT_KIND_{expected}" in kinds
    assert kinds.index("DISPATCHER_EVENT_KIND_RESERVED") < kinds.index(
        "DISPATCHER_EVENT_KIND_REGISTERED"
    )
    assert all(e.assignment_id == assignment.assignment_id for e in received)


async def test_grpcurl_reserves_and_reads_status_through_reflection(live: LiveDispatcher) -> None:
    """What docs/dispatcher.md shows: grpcurl with nothing but server reflection."""
    address = f"127.0.0.1:{live.dispatcher.port}"

    async def grpcurl(*args: str) -> str:
        process = await asyncio.create_subprocess_exec(
            grpcurl_binary(), "-plaintext", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), timeout=30)
        assert process.returncode == 0, err.decode()
        return out.decode()

    assert "gpuloom.v1.Dispatcher" in await grpcurl(address, "list")
    reserve = {
        "assignment_id": "demo-1",
        "client_name": "resnet",
        "memory_cap_bytes": str(4 << 30),
        "share": {"sm_percent": 24, "quota": {"request_percent": 40, "limit_percent": 60}},
    }
    answer = json.loads(
        await grpcurl("-d", json.dumps(reserve), address, "gpuloom.v1.Dispatcher/Reserve")
    )
    assert answer["environment"]["GPULOOM_DISPATCHER_SOCKET"] == live.socket_path
    status = json.loads(await grpcurl(address, "gpuloom.v1.Dispatcher/GetGpuStatus"))
    # grpcurl prints the proto field names.
    assert status["clients"][0]["assignment"]["share"]["sm_percent"] == 24
    assert status["quota_reserved_percent"] == 40


async def test_a_caller_that_gives_up_leaves_the_book_and_the_shares_agreeing(
    live: LiveDispatcher,
) -> None:
    # Placement's RPC deadline may cancel a Reserve or a Release while the book's thread or
    # the channel is at work. Each is made in full anyway: the retried Reserve finds the
    # reservation, and its Release removes a share the channel holds (before, a share the
    # book had forgotten made the retry fail with "client already exists", and a reservation
    # without its share made the release fail with "unknown client").
    core = live.dispatcher.core
    specs = [
        reserve_spec_from_pb(reserve_request(request=2, assignment_id=f"gone-{n}"))
        for n in range(12)
    ]
    for n, spec in enumerate(specs):
        task = asyncio.create_task(core.reserve(spec))
        for _ in range(n % 4):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for spec in specs:
        await core.reserve(spec)
    for n, spec in enumerate(specs):
        task = asyncio.create_task(core.release(spec.assignment_id))
        for _ in range(n % 4):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for spec in specs:  # each may be made again, and released
        await core.reserve(spec)
        assert await core.release(spec.assignment_id)
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert len(status.clients) == 0 and status.quota_reserved_percent == 0
