"""FIKIT live: real processes under the C shim on the fake driver (one fake GPU whose engine runs
one kernel at a time for every process), a real dispatcher with policy fikit and its native
arbiter, kernel tables from a real profile store.

A high-priority inference workload (requests of three kernels with host work between them)
shares the GPU with a low-priority training loop. Three ways: `exclusive` (the inference alone,
no shim), `sharing` (both, no shim: the GPU interleaves whoever comes) and `fikit` (both under
the shim, the dispatcher admitting kernels)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuloom.policies.profiling.kernels import kernel_id
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.sim.kernels import simulate
from gpuloom.sim.scenario import load_scenario
from gpuloom.v1 import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, profile_store_pb2
from gpuloom.v1 import profile_store_pb2_grpc as store_grpc
from tests.dispatcher.conftest import GIB, LiveDispatcher, start_live, stop_live
from tests.polling import eventually
from tests.profile_store.conftest import store_app, stub  # noqa: F401  (fixtures)
from tests.shim.conftest import Run, Runner

HIGH = ["k_h1_300us", "k_h2_200us", "k_h3_300us"]
LOW = "k_lo_150us"
GAP_US, PAUSE_US = 400, 2000
REQUESTS = 150
TRAIN_SYNC_EVERY = 1  # the training loop waits for each kernel
SCENARIO = "fikit_fake_driver.json"  # the same workloads, for the simulator
ONE = (1, 1, 1)


def _kernel(name: str, duration_us: float, gap_us: float) -> profile_store_pb2.KernelStats:
    return profile_store_pb2.KernelStats(
        kernel_id=kernel_id(name, ONE, ONE),
        name=name,
        grid=common_pb2.Dim3(x=1, y=1, z=1),
        block=common_pb2.Dim3(x=1, y=1, z=1),
        sample_count=100,
        mean_duration_ns=duration_us * 1e3,
        p50_duration_ns=duration_us * 1e3,
        p95_duration_ns=duration_us * 1e3,
        mean_gap_after_ns=gap_us * 1e3,
    )


async def put_kernel_profile(
    store: store_grpc.ProfileStoreStub,
    key: str,
    gpu_model: str,
    kernels: list[profile_store_pb2.KernelStats],
    measured_runs: int = 10,
) -> None:
    """Puts `kernels` in the store as task `key`'s profile on `gpu_model`."""
    await store.PutKernelProfile(
        profile_store_pb2.PutKernelProfileRequest(
            profile=profile_store_pb2.KernelProfile(
                meta=profile_store_pb2.ProfileMeta(key=key, gpu_model=gpu_model),
                measured_runs=measured_runs,
                kernels=kernels,
            )
        )
    )


async def _put_profiles(store: store_grpc.ProfileStoreStub, gpu_model: str) -> None:
    """What the profiler would have measured: the inference's gaps are its host work (the
    last kernel's gap is the pause to the next request); the training loop has none."""
    high = [_kernel(HIGH[0], 300, GAP_US), _kernel(HIGH[1], 200, GAP_US)]
    high.append(_kernel(HIGH[2], 300, PAUSE_US))
    for key, kernels in (("infer", high), ("train", [_kernel(LOW, 150, 0)])):
        await put_kernel_profile(store, key, gpu_model, kernels)


@dataclass
class Fikit:
    live: LiveDispatcher
    reserved: list[str] = field(default_factory=list)

    async def release_all(self) -> None:
        while self.reserved:
            await self.live.stub.Release(
                dispatcher_pb2.ReleaseRequest(assignment_id=self.reserved.pop())
            )

    async def token(
        self, task_key: str, priority: int, request: float = 50, limit: float = 100
    ) -> str:
        """A reservation's token: all the SMs, `request`..`limit` percent of the time."""
        assignment_id = f"{task_key}-{time.monotonic_ns()}"
        self.reserved.append(assignment_id)
        answer = await self.live.stub.Reserve(
            dispatcher_pb2.ReserveRequest(
                assignment_id=assignment_id,
                client_name=task_key,
                task_key=task_key,
                priority=common_pb2.Priority(level=priority),
                memory_cap_bytes=GIB,
                share=common_pb2.SpatioTemporalShare(
                    sm_percent=100,
                    quota=common_pb2.TimeQuota(request_percent=request, limit_percent=limit),
                ),
            )
        )
        return answer.assignment_token

    def env(self, token: str, **extra: str) -> dict[str, str]:
        return {
            "GPULOOM_DISPATCHER_SOCKET": self.live.socket_path,
            "GPULOOM_ASSIGNMENT_TOKEN": token,
            "GPULOOM_SHIM_WAIT_MS": "2000",
            **extra,
        }


@contextlib.asynccontextmanager
async def live_with_profiles(
    short_dir: Path,
    store_app: ProfileStoreApp,  # noqa: F811
    stub: store_grpc.ProfileStoreStub,  # noqa: F811
    **settings: object,
) -> AsyncIterator[Fikit]:
    """A live dispatcher with `settings`, the workloads' kernel profiles in its store."""
    dispatcher, channel = await start_live(
        short_dir, profile_store_address=f"127.0.0.1:{store_app.port}", **settings
    )
    await _put_profiles(stub, dispatcher.core.gpu.model)
    try:
        yield Fikit(
            LiveDispatcher(dispatcher, dispatcher_pb2_grpc.DispatcherStub(channel), short_dir)
        )
    finally:
        await channel.close()
        await stop_live(dispatcher)


LiveWithProfiles = Callable[..., contextlib.AbstractAsyncContextManager[Fikit]]


@pytest.fixture
def profiled(
    short_dir: Path,
    store_app: ProfileStoreApp,  # noqa: F811
    stub: store_grpc.ProfileStoreStub,  # noqa: F811
) -> LiveWithProfiles:
    """live_with_profiles on this test's directory and profile store: give it the settings."""
    return functools.partial(live_with_profiles, short_dir, store_app, stub)


@pytest.fixture
async def fikit(profiled: LiveWithProfiles) -> AsyncIterator[Fikit]:
    async with profiled(policy="fikit") as live:
        yield live


def _infer() -> list[str]:
    return ["module", ",".join([*HIGH, LOW]), "infer", str(REQUESTS), str(PAUSE_US),
            str(GAP_US), ",".join(HIGH)]  # fmt: skip


# The high-priority mean under FIKIT may be at most this many times its exclusive mean: a
# holder held back behind fill kernels (a broken gap window, a lost wake-up) shows as 2x and
# more; noise on this machine reaches 1.4x.
HOLDER_BOUND = 1.5
ATTEMPTS = 3


def _train(seconds: float) -> list[str]:
    return ["module", ",".join([*HIGH, LOW]), "loop", str(seconds), LOW, str(TRAIN_SYNC_EVERY)]


def _jct_ms(result: Run) -> tuple[float, float]:
    """The inference's mean and p99 request latency."""
    assert result.returncode == 0, result.stderr
    return float(result.value("infer", "mean_ms")), float(result.value("infer", "p99_ms"))


def _launches(result: Run) -> int:
    assert result.returncode == 0, result.stderr
    return int(result.value("loop", "launches"))


async def _with_training(run: Runner, train_env: dict[str, str] | None, infer_env, preload):
    """The inference while the training loop runs beside it (started first, outlasting it)."""
    training = asyncio.create_task(
        run.run_async(*_train(4.0), env=train_env, preload=preload, timeout=30)
    )
    await asyncio.sleep(0.3)
    inference = await run.run_async(*_infer(), env=infer_env, preload=preload, timeout=30)
    return inference, await training


async def _three_ways(fikit: Fikit, run: Runner) -> tuple[str, bool]:
    """One side-by-side measurement: (report, whether FIKIT kept its promise)."""
    exclusive = _jct_ms(await run.run_async(*_infer(), preload=False, timeout=30))
    shared, shared_training = await _with_training(run, None, None, preload=False)
    high = fikit.env(await fikit.token("infer", 0))
    low = fikit.env(await fikit.token("train", 5))
    admitted, admitted_training = await _with_training(run, low, high, preload=True)
    sharing, with_fikit = _jct_ms(shared), _jct_ms(admitted)
    report = (
        f"mean/p99 ms: exclusive {exclusive}, sharing {sharing}, fikit {with_fikit}; training "
        f"launches: sharing {_launches(shared_training)}, fikit {_launches(admitted_training)}"
    )
    print(report)
    # The ordering the simulator predicts (on the mean: a p99 of 150 requests on a shared
    # two-core machine is one unlucky wake-up), the holder never held back for long, and the
    # low-priority task still works. How close FIKIT comes to exclusive (the 5%) is a
    # measurement, read from the printed report (docs/benchmarks.md), not asserted here: on a
    # shared two-core VM, exclusive alone moves by 20% from run to run.
    kept = (
        with_fikit[0] < sharing[0]
        and with_fikit[0] <= exclusive[0] * HOLDER_BOUND
        and _launches(admitted_training) > 0.2 * _launches(shared_training)
    )
    return report, kept


async def test_fikit_keeps_the_high_priority_latency_while_the_low_one_works(
    fikit: Fikit, run: Runner
) -> None:
    # Timing on a shared machine: when a side-by-side measurement misses, another is taken;
    # the test fails only when all ATTEMPTS miss.
    report, kept = await _three_ways(fikit, run)
    for _ in range(ATTEMPTS - 1):
        if kept:
            break
        await fikit.release_all()
        report, kept = await _three_ways(fikit, run)
    assert kept, report
    stats = fikit.live.dispatcher.engine.fikit_stats()
    assert stats.grants > 0 and stats.unknown_kernels == 0, stats
    # The C shims took the one-wake-up path: the holder's launches fired the training's arms.
    assert stats.arms > 0 and stats.fired > 0 and stats.invalid_writes == 0, stats
    print(f"arbiter: {stats}")


async def test_the_holder_fires_its_arm_only_after_its_real_launch(
    fikit: Fikit, run: Runner, tmp_path: Path
) -> None:
    """A fill the holder's launch releases must reach the GPU behind the holder's kernel: the
    fire comes after the real launch returned, never between the post and the launch (the
    fill would run first and the holder would wait for it). The holder's shim and the fake
    driver trace into one file, so its lines are in the process's own order."""
    trace = tmp_path / "holder.trace"
    high = fikit.env(await fikit.token("infer", 0))
    high.update(GPULOOM_SHIM_TRACE=str(trace), GPULOOM_FAKE_CUDA_TRACE=str(trace))
    low = fikit.env(await fikit.token("train", 5))
    inference, _ = await _with_training(run, low, high, preload=True)
    _jct_ms(inference)
    lines = trace.read_text().splitlines()
    fires = [i for i, line in enumerate(lines) if line.startswith("fikit fire")]
    assert fires, "no arm was fired"
    launch_lines = ("launch cuLaunchKernel", "fake cuLaunchKernel")
    for i in fires:
        shim_launch, driver_launch = (
            max(j for j in range(i) if lines[j].startswith(prefix)) for prefix in launch_lines
        )
        assert shim_launch < driver_launch < i, lines[max(0, i - 4) : i + 1]
        fired_id = lines[i].split()[2]
        assert lines[shim_launch].split()[2] == fired_id  # the launch that fired it


UNPROFILED = "k_unprofiled_300us"  # not in the holder's profile: no gap is ever filled


def _holder_loop(seconds: float) -> list[str]:
    """The holder back to back on a kernel its profile does not know: nothing may fill."""
    return ["module", ",".join([UNPROFILED, LOW]), "loop", str(seconds), UNPROFILED, "1"]


def _ran(run: Runner, name: str, after_ns: int = 0, before_ns: int | None = None) -> int:
    return sum(
        1
        for _pid, kernel, start, _end in run.engine_runs()
        if kernel == name and start >= after_ns and (before_ns is None or start < before_ns)
    )


async def _holder_then_filler(
    fikit: Fikit,
    run: Runner,
    holder_s: float,
    filler_s: float,
    settle_s: float = 0.3,
    **filler_env: str,
) -> tuple[asyncio.Task[Run], asyncio.Task[Run]]:
    """The unprofiled holder (priority 0) looping `holder_s`, seen running; then a filler
    (priority 5) training for `filler_s`, given `settle_s` to start waiting on it."""
    holder = fikit.env(await fikit.token("infer", 0))
    filler = fikit.env(await fikit.token("train", 5), **filler_env)
    holding = run.run_async(*_holder_loop(holder_s), env=holder, timeout=40)
    holder_task = asyncio.create_task(holding)
    await eventually(lambda: _ran(run, UNPROFILED) > 20, "the unprofiled task's kernels", 5.0, 0.02)
    filler_task = asyncio.create_task(run.run_async(*_train(filler_s), env=filler, timeout=40))
    await asyncio.sleep(settle_s)
    return holder_task, filler_task


async def test_a_killed_holder_leaves_the_waiting_filler_free(fikit: Fikit, run: Runner) -> None:
    holder_task, filler_task = await _holder_then_filler(fikit, run, 30, 1.0, settle_s=0.5)
    killed_at = time.monotonic_ns()
    os.kill(_pid_of(run, UNPROFILED), signal.SIGKILL)
    await holder_task
    result = await filler_task
    # Starved while the holder ran (at most one kernel slipped in before it took the GPU) ...
    assert _ran(run, LOW, before_ns=killed_at) <= 1
    # ... and free as soon as it died.
    assert _launches(result) > 100
    assert fikit.live.dispatcher.engine.fikit_stats().unknown_kernels > 0


async def test_a_killed_waiting_filler_goes_unnoticed(fikit: Fikit, run: Runner) -> None:
    holder_task, filler_task = await _holder_then_filler(fikit, run, 1.5, 30)
    killed_at = time.monotonic_ns()
    os.kill(_pid_running(_train(30)), signal.SIGKILL)
    await filler_task
    # The arbiter forgot it (its socket closed) while the holder still runs ...
    await eventually(
        lambda: fikit.live.dispatcher.engine.fikit_stats().tasks == 1, "one arbiter task", 5.0, 0.02
    )
    result = await holder_task
    assert result.returncode == 0, result.stderr
    assert _ran(run, UNPROFILED, after_ns=killed_at) > 100  # ... and went on


async def test_a_dead_dispatcher_releases_the_waiting_filler_within_the_bound(
    fikit: Fikit, run: Runner
) -> None:
    waiting = {"GPULOOM_SHIM_WAIT_MS": "500"}
    holder_task, filler_task = await _holder_then_filler(fikit, run, 3, 1.0, **waiting)
    stopped_at = time.monotonic_ns()
    await stop_live(fikit.live.dispatcher)  # closes every connection, stops the arbiter
    result = await filler_task
    await holder_task
    assert result.returncode == 0, result.stderr  # fail-open: it ran on, unthrottled
    first_after = min(
        (
            start
            for _pid, name, start, _end in run.engine_runs()
            if name == LOW and start > stopped_at
        ),
        default=None,
    )
    assert first_after is not None
    assert (first_after - stopped_at) / 1e6 < 500 + 200  # the bound, plus scheduling slack


def _pid_running(args: list[str]) -> int:
    """The pid of the running cudart_like whose arguments end with `args` (from /proc)."""
    wanted = "\0".join(args)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").rstrip("\0")
        except OSError:
            continue
        if "cudart_like" in cmdline and cmdline.endswith(wanted):
            return int(entry.name)
    raise AssertionError(f"no running cudart_like with {args}")


def _pid_of(run: Runner, kernel: str) -> int:
    """The pid of the process that ran `kernel` on the fake GPU (its ground-truth log)."""
    for pid, name, _start, _end in run.engine_runs():
        if name == kernel:
            return pid
    raise AssertionError(f"nobody ran {kernel}")


def test_the_simulator_predicts_the_same_ordering_for_these_workloads() -> None:
    """benchmarks/fikit_fake_driver.json models the workloads of the first test; the simulator,
    driving the same decision core, predicts the ordering that test measures live."""
    scenario = load_scenario(Path(__file__).resolve().parents[2] / "benchmarks" / SCENARIO)
    mean = {
        mode: simulate(scenario, mode).to_dict()["tasks"]["infer"]["jct_mean_ms"]
        for mode in ("exclusive", "sharing", "fikit")
    }
    assert mean["exclusive"] <= mean["fikit"] < mean["sharing"], mean
