"""The shim against a live dispatcher (simulated GPU, real socket): memory cap, token sharing
measured on the fake GPU's engine, dispatcher loss (open and closed), token reuse."""

from __future__ import annotations

import asyncio
import time

import prometheus_client
import pytest

from gpuloom.services.dispatcher.domain import derive_task_key
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import GIB, LiveDispatcher
from tests.shim.conftest import (
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    PROGRAM,
    Runner,
    assert_charged_as_ran,
    launch,
)

MIB = 1 << 20


async def _until_registered(live: LiveDispatcher, clients: int) -> None:
    """Until the dispatcher lists this many connected clients (at most 10 s)."""
    for _ in range(200):
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        if sum(1 for c in status.clients if c.connected) >= clients:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{clients} client(s) never registered")


def _env(live: LiveDispatcher, token: str, **extra: str) -> dict[str, str]:
    return {
        "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
        "GPULOOM_ASSIGNMENT_TOKEN": token,
        **extra,
    }


async def test_memory_cap_on_every_allocation_path(live: LiveDispatcher, run: Runner) -> None:
    assignment = await live.reserve(memory_gib=1.0)
    kinds = ["alloc", "pitch", "managed", "async", "create"]
    ops: list[str] = []
    for kind in kinds:  # 5 x 200 MiB fit under 1 GiB ...
        ops += ["alloc", kind, str(200 * MIB)]
    for kind in kinds:  # ... and then nothing of 100 MiB does, on any path
        ops += ["alloc", kind, str(100 * MIB)]
    ops += ["meminfo", "freeall", "meminfo", "alloc", "create", str(1000 * MIB)]
    result = await run.run_async(*ops, env=_env(live, assignment.assignment_token))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for kind in kinds:
        assert f"alloc {kind} {200 * MIB} rc=0" in lines
        assert f"alloc {kind} {100 * MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in lines
    meminfo = [line for line in lines if line.startswith("meminfo")]
    assert meminfo[0] == f"meminfo rc=0 free={GIB - 1000 * MIB} total={GIB}"
    assert meminfo[1] == f"meminfo rc=0 free={GIB} total={GIB}"  # frees are tracked
    assert lines[-1] == f"alloc create {1000 * MIB} rc=0"
    # The refused allocations never reached the driver.
    assert not any(
        "100" in line and "fake cuMem" in line and "out_of" in line for line in result.fake_trace
    )


KERNEL, SYNC_EVERY = "k_work_2000us", "1"
SHARING = {
    "window_ms": 500.0,
    "policy_args": "tokens.lease_min_s=0.02,tokens.lease_initial_s=0.025,tokens.lease_max_s=0.05",
}


@pytest.mark.parametrize("live", [SHARING], indirect=True)
async def test_two_processes_share_the_gpu_by_their_requests(
    live: LiveDispatcher, run: Runner
) -> None:
    requests = [0.3, 0.7]
    assignments = [await live.reserve(sm=100, request=r * 100, limit=r * 100) for r in requests]
    tokens = [assignment.assignment_token for assignment in assignments]
    seconds = 4.0
    results = await asyncio.gather(
        *(
            run.run_async(
                "module",
                KERNEL,
                "loop",
                str(seconds),
                KERNEL,
                SYNC_EVERY,
                env=_env(live, token, GPULOOM_SHIM_WAIT_MS="3000"),
            )
            for token in tokens
        )
    )
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "UNTHROTTLED" not in result.stderr, result.stderr
    runs = run.engine_runs()
    pids = sorted({pid for pid, *_ in runs})
    assert len(pids) == 2
    first = min(start for _, _, start, _ in runs)
    last = min(max(end for p, _, _, end in runs if p == pid) for pid in pids)
    start, stop = first + int(1.0e9), last - int(0.2e9)  # skip a warm-up second and the tail
    assert stop - start > 2e9

    def busy(pid: int) -> int:
        return sum(
            max(0, min(end, stop) - max(begin, start)) for p, _, begin, end in runs if p == pid
        )

    # GPU-time shares: each process's part of the time the fake GPU's engine was busy (the
    # engine's own log is the ground truth). Requests add up to 100 %, so the few percent lost
    # to lease handovers and launch overhead come out of someone's share of the wall clock;
    # the shares of GPU time delivered are what the quotas divide.
    # On a loaded 2-vCPU machine a hand-over costs the two clients' and the channel's wake-ups,
    # so up to a fifth of the engine's time may go idle; leases that are not handed over leave
    # it idle for whole windows.
    window = stop - start
    total = sum(busy(pid) for pid in pids)
    assert total / window > 0.8, "the engine sat idle: leases are not handed over"
    pid_of = [int(result.value("init", "pid")) for result in results]
    shares = [busy(pid) / total for pid in pid_of]
    for share, request in zip(shares, requests, strict=True):
        assert share == pytest.approx(request, abs=0.04), shares
    # The limit is a cap on the wall clock, whatever the other client left idle.
    for pid, limit in zip(pid_of, requests, strict=True):
        assert busy(pid) / window <= limit + 0.02, (busy(pid) / window, limit)

    await assert_charged_as_ran(live, assignments, results, runs)


@pytest.mark.parametrize("live", [SHARING], indirect=True)
async def test_a_lone_process_takes_its_leases_from_the_desk(
    live: LiveDispatcher, run: Runner
) -> None:
    """Alone on the GPU, the shim's lease requests are answered by the lease desk from its
    standing terms (no socket, no Python), and what it is charged is still what it ran."""
    renewed_before = _desk_events("renewed")
    assignment = await live.reserve(sm=50, request=50, limit=100)
    result = await run.run_async(
        "module", KERNEL, "loop", "1.5", KERNEL, SYNC_EVERY,
        env=_env(live, assignment.assignment_token),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "UNTHROTTLED" not in result.stderr, result.stderr
    channel = live.dispatcher.channel
    snapshot = await asyncio.wrap_future(channel.submit(channel.scheduler_snapshot))
    client = snapshot.clients[assignment.assignment_id]
    await asyncio.sleep(0.6)  # desk metrics are flushed with the housekeeping
    renewed = _desk_events("renewed") - renewed_before
    # Python answers the first request and one per window (new terms); the desk the rest.
    assert client.leases_granted >= 20
    assert renewed >= client.leases_granted - 6, (renewed, client.leases_granted)
    pid = int(result.value("init", "pid"))
    truth_s = sum(end - begin for p, _, begin, end in run.engine_runs() if p == pid) / 1e9
    assert client.total_gpu_s == pytest.approx(truth_s, rel=0.1), (client.total_gpu_s, truth_s)


def _desk_events(event: str) -> float:
    sample = prometheus_client.REGISTRY.get_sample_value(
        "gpuloom_dispatcher_lease_desk_events_total", {"gpu": "0", "event": event}
    )
    return sample or 0.0


@pytest.mark.parametrize("policy", ["open", "closed"])
async def test_dispatcher_loss_mid_run(live: LiveDispatcher, run: Runner, policy: str) -> None:
    # A small share: the process waits for leases most of the time, so losing the dispatcher
    # while it waits is the likely case.
    token = (await live.reserve(sm=100, request=20.0, limit=20.0)).assignment_token
    wait_ms = 300
    env = _env(live, token, GPULOOM_SHIM_WAIT_MS=str(wait_ms), GPULOOM_ON_DISPATCHER_LOSS=policy)
    task = asyncio.create_task(
        run.run_async("module", "k_l_500us", "loop", "2.0", "k_l_500us", "1", env=env)
    )
    await asyncio.sleep(0.8)
    stopped_ns = time.monotonic_ns()
    await asyncio.to_thread(live.dispatcher.channel.stop)
    started = asyncio.get_running_loop().time()
    result = await task
    finished = asyncio.get_running_loop().time() - started
    assert "lost the dispatcher" in result.stderr, result.stderr
    max_launch_ms = float(result.value("loop", "max_launch_ms"))
    assert max_launch_ms < wait_ms + 100, result.stdout
    if policy == "open":
        assert result.returncode == 0, result.stderr
        assert "UNTHROTTLED" in result.stderr
        # The rest of the run went at full speed (2 s of 0.5 ms kernels, 20 % before the loss).
        assert int(result.value("loop", "launches")) > 1000
    else:
        assert result.returncode == 3
        assert f"rc={CUDA_ERROR_NOT_PERMITTED}" in result.line("loop")
        assert "CUDA_ERROR_NOT_PERMITTED" in result.stderr
        assert finished < 1.5  # it failed soon after the loss instead of running on
        # The bound: no kernel of its started later than GPULOOM_SHIM_WAIT_MS after the loss
        # (the closed socket is seen at once; the wait bound covers a hung dispatcher).
        last_start = max(start for _pid, _name, start, _end in run.engine_runs())
        assert (last_start - stopped_ns) / 1e6 < wait_ms, (last_start - stopped_ns) / 1e6


@pytest.mark.parametrize("policy", ["open", "closed"])
async def test_another_process_with_the_same_token_is_refused(
    live: LiveDispatcher, run: Runner, policy: str
) -> None:
    """A refusal is the dispatcher's decision, not its loss: under either loss policy the
    refused process launches nothing and, never given a memory cap, allocates nothing."""
    token = (await live.reserve(sm=100, request=50.0)).assignment_token
    env = _env(live, token, GPULOOM_ON_DISPATCHER_LOSS=policy)
    # The owner runs while the thief tries (after it exits, a process of the same user may
    # take the reservation over: a restart, tests/dispatcher/test_channel.py).
    owner_task = asyncio.create_task(
        run.run_async("module", "k_o_10us", "loop", "3", "k_o_10us", "1", env=env)
    )
    await _until_registered(live, 1)
    thief = await run.run_async(
        "module",
        "k_o_10us",
        *launch("kernel", "k_o_10us", 3),
        "sync",
        "alloc",
        "alloc",
        str(MIB),
        env=env,
    )
    owner = await owner_task
    assert owner.returncode == 0 and owner.stderr == "", owner.stderr
    assert any(line.startswith("registered mode 1") for line in owner.shim_trace)
    assert "dispatcher refused registration" in thief.stderr, thief.stderr
    assert "GPULOOM_ON_DISPATCHER_LOSS does not apply" in thief.stderr
    assert "refused" in thief.shim_trace and "UNTHROTTLED" not in thief.stderr
    assert thief.returncode == 3
    assert f"launch kernel k_o_10us rc={CUDA_ERROR_NOT_PERMITTED}" in thief.stdout
    assert f"alloc alloc {MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in thief.stdout
    assert not [r for r in run.engine_runs() if r[0] == int(thief.value("init", "pid"))]


@pytest.mark.parametrize("policy", ["open", "closed"])
async def test_an_evicted_process_launches_nothing_more_and_keeps_its_cap(
    live: LiveDispatcher, run: Runner, policy: str
) -> None:
    """Evicted mid-run (EvictClient), under either loss policy: its next launch fails with
    CUDA_ERROR_NOT_PERMITTED (not unthrottled) and its memory cap still holds."""
    assignment = await live.reserve(sm=100, request=10.0, limit=10.0, memory_gib=1.0)
    env = _env(live, assignment.assignment_token, GPULOOM_ON_DISPATCHER_LOSS=policy)
    ops = [
        "module", "k_e_500us", "alloc", "alloc", str(512 * MIB),
        "loop", "3.0", "k_e_500us", "1",
        "meminfo", "alloc", "alloc", str(600 * MIB), "alloc", "alloc", str(100 * MIB),
    ]  # fmt: skip
    task = asyncio.create_task(run.run_async(*ops, env=env))
    await _until_registered(live, 1)
    await asyncio.sleep(0.5)
    evicted_ns = time.monotonic_ns()
    await live.stub.EvictClient(
        dispatcher_pb2.EvictClientRequest(assignment_id=assignment.assignment_id, reason="abuse")
    )
    result = await task
    assert result.returncode == 3, result.stderr
    assert "assignment evicted" in result.stderr and "does not apply" in result.stderr
    assert "UNTHROTTLED" not in result.stderr
    assert f"rc={CUDA_ERROR_NOT_PERMITTED}" in result.line("loop")
    # Nothing of it started on the GPU after the eviction (but what it had queued).
    pid = int(result.value("init", "pid"))
    last_start = max(start for p, _, start, _ in run.engine_runs() if p == pid)
    assert (last_start - evicted_ns) / 1e6 < 50, (last_start - evicted_ns) / 1e6
    # The cap stays: 1 GiB, 512 MiB of it held.
    lines = result.stdout.splitlines()
    assert f"meminfo rc=0 free={GIB - 512 * MIB} total={GIB}" in lines
    assert f"alloc alloc {600 * MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in lines
    assert f"alloc alloc {100 * MIB} rc=0" in lines


async def test_the_shim_sends_its_command_line_for_a_derived_task_key(
    live: LiveDispatcher, run: Runner
) -> None:
    """A reservation without a task key: the dispatcher derives one from the C process's
    command line, exactly as from the Python client's."""
    events = live.stub.WatchEvents(dispatcher_pb2.WatchEventsRequest())
    assignment = await live.reserve()
    ops = ["sync", "meminfo"]
    result = await run.run_async(*ops, env=_env(live, assignment.assignment_token))
    assert result.returncode == 0, result.stderr
    expected = derive_task_key("cudart_like", [str(PROGRAM), *ops])
    async for event in events:
        if event.kind == dispatcher_pb2.DISPATCHER_EVENT_KIND_REGISTERED:
            assert event.detail.endswith(f"task {expected}"), event.detail
            break
    events.cancel()


async def test_a_long_command_line_still_registers(live: LiveDispatcher, run: Runner) -> None:
    """The Register frame carries the command line (up to 16 KiB): one longer than a small
    frame must register all the same, or the process would run uncapped."""
    assignment = await live.reserve(memory_gib=1.0)
    ops = ["alloc", "alloc", "0" * 2000 + "4096", "meminfo"]  # a 2 KiB way to write 4096
    result = await run.run_async(*ops, env=_env(live, assignment.assignment_token))
    assert result.returncode == 0, result.stderr
    assert "UNTHROTTLED" not in result.stderr, result.stderr
    assert f"meminfo rc=0 free={GIB - 4096} total={GIB}" in result.stdout.splitlines()


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"GPULOOM_SHIM_WAIT_MS": "soon"}, "GPULOOM_SHIM_WAIT_MS=soon"),
        ({"GPULOOM_SHIM_WAIT_MS": "0"}, "GPULOOM_SHIM_WAIT_MS=0"),
        ({"GPULOOM_ON_DISPATCHER_LOSS": "maybe"}, "failing closed"),
        ({"GPULOOM_SHIM_LOG": "loud"}, "GPULOOM_SHIM_LOG=loud"),
        ({"GPULOOM_SHIM_EVENT_POOL": "0"}, "GPULOOM_SHIM_EVENT_POOL=0"),
    ],
)
async def test_a_bad_shim_variable_is_named_and_the_cap_and_admission_stay(
    live: LiveDispatcher, run: Runner, env: dict[str, str], complaint: str
) -> None:
    """A malformed setting falls back alone (to its default, or closed for the loss policy):
    the process still registers, shares and keeps its memory cap."""
    assignment = await live.reserve(sm=100, request=50.0, memory_gib=1.0)
    ops = [
        "module", "k_v_100us", *launch("kernel", "k_v_100us", 3), "sync",
        "meminfo", "alloc", "alloc", str(2 * GIB),
    ]  # fmt: skip
    result = await run.run_async(*ops, env=_env(live, assignment.assignment_token, **env))
    assert result.returncode == 0, result.stderr
    complaints = [line for line in result.stderr.splitlines() if "bad configuration" in line]
    assert len(complaints) == 1 and complaint in complaints[0], result.stderr
    assert any(line.startswith("registered mode 1") for line in result.shim_trace)
    assert "launch kernel k_v_100us rc=0" in result.stdout
    assert f"meminfo rc=0 free={GIB} total={GIB}" in result.stdout.splitlines()
    assert f"alloc alloc {2 * GIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in result.stdout
