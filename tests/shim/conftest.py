"""Fixtures for the native shim: build it once per session, run the C test program under it.

The dispatcher fixtures (`live`, `short_dir`) are the dispatcher tests' own: a real dispatcher in
the test process on a simulated GPU.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuloom.policies.profiling.kernels import kernel_id  # noqa: F401  (the shim's, re-exported)
from tests.dispatcher.conftest import (
    LiveDispatcher,
    live,  # noqa: F401  (re-exported fixture)
)

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "shim"
BUILD = SHIM / "build"
PROGRAM = BUILD / "cudart_like"
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_PERMITTED = 800


@pytest.fixture(scope="session")
def shim_build() -> Path:
    """`make -C shim`, once; a failed build fails every test that needs it, loudly."""
    result = subprocess.run(
        ["make", "-C", str(SHIM), f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"make -C shim failed ({result.returncode}):\n{result.stdout}\n{result.stderr}",
            pytrace=False,
        )
    return BUILD


def launch(
    kind: str,
    name: str,
    count: int,
    grid: tuple[int, int, int] = (1, 1, 1),
    block: tuple[int, int, int] = (1, 1, 1),
) -> list[str]:
    """cudart_like's `launch KIND NAME N GX GY GZ BX BY BZ` op."""
    return ["launch", kind, name, str(count), *map(str, (*grid, *block))]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    shim_trace: list[str]
    fake_trace: list[str]
    runs: list[tuple[int, str, int, int]] = field(default_factory=list)  # pid name t0 t1

    def line(self, prefix: str) -> str:
        matches = [line for line in self.stdout.splitlines() if line.startswith(prefix)]
        assert matches, f"no {prefix!r} line in:\n{self.stdout}\nstderr:\n{self.stderr}"
        return matches[-1]

    def value(self, prefix: str, key: str) -> str:
        for part in self.line(prefix).split():
            if part.startswith(f"{key}="):
                return part.split("=", 1)[1]
        raise AssertionError(f"no {key}= in {self.line(prefix)!r}")


async def assert_charged_as_ran(
    dispatcher: LiveDispatcher,
    assignments: list,
    results: list[Run],
    runs: list[tuple[int, str, int, int]],
) -> None:
    """The dispatcher charged each assignment's process what the shim measured with events:
    within 10% of the device time its kernels took on the fake GPU (`runs`, its log)."""
    channel = dispatcher.dispatcher.channel
    snapshot = await asyncio.wrap_future(channel.submit(channel.scheduler_snapshot))
    for assignment, result in zip(assignments, results, strict=True):
        pid = int(result.value("init", "pid"))
        truth_s = sum(end - start for p, _, start, end in runs if p == pid) / 1e9
        charged_s = snapshot.clients[assignment.assignment_id].total_gpu_s
        assert charged_s == pytest.approx(truth_s, rel=0.1), (charged_s, truth_s)


class Runner:
    """Runs build/cudart_like with the shim preloaded on the fake driver."""

    def __init__(self, build: Path, work: Path) -> None:
        self.build = build
        self.work = work
        self.fake_dir = work / "fake-gpu"  # one fake GPU (engine lock + runs.log) per test
        self.fake_dir.mkdir()
        self._count = 0

    def prepare(
        self, args: list[str], env: dict[str, str] | None, preload: bool, fake: str
    ) -> tuple[list[str], dict[str, str], Path, Path]:
        self._count += 1
        shim_trace = self.work / f"shim-{self._count}.trace"
        fake_trace = self.work / f"fake-{self._count}.trace"
        environment = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("GPULOOM_") and k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")
        }
        environment.update(
            LD_LIBRARY_PATH=str(self.build / fake),
            GPULOOM_FAKE_CUDA_DIR=str(self.fake_dir),
            GPULOOM_FAKE_CUDA_TRACE=str(fake_trace),
            GPULOOM_SHIM_TRACE=str(shim_trace),
        )
        if preload:
            environment["LD_PRELOAD"] = str(self.build / "libgpuloom.so")
        environment.update(env or {})
        return [str(PROGRAM), *args], environment, shim_trace, fake_trace

    def finish(self, code: int, out: str, err: str, shim_trace: Path, fake_trace: Path) -> Run:
        def lines(path: Path) -> list[str]:
            return path.read_text().splitlines() if path.exists() else []

        return Run(code, out, err, lines(shim_trace), lines(fake_trace))

    def __call__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        preload: bool = True,
        fake: str = "fake",
        timeout: float = 20,
    ) -> Run:
        command, environment, shim_trace, fake_trace = self.prepare(list(args), env, preload, fake)
        done = subprocess.run(
            command, env=environment, capture_output=True, text=True, timeout=timeout, check=False
        )
        return self.finish(done.returncode, done.stdout, done.stderr, shim_trace, fake_trace)

    async def run_async(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 20,
        preload: bool = True,
    ) -> Run:
        """The same, without blocking the event loop (the live dispatcher's gRPC runs on it)."""
        command, environment, shim_trace, fake_trace = self.prepare(
            list(args), env, preload, "fake"
        )
        process = await asyncio.create_subprocess_exec(
            *command,
            env=environment,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError(f"{command} did not finish within {timeout} s") from None
        assert process.returncode is not None
        return self.finish(process.returncode, out.decode(), err.decode(), shim_trace, fake_trace)

    def engine_runs(self) -> list[tuple[int, str, int, int]]:
        """The fake GPU's ground truth: (pid, kernel, start_ns, end_ns) of every kernel run."""
        log = self.fake_dir / "runs.log"
        runs = []
        for line in log.read_text().splitlines() if log.exists() else []:
            _, pid, name, start, end = line.split()
            runs.append((int(pid), name, int(start), int(end)))
        return runs


@pytest.fixture
def run(shim_build: Path) -> Iterator[Runner]:
    with tempfile.TemporaryDirectory(prefix="gl-shim-") as work:
        yield Runner(shim_build, Path(work))
