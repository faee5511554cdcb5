"""The fake driver's GPU with and without MPS (shim/fake/fake_cuda.c, "the MPS engine").

With GPULOOM_FAKE_CUDA_MPS=1 the kernels of different processes run at once under the
simulator's model (gpuloom/sim/device.py): the fake's logged ends are checked against that
model fed the same starts, so the two cannot drift apart. Without it they take turns, as
before; a kernel alone takes its duration either way."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gpuloom.sim.device import Device, GpuConfig

from .conftest import Run, Runner, launch

MPS = {"GPULOOM_FAKE_CUDA_MPS": "1"}
# Two tasks that fit the GPU together (50% + 40% of the SMs) and are bound by different units.
COMPUTE = ("k_conv", 200_000, 50, "compute")
MEMORY = ("k_copy", 150_000, 40, "memory")


def _module(*kernels: tuple[str, int, int, str]) -> str:
    return ",".join(f"{name}:{us}:{need}:{bound}" for name, us, need, bound in kernels)


def _task(kernel: tuple[str, int, int, str], count: int) -> tuple[str, ...]:
    return ("module", _module(kernel), *launch("kernel", kernel[0], count), "sync")


async def _together(run: Runner, env: dict[str, str], *tasks: tuple[str, ...]) -> list[Run]:
    results = await asyncio.gather(
        *(run.run_async(*task, env=env, preload=False, timeout=30) for task in tasks)
    )
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    return list(results)


def _overlap_ns(runs: list[tuple[int, str, int, int]]) -> int:
    """Time during which kernels of two different processes ran at once."""
    return sum(
        max(0, min(a[3], b[3]) - max(a[2], b[2]))
        for a, b in itertools.combinations(runs, 2)
        if a[0] != b[0]
    )


def _simulated_ends(
    runs: list[tuple[int, str, int, int]], kernels: dict[str, tuple[int, int, str]]
) -> dict[tuple[int, int], int]:
    """The simulator's device (MPS, 100 SMs: one per percent) fed the fake's own starts: when
    each kernel (pid, start) would end."""
    pids = sorted({pid for pid, *_ in runs})
    device = Device(GpuConfig(sms=100, mps=True), contexts=len(pids), concurrent=True)
    ends: dict[tuple[int, int], int] = {}
    for pid, name, start, _ in sorted(runs, key=lambda r: r[2]):
        for done in device.advance(start):
            ends[done.tag] = done.end
        us, need, bound = kernels[name]
        device.submit(start, pids.index(pid), (pid, start), us * 1000, need, bound)
    while (t := device.next_time()) is not None:
        for done in device.advance(t):
            ends[done.tag] = done.end
    return ends


async def test_under_mps_two_processes_kernels_co_run_as_the_simulator_models(
    run: Runner,
) -> None:
    await _together(run, MPS, _task(COMPUTE, 2), _task(MEMORY, 3))
    runs = run.engine_runs()
    assert len(runs) == 5 and len({pid for pid, *_ in runs}) == 2, runs
    # Launched together, the 200 ms and 150 ms kernels overlap for most of their time.
    assert _overlap_ns(runs) > 100_000_000, runs
    kernels = {name: (us, need, bound) for name, us, need, bound in (COMPUTE, MEMORY)}
    expected = _simulated_ends(runs, kernels)
    for pid, name, start, end in runs:
        # The same model, to the rounding of a nanosecond per event.
        assert abs(end - expected[(pid, start)]) <= 1_000, (name, end, expected[(pid, start)])
        # Beside each other both run slower than alone (1.2x and 1.25x here), never faster.
        assert end - start >= kernels[name][0] * 1000
    slowed = [end - start for _, name, start, end in runs if name == "k_conv"]
    assert max(slowed) > 1.1 * COMPUTE[1] * 1000, runs


async def test_kernels_that_ask_for_every_sm_co_run_no_faster_than_in_turns(
    run: Runner,
) -> None:
    """Two full-GPU compute kernels share the SMs and clash (F same class 2.5): each runs at
    1 / (2 * 1.75) of its speed, so together they take longer than one after the other."""
    full = ("k_full", 100_000, 100, "compute")
    await _together(run, MPS, _task(full, 1), _task(full, 1))
    (a, b) = sorted(run.engine_runs(), key=lambda r: r[2])
    assert a[0] != b[0] and _overlap_ns([a, b]) > 0
    expected = _simulated_ends([a, b], {"k_full": full[1:]})
    assert abs(a[3] - expected[(a[0], a[2])]) <= 1_000
    assert abs(b[3] - expected[(b[0], b[2])]) <= 1_000
    assert b[3] - a[2] >= 2 * full[1] * 1000


async def test_without_mps_the_processes_take_turns(run: Runner) -> None:
    await _together(run, {}, _task(COMPUTE, 2), _task(MEMORY, 3))
    runs = run.engine_runs()
    assert len(runs) == 5 and len({pid for pid, *_ in runs}) == 2
    assert _overlap_ns(runs) == 0, runs


@pytest.mark.parametrize("env", [{}, MPS], ids=["turns", "mps"])
def test_a_kernel_alone_takes_its_duration(run: Runner, env: dict[str, str]) -> None:
    """Solo timing as before the MPS engine: its duration, need/share times longer in a
    partition below its need (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)."""
    for share, expected_us in ((100, 40_000), (50, 80_000)):
        result = run(
            *_task(("k_solo", 40_000, 100, "memory"), 2),
            env={**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)},
            preload=False,
        )
        assert result.returncode == 0, result.stderr
        pid = int(result.value("init", "pid"))
        durations = [end - start for p, _, start, end in run.engine_runs() if p == pid]
        assert len(durations) == 2
        for duration in durations:
            if env:  # the model's end, not the thread's wake-up: exact
                assert duration == expected_us * 1000, durations
            else:  # a loaded machine wakes the sleeping engine late, never early
                assert expected_us * 1000 <= duration < expected_us * 1250 + 5_000_000


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"GPULOOM_FAKE_CUDA_MPS": "yes"}, "GPULOOM_FAKE_CUDA_MPS=yes"),
        ({"GPULOOM_FAKE_CUDA_INTERFERENCE": "2.5,0.9,2"}, "GPULOOM_FAKE_CUDA_INTERFERENCE="),
        ({"GPULOOM_FAKE_CUDA_INTERFERENCE": "2.5,1.5"}, "GPULOOM_FAKE_CUDA_INTERFERENCE="),
    ],
)
def test_bad_gpu_settings_fail_cuinit_naming_the_setting(
    run: Runner, env: dict[str, str], says: str
) -> None:
    result = run("module", "k_x_10us", "sync", env=env, preload=False)
    assert result.returncode == 1 and "init rc=1 " in result.stdout, result.stdout
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert run.engine_runs() == []


def test_an_unknown_bound_class_is_refused(run: Runner) -> None:
    result = run("module", "k_x:100:50:membound", env=MPS, preload=False)
    assert "module rc=200" in result.stdout, result.stdout  # CUDA_ERROR_INVALID_IMAGE
    assert "bound class membound" in result.stderr


async def test_interference_factors_are_settable(run: Runner) -> None:
    """GPULOOM_FAKE_CUDA_INTERFERENCE=1,1,1: co-runners that fit the GPU do not slow each
    other (the factors are the model's, not constants of the engine)."""
    env = {**MPS, "GPULOOM_FAKE_CUDA_INTERFERENCE": "1,1,1"}
    await _together(run, env, _task(COMPUTE, 1), _task(MEMORY, 1))
    runs = run.engine_runs()
    assert _overlap_ns(runs) > 0
    for _, name, start, end in runs:
        us = COMPUTE[1] if name == "k_conv" else MEMORY[1]
        assert end - start == us * 1000, runs
