"""One fake GPU whose cudart_like processes share its memory (GPULOOM_FAKE_CUDA_SHARED_MEMORY),
as the checkpoint and memory-releasing suspension tests drive it: its environment, the
`steady` training loop (allocates once and reuses, checks every byte at the end) and the free
memory that `meminfo` reports."""

from __future__ import annotations

import subprocess

from tests.shim.conftest import PROGRAM, Runner

MIB = 1 << 20
GPU_MIB = 1024
LAYER = 64 * MIB
KERNELS = "k_fwd_200us,k_bwd_300us,k_opt_100us"


def shared_gpu_env(run: Runner, shim: bool) -> dict[str, str]:
    """The environment of a process on the shared GPU (`shim`: under the shim)."""
    _, environment, _, _ = run.prepare([], None, shim, "fake")
    environment.update(GPULOOM_FAKE_CUDA_SHARED_MEMORY="1", GPULOOM_FAKE_CUDA_MEM_MIB=str(GPU_MIB))
    return environment


def steady_ops(steps: int, layers: int = 4) -> tuple[str, ...]:
    """cudart_like's arguments for `steps` mini-batches of `layers` layers, 20 ms apart."""
    return ("module", KERNELS, "steady", str(steps), "20000", str(layers), str(LAYER), KERNELS)


def meminfo_free(lines: list[str]) -> int:
    """The free bytes in the output of cudart_like's `meminfo`."""
    line = next(x for x in lines if x.startswith("meminfo"))
    return int(line.split("free=")[1].split()[0])


class DriverProcesses:
    """cudart_like processes on the fake driver (no shim: the driver alone), killed at close."""

    def __init__(self, run: Runner) -> None:
        self.run = run
        self.started: list[subprocess.Popen[str]] = []

    def launch(
        self, environment: dict[str, str], ops: tuple[str, ...], ready: str
    ) -> tuple[int, subprocess.Popen[str]]:
        """Start `ops` and read its output up to the line starting with `ready`: its pid and
        the process."""
        process = subprocess.Popen(
            [str(PROGRAM), *ops], env=environment, stdout=subprocess.PIPE, text=True
        )
        self.started.append(process)
        assert process.stdout is not None
        pid = 0
        for line in process.stdout:
            if line.startswith("init"):
                pid = int(line.split("pid=")[1])
            if line.startswith(ready):
                return pid, process
        raise AssertionError(f"{ops} ended before {ready!r}")

    def close(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.wait()


def finish(process: subprocess.Popen[str]) -> list[str]:
    """The rest of a started process's output, once it ends."""
    out, _ = process.communicate(timeout=60)
    return out.splitlines()
