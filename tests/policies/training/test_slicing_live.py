"""Over-subscription on the live cluster (gpuloom/policies/training/live.py with `gandiva`):
a pending one-GPU training job is time-sliced into a full GPU's round-robin by the policy's
own rules (its wait, the service of the jobs it joins, the queue ahead of it), only into GPUs
holding training jobs, never an elastic job's or a GPU busy with other work; and the live view
packs in place only. Head-of-queue preemption is taken live onto exactly one later job's GPUs."""

from __future__ import annotations

from gpuloom.policies.training.gandiva import GandivaPolicy
from gpuloom.policies.training.live import (
    LiveGpu,
    LiveGroupState,
    LiveJob,
    LivePending,
    LivePlan,
    live_plan,
    live_view,
)
from gpuloom.policies.training.model import Place, Suspend

GIB = 1 << 30
EFFICIENCY = 60 / 61
HOUR = 3600.0


def gpus(n: int, busy: tuple[int, ...] = ()) -> list[LiveGpu]:
    return [LiveGpu(f"g{i}", "n1", "A100", 80 * GIB, i in busy) for i in range(n)]


def running(job_id: str, gpu: str, attained_s: float, **more: object) -> LiveJob:
    return LiveJob(job_id, gpu, "resnet", 8 * GIB, 0.0, attained_s=attained_s, **more)  # type: ignore[arg-type]


def waiting(job_id: str, submitted_at: float, sliceable: bool = True) -> LivePending:
    return LivePending(job_id, 1, 8 * GIB, submitted_at, sliceable=sliceable)


def plan(
    cluster: list[LiveGpu],
    jobs: list[LiveJob],
    pending: list[LivePending],
    now: float,
    groups: dict[str, LiveGroupState] | None = None,
    policy: GandivaPolicy | None = None,
) -> LivePlan:
    live = live_view(cluster, jobs, groups or {}, now, EFFICIENCY, pending=pending)
    return live_plan(live, policy or GandivaPolicy(queue_ahead=0, bet_min_ended=0))


def test_a_pending_job_is_time_sliced_in_once_the_rules_allow() -> None:
    cluster = gpus(2)
    jobs = [running("a", "g0", 2 * HOUR), running("b", "g1", 0.5 * HOUR)]
    # Waited half an hour: it waits on for a GPU of its own.
    assert plan(cluster, jobs, [waiting("c", 0.0)], 0.5 * HOUR).slices == ()
    # Waited two hours: into the round-robin of the job that has had its hour of service
    # (not the one that has had half an hour: it may be the shorter).
    assert plan(cluster, jobs, [waiting("c", 0.0)], 2 * HOUR).slices == (("c", "g0"),)
    # With two hours each, the lower GPU first; a job the policy may not slice is not.
    both = [running("a", "g0", 2 * HOUR), running("b", "g1", 2 * HOUR)]
    assert plan(cluster, both, [waiting("c", 0.0)], 2 * HOUR).slices == (("c", "g0"),)
    assert plan(cluster, both, [waiting("c", 0.0, sliceable=False)], 2 * HOUR).slices == ()


def test_the_queue_ahead_rule_holds_live() -> None:
    cluster = gpus(1)
    jobs = [running("a", "g0", 3 * HOUR)]
    pending = [waiting("c", 0.0), waiting("d", 1.0), waiting("e", 2.0)]
    # Two jobs of its shape must wait ahead of it (the default): only the third is sliced in.
    sliced = plan(cluster, jobs, pending, 2 * HOUR, policy=GandivaPolicy(bet_min_ended=0)).slices
    assert sliced == (("e", "g0"),)


def test_no_slice_into_a_gpu_busy_with_other_work_or_an_elastic_job() -> None:
    cluster = gpus(2, busy=(1,))
    elastic = running("el", "g0", 3 * HOUR, gpus=1, max_gpus=2)
    policy = GandivaPolicy(queue_ahead=0, share_after_s=0)
    assert plan(cluster, [elastic], [waiting("c", 0.0)], 2 * HOUR, policy=policy).slices == ()


def test_the_live_view_packs_in_place_only() -> None:
    """Two measured jobs time-sliced on g0 and one alone on g1, all of a packable type: the
    policy packs the pair on g0 in place; moving one onto g1 (a busy GPU) is never planned."""
    cluster = gpus(2)
    jobs = [
        running("a", "g0", 0.0, utilisation=0.3),
        running("b", "g0", 0.0, utilisation=0.4),
        running("c", "g1", 0.0, utilisation=0.1),
    ]
    result = plan(cluster, jobs, [], 0.0)
    assert result.pack == ("g0",)
    assert result.moves == ()


def preempting_plan(cluster: list[LiveGpu], jobs: list[LiveJob], pending, preempt: bool):
    """gandiva that never time-slices a waiting job in, and lets the head preempt after an
    hour jobs that have had an hour of service, asked at two hours."""
    policy = GandivaPolicy(
        slice_after_s=1e9, share_after_s=HOUR, queue_ahead=0, bet_min_ended=0, preempt_after_s=HOUR
    )
    live = live_view(cluster, jobs, {}, 2 * HOUR, EFFICIENCY, pending=pending, preempt=preempt)
    return live_plan(live, policy)


def test_the_head_preempts_live_onto_exactly_one_later_jobs_gpus() -> None:
    late = LiveJob("late", "g0", "resnet", 8 * GIB, 10.0, attained_s=2 * HOUR)
    head = LivePending("head", 1, 8 * GIB, 0.0, sliceable=True)
    taken = preempting_plan(gpus(1), [late], [head], preempt=True)
    assert taken.preemptions == (("head", "g0", "late"),) and taken.slices == ()
    # Not where the view forbids it, nor for a job that arrived before the head.
    assert preempting_plan(gpus(1), [late], [head], preempt=False).preemptions == ()
    early = LiveJob("early", "g0", "resnet", 8 * GIB, 0.0, attained_s=2 * HOUR)
    later_head = LivePending("head", 1, 8 * GIB, 10.0, sliceable=True)
    assert preempting_plan(gpus(1), [early], [later_head], preempt=True).preemptions == ()
    # A head of two GPUs that would take one free GPU and the late job's: the policy preempts,
    # but a binding joins one time-slice group, so it is not taken live.
    wide = LivePending("head", 2, 8 * GIB, 0.0, sliceable=True)
    live = live_view(gpus(2), [late], {}, 2 * HOUR, EFFICIENCY, pending=[wide], preempt=True)
    decided = GandivaPolicy(
        slice_after_s=1e9, share_after_s=HOUR, queue_ahead=0, bet_min_ended=0, preempt_after_s=HOUR
    ).decide(live.view)
    assert [a.reason for a in decided if isinstance(a, Suspend | Place)] == ["preempt", "preempt"]
    assert preempting_plan(gpus(2), [late], [wide], preempt=True).preemptions == ()
