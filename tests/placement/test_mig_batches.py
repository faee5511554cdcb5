"""MIG batches in the placement core, with an injected clock, a fake profile store and fake
dispatchers running the batches: collection by window and by size, the split over the fleet's
MIG GPUs (every plan checked with verify_plan), runs whose tasks the submitters' own runners
start and end, failures, cancellation and restarts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from gpuloom.clients.placement import PlacementClient
from gpuloom.clients.run import JobRunner, RunOutcome
from gpuloom.domain import profiles as d
from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.gpus import GpuInfo, find_model
from gpuloom.domain.mig_runs import NOT_REPORTED
from gpuloom.domain.placement import JobKind, JobSpec, JobState, MigSlot
from gpuloom.domain.shares import share_of
from gpuloom.policies.mig import verify_plan
from gpuloom.services.dispatcher.app import GpuDispatcher, start_gpu_dispatcher
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.services.placement.domain import Binding, Job
from gpuloom.services.placement.mig_batches import NO_MIG_GPU, MigBatchConfig
from gpuloom.services.placement.repository import (
    _binding_from_json,
    _binding_to_json,
    spec_from_json,
    spec_to_json,
)
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.v1 import common_pb2, placement_pb2
from tests.dispatcher.conftest import dispatcher_settings
from tests.placement.conftest import eventually, start_placement, submit
from tests.placement.fakes import FakeMigRunner, FakeProfiles
from tests.placement.harness import CoreHarness

GIB = 1 << 30
A100 = "A100-80GB"
# A task that scales with its instance, and one that does not.
SCALING = {1: 8.0, 2: 4.2, 3: 3.0, 4: 2.4, 7: 1.5}
FLAT = {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0, 7: 2.0}
SUCCEEDED = placement_pb2.JOB_STATE_SUCCEEDED
FAILED = placement_pb2.JOB_STATE_FAILED


def mig_spec(
    name: str = "task", task_key: str = "scaling", command: tuple[str, ...] = ("true",), **changes
) -> JobSpec:
    spec = JobSpec(
        name=name,
        kind=JobKind.BATCH,
        share=share_of(),
        mig_slices=1,
        task_key=task_key,
        command=command,
    )
    return replace(spec, **changes)


def mig_gpu(i: int, model: str = A100, enabled: bool = True) -> GpuInfo:
    known = find_model(model)
    assert known is not None
    return GpuInfo(
        f"GPU-{i}",
        "node-0",
        model,
        known.memory_bytes,
        known.sm_count,
        mig_capable=known.mig_capable,
        mig_enabled=enabled,
    )


class Harness(CoreHarness):
    """A core with MIG batches: fake profiles, fake dispatchers running the batches, a clock
    the test moves, and the submitters' runners (`follow`). No timer task: the tests plan what
    is due themselves, on their own clock (the end-to-end test at the end has the service's
    timer do it)."""

    def __init__(self, folder: Path, max_tasks: int = 64, window_s: float = 10.0) -> None:
        profiles = FakeProfiles()
        profiles.mig[("scaling", A100)] = SCALING
        profiles.mig[("flat", A100)] = FLAT
        mig = MigBatchConfig(window_s=window_s, max_tasks=max_tasks, timer=False)
        super().__init__(folder, profiles, FakeMigRunner(), mig)
        self.exit_codes: dict[str, int] = {}  # job id -> the exit code its command ends with
        self.runners: list[asyncio.Task[None]] = []

    async def submit(
        self, count: int, key: str = "scaling", follow: bool = True, **changes
    ) -> list[Job]:
        """`count` tasks, each run by its submitter's runner unless `follow` is False."""
        assert self.core is not None
        jobs = [
            await self.core.submit(f"{key}-{i}", mig_spec(f"{key}-{i}", key, **changes))
            for i in range(count)
        ]
        for job in jobs if follow else ():
            self.follow(job.job_id)
        return jobs

    def follow(self, job_id: str) -> None:
        """The job's runner, as `gpuloom run --mig` is: it follows the job until its batch
        hands it its instance, runs its command there (here: at once, ending with the exit code
        set for it) and reports the end."""
        core = self.core
        assert core is not None

        async def run() -> None:
            async for job in core.watch(job_id):
                slot = job.binding.mig if job.binding else None
                if job.state is JobState.ASSIGNED and slot and slot.instance_uuid:
                    code = self.exit_codes.get(job_id, 0)
                    message = f"exit code {code} in {slot.instance_uuid}"
                    await core.report_done(job_id, code == 0, code, message)

        self.runners.append(asyncio.create_task(run()))

    async def stop(self) -> None:
        for runner in self.runners:
            runner.cancel()
        await asyncio.gather(*self.runners, return_exceptions=True)
        self.runners.clear()
        await super().stop()

    async def wait_for(self, job_ids: list[str], *states: JobState) -> list[Job]:
        """The jobs, once every one is in one of `states`."""
        assert self.core is not None
        async with asyncio.timeout(10):
            while True:
                jobs = [await self.core.get(job_id) for job_id in job_ids]
                if all(job.state in states for job in jobs):
                    return jobs
                await asyncio.sleep(0.01)


@pytest.fixture
def harness_class() -> type[Harness]:
    return Harness


def ids(jobs: list[Job]) -> list[str]:
    return [job.job_id for job in jobs]


async def test_a_batch_is_due_when_its_oldest_task_has_waited_the_window(
    harness: Harness,
) -> None:
    core = await harness.with_gpus(mig_gpu, range(2))
    jobs = await harness.submit(2)
    assert all(job.state is JobState.PENDING for job in jobs)
    assert (
        jobs[-1].pending_reason == "waiting for the next MIG batch (2 of 64 tasks; due in 10.0 s)"
    )
    harness.clock.now += 9.9
    assert await core.mig.plan_due() is None
    assert not harness.runner.requests
    assert "due in 0.1 s" in (await core.get(jobs[0].job_id)).pending_reason
    harness.clock.now += 0.1
    plan = await core.mig.plan_due()
    assert plan is not None and len(plan.task_gpu) == 2
    done = await harness.wait_for(ids(jobs), JobState.SUCCEEDED)
    assert all(job.exit_code == 0 and job.policy == "far" for job in done)
    assert await core.mig.plan_due() is None  # nothing waits any more


async def test_a_batch_is_due_at_once_when_max_tasks_wait(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_tasks=3)
    core = await h.start()
    try:
        await core.register_gpu(mig_gpu(0), "10.0.0.0:50060")
        h.runner.go.clear()  # runs hold their tasks: the jobs stay ASSIGNED
        first = await h.submit(2)
        assert await core.mig.plan_due() is None
        assert "(2 of 3 tasks; due in 10.0 s)" in first[1].pending_reason
        third = await core.submit("third", mig_spec("third"))
        h.follow(third.job_id)
        assert "(3 of 3 tasks; due now)" in third.pending_reason
        # No time passed: the size alone makes the batch due.
        assert await core.mig.plan_due() is not None
        assigned = await h.wait_for([*ids(first), third.job_id], JobState.ASSIGNED)
        assert {job.binding.gpu_uuid for job in assigned if job.binding} == {"GPU-0"}
        await eventually(lambda: len(h.runner.requests) == 1)
        h.runner.go.set()
        await h.wait_for(ids(assigned), JobState.SUCCEEDED)
    finally:
        await h.stop()


async def test_a_batch_is_split_over_two_mig_gpus_with_legal_plans_written_durably(
    harness: Harness,
) -> None:
    core = await harness.with_gpus(mig_gpu, range(2))
    harness.runner.go.clear()
    jobs = await harness.submit(6, "scaling") + await harness.submit(4, "flat")
    harness.clock.now += 10
    planned_at = harness.clock.now
    plan = await core.mig.plan_due()
    assert plan is not None
    assert set(plan.plans) == {"GPU-0", "GPU-1"}  # both GPUs take a share
    geometry = find_model(A100).geometry()  # type: ignore[union-attr]
    by_job = {}
    for gpu_id, gpu_plan in plan.plans.items():
        verify_plan(gpu_plan.plan, gpu_plan.tasks, geometry)
        for a in gpu_plan.new_assignments:
            by_job[a.task] = (gpu_id, a, gpu_plan.now_s)
    assert sorted(by_job) == sorted(ids(jobs))  # every job planned exactly once

    for job in jobs:
        got = await core.get(job.job_id)
        stored = await core.repository.get_job(job.job_id)  # written, not only in memory
        gpu_id, a, now_s = by_job[job.job_id]
        for seen in (got, stored):
            assert seen is not None and seen.state is JobState.ASSIGNED
            assert seen.binding is not None and seen.binding.gpu_uuid == gpu_id
            assert seen.binding.dispatcher_address == f"10.0.0.{gpu_id[-1]}:50060"
            slot = seen.binding.mig
            assert slot is not None and (slot.size, slot.first_slice) == (a.size, a.first_slice)
            assert slot.planned_start == pytest.approx(planned_at + a.start_s - now_s)
            assert slot.planned_end == pytest.approx(planned_at + a.end_s - now_s)

    # One RunMigBatch per GPU with exactly its tasks and their times (no command: the
    # submitters' runners start them).
    await eventually(lambda: len(harness.runner.requests) == 2)
    assert sorted(address for address, _ in harness.runner.requests) == [
        "10.0.0.0:50060",
        "10.0.0.1:50060",
    ]
    for address, request in harness.runner.requests:
        gpu_id = f"GPU-{address.split('.')[3][0]}"
        assert request.policy == "far"
        assert {t.name for t in request.tasks} == {j for j, v in by_job.items() if v[0] == gpu_id}
        for t in request.tasks:
            assert dict(t.seconds_by_size) in (SCALING, FLAT)
    harness.runner.go.set()
    done = await harness.wait_for(ids(jobs), JobState.SUCCEEDED)
    for job in done:  # each ran in the instance it was handed, as its runner reported
        slot = job.binding.mig  # type: ignore[union-attr]
        assert slot.instance_uuid.startswith("MIG-") and slot.instance_uuid in job.message


async def test_a_second_batch_is_planned_after_the_first_and_runs_after_it(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, window_s=1.0)
    core = await h.start()
    try:
        await core.register_gpu(mig_gpu(0), "10.0.0.0:50060")
        h.runner.go.clear()
        first = await h.submit(3, "scaling")
        h.clock.now += 1
        one = await core.mig.plan_due()
        assert one is not None
        second = await h.submit(3, "flat")
        h.clock.now += 1
        two = await core.mig.plan_due()
        assert two is not None
        # The GPU is still busy with the first batch (as planned): the second is concatenated
        # into its plan, or starts a fresh plan after it; nothing of it starts in the past.
        gpu_plan = two.plans["GPU-0"]
        assert gpu_plan.concatenated or gpu_plan.now_s < 0
        assert core.mig.planner.kept_batches("GPU-0") == (2 if gpu_plan.concatenated else 1)
        slots = [(await core.get(j)).binding.mig for j in ids(second)]  # type: ignore[union-attr]
        assert min(slot.planned_start for slot in slots) >= h.clock.now - 1e-6  # type: ignore[union-attr]
        # Only one batch runs on a dispatcher at a time: the second waits for the first (the
        # fake dispatcher refuses a second one while one runs, as RunMigBatch does).
        await eventually(lambda: len(h.runner.requests) == 1)
        h.runner.go.set()
        await h.wait_for(ids(first) + ids(second), JobState.SUCCEEDED)
        assert len(h.runner.requests) == 2 and h.runner.overlaps == 0
    finally:
        await h.stop()


async def test_exit_codes_end_jobs_succeeded_or_failed(harness: Harness) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    jobs = await harness.submit(2)
    harness.exit_codes[jobs[1].job_id] = 3
    harness.clock.now += 10
    await core.mig.plan_due()
    ok, bad = await harness.wait_for(ids(jobs), JobState.SUCCEEDED, JobState.FAILED)
    assert ok.state is JobState.SUCCEEDED and ok.exit_code == 0
    assert bad.state is JobState.FAILED and bad.exit_code == 3
    assert bad.message.startswith("exit code 3 in MIG-")
    # Each end went on to the dispatcher, which moved the instance on to its next task.
    await eventually(lambda: len(harness.runner.ends) == 2)
    assert {(e.task, e.exit_code) for e in harness.runner.ends} == {
        (ok.job_id, 0),
        (bad.job_id, 3),
    }


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kind": JobKind.TRAINING}, "spec.kind"),
        ({"task_key": ""}, "spec.task_key"),
        ({"command": ()}, "spec.command"),
        ({"command": ("",)}, "spec.command"),
        ({"command": ("echo",) * 257}, "spec.command"),
        ({"command": ("echo", "x" * 4097)}, "spec.command[1]"),
        ({"command": ("echo", "a\0b")}, "spec.command[1]"),
        ({"share": share_of(50, 50, memory_bytes=GIB), "mps": True}, "spec.resources"),
        ({"whole_gpus": 1}, "spec.resources"),
        ({"mig_size": 5}, "spec.resources.mig.slices"),
        ({"mig_size": 8}, "spec.resources.mig.slices"),
    ],
)
async def test_bad_mig_specs_are_refused_naming_the_field(
    harness: Harness, changes: dict, field: str
) -> None:
    core = harness.core
    assert core is not None
    spec = mig_spec(**changes)
    with pytest.raises(InvalidArgument) as refused:
        await core.submit("bad", spec)
    assert refused.value.field == field


async def test_a_task_asking_a_size_is_planned_only_in_instances_of_that_size(
    harness: Harness,
) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    # Left to the planner, FLAT tasks (the same time on every size) go to small instances;
    # these ask for 3 slices and 7 slices.
    harness.profiles.mig[("flat-too", A100)] = FLAT  # type: ignore[union-attr]
    asked = await harness.submit(2, "flat", mig_size=3)
    asked += await harness.submit(1, "flat-too", mig_size=7)
    free = await harness.submit(2, "scaling")
    harness.clock.now += 10
    plan = await core.mig.plan_due()
    assert plan is not None
    sizes = {a.task: a.size for gpu_plan in plan.plans.values() for a in gpu_plan.new_assignments}
    assert [sizes[j.job_id] for j in asked] == [3, 3, 7]
    assert all(sizes[j.job_id] in SCALING for j in free)
    for job in asked:  # its times, as stored, are those of its size only
        stored = await core.repository.get_job(job.job_id)
        assert stored is not None and stored.spec.mig_size == job.spec.mig_size
        assert dict(stored.spec.mig_times) == {job.spec.mig_size: FLAT[job.spec.mig_size]}


async def test_a_size_the_tasks_profile_does_not_time_is_a_failed_precondition(
    harness: Harness,
) -> None:
    core = harness.core
    assert core is not None
    harness.profiles.mig[("small", A100)] = {1: 5.0, 2: 3.0}  # type: ignore[union-attr]
    with pytest.raises(FailedPrecondition, match=r"no time for the 4-slice instance .* sizes 1, 2"):
        await core.submit("r", mig_spec(task_key="small", mig_size=4))
    assert not await core.repository.live_jobs()  # nothing was written


async def test_a_command_without_mig_is_refused(harness: Harness) -> None:
    core = harness.core
    assert core is not None
    spec = JobSpec(
        name="mps",
        kind=JobKind.BATCH,
        share=share_of(50, 50, memory_bytes=GIB),
        mps=True,
        command=("true",),
    )
    with pytest.raises(InvalidArgument) as refused:
        await core.submit("mps", spec)
    assert refused.value.field == "spec.command"


async def test_a_task_without_a_mig_profile_or_profile_store_is_a_failed_precondition(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    core = await h.start()
    try:
        with pytest.raises(FailedPrecondition, match="no MIG profile for task 'unknown'"):
            await core.submit("r", mig_spec(task_key="unknown"))
        with pytest.raises(FailedPrecondition, match=r"no MIG profile .* on H100-80GB"):
            await core.submit("r", mig_spec(gpu_model="H100-80GB"))
    finally:
        await h.stop()
    h.profiles = None
    core = await h.start()
    try:
        with pytest.raises(FailedPrecondition, match="PROFILE_STORE_ADDRESS"):
            await core.submit("r", mig_spec())
        assert not await core.repository.live_jobs()  # nothing was written
    finally:
        await h.stop()


async def test_tasks_wait_while_no_mig_gpu_can_take_them(harness: Harness) -> None:
    core = harness.core
    assert core is not None
    # An MPS GPU (no MIG) is no help.
    await core.register_gpu(mig_gpu(0, "V100-32GB"), "10.0.0.0:50060")
    jobs = await harness.submit(2)
    harness.clock.now += 10
    assert await core.mig.plan_due() is None
    assert (await core.get(jobs[0].job_id)).pending_reason == NO_MIG_GPU
    # A MIG-capable GPU with MIG mode off cannot run a batch either.
    await core.register_gpu(mig_gpu(1, enabled=False), "10.0.0.1:50060")
    assert await core.mig.plan_due() is None
    assert "1 with MIG mode off" in (await core.get(jobs[0].job_id)).pending_reason
    await core.register_gpu(mig_gpu(2), "10.0.0.2:50060")
    plan = await core.mig.plan_due()
    assert plan is not None and set(plan.plans) == {"GPU-2"}
    await harness.wait_for(ids(jobs), JobState.SUCCEEDED)


async def test_a_task_goes_only_to_gpus_of_the_model_it_names(harness: Harness) -> None:
    core = harness.core
    assert core is not None
    harness.profiles.mig[("scaling", "H100-80GB")] = SCALING  # type: ignore[union-attr]
    harness.profiles.mig[("scaling", "A30-24GB")] = SCALING  # type: ignore[union-attr]
    await core.register_gpu(mig_gpu(0), "10.0.0.0:50060")
    await core.register_gpu(mig_gpu(1, "H100-80GB"), "10.0.0.1:50060")
    h100 = await harness.submit(4, gpu_model="H100-80GB")
    a30 = await core.submit("a30", mig_spec("a30", gpu_model="A30-24GB"))
    harness.clock.now += 10
    plan = await core.mig.plan_due()
    assert plan is not None and set(plan.plans) == {"GPU-1"}
    done = await harness.wait_for(ids(h100), JobState.SUCCEEDED)
    assert all(job.binding.gpu_uuid == "GPU-1" for job in done)  # type: ignore[union-attr]
    waiting = await core.get(a30.job_id)
    assert waiting.state is JobState.PENDING
    assert "no MIG GPU of model A30-24GB" in waiting.pending_reason
    # Cancelling a waiting task takes it out of the queue.
    cancelled = await core.cancel(a30.job_id, "no A30 here")
    assert cancelled.state is JobState.CANCELLED
    await core.register_gpu(mig_gpu(2, "A30-24GB"), "10.0.0.2:50060")
    assert await core.mig.plan_due() is None


async def test_a_refused_run_gives_its_tasks_back_to_the_next_batch(harness: Harness) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    harness.runner.refuse.add("10.0.0.0:50060")
    jobs = await harness.submit(4)
    harness.clock.now += 10
    assert await core.mig.plan_due() is not None
    back = await harness.wait_for(ids(jobs), JobState.PENDING)
    # Written with the reason; GPU-0 is skipped until its next heartbeat.
    stored = await core.repository.get_job(jobs[0].job_id)
    assert stored is not None and stored.state is JobState.PENDING and stored.binding is None
    assert stored.pending_reason.startswith(
        "its MIG batch on GPU GPU-0 could not run (dispatcher 10.0.0.0:50060 unreachable)"
    )
    assert await core.mig.plan_due() is None
    reasons = [(await core.get(job.job_id)).pending_reason for job in back]
    assert all("skipped until their next heartbeat" in reason for reason in reasons)
    # Another MIG GPU takes them at once: they have waited their window already.
    await core.register_gpu(mig_gpu(1), "10.0.0.1:50060")
    plan = await core.mig.plan_due()
    assert plan is not None and set(plan.plans) == {"GPU-1"}
    done = await harness.wait_for(ids(jobs), JobState.SUCCEEDED)
    assert all(job.binding.gpu_uuid == "GPU-1" for job in done)  # type: ignore[union-attr]
    # After its heartbeat GPU-0 takes batches again.
    await core.heartbeat("GPU-0", 0.0, 0, [])
    harness.runner.refuse.clear()
    more = await harness.submit(8, "flat")
    harness.clock.now += 10
    plan = await core.mig.plan_due()
    assert plan is not None and "GPU-0" in plan.plans
    await harness.wait_for(ids(more), JobState.SUCCEEDED)


async def test_a_run_whose_stream_breaks_loses_its_tasks_saying_so(harness: Harness) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    harness.runner.break_after_start.add("10.0.0.0:50060")
    jobs = await harness.submit(2)
    harness.clock.now += 10
    await core.mig.plan_due()
    lost = await harness.wait_for(ids(jobs), JobState.LOST)
    assert all("stream failed" in j.message and "cannot be followed" in j.message for j in lost)


async def test_a_task_in_a_batch_is_reported_done_only_once_handed_and_may_be_cancelled(
    harness: Harness,
) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    harness.runner.go.clear()
    jobs = await harness.submit(3, "flat")
    waiting = await core.submit("waiting", mig_spec("waiting"))
    assert (await core.cancel(waiting.job_id)).state is JobState.CANCELLED
    harness.clock.now += 10
    plan = await core.mig.plan_due()
    assert plan is not None and len(plan.task_gpu) == 3  # the cancelled one is not in it
    await harness.wait_for(ids(jobs), JobState.ASSIGNED)
    # Not handed its instance yet: there is no run of it to report.
    with pytest.raises(FailedPrecondition, match="has not been handed its MIG instance yet"):
        await core.report_done(jobs[0].job_id, True, 0, "")
    # Cancelled in the batch before its turn: the dispatcher skips it when it comes.
    order = [t.name for t in harness.runner.requests[0][1].tasks]
    skipped = order[1]
    assert (await core.cancel(skipped, "not needed")).state is JobState.CANCELLED
    harness.runner.go.set()
    done = await harness.wait_for([order[0], order[2]], JobState.SUCCEEDED)
    assert all(job.binding.mig.instance_uuid for job in done)  # type: ignore[union-attr]
    await eventually(lambda: len(harness.runner.ends) == 3)
    assert [(e.task, e.exit_code) for e in harness.runner.ends] == [
        (order[0], 0),
        (skipped, NOT_REPORTED),
        (order[2], 0),
    ]


async def test_a_handed_task_can_be_cancelled_and_its_instance_moves_on(
    harness: Harness,
) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    jobs = await harness.submit(2, "flat", follow=False)
    # A runner that takes the instance and never ends: the job is cancelled instead.
    first_seen: asyncio.Queue[Job] = asyncio.Queue()

    async def hold(job_id: str) -> None:
        async for job in core.watch(job_id):
            slot = job.binding.mig if job.binding else None
            if job.state is JobState.ASSIGNED and slot and slot.instance_uuid:
                first_seen.put_nowait(job)

    holders = [asyncio.create_task(hold(job.job_id)) for job in jobs]
    try:
        harness.clock.now += 10
        await core.mig.plan_due()
        async with asyncio.timeout(10):
            handed = await first_seen.get()
        cancelled = await core.cancel(handed.job_id, "taking too long")
        assert cancelled.state is JobState.CANCELLED
        async with asyncio.timeout(10):
            second = await first_seen.get()  # the instance went on to the next task
        assert second.job_id != handed.job_id
        await core.cancel(second.job_id)
        await eventually(lambda: len(harness.runner.ends) == 2)
        assert [e.exit_code for e in harness.runner.ends] == [NOT_REPORTED, NOT_REPORTED]
    finally:
        for holder in holders:
            holder.cancel()


async def test_a_task_no_runner_follows_fails_when_handed_its_instance(
    harness: Harness,
) -> None:
    core = await harness.with_gpus(mig_gpu, range(1))
    orphan = (await harness.submit(1, "flat", follow=False))[0]
    followed = await harness.submit(1, "scaling")
    harness.clock.now += 10
    await core.mig.plan_due()
    failed = (await harness.wait_for([orphan.job_id], JobState.FAILED))[0]
    assert "no runner was following the job" in failed.message
    assert "gpuloom run --mig" in failed.message
    # The batch went on: the followed task ran.
    await harness.wait_for(ids(followed), JobState.SUCCEEDED)
    await eventually(lambda: len(harness.runner.ends) == 2)
    assert (orphan.job_id, NOT_REPORTED) in {(e.task, e.exit_code) for e in harness.runner.ends}


async def test_a_restart_collects_waiting_tasks_again_and_loses_those_it_cannot_follow(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    core = await h.start()
    await core.register_gpu(mig_gpu(0), "10.0.0.0:50060")
    h.runner.go.clear()
    running = await h.submit(2, "scaling")
    h.clock.now += 10
    assert await core.mig.plan_due() is not None
    waiting = await h.submit(2, "flat")
    await h.stop()  # the runs' streams go with it

    h.profiles = None  # the times come from the stored jobs, not the profile store
    h.runner = FakeMigRunner()
    core = await h.start()
    for job in waiting:  # their submitters' runners follow them again
        h.follow(job.job_id)
    lost = [await core.get(job_id) for job_id in ids(running)]
    assert all(job.state is JobState.LOST for job in lost)
    assert all("placement restarted" in job.message for job in lost)
    again = [await core.get(job_id) for job_id in ids(waiting)]
    assert all(job.state is JobState.PENDING for job in again)
    h.clock.now += 10
    plan = await core.mig.plan_due()
    assert plan is not None and set(plan.plans) == {"GPU-0"}
    await h.wait_for(ids(waiting), JobState.SUCCEEDED)
    assert {t.name for t in h.runner.requests[0][1].tasks} == set(ids(waiting))
    assert {dict(t.seconds_by_size)[1] for t in h.runner.requests[0][1].tasks} == {FLAT[1]}
    await h.stop()


def test_mig_specs_and_slots_survive_the_database_and_old_rows_stay_readable() -> None:
    spec = replace(mig_spec(command=("python", "-c", "print(1)")), mig_times=((1, 2.5), (7, 0.5)))
    again = spec_from_json(spec_to_json(spec))
    assert again == spec and again.mig_times == spec.mig_times and again.command == spec.command
    sized = replace(spec, mig_size=3)
    assert spec_from_json(spec_to_json(sized)) == sized
    assert "mig_size" not in spec_to_json(spec)  # rows of tasks asking no size stay as they were
    slot = MigSlot(3, 4, planned_start=10.0, planned_end=12.5, instance_uuid="MIG-GPU-0-s4-3g")
    cap = replace(spec.share, memory_bytes=40 * GIB)
    binding = Binding("GPU-0", "n", "h:1", (0, 0, 0, 0), cap, "", mig=slot)
    assert _binding_from_json(_binding_to_json(binding), spec) == binding
    # Rows written before MIG batches have none of the new keys.
    old_spec = (
        '{"gpu_model":"","kind":"inference","memory_bytes":1,"name":"n","policy":"",'
        '"priority":0,"share":[50,50.0,50.0],"slo":[0.0,0.0],"task_key":"","whole_gpus":0}'
    )
    old = spec_from_json(old_spec)
    assert (old.mig_slices, old.command, old.mig_times) == (0, (), ())
    assert spec_to_json(old) == old_spec  # and other jobs are written as before
    old_binding = (
        '{"gpu_uuid":"GPU-0","node":"n","dispatcher_address":"h:1","rect":[0,0,10,10],'
        '"memory_cap_bytes":1,"token":"t","environment":{}}'
    )
    loaded = _binding_from_json(old_binding, old)
    assert loaded is not None and loaded.mig is None
    assert loaded.share == replace(old.share, memory_bytes=1)  # the job's, with the stored cap
    assert _binding_to_json(loaded) == old_binding


# --- end to end: gRPC, a real profile store, real dispatchers on simulated MIG GPUs ----------


@pytest.fixture
async def mig_dispatchers(short_dir: Path) -> AsyncIterator[list[GpuDispatcher]]:
    """Two simulated A100s in MIG mode, instant reconfiguration, one dispatcher each."""
    backend = SimulatedBackend("2xA100-80GB", mig_enabled=True, time_scale=0)
    started = [
        await start_gpu_dispatcher(dispatcher_settings(), backend, gpu, "127.0.0.1", 0, short_dir)
        for gpu in backend.gpus()
    ]
    yield started
    for dispatcher in started:
        await dispatcher.server.stop(0)
        dispatcher.channel.stop()
    backend.close()


def mig_job(name: str, command: list[str]) -> placement_pb2.JobSpec:
    return placement_pb2.JobSpec(
        name=name,
        task_key="tiny",
        kind=placement_pb2.JOB_KIND_BATCH,
        resources=common_pb2.Resources(mig=common_pb2.MigProfile(slices=1)),
        command=command,
    )


async def test_mig_batch_tasks_run_through_the_service_on_mig_dispatchers(
    store: ProfileStoreApp, mig_dispatchers: list[GpuDispatcher], tmp_path: Path
) -> None:
    instant = dict.fromkeys((1, 2, 3, 4, 7), 0.0)  # as the simulated GPUs reconfigure
    settings = PlacementSettings(
        port=0,
        database_url=f"sqlite:///{tmp_path / 'placement.db'}",
        profile_store_address=f"127.0.0.1:{store.port}",
        mig_batch_max_tasks=4,  # the fourth task makes the batch due
        mig_batch_window_s=600,
        mig_create_seconds=instant,
        mig_destroy_seconds=instant,
    )
    live = await start_placement(settings, tmp_path)
    try:
        for dispatcher in mig_dispatchers:
            gpu = dispatcher.core.gpu
            await live.stub.RegisterGpu(
                placement_pb2.RegisterGpuRequest(
                    gpu=placement_pb2.GpuInfo(
                        ref=common_pb2.GpuRef(node="n1", gpu_uuid=gpu.gpu_uuid),
                        model=gpu.model,
                        memory_bytes=gpu.memory_bytes,
                        sm_count=gpu.sm_count,
                        mig_capable=True,
                        mig_enabled=True,
                    ),
                    dispatcher_address=f"127.0.0.1:{dispatcher.port}",
                )
            )
        # Without a profile the task is refused; with one it waits for its batch.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await submit(live.stub, mig_job("early", ["true"]))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no MIG profile for task 'tiny'" in (refused.value.details() or "")
        times = tuple(d.MigTime(s, t) for s, t in ((1, 0.4), (2, 0.3), (3, 0.2), (7, 0.1)))
        await store.store.put(d.MigProfile(key="tiny", gpu_model=A100, times=times), None)

        # Four submitters, each with its own runner (gpuloom run --mig): each command writes
        # down the instance it runs in and exits with its code. The fourth makes the batch due.
        address = f"127.0.0.1:{live.app.port}"
        codes = [0, 0, 3, 0]

        def command(i: int) -> list[str]:
            out = tmp_path / f"task-{i}.out"
            source = (
                "import os, sys\n"
                f"open({str(out)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n"
                f"sys.exit({codes[i]})\n"
            )
            return [sys.executable, "-S", "-c", source]

        def run(i: int) -> RunOutcome:
            spec = mig_spec(f"task-{i}", "tiny", command=tuple(command(i)))
            with PlacementClient(address) as client:
                return JobRunner(client).run(spec, command(i), timeout_s=60)

        outcomes = await asyncio.gather(*(asyncio.to_thread(run, i) for i in range(4)))
        assert [o.exit_code for o in outcomes] == codes
        uuids = {dispatcher.core.gpu.gpu_uuid for dispatcher in mig_dispatchers}
        for i, outcome in enumerate(outcomes):
            job = outcome.job
            assert job is not None
            assert job.state is (JobState.SUCCEEDED if codes[i] == 0 else JobState.FAILED)
            assert job.exit_code == codes[i]
            assert job.assignment is not None and job.assignment.gpu_uuid in uuids
            slot = job.assignment.mig
            assert slot is not None and slot.planned_end > slot.planned_start
            # The command ran in the instance its batch handed it, of the planned size.
            assert (tmp_path / f"task-{i}.out").read_text() == slot.instance_uuid
            assert slot.instance_uuid.startswith("MIG-") and slot.instance_uuid.endswith(
                f"-s{slot.first_slice}-{slot.size}g"
            )
            assert job.spec.command == tuple(command(i))
        # Every instance the runs created is gone again (the batch ends after its last task).
        await eventually(
            lambda: all(
                gpu.core.backend.mig_instances(gpu.core.gpu.index) == [] for gpu in mig_dispatchers
            )
        )
    finally:
        await live.stop()


def test_the_size_a_task_asks_for_crosses_the_wire_and_no_size_stays_no_size() -> None:
    from gpuloom.convert.placement import spec_from_pb, spec_to_pb

    for size in (0, 1, 3, 7):
        msg = spec_to_pb(mig_spec(mig_size=size))
        assert msg.resources.WhichOneof("share") == "mig"
        assert msg.resources.mig.slices == size
        back = spec_from_pb(msg)
        assert (back.mig_slices, back.mig_size) == (1, size)
