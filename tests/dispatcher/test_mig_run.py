"""MIG execution through the dispatcher (FAR paper, Algorithm 3), on a simulated A100: the plan's
instances are created and destroyed through the backend and every task's command runs in its
instance, with real start and end times reported beside the planned ones."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from gpuloom.services.dispatcher.app import GpuDispatcher, start_gpu_dispatcher
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc
from tests.dispatcher.conftest import dispatcher_settings

# The task: look at which instance it was given, sleep as long as the task takes on that size,
# and write down the instance.
TASK = (
    "import json, os, sys, time\n"
    "device = os.environ['CUDA_VISIBLE_DEVICES']\n"
    "size = device.rsplit('-', 1)[1].rstrip('g')\n"
    "time.sleep(json.loads(sys.argv[1])[size])\n"
    "open(sys.argv[2], 'w').write(device)\n"
)
SIZES = (1, 2, 3, 4, 7)


@pytest.fixture
async def mig_stub(
    short_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[dispatcher_pb2_grpc.DispatcherStub, SimulatedBackend]]:
    backend = SimulatedBackend(
        "A100-80GB", mig_enabled=getattr(request, "param", True), time_scale=0
    )
    dispatcher: GpuDispatcher = await start_gpu_dispatcher(
        dispatcher_settings(), backend, backend.gpu(0), "127.0.0.1", 0, short_dir
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{dispatcher.port}")
    try:
        yield dispatcher_pb2_grpc.DispatcherStub(channel), backend
    finally:
        await channel.close()
        await dispatcher.server.stop(0)
        dispatcher.channel.stop()


def task(name: str, times: dict[int, float], out: Path) -> dispatcher_pb2.MigTaskSpec:
    # -S: no site packages to import, so a task starts in milliseconds and runs as planned.
    argv = [
        sys.executable, "-S", "-c", TASK, json.dumps({str(k): v for k, v in times.items()}),
        str(out),
    ]  # fmt: skip
    return dispatcher_pb2.MigTaskSpec(name=name, seconds_by_size=times, argv=argv)


# A task's process start (python -S) is not in the plan: up to 0.15 s each on a loaded 2-vCPU
# machine, and it adds up along the chain of tasks run one after another on the same slices.
STARTUP_S, SLACK_S = 0.2, 0.1


def _chain_depths(runs: Sequence[dispatcher_pb2.MigTaskRun]) -> dict[str, int]:
    """How many tasks ran before each one, one after another, on slices it shares with them."""

    def overlap(a: dispatcher_pb2.MigTaskRun, b: dispatcher_pb2.MigTaskRun) -> bool:
        return a.first_slice < b.first_slice + b.size and b.first_slice < a.first_slice + a.size

    depth: dict[str, int] = {}
    for run in sorted(runs, key=lambda r: r.start_s):
        before = [o for o in runs if o.task in depth and overlap(o, run) and o.end_s <= run.start_s]
        depth[run.task] = 1 + max((depth[o.task] for o in before), default=-1)
    return depth


def batch(tmp: Path) -> list[dispatcher_pb2.MigTaskSpec]:
    # One task that scales (FAR gives it a big instance first), several that do not.
    scaling = {1: 1.4, 2: 0.8, 3: 0.6, 4: 0.5, 7: 0.3}
    flat = [0.25, 0.3, 0.35, 0.4, 0.45, 0.5]
    specs = [task("scaling", scaling, tmp / "scaling.out")]
    specs += [
        task(f"flat{i}", dict.fromkeys(SIZES, t), tmp / f"flat{i}.out") for i, t in enumerate(flat)
    ]
    return specs


async def test_a_far_plan_runs_in_its_instances_close_to_the_plan(
    mig_stub: tuple[dispatcher_pb2_grpc.DispatcherStub, SimulatedBackend], tmp_path: Path
) -> None:
    stub, backend = mig_stub
    request = dispatcher_pb2.RunMigBatchRequest(
        tasks=batch(tmp_path),
        # Instant reconfiguration on this simulated GPU: plan with the same zero times.
        create_seconds=dict.fromkeys(SIZES, 0.0),
        destroy_seconds=dict.fromkeys(SIZES, 0.0),
    )
    updates = [update async for update in stub.RunMigBatch(request)]
    kinds = [u.WhichOneof("update") for u in updates]
    assert kinds[0] == "planned" and kinds[-1] == "report"
    assert kinds.count("task_ended") == 7
    planned, report = updates[0].planned, updates[-1].report
    assert planned.policy == "far" and planned.tasks == 7

    depth = _chain_depths(report.tasks)
    for run in report.tasks:
        assert run.exit_code == 0
        # The task really ran in the instance it was reported in, of the planned size.
        assert (tmp_path / f"{run.task}.out").read_text() == run.instance_uuid
        assert run.instance_uuid.endswith(f"-s{run.first_slice}-{run.size}g")
        # Never ahead of the plan; behind it by at most a process start per task in its chain.
        start_lag, end_lag = run.start_s - run.planned_start_s, run.end_s - run.planned_end_s
        assert -0.05 <= start_lag <= SLACK_S + STARTUP_S * depth[run.task], (run, start_lag)
        assert -0.05 <= end_lag <= SLACK_S + STARTUP_S * (depth[run.task] + 1), (run, end_lag)
    makespan_lag = report.makespan_s - planned.planned_makespan_s
    assert -0.05 <= makespan_lag <= SLACK_S + STARTUP_S * (max(depth.values()) + 1)
    creates = [r for r in report.reconfigurations if r.action == "create"]
    destroys = [r for r in report.reconfigurations if r.action == "destroy"]
    assert len(creates) == len(destroys) == len({(t.size, t.first_slice) for t in report.tasks})
    assert backend.mig_instances(0) == []  # everything created was destroyed


async def test_a_second_batch_waits_for_the_gpu(
    mig_stub: tuple[dispatcher_pb2_grpc.DispatcherStub, SimulatedBackend], tmp_path: Path
) -> None:
    stub, _ = mig_stub
    first = stub.RunMigBatch(dispatcher_pb2.RunMigBatchRequest(tasks=batch(tmp_path)))
    assert (await first.read()).WhichOneof("update") == "planned"
    second = stub.RunMigBatch(dispatcher_pb2.RunMigBatchRequest(tasks=batch(tmp_path)))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await second.read()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already running" in (refused.value.details() or "")
    while (update := await first.read()) is not grpc.aio.EOF:
        last = update
    assert last.WhichOneof("update") == "report"


@pytest.mark.parametrize(
    ("change", "code", "needle"),
    [
        (lambda r: setattr(r, "policy", "best-guess"), "INVALID_ARGUMENT", "unknown MIG policy"),
        (lambda r: r.tasks[0].seconds_by_size.__setitem__(5, 1.0), "INVALID_ARGUMENT", "not 5"),
        (lambda r: r.tasks[1].seconds_by_size.__setitem__(2, -1.0), "INVALID_ARGUMENT", "> 0"),
        (lambda r: r.tasks[2].ClearField("argv"), "INVALID_ARGUMENT", "tasks[2].argv"),
        (lambda r: setattr(r.tasks[3], "name", "flat0"), "INVALID_ARGUMENT", "appears twice"),
        (lambda r: r.ClearField("tasks"), "INVALID_ARGUMENT", "at least one task"),
    ],
)
async def test_bad_batches_are_refused_before_anything_runs(
    mig_stub: tuple[dispatcher_pb2_grpc.DispatcherStub, SimulatedBackend],
    tmp_path: Path,
    change: object,
    code: str,
    needle: str,
) -> None:
    stub, backend = mig_stub
    request = dispatcher_pb2.RunMigBatchRequest(tasks=batch(tmp_path))
    change(request)  # type: ignore[operator]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.RunMigBatch(request).read()
    assert refused.value.code().name == code
    assert needle in (refused.value.details() or "")
    assert backend.mig_instances(0) == [] and not list(tmp_path.glob("*.out"))


@pytest.mark.parametrize("mig_stub", [False], indirect=True)
async def test_mig_mode_off_is_a_failed_precondition(
    mig_stub: tuple[dispatcher_pb2_grpc.DispatcherStub, SimulatedBackend], tmp_path: Path
) -> None:
    stub, _ = mig_stub
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.RunMigBatch(dispatcher_pb2.RunMigBatchRequest(tasks=batch(tmp_path))).read()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "MIG mode is off" in (refused.value.details() or "")
    await asyncio.sleep(0)
