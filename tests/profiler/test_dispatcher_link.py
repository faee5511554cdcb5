"""Measurement sessions through a live dispatcher: while a session is open, each process of
the task registers in MEASURE mode and is one run; its records reach the profiler, and after
T runs the profile is in the store and the task's processes share again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuloom.clients.shim import ShimClient
from gpuloom.policies.profiling.kernels import kernel_id
from gpuloom.services.dispatcher.domain import derive_task_key
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.shimwire import ShimMode
from gpuloom.v1 import (
    common_pb2,
    dispatcher_pb2,
    dispatcher_pb2_grpc,
    profile_store_pb2,
    profile_store_pb2_grpc,
    profiler_pb2,
    profiler_pb2_grpc,
    shim_pb2,
)
from tests.dispatcher.conftest import reserve_request, start_live
from tests.profiler.conftest import session_when_closed

RUNS = 10
KERNELS = [("gemm", 50_000, 3_000), ("softmax", 8_000, 12_000), ("copy", 20_000, 5_000)]


@pytest.fixture
async def linked(
    short_dir: Path, profiler_app: ProfilerApp
) -> AsyncIterator[tuple[dispatcher_pb2_grpc.DispatcherStub, str]]:
    dispatcher, channel = await start_live(
        short_dir, profiler_address=f"127.0.0.1:{profiler_app.port}", profiler_poll_s=0.05
    )
    try:
        yield dispatcher_pb2_grpc.DispatcherStub(channel), dispatcher.core.socket_path
    finally:
        await channel.close()
        await dispatcher.server.stop(0)
        dispatcher.channel.stop()
        await dispatcher.profiler_link.stop()  # type: ignore[union-attr]


def _run_records() -> list[shim_pb2.KernelRecord]:
    records, clock = [], 1_000
    for name, duration, gap in KERNELS * 4:
        records.append(
            shim_pb2.KernelRecord(
                kernel_id=kernel_id(name, (8, 1, 1), (128, 1, 1)),
                name=name,
                grid=common_pb2.Dim3(x=8, y=1, z=1),
                block=common_pb2.Dim3(x=128, y=1, z=1),
                start_ns=clock,
                end_ns=clock + duration,
            )
        )
        clock += duration + gap
    return records


async def _process(stub: dispatcher_pb2_grpc.DispatcherStub, socket_path: str, n: int) -> ShimMode:
    """One process of the task: reserve, register, send its kernels if measuring, leave."""
    request = reserve_request(sm=50, request=10, assignment_id=f"run-{n}")
    request.task_key = "toy-model"
    assignment = await stub.Reserve(request)
    with ShimClient.connect(socket_path, assignment.assignment_token) as shim:
        mode = shim.registration.mode
        if mode is ShimMode.MEASURE:
            shim.send_measurements(_run_records())
    await stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id))
    return mode


async def test_a_session_measures_t_processes_then_the_task_shares(
    linked: tuple[dispatcher_pb2_grpc.DispatcherStub, str],
    profiler: profiler_pb2_grpc.ProfilerStub,
    stub: profile_store_pb2_grpc.ProfileStoreStub,
) -> None:
    dispatcher, socket_path = linked
    assert await _process(dispatcher, socket_path, 0) is ShimMode.SHARE  # no session yet

    session = await profiler.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key="toy-model", gpu_model="A100-80GB", runs=RUNS)
    )
    await asyncio.sleep(0.3)  # the dispatcher polls open sessions every 0.05 s here
    modes = [await _process(dispatcher, socket_path, n) for n in range(1, RUNS + 1)]
    assert modes == [ShimMode.MEASURE] * RUNS

    done = await session_when_closed(profiler, session.session_id)
    assert done.state == profiler_pb2.SESSION_STATE_COMPLETE, done
    assert done.runs_received == RUNS and done.records == RUNS * 12

    stored = await stub.GetKernelProfile(
        profile_store_pb2.GetProfileRequest(key="toy-model", gpu_model="A100-80GB")
    )
    by_name = {k.name: k for k in stored.kernels}
    for name, duration, _gap in KERNELS:
        assert by_name[name].mean_duration_ns == pytest.approx(duration)
        assert by_name[name].sample_count == 4 * RUNS
    assert by_name["gemm"].mean_gap_after_ns == pytest.approx(3_000)

    await asyncio.sleep(0.3)
    assert await _process(dispatcher, socket_path, 99) is ShimMode.SHARE  # measured: share


async def test_without_a_reachable_profiler_processes_share(short_dir: Path) -> None:
    dispatcher, channel = await start_live(
        short_dir, profiler_address="127.0.0.1:1", profiler_poll_s=0.05
    )
    try:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        assert await _process(stub, dispatcher.core.socket_path, 0) is ShimMode.SHARE
    finally:
        await channel.close()
        await dispatcher.server.stop(0)
        dispatcher.channel.stop()
        await dispatcher.profiler_link.stop()  # type: ignore[union-attr]


async def test_a_task_key_is_derived_from_the_command_line(
    linked: tuple[dispatcher_pb2_grpc.DispatcherStub, str],
    profiler: profiler_pb2_grpc.ProfilerStub,
) -> None:
    """A reservation without a task key: the process's command line names the task."""
    dispatcher, socket_path = linked
    argv = ["/usr/bin/python3", "train.py", "--epochs", "3"]
    key = derive_task_key("python3", argv)
    assert key.startswith("python3-") and key == derive_task_key("python3", list(argv))
    assert key != derive_task_key("python3", [*argv[:-1], "4"])
    await profiler.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key=key, gpu_model="A100-80GB", runs=RUNS)
    )
    await asyncio.sleep(0.3)

    async def register(command: list[str], n: int) -> ShimMode:
        assignment = await dispatcher.Reserve(
            reserve_request(sm=50, request=10, assignment_id=f"derived-{n}")
        )
        with ShimClient.connect(socket_path, assignment.assignment_token, argv=command) as shim:
            mode = shim.registration.mode
        await dispatcher.Release(
            dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id)
        )
        return mode

    assert await register(argv, 1) is ShimMode.MEASURE
    assert await register(["/usr/bin/python3", "serve.py"], 2) is ShimMode.SHARE


async def test_a_profiler_falling_behind_loses_records_but_never_a_runs_end(
    linked: tuple[dispatcher_pb2_grpc.DispatcherStub, str],
    profiler: profiler_pb2_grpc.ProfilerStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shims send small batches; queued ones travel merged, and when the queue is full the
    records are dropped, not the end of a run: the session still completes (it stayed open
    for ever when a run's end was dropped: seen in a dry run of scripts/bench_fikit_torch)."""
    from gpuloom.services.dispatcher import profiling

    monkeypatch.setattr(profiling, "MAX_QUEUED_UPLOADS", 2)
    dispatcher, socket_path = linked
    session = await profiler.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key="toy-model", gpu_model="A100-80GB", runs=RUNS)
    )
    await asyncio.sleep(0.3)
    for n in range(RUNS):
        request = reserve_request(sm=50, request=10, assignment_id=f"burst-{n}")
        request.task_key = "toy-model"
        assignment = await dispatcher.Reserve(request)
        with ShimClient.connect(socket_path, assignment.assignment_token) as shim:
            assert shim.registration.mode is ShimMode.MEASURE
            for record in _run_records():  # one record a frame: a burst of small batches
                shim.send_measurements([record])
        await dispatcher.Release(
            dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id)
        )
    done = await session_when_closed(profiler, session.session_id)
    assert done.state == profiler_pb2.SESSION_STATE_COMPLETE, done
    assert done.runs_received == RUNS
    assert 0 < done.records <= RUNS * 12
