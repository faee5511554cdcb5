"""A restore onto another GPU of the same chip type (the GPU pairs of CUDA 13.0's restore
args), on the fake driver with several GPUs of one node (GPULOOM_FAKE_CUDA_GPUS), driven as a
controller drives it: from another process, by pid, through gpuloom.cudadrv.CheckpointDriver.
The workload is cudart_like's `steady` loop (allocates once and reuses, checks a device step
counter every mini-batch and every byte of its buffers at the end)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuloom.cudadrv import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    CheckpointDriver,
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

CUDA_ERROR_INVALID_DEVICE = 101
SOURCE = "GPU-aaaa0000-0000-0000-0000-000000000001"
TARGET = "GPU-aaaa0000-0000-0000-0000-000000000002"
OTHER_CHIP = "GPU-bbbb0000-0000-0000-0000-000000000003"
UNKNOWN = "GPU-cccc0000-0000-0000-0000-000000000004"
GPUS = f"{SOURCE}=H100:{GPU_MIB},{TARGET}=H100:{GPU_MIB},{OTHER_CHIP}=A100:{GPU_MIB}"
HELD = 4 * LAYER + 8  # the steady loop's four layers and its step counter


@pytest.fixture
def driver(shim_build: Path) -> CheckpointDriver:
    return CheckpointDriver(str(shim_build / "fake" / "libcuda.so.1"))


class Node(DriverProcesses):
    """cudart_like processes on the fake GPUs of one node (no shim: the driver alone)."""

    def env(self, gpu: str, gpus: str = GPUS) -> dict[str, str]:
        environment = shared_gpu_env(self.run, shim=False)
        environment.update(GPULOOM_FAKE_CUDA_GPUS=gpus, GPULOOM_FAKE_CUDA_GPU=gpu)
        return environment

    def free_bytes(self, gpu: str) -> int:
        done = subprocess.run(
            [str(PROGRAM), "meminfo"], env=self.env(gpu), capture_output=True, text=True, check=True
        )
        return meminfo_free(done.stdout.splitlines())

    def start(self, gpu: str, *ops: str, ready: str) -> tuple[int, subprocess.Popen[str]]:
        return self.launch(self.env(gpu), ops, ready)

    def training(self, gpu: str, steps: int) -> tuple[int, subprocess.Popen[str]]:
        return self.start(gpu, *steady_ops(steps), ready="steady allocated")


@pytest.fixture
def node(run: Runner) -> Iterator[Node]:
    fake = Node(run)
    yield fake
    fake.close()


def test_a_restore_with_a_gpu_pair_moves_the_memory_onto_the_target_gpu(
    driver: CheckpointDriver, node: Node
) -> None:
    source_before, target_before = node.free_bytes(SOURCE), node.free_bytes(TARGET)
    pid, job = node.training(SOURCE, steps=30)
    assert source_before - node.free_bytes(SOURCE) >= HELD
    assert node.free_bytes(TARGET) == target_before
    driver.lock(pid, 5000)
    driver.checkpoint(pid)
    assert node.free_bytes(SOURCE) == source_before
    driver.restore(pid, [(SOURCE, TARGET)])
    assert driver.state(pid) is ProcessState.LOCKED
    # The source GPU's memory stays given back; the target's is taken.
    assert node.free_bytes(SOURCE) == source_before
    assert target_before - node.free_bytes(TARGET) >= HELD
    driver.unlock(pid)
    lines = finish(job)
    steps = [int(x.split()[2]) for x in lines if x.startswith("steady step")]
    assert steps == list(range(30))  # every step exactly once, in order
    assert lines[-1] == "steady minibatches=30 done=30 failed=0 corrupt=0 damaged_layers=0"
    assert job.returncode == 0
    assert node.free_bytes(TARGET) == target_before  # its frees counted on the target


def test_a_restore_onto_another_chip_type_an_unknown_gpu_or_no_room_is_refused(
    driver: CheckpointDriver, node: Node, tmp_path: Path
) -> None:
    source_before, target_before = node.free_bytes(SOURCE), node.free_bytes(TARGET)
    pid, job = node.training(SOURCE, steps=10)
    driver.lock(pid)
    driver.checkpoint(pid)
    go = tmp_path / "go"
    _, hog = node.start(
        TARGET, "alloc", "alloc", str(GPU_MIB * MIB - LAYER), "waitfile", str(go),
        ready="alloc alloc",
    )  # fmt: skip
    hogged = node.free_bytes(TARGET)
    refusals = [
        ([(SOURCE, OTHER_CHIP)], CUDA_ERROR_INVALID_DEVICE),
        ([(SOURCE, UNKNOWN)], CUDA_ERROR_INVALID_DEVICE),
        ([(TARGET, SOURCE)], CUDA_ERROR_INVALID_VALUE),  # not a GPU the process used
        ([(SOURCE, TARGET)], CUDA_ERROR_OUT_OF_MEMORY),
    ]
    for pairs, code in refusals:
        with pytest.raises(CudaError) as refused:
            driver.restore(pid, pairs)
        assert refused.value.code == code, pairs
        assert driver.state(pid) is ProcessState.CHECKPOINTED
        assert node.free_bytes(SOURCE) == source_before
        assert node.free_bytes(TARGET) == hogged
    with pytest.raises(ValueError, match="not a GPU UUID"):
        driver.restore(pid, [(SOURCE, "GPU-12")])
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    go.touch()
    hog.wait(timeout=30)
    driver.restore(pid, [(SOURCE, TARGET)])  # room again: restored there, every byte intact
    assert target_before - node.free_bytes(TARGET) >= HELD
    driver.unlock(pid)
    assert finish(job)[-1] == "steady minibatches=10 done=10 failed=0 corrupt=0 damaged_layers=0"


def test_a_restore_without_pairs_stays_on_its_gpu(driver: CheckpointDriver, node: Node) -> None:
    target_before = node.free_bytes(TARGET)
    source_before = node.free_bytes(SOURCE)
    pid, job = node.training(SOURCE, steps=5)
    driver.lock(pid)
    driver.checkpoint(pid)
    driver.restore(pid)
    assert source_before - node.free_bytes(SOURCE) >= HELD
    assert node.free_bytes(TARGET) == target_before
    driver.unlock(pid)
    assert finish(job)[-1].endswith("corrupt=0 damaged_layers=0")


@pytest.mark.parametrize(
    ("gpus", "gpu", "code", "says"),
    [
        ("GPU-12=H100:1024", SOURCE, CUDA_ERROR_INVALID_VALUE, "bad entry GPU-12=H100:1024"),
        (f"{SOURCE}=H100", SOURCE, CUDA_ERROR_INVALID_VALUE, "bad entry"),
        (f"{SOURCE}=H100:0", SOURCE, CUDA_ERROR_INVALID_VALUE, "bad entry"),
        (f"{SOURCE}=H100:1,{SOURCE}=H100:1", SOURCE, CUDA_ERROR_INVALID_VALUE, "each once"),
        (GPUS, UNKNOWN, CUDA_ERROR_INVALID_DEVICE, f"GPULOOM_FAKE_CUDA_GPU={UNKNOWN} is not"),
    ],
)
def test_bad_gpu_settings_fail_cuinit_and_say_why(
    node: Node, gpus: str, gpu: str, code: int, says: str
) -> None:
    done = subprocess.run(
        [str(PROGRAM), "meminfo"], env=node.env(gpu, gpus), capture_output=True, text=True
    )
    assert f"init rc={code} " in done.stdout
    assert says in done.stderr


def test_each_gpu_answers_its_own_memory(node: Node, tmp_path: Path) -> None:
    go = tmp_path / "go"
    _, job = node.start(
        SOURCE, "alloc", "alloc", str(LAYER), "waitfile", str(go), ready="alloc alloc"
    )
    assert GPU_MIB * MIB - node.free_bytes(SOURCE) == LAYER
    assert node.free_bytes(TARGET) == GPU_MIB * MIB
    assert node.free_bytes(OTHER_CHIP) == GPU_MIB * MIB
    go.touch()
    job.wait(timeout=30)
    assert node.free_bytes(SOURCE) == GPU_MIB * MIB
