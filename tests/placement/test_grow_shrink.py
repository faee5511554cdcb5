"""Grow-shrink live on placement's core (in-memory dispatchers, a clock the test moves, the
driver ticked by hand, policy `gandiva-gs`): an elastic training job's range is validated and
kept; it grows onto a GPU of its node idle for the period through its checkpoint hook, and
shrinks back at once when a pending job needs that GPU; a failing hook leaves it as it was."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import prometheus_client
import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.clients.cli.jobs.listing import training_cell
from gpuloom.clients.cli.jobs.one_job import details
from gpuloom.clients.placement import JobFileError, spec_from_document
from gpuloom.convert.placement import spec_from_pb, spec_to_pb
from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import CheckpointHook, TrainingPhase
from gpuloom.services.placement.convert import job_view
from gpuloom.services.placement.core import PlacementCore
from gpuloom.services.placement.decisions import GPU_UUIDS_VARIABLE
from gpuloom.services.placement.domain import Job
from gpuloom.services.placement.repository import spec_from_json, spec_to_json
from gpuloom.services.placement.training import TrainingConfig
from tests.placement.conftest import eventually
from tests.placement.harness import CoreHarness
from tests.placement.training_fakes import FakeTrainingControl

GIB = 1 << 30
IDLE_S = 100.0
HOOK = CheckpointHook(signal="SIGUSR1", timeout_s=20)


def elastic(low: int = 1, high: int = 2, name: str = "grower") -> JobSpec:
    return JobSpec(
        name=name,
        kind=JobKind.TRAINING,
        share=share_of(),
        whole_gpus=low,
        checkpoint=HOOK,
        max_gpus=high,
    )


def gpu(i: int, node: str = "node-0") -> GpuInfo:
    return GpuInfo(f"GPU-{i}", node, "A100-80GB", 80 * GIB, 108)


def address(i: int) -> str:
    return f"10.0.0.{i}:50060"


def resized() -> float:
    return sum(
        prometheus_client.REGISTRY.get_sample_value(
            "gpuloom_placement_training_resizes_total", {"reason": reason}
        )
        or 0.0
        for reason in ("grow", "shrink")
    )


@pytest.fixture
async def gs(tmp_path: Path):
    h = CoreHarness(
        tmp_path,
        training=TrainingConfig(policy="gandiva-gs", quantum_s=60, grow_idle_s=IDLE_S, tick_s=3600),
        training_control=FakeTrainingControl(),
    )
    await h.start()
    yield h
    await h.stop()


async def asked(core: PlacementCore, job_id: str, reason: str) -> tuple[str, int]:
    """Tick until the job's runner is asked for a resize; (its id, the GPU count)."""
    for _ in range(100):
        await core.training.tick()
        job = await core.get(job_id)
        migration = job.training.migration if job.training else None
        if migration is not None:
            assert migration.reason == reason and job.training is not None
            assert job.training.phase is TrainingPhase.MIGRATING
            return migration.migration_id, migration.gpus
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job_id} was never asked to {reason}")


async def elastic_on_two_gpus(core: PlacementCore) -> Job:
    """GPU-0 and GPU-1 on one node, free from now on, and the elastic job (1..2) on one."""
    for i in range(2):
        await core.register_gpu(gpu(i), address(i))
    await core.training.tick()
    job = await core.submit("r-grower", elastic())
    assert job.state is JobState.ASSIGNED and job.binding is not None
    return job


async def asked_to_grow(h: CoreHarness) -> tuple[PlacementCore, Job, str]:
    """The elastic job on one of two GPUs, asked to grow once they have been idle the period:
    the core, the job as it was placed and the resize's migration id."""
    core = h.core
    assert core is not None
    job = await elastic_on_two_gpus(core)
    h.clock.now += IDLE_S
    migration, _ = await asked(core, job.job_id, "grow")
    return core, job, migration


async def grown(h: CoreHarness) -> tuple[PlacementCore, str]:
    """GPU-0 and GPU-1 on one node; the elastic job (1..2) on GPU-0 grows onto GPU-1 once it
    has been idle for the period."""
    core = h.core
    assert core is not None
    job = await elastic_on_two_gpus(core)
    assert job.binding is not None
    first = job.binding.gpu_uuid
    h.clock.now += IDLE_S - 1
    await core.training.tick()
    assert (await core.get(job.job_id)).training.migration is None  # type: ignore[union-attr]
    h.clock.now += 1
    migration, gpus = await asked(core, job.job_id, "grow")
    assert gpus == 2
    other = "GPU-1" if first == "GPU-0" else "GPU-0"
    held = h.dispatchers.held
    # The new GPU is held for it (fleet and dispatcher) before the runner is asked, and its
    # dispatcher's heartbeats listing it are not stale.
    assert job.job_id in held[address(int(other[-1]))]
    assert core.inventory.fleet.gpus_of(job.job_id) == (first, other)
    assert await core.heartbeat(other, 0.0, 0, [job.job_id]) == []
    old_token = held[address(int(first[-1]))][job.job_id].token
    before = resized()
    done = await core.report_checkpoint(job.job_id, migration, True, "")
    assert done.binding is not None and done.binding.gpu_uuids == (first, other)
    # The first GPU is reserved again under the new token (the old one is bound to the
    # process that stopped); every GPU's reservation carries it.
    token = done.binding.token
    assert token != old_token
    assert {held[address(i)][job.job_id].token for i in range(2)} == {token}
    assert done.binding.environment[GPU_UUIDS_VARIABLE] == f"{first},{other}"
    assert done.training is not None and done.training.resizes == 1
    assert done.training.migration is None and done.training.phase is TrainingPhase.RUNNING
    assert resized() == before + 1
    core.inventory.fleet.verify()
    return core, job.job_id


async def test_an_elastic_job_grows_onto_an_idle_gpu_then_shrinks_for_a_pending_job(
    gs: CoreHarness,
) -> None:
    core, grower = await grown(gs)
    job = await core.get(grower)
    assert job.binding is not None
    first, other = job.binding.gpu_uuids
    shown = job_view(job)
    assert "grown to 2 of 1..2" in training_cell(shown)
    assert "elastic" in details(shown) and "resizes" in details(shown)
    # Nothing more to grow onto, nobody waiting: it stays grown.
    gs.clock.now += 10 * IDLE_S
    await core.training.tick()
    assert (await core.get(grower)).training.migration is None  # type: ignore[union-attr]
    # A job that needs a whole GPU arrives: pending, and the grown job is asked to shrink.
    newcomer = await core.submit("r-new", replace(elastic(name="new"), max_gpus=0))
    assert newcomer.state is JobState.PENDING
    migration, gpus = await asked(core, grower, "shrink")
    assert gpus == 1
    assert "shrinking to 1 GPU" in training_cell(job_view(await core.get(grower)))
    assert (await core.get(newcomer.job_id)).state is JobState.PENDING  # not before the hook
    done = await core.report_checkpoint(grower, migration, True, "")
    assert done.binding is not None and done.binding.gpu_uuids == (first,)
    assert GPU_UUIDS_VARIABLE not in done.binding.environment
    held = gs.dispatchers.held
    await eventually(lambda: grower not in held[address(int(other[-1]))])
    assert held[address(int(first[-1]))][grower].token == done.binding.token
    assert "1 of 1..2 GPUs" in training_cell(job_view(done))

    # The GPU it gave back goes to the pending job.
    async def placed() -> bool:
        return (await core.get(newcomer.job_id)).state is JobState.ASSIGNED

    for _ in range(200):
        if await placed():
            break
        await asyncio.sleep(0.01)
    now = await core.get(newcomer.job_id)
    assert now.state is JobState.ASSIGNED and now.binding is not None
    assert now.binding.gpu_uuid == other
    core.inventory.fleet.verify()
    # With the pending job placed, nothing is idle: it does not grow again.
    gs.clock.now += 10 * IDLE_S
    await core.training.tick()
    job = await core.get(grower)
    assert job.training is not None and job.training.migration is None
    assert job.training.resizes == 2


async def test_a_failed_hook_leaves_the_job_on_its_gpus_and_gives_the_new_one_back(
    gs: CoreHarness,
) -> None:
    core, job, migration = await asked_to_grow(gs)
    assert job.binding is not None
    stayed = await core.report_checkpoint(job.job_id, migration, False, "exit code 3")
    assert stayed.binding is not None and stayed.binding.gpu_uuids == job.binding.gpu_uuids
    assert stayed.binding.token == job.binding.token
    assert stayed.training is not None and stayed.training.last_hook_error == "exit code 3"
    assert stayed.training.failed_migrations == 1 and stayed.training.resizes == 0
    held = gs.dispatchers.held
    other = 1 - int(job.binding.gpu_uuid[-1])
    await eventually(lambda: job.job_id not in held[address(other)])
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpus_of(job.job_id) == job.binding.gpu_uuids
    assert not fleet.allocations(f"GPU-{other}")
    # Not asked again before the back-off has passed; a late report of it is refused.
    await core.training.tick()
    assert (await core.get(job.job_id)).training.migration is None  # type: ignore[union-attr]
    with pytest.raises(FailedPrecondition):
        await core.report_checkpoint(job.job_id, migration, True, "")


async def test_a_dispatcher_refusing_the_first_gpu_again_fails_the_resize_and_keeps_the_job(
    gs: CoreHarness,
) -> None:
    core, job, migration = await asked_to_grow(gs)
    assert job.binding is not None
    first = address(int(job.binding.gpu_uuid[-1]))
    gs.dispatchers.down.add(first)
    with pytest.raises(FailedPrecondition, match="restarts where it was"):
        await core.report_checkpoint(job.job_id, migration, True, "")
    stayed = await core.get(job.job_id)
    assert stayed.binding is not None and stayed.binding.gpu_uuids == job.binding.gpu_uuids
    assert stayed.training is not None and "again failed" in stayed.training.last_hook_error
    core.inventory.fleet.verify()
    assert core.inventory.fleet.gpus_of(job.job_id) == job.binding.gpu_uuids


async def test_a_grown_job_is_durable_across_a_restart(gs: CoreHarness) -> None:
    _, grower = await grown(gs)
    await gs.stop()
    core = await gs.start()
    job = await core.get(grower)
    assert job.binding is not None and len(job.binding.gpu_uuids) == 2
    assert job.spec.max_gpus == 2
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpus_of(grower) == job.binding.gpu_uuids


async def test_gandiva_without_grow_shrink_never_resizes(tmp_path: Path) -> None:
    h = CoreHarness(
        tmp_path,
        training=TrainingConfig(policy="gandiva", grow_idle_s=IDLE_S, tick_s=3600),
        training_control=FakeTrainingControl(),
    )
    core = await h.start()
    try:
        job = await elastic_on_two_gpus(core)
        for _ in range(3):
            h.clock.now += IDLE_S
            await core.training.tick()
            await asyncio.sleep(0.01)
        now = await core.get(job.job_id)
        assert now.training is not None and now.training.migration is None
        assert now.binding is not None and len(now.binding.gpu_uuids) == 1
    finally:
        await h.stop()


# ---- the elastic range as input ----


def test_an_elastic_range_is_validated_naming_the_field() -> None:
    share = share_of(100, 50, 100, memory_bytes=GIB)
    for spec, message in (
        (replace(elastic(), kind=JobKind.BATCH, checkpoint=None), "only training jobs"),
        (replace(elastic(), whole_gpus=0, share=share, mps=True), "needs whole GPUs"),
        (replace(elastic(), checkpoint=None), "needs a checkpoint hook"),
        (elastic(low=3, high=2), "within whole_gpus..64"),
        (elastic(high=65), "within whole_gpus..64"),
    ):
        with pytest.raises(InvalidArgument, match=message) as refused:
            spec.validate(["mra"])
        assert refused.value.field == "spec.max_gpus"
    elastic(low=2, high=2).validate(["mra"])  # a range of one count is allowed
    assert not elastic(low=2, high=2).elastic and elastic().elastic


async def test_a_range_beyond_the_largest_node_is_refused_and_a_good_one_is_kept(
    tmp_path: Path,
) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    try:
        for i in range(2):
            await core.register_gpu(gpu(i), address(i))
        await core.register_gpu(gpu(2, "node-1"), address(2))
        with pytest.raises(InvalidArgument, match="the most: 2") as refused:
            await core.submit("r-wide", elastic(high=3))
        assert refused.value.field == "spec.max_gpus"
        job = await core.submit("r-ok", elastic())
        assert job.spec.max_gpus == 2
    finally:
        await h.stop()
    assert spec_from_json(spec_to_json(elastic())) == elastic()
    assert spec_from_pb(spec_to_pb(elastic(2, 4))) == elastic(2, 4)
    assert "max_gpus" not in spec_to_json(replace(elastic(), max_gpus=0))


def test_a_job_file_and_gpuloom_run_declare_an_elastic_range() -> None:
    document = {
        "name": "t",
        "kind": "training",
        "resources": {"whole_gpus": 1, "max_gpus": 4},
        "checkpoint": {"signal": "SIGUSR1"},
    }
    assert spec_from_document(document, "job.yaml").max_gpus == 4
    shared = {"name": "t", "kind": "training", "resources": {"max_gpus": 4, "mps": {}}}
    with pytest.raises(JobFileError, match=r"resources\.max_gpus"):
        spec_from_document(shared, "job.yaml")
    runner = CliRunner()
    low = runner.invoke(cli, ["run", "--gpus", "2", "--max-gpus", "1", "--", "true"])
    assert low.exit_code == 2 and "--max-gpus 1 is below --gpus 2" in low.output
    share = runner.invoke(
        cli, ["run", "--sm", "50", "--memory-gib", "1", "--max-gpus", "2", "true"]
    )
    assert share.exit_code == 2 and "--max-gpus needs whole GPUs" in share.output
