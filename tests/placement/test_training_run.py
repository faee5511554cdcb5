"""Gandiva's migration end to end: placement (gandiva training policy, its own driver loop) with
two fake dispatchers over gRPC (Reserve, Release, SuspendClient, ResumeClient:
training_fakes.py), and `gpuloom run`'s JobRunner running a real training process
(training_worker.py) that answers its checkpoint signal. A job with a hook moves to a GPU that
frees up with no step lost or done twice; a hook that fails leaves it running where it was,
with the error in `gpuloom job`."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.clients.placement import PlacementClient
from gpuloom.clients.run import JobRunner, RunOutcome
from gpuloom.domain.placement import JobKind, JobSpec
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import CheckpointHook
from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.v1 import common_pb2
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc as pb_grpc
from tests.placement.conftest import GIB, counter, eventually
from tests.placement.training_fakes import FakeDispatcherServer, cycle

WORKER = Path(__file__).with_name("training_worker.py")
STEPS = 300


@dataclass
class Plane:
    app: PlacementApp
    stub: pb_grpc.PlacementStub
    gpus: list[FakeDispatcherServer]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    async def register(self, index: int) -> None:
        server = self.gpus[index]
        await self.stub.RegisterGpu(
            pb.RegisterGpuRequest(
                gpu=pb.GpuInfo(
                    ref=common_pb2.GpuRef(node="n1", gpu_uuid=f"GPU-{index}"),
                    model="A100-80GB",
                    memory_bytes=80 * GIB,
                    sm_count=108,
                ),
                dispatcher_address=server.address,
            )
        )


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    gpus = [FakeDispatcherServer(f"dispatcher-{i}") for i in range(2)]
    for server in gpus:
        await server.start()
    settings = PlacementSettings(
        port=0,
        database_url=f"sqlite:///{tmp_path / 'placement.db'}",
        training_policy="gandiva",
        training_quantum_s=60,
        # The fake dispatchers send no heartbeats.
        heartbeat_interval_s=300,
        heartbeat_timeout_s=3600,
    )
    app = await PlacementApp.start(settings, "127.0.0.1", tmp_path)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    yield Plane(app, pb_grpc.PlacementStub(channel), gpus)
    await channel.close()
    await app.stop(0)
    for server in gpus:
        await server.stop()


def training(name: str, hook: CheckpointHook | None) -> JobSpec:
    return JobSpec(
        name=name,
        kind=JobKind.TRAINING,
        share=share_of(100, 50, 100, memory_bytes=8 * GIB),
        mps=True,
        checkpoint=hook,
    )


async def start_run(
    plane: Plane, hook: CheckpointHook, tmp_path: Path
) -> tuple[asyncio.Future[RunOutcome], list[str], Path, str]:
    """GPU-0 only: a job without a hook, then `gpuloom run` of the worker with `hook`."""
    await plane.register(0)
    plain = training("plain", None)
    with PlacementClient(plane.address) as client:
        await asyncio.to_thread(client.submit, plain, "plain")
    said: list[str] = []
    log = tmp_path / "steps.log"
    command = [sys.executable, str(WORKER), str(tmp_path / "state"), str(log), str(STEPS)]

    def run() -> RunOutcome:
        with PlacementClient(plane.address) as client:
            return JobRunner(client, on_message=said.append).run(training("mover", hook), command)

    outcome = asyncio.ensure_future(asyncio.to_thread(run))
    await eventually(lambda: log.exists() and log.read_text().count("step ") >= 20)
    jobs = (await plane.stub.ListJobs(pb.ListJobsRequest())).jobs
    (mover,) = [j.job_id for j in jobs if j.spec.name == "mover"]
    return outcome, said, log, mover


async def test_a_job_with_a_signal_hook_moves_to_a_free_gpu_without_losing_work(
    plane: Plane, tmp_path: Path
) -> None:
    moved_before = counter("gpuloom_placement_training_migrations_total", outcome="moved")
    outcome, said, log, mover = await start_run(
        plane, CheckpointHook(signal="SIGUSR1", timeout_s=20), tmp_path
    )
    await plane.register(1)  # a free GPU: the policy spreads the crowded one
    result = await asyncio.wait_for(outcome, 60)
    assert result.exit_code == 0, said
    lines = log.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start ")]
    assert starts[0] == "start 0 dispatcher-0"
    assert len(starts) == 2 and starts[1].endswith("dispatcher-1"), lines
    resumed_at = int(starts[1].split()[1])
    assert 0 < resumed_at < STEPS
    steps = [int(line.split()[1]) for line in lines if line.startswith("step ")]
    assert steps == list(range(1, STEPS + 1))  # every step once: none lost, none redone
    on_target = [line for line in lines if line.startswith("step ") and "dispatcher-1" in line]
    assert len(on_target) == STEPS - resumed_at
    job = await plane.stub.GetJob(pb.GetJobRequest(job_id=mover))
    assert job.state == pb.JOB_STATE_SUCCEEDED
    assert job.assignment.gpu.gpu_uuid == "GPU-1"
    assert (
        counter("gpuloom_placement_training_migrations_total", outcome="moved") == moved_before + 1
    )
    assert any("moved to GPU GPU-1" in line for line in said)
    # The old GPU's dispatcher let it go; the new one released it at its end.
    await eventually(lambda: mover not in plane.gpus[1].servicer.reservations)
    assert mover not in plane.gpus[0].servicer.reservations


async def test_a_failing_hook_leaves_the_job_running_where_it_is_and_says_so(
    plane: Plane, tmp_path: Path
) -> None:
    hook = CheckpointHook(("sh", "-c", "echo disk full >&2; exit 3"), "", 10)
    outcome, said, log, mover = await start_run(plane, hook, tmp_path)
    await plane.register(1)

    async def failed() -> bool:
        job = await plane.stub.GetJob(pb.GetJobRequest(job_id=mover))
        return bool(job.training.last_hook_error)

    async with asyncio.timeout(30):
        while not await failed():
            await asyncio.sleep(0.05)
    job = await plane.stub.GetJob(pb.GetJobRequest(job_id=mover))
    assert job.state == pb.JOB_STATE_ASSIGNED and job.assignment.gpu.gpu_uuid == "GPU-0"
    assert job.training.last_hook_error == "the hook exited with code 3: disk full"
    assert job.training.failed_migrations == 1
    shown = await asyncio.to_thread(
        CliRunner().invoke, cli, ["job", mover, f"--placement={plane.address}"]
    )
    assert re.search(r"^hook error\s+the hook exited with code 3: disk full", shown.stdout, re.M)
    assert re.search(r"^checkpoint\s+sh -c", shown.stdout, re.M)
    listed = await asyncio.to_thread(
        CliRunner().invoke, cli, ["jobs", f"--placement={plane.address}"]
    )
    assert "TRAINING" in listed.stdout
    result = await asyncio.wait_for(outcome, 60)
    assert result.exit_code == 0
    lines = log.read_text().splitlines()
    assert [line for line in lines if line.startswith("start ")] == ["start 0 dispatcher-0"]
    steps = [int(line.split()[1]) for line in lines if line.startswith("step ")]
    assert steps == list(range(1, STEPS + 1))
    done = await plane.stub.GetJob(pb.GetJobRequest(job_id=mover))
    assert done.state == pb.JOB_STATE_SUCCEEDED and done.assignment.gpu.gpu_uuid == "GPU-0"
    assert any("checkpoint hook failed" in line for line in said)


async def test_heartbeats_carry_training_reports_checked_by_the_servicer(
    plane: Plane,
) -> None:
    await plane.register(0)
    job = await plane.stub.SubmitJob(
        pb.SubmitJobRequest(
            request_id="t",
            spec=pb.JobSpec(
                name="t",
                kind=pb.JOB_KIND_TRAINING,
                resources=common_pb2.Resources(memory_bytes=GIB, whole_gpus=1),
            ),
        )
    )
    bad = pb.HeartbeatRequest(
        gpu_uuid="GPU-0",
        assignment_ids=[job.job_id],
        training=[pb.TrainingReport(assignment_id=job.job_id, cycle=cycle(-2.0))],
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await plane.stub.Heartbeat(bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "training[0].cycle.minibatch_s" in (refused.value.details() or "")
    good = pb.HeartbeatRequest(
        gpu_uuid="GPU-0",
        assignment_ids=[job.job_id],
        training=[pb.TrainingReport(assignment_id=job.job_id, cycle=cycle(0.75))],
    )
    await plane.stub.Heartbeat(good)
    got = await plane.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert got.training.minibatch_s == 0.75
    assert got.training.phase == pb.TRAINING_PHASE_RUNNING and got.training.height == 1
