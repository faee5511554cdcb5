"""Gandiva's live mechanisms on placement's core (in-memory dispatchers, a clock the test
moves, the driver ticked by hand): training state from heartbeats, time-slicing round-robin
with priorities, packing trials and their undo, migrations through checkpoint hooks."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import prometheus_client
import pytest
import structlog
import structlog.testing
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.clients.placement import JobFileError, spec_from_document
from gpuloom.convert.placement import job_from_pb, job_to_pb
from gpuloom.convert.training import (
    report_to_pb,
    reports_from_pb,
    training_from_pb,
    training_to_pb,
)
from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import (
    CheckpointHook,
    MigrationRequest,
    PackingTrial,
    TrainingCycle,
    TrainingPhase,
    TrainingReport,
    TrainingState,
)
from gpuloom.policies.training.gandiva import BET_MIN_ENDED, GandivaKnobs
from gpuloom.services.placement import training as training_module
from gpuloom.services.placement.convert import job_view
from gpuloom.services.placement.core import PlacementCore
from gpuloom.services.placement.domain import Job
from gpuloom.services.placement.training import SWITCH_REASON, TrainingConfig
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import eventually
from tests.placement.harness import CoreHarness
from tests.placement.training_fakes import FakeTrainingControl, cycle

GIB = 1 << 30
QUANTUM = 60.0
TRIAL = 100.0
SIGNAL_HOOK = CheckpointHook(signal="SIGUSR1", timeout_s=20)


def training(
    name: str,
    *,
    priority: int = 5,
    hook: CheckpointHook | None = None,
    quota: float = 50,
    memory_gib: float = 8,
    task_key: str = "",
) -> JobSpec:
    return JobSpec(
        name=name,
        kind=JobKind.TRAINING,
        share=share_of(100, quota, 100, memory_bytes=int(memory_gib * GIB), priority=priority),
        mps=True,
        task_key=task_key,
        checkpoint=hook,
    )


def gpu(i: int) -> GpuInfo:
    return GpuInfo(f"GPU-{i}", "node-0", "A100-80GB", 80 * GIB, 108)


def report(
    job_id: str, minibatch_s: float, suspended: bool = False, reason: str = ""
) -> TrainingReport:
    cycle = TrainingCycle(minibatch_s, True, 0, 0, 0.0, 40, 10)
    return TrainingReport(job_id, cycle, suspended, reason)


def metric(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def gandiva(tmp_path: Path):
    async for harness in _gandiva(tmp_path, GandivaKnobs()):
        yield harness


async def _gandiva(tmp_path: Path, knobs: GandivaKnobs):
    """A started core under gandiva with `knobs`, its fake training control at `h.control`."""
    control = FakeTrainingControl()
    training = TrainingConfig(
        policy="gandiva", quantum_s=QUANTUM, pack_trial_s=TRIAL, tick_s=3600, gandiva=knobs
    )
    async with CoreHarness(tmp_path, training=training, training_control=control) as h:
        h.control = control  # type: ignore[attr-defined]
        yield h


async def beat(core: PlacementCore, gpu_uuid: str, reports: list[TrainingReport]) -> None:
    held = [j.job_id for j in core.jobs.holding(gpu_uuid)]
    await core.heartbeat(gpu_uuid, 40.0, 0, held, (), training=reports)


async def two_on_one_gpu(h: CoreHarness, *specs: JobSpec) -> list[str]:
    core = h.core
    assert core is not None
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    jobs = [await core.submit(f"r-{s.name}", s) for s in specs]
    assert all(j.state is JobState.ASSIGNED for j in jobs)
    assert {j.binding.gpu_uuid for j in jobs if j.binding} == {"GPU-0"}
    return [j.job_id for j in jobs]


def core_and_control(h: CoreHarness) -> tuple[PlacementCore, FakeTrainingControl]:
    """A started gandiva harness's core and its fake training control."""
    assert h.core is not None
    return h.core, h.control  # type: ignore[attr-defined]


async def phase(core: PlacementCore, job_id: str) -> TrainingPhase:
    job = await core.get(job_id)
    assert job.training is not None
    return job.training.phase


# ---- training state ----


async def test_heartbeats_give_training_jobs_their_minibatch_time_and_others_nothing(
    tmp_path: Path,
) -> None:
    h = CoreHarness(tmp_path)  # the policy is off: state is shown, nothing is switched
    core = await h.start()
    try:
        await core.register_gpu(gpu(0), "10.0.0.0:50060")
        await core.register_gpu(gpu(1), "10.0.0.1:50060")
        train = await core.submit("t", training("t", quota=100))
        serve = await core.submit(
            "s",
            JobSpec(
                name="s", kind=JobKind.INFERENCE, share=share_of(50, 50, memory_bytes=GIB), mps=True
            ),
        )
        assert train.binding is not None and serve.binding is not None
        where = train.binding.gpu_uuid
        await beat(core, where, [report(train.job_id, 0.25), report("j-unknown", 1.0)])
        got = await core.get(train.job_id)
        assert got.training is not None and got.training.minibatch_s == 0.25
        assert got.training.solo_minibatch_s == 0  # not alone for half a quantum yet
        h.clock.now += 30  # half the default quantum
        await beat(core, where, [report(train.job_id, 0.25)])
        # A report for a job on another GPU, and for a job that is no training job: ignored.
        await beat(core, serve.binding.gpu_uuid, [report(serve.job_id, 2.0)])
        other = "GPU-1" if where == "GPU-0" else "GPU-0"
        await beat(core, other, [report(train.job_id, 9.0)])
        got = await core.get(train.job_id)
        assert got.training is not None
        assert got.training.minibatch_s == 0.25 and got.training.solo_minibatch_s == 0.25
        assert got.training.phase is TrainingPhase.RUNNING and got.training.minibatches == 10
        assert (await core.get(serve.job_id)).training is None
        # A suspension the dispatcher reports shows.
        await beat(core, where, [report(train.job_id, 0.25, suspended=True)])
        assert await phase(core, train.job_id) is TrainingPhase.SUSPENDED
    finally:
        await h.stop()


def test_training_reports_are_validated_naming_the_field() -> None:
    good = pb.TrainingReport(assignment_id="j-1", cycle=cycle(0.5))
    assert reports_from_pb([good])[0].cycle.minibatch_s == 0.5
    bad_cases = {
        "training[1].cycle.minibatch_s": pb.TrainingReport(assignment_id="j-2", cycle=cycle(-1.0)),
        "training[1].assignment_id": pb.TrainingReport(cycle=cycle(1.0)),
        "training[1].suspended_reason": pb.TrainingReport(
            assignment_id="j-2", suspended=True, suspended_reason="x" * 1025
        ),
        "training[1].memory_note": pb.TrainingReport(
            assignment_id="j-2", suspended=True, memory_note="x" * 1025
        ),
        "training[1].restore_failed": pb.TrainingReport(
            assignment_id="j-2", suspended=True, restore_failed=True
        ),
    }
    for field, bad in bad_cases.items():
        with pytest.raises(InvalidArgument) as refused:
            reports_from_pb([good, bad])
        assert refused.value.field == field
    nan = pb.TrainingReport(assignment_id="j-3", cycle=cycle(math.nan))
    with pytest.raises(InvalidArgument, match="finite"):
        reports_from_pb([nan])
    # Found by the fuzzer: a Timestamp out of its range was an internal error.
    bad_time = pb.TrainingReport(assignment_id="j-5", cycle=cycle(0.5))
    bad_time.cycle.next_low_point.nanos = -(2**31)
    with pytest.raises(InvalidArgument, match="not a valid timestamp") as refused:
        reports_from_pb([good, bad_time])
    assert refused.value.field == "training[1].cycle.next_low_point"
    with pytest.raises(InvalidArgument, match="not suspended"):
        reports_from_pb([pb.TrainingReport(assignment_id="j-6", suspended_reason="by hand")])
    with pytest.raises(InvalidArgument, match="not suspended"):
        reports_from_pb([pb.TrainingReport(assignment_id="j-6", memory_note="restore failed")])
    suspended = pb.TrainingReport(
        assignment_id="j-7", suspended=True, suspended_reason="why", memory_note="restore failed"
    )
    (read,) = reports_from_pb([suspended])
    assert read.suspended_reason == "why" and read.memory_note == "restore failed"
    assert reports_from_pb([report_to_pb(read)]) == [read]
    upside_down = pb.TrainingReport(assignment_id="j-4")
    upside_down.cycle.low_memory_bytes, upside_down.cycle.high_memory_bytes = 10, 5
    with pytest.raises(InvalidArgument, match="above high_memory_bytes"):
        reports_from_pb([upside_down])


def test_checkpoint_hooks_are_validated() -> None:
    for hook, field in (
        (CheckpointHook(), "spec.checkpoint"),
        (CheckpointHook(("save",), "SIGUSR1"), "spec.checkpoint"),
        (CheckpointHook(signal="SIGKILL"), "spec.checkpoint.signal"),
        (CheckpointHook(signal="SIGUSR1", timeout_s=-1), "spec.checkpoint.timeout_s"),
        (CheckpointHook(signal="SIGUSR1", timeout_s=math.inf), "spec.checkpoint.timeout_s"),
        (CheckpointHook(("",)), "spec.checkpoint.command"),
        (CheckpointHook(("save", "a\0b")), "spec.checkpoint.command[1]"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            training("t", hook=hook).validate(["mra"])
        assert refused.value.field == field
    serve = JobSpec(
        name="s",
        kind=JobKind.INFERENCE,
        share=share_of(50, 50, memory_bytes=GIB),
        mps=True,
        checkpoint=SIGNAL_HOOK,
    )
    with pytest.raises(InvalidArgument, match="only training jobs"):
        serve.validate(["mra"])
    training("t", hook=SIGNAL_HOOK).validate(["mra"])


async def test_a_checkpoint_hook_survives_a_restart(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    hook = CheckpointHook(("save", "--now"), "", 12.5)
    job = await core.submit("r", training("t", hook=hook))
    await h.stop()
    core = await h.start()
    try:
        assert (await core.get(job.job_id)).spec.checkpoint == hook
    finally:
        await h.stop()


# ---- time-slicing ----


async def test_two_training_jobs_on_one_gpu_take_turns_one_quantum_each(
    gandiva: CoreHarness,
) -> None:
    core, control = core_and_control(gandiva)
    a, b = await two_on_one_gpu(gandiva, training("a"), training("b"))
    running = []
    for _ in range(4):
        await core.training.tick()
        assert control.suspended & {a, b} and len(control.suspended & {a, b}) == 1
        (now_running,) = {a, b} - control.suspended
        running.append(now_running)
        assert await phase(core, now_running) is TrainingPhase.RUNNING
        assert await phase(core, ({a, b} - {now_running}).pop()) is TrainingPhase.SUSPENDED
        job = await core.get(a)
        assert job.training is not None and job.training.height == 2
        await core.training.tick()  # within the quantum: nothing changes
        assert {a, b} - control.suspended == {now_running}
        gandiva.clock.now += QUANTUM
    first, second = running[:2]  # submitted at the same time: in job id order
    assert {first, second} == {a, b} and running == [first, second, first, second]
    # Never two of them running at once: every resume came after the other's suspension.
    suspended: set[str] = set()
    for call, _, job_id in control.calls:
        (suspended.add if call == "suspend" else suspended.discard)(job_id)
        assert len({a, b} - suspended) <= 1


async def test_a_higher_priority_job_is_never_suspended_for_a_lower_one(
    gandiva: CoreHarness,
) -> None:
    core, control = core_and_control(gandiva)
    low, high, high2 = await two_on_one_gpu(
        gandiva,
        training("low", priority=7, quota=30),
        training("high", priority=1, quota=30),
        training("high2", priority=1, quota=30),
    )
    for _ in range(6):
        await core.training.tick()
        assert low in control.suspended
        assert len({high, high2} - control.suspended) == 1  # the two of priority 1 take turns
        gandiva.clock.now += QUANTUM
    assert ("suspend", "10.0.0.0:50060", low) in control.calls
    assert not any(call == "resume" and job == low for call, _, job in control.calls)
    # The high ones end: the low one runs.
    for job_id in (high, high2):
        await core.cancel(job_id)
    await core.training.tick()
    assert low not in control.suspended


async def test_a_suspension_its_dispatcher_lost_is_made_again(gandiva: CoreHarness) -> None:
    """A dispatcher keeps no suspension across a restart: once its heartbeat reports the
    suspended low-priority job running, the driver suspends it again, and only then."""
    core, control = core_and_control(gandiva)
    low, high = await two_on_one_gpu(
        gandiva, training("low", priority=7, quota=30), training("high", priority=1, quota=30)
    )
    await core.training.tick()
    assert control.suspended & {low, high} == {low}

    def suspensions() -> int:
        return sum(1 for call, _, job in control.calls if call == "suspend" and job == low)

    gandiva.clock.now += 1
    await beat(core, "GPU-0", [report(low, 0.5, suspended=True), report(high, 0.5)])
    await core.training.tick()
    assert suspensions() == 1  # reported suspended: nothing to do

    control.suspended.discard(low)  # the dispatcher restarted
    gandiva.clock.now += 1
    with structlog.testing.capture_logs() as logs:
        await beat(core, "GPU-0", [report(low, 0.5, suspended=False), report(high, 0.5)])
        await core.training.tick()
    assert suspensions() == 2 and low in control.suspended
    assert any(e["event"].startswith("a suspended training job runs again") for e in logs)
    assert await phase(core, low) is TrainingPhase.SUSPENDED
    await core.training.tick()  # no fresher report: not asked again
    assert suspensions() == 2
    assert not any(call == "resume" and job == low for call, _, job in control.calls)


async def test_a_placement_started_again_resumes_its_own_suspensions_and_no_others(
    gandiva: CoreHarness,
) -> None:
    """The dispatchers kept suspensions an earlier placement made (this one has no memory of
    them): those made for time-slicing are resumed in their turn, one made by hand is not."""
    control: FakeTrainingControl = gandiva.control  # type: ignore[attr-defined]
    core = await gandiva.with_gpus(gpu, range(2))
    # Quota 60: one such job per GPU; each alone on its GPU, so each would run.
    ours = (await core.submit("r-ours", training("ours", quota=60))).job_id
    by_hand = (await core.submit("r-hand", training("hand", quota=60))).job_id
    where = {j: (await core.get(j)).binding.gpu_uuid for j in (ours, by_hand)}  # type: ignore[union-attr]
    assert len(set(where.values())) == 2
    control.suspended |= {ours, by_hand}
    await beat(core, where[ours], [report(ours, 0.5, suspended=True, reason=SWITCH_REASON)])
    await beat(core, where[by_hand], [report(by_hand, 0.5, suspended=True, reason="debugging")])
    await core.training.tick()
    assert control.suspended == {by_hand}
    assert [(call, job) for call, _, job in control.calls] == [("resume", ours)]
    assert await phase(core, ours) is TrainingPhase.RUNNING
    assert await phase(core, by_hand) is TrainingPhase.SUSPENDED


async def test_a_dispatcher_that_fails_the_switch_is_tried_again_each_quantum(
    gandiva: CoreHarness,
) -> None:
    core, control = core_and_control(gandiva)
    tries = {"n": 0}
    real_suspend = control.suspend

    async def failing(*args: object, **kwargs: object) -> bool:
        tries["n"] += 1
        raise FailedPrecondition("SuspendClient is not implemented")

    control.suspend = failing  # type: ignore[method-assign]
    a, b = await two_on_one_gpu(gandiva, training("a"), training("b"))
    for _ in range(3):
        await core.training.tick()
    assert tries["n"] == 1  # once, not once per tick
    assert await phase(core, a) is TrainingPhase.RUNNING  # nothing was suspended
    gandiva.clock.now += QUANTUM
    control.suspend = real_suspend  # type: ignore[method-assign]
    await core.training.tick()
    assert len(control.suspended & {a, b}) == 1


# ---- packing ----


async def measured_alone(h: CoreHarness, jobs: list[str], seconds: dict[str, float]) -> None:
    """Each job runs its turn, and its dispatcher measures its mini-batch time alone."""
    core = h.core
    assert core is not None
    control: FakeTrainingControl = h.control  # type: ignore[attr-defined]
    for _ in jobs:
        await core.training.tick()
        # Measured once it has run alone for half a quantum (the first report starts that).
        for _ in range(2):
            await beat(
                core,
                "GPU-0",
                [report(j, seconds[j], suspended=j in control.suspended) for j in jobs],
            )
            h.clock.now += QUANTUM / 2


async def test_a_packing_that_loses_to_time_slicing_is_undone_and_not_tried_again(
    gandiva: CoreHarness,
) -> None:
    core, control = core_and_control(gandiva)
    a, b = await two_on_one_gpu(gandiva, training("a", task_key="ta"), training("b", task_key="tb"))
    # Both running at once (before the first turn): what they report is no time alone.
    for _ in range(2):
        await beat(core, "GPU-0", [report(a, 1.0), report(b, 2.0)])
        gandiva.clock.now += QUANTUM
    await core.training.tick()
    assert await phase(core, a) is not TrainingPhase.PACKED  # not measured alone yet
    assert (await core.get(a)).training.solo_minibatch_s == 0  # type: ignore[union-attr]
    await measured_alone(gandiva, [a, b], {a: 1.0, b: 2.0})
    await core.training.tick()
    assert await phase(core, a) is TrainingPhase.PACKED
    job = await core.get(a)
    assert job.training is not None and job.training.packed_with == b
    assert not control.suspended & {a, b}  # both run
    # Packed, each is three times slower: 1/3 + 1/3 < 60/61, packing loses.
    gandiva.clock.now += TRIAL / 2
    await beat(core, "GPU-0", [report(a, 3.0), report(b, 6.0)])
    gandiva.clock.now += TRIAL / 2
    undone = metric("gpuloom_placement_training_packings_total", outcome="undone")
    await core.training.tick()  # the trial is measured
    await core.training.tick()  # the policy undoes it
    assert metric("gpuloom_placement_training_packings_total", outcome="undone") == undone + 1
    job = await core.get(a)
    assert job.training is not None and job.training.phase is not TrainingPhase.PACKED
    (trial,) = job.training.packings
    assert trial.partner == b and trial.undone
    assert trial.solo_minibatch_s == 1.0 and trial.packed_minibatch_s == 3.0
    assert trial.gain == pytest.approx(1 / 3 + 2 / 6)
    assert len({a, b} - control.suspended) == 1  # time-sliced again
    for _ in range(5):  # that pair is not packed again
        gandiva.clock.now += QUANTUM
        await core.training.tick()
        assert await phase(core, a) is not TrainingPhase.PACKED


async def test_a_packing_that_pays_off_stays(gandiva: CoreHarness) -> None:
    core = gandiva.core
    assert core is not None
    a, b = await two_on_one_gpu(gandiva, training("a", task_key="ta"), training("b", task_key="tb"))
    await measured_alone(gandiva, [a, b], {a: 1.0, b: 1.0})
    await core.training.tick()
    assert await phase(core, a) is TrainingPhase.PACKED
    gandiva.clock.now += TRIAL / 2
    await beat(core, "GPU-0", [report(a, 1.25), report(b, 1.25)])
    gandiva.clock.now += TRIAL
    for _ in range(3):
        await core.training.tick()
    job = await core.get(b)
    assert job.training is not None and job.training.phase is TrainingPhase.PACKED
    assert job.training.packings[-1].gain == pytest.approx(1.6)
    assert not job.training.packings[-1].undone


# ---- migration ----


async def crowded_then_free(h: CoreHarness, *specs: JobSpec) -> list[str]:
    """The jobs share GPU-0 (the only one); then GPU-1 comes, free."""
    ids = await two_on_one_gpu(h, *specs)
    core = h.core
    assert core is not None
    await core.register_gpu(gpu(1), "10.0.0.1:50060")
    return ids


async def mover_beside_plain(h: CoreHarness) -> tuple[PlacementCore, str, str]:
    """A job without a hook and one with a signal hook share GPU-0; then GPU-1 comes, free."""
    core = h.core
    assert core is not None
    plain, mover = await crowded_then_free(
        h, training("plain"), training("mover", hook=SIGNAL_HOOK)
    )
    return core, plain, mover


async def test_a_job_with_a_hook_migrates_to_a_free_gpu_once_its_runner_checkpointed(
    gandiva: CoreHarness,
) -> None:
    core, plain, mover = await mover_beside_plain(gandiva)
    moved_before = metric("gpuloom_placement_training_migrations_total", outcome="moved")
    await migrating(core, mover)  # the target's reservation is made in the background
    job = await core.get(mover)
    assert job.training is not None and job.training.migration is not None
    migration = job.training.migration
    assert migration.target_gpu_uuid == "GPU-1" and migration.reason == "spread"
    assert job.binding is not None and job.binding.gpu_uuid == "GPU-0"  # not moved yet
    held = gandiva.dispatchers.held
    assert mover in held["10.0.0.1:50060"] and mover in held["10.0.0.0:50060"]
    # The target's dispatcher holds it too: not stale there while the migration runs.
    assert await core.heartbeat("GPU-1", 0.0, 0, [mover]) == []
    with pytest.raises(FailedPrecondition, match="no migration"):
        await core.report_checkpoint(mover, "not-this-one", True, "")
    moved = await core.report_checkpoint(mover, migration.migration_id, True, "")
    assert moved.binding is not None and moved.binding.gpu_uuid == "GPU-1"
    assert moved.binding.environment["GPULOOM_DISPATCHER"] == "10.0.0.1:50060"
    assert moved.training is not None and moved.training.migrations == 1
    assert moved.training.migration is None
    await eventually(lambda: mover not in held["10.0.0.0:50060"])
    assert mover not in held["10.0.0.0:50060"] and plain in held["10.0.0.0:50060"]
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpu_of(mover) == "GPU-1" and fleet.gpu_of(plain) == "GPU-0"
    assert (
        metric("gpuloom_placement_training_migrations_total", outcome="moved") == moved_before + 1
    )
    # Both run alone now: nobody is suspended.
    await core.training.tick()
    control: FakeTrainingControl = gandiva.control  # type: ignore[attr-defined]
    assert not control.suspended & {plain, mover}
    # Ending it releases it where it is now.
    await core.report_done(mover, True, 0, "")
    await eventually(lambda: mover not in held["10.0.0.1:50060"])
    assert mover not in held["10.0.0.1:50060"]


async def test_a_failed_hook_leaves_the_job_where_it_is_with_the_error_shown(
    gandiva: CoreHarness,
) -> None:
    core, _, mover = await mover_beside_plain(gandiva)
    failed_before = metric("gpuloom_placement_training_migrations_total", outcome="hook_failed")
    migration = await migrating(core, mover)
    with structlog.testing.capture_logs() as logs:
        stayed = await core.report_checkpoint(mover, migration, False, "the job exited with code 3")
    (line,) = [e for e in logs if e["event"].startswith("checkpoint hook failed")]
    assert line["log_level"] == "warning" and line["job"] == mover
    assert line["error"] == "the job exited with code 3" and line["target"] == "GPU-1"
    assert stayed.binding is not None and stayed.binding.gpu_uuid == "GPU-0"
    assert stayed.state is JobState.ASSIGNED
    assert stayed.training is not None
    assert stayed.training.last_hook_error == "the job exited with code 3"
    assert stayed.training.failed_migrations == 1 and stayed.training.migration is None
    assert stayed.training.phase is not TrainingPhase.MIGRATING
    held = gandiva.dispatchers.held
    await eventually(lambda: mover not in held["10.0.0.1:50060"])
    assert mover not in held["10.0.0.1:50060"]  # the target was given back
    fleet = core.inventory.fleet
    fleet.verify()
    assert not fleet.allocations("GPU-1") and fleet.gpu_of(mover) == "GPU-0"
    assert (
        metric("gpuloom_placement_training_migrations_total", outcome="hook_failed")
        == failed_before + 1
    )
    # It is not asked again right away (back-off), and the answer to a stale report refuses.
    await core.training.tick()
    job = await core.get(mover)
    assert job.training is not None and job.training.migration is None
    with pytest.raises(FailedPrecondition):
        await core.report_checkpoint(mover, migration, True, "")


async def test_a_migration_without_an_answer_gives_up_at_its_deadline(
    gandiva: CoreHarness,
) -> None:
    core, _, mover = await mover_beside_plain(gandiva)
    await migrating(core, mover)
    gandiva.clock.now += SIGNAL_HOOK.timeout_s + 31
    await core.training.tick()
    job = await core.get(mover)
    assert job.training is not None and job.training.migration is None
    assert "no checkpoint report within 50 s" in job.training.last_hook_error
    assert job.binding is not None and job.binding.gpu_uuid == "GPU-0"


async def test_jobs_without_a_hook_are_never_migrated(gandiva: CoreHarness) -> None:
    core = gandiva.core
    assert core is not None
    a, b = await crowded_then_free(gandiva, training("a"), training("b"))
    for _ in range(5):
        await core.training.tick()
        gandiva.clock.now += QUANTUM
    for job_id in (a, b):
        job = await core.get(job_id)
        assert job.binding is not None and job.binding.gpu_uuid == "GPU-0"
        assert job.training is not None and job.training.migrations == 0
        assert job.training.migration is None
    assert not core.inventory.fleet.allocations("GPU-1")


async def frees_memory(core: PlacementCore, *gpu_uuids: str) -> None:
    """Heartbeats saying these GPUs' dispatchers free a suspended job's memory."""
    for gpu_uuid in gpu_uuids:
        held = [j.job_id for j in core.jobs.holding(gpu_uuid)]
        await core.heartbeat(gpu_uuid, 40.0, 0, held, (), suspend_releases_memory=True)


async def moved_without_hook(h: CoreHarness, jobs: list[str], gpu_uuid: str) -> str:
    """Tick until one of the jobs is bound to gpu_uuid (or fail); its id."""
    core = h.core
    assert core is not None
    for _ in range(300):
        await core.training.tick()
        for job_id in jobs:
            job = await core.get(job_id)
            if job.binding is not None and job.binding.gpu_uuid == gpu_uuid:
                return job_id
        await asyncio.sleep(0.01)
    raise AssertionError(f"none of {jobs} moved to {gpu_uuid}")


async def test_a_job_without_a_hook_moves_through_the_drivers_checkpoint_api(
    gandiva: CoreHarness,
) -> None:
    """Where both GPUs' dispatchers free a suspended job's memory, a job without a hook is
    moved by placement: suspended at its source (checkpointed), MoveClient there, then
    UnlockMovedClient at the target once its shim registered; the runner is not asked."""
    core, control = core_and_control(gandiva)
    control.unregistered_unlocks = 2  # the shim registers with the target a little later
    a, b = await crowded_then_free(gandiva, training("a"), training("b"))
    await frees_memory(core, "GPU-0", "GPU-1")
    moved_before = metric("gpuloom_placement_training_migrations_total", outcome="moved")
    mover = await moved_without_hook(gandiva, [a, b], "GPU-1")
    stayed = b if mover == a else a
    source, target = "10.0.0.0:50060", "10.0.0.1:50060"
    mine = [c for c in control.calls if c[2] == mover and c[0] != "resume"]
    assert mine[-5:] == [
        ("suspend", source, mover),
        ("move", source, mover),
        ("unlock_moved", target, mover),
        ("unlock_moved", target, mover),
        ("unlock_moved", target, mover),
    ]
    job = await core.get(mover)
    assert job.binding is not None and job.binding.dispatcher_address == target
    assert job.training is not None and job.training.migrations == 1
    assert job.training.migration is None and job.training.last_hook_error == ""
    held = gandiva.dispatchers.held
    await eventually(lambda: mover not in held[source])
    assert mover in held[target] and stayed in held[source]
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpu_of(mover) == "GPU-1" and fleet.gpu_of(stayed) == "GPU-0"
    assert (
        metric("gpuloom_placement_training_migrations_total", outcome="moved") == moved_before + 1
    )
    with pytest.raises(FailedPrecondition):  # there is nothing for a runner to report
        await core.report_checkpoint(mover, "any", True, "")


async def test_a_move_without_a_hook_that_fails_leaves_it_where_it_was_with_the_reason(
    gandiva: CoreHarness,
) -> None:
    core, control = core_and_control(gandiva)
    why = "move failed: cuCheckpointProcessRestore failed: CUDA_ERROR_OUT_OF_MEMORY (2)"
    control.move_failures = [why]
    a, b = await crowded_then_free(gandiva, training("a"), training("b"))
    await frees_memory(core, "GPU-0", "GPU-1")
    failed_before = metric("gpuloom_placement_training_migrations_total", outcome="move_failed")
    for _ in range(300):
        await core.training.tick()
        if (
            not control.move_failures
            and metric("gpuloom_placement_training_migrations_total", outcome="move_failed")
            == failed_before + 1
        ):
            break
        await asyncio.sleep(0.01)
    (tried,) = {c[2] for c in control.calls if c[0] == "move"}
    job = await core.get(tried)
    assert job.binding is not None and job.binding.gpu_uuid == "GPU-0"  # where it was
    assert job.training is not None and job.training.failed_migrations == 1
    assert job.training.last_hook_error == f"move without a hook failed: {why}"
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpu_of(tried) == "GPU-0"
    assert all(x.allocation_id != tried + "@move" for x in fleet.allocations("GPU-1"))
    # The free GPU goes to the other job instead; the one that failed is not tried again
    # within its back-off (RETRY_QUANTA quanta).
    other = b if tried == a else a
    assert await moved_without_hook(gandiva, [other], "GPU-1") == other
    for _ in range(3):
        await core.training.tick()
    assert [c[2] for c in control.calls if c[0] == "move"].count(tried) == 1
    assert (await core.get(tried)).binding.gpu_uuid == "GPU-0"  # type: ignore[union-attr]


async def test_a_job_whose_memory_cannot_be_restored_on_its_gpu_is_moved_where_it_fits(
    gandiva: CoreHarness,
) -> None:
    """A job without a hook, suspended with its memory checkpointed, whose resume could not
    restore it (no room on its GPU): placement moves it to another GPU of its node of the
    same model. Without the failed restore the lone job stays."""
    core, control = core_and_control(gandiva)
    (lone,) = await two_on_one_gpu(gandiva, training("lone"))
    await core.register_gpu(gpu(1), "10.0.0.1:50060")
    suspended = TrainingReport(
        lone, TrainingCycle(1.0, True, 0, 0, 0.0, 40, 10), True, "suspended", True
    )

    async def heartbeats(restore_failed: bool) -> None:
        note = "restore failed: CUDA_ERROR_OUT_OF_MEMORY (2)" if restore_failed else ""
        said = replace(suspended, memory_note=note, restore_failed=restore_failed)
        await core.heartbeat(
            "GPU-0", 40.0, 0, [lone], training=[said], suspend_releases_memory=True
        )
        await core.heartbeat("GPU-1", 0.0, 0, [], suspend_releases_memory=True)

    await heartbeats(restore_failed=False)
    for _ in range(3):
        await core.training.tick()
        gandiva.clock.now += QUANTUM
    assert not [c for c in control.calls if c[0] == "move"]
    await heartbeats(restore_failed=True)
    assert await moved_without_hook(gandiva, [lone], "GPU-1") == lone
    assert [c[:2] for c in control.calls if c[2] == lone and c[0] == "move"] == [
        ("move", "10.0.0.0:50060")
    ]
    job = await core.get(lone)
    assert job.training is not None and job.training.migrations == 1
    core.inventory.fleet.verify()
    assert core.inventory.fleet.gpu_of(lone) == "GPU-1"


async def test_a_moved_job_whose_shim_registers_late_is_unlocked_at_a_later_tick(
    gandiva: CoreHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's unlock keeps failing past the move's wait: the move is committed (the
    process is there), the error shown, and the unlock is tried again every tick until it
    answers; then the error is cleared."""
    monkeypatch.setattr(training_module, "MOVE_REGISTER_S", 0.2)
    core, control = core_and_control(gandiva)
    control.unregistered_unlocks = 10**6
    a, b = await crowded_then_free(gandiva, training("a"), training("b"))
    await frees_memory(core, "GPU-0", "GPU-1")
    mover = await moved_without_hook(gandiva, [a, b], "GPU-1")

    async def error_shown() -> str:
        job = await core.get(mover)
        return job.training.last_hook_error if job.training else ""

    for _ in range(100):
        if await error_shown():
            break
        await asyncio.sleep(0.05)
    assert (await error_shown()).startswith("moved, but not unlocked yet: no process registered")
    control.unregistered_unlocks = 0  # the shim registers
    for _ in range(100):
        await core.training.tick()
        if not await error_shown():
            break
        await asyncio.sleep(0.05)
    assert await error_shown() == ""
    unlocks = [c for c in control.calls if c[0] == "unlock_moved" and c[2] == mover]
    assert unlocks[-1] == ("unlock_moved", "10.0.0.1:50060", mover)


async def test_a_job_without_a_hook_is_not_moved_where_a_dispatcher_keeps_memory_resident(
    gandiva: CoreHarness,
) -> None:
    core, control = core_and_control(gandiva)
    await crowded_then_free(gandiva, training("a"), training("b"))
    await frees_memory(core, "GPU-0")  # GPU-1's dispatcher does not (no API, or off)
    for _ in range(5):
        await core.training.tick()
        gandiva.clock.now += QUANTUM
    assert not [c for c in control.calls if c[0] == "move"]
    assert not core.inventory.fleet.allocations("GPU-1")


async def migrating(core: PlacementCore, job_id: str) -> str:
    for _ in range(200):
        await core.training.tick()
        job = await core.get(job_id)
        if job.training and job.training.migration is not None:
            return job.training.migration.migration_id
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job_id} was never asked to migrate")


# ---- the messages, job files and `gpuloom run` ----


def test_training_state_and_hooks_convert_exactly_both_ways() -> None:
    state = TrainingState(
        phase=TrainingPhase.MIGRATING,
        packed_with="",
        minibatch_s=0.5,
        solo_minibatch_s=0.4,
        height=3,
        minibatches=12,
        packings=(PackingTrial("j-b", 10.0, 0.4, 0.9, 0.95, True),),
        migrations=2,
        failed_migrations=1,
        last_hook_error="timed out",
        last_hook_error_at=20.0,
        migration=MigrationRequest("m1", "GPU-1", "node-0", "spread", 30.0, 110.0),
        memory_in_turns=True,
        memory_released=True,
        preempted_by="j-h",
        memory_note="restore failed",
    )
    assert training_from_pb(training_to_pb(state)) == state
    view = job_view(
        Job(
            "j-a",
            "r",
            training("t", hook=CheckpointHook(("save", "--all"), "", 5)),
            JobState.PENDING,
            1.0,
            1.0,
            training=state,
        )
    )
    assert job_from_pb(job_to_pb(view)) == view
    message = job_to_pb(view)
    assert message.spec.checkpoint.command == ["save", "--all"]
    assert message.training.migration.target.gpu_uuid == "GPU-1"


def test_a_job_file_declares_a_checkpoint_hook_and_bad_ones_name_the_key() -> None:
    doc = {
        "name": "train",
        "kind": "training",
        "resources": {"whole_gpus": 1},
        "checkpoint": {"signal": "SIGUSR1", "timeout_s": 30},
    }
    spec = spec_from_document(doc, "t.yaml")
    assert spec.checkpoint.signal == "SIGUSR1" and spec.checkpoint.timeout_s == 30
    for hook, key in (
        ({"command": "save.sh"}, "checkpoint.command"),
        ({"signal": 10}, "checkpoint.signal"),
        ({"when": "now"}, "checkpoint.when"),
        ("SIGUSR1", "checkpoint"),
    ):
        with pytest.raises(JobFileError) as refused:
            spec_from_document({**doc, "checkpoint": hook}, "t.yaml")
        assert refused.value.key == key


def test_gpuloom_run_takes_one_hook_and_refuses_two() -> None:
    runner = CliRunner()
    both = runner.invoke(
        cli,
        ["run", "--checkpoint-signal", "SIGUSR1", "--checkpoint-command", "save", "--", "true"],
    )
    assert both.exit_code == 2 and "not both" in both.output
    alone = runner.invoke(cli, ["run", "--checkpoint-timeout", "5", "--", "true"])
    assert alone.exit_code == 2 and "--checkpoint-timeout needs" in alone.output


async def test_a_migration_is_durable_across_a_restart(gandiva: CoreHarness) -> None:
    core, plain, mover = await mover_beside_plain(gandiva)
    migration = await migrating(core, mover)
    await core.report_checkpoint(mover, migration, True, "")
    await gandiva.stop()
    core = await gandiva.start()
    job = await core.get(mover)
    assert job.state is JobState.ASSIGNED
    assert job.binding is not None and job.binding.gpu_uuid == "GPU-1"
    assert job.binding.environment["GPULOOM_DISPATCHER"] == "10.0.0.1:50060"
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpu_of(mover) == "GPU-1" and fleet.gpu_of(plain) == "GPU-0"
    assert job.training is None  # kept in memory only: the next heartbeats bring it back


# ---- with node resources and jobs on several GPUs ----


async def test_a_migration_never_over_commits_the_target_nodes_cpu(gandiva: CoreHarness) -> None:
    core = gandiva.core
    assert core is not None
    await core.register_gpu(replace(gpu(0), node_cpu_milli=4000), "10.0.0.0:50060")
    specs = [
        replace(training("plain"), cpu_milli=1000),
        replace(training("mover", hook=SIGNAL_HOOK), cpu_milli=1000),
    ]
    jobs = [await core.submit(f"r-{s.name}", s) for s in specs]
    assert {j.binding.gpu_uuid for j in jobs if j.binding} == {"GPU-0"}
    # A free GPU, but on a node with less CPU free than either job asks.
    await core.register_gpu(replace(gpu(1), node="node-1", node_cpu_milli=500), "10.0.0.1:50060")
    fleet = core.inventory.fleet
    for _ in range(5):  # each round: no move is begun (it would take GPU-1 at once)
        await core.training.tick()
        await asyncio.sleep(0.01)  # a target's reservation is made in the background
        fleet.verify()
        assert not fleet.allocations("GPU-1") and fleet.node("node-1").cpu_used == 0
        for job in jobs:
            now = await core.get(job.job_id)
            assert now.binding is not None and now.binding.gpu_uuid == "GPU-0"
            assert now.training is not None and now.training.migration is None
        gandiva.clock.now += QUANTUM
    assert (
        "10.0.0.1:50060" not in gandiva.dispatchers.held
        or not gandiva.dispatchers.held["10.0.0.1:50060"]
    )


async def test_a_training_job_alone_on_several_gpus_runs_on_them_undisturbed(
    gandiva: CoreHarness,
) -> None:
    core = await gandiva.with_gpus(gpu, range(3))
    spec = JobSpec(
        name="wide",
        kind=JobKind.TRAINING,
        share=share_of(memory_bytes=8 * GIB),
        whole_gpus=2,
        checkpoint=SIGNAL_HOOK,
    )
    wide = await core.submit("r-wide", spec)
    assert wide.binding is not None and len(wide.binding.gpu_uuids) == 2
    narrow = await core.submit("r-narrow", training("narrow", hook=SIGNAL_HOOK))
    assert narrow.binding is not None
    for _ in range(5):
        await core.training.tick()
        gandiva.clock.now += QUANTUM
    control: FakeTrainingControl = gandiva.control  # type: ignore[attr-defined]
    assert wide.job_id not in control.suspended
    now = await core.get(wide.job_id)
    # Shown (height 1), never suspended, packed or migrated: the same GPUs.
    assert now.training is not None and now.training.phase is TrainingPhase.RUNNING
    assert now.training.height == 1 and not now.training.packings
    assert now.training.migrations == 0
    assert now.binding is not None and now.binding.gpu_uuids == wide.binding.gpu_uuids
    assert not any(job == wide.job_id for _, _, job in control.calls)
    core.inventory.fleet.verify()


# ---- over-subscription: a pending job time-sliced into a full GPU ----

SLICE_AFTER = 600.0
SHARE_AFTER = 300.0


@pytest.fixture
async def slicing(tmp_path: Path):
    """gandiva with its over-subscription rules shortened: a job waits 600 s before it is
    time-sliced in, with jobs that have run 300 s, whatever waits ahead of it, with no job of
    its count seen to end."""
    async for harness in _slicing(tmp_path, bet_min_ended=0):
        yield harness


@pytest.fixture
async def slicing_on_evidence(tmp_path: Path):
    """The same, but with `BET_MIN_ENDED` jobs of its count seen to end first (the default)."""
    async for harness in _slicing(tmp_path, bet_min_ended=BET_MIN_ENDED):
        yield harness


def _slicing(tmp_path: Path, bet_min_ended: int):
    knobs = GandivaKnobs(
        slice_after_s=SLICE_AFTER,
        share_after_s=SHARE_AFTER,
        queue_ahead=0,
        bet_min_ended=bet_min_ended,
    )
    return _gandiva(tmp_path, knobs)


def whole_gpu(name: str, *, memory_gib: float = 8, priority: int = 5) -> JobSpec:
    return training(name, quota=100, memory_gib=memory_gib, priority=priority)


async def assigned(core: PlacementCore, job_id: str) -> Job:
    await eventually(lambda: core.jobs.job(job_id).state is JobState.ASSIGNED)  # type: ignore[union-attr]
    return await core.get(job_id)


async def take_turns(h: CoreHarness, a: str, b: str) -> list[str]:
    """Four quanta of the driver: which of `a` and `b` ran in each (never both at once)."""
    core = h.core
    assert core is not None
    control: FakeTrainingControl = h.control  # type: ignore[attr-defined]
    running = []
    for _ in range(4):
        await core.training.tick()
        (now_running,) = {a, b} - control.suspended
        running.append(now_running)
        h.clock.now += QUANTUM
    suspended: set[str] = set()
    for call, _, job_id in control.calls:
        (suspended.add if call == "suspend" else suspended.discard)(job_id)
        assert len({a, b} - suspended) <= 1
    return running


async def test_a_pending_training_job_is_time_sliced_into_a_full_gpu(slicing: CoreHarness) -> None:
    core = slicing.core
    assert core is not None
    control: FakeTrainingControl = slicing.control  # type: ignore[attr-defined]
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    a = await core.submit("r-a", whole_gpu("a"))
    slicing.clock.now += 1
    b = await core.submit("r-b", whole_gpu("b"))
    assert a.state is JobState.ASSIGNED and b.state is JobState.PENDING
    await core.training.tick()
    # b has waited 400 s of its 600: it waits on, as FIFO would.
    slicing.clock.now += 400
    await core.training.tick()
    assert (await core.get(b.job_id)).state is JobState.PENDING
    before = metric("gpuloom_placement_training_slices_total")
    slicing.clock.now += 300
    await core.training.tick()
    b_now = await assigned(core, b.job_id)
    assert metric("gpuloom_placement_training_slices_total") == before + 1
    assert a.binding is not None and b_now.binding is not None
    # In a's rectangle, with its own memory: the fleet holds both, over-committing nothing.
    assert b_now.binding.gpu_uuid == "GPU-0"
    assert b_now.binding.time_slice_of == a.job_id
    assert b_now.binding.rect == a.binding.rect
    fleet = core.jobs.scheduler.fleet
    fleet.verify()
    assert fleet.slot("GPU-0").memory_used == 16 * GIB
    # Its dispatcher was asked to reserve it in a's time-slice group.
    assert slicing.dispatchers.held["10.0.0.0:50060"][b.job_id].time_slice_of == a.job_id
    view = job_view(b_now, with_token=False)
    assert view.assignment is not None and view.assignment.time_slice_of == a.job_id
    # Then they take turns, one quantum each, never both at once.
    assert await take_turns(slicing, a.job_id, b.job_id) == [a.job_id, b.job_id] * 2
    # a ends: b runs on alone in the group's rectangle, which no new job may take meanwhile.
    await core.report_done(a.job_id, True, 0, "")
    await core.training.tick()
    assert b.job_id not in control.suspended
    c = await core.submit("r-c", whole_gpu("c"))
    assert c.state is JobState.PENDING
    fleet.verify()
    # b ends: the rectangle is free again, and c takes it.
    await core.report_done(b.job_id, True, 0, "")
    await assigned(core, c.job_id)


async def test_no_job_is_time_sliced_in_where_its_memory_or_priority_does_not_fit(
    slicing: CoreHarness,
) -> None:
    core = slicing.core
    assert core is not None
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    await core.register_gpu(gpu(1), "10.0.0.0:50061")
    a = await core.submit("r-a", whole_gpu("a", memory_gib=40))
    high = await core.submit("r-h", whole_gpu("h", priority=1))
    big = await core.submit("r-big", whole_gpu("big", memory_gib=50))
    low = await core.submit("r-low", whole_gpu("low", priority=7))
    assert a.state is JobState.ASSIGNED and high.state is JobState.ASSIGNED
    await core.training.tick()
    slicing.clock.now += 2 * SLICE_AFTER
    for _ in range(3):
        await core.training.tick()
        await asyncio.sleep(0.05)
    # 50 GiB do not fit beside a's 40 on an 80 GiB GPU, and a priority-7 job would never get
    # a turn beside the priority-1 job (nor may it take turns from a priority-5 one).
    for job in (big, low):
        after = await core.get(job.job_id)
        assert after.state is JobState.PENDING and after.binding is None
    core.jobs.scheduler.fleet.verify()
    assert slicing.dispatchers.all_held().keys() == {a.job_id, high.job_id}


async def test_a_time_sliced_job_survives_a_placement_restart(slicing: CoreHarness) -> None:
    core = slicing.core
    assert core is not None
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    a = await core.submit("r-a", whole_gpu("a"))
    b = await core.submit("r-b", whole_gpu("b"))
    await core.training.tick()
    slicing.clock.now += 2 * SLICE_AFTER
    await core.training.tick()
    await assigned(core, b.job_id)
    await slicing.stop()
    core = await slicing.start()
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    after = await core.get(b.job_id)
    assert after.state is JobState.ASSIGNED and after.binding is not None
    assert after.binding.time_slice_of == a.job_id
    fleet = core.jobs.scheduler.fleet
    fleet.verify()
    assert fleet.slot("GPU-0").memory_used == 16 * GIB
    # The group's rectangle is still held: a new whole-GPU job waits.
    c = await core.submit("r-c", whole_gpu("c"))
    assert c.state is JobState.PENDING


async def test_a_pending_job_on_several_gpus_is_time_sliced_into_another_ones_gpus(
    slicing: CoreHarness,
) -> None:
    control: FakeTrainingControl = slicing.control  # type: ignore[attr-defined]
    core = await slicing.with_gpus(gpu, range(2))

    def wide(name: str) -> JobSpec:
        return JobSpec(
            name=name, kind=JobKind.TRAINING, share=share_of(memory_bytes=8 * GIB), whole_gpus=2
        )

    a = await core.submit("r-a", wide("a"))
    slicing.clock.now += 1
    b = await core.submit("r-b", wide("b"))
    slicing.clock.now += 1
    one = await core.submit("r-one", whole_gpu("one"))
    assert a.state is JobState.ASSIGNED and a.binding is not None
    assert b.state is JobState.PENDING and one.state is JobState.PENDING
    await core.training.tick()
    slicing.clock.now += 2 * SLICE_AFTER
    await core.training.tick()
    b_now = await assigned(core, b.job_id)
    # On a's two GPUs, in their order, in a's time-slice group on each, on both dispatchers.
    assert b_now.binding is not None and b_now.binding.gpu_uuids == a.binding.gpu_uuids
    assert b_now.binding.time_slice_of == a.job_id
    for uuid_ in a.binding.gpu_uuids:
        address = core.inventory.record(uuid_).dispatcher_address
        assert slicing.dispatchers.held[address][b.job_id].time_slice_of == a.job_id
        assert core.inventory.fleet.slot(uuid_).memory_used == 16 * GIB
    core.inventory.fleet.verify()
    # The one-GPU job found no round-robin of its count: it waits on.
    assert (await core.get(one.job_id)).state is JobState.PENDING
    assert await take_turns(slicing, a.job_id, b.job_id) == [a.job_id, b.job_id] * 2
    # Switched through their first GPU's dispatcher, where their processes register.
    assert {address for _, address, _ in control.calls} == {"10.0.0.0:50060"}
    job = await core.get(a.job_id)
    assert job.training is not None and job.training.height == 2
    # a ends: b runs on alone, both GPUs still held; b ends: the one-GPU job gets one.
    await core.report_done(a.job_id, True, 0, "")
    await core.training.tick()
    assert b.job_id not in control.suspended
    assert (await core.get(one.job_id)).state is JobState.PENDING
    await core.report_done(b.job_id, True, 0, "")
    await assigned(core, one.job_id)
    core.inventory.fleet.verify()


async def test_a_job_whose_time_sliced_binding_failed_is_not_sliced_in_again_at_once(
    slicing: CoreHarness,
) -> None:
    core = slicing.core
    assert core is not None
    address = "10.0.0.0:50060"
    await core.register_gpu(gpu(0), address)
    a = await core.submit("r-a", whole_gpu("a"))
    slicing.clock.now += 1
    b = await core.submit("r-b", whole_gpu("b"))
    await core.training.tick()
    slicing.clock.now += 2 * SLICE_AFTER
    slicing.dispatchers.down.add(address)
    calls = slicing.dispatchers.reserve_calls
    await core.training.tick()

    def waits_again() -> bool:
        job = core.jobs.job(b.job_id)
        tried = slicing.dispatchers.reserve_calls > calls
        return tried and job is not None and job.state is JobState.PENDING

    await eventually(waits_again)
    assert slicing.dispatchers.reserve_calls == calls + 1
    core.inventory.fleet.verify()
    assert core.inventory.fleet.slot("GPU-0").memory_used == 8 * GIB  # b's memory given back
    # Its dispatcher answers again, but b is not time-sliced in again for 5 quanta.
    slicing.dispatchers.down.clear()
    for _ in range(4):
        slicing.clock.now += QUANTUM
        await beat(core, "GPU-0", [])
        await core.training.tick()
        await asyncio.sleep(0.01)
        assert (await core.get(b.job_id)).state is JobState.PENDING
    assert slicing.dispatchers.reserve_calls == calls + 1
    slicing.clock.now += 2 * QUANTUM
    await beat(core, "GPU-0", [])
    await core.training.tick()
    after = await assigned(core, b.job_id)
    assert after.binding is not None and after.binding.time_slice_of == a.job_id


@pytest.mark.parametrize("ended", [BET_MIN_ENDED - 1, BET_MIN_ENDED])
async def test_the_jobs_seen_to_end_inform_the_gittins_rule_live(
    slicing_on_evidence: CoreHarness, ended: int
) -> None:
    # `ended` jobs run 100 s each and succeed, one more fails; then a runs 700 s, longer than
    # all of them, and b has waited past its patience. With fewer than BET_MIN_ENDED jobs
    # seen to succeed, nothing says which is likelier to end soon: no bet is made and b
    # waits, as FIFO (the failed job is not counted). Among BET_MIN_ENDED, a is an outlier
    # of a heavy tail and b likely the shorter: it is time-sliced in.
    slicing = slicing_on_evidence
    core = slicing.core
    assert core is not None
    await core.register_gpu(gpu(0), "10.0.0.0:50060")

    async def run_for(name: str, seconds: float, succeeded: bool) -> None:
        job = await core.submit(f"r-{name}", whole_gpu(name))
        await core.training.tick()
        slicing.clock.now += seconds
        await core.training.tick()
        await core.report_done(job.job_id, succeeded, 0 if succeeded else 1, "")
        await core.training.tick()

    for n in range(ended):
        await run_for(f"short-{n}", 100, succeeded=True)
    # One that failed says nothing of how long such jobs run: it is not counted.
    await run_for("failed", 10, succeeded=False)
    a = await core.submit("r-a", whole_gpu("a"))
    slicing.clock.now += 1
    b = await core.submit("r-b", whole_gpu("b"))
    assert a.state is JobState.ASSIGNED and b.state is JobState.PENDING
    await core.training.tick()
    slicing.clock.now += SLICE_AFTER + 100
    await core.training.tick()
    if ended < BET_MIN_ENDED:
        assert (await core.get(b.job_id)).state is JobState.PENDING
    else:
        sliced = await assigned(core, b.job_id)
        assert sliced.binding is not None and sliced.binding.time_slice_of == a.job_id


async def beat_memory(core: PlacementCore, gpu_uuid: str, frees: bool, *reports) -> None:
    """A heartbeat saying whether the GPU's dispatcher frees a suspended job's memory."""
    held = [j.job_id for j in core.jobs.holding(gpu_uuid)]
    await core.heartbeat(
        gpu_uuid, 40.0, 0, held, (), training=list(reports), suspend_releases_memory=frees
    )


async def test_jobs_whose_memory_sums_above_the_gpu_take_turns_where_suspension_frees_it(
    slicing: CoreHarness,
) -> None:
    core = slicing.core
    assert core is not None
    await core.register_gpu(gpu(0), "10.0.0.0:50060")  # 80 GiB
    a = await core.submit("r-a", whole_gpu("a", memory_gib=50))
    slicing.clock.now += 1
    b = await core.submit("r-b", whole_gpu("b", memory_gib=50))
    assert a.state is JobState.ASSIGNED and b.state is JobState.PENDING
    # A dispatcher whose suspension keeps the memory resident: 50 + 50 GiB never take turns,
    # and `gpuloom job` and the metric say why.
    await beat_memory(core, "GPU-0", False)
    await core.training.tick()
    slicing.clock.now += 2 * SLICE_AFTER
    for _ in range(2):
        await core.training.tick()
    assert (await core.get(b.job_id)).state is JobState.PENDING
    shown = (await core.get(a.job_id)).training
    assert shown is not None and not shown.memory_in_turns
    assert "stays resident while suspended" in shown.memory_text()
    assert metric("gpuloom_placement_training_suspend_memory_gpus", memory="resident") == 1
    # Its dispatcher frees a suspended job's memory (the driver's checkpoint API): b joins a's
    # group, the group holds the larger member's 50 GiB, and b runs with its own 50 GiB cap.
    await beat_memory(core, "GPU-0", True)
    await core.training.tick()
    b_now = await assigned(core, b.job_id)
    assert b_now.binding is not None and b_now.binding.time_slice_of == a.job_id
    assert b_now.binding.memory_in_turns and b_now.binding.share.memory_bytes == 50 * GIB
    fleet = core.jobs.scheduler.fleet
    fleet.verify()
    assert fleet.slot("GPU-0").memory_used == 50 * GIB
    assert slicing.dispatchers.held["10.0.0.0:50060"][b.job_id].time_slice_of == a.job_id
    assert metric("gpuloom_placement_training_suspend_memory_gpus", memory="freed") == 1
    assert await take_turns(slicing, a.job_id, b.job_id) == [a.job_id, b.job_id] * 2
    # A suspension reported with its memory in host memory shows as such.
    await beat_memory(
        core, "GPU-0", True, replace(report(b.job_id, 0.1, True), memory_released=True)
    )
    await core.training.tick()
    shown = (await core.get(b.job_id)).training
    assert shown is not None and shown.memory_released and "host memory" in shown.memory_text()
    # A resume whose restore failed (no room): it stays suspended and gpuloom job says why.
    why = "restore failed: CUDA_ERROR_OUT_OF_MEMORY (2)"
    failed = replace(report(b.job_id, 0.1, True), memory_released=True, memory_note=why)
    await beat_memory(core, "GPU-0", True, failed)
    shown = (await core.get(b.job_id)).training
    assert shown is not None and shown.memory_note == why
    # Across a restart the group is charged the same (the binding keeps memory in turns).
    await slicing.stop()
    core = await slicing.start()
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    fleet = core.jobs.scheduler.fleet
    fleet.verify()
    assert fleet.slot("GPU-0").memory_used == 50 * GIB
    # a ends: b's 50 GiB stay held; b ends: the GPU is empty.
    await core.report_done(a.job_id, True, 0, "")
    assert fleet.slot("GPU-0").memory_used == 50 * GIB
    await core.report_done(b.job_id, True, 0, "")
    assert fleet.slot("GPU-0").memory_used == 0
    fleet.verify()


@pytest.fixture
async def preempting(tmp_path: Path):
    """gandiva that never time-slices a waiting job in (it would wait a week) but lets the
    head of the queue preempt after 600 s, a job that has run 300 s."""
    knobs = GandivaKnobs(
        slice_after_s=604_800,
        share_after_s=SHARE_AFTER,
        queue_ahead=0,
        bet_min_ended=0,
        preempt_after_s=SLICE_AFTER,
    )
    async for harness in _gandiva(tmp_path, knobs):
        yield harness


async def test_the_head_of_the_queue_preempts_a_later_job_through_suspension(
    preempting: CoreHarness,
) -> None:
    """A backfilled job (it arrived after the head and took the half of the GPU the head could
    not use) is preempted once the head has waited: the head joins its time-slice group (the
    memory in turns: 60 + 30 GiB on an 80 GiB GPU) and runs, the preempted job stays suspended
    until the head ends, then runs on."""
    core = preempting.core
    assert core is not None
    control: FakeTrainingControl = preempting.control  # type: ignore[attr-defined]
    await core.register_gpu(gpu(0), "10.0.0.0:50060")
    await beat_memory(core, "GPU-0", True)
    a = await core.submit("r-a", training("a", memory_gib=40))
    preempting.clock.now += 1
    head = await core.submit("r-head", training("head", memory_gib=60))
    preempting.clock.now += 1
    late = await core.submit("r-late", training("late", memory_gib=30))
    assert a.state is JobState.ASSIGNED and late.state is JobState.ASSIGNED
    assert head.state is JobState.PENDING  # 40 + 60 GiB do not fit; 40 + 30 do
    await core.training.tick()
    await core.report_done(a.job_id, True, 0, "")  # 30 + 60 GiB still do not fit
    assert (await core.get(head.job_id)).state is JobState.PENDING
    before = metric("gpuloom_placement_training_preemptions_total")
    # The head has waited 400 s of its 600: nothing yet.
    for _ in range(4):
        preempting.clock.now += 100
        await core.training.tick()
    assert (await core.get(head.job_id)).state is JobState.PENDING
    preempting.clock.now += 300
    await core.training.tick()
    head_now = await assigned(core, head.job_id)
    assert metric("gpuloom_placement_training_preemptions_total") == before + 1
    assert head_now.binding is not None and head_now.binding.time_slice_of == late.job_id
    assert head_now.binding.memory_in_turns
    fleet = core.jobs.scheduler.fleet
    fleet.verify()
    assert fleet.slot("GPU-0").memory_used == 60 * GIB
    # The head runs; the preempted job waits suspended, quantum after quantum.
    for _ in range(4):
        await core.training.tick()
        assert control.suspended == {late.job_id}
        preempting.clock.now += QUANTUM
    shown = (await core.get(late.job_id)).training
    assert shown is not None and shown.preempted_by == head.job_id
    assert shown.describe() == f"preempted by {head.job_id}"
    # The head ends: the preempted job runs on.
    await core.report_done(head.job_id, True, 0, "")
    await core.training.tick()
    assert control.suspended == set()
    shown = (await core.get(late.job_id)).training
    assert shown is not None and not shown.preempted_by
    assert fleet.slot("GPU-0").memory_used == 30 * GIB
