"""Time-slice reservations (Gandiva's over-subscription): a member of a group shares the group's
SM x quota rectangle and adds only its memory; it starts suspended and runs once resumed. The
book alone, then through gRPC with the Python reference client (the C shim's side is
tests/shim/test_training.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.clients.shim import ShimClient
from gpuloom.domain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import TIME_SLICE_REASON
from gpuloom.services.dispatcher.domain import ReserveSpec
from gpuloom.services.dispatcher.reservations import FULL_AREA, ReservationBook
from gpuloom.shimwire import ShimMode
from gpuloom.v1 import dispatcher_pb2, shim_pb2
from tests.dispatcher.conftest import LiveDispatcher, reserve_request

GIB = 1 << 30


def spec(
    assignment_id: str,
    time_slice_of: str = "",
    memory_gib: int = 10,
    request: float = 100,
    sm: int = 100,
    mode: ShimMode = ShimMode.SHARE,
) -> ReserveSpec:
    share = share_of(sm, request, memory_bytes=memory_gib * GIB, priority=3)
    return ReserveSpec(assignment_id, "job", share, mode, time_slice_of=time_slice_of)


def whole_gpu_pair(book: ReservationBook) -> None:
    book.reserve(spec("a"))
    member, created = book.reserve(spec("b", time_slice_of="a"))
    assert created and member.time_slice_of == "a" and member.group == "a"


# ---- the book ----


def test_a_group_takes_the_gpus_area_once() -> None:
    book = ReservationBook(80 * GIB, None)
    whole_gpu_pair(book)
    with pytest.raises(ResourceExhausted, match="over-committed"):
        book.reserve(spec("c", request=1))
    # Its members run one at a time: one guaranteed quota; each member's memory.
    assert book.quota_reserved_percent() == 100
    assert book.memory_reserved_bytes() == 20 * GIB
    assert [r.assignment_id for r in book.all()] == ["a", "b"]


def test_a_member_larger_than_its_group_grows_the_groups_area() -> None:
    book = ReservationBook(80 * GIB, None)
    book.reserve(spec("a", sm=50, request=50))  # 25% of the area
    book.reserve(spec("c", sm=50, request=100))  # 50%
    with pytest.raises(ResourceExhausted, match="time-slice group 'a' holds 25%"):
        book.reserve(spec("b", "a", sm=100, request=60))  # 60%: the group would be 60%
    book.reserve(spec("b", "a", sm=100, request=50))  # 50%: the group is 50%, 100% in all
    assert book.quota_reserved_percent() == 150  # c's 100 + the group's largest, 50
    with pytest.raises(ResourceExhausted, match="over-committed"):
        book.reserve(spec("d", "a", sm=100, request=51))


def test_a_member_still_needs_memory_of_its_own() -> None:
    book = ReservationBook(16 * GIB, None)
    book.reserve(spec("a"))
    before = book.all()
    with pytest.raises(ResourceExhausted, match="not enough GPU memory"):
        book.reserve(spec("b", time_slice_of="a"))
    assert book.all() == before


def test_with_memory_in_turns_a_group_holds_its_largest_members_memory() -> None:
    """A dispatcher whose driver checkpoints a suspended client's memory takes a group's
    memory in turns: members whose memory sums above the GPU are admitted."""
    book = ReservationBook(20 * GIB, None)
    book.memory_in_turns = True
    book.reserve(spec("a", sm=50))
    book.reserve(spec("b", time_slice_of="a", sm=50))  # 10 + 10 GiB, taken in turns
    book.reserve(spec("x", memory_gib=4, sm=50))  # beside the group
    assert book.memory_reserved_bytes() == 14 * GIB
    book.reserve(spec("c", time_slice_of="a", memory_gib=14, sm=50))  # the group holds 14 now
    assert book.memory_reserved_bytes() == 18 * GIB
    before = book.all()
    with pytest.raises(ResourceExhausted, match="beyond its time-slice group's"):
        book.reserve(spec("d", time_slice_of="a", memory_gib=17, sm=50))  # 17 + 4 > 20
    with pytest.raises(ResourceExhausted, match="not enough GPU memory"):
        book.reserve(spec("e", memory_gib=3, sm=50))  # 18 + 3 > 20
    assert book.all() == before
    book.release("c")
    assert book.memory_reserved_bytes() == 14 * GIB


def test_a_member_needs_its_group_on_this_gpu() -> None:
    book = ReservationBook(80 * GIB, None)
    with pytest.raises(FailedPrecondition, match="nothing to time-slice with"):
        book.reserve(spec("b", time_slice_of="a"))
    assert book.all() == []
    whole_gpu_pair(book)
    # A member is not a group's key: the message names the group to join.
    with pytest.raises(FailedPrecondition, match="member of group 'a'"):
        book.reserve(spec("c", time_slice_of="b"))
    assert len(book.all()) == 2


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (spec("b", time_slice_of="no spaces"), "1..128 characters"),
        (spec("b", time_slice_of="x" * 129), "1..128 characters"),
        (spec("b", time_slice_of="b"), "not its own id"),
        (spec("b", time_slice_of="a", mode=ShimMode.MEASURE), "only SHARE"),
        (spec("b", time_slice_of="a", mode=ShimMode.OFF), "only SHARE"),
    ],
)
def test_a_bad_time_slice_of_is_an_invalid_argument(bad: ReserveSpec, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        bad.validate()
    assert caught.value.field == "time_slice_of"


def test_the_group_outlives_its_first_member() -> None:
    book = ReservationBook(80 * GIB, None)
    whole_gpu_pair(book)
    book.release("a")
    # Its area is still held, and it can still be joined by its key.
    with pytest.raises(ResourceExhausted, match="over-committed"):
        book.reserve(spec("c"))
    book.reserve(spec("c", time_slice_of="a"))
    # The key is not for a reservation of its own while the group lives.
    with pytest.raises(FailedPrecondition, match="key of a time-slice group still held by b, c"):
        book.reserve(spec("a", request=1))
    book.release("b")
    with pytest.raises(ResourceExhausted, match="over-committed"):
        book.reserve(spec("d"))
    book.release("c")  # the last member: the group ends
    book.reserve(spec("d"))
    book.reserve(spec("a", time_slice_of="d"))


def test_a_retry_is_idempotent_and_time_slice_of_is_part_of_the_request() -> None:
    book = ReservationBook(80 * GIB, None)
    whole_gpu_pair(book)
    member = book.get("b")
    assert book.reserve(spec("b", time_slice_of="a")) == (member, False)
    with pytest.raises(AlreadyExists, match="different request"):
        book.reserve(spec("b"))
    with pytest.raises(AlreadyExists, match="different request"):
        book.reserve(spec("a", time_slice_of="b"))


def test_groups_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "reservations.json"
    book = ReservationBook(80 * GIB, path)
    whole_gpu_pair(book)
    book.release("a")
    again = ReservationBook(80 * GIB, path)
    (restored,) = again.all()
    assert restored == book.get("b") and restored.time_slice_of == "a"
    with pytest.raises(ResourceExhausted, match="over-committed"):
        again.reserve(spec("c"))
    again.reserve(spec("c", time_slice_of="a"))


def test_a_file_of_an_older_dispatcher_loads_without_groups(tmp_path: Path) -> None:
    path = tmp_path / "reservations.json"
    ReservationBook(80 * GIB, path).reserve(spec("a", request=40))
    document = json.loads(path.read_text())
    for item in document["reservations"]:
        del item["time_slice_of"]
    path.write_text(json.dumps(document))
    (restored,) = ReservationBook(80 * GIB, path).all()
    assert restored.time_slice_of == "" and restored.group == "a"


operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "join", "release"]),
        st.integers(0, 5),  # assignment id
        st.integers(0, 5),  # the group joined
        st.integers(0, 12),  # memory GiB
        st.floats(1, 100),  # quota request
        st.integers(1, 100),  # SM percent
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_groups_never_over_commit_memory_or_the_area(
    ops: list[tuple[str, int, int, int, float, int]],
) -> None:
    book = ReservationBook(40 * GIB, None)
    for action, number, group, memory, request, sm in ops:
        before = book.all()
        if action == "release":
            book.release(f"a{number}")
            continue
        joined = f"a{group}" if action == "join" and group != number else ""
        try:
            book.reserve(spec(f"a{number}", joined, memory, request, sm))
        except (ResourceExhausted, AlreadyExists, FailedPrecondition):
            assert book.all() == before  # refused: nothing changed
        assert book.memory_reserved_bytes() <= 40 * GIB
        areas: dict[str, float] = {}
        for r in book.all():
            area = r.share.sm_percent * r.share.quota.request_percent
            areas[r.group] = max(areas.get(r.group, 0.0), area)
        assert sum(areas.values()) <= FULL_AREA * (1 + 1e-6)


# ---- through gRPC ----


def member_request(
    time_slice_of: str, assignment_id: str, **kwargs: object
) -> dispatcher_pb2.ReserveRequest:
    request = reserve_request(assignment_id=assignment_id, **kwargs)  # type: ignore[arg-type]
    request.time_slice_of = time_slice_of
    return request


async def clients(live: LiveDispatcher) -> dict[str, dispatcher_pb2.ClientStatus]:
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    return {c.assignment.assignment_id: c for c in status.clients}


async def test_a_member_is_reserved_suspended_and_resumed_by_resume_client(
    live: LiveDispatcher,
) -> None:
    first = await live.reserve(request=100, assignment_id="first")
    member = await live.stub.Reserve(member_request("first", "member", request=100))
    assert member.time_slice_of == "first" and member.assignment_token
    assert first.time_slice_of == ""
    shown = await clients(live)
    assert not shown["first"].suspended
    assert shown["member"].suspended and shown["member"].suspended_reason == TIME_SLICE_REASON
    assert shown["member"].suspend_outcome == "not_running"
    assert shown["member"].assignment.time_slice_of == "first"
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert status.quota_reserved_percent == pytest.approx(100)
    # Placement's heartbeats carry the suspension and its reason.
    reports = {r.assignment_id: r for r in await live.dispatcher.core.training_reports()}
    assert reports["member"].suspended and reports["member"].suspended_reason == TIME_SLICE_REASON

    resumed = await live.stub.ResumeClient(
        dispatcher_pb2.ResumeClientRequest(assignment_id="member")
    )
    assert not resumed.suspended
    # A retried Reserve answers the same and leaves it running (it may have been resumed).
    again = await live.stub.Reserve(member_request("first", "member", request=100))
    assert again.assignment_token == member.assignment_token
    assert not (await clients(live))["member"].suspended


@pytest.mark.parametrize(
    ("time_slice_of", "mode", "code", "detail"),
    [
        ("no spaces", 0, grpc.StatusCode.INVALID_ARGUMENT, "time_slice_of"),
        ("member", 0, grpc.StatusCode.INVALID_ARGUMENT, "time_slice_of"),
        ("first", shim_pb2.SHIM_MODE_MEASURE, grpc.StatusCode.INVALID_ARGUMENT, "time_slice_of"),
        ("nobody", 0, grpc.StatusCode.FAILED_PRECONDITION, "nothing to time-slice with"),
    ],
)
async def test_bad_members_are_refused_and_change_nothing(
    live: LiveDispatcher, time_slice_of: str, mode: int, code: grpc.StatusCode, detail: str
) -> None:
    await live.reserve(request=100, assignment_id="first")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await live.stub.Reserve(member_request(time_slice_of, "member", request=100, mode=mode))
    assert caught.value.code() == code and detail in (caught.value.details() or "")
    assert list(await clients(live)) == ["first"]
    suspended = await asyncio.wrap_future(
        live.dispatcher.channel.submit(live.dispatcher.channel.suspensions)
    )
    assert suspended == {}


async def test_a_released_members_suspension_goes_with_it(live: LiveDispatcher) -> None:
    await live.reserve(request=100, assignment_id="first")
    await live.stub.Reserve(member_request("first", "member", request=100))
    await live.stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id="member"))
    channel = live.dispatcher.channel
    assert await asyncio.wrap_future(channel.submit(channel.suspensions)) == {}
    # Reserved again as a member it starts suspended again; once the group is gone, the same id
    # reserved on its own runs.
    await live.stub.Reserve(member_request("first", "member", request=100))
    assert (await clients(live))["member"].suspended
    for assignment_id in ("member", "first"):
        await live.stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id=assignment_id))
    await live.reserve(request=100, assignment_id="member")
    assert not (await clients(live))["member"].suspended
    assert await asyncio.wrap_future(channel.submit(channel.suspensions)) == {}


async def test_members_take_turns_at_the_gpu(live: LiveDispatcher) -> None:
    """Two whole-GPU members whose requests sum to 200%: the running one is leased, the
    suspended one is not; swapped (as placement's driver does), the other one is."""
    first = await live.reserve(request=100, assignment_id="first")
    member = await live.stub.Reserve(member_request("first", "member", request=100))

    def member_works() -> tuple[bool, float]:
        with ShimClient.connect(member.socket_path, member.assignment_token) as shim:
            started_suspended = shim.suspended()
            started = time.monotonic()
            shim.acquire(timeout_s=0.2)  # far shorter than its suspension
            return started_suspended, time.monotonic() - started

    with ShimClient.connect(first.socket_path, first.assignment_token) as running:
        assert running.acquire(timeout_s=2) is not None
        job = asyncio.ensure_future(asyncio.to_thread(member_works))
        for _ in range(20):  # the running one keeps being leased while the member waits
            running.release()
            assert running.acquire(timeout_s=2) is not None
            await asyncio.sleep(0.02)
        assert not job.done()
        shown = await clients(live)
        assert shown["member"].state != dispatcher_pb2.LEASE_STATE_HOLDING
        swapped_at = time.monotonic()
        await live.stub.SuspendClient(dispatcher_pb2.SuspendClientRequest(assignment_id="first"))
        await live.stub.ResumeClient(dispatcher_pb2.ResumeClientRequest(assignment_id="member"))
        started_suspended, waited = await asyncio.wait_for(job, 10)
        assert started_suspended and waited >= 0.3
        assert time.monotonic() - swapped_at < 5
        shown = await clients(live)
        assert shown["first"].suspended and not shown["member"].suspended
        assert shown["first"].state != dispatcher_pb2.LEASE_STATE_HOLDING
        assert shown["member"].leases_granted >= 1
