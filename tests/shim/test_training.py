"""Gandiva's live mechanisms on the real C shim and the fake driver: a fake training loop
(allocate activations layer by layer, launch, free them in reverse, synchronise; one mini-batch
every PERIOD) is introspected from the memory samples its shim writes, and suspended at a low
point and resumed with nothing lost. The fake GPU's engine log is the ground truth of which
kernels ran when."""

from __future__ import annotations

import asyncio
import time

import grpc
import prometheus_client
import pytest

from gpuloom.domain.training import TIME_SLICE_REASON
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import LiveDispatcher, reserve_request
from tests.shim.conftest import Run, Runner, launch

MIB = 1 << 20
KERNEL = "k_layer_2500us"  # 40 ms of GPU time per 100 ms mini-batch
SHORT_KERNEL = "k_layer_1250us"  # 20 ms: two such jobs leave the GPU idle half the time
PERIOD_S = 0.1
LAYERS = 8
ACTIVATIONS = 16 * MIB  # per layer
WEIGHTS = 64 * MIB  # held throughout: the cycle's floor
LOW, HIGH = WEIGHTS, WEIGHTS + LAYERS * ACTIVATIONS
SWING = HIGH - LOW
TRAINING = {"training_analyze_ms": 500.0, "training_window_s": 10.0}


def _env(live: LiveDispatcher, token: str, **extra: str) -> dict[str, str]:
    return {
        "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
        "GPULOOM_ASSIGNMENT_TOKEN": token,
        **extra,
    }


def _train(steps: int, kernel: str = KERNEL) -> list[str]:
    return [
        "module", kernel, "alloc", "alloc", str(WEIGHTS),
        "train", str(steps), str(int(PERIOD_S * 1e6)), str(LAYERS), str(ACTIVATIONS), kernel,
    ]  # fmt: skip


def _step_starts(result: Run) -> list[int]:
    """When each mini-batch began (CLOCK_MONOTONIC ns), as the job printed it."""
    return [
        int(line.split("t=")[1])
        for line in result.stdout.splitlines()
        if line.startswith("train step")
    ]


def _realized_period_s(starts: list[int], until_ns: int) -> float:
    """The job's own mean mini-batch period over what the detection saw (its last window):
    on a loaded machine the loop runs late, and that is the period there is to detect."""
    seen = [t for t in starts if until_ns - TRAINING["training_window_s"] * 1e9 <= t <= until_ns]
    return (seen[-1] - seen[0]) / (len(seen) - 1) / 1e9


async def _client(live: LiveDispatcher, assignment_id: str) -> dispatcher_pb2.ClientStatus:
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    return next(c for c in status.clients if c.assignment.assignment_id == assignment_id)


async def _wait_for_cycle(
    live: LiveDispatcher, assignment_id: str, timeout_s: float = 8.0, stable: bool = False
) -> dispatcher_pb2.ClientStatus:
    """The client once its cycle is detected (within the job's run: the tests' jobs last 8 to
    10 s); `stable`: and found stable (on a loaded machine the first estimates may rest on a
    few irregular mini-batches)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        client = await _client(live, assignment_id)
        # A few cycles more than the detection needs: the first estimates rest on three.
        training = client.training
        if training.minibatch_s > 0 and training.minibatches >= 8 and training.stable >= stable:
            return client
        await asyncio.sleep(0.1)
    raise AssertionError(f"no training cycle detected within {timeout_s} s: {client.training}")


@pytest.mark.parametrize("live", [TRAINING], indirect=True)
async def test_the_mini_batch_time_and_low_memory_come_from_the_shims_samples(
    live: LiveDispatcher, run: Runner
) -> None:
    assignment = await live.reserve(memory_gib=1.0)
    job = asyncio.ensure_future(
        run.run_async(*_train(80), env=_env(live, assignment.assignment_token), timeout=60)
    )
    labels = {"gpu": "0", "assignment": assignment.assignment_id}
    try:
        client = await _wait_for_cycle(live, assignment.assignment_id, stable=True)
        seen_at, seen_ns = time.time(), time.monotonic_ns()
        gauge = prometheus_client.REGISTRY.get_sample_value(
            "gpuloom_dispatcher_training_minibatch_seconds", labels
        )
    finally:
        result = await job
    assert result.returncode == 0, result.stderr
    assert "train minibatches=80 done=80 failed=0" in result.stdout
    cycle = client.training
    starts = _step_starts(result)
    realized = _realized_period_s(starts, seen_ns)
    assert realized == pytest.approx(PERIOD_S, rel=0.25)  # the loop kept roughly to its pace
    assert cycle.minibatch_s == pytest.approx(realized, rel=0.1), (cycle, realized)
    assert cycle.low_memory_bytes == pytest.approx(LOW, abs=0.05 * SWING), cycle
    # The peak lasts one kernel (2.5 ms): the detection's median filter (a tenth of the period)
    # may trim it by up to a layer's activations.
    assert HIGH - 1.5 * ACTIVATIONS <= cycle.high_memory_bytes <= HIGH + 0.05 * SWING, cycle
    assert cycle.samples > 100
    # The next low point predicted is at most a period and an analysis round away.
    next_low_point = cycle.next_low_point.ToMicroseconds() / 1e6
    assert seen_at - 1.0 < next_low_point < seen_at + 2 * PERIOD_S
    assert gauge == pytest.approx(cycle.minibatch_s, rel=0.1)
    # The process is gone: what the last analysis while it ran found stands (its flat tail is
    # not analysed: a cycle found would otherwise turn into "no cycle" as the tail grows).
    ended = await _client(live, assignment.assignment_id)
    await asyncio.sleep(3 * TRAINING["training_analyze_ms"] / 1e3)
    later = await _client(live, assignment.assignment_id)
    assert later.training == ended.training
    accepted = prometheus_client.REGISTRY.get_sample_value(
        "gpuloom_dispatcher_memory_samples_total", {"gpu": "0", "outcome": "accepted"}
    )
    assert accepted is not None and accepted > 100


@pytest.mark.parametrize("live", [TRAINING], indirect=True)
async def test_a_job_is_suspended_at_a_low_point_and_resumed_with_no_lost_work(
    live: LiveDispatcher, run: Runner
) -> None:
    """Two training processes share the GPU; one is suspended at a mini-batch boundary for
    longer than its shim's wait bound, and resumed: no kernel of it runs meanwhile (the other's
    do), its memory stays as it was, and it completes every mini-batch."""
    steps = 100
    first, second = [await live.reserve(request=50.0, memory_gib=1.0) for _ in range(2)]
    jobs = [
        asyncio.ensure_future(
            run.run_async(
                *_train(steps, kernel=SHORT_KERNEL),
                # A wait bound far below the suspension: a suspended shim waits past it.
                env=_env(live, a.assignment_token, GPULOOM_SHIM_WAIT_MS="400"),
                timeout=60,
            )
        )
        for a in (first, second)
    ]
    try:
        await _wait_for_cycle(live, first.assignment_id)
        request = dispatcher_pb2.SuspendClientRequest(
            assignment_id=first.assignment_id, max_wait_ms=1000, reason="time-slice"
        )
        suspended = await live.stub.SuspendClient(request)
        suspended_ns = time.monotonic_ns()
        await asyncio.sleep(1.0)
        again = await live.stub.SuspendClient(request)  # idempotent: the same suspension
        held = await _client(live, first.assignment_id)
        resume_ns = time.monotonic_ns()
        resumed = await live.stub.ResumeClient(
            dispatcher_pb2.ResumeClientRequest(assignment_id=first.assignment_id)
        )
        resumed_again = await live.stub.ResumeClient(
            dispatcher_pb2.ResumeClientRequest(assignment_id=first.assignment_id)
        )
    finally:
        results = await asyncio.gather(*jobs)

    assert suspended.suspended and suspended.suspended_reason == "time-slice"
    assert suspended.suspend_outcome == "low_point", suspended
    assert suspended.suspend_wait_ms <= 1000
    # Stopped at a mini-batch boundary: near the cycle's floor, and held there (resident).
    assert suspended.suspended_memory_bytes <= LOW + 0.1 * SWING, suspended
    # Held resident: nothing freed, and at most the one allocation that raced the suspension
    # (the dispatcher records the memory its samples show; under load the process may have
    # taken its next layer before it read the suspension; its next allocation then waits).
    assert held.suspended
    assert 0 <= held.memory_allocated_bytes - suspended.suspended_memory_bytes <= ACTIVATIONS
    assert suspended.HasField("suspended_at")
    assert again.suspended_at == suspended.suspended_at
    assert not resumed.suspended and not resumed_again.suspended
    assert not resumed.HasField("suspended_at")

    for result in results:
        assert result.returncode == 0, result.stderr
        assert f"train minibatches={steps} done={steps} failed=0" in result.stdout
        assert "UNTHROTTLED" not in result.stderr, result.stderr
    pid_first, pid_second = (int(r.value("init", "pid")) for r in results)
    runs = run.engine_runs()
    # Nothing of the suspended process ran while it was suspended (a kernel queued before the
    # suspension may finish in its first milliseconds); the other process kept running.
    settle = int(0.02e9)
    assert not [r for r in runs if r[0] == pid_first and suspended_ns + settle < r[2] < resume_ns]
    assert [r for r in runs if r[0] == pid_second and suspended_ns < r[2] < resume_ns]
    # Every mini-batch of both ran in full: 2 launches per layer each.
    for pid in (pid_first, pid_second):
        assert len([r for r in runs if r[0] == pid]) == steps * 2 * LAYERS
    # Suspended well before the end: it had mini-batches left to run after the resume.
    assert [r for r in runs if r[0] == pid_first and r[2] > resume_ns]
    assert "suspended" in " ".join(results[0].shim_trace)


def _launching(live: LiveDispatcher, run: Runner, token: str, kernels: int) -> asyncio.Future[Run]:
    """A process that launches `kernels` kernels and synchronises (a shim wait bound of 300 ms,
    which a suspended shim waits past)."""
    return asyncio.ensure_future(
        run.run_async(
            "module",
            KERNEL,
            *launch("kernel", KERNEL, kernels),
            "sync",
            env=_env(live, token, GPULOOM_SHIM_WAIT_MS="300"),
        )
    )


async def _resume_and_check(
    live: LiveDispatcher, run: Runner, job: asyncio.Future[Run], assignment_id: str, started_ns: int
) -> None:
    """Resumes the suspended client: its process (5 kernels, started at `started_ns`) ends well,
    every kernel having run after the resume and none before."""
    resume_ns = time.monotonic_ns()
    await live.stub.ResumeClient(dispatcher_pb2.ResumeClientRequest(assignment_id=assignment_id))
    result = await job
    assert result.returncode == 0, result.stderr
    runs = run.engine_runs()
    assert len(runs) == 5
    assert all(started_ns < start and start > resume_ns for _, _, start, _ in runs)


@pytest.mark.parametrize("live", [TRAINING], indirect=True)
async def test_a_process_that_registers_while_suspended_waits_for_resume(
    live: LiveDispatcher, run: Runner
) -> None:
    assignment = await live.reserve()
    suspended = await live.stub.SuspendClient(
        dispatcher_pb2.SuspendClientRequest(assignment_id=assignment.assignment_id)
    )
    assert suspended.suspended and suspended.suspend_outcome == "not_running"
    started_ns = time.monotonic_ns()
    job = _launching(live, run, assignment.assignment_token, 5)
    await asyncio.sleep(1.0)
    assert not job.done()
    await _resume_and_check(live, run, job, assignment.assignment_id, started_ns)


async def test_a_time_slice_member_runs_no_kernel_until_resumed(
    live: LiveDispatcher, run: Runner
) -> None:
    """Reserved to take turns in a whole-GPU job's rectangle (time_slice_of), a process starts
    suspended: none of its kernels runs until placement's ResumeClient."""
    await live.reserve(request=100.0, assignment_id="running")
    request = reserve_request(request=100.0, assignment_id="member")
    request.time_slice_of = "running"
    member = await live.stub.Reserve(request)
    started_ns = time.monotonic_ns()
    job = _launching(live, run, member.assignment_token, 5)
    await asyncio.sleep(1.0)
    assert not job.done()
    client = await _client(live, "member")
    assert client.connected and client.suspended
    assert client.suspended_reason == TIME_SLICE_REASON
    assert run.engine_runs() == []
    await _resume_and_check(live, run, job, "member", started_ns)


async def test_the_dispatchers_death_frees_a_suspended_process(
    live: LiveDispatcher, run: Runner
) -> None:
    """Suspended, the shim waits without its bound; a dispatcher that dies lets it go on
    (fail-open, loudly), as any loss of the dispatcher does."""
    assignment = await live.reserve()
    await live.stub.SuspendClient(
        dispatcher_pb2.SuspendClientRequest(assignment_id=assignment.assignment_id)
    )
    job = _launching(live, run, assignment.assignment_token, 3)
    await asyncio.sleep(0.8)
    assert not job.done()
    await asyncio.to_thread(live.dispatcher.channel.stop)
    result = await job
    assert result.returncode == 0, result.stderr
    assert "UNTHROTTLED" in result.stderr
    assert len(run.engine_runs()) == 3


async def test_suspend_and_resume_answer_bad_requests(live: LiveDispatcher) -> None:
    stub = live.stub
    for call, request in (
        (stub.SuspendClient, dispatcher_pb2.SuspendClientRequest(assignment_id="nobody")),
        (stub.ResumeClient, dispatcher_pb2.ResumeClientRequest(assignment_id="nobody")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(request)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assignment = await live.reserve()
    for bad in (
        dispatcher_pb2.SuspendClientRequest(assignment_id="bad id!"),
        dispatcher_pb2.SuspendClientRequest(assignment_id=assignment.assignment_id, max_wait_ms=-1),
        dispatcher_pb2.SuspendClientRequest(
            assignment_id=assignment.assignment_id, max_wait_ms=float("nan")
        ),
        dispatcher_pb2.SuspendClientRequest(
            assignment_id=assignment.assignment_id, max_wait_ms=1e9
        ),
        dispatcher_pb2.SuspendClientRequest(
            assignment_id=assignment.assignment_id, reason="x" * 2000
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SuspendClient(bad)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    client = await _client(live, assignment.assignment_id)
    assert not client.suspended  # a refused request changed nothing


@pytest.mark.parametrize(
    ("live", "mode"),
    [({}, 0), ({"policy": "fikit"}, 0), ({}, 3)],
    indirect=["live"],
    ids=["share", "fikit", "off"],
)
async def test_a_running_process_is_held_in_every_mode(
    live: LiveDispatcher, run: Runner, mode: int
) -> None:
    """SHARE (its lease withdrawn), FIKIT (out of the arbiter's decisions; the shim holds back)
    and OFF (admitted until further notice, then not): a suspended process launches nothing."""
    assignment = await live.reserve(mode=mode)
    job = asyncio.ensure_future(
        run.run_async(
            *["module", KERNEL, "loop", "3.0", KERNEL, "1"],
            env=_env(live, assignment.assignment_token, GPULOOM_SHIM_WAIT_MS="300"),
        )
    )
    deadline = time.monotonic() + 10
    while not run.engine_runs() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    suspended = await live.stub.SuspendClient(
        dispatcher_pb2.SuspendClientRequest(assignment_id=assignment.assignment_id)
    )
    suspended_ns = time.monotonic_ns()
    await asyncio.sleep(1.0)  # over three times the shim's wait bound
    resume_ns = time.monotonic_ns()
    await live.stub.ResumeClient(
        dispatcher_pb2.ResumeClientRequest(assignment_id=assignment.assignment_id)
    )
    result = await job
    assert result.returncode == 0, result.stderr
    assert "UNTHROTTLED" not in result.stderr, result.stderr
    # It allocates nothing: no cycle, suspended at once.
    assert suspended.suspended and suspended.suspend_outcome == "no_cycle", suspended
    runs = run.engine_runs()
    settle = int(0.02e9)
    assert not [r for r in runs if suspended_ns + settle < r[2] < resume_ns]
    assert [r for r in runs if r[2] < suspended_ns] and [r for r in runs if r[2] > resume_ns]


@pytest.mark.parametrize("live", [{"policy": "fikit"}], indirect=True)
async def test_a_suspended_fikit_holder_leaves_the_gpu_to_the_next_priority(
    live: LiveDispatcher, run: Runner
) -> None:
    """FIKIT's arbiter is told of a suspension: while the priority-0 process is suspended, the
    priority-5 one holds the GPU and launches without asking (no grant per kernel, as it would
    as a filler of an idle holder); resumed, the first holds it again."""
    from tests.dispatcher.conftest import reserve_request

    modules = ["module", f"{KERNEL},{SHORT_KERNEL}"]
    tokens = {}
    for name, level in (("low", 5), ("high", 0)):
        request = reserve_request(assignment_id=f"fikit-{name}")
        request.priority.level = level
        tokens[name] = (await live.stub.Reserve(request)).assignment_token
    wait = {"GPULOOM_SHIM_WAIT_MS": "5000"}
    low = asyncio.ensure_future(
        run.run_async(*modules, "loop", "4.0", SHORT_KERNEL, "1",
                      env=_env(live, tokens["low"], **wait))
    )  # fmt: skip
    await asyncio.sleep(0.3)
    high = asyncio.ensure_future(
        run.run_async(*modules, "loop", "3.0", KERNEL, "1", env=_env(live, tokens["high"], **wait))
    )
    deadline = time.monotonic() + 10
    while not [r for r in run.engine_runs() if r[1] == KERNEL] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    suspended = await live.stub.SuspendClient(
        dispatcher_pb2.SuspendClientRequest(assignment_id="fikit-high")
    )
    assert suspended.suspended, suspended
    arbiter = live.dispatcher.engine
    await asyncio.sleep(0.1)  # the low one's role changes at the arbiter's next round
    grants, began = arbiter.fikit_stats().grants, time.monotonic_ns()
    await asyncio.sleep(0.8)
    granted, ended = arbiter.fikit_stats().grants - grants, time.monotonic_ns()
    await live.stub.ResumeClient(dispatcher_pb2.ResumeClientRequest(assignment_id="fikit-high"))
    for result in (await high, await low):
        assert result.returncode == 0, result.stderr
    ran = [r for r in run.engine_runs() if r[1] == SHORT_KERNEL and began < r[2] < ended]
    # 0.8 s of 1.25 ms kernels: a holder runs hundreds; a filler would need a grant for each.
    assert len(ran) > 150, len(ran)
    assert granted <= 2, granted
