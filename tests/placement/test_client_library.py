"""The placement client library against a live placement service: it returns domain dataclasses
and raises domain errors, its conversions give back exactly what the service sent, and the
JobRunner example of docs/jobs.md runs as written."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from gpuloom.clients.placement import PlacementClient, WaitTimedOut
from gpuloom.clients.run import JobRunner
from gpuloom.convert import placement as convert
from gpuloom.convert.times import timestamp
from gpuloom.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from gpuloom.domain.placement import (
    Assignment,
    FunctionScaling,
    GpuEntry,
    JobKind,
    JobSpec,
    JobState,
    JobView,
    MigSlot,
    ThroughputConfig,
)
from gpuloom.domain.shares import share_of
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import GIB, Live, mps_spec, register_all, submit

DOCS = Path(__file__).resolve().parents[2] / "docs" / "jobs.md"


def client_of(live: Live) -> PlacementClient:
    return PlacementClient(f"127.0.0.1:{live.app.port}")


async def test_the_client_speaks_dataclasses_and_domain_errors(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    spec = JobSpec(
        name="typed",
        kind=JobKind.INFERENCE,
        share=share_of(30, 40.0, 60.0, memory_bytes=2 * GIB, priority=3),
        mps=True,
    )
    with client_of(placement) as client:
        job = await asyncio.to_thread(client.submit, spec, "typed-1")
        assert isinstance(job, JobView) and job.state is JobState.ASSIGNED
        assert job.spec == spec and job.request_id == "typed-1"
        assert isinstance(job.assignment, Assignment)
        assert job.assignment.share == spec.share.partition
        assert job.assignment.environment["GPULOOM_ASSIGNMENT_ID"] == job.job_id
        assert await asyncio.to_thread(client.get, job.job_id) == job

        entries = await asyncio.to_thread(lambda: list(client.gpus()))
        assert all(isinstance(e, GpuEntry) for e in entries) and len(entries) == 4
        holder = next(e for e in entries if e.gpu.gpu_uuid == job.assignment.gpu_uuid)
        assert holder.jobs == 1 and holder.memory_reserved_bytes == 2 * GIB

        cancelled = await asyncio.to_thread(client.cancel, job.job_id, "done")
        assert cancelled.state is JobState.CANCELLED and cancelled.message.endswith("done")
        with pytest.raises(FailedPrecondition):
            await asyncio.to_thread(client.cancel, job.job_id)
        with pytest.raises(NotFound):
            await asyncio.to_thread(client.get, "j-nobody")
        with pytest.raises(InvalidArgument) as refused:
            await asyncio.to_thread(
                client.submit, JobSpec(name="bad", kind=JobKind.BATCH, share=share_of())
            )
        assert refused.value.field == "spec.resources"
        # This placement has no profile store, so auto-scaling is refused.
        template = {"name": "r", "kind": "inference", "resources": {"memory_gib": 1}}
        with pytest.raises(FailedPrecondition, match="profile store"):
            await asyncio.to_thread(client.set_function_load, "serve", 10.0, template)


async def test_conversions_give_back_what_the_service_sent(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    await submit(placement.stub, mps_spec("shared", 40, 30, limit=50, task_key="t"))
    whole = pb.JobSpec(name="whole", kind=pb.JOB_KIND_TRAINING)
    whole.resources.whole_gpus = 1
    whole.slo.p99_latency_ms = 12.5
    done = await submit(placement.stub, whole)
    await placement.stub.ReportJobDone(
        pb.ReportJobDoneRequest(job_id=done.job_id, succeeded=False, exit_code=3, message="x")
    )
    for i in range(3):
        await submit(placement.stub, mps_spec(f"big{i}", 100, 100, memory_gib=70))
    await submit(placement.stub, mps_spec("waits", 100, 100, memory_gib=70))
    jobs = (await placement.stub.ListJobs(pb.ListJobsRequest())).jobs
    assert {j.state for j in jobs} >= {
        pb.JOB_STATE_ASSIGNED,
        pb.JOB_STATE_FAILED,
        pb.JOB_STATE_PENDING,
    }
    for message in jobs:
        assert convert.job_to_pb(convert.job_from_pb(message)) == message
    for entry in (await placement.stub.ListGpus(pb.ListGpusRequest())).gpus:
        assert convert.gpu_entry_to_pb(convert.gpu_entry_from_pb(entry)) == entry


def test_a_mig_task_converts_with_its_slot() -> None:
    message = pb.Job(job_id="j-1", state=pb.JOB_STATE_ASSIGNED, revision=2)
    message.spec.kind = pb.JOB_KIND_BATCH
    message.spec.priority.SetInParent()  # the service always sends a priority and an SLO
    message.spec.slo.SetInParent()
    message.spec.resources.mig.slices = 1
    message.spec.command.extend(["./lud", "-s", "8"])
    message.assignment.gpu.gpu_uuid = "GPU-7"
    message.assignment.mig.CopyFrom(pb.MigSlot(size=3, first_slice=4, planned_end=timestamp(9.5)))
    job = convert.job_from_pb(message)
    assert job.spec.is_mig_batch and job.spec.command == ("./lud", "-s", "8")
    assert job.assignment is not None and job.assignment.share is None
    assert job.assignment.mig == MigSlot(3, 4, 0.0, 9.5)
    assert convert.job_to_pb(job) == message


def test_an_auto_scaling_answer_converts() -> None:
    replica = pb.Job(job_id="j-2", state=pb.JOB_STATE_ASSIGNED)
    message = pb.SetFunctionLoadResponse(
        added=[replica],
        capacity_requests_per_s=120.0,
        most_efficient=pb.ThroughputConfig(sm_percent=25, quota_percent=50, requests_per_s=60),
    )
    scaling = convert.scaling_from_pb(message)
    assert isinstance(scaling, FunctionScaling)
    assert [j.job_id for j in scaling.added] == ["j-2"] and scaling.removed == ()
    assert scaling.capacity_requests_per_s == 120.0
    assert scaling.most_efficient == ThroughputConfig(25, 50.0, 60.0)
    assert convert.scaling_from_pb(pb.SetFunctionLoadResponse()).most_efficient is None


def docs_runner_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (example,) = [b for b in blocks if "JobRunner(" in b]
    return example


async def test_the_job_runner_example_of_the_docs_runs(
    placement: Live,
    dispatchers: DispatcherApp,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await register_all(placement.stub, dispatchers)
    shim = tmp_path / "libfake.so"
    shim.write_bytes(b"")  # never loaded: the child is Python and only reads its environment
    (tmp_path / "train.py").write_text(
        "import os\n"
        "with open('ran.txt', 'w') as out:\n"
        "    out.write(os.environ['GPULOOM_ASSIGNMENT_ID'] + ' ' + os.environ['LD_PRELOAD'])\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPULOOM_PLACEMENT_ADDRESS", f"127.0.0.1:{placement.app.port}")
    monkeypatch.setenv("GPULOOM_SHIM_PATH", str(shim))
    namespace: dict[str, object] = {}
    with pytest.raises(SystemExit) as ended:
        await asyncio.to_thread(exec, docs_runner_example(), namespace)
    assert ended.value.code == 0
    outcome = namespace["outcome"]
    assert outcome.job is not None and outcome.job.state is JobState.SUCCEEDED  # type: ignore[attr-defined]
    assert outcome.message == f"{sys.executable} exited with code 0"  # type: ignore[attr-defined]
    job_id, preload = (tmp_path / "ran.txt").read_text().split()
    assert job_id == outcome.job.job_id and preload == str(shim)  # type: ignore[attr-defined]


async def test_the_runner_cancels_a_job_it_gave_up_waiting_for(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    for i in range(4):
        await submit(placement.stub, mps_spec(f"big{i}", 100, 100, memory_gib=70))
    said: list[str] = []
    with client_of(placement) as client:
        runner = JobRunner(client, on_message=said.append)
        spec = {"name": "late", "kind": "batch", "resources": {"whole_gpus": 1}}
        with pytest.raises(WaitTimedOut, match=r"not assigned within 0\.3 s"):
            await asyncio.to_thread(runner.run, spec, [sys.executable, "-c", "pass"], 0.3)
        cancelled = await asyncio.to_thread(lambda: list(client.list(["cancelled"])))
    (late,) = [j for j in cancelled if j.spec.name == "late"]
    assert said and said[0].startswith(f"job {late.job_id} pending:")


class _RetryingClient:
    """A placement client whose job is bound, fails to bind, waits and is bound again, over
    and over, before it is assigned: what `wait_assigned` hands `on_update` meanwhile."""

    def __init__(self, job: JobView, reasons: list[str]) -> None:
        self.job, self.reasons = job, reasons

    def wait_assigned(
        self, job_id: str, timeout_s: float | None, on_update: Callable[[JobView], None]
    ) -> JobView:
        for reason in self.reasons:
            on_update(replace(self.job, state=JobState.BINDING, pending_reason=""))
            on_update(replace(self.job, state=JobState.PENDING, pending_reason=reason))
        return replace(self.job, state=JobState.ASSIGNED)


def test_the_runner_tells_each_reason_to_wait_once_however_often_binding_is_retried() -> None:
    failed = "binding on GPU SIM-0 failed (dispatcher unreachable); will try again"
    waiting = "no GPU has room for it now"
    spec = JobSpec(
        name="retried",
        kind=JobKind.INFERENCE,
        share=share_of(20, 20.0, 20.0, memory_bytes=GIB),
        mps=True,
    )
    job = JobView("j-1", "r-1", spec, JobState.PENDING, 0.0, 0.0, 1)
    said: list[str] = []
    runner = JobRunner(_RetryingClient(job, [failed, waiting] * 20), on_message=said.append)  # type: ignore[arg-type]
    assert runner.wait_assigned(job).state is JobState.ASSIGNED
    assert said == [f"job j-1 pending: {failed}", f"job j-1 pending: {waiting}"]


class _EndedMeanwhileClient:
    """A placement client whose job was evicted while its command ran, before the runner's
    watch told it: the report of the command's end is refused."""

    def __init__(self, job: JobView) -> None:
        self.job = job

    def watch(self, job_id: str) -> list[JobView]:
        return []

    def report_done(self, job_id: str, succeeded: bool, code: int, message: str) -> JobView:
        raise FailedPrecondition(f"job {job_id} already finished (evicted)")

    def get(self, job_id: str) -> JobView:
        return self.job


def test_a_command_ending_after_its_job_was_evicted_says_the_eviction() -> None:
    spec = JobSpec(name="e", kind=JobKind.BATCH, share=share_of(memory_bytes=GIB))
    why = "evicted by the dispatcher of GPU SIM-0: over its share"
    evicted = JobView("j-1", "r-1", spec, JobState.EVICTED, 0.0, 0.0, 1, message=why)
    said: list[str] = []
    runner = JobRunner(_EndedMeanwhileClient(evicted), on_message=said.append)  # type: ignore[arg-type]
    assigned = replace(evicted, state=JobState.ASSIGNED, message="")
    outcome = runner.run_assigned(assigned, [sys.executable, "-c", "raise SystemExit(3)"])
    assert outcome.exit_code == 3 and outcome.job is evicted
    assert said == [f"job j-1 was evicted: {why}"]
