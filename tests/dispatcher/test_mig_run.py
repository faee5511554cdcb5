"""MIG execution through the dispatcher (FAR paper, Algorithm 3), on a simulated A100: the plan's
instances are created and destroyed through the backend, each task is handed to the batch's
runner (the caller), which starts it in its instance, and its real start and end are reported
beside the planned ones. The dispatcher itself starts nothing."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import pytest

from gpuloom.clients.mig_run import MigBatch, MigBatchRunner, MigBatchTask
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
Stub = dispatcher_pb2_grpc.DispatcherStub


@pytest.fixture
async def mig_stub(
    short_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Stub, SimulatedBackend, str]]:
    backend = SimulatedBackend(
        "A100-80GB", mig_enabled=getattr(request, "param", True), time_scale=0
    )
    dispatcher: GpuDispatcher = await start_gpu_dispatcher(
        dispatcher_settings(), backend, backend.gpu(0), "127.0.0.1", 0, short_dir
    )
    address = f"127.0.0.1:{dispatcher.port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield dispatcher_pb2_grpc.DispatcherStub(channel), backend, address
    finally:
        await channel.close()
        await dispatcher.server.stop(0)
        dispatcher.channel.stop()


def task(name: str, times: dict[int, float], out: Path) -> MigBatchTask:
    # -S: no site packages to import, so a task starts in milliseconds and runs as planned.
    argv = (
        sys.executable, "-S", "-c", TASK, json.dumps({str(k): v for k, v in times.items()}),
        str(out),
    )  # fmt: skip
    return MigBatchTask(name, times, argv)


def spec(task: MigBatchTask) -> dispatcher_pb2.MigTaskSpec:
    return dispatcher_pb2.MigTaskSpec(name=task.name, seconds_by_size=task.seconds_by_size)


def request_of(tasks: Sequence[MigBatchTask], **fields: object) -> dispatcher_pb2.MigRunInput:
    batch = dispatcher_pb2.RunMigBatchRequest(tasks=[spec(t) for t in tasks], **fields)
    return dispatcher_pb2.MigRunInput(batch=batch)


def short_tasks(count: int, folder: Path) -> list[MigBatchTask]:
    """`count` tasks t0, t1, ... of 0.1 s in a whole (7-slice) instance, writing in `folder`."""
    return [task(f"t{i}", {7: 0.1}, folder / f"t{i}.out") for i in range(count)]


async def batch_call(stub: Stub, tasks: Sequence[MigBatchTask]) -> grpc.aio.StreamStreamCall:
    """A RunMigBatch call that has sent its batch of `tasks`; the test is its runner."""
    call = stub.RunMigBatch()
    await call.write(request_of(tasks))
    return call


Starter = Callable[[dispatcher_pb2.MigTaskStarted], Awaitable[int]]


async def _succeed(_: dispatcher_pb2.MigTaskStarted) -> int:
    return 0


async def run_as_caller(
    stub: Stub, first: dispatcher_pb2.MigRunInput, start: Starter = _succeed
) -> list[dispatcher_pb2.MigRunUpdate]:
    """Be the batch's runner without starting any process: each task handed out is `start`ed
    (by default: at once, exit code 0) and its end reported; every update, in order."""
    call = stub.RunMigBatch()
    await call.write(first)
    updates = []
    async for update in call:
        updates.append(update)
        if update.WhichOneof("update") == "task_started":
            code = await start(update.task_started)
            end = dispatcher_pb2.MigTaskEnd(task=update.task_started.task, exit_code=code)
            await call.write(dispatcher_pb2.MigRunInput(task_end=end))
        elif update.WhichOneof("update") == "report":
            await call.done_writing()
    return updates


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


def batch(tmp: Path) -> list[MigBatchTask]:
    # One task that scales (FAR gives it a big instance first), several that do not.
    scaling = {1: 1.4, 2: 0.8, 3: 0.6, 4: 0.5, 7: 0.3}
    flat = [0.25, 0.3, 0.35, 0.4, 0.45, 0.5]
    specs = [task("scaling", scaling, tmp / "scaling.out")]
    specs += [
        task(f"flat{i}", dict.fromkeys(SIZES, t), tmp / f"flat{i}.out") for i, t in enumerate(flat)
    ]
    return specs


async def test_a_far_plan_runs_in_its_instances_close_to_the_plan(
    mig_stub: tuple[Stub, SimulatedBackend, str], tmp_path: Path
) -> None:
    _, backend, address = mig_stub
    # The runner (gpuloom mig run's) starts each task it is handed; the dispatcher starts none.
    seen: list[object] = []
    runner = MigBatchRunner(address, tmp_path / "logs", on_update=seen.append)
    report = await asyncio.to_thread(
        runner.run,
        MigBatch(
            tuple(batch(tmp_path)),
            # Instant reconfiguration on this simulated GPU: plan with the same zero times.
            create_seconds=dict.fromkeys(SIZES, 0.0),
            destroy_seconds=dict.fromkeys(SIZES, 0.0),
        ),
    )
    kinds = [type(update).__name__ for update in seen]
    assert kinds[0] == "MigPlanned" and kinds[-1] == "MigRunReport"
    assert kinds.count("TaskStart") == kinds.count("TaskRun") == 7
    planned = seen[0]
    assert planned.policy == "far" and planned.tasks == 7  # type: ignore[attr-defined]

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
    makespan_lag = report.makespan_s - report.planned_makespan_s
    assert -0.05 <= makespan_lag <= SLACK_S + STARTUP_S * (max(depth.values()) + 1)
    creates = [r for r in report.reconfigurations if r.action == "create"]
    destroys = [r for r in report.reconfigurations if r.action == "destroy"]
    assert len(creates) == len(destroys) == len({(t.size, t.first_slice) for t in report.tasks})
    assert backend.mig_instances(0) == []  # everything created was destroyed


async def test_the_dispatcher_starts_no_command_of_a_batch(
    mig_stub: tuple[Stub, SimulatedBackend, str], tmp_path: Path
) -> None:
    """A batch as an older client sent it, each task with an argv (field 3, gone from the
    protocol): the dispatcher hands the tasks to the caller and runs none of the commands."""
    stub, backend, _ = mig_stub
    witness = tmp_path / "ran"
    raw = dispatcher_pb2.RunMigBatchRequest(
        tasks=[dispatcher_pb2.MigTaskSpec(name="t", seconds_by_size={1: 0.1})]
    ).SerializeToString()
    # Field 1 (tasks) holds the task; append its field 3 (argv) by hand, as bytes on the wire.
    task_bytes = dispatcher_pb2.MigTaskSpec(name="t", seconds_by_size={1: 0.1}).SerializeToString()
    for arg in ("sh", "-c", f"id > {witness}"):
        encoded = arg.encode()
        task_bytes += b"\x1a" + bytes([len(encoded)]) + encoded
    raw = b"\x0a" + bytes([len(task_bytes)]) + task_bytes
    first = dispatcher_pb2.MigRunInput(batch=dispatcher_pb2.RunMigBatchRequest.FromString(raw))
    updates = await run_as_caller(stub, first)
    started = [u.task_started for u in updates if u.WhichOneof("update") == "task_started"]
    assert [s.task for s in started] == ["t"] and started[0].instance_uuid.startswith("MIG-")
    assert updates[-1].report.tasks[0].exit_code == 0
    await asyncio.sleep(0.3)
    assert not witness.exists()
    assert backend.mig_instances(0) == []


async def test_a_runner_that_hangs_up_gets_nothing_more_and_frees_the_gpu(
    mig_stub: tuple[Stub, SimulatedBackend, str], tmp_path: Path
) -> None:
    stub, backend, _ = mig_stub
    # Only 7 slices: the three run one after another in one instance.
    tasks = short_tasks(3, tmp_path)
    call = await batch_call(stub, tasks)
    handed = []
    async for update in call:
        if update.WhichOneof("update") == "task_started":
            handed.append(update.task_started.task)
            break
    call.cancel()  # the runner goes away with its first task running
    assert len(handed) == 1
    # The run winds down: its instance is destroyed and the GPU takes the next batch.
    for _ in range(100):
        if not backend.mig_instances(0):
            break
        await asyncio.sleep(0.05)
    assert backend.mig_instances(0) == []
    updates = []
    for _ in range(50):
        try:
            updates = await run_as_caller(stub, request_of(tasks[:1]))
            break
        except grpc.aio.AioRpcError as error:
            assert "already running" in (error.details() or "")
            await asyncio.sleep(0.05)
    assert updates[-1].WhichOneof("update") == "report"
    assert [t.task for t in updates[-1].report.tasks] == ["t0"]


async def test_a_runner_that_stops_sending_ends_the_run(
    mig_stub: tuple[Stub, SimulatedBackend, str], tmp_path: Path
) -> None:
    stub, backend, _ = mig_stub
    tasks = short_tasks(3, tmp_path)
    call = await batch_call(stub, tasks)
    updates = []
    async for update in call:
        updates.append(update)
        if update.WhichOneof("update") == "task_started":
            await call.done_writing()  # it will report no end
    kinds = [u.WhichOneof("update") for u in updates]
    assert kinds == ["planned", "task_started", "task_ended", "report"]
    assert updates[2].task_ended.exit_code == -1  # NOT_REPORTED: its runner went away
    assert len(updates[3].report.tasks) == 1  # the other two were never handed out
    assert backend.mig_instances(0) == []


@pytest.mark.parametrize(
    ("end", "needle"),
    [
        (dispatcher_pb2.MigTaskEnd(task="t9", exit_code=0), "task_end.task: 't9' is not a task"),
        (None, "task_end: after the first message"),
    ],
)
async def test_a_bad_task_end_is_refused_and_ends_the_run(
    mig_stub: tuple[Stub, SimulatedBackend, str],
    tmp_path: Path,
    end: dispatcher_pb2.MigTaskEnd | None,
    needle: str,
) -> None:
    stub, backend, _ = mig_stub
    tasks = short_tasks(2, tmp_path)
    call = await batch_call(stub, tasks)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for update in call:
            if update.WhichOneof("update") == "task_started":
                bad = (
                    dispatcher_pb2.MigRunInput(task_end=end)
                    if end is not None
                    else request_of(tasks)  # a second batch
                )
                await call.write(bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (refused.value.details() or "")
    for _ in range(100):
        if not backend.mig_instances(0):
            break
        await asyncio.sleep(0.05)
    assert backend.mig_instances(0) == []


async def test_a_second_batch_waits_for_the_gpu(
    mig_stub: tuple[Stub, SimulatedBackend, str], tmp_path: Path
) -> None:
    stub, _, _ = mig_stub
    gate = asyncio.Event()

    async def held(_: dispatcher_pb2.MigTaskStarted) -> int:
        await gate.wait()
        return 0

    first = asyncio.ensure_future(run_as_caller(stub, request_of(batch(tmp_path)), held))
    await asyncio.sleep(0.3)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run_as_caller(stub, request_of(batch(tmp_path)))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already running" in (refused.value.details() or "")
    gate.set()
    updates = await first
    assert updates[-1].WhichOneof("update") == "report"


@pytest.mark.parametrize(
    ("change", "code", "needle"),
    [
        (lambda r: setattr(r, "policy", "best-guess"), "INVALID_ARGUMENT", "unknown MIG policy"),
        (lambda r: r.tasks[0].seconds_by_size.__setitem__(5, 1.0), "INVALID_ARGUMENT", "not 5"),
        (lambda r: r.tasks[1].seconds_by_size.__setitem__(2, -1.0), "INVALID_ARGUMENT", "> 0"),
        (lambda r: setattr(r.tasks[3], "name", "flat0"), "INVALID_ARGUMENT", "appears twice"),
        (lambda r: r.ClearField("tasks"), "INVALID_ARGUMENT", "at least one task"),
    ],
)
async def test_bad_batches_are_refused_before_anything_runs(
    mig_stub: tuple[Stub, SimulatedBackend, str],
    tmp_path: Path,
    change: object,
    code: str,
    needle: str,
) -> None:
    stub, backend, _ = mig_stub
    first = request_of(batch(tmp_path))
    change(first.batch)  # type: ignore[operator]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run_as_caller(stub, first)
    assert refused.value.code().name == code
    assert needle in (refused.value.details() or "")
    assert backend.mig_instances(0) == []


async def test_the_first_message_must_be_the_batch(
    mig_stub: tuple[Stub, SimulatedBackend, str],
) -> None:
    stub, backend, _ = mig_stub
    end = dispatcher_pb2.MigRunInput(task_end=dispatcher_pb2.MigTaskEnd(task="t0"))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run_as_caller(stub, end)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch: the first message is the batch" in (refused.value.details() or "")
    assert backend.mig_instances(0) == []


@pytest.mark.parametrize("mig_stub", [False], indirect=True)
async def test_mig_mode_off_is_a_failed_precondition(
    mig_stub: tuple[Stub, SimulatedBackend, str], tmp_path: Path
) -> None:
    stub, _, _ = mig_stub
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run_as_caller(stub, request_of(batch(tmp_path)))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "MIG mode is off" in (refused.value.details() or "")
