"""The fake driver's checkpoint API (cuCheckpointProcess*), driven as the dispatcher drives it:
from another process, by pid, through gpuloom.cudadrv.CheckpointDriver. One fake GPU whose
processes share its memory (GPULOOM_FAKE_CUDA_SHARED_MEMORY=1); the workload is cudart_like's
`steady` loop, which allocates once and reuses, checks a device step counter every mini-batch
and every byte of its buffers at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuloom.cudadrv import (
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TIMEOUT,
    CheckpointDriver,
    CheckpointUnsupported,
    CudaError,
    ProcessState,
)
from tests.shim.conftest import PROGRAM, Runner
from tests.shim.shared_gpu import (
    GPU_MIB,
    LAYER,
    MIB,
    DriverProcesses,
    finish,
    meminfo_free,
    shared_gpu_env,
    steady_ops,
)


@pytest.fixture
def driver(shim_build: Path) -> CheckpointDriver:
    return CheckpointDriver(str(shim_build / "fake" / "libcuda.so.1"))


class Gpu(DriverProcesses):
    """cudart_like processes on one fake GPU (no shim: the driver alone)."""

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        environment = shared_gpu_env(self.run, shim=False)
        environment.update(extra or {})
        return environment

    def free_bytes(self) -> int:
        done = subprocess.run(
            [str(PROGRAM), "meminfo"], env=self.env(), capture_output=True, text=True, check=True
        )
        return meminfo_free(done.stdout.splitlines())

    def once(self, *ops: str) -> list[str]:
        done = subprocess.run(
            [str(PROGRAM), *ops], env=self.env(), capture_output=True, text=True, timeout=30
        )
        return done.stdout.splitlines()

    def start(
        self, *ops: str, ready: str, extra: dict[str, str] | None = None
    ) -> tuple[int, subprocess.Popen[str]]:
        return self.launch(self.env(extra), ops, ready)

    def training(
        self, steps: int, layers: int = 4, extra: dict[str, str] | None = None
    ) -> tuple[int, subprocess.Popen[str]]:
        return self.start(*steady_ops(steps, layers), ready="steady allocated", extra=extra)


@pytest.fixture
def gpu(run: Runner) -> Iterator[Gpu]:
    fake = Gpu(run)
    yield fake
    fake.close()


def test_suspend_releases_the_gpus_memory_and_resume_brings_every_byte_back(
    driver: CheckpointDriver, gpu: Gpu
) -> None:
    before = gpu.free_bytes()
    pid, job = gpu.training(steps=30)
    held = 4 * LAYER + 8
    assert before - gpu.free_bytes() >= held
    # A second job whose memory does not fit beside it is refused...
    second = str(GPU_MIB * MIB - 2 * LAYER)
    assert f"alloc alloc {second} rc={CUDA_ERROR_OUT_OF_MEMORY}" in gpu.once(
        "alloc", "alloc", second
    )
    assert driver.state(pid) is ProcessState.RUNNING
    driver.lock(pid, 5000)
    assert driver.state(pid) is ProcessState.LOCKED
    driver.checkpoint(pid)
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    # The GPU's free memory is back to within 1% of what it was before the job started...
    assert abs(gpu.free_bytes() - before) <= before // 100
    # ...and the second job runs while it is suspended.
    assert f"alloc alloc {second} rc=0" in gpu.once("alloc", "alloc", second)
    driver.restore(pid)
    assert driver.state(pid) is ProcessState.LOCKED
    assert before - gpu.free_bytes() >= held
    driver.unlock(pid)
    assert driver.state(pid) is ProcessState.RUNNING
    lines = finish(job)
    steps = [int(x.split()[2]) for x in lines if x.startswith("steady step")]
    assert steps == list(range(30))  # every step exactly once, in order
    assert lines[-1] == "steady minibatches=30 done=30 failed=0 corrupt=0 damaged_layers=0"
    assert job.returncode == 0


def test_requests_out_of_order_are_refused_and_change_nothing(
    driver: CheckpointDriver, gpu: Gpu
) -> None:
    pid, job = gpu.training(steps=20)
    for call in (driver.checkpoint, driver.restore, driver.unlock):
        with pytest.raises(CudaError) as refused:
            call(pid)
        assert refused.value.code == CUDA_ERROR_ILLEGAL_STATE
    assert driver.state(pid) is ProcessState.RUNNING
    driver.lock(pid)
    with pytest.raises(CudaError) as refused:
        driver.lock(pid)
    assert refused.value.code == CUDA_ERROR_ILLEGAL_STATE
    driver.checkpoint(pid)
    with pytest.raises(CudaError):
        driver.unlock(pid)  # a checkpointed process must be restored first
    driver.restore(pid)
    driver.unlock(pid)
    assert finish(job)[-1].endswith("corrupt=0 damaged_layers=0")


def test_a_restore_without_room_fails_and_leaves_it_checkpointed(
    driver: CheckpointDriver, gpu: Gpu, tmp_path: Path
) -> None:
    pid, job = gpu.training(steps=10)
    driver.lock(pid)
    driver.checkpoint(pid)
    go = tmp_path / "go"
    _, hog = gpu.start(
        "alloc", "alloc", str(GPU_MIB * MIB - LAYER), "waitfile", str(go), ready="alloc alloc"
    )
    with pytest.raises(CudaError) as refused:
        driver.restore(pid)
    assert refused.value.code == CUDA_ERROR_OUT_OF_MEMORY
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    go.touch()
    hog.wait(timeout=30)
    driver.restore(pid)  # room again: it restores, every byte intact
    driver.unlock(pid)
    assert finish(job)[-1] == "steady minibatches=10 done=10 failed=0 corrupt=0 damaged_layers=0"


def test_a_restore_that_cannot_put_the_bytes_back_leaves_the_process_failed(
    driver: CheckpointDriver, gpu: Gpu
) -> None:
    pid, _ = gpu.training(steps=10, extra={"GPULOOM_FAKE_CUDA_CKPT_FAIL": "restore"})
    driver.lock(pid)
    driver.checkpoint(pid)
    with pytest.raises(CudaError):
        driver.restore(pid)
    assert driver.state(pid) is ProcessState.FAILED


def test_a_process_that_dies_checkpointed_holds_nothing(driver: CheckpointDriver, gpu: Gpu) -> None:
    before = gpu.free_bytes()
    pid, job = gpu.training(steps=1000)
    driver.lock(pid)
    os.kill(pid, signal.SIGKILL)
    job.wait(timeout=30)
    assert gpu.free_bytes() == before
    for call in (driver.checkpoint, driver.state):
        with pytest.raises(CudaError) as refused:
            call(pid)
        assert refused.value.code == CUDA_ERROR_INVALID_VALUE


def test_a_pid_that_is_not_a_cuda_process_is_refused(driver: CheckpointDriver) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (sleeper.pid, os.getpid(), 0, -1):
            with pytest.raises(CudaError) as refused:
                driver.lock(pid)
            assert refused.value.code == CUDA_ERROR_INVALID_VALUE
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_that_times_out_leaves_the_process_running(
    driver: CheckpointDriver, gpu: Gpu
) -> None:
    pid, job = gpu.start(
        "module", "k_long_3000000us", "launch", "kernel", "k_long_3000000us", "1",
        "1", "1", "1", "1", "1", "1", "ssync", ready="launch",
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(CudaError) as refused:
        driver.lock(pid, 200)  # the kernel runs for 3 s
    assert refused.value.code == CUDA_ERROR_TIMEOUT
    assert time.monotonic() - started < 2.5
    assert driver.state(pid) is ProcessState.RUNNING
    assert "ssync rc=0" in finish(job)


def test_a_driver_without_the_api_says_so(shim_build: Path) -> None:
    with pytest.raises(CheckpointUnsupported, match="no checkpoint API"):
        CheckpointDriver(str(shim_build / "fake_min" / "libcuda.so.1"))


def test_every_kind_of_allocation_is_released_and_restored(
    driver: CheckpointDriver, gpu: Gpu, tmp_path: Path
) -> None:
    """Virtual memory (cuMemCreate + cuMemMap), arrays and pool allocations count on the GPU
    like pointers: all given back at the checkpoint, all taken again at the restore, and freed
    as usual afterwards."""
    before = gpu.free_bytes()
    go = tmp_path / "go"
    ops = ["stream", "alloc", "vmm", str(LAYER), "alloc", "array", str(LAYER)]
    ops += ["alloc", "pool", str(LAYER), "alloc", "alloc", str(LAYER), "fill", "7"]
    pid, job = gpu.start(*ops, "waitfile", str(go), "peek", "freeall", ready="fill")
    assert before - gpu.free_bytes() == 4 * LAYER
    driver.lock(pid)
    driver.checkpoint(pid)
    assert gpu.free_bytes() == before
    driver.restore(pid)
    assert before - gpu.free_bytes() == 4 * LAYER
    driver.unlock(pid)
    go.touch()
    lines = finish(job)
    assert "peek rc=0 first=7 uniform=1" in lines
    assert "freeall rc=0" in lines
    assert gpu.free_bytes() == before
