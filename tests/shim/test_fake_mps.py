"""The fake driver's GPU with and without MPS (shim/fake/fake_cuda.c, "the MPS engine").

With GPULOOM_FAKE_CUDA_MPS=1 the kernels of different processes run at once under the
simulator's model (gpuloom/sim/device.py): the fake's logged ends are checked against that
model fed the same starts, so the two cannot drift apart. Without it they take turns, as
before; a kernel alone takes its duration either way."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import time

import pytest

from gpuloom.sim.device import Device, GpuConfig
from tests.dispatcher.conftest import LiveDispatcher

from .conftest import Run, Runner, assert_charged_as_ran, launch

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


# ---- end to end: what the dispatcher admits together co-runs ----

PARTITIONS = {
    "window_ms": 500.0,
    "policy_args": "tokens.lease_min_s=0.02,tokens.lease_initial_s=0.025,tokens.lease_max_s=0.05",
}


@pytest.mark.parametrize("live", [PARTITIONS], indirect=True)
@pytest.mark.parametrize("mps", [True, False], ids=["mps", "turns"])
async def test_two_partitions_leased_together_co_run_only_on_an_mps_gpu(
    live: LiveDispatcher, run: Runner, mps: bool
) -> None:
    """Two 50% SM partitions (policy spatiotemporal: their leases may be held together), each a
    loop of kernels that use half the SMs, through the shim. On the MPS GPU their kernels run
    at once (slowed 1.25x by each other, compute beside memory), and the dispatcher charges
    each process the device time its kernels took; without MPS they take turns (and each one's
    measured time also counts its waits for the other's kernels: docs/harvest.md, "Not
    built")."""
    assignments = [await live.reserve(sm=50, request=50, limit=100) for _ in range(2)]
    kernels = (("k_conv", 2000, 50, "compute"), ("k_copy", 2000, 50, "memory"))
    results = await asyncio.gather(
        *(
            run.run_async(
                "module",
                _module(kernel),
                "loop",
                "2",
                kernel[0],
                "1",
                env={
                    "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
                    "GPULOOM_ASSIGNMENT_TOKEN": assignment.assignment_token,
                    "GPULOOM_SHIM_WAIT_MS": "3000",
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                    "GPULOOM_FAKE_CUDA_MPS": "1" if mps else "0",
                },
                timeout=60,
            )
            for assignment, kernel in zip(assignments, kernels, strict=True)
        )
    )
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "UNTHROTTLED" not in result.stderr, result.stderr
    runs = run.engine_runs()
    assert len({pid for pid, *_ in runs}) == 2
    busy = sum(end - start for *_, start, end in runs)
    if mps:
        assert _overlap_ns(runs) > 0.25 * busy, (_overlap_ns(runs), busy)
        longest = max(end - start for *_, start, end in runs)
        assert 2_400_000 <= longest <= 2_500_000 + 1_000  # 2 ms at 1 / 1.25 of its speed
    else:
        assert _overlap_ns(runs) == 0
        return
    await assert_charged_as_ran(live, assignments, results, runs)


def test_a_killed_process_kernel_stops_slowing_the_others(run: Runner) -> None:
    """A process killed mid-kernel leaves its kernel in the shared engine state; the next
    process drops it (its pid is gone), as a real driver frees a dead context's work."""
    command, environment, _, _ = run.prepare(
        list(_task(("k_long", 5_000_000, 100, "unknown"), 1)), MPS, False, "fake"
    )
    victim = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline().startswith("init rc=0")
        time.sleep(0.3)  # its 5 s kernel is running
    finally:
        victim.kill()
        victim.wait()
    result = run(*_task(("k_after", 50_000, 100, "unknown"), 1), env=MPS, preload=False)
    assert result.returncode == 0, result.stderr
    (after,) = [r for r in run.engine_runs() if r[1] == "k_after"]
    assert after[3] - after[2] == 50_000_000, after  # alone: not slowed by the dead kernel
