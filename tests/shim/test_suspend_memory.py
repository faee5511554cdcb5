"""Suspension that frees GPU memory, end to end: a live dispatcher, the shim, and the fake
driver's checkpoint API on one fake GPU whose processes share its memory. The dispatcher
suspends a training loop that allocates once and reuses (as PyTorch does) with lock +
checkpoint, so another job whose memory did not fit beside it runs meanwhile, and resumes it
with restore + unlock: every step run exactly once, every byte intact. Faults: no room to
restore (stays suspended, the reason shown), a process that dies checkpointed (its reservation
is freed), a driver without the API (memory resident, said so), a pid that is not the
reservation's process (refused before the driver is called)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuloom.cudadrv import CheckpointDriver, CudaError, ProcessState
from gpuloom.services.dispatcher.checkpoint import Checkpointer, CheckpointRefused, MemoryState
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import LiveDispatcher
from tests.shim.conftest import BUILD, CUDA_ERROR_OUT_OF_MEMORY, PROGRAM, Runner
from tests.shim.shared_gpu import GPU_MIB, LAYER, MIB, meminfo_free, shared_gpu_env, steady_ops

HELD = 4 * LAYER + 8
FAKE = str(BUILD / "fake" / "libcuda.so.1")
ON = {"suspend_release_memory": True, "cuda_library": FAKE}
NO_API = {"suspend_release_memory": True, "cuda_library": str(BUILD / "fake_min" / "libcuda.so.1")}


@dataclass
class Job:
    process: asyncio.subprocess.Process
    pid: int
    lines: list[str]

    async def finish(self) -> list[str]:
        assert self.process.stdout is not None
        out = await asyncio.wait_for(self.process.stdout.read(), 60)
        await self.process.wait()
        return self.lines + out.decode().splitlines()


class Gpu:
    def __init__(self, run: Runner, live: LiveDispatcher) -> None:
        self.run, self.live = run, live
        self.jobs: list[Job] = []

    def env(self, token: str | None) -> dict[str, str]:
        env = shared_gpu_env(self.run, shim=token is not None)
        if token is not None:
            env.update(
                GPULOOM_DISPATCHER_SOCKET=self.live.socket_path, GPULOOM_ASSIGNMENT_TOKEN=token
            )
        return env

    async def start(self, token: str | None, *ops: str, ready: str) -> Job:
        process = await asyncio.create_subprocess_exec(
            str(BUILD / "cudart_like"), *ops, env=self.env(token), stdout=asyncio.subprocess.PIPE
        )
        job = Job(process, 0, [])
        self.jobs.append(job)
        assert process.stdout is not None
        while True:
            raw = await asyncio.wait_for(process.stdout.readline(), 30)
            assert raw, f"{ops} ended before {ready!r}: {job.lines}"
            line = raw.decode().rstrip("\n")
            job.lines.append(line)
            if line.startswith("init"):
                job.pid = int(line.split("pid=")[1])
            if line.startswith(ready):
                return job

    async def training(self, token: str, steps: int = 40) -> Job:
        return await self.start(token, *steady_ops(steps), ready="steady allocated")

    async def reserved_training(self, steps: int = 40) -> tuple[dispatcher_pb2.Assignment, Job]:
        """A training loop under a new reservation of 1 GiB: the reservation and the job."""
        assignment = await self.live.reserve(memory_gib=1.0)
        return assignment, await self.training(assignment.assignment_token, steps)

    async def once(self, *ops: str) -> list[str]:
        job = await self.start(None, *ops, ready="init")
        return await job.finish()

    async def free_bytes(self) -> int:
        return meminfo_free(await self.once("meminfo"))


@pytest.fixture
async def gpu(run: Runner, live: LiveDispatcher) -> AsyncIterator[Gpu]:
    fake = Gpu(run, live)
    yield fake
    for job in fake.jobs:
        if job.process.returncode is None:
            job.process.kill()
            await job.process.wait()


async def _suspend(live: LiveDispatcher, assignment_id: str) -> dispatcher_pb2.ClientStatus:
    return await live.stub.SuspendClient(
        dispatcher_pb2.SuspendClientRequest(assignment_id=assignment_id, reason="test")
    )


async def _resume(live: LiveDispatcher, assignment_id: str) -> dispatcher_pb2.ClientStatus:
    return await live.stub.ResumeClient(
        dispatcher_pb2.ResumeClientRequest(assignment_id=assignment_id)
    )


def _steps(lines: list[str]) -> list[int]:
    return [int(x.split()[2]) for x in lines if x.startswith("steady step")]


@pytest.mark.parametrize("live", [ON], indirect=True)
async def test_a_suspended_job_frees_its_memory_for_another_and_resumes_intact(
    live: LiveDispatcher, gpu: Gpu
) -> None:
    before = await gpu.free_bytes()
    a, job = await gpu.reserved_training()
    other = str(GPU_MIB * MIB - 2 * LAYER)  # does not fit beside it
    assert f"alloc alloc {other} rc={CUDA_ERROR_OUT_OF_MEMORY}" in await gpu.once(
        "alloc", "alloc", other
    )
    suspended = await _suspend(live, a.assignment_id)
    assert suspended.suspended and suspended.suspended_memory_released, suspended
    assert suspended.suspended_memory_note == ""
    assert abs(await gpu.free_bytes() - before) <= before // 100  # back within 1%
    assert f"alloc alloc {other} rc=0" in await gpu.once("alloc", "alloc", other)
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    (client,) = status.clients
    assert client.suspended and client.suspended_memory_released
    resumed = await _resume(live, a.assignment_id)
    assert not resumed.suspended and not resumed.suspended_memory_released
    lines = await job.finish()
    assert _steps(lines) == list(range(40))  # every step exactly once
    assert lines[-1] == "steady minibatches=40 done=40 failed=0 corrupt=0 damaged_layers=0"


@pytest.mark.parametrize("live", [ON], indirect=True)
async def test_a_restore_without_room_leaves_it_suspended_with_the_reason(
    live: LiveDispatcher, gpu: Gpu, tmp_path: Path
) -> None:
    a, job = await gpu.reserved_training(20)
    assert (await _suspend(live, a.assignment_id)).suspended_memory_released
    (report,) = await live.dispatcher.core.training_reports()
    assert report.memory_released and not report.restore_failed
    go = tmp_path / "go"
    hog = await gpu.start(
        None, "alloc", "alloc", str(GPU_MIB * MIB - LAYER), "waitfile", str(go),
        ready="alloc alloc",
    )  # fmt: skip
    refused = await _resume(live, a.assignment_id)
    assert refused.suspended and refused.suspended_memory_released
    assert refused.suspended_memory_note.startswith("restore failed"), refused
    assert str(CUDA_ERROR_OUT_OF_MEMORY) in refused.suspended_memory_note
    # Placement hears the reason with the next heartbeat (gpuloom job shows it), and that the
    # restore failed (it may move the job elsewhere).
    (report,) = await live.dispatcher.core.training_reports()
    assert report.suspended and report.memory_note == refused.suspended_memory_note
    assert report.memory_released and report.restore_failed
    go.touch()
    await hog.finish()
    resumed = await _resume(live, a.assignment_id)
    assert not resumed.suspended
    lines = await job.finish()
    assert _steps(lines) == list(range(20))
    assert lines[-1].endswith("failed=0 corrupt=0 damaged_layers=0")


@pytest.mark.parametrize("live", [ON], indirect=True)
async def test_a_process_that_dies_checkpointed_frees_its_reservation(
    live: LiveDispatcher, gpu: Gpu
) -> None:
    before = await gpu.free_bytes()
    a, job = await gpu.reserved_training(1000)
    assert (await _suspend(live, a.assignment_id)).suspended_memory_released
    os.kill(job.pid, signal.SIGKILL)
    await job.process.wait()
    for _ in range(100):
        status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        if not status.clients:
            break
        await asyncio.sleep(0.1)
    assert not status.clients  # evicted: nothing is held for it
    assert status.memory_reserved_bytes == 0
    assert await gpu.free_bytes() == before


@pytest.mark.parametrize("live", [NO_API], indirect=True)
async def test_without_the_api_the_memory_stays_resident_and_says_why(
    live: LiveDispatcher, gpu: Gpu
) -> None:
    a, job = await gpu.reserved_training(20)
    free = await gpu.free_bytes()
    suspended = await _suspend(live, a.assignment_id)
    assert suspended.suspended and not suspended.suspended_memory_released
    assert "no checkpoint API" in suspended.suspended_memory_note
    assert await gpu.free_bytes() == free  # resident, as before
    assert not (await _resume(live, a.assignment_id)).suspended
    assert (await job.finish())[-1].endswith("failed=0 corrupt=0 damaged_layers=0")


class _Recording:
    def __init__(self, library: str) -> None:
        self.calls: list[str] = []

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.calls.append("lock")

    def checkpoint(self, pid: int) -> None:
        self.calls.append("checkpoint")


def test_a_pid_that_is_not_the_reservations_process_is_refused_before_the_driver() -> None:
    made: list[_Recording] = []

    def make(library: str) -> _Recording:
        made.append(_Recording(library))
        return made[-1]

    checkpointer = Checkpointer("libcuda.so.1", driver=make)  # type: ignore[arg-type]
    for pid, owners in ((1234, (999,)), (0, (0,)), (-5, (-5,)), (42, ())):
        with pytest.raises(CheckpointRefused, match="not the reservation's process"):
            checkpointer.release(pid, owners)
    assert not made  # the driver was never even loaded
    assert checkpointer.release(999, (999,)) == MemoryState(True, "", 999)
    assert made[0].calls == ["lock", "checkpoint"]


def test_a_failed_checkpoint_unlocks_the_process_again(shim_build: Path) -> None:
    """A process the driver locked but could not checkpoint runs on (memory resident)."""

    class Failing(CheckpointDriver):
        def checkpoint(self, pid: int) -> None:
            raise CudaError("cuCheckpointProcessCheckpoint", 2)

    env = {"LD_LIBRARY_PATH": str(shim_build / "fake"), "GPULOOM_FAKE_CUDA_DIR": "/tmp"}
    sleeper = subprocess.Popen(
        [str(PROGRAM), "sleep", "30000000"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert sleeper.stdout is not None
        pid = int(sleeper.stdout.readline().split("pid=")[1])
        checkpointer = Checkpointer(FAKE, driver=Failing)
        state = checkpointer.release(pid, (pid,))
        assert not state.released and "checkpoint failed" in state.note
        assert CheckpointDriver(FAKE).state(pid) is ProcessState.RUNNING
    finally:
        sleeper.kill()
        sleeper.wait()
