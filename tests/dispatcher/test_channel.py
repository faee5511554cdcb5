"""The shim channel against the Python reference client: registration, identity, leases through
shared memory, and what garbage, dead clients and silent clients get."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import prometheus_client
import pytest

from gpuloom.clients.shim import Evicted, ShimChannelError, ShimClient
from gpuloom.shimwire import AdmissionState, ShimMode, encode_frame
from gpuloom.v1 import dispatcher_pb2, shim_pb2
from tests.dispatcher.conftest import LiveDispatcher
from tests.polling import eventually


async def test_register_hands_out_the_region_with_cap_and_share(live: LiveDispatcher) -> None:
    assignment = await live.reserve(sm=40, request=30, limit=60, memory_gib=2)
    assert assignment.environment["GPULOOM_ASSIGNMENT_TOKEN"] == assignment.assignment_token
    assert assignment.environment["GPULOOM_DISPATCHER_SOCKET"] == live.socket_path
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
        registration = shim.registration
        assert registration.assignment_id == assignment.assignment_id
        assert registration.memory_cap_bytes == 2 << 30
        assert registration.sm_percent == 40
        assert registration.mode is ShimMode.SHARE
        assert registration.window_s == pytest.approx(0.2)
        # The cap, the SM percent and the mode come on the frame alone: the region's words
        # 32..47 stay zero.
        assert bytes(shim.region.mapping[32:48]) == bytes(16)
        assert shim.region.state is AdmissionState.WAITING
        assert shim.current_lease() is None

        lease = shim.acquire(timeout_s=2)
        assert shim.region.state is AdmissionState.LEASED
        assert 0 < lease.remaining_s() <= 0.010 + 1e-3  # lease_initial_ms in the fixture
        assert shim.acquire() == lease  # still in force: no round trip

    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    (client,) = status.clients
    assert client.leases_granted == 1 and client.pid == os.getpid()


async def test_measure_and_off_modes_are_admitted_open(live: LiveDispatcher) -> None:
    for mode in (shim_pb2.SHIM_MODE_MEASURE, shim_pb2.SHIM_MODE_OFF):
        assignment = await live.reserve(sm=10, request=10, mode=mode)
        with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
            assert shim.region.state is AdmissionState.OPEN
            assert shim.current_lease() is not None


async def test_unknown_token_is_refused(live: LiveDispatcher) -> None:
    with pytest.raises(ShimChannelError, match="unknown assignment token"):
        ShimClient.connect(live.socket_path, "x" * 43)


REPLAY = textwrap.dedent(
    """
    import sys
    from gpuloom.clients.shim import ShimClient, ShimChannelError
    try:
        ShimClient.connect(sys.argv[1], sys.argv[2]).close()
    except ShimChannelError as error:
        print(error)
        sys.exit(3)
    """
)


async def test_token_replayed_by_another_process_is_refused(live: LiveDispatcher) -> None:
    assignment = await live.reserve()
    token = assignment.assignment_token
    with ShimClient.connect(live.socket_path, token):
        pass
    # The same process may come back (a reconnect) ...
    with ShimClient.connect(live.socket_path, token) as again:
        assert again.registration.assignment_id == assignment.assignment_id
    # ... but no other process may spend this assignment.
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", REPLAY, live.socket_path, token],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 3, result.stderr
    assert f"already used by pid {os.getpid()}" in result.stdout


async def test_once_its_process_exits_a_restart_takes_the_token_over(
    live: LiveDispatcher,
) -> None:
    """A job started again on its assignment (gpuloom run after a failed checkpoint, a
    crash-restart loop): the token's process has exited, so a process of the same user takes
    the reservation over; while that one runs, nobody else can."""
    token = (await live.reserve()).assignment_token

    def replay() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", REPLAY, live.socket_path, token],
            capture_output=True,
            text=True,
            timeout=30,
        )

    for _ in range(2):  # registers, exits; the next one takes over
        result = await asyncio.to_thread(replay)
        assert result.returncode == 0, result.stdout + result.stderr
    with ShimClient.connect(live.socket_path, token) as holder:
        assert holder.acquire(timeout_s=2) is not None
        refused = await asyncio.to_thread(replay)
        assert refused.returncode == 3
        assert f"already used by pid {os.getpid()}" in refused.stdout


# Leases long enough that the two outlast a status call on a loaded machine.
@pytest.mark.parametrize(
    "live",
    [{"window_ms": 1000, "policy_args": "tokens.lease_initial_s=0.15,tokens.lease_max_s=0.2"}],
    indirect=True,
)
async def test_two_half_gpu_clients_run_together_and_a_third_waits(live: LiveDispatcher) -> None:
    tokens = [
        (await live.reserve(sm=sm, request=30, limit=100)).assignment_token for sm in (50, 50, 30)
    ]
    first, second, third = (ShimClient.connect(live.socket_path, t) for t in tokens)
    try:
        a = first.acquire(timeout_s=2)
        b = second.acquire(timeout_s=2)
        assert first.current_lease() is not None and second.current_lease() is not None
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        assert status.running_sm_percent == 100

        waiting = asyncio.create_task(asyncio.to_thread(third.acquire, 2.0))
        # The third's request reaches the dispatcher when this loaded machine lets it;
        # ask until it shows, well inside the others' 150 ms leases.
        deadline = time.monotonic() + 0.1
        while True:
            await asyncio.sleep(0.002)
            status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
            if status.waiting or time.monotonic() > deadline:
                break
        assert third.current_lease() is None
        assert list(status.waiting) == [third.registration.assignment_id]
        # 50 + 50 + 30 > 100: the third gets its lease only once one of the others' ends.
        c = await waiting
        ended_first = min(a.until_ns, b.until_ns)
        assert time.monotonic_ns() >= ended_first - 1_000_000
        # A new lease (the desk's ids and the scheduler's come from different ranges).
        assert c.lease_id not in (0, a.lease_id, b.lease_id)
    finally:
        for shim in (first, second, third):
            shim.close()


def _raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def _closed_with_error(sock: socket.socket) -> str:
    """Read what the dispatcher says before it hangs up; '' when it hangs up silently."""
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    sock.close()
    if not data:
        return ""
    message = shim_pb2.DispatcherMessage.FromString(data[4:])
    return message.error.message


@pytest.mark.parametrize(
    ("garbage", "expected"),
    [
        (b"\xff\xff\xff\xff", "frame length 4294967295 outside"),
        (b"\x00\x00\x00\x00", "frame length 0 outside"),
        (encode_frame(b"\xff\xff\xff"), "malformed message"),
        (encode_frame(b"\x78\x01"), "unknown or empty message type"),  # field 15: not ours
        (
            encode_frame(shim_pb2.ShimMessage(goodbye=shim_pb2.Goodbye()).SerializeToString()),
            "first message must be register",
        ),
        (
            encode_frame(
                shim_pb2.ShimMessage(
                    register=shim_pb2.Register(protocol_version=9, assignment_token="t")
                ).SerializeToString()
            ),
            "protocol version 9 not supported",
        ),
    ],
)
async def test_garbage_closes_only_the_offending_connection(
    live: LiveDispatcher, garbage: bytes, expected: str
) -> None:
    assignment = await live.reserve()
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as good:
        bad = _raw_connect(live.socket_path)
        bad.sendall(garbage)
        reason = await asyncio.to_thread(_closed_with_error, bad)
        assert expected in reason
        # Everyone else carries on.
        assert good.acquire(timeout_s=2) is not None
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert len(status.clients) == 1


async def test_a_silent_connection_is_closed_after_the_registration_limit(
    live: LiveDispatcher,
) -> None:
    silent = _raw_connect(live.socket_path)
    started = time.monotonic()
    reason = await asyncio.to_thread(_closed_with_error, silent)
    assert "no registration within the time limit" in reason
    assert time.monotonic() - started < 3  # limit 1 s in the fixture, swept every 0.5 s


async def test_implausible_usage_report_closes_the_connection(live: LiveDispatcher) -> None:
    assignment = await live.reserve()
    shim = ShimClient.connect(live.socket_path, assignment.assignment_token)
    lease = shim.acquire(timeout_s=2)
    report = shim_pb2.UsageReport(lease_id=lease.lease_id, gpu_time_ns=10**18, release=True)
    shim._send(shim_pb2.ShimMessage(usage=report))
    with pytest.raises(ShimChannelError, match="not plausible"):
        for _ in range(100):
            shim._check_socket()
            await asyncio.sleep(0.01)
    shim.close()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from gpuloom.clients.shim import ShimClient
    shim = ShimClient.connect(sys.argv[1], sys.argv[2])
    lease = shim.acquire(timeout_s=5)
    print(lease.lease_id, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("live", [{"policy": "exclusive"}], indirect=True)
async def test_a_client_killed_holding_a_lease_loses_it_at_once(live: LiveDispatcher) -> None:
    """Exclusive mode: the holder's lease never expires, so only the death notice frees it."""
    holder_token = (await live.reserve(request=50)).assignment_token
    waiter_token = (await live.reserve(request=50)).assignment_token
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, live.socket_path, holder_token],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        line = await asyncio.to_thread(holder.stdout.readline)
        assert line.strip().isdigit()
        with ShimClient.connect(live.socket_path, waiter_token) as waiter:
            with pytest.raises(TimeoutError):
                waiter.acquire(timeout_s=0.2)
            holder.send_signal(signal.SIGKILL)
            started = time.monotonic()
            lease = await asyncio.to_thread(waiter.acquire, 5.0)
            assert time.monotonic() - started < 1.0
            assert lease.remaining_s() > 1e6  # exclusive: open-ended
    finally:
        holder.kill()
        holder.wait()
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    holder_status = next(c for c in status.clients if not c.connected)
    assert holder_status.state == dispatcher_pb2.LEASE_STATE_IDLE


async def test_release_evicts_the_connected_process(live: LiveDispatcher) -> None:
    assignment = await live.reserve()
    shim = ShimClient.connect(live.socket_path, assignment.assignment_token)
    shim.acquire(timeout_s=2)
    released = await live.stub.Release(
        dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id)
    )
    assert released.released
    assert shim.region.state is AdmissionState.EVICTED
    with pytest.raises(Evicted, match="assignment released"):
        shim.acquire(timeout_s=1)
    shim.close()
    again = await live.stub.Release(
        dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id)
    )
    assert not again.released


async def test_a_client_that_never_reads_slows_nobody(live: LiveDispatcher) -> None:
    """It registers, never reads a byte (not even its registration) and keeps asking for
    leases; the dispatcher serves another client meanwhile and can still evict it."""
    silent_assignment = await live.reserve(sm=50, request=30)
    good_assignment = await live.reserve(sm=50, request=30)
    silent = _raw_connect(live.socket_path)
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    register = shim_pb2.ShimMessage(
        register=shim_pb2.Register(
            protocol_version=1, assignment_token=silent_assignment.assignment_token
        )
    )
    silent.sendall(encode_frame(register.SerializeToString()))
    request = encode_frame(
        shim_pb2.ShimMessage(lease_request=shim_pb2.LeaseRequest()).SerializeToString()
    )
    with ShimClient.connect(live.socket_path, good_assignment.assignment_token) as good:
        for _ in range(200):
            silent.sendall(request)
            assert good.acquire(timeout_s=2) is not None
            good.release()
    await live.stub.EvictClient(
        dispatcher_pb2.EvictClientRequest(assignment_id=silent_assignment.assignment_id)
    )
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert [c.assignment.assignment_id for c in status.clients] == [good_assignment.assignment_id]
    silent.close()


def _sample(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("live", [{"window_ms": 10_000}], indirect=True)
async def test_metrics_count_leases_waits_and_usage(live: LiveDispatcher) -> None:
    granted_before = _sample("gpuloom_dispatcher_leases_granted_total", gpu="0")
    waits_before = _sample("gpuloom_dispatcher_lease_wait_seconds_count", gpu="0")
    assignment = await live.reserve(sm=100, request=40, limit=80)
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
        for _ in range(5):
            shim.acquire(timeout_s=2)
            shim.record_usage(0.001)
            shim.release()
        # On a loaded machine a lease may come and expire before the client looks: it is
        # reported unused and asked again, one grant and one wait more.
        expected = 5 + shim.missed_leases

        def granted() -> float:
            return _sample("gpuloom_dispatcher_leases_granted_total", gpu="0") - granted_before

        deadline = time.monotonic() + 5
        while granted() < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # lease metrics are flushed every 0.5 s
        labels = {"gpu": "0", "assignment": assignment.assignment_id}
        assert granted() == expected
        assert _sample("gpuloom_dispatcher_lease_wait_seconds_count", gpu="0") - waits_before == (
            expected
        )
        assert _sample("gpuloom_dispatcher_client_used_ratio", **labels) > 0
        assert _sample("gpuloom_dispatcher_client_quota_ratio", bound="limit", **labels) == 0.8
    await live.stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id))
    assert _sample("gpuloom_dispatcher_client_quota_ratio", bound="limit", **labels) == 0


# ---- the lease desk ----


def _desk_sample(event: str) -> float:
    return _sample("gpuloom_dispatcher_lease_desk_events_total", gpu="0", event=event)


def _twenty_leases_renewed_natively(shim: ShimClient) -> int:
    """Twenty leases, each asked only once the last is over, as the C shim asks (the request
    goes to the engine's lease half), 2 ms used of each: every one a new lease, and at least 18
    renewed natively (the first, and one per new terms, may be Python's). Returns how many
    were."""
    ids = []
    for _ in range(20):
        lease = shim.acquire(timeout_s=2)
        ids.append(lease.lease_id)
        shim.record_usage(0.002)
        while shim.current_lease() is not None:
            time.sleep(0.001)
    assert len(set(ids)) == 20
    native = [i for i in ids if i >= 1 << 62]
    assert len(native) >= 18, ids
    return len(native)


@pytest.mark.parametrize("live", [{"window_ms": 10_000}], indirect=True)
async def test_the_desk_renews_leases_natively_and_the_books_follow(live: LiveDispatcher) -> None:
    """After the first lease, renewals come from the standing terms without Python; the
    scheduler's books (leases granted, GPU time charged from the reports) still add up."""
    renewed_before = _desk_sample("renewed")
    assignment = await live.reserve(sm=50, request=40, limit=80)
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
        assert shim.desk is not None  # the dispatcher offered its doorbell
        native = _twenty_leases_renewed_natively(shim)
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        (client,) = status.clients
        # On a loaded machine a lease may come and expire before the client looks: it is
        # reported unused (0 s) and asked again.
        missed = shim.missed_leases
        assert client.leases_granted == 20 + missed
        # 19 reports of 2 ms each replaced the leases' provisional charges; the 20th lease is
        # still charged provisionally (10 ms).
        assert client.gpu_time_s == pytest.approx(19 * 0.002 + 0.010, abs=1e-6)
        await asyncio.sleep(0.6)  # desk metrics are flushed with the housekeeping
        renewed = _desk_sample("renewed") - renewed_before
        assert native <= renewed <= native + missed


async def test_a_request_the_desk_cannot_grant_waits_in_the_policy_order(
    live: LiveDispatcher,
) -> None:
    """Two 60% clients cannot run together: the second's request is forwarded, waits, and gets
    the GPU when the first's lease ends; the first then gets no more native renewals."""
    first_token, second_token = [
        (await live.reserve(sm=60, request=30, limit=100)).assignment_token for _ in range(2)
    ]
    with (
        ShimClient.connect(live.socket_path, first_token) as first,
        ShimClient.connect(live.socket_path, second_token) as second,
    ):
        a = first.acquire(timeout_s=2)
        waiting = asyncio.create_task(asyncio.to_thread(second.acquire, 2.0))
        await asyncio.sleep(0.003)
        assert not waiting.done()
        b = await waiting
        assert time.monotonic_ns() >= a.until_ns - 1_000_000  # only after a's lease ended
        assert b.lease_id < 1 << 62  # granted by the scheduler, in the policy's order
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        assert status.running_sm_percent == 60


@pytest.mark.parametrize(
    "live", [{"window_ms": 10_000, "policy": "composed"}], indirect=True, ids=["composed"]
)
async def test_under_composed_a_levels_leases_are_renewed_by_the_same_engine(
    live: LiveDispatcher,
) -> None:
    """The default policy: a process admitted kernel by kernel (mode FIKIT) asks for its
    level's leases through the engine's doorbell too, and after the first lease they are
    renewed from standing terms without Python, the books following. Two clients share the
    level (one alone would hold an open-ended lease and never ask again)."""
    assignment = await live.reserve(sm=50, request=40, limit=80)
    await live.reserve(sm=50, request=40, limit=80)  # the level's other client, idle
    engine = live.dispatcher.engine
    renewed_before = engine.lease_stats().renewed
    with ShimClient.connect(live.socket_path, assignment.assignment_token) as shim:
        assert shim.registration.mode is ShimMode.FIKIT
        assert shim.desk is not None  # the engine's doorbell, for its leases
        # ... and the same engine admits its kernels (its count is taken at the engine's next
        # round, which a loaded machine may run a little after the registration's answer)
        await eventually(lambda: engine.fikit_stats().tasks == 1, "the engine to count the task")
        native = _twenty_leases_renewed_natively(shim)
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        (client,) = [
            c for c in status.clients if c.assignment.assignment_id == assignment.assignment_id
        ]
        missed = shim.missed_leases
        assert client.leases_granted == 20 + missed
        assert client.gpu_time_s == pytest.approx(19 * 0.002 + 0.010, abs=1e-6)
        renewed = engine.lease_stats().renewed - renewed_before
        assert native <= renewed <= native + missed


@pytest.mark.parametrize(
    "live", [{}, {"policy": "composed"}], indirect=True, ids=["spatiotemporal", "composed"]
)
async def test_garbage_in_the_request_words_costs_only_its_writer(live: LiveDispatcher) -> None:
    bad_token, good_token = [
        (await live.reserve(sm=50, request=30)).assignment_token for _ in range(2)
    ]
    with (
        ShimClient.connect(live.socket_path, bad_token) as bad,
        ShimClient.connect(live.socket_path, good_token) as good,
    ):
        assert bad.desk is not None
        good.acquire(timeout_s=2)
        bad.desk.post(report_lease_id=1, gpu_time_ns=10**19)  # ~317 years in one lease
        with pytest.raises(ShimChannelError, match="not plausible"):
            for _ in range(2000):  # the dispatcher says why and hangs up
                bad._check_socket()
                time.sleep(0.001)
        for _ in range(5):
            while good.current_lease() is not None:
                time.sleep(0.001)
            assert good.acquire(timeout_s=2) is not None
