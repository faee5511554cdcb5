"""MIG batches need nothing of placement's jobs but the `JobLedger` interface: driven here by
an in-memory ledger, with no core and no database, they take back waiting tasks, lose those a
restart cut off, plan a due batch, record its assignments, record each task's instance when its
run hands it out (to the runner that follows the job), and pass the task's end on to the run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from gpuloom.domain.placement import JobState, MigSlot
from gpuloom.services.placement.dispatchers import DispatcherChannels
from gpuloom.services.placement.domain import Binding, GpuRecord, Job
from gpuloom.services.placement.inventory import Inventory
from gpuloom.services.placement.ledger import JobLedger
from gpuloom.services.placement.mig_batches import WAITING, MigBatchConfig, MigBatches
from tests.placement.fakes import FakeMigRunner
from tests.placement.test_mig_batches import SCALING, mig_gpu, mig_spec

NOW = 1_000.0


class MemoryLedger:
    """Every operation of the JobLedger, on a dict, noting what it was asked."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self.jobs = {job.job_id: job for job in jobs}
        self.lock = asyncio.Lock()
        self.recorded: list[Job] = []
        self.finished: list[tuple[str, JobState, str]] = []
        self.ended: list[tuple[str, JobState, int]] = []
        self.following: set[str] = set()  # jobs a runner follows

    def followed(self, job_id: str) -> bool:
        return job_id in self.following

    def now(self) -> float:
        return NOW

    def job(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def set_pending_reason(self, job_id: str, reason: str) -> None:
        self.jobs[job_id] = replace(self.jobs[job_id], pending_reason=reason)

    async def record(self, jobs: Sequence[Job]) -> None:
        assert self.lock.locked()
        self.recorded += jobs
        self.jobs.update((job.job_id, job) for job in jobs)

    async def finish(self, jobs: Sequence[Job], state: JobState, message: str) -> None:
        for job in jobs:
            self.finished.append((job.job_id, state, message))
            del self.jobs[job.job_id]

    async def end_reported(self, job_id: str, state: JobState, message: str, exit_code: int) -> Job:
        self.ended.append((job_id, state, exit_code))
        return self.jobs.pop(job_id).advance(NOW, state=state, message=message)


def task_job(name: str, state: JobState = JobState.PENDING, gpu: str = "") -> Job:
    spec = replace(mig_spec(name), mig_times=tuple(sorted(SCALING.items())))
    binding = None
    if gpu:
        slot = MigSlot(size=7, first_slice=0, planned_start=NOW, planned_end=NOW + 1)
        binding = Binding(gpu, "node-0", "d:1", (0, 0, 0, 0), spec.share, "", mig=slot)
    return Job(name, name, spec, state, NOW - 20, NOW - 20, binding=binding)


async def test_mig_batches_work_through_the_ledger_alone() -> None:
    cut_off = task_job("cut-off", JobState.ASSIGNED, gpu="GPU-9")
    waiting = task_job("waiting")
    ledger = MemoryLedger([cut_off, waiting])
    _: JobLedger = ledger  # the interface is all it offers
    inventory = Inventory(repository=None)  # type: ignore[arg-type]  # loaded, never written
    inventory.load([GpuRecord(mig_gpu(0), "d:0", NOW, NOW)], {}, NOW)
    runner = FakeMigRunner()
    mig = MigBatches(ledger, inventory, None, runner, MigBatchConfig(timer=False))

    await mig.restore(list(ledger.jobs.values()))
    assert [(job_id, state) for job_id, state, _ in ledger.finished] == [("cut-off", JobState.LOST)]
    assert "placement restarted" in ledger.finished[0][2]
    assert ledger.jobs["waiting"].pending_reason.startswith(WAITING)

    plan = await mig.plan_due()
    assert plan is not None and set(plan.plans) == {"GPU-0"}
    [assigned] = ledger.recorded
    assert (assigned.job_id, assigned.state, assigned.policy) == (
        "waiting",
        JobState.ASSIGNED,
        "far",
    )
    assert assigned.binding is not None and assigned.binding.mig is not None
    ledger.following.add("waiting")  # its submitter's runner follows it
    async with asyncio.timeout(5):
        while len(ledger.recorded) < 2:
            await asyncio.sleep(0.01)
    handed = ledger.recorded[1]  # the run handed it its instance: the job says which
    assert handed.binding is not None and handed.binding.mig is not None
    uuid = handed.binding.mig.instance_uuid
    assert uuid.startswith("MIG-") and handed.binding.environment == {"CUDA_VISIBLE_DEVICES": uuid}
    # Its runner reports the end (the decisions end the job, then tell MIG batches): the run
    # is told, and moves on.
    ended = ledger.jobs.pop("waiting").advance(NOW, state=JobState.SUCCEEDED, exit_code=0)
    async with ledger.lock:
        mig.forget(ended)
    async with asyncio.timeout(5):
        while not runner.ends:
            await asyncio.sleep(0.01)
    assert [(e.task, e.exit_code) for e in runner.ends] == [("waiting", 0)]
    await mig.stop()


async def test_the_channel_pool_opens_one_channel_per_address() -> None:
    channels = DispatcherChannels()
    try:
        first = channels.stub("127.0.0.1:1")
        assert channels.stub("127.0.0.1:1") is first
        assert channels.stub("127.0.0.1:2") is not first
    finally:
        await channels.close()
    assert channels.stub("127.0.0.1:1") is not first  # closed: a later call opens anew
    await channels.close()
