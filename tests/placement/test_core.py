"""The placement core with an injected clock and in-memory dispatchers: heartbeats and lost
GPUs, restarts on the same database, and the no-over-commitment invariant."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import prometheus_client
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import share_of
from gpuloom.policies.placement import GRID_H, GRID_W
from gpuloom.services.placement.repository import JobFilter
from tests.placement.harness import CoreHarness

GIB = 1 << 30


def spec(name: str = "job", sm: int = 50, quota: float = 50, memory_gib: float = 8) -> JobSpec:
    return JobSpec(
        name=name,
        kind=JobKind.INFERENCE,
        share=share_of(sm, quota, memory_bytes=int(memory_gib * GIB)),
        mps=True,
    )


def gpu(i: int, memory_gib: int = 80) -> GpuInfo:
    return GpuInfo(f"GPU-{i}", f"node-{i // 2}", "A100-80GB", memory_gib * GIB, 108)


async def test_a_silent_gpu_is_lost_with_its_jobs_and_comes_back_on_its_next_heartbeat(
    harness: CoreHarness,
) -> None:
    core = await harness.with_gpus(gpu, range(2))
    jobs = [await core.submit(f"r{i}", spec(f"j{i}", sm=100, quota=100)) for i in range(2)]
    assert {j.binding.gpu_uuid for j in jobs if j.binding} == {"GPU-0", "GPU-1"}
    harness.clock.now += 4
    await core.heartbeat("GPU-1", math.nan, 0, [jobs[1].job_id])  # NaN: utilisation unknown
    with pytest.raises(InvalidArgument, match="utilization_percent"):
        await core.heartbeat("GPU-1", 140.0, 0, [])
    harness.clock.now += 2  # GPU-0 silent for 6 s, GPU-1 for 2 s
    assert await core.check_heartbeats() == ["GPU-0"]
    lost = next(j for j in jobs if j.binding and j.binding.gpu_uuid == "GPU-0")
    got = await core.get(lost.job_id)
    assert got.state is JobState.LOST and "stopped sending heartbeats" in got.message
    # A new job cannot go to the lost GPU, and GPU-1 is full: it waits.
    waiting = await core.submit("r-new", spec("new", sm=100, quota=100))
    assert waiting.state is JobState.PENDING
    # The dispatcher comes back: it is told to drop the lost job's reservation, and the
    # waiting job gets the GPU.
    stale = await core.heartbeat("GPU-0", 0.0, 0, [lost.job_id])
    assert stale == [lost.job_id]
    for _ in range(100):
        now = await core.get(waiting.job_id)
        if now.state is JobState.ASSIGNED:
            break
        await asyncio.sleep(0.01)
    assert now.state is JobState.ASSIGNED and now.binding and now.binding.gpu_uuid == "GPU-0"


async def test_a_restart_keeps_every_job_and_decision_and_binds_what_was_only_reserved(
    tmp_path: Path,
) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    await core.register_gpu(gpu(0), "10.0.0.1:50060")
    await core.register_gpu(gpu(1), "10.0.0.2:50060")
    h.dispatchers.down.add("10.0.0.2:50060")
    placed = [await core.submit(f"r{i}", spec(f"j{i}", sm=30, quota=30)) for i in range(6)]
    before = {j.job_id: j for j in placed}
    await h.stop()

    h.dispatchers.down.clear()
    core = await h.start()
    for job_id, job in before.items():
        again = await core.get(job_id)
        assert again.request_id == job.request_id and again.spec == job.spec
        if job.state is JobState.ASSIGNED:
            assert again.state is JobState.ASSIGNED and again.binding == job.binding
    # The fleet is rebuilt from the stored rectangles: nothing overlaps, nothing is lost.
    core.inventory.fleet.verify()
    assert sorted(core.inventory.fleet.gpu_ids()) == ["GPU-0", "GPU-1"]
    # Re-submitting the same requests gives the same jobs, not new placements.
    for i in range(6):
        assert (await core.submit(f"r{i}", spec(f"j{i}", sm=30, quota=30))).job_id in before
    held = h.dispatchers.all_held()
    assert all(held.get(j) for j, job in before.items() if job.state is JobState.ASSIGNED)
    await h.stop()


async def test_after_a_restart_known_gpus_get_the_registration_grace_before_they_are_lost(
    tmp_path: Path,
) -> None:
    """A whole host restarted: placement is back first, the dispatchers register later than a
    heartbeat timeout (5 s here). Within the grace (30 s) nothing is lost; a GPU heard from
    again is back on the usual timeout; one never heard from is lost when the grace ends."""
    h = CoreHarness(tmp_path, registration_grace_s=30)
    core = await h.start()
    for i in range(2):
        await core.register_gpu(gpu(i), f"10.0.0.{i}:50060")
    jobs = [await core.submit(f"r{i}", spec(f"j{i}", sm=100, quota=100)) for i in range(2)]
    assert all(j.state is JobState.ASSIGNED for j in jobs)
    await h.stop()

    h.clock.now += 600  # down for ten minutes
    core = await h.start()
    h.clock.now += 20  # four heartbeat timeouts, within the grace
    assert await core.check_heartbeats() == []
    await core.register_gpu(gpu(0), "10.0.0.7:50060")  # back, at another address
    h.clock.now += 6  # GPU-0 heard from: the usual timeout holds for it again
    assert await core.check_heartbeats() == ["GPU-0"]
    h.clock.now += 5  # 31 s since the restart: GPU-1 never came back
    assert await core.check_heartbeats() == ["GPU-1"]
    states = {j.job_id: await core.get(j.job_id) for j in jobs}
    on_gpu1 = next(j for j in states.values() if j.binding and j.binding.gpu_uuid == "GPU-1")
    assert on_gpu1.state is JobState.LOST
    assert "did not register again within 30 s of placement's restart" in on_gpu1.message
    await h.stop()


async def test_without_a_grace_a_restart_gives_known_gpus_one_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    await core.register_gpu(gpu(0), "10.0.0.1:50060")
    await h.stop()
    core = await h.start()
    h.clock.now += 4
    assert await core.check_heartbeats() == []
    h.clock.now += 2
    assert await core.check_heartbeats() == ["GPU-0"]
    await h.stop()


def pending_tries() -> float:
    return prometheus_client.REGISTRY.get_sample_value("gpuloom_placement_pending_tries_total") or 0


async def test_pending_jobs_survive_a_restart_and_a_release_tries_only_those_it_can_take(
    tmp_path: Path,
) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    await core.register_gpu(gpu(0), "10.0.0.1:50060")
    await core.submit("big", spec("big", sm=50, quota=100, memory_gib=40))
    small = await core.submit("small", spec("small", sm=50, quota=100, memory_gib=10))
    hungry = [
        await core.submit(f"h{i}", spec(f"h{i}", sm=50, quota=100, memory_gib=50))
        for i in range(10)
    ]
    fits = [
        await core.submit(f"f{i}", spec(f"f{i}", sm=50, quota=100, memory_gib=10)) for i in range(3)
    ]
    assert {j.state for j in (*hungry, *fits)} == {JobState.PENDING}
    await h.stop()

    core = await h.start()  # the pending jobs wait again in the scheduler
    assert core.jobs.scheduler.waiting == 13 and core.jobs.scheduler.buckets == 2
    async with asyncio.timeout(5):  # the first batch after a start tries each bucket once
        while core.jobs.scheduler.wants_decide:
            await asyncio.sleep(0.01)
    tries = pending_tries()
    await core.cancel(small.job_id)

    async def states() -> list[JobState]:
        return [(await core.get(j.job_id)).state for j in (*hungry, *fits)]

    async with asyncio.timeout(5):
        while JobState.ASSIGNED not in await states():
            await asyncio.sleep(0.01)
    # The freed GPU cannot hold a 50 GiB job: no hungry job was tried, and of the fitting
    # ones the first is placed and the second refused (the third asks the same: not tried).
    # (All were submitted at the same clock time: which one is first is up to their ids.)
    assert sorted(s.value for s in await states()) == ["assigned"] + ["pending"] * 12
    assert pending_tries() - tries == 2
    await h.stop()


async def test_ending_jobs_follows_their_state(harness: CoreHarness) -> None:
    core = harness.core
    assert core is not None
    with pytest.raises(NotFound):
        await core.cancel("j-missing")
    pending = await core.submit("r1", spec())
    assert pending.state is JobState.PENDING and "no GPU" in pending.pending_reason
    with pytest.raises(FailedPrecondition, match="only an assigned job can finish"):
        await core.report_done(pending.job_id, True, 0, "")
    cancelled = await core.cancel(pending.job_id, "changed my mind")
    assert cancelled.state is JobState.CANCELLED and cancelled.message == "changed my mind"
    with pytest.raises(FailedPrecondition, match="already finished"):
        await core.cancel(pending.job_id)


arrivals = st.lists(
    st.tuples(
        st.sampled_from(["submit", "cancel", "done", "lose"]),
        st.integers(1, 100),  # SM percent
        st.sampled_from([5.0, 12.5, 25.0, 33.33, 40.0, 60.0, 100.0]),  # quota
        st.integers(1, 40),  # memory GiB
        st.sampled_from(["mra", "binpack", "spread", "time-share"]),
        st.integers(0, 30),  # which job to end
    ),
    max_size=30,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=arrivals)
async def test_no_gpu_is_ever_over_committed_whatever_the_order(
    tmp_path_factory: pytest.TempPathFactory, ops: list
) -> None:
    h = CoreHarness(tmp_path_factory.mktemp("prop"))
    core = await h.start()
    for i in range(3):
        await core.register_gpu(gpu(i, memory_gib=48), f"10.0.0.{i}:50060")
    ids: list[str] = []
    for n, (action, sm, quota, memory, policy, which) in enumerate(ops):
        if action == "submit":
            job_spec = replace(spec(f"j{n}", sm, quota, memory), policy=policy)
            ids.append((await core.submit(f"r{n}", job_spec)).job_id)
        elif ids and action in ("cancel", "done"):
            job = await core.get(ids[which % len(ids)])
            if job.state is JobState.ASSIGNED:
                if action == "cancel":
                    await core.cancel(job.job_id)
                else:
                    await core.report_done(job.job_id, True, 0, "")
        elif action == "lose":
            h.clock.now += 10
            for i in range(3):
                if i != which % 3:
                    await core.heartbeat(f"GPU-{i}", 0.0, 0, [])
            await core.check_heartbeats()
            await core.heartbeat(f"GPU-{which % 3}", 0.0, 0, [])
        core.inventory.fleet.verify()
        for gpu_id in core.inventory.fleet.gpu_ids():
            slot = core.inventory.fleet.slot(gpu_id)
            assert slot.memory_used <= 48 * GIB
            assert slot.area_used <= GRID_W * GRID_H
        # What the dispatchers hold is exactly the assigned jobs.
        live_assigned = {j.job_id for j in core.jobs.live.values() if j.state is JobState.ASSIGNED}
        assert set(h.dispatchers.all_held()) >= live_assigned
    await h.stop()


async def test_gpus_in_mig_mode_take_no_shares(harness: CoreHarness) -> None:
    core = harness.core
    assert core is not None
    mig_mode = replace(gpu(0), mig_capable=True, mig_enabled=True)
    await core.register_gpu(mig_mode, "10.0.0.0:50060")
    await core.register_gpu(gpu(1), "10.0.0.1:50060")
    placed = [await core.submit(f"r{i}", spec(f"j{i}", sm=100, quota=50)) for i in range(3)]
    assert [j.state for j in placed] == [JobState.ASSIGNED, JobState.ASSIGNED, JobState.PENDING]
    assert {j.binding.gpu_uuid for j in placed if j.binding} == {"GPU-1"}
    # A heartbeat after a restart of its dispatcher does not open it to shares either.
    await core.register_gpu(mig_mode, "10.0.0.0:50060")
    assert not core.inventory.fleet.slot("GPU-0").schedulable


async def test_a_gpu_re_registered_smaller_than_its_jobs_is_refused_and_changes_nothing(
    harness: CoreHarness,
) -> None:
    core = harness.core
    assert core is not None
    await core.register_gpu(gpu(0, memory_gib=80), "10.0.0.0:50060")
    job = await core.submit("r1", spec("big", memory_gib=60))
    assert job.state is JobState.ASSIGNED
    with pytest.raises(FailedPrecondition, match="would not fit"):
        await core.register_gpu(gpu(0, memory_gib=40), "10.0.0.0:50060")
    assert core.inventory.fleet.gpu("GPU-0").memory_bytes == 80 * GIB
    assert [a.allocation_id for a in core.inventory.fleet.allocations("GPU-0")] == [job.job_id]
    # Larger is fine, and the job stays where it is.
    await core.register_gpu(gpu(0, memory_gib=96), "10.0.0.9:50060")
    assert core.inventory.fleet.gpu("GPU-0").memory_bytes == 96 * GIB
    assert core.inventory.fleet.gpu_of(job.job_id) == "GPU-0"


async def test_list_gpus_pages_through_the_fleet_by_node_then_uuid(harness: CoreHarness) -> None:
    core = await harness.with_gpus(
        gpu, (4, 0, 3, 1, 2)
    )  # nodes: node-0 (GPU-0, 1), node-1 (GPU-2, 3), node-2 (GPU-4)
    seen, token = [], ""
    while True:
        views, token = core.gpus("", 2, token)
        seen += [v.record.info.gpu_uuid for v in views]
        if not token:
            break
    assert seen == ["GPU-0", "GPU-1", "GPU-2", "GPU-3", "GPU-4"]
    first, token = core.gpus("node-1", 1, "")
    assert [v.record.info.gpu_uuid for v in first] == ["GPU-2"] and token
    rest, token = core.gpus("node-1", 1, token)
    assert [v.record.info.gpu_uuid for v in rest] == ["GPU-3"] and not token
    with pytest.raises(InvalidArgument, match="page_token"):
        core.gpus("", 2, "bm90LWEtdG9rZW4=")  # base64, but not ours


async def test_listing_by_state_follows_the_live_state_not_the_stored_one(
    harness: CoreHarness,
) -> None:
    """ASSIGNED is written behind the answer: a job the core holds as ASSIGNED may still be
    BINDING in the database for a moment. A state filter answers by the live state."""
    core = harness.core
    assert core is not None
    await core.register_gpu(gpu(0), "10.0.0.1:50060")
    job = await core.submit("r1", spec())
    await _eventually_assigned(core, job.job_id)
    # The database a moment behind: the row still says BINDING.
    assigned = await core.get(job.job_id)
    await core.repository.update_jobs([replace(assigned, state=JobState.BINDING)])
    listed, _ = await core.list(JobFilter(states=(JobState.ASSIGNED,)), 10, "")
    assert [j.job_id for j in listed] == [job.job_id]
    assert listed[0].state is JobState.ASSIGNED
    binding, _ = await core.list(JobFilter(states=(JobState.BINDING,)), 10, "")
    assert binding == []


async def _eventually_assigned(core, job_id: str) -> None:
    for _ in range(200):
        if (await core.get(job_id)).state is JobState.ASSIGNED:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id} was not assigned")
