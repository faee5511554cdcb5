"""The pure placement scheduler, driven directly (no service, no clock, no database): jobs are
placed or wait with a reason, ends give capacity back, a release tries again only the waiting
jobs that the freed GPU can now take, and over random event sequences no GPU is ever
over-committed and no waiting job is left that would fit."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import (
    NO_PROFILES,
    POLICIES,
    Fleet,
    JobRequest,
    Placement,
    PlacementContext,
    Unplaceable,
    get_policy,
)
from gpuloom.policies.placement.scheduler import NO_GPU_YET, Ask, Placed, Scheduler, Waiting

from .helpers import SchedulerRun, fleet_of, gpu, job, scheduler_events

ALL = {name: get_policy(name) for name in POLICIES}


class Counting:
    """MRA, noting every job it is asked about (a fake that counts, not a mock)."""

    name = "mra"

    def __init__(self) -> None:
        self.inner = get_policy("mra")
        self.asked: list[str] = []

    def place(
        self, request: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        self.asked.append(request.job_id)
        return self.inner.place(request, fleet, context)


def ask(job_id: str, sm: int, quota: float, memory_gib: float = 1, at: float = 0.0, **kw) -> Ask:
    policy = kw.pop("policy", "")
    return Ask(job(job_id, sm, quota, memory_gib, **kw), policy=policy, submitted_at=at)


def test_a_job_is_placed_or_waits_with_the_reason() -> None:
    empty = Scheduler(ALL, "mra")
    waiting = empty.submit(ask("early", 50, 50))
    assert waiting == Waiting(ask("early", 50, 50), NO_GPU_YET)
    assert "early" in empty and empty.reason("early") == NO_GPU_YET

    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    first = scheduler.submit(ask("a", 60, 100, 10))
    assert isinstance(first, Placed) and first.placement.gpu_id == "g0"
    assert scheduler.fleet.gpu_of("a") == "g0"
    second = scheduler.submit(ask("b", 60, 100, 10))
    assert isinstance(second, Waiting) and "60% SM" in second.reason
    assert scheduler.waiting == 1 and scheduler.reason("b") == second.reason
    assert not scheduler.wants_decide  # nothing has changed since it was refused


def test_an_unknown_policy_or_a_known_job_is_refused_and_changes_nothing() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    try:
        scheduler.submit(ask("a", 10, 10, policy="no-such"))
    except ValueError as error:
        assert "no-such" in str(error)
    else:
        raise AssertionError("an unknown policy was accepted")
    assert scheduler.fleet.gpu_of("a") is None and scheduler.waiting == 0
    scheduler.submit(ask("a", 10, 10))
    try:
        scheduler.submit(ask("a", 10, 10))
    except ValueError as error:
        assert "already known" in str(error)
    else:
        raise AssertionError("a job was submitted twice")
    assert len(scheduler.fleet.allocations("g0")) == 1


def test_an_end_gives_capacity_back_and_decide_takes_the_best_waiting_job_first() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    assert isinstance(scheduler.submit(ask("holder", 100, 100)), Placed)
    scheduler.submit(ask("old-low", 100, 100, at=1, priority=5))
    scheduler.submit(ask("new-high", 100, 100, at=3, priority=1))
    scheduler.submit(ask("old-high", 100, 100, at=2, priority=1))
    assert scheduler.end("holder") is True
    assert scheduler.wants_decide
    decided = scheduler.decide()
    assert [p.ask.job_id for p in decided.placed] == ["old-high"]
    # old-high placed; new-high refused, and its bucket stops there; old-low (another priority,
    # another bucket) refused.
    assert decided.tried == 3
    assert not scheduler.wants_decide
    assert scheduler.end("old-low") is False and "old-low" not in scheduler  # stops waiting
    assert scheduler.end("old-low") is False  # a second end is harmless


def test_a_release_tries_only_the_bucket_the_freed_gpu_can_now_hold() -> None:
    counting = Counting()
    scheduler = Scheduler({"mra": counting}, "mra", fleet=fleet_of(gpu("g0", memory_gib=80)))
    scheduler.submit(ask("big", 50, 100, 40))
    scheduler.submit(ask("small", 50, 100, 10))
    # Three buckets wait: too much memory for what a release of `small` frees, another GPU
    # model, and the one that fits (ten identical jobs).
    for i in range(10):
        scheduler.submit(ask(f"hungry-{i}", 50, 100, 60, at=i))
        scheduler.submit(ask(f"pinned-{i}", 50, 100, 1, at=i, gpu_model="A100-80GB"))
        scheduler.submit(ask(f"fits-{i}", 50, 100, 10, at=10 + i))
    assert scheduler.waiting == 30 and scheduler.buckets == 3
    counting.asked.clear()

    scheduler.end("small")
    decided = scheduler.decide()

    assert [p.ask.job_id for p in decided.placed] == ["fits-0"]
    # The fitting bucket's head (placed) and the next one (refused: the rest asks the same);
    # nothing of the other 29 waiting jobs.
    assert counting.asked == ["fits-0", "fits-1"] and decided.tried == 2
    assert scheduler.waiting == 29


def test_a_bucket_whose_reason_changes_tells_each_of_its_jobs() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    for i in range(3):
        scheduler.submit(ask(f"w{i}", 100, 100, at=i, gpu_model="A100-80GB"))
    assert scheduler.reason("w2").startswith("no GPU of model A100-80GB (models: H100-80GB)")
    scheduler.fleet.add_gpu(gpu("a0", "A100-80GB"))
    scheduler.capacity_changed("a0")
    decided = scheduler.decide()
    assert [p.ask.job_id for p in decided.placed] == ["w0"]
    # w1 was refused for another reason now: both jobs still waiting are told.
    assert [(w.ask.job_id, w.reason) for w in decided.reasons] == [
        ("w1", "no GPU of model A100-80GB has 100% quota x 100% SM free"),
        ("w2", "no GPU of model A100-80GB has 100% quota x 100% SM free"),
    ]
    assert scheduler.reason("w2") == decided.reasons[1].reason


def test_a_failed_bind_gives_capacity_back_and_the_job_waits_to_be_tried_again() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0"), gpu("g1")))
    first = scheduler.submit(ask("a", 100, 100))
    assert isinstance(first, Placed)
    bad = first.placement.gpu_id
    scheduler.fleet.set_schedulable(bad, False)  # the caller keeps the GPU from taking work
    scheduler.bind_failed(ask("a", 100, 100), f"binding on GPU {bad} failed")
    assert scheduler.fleet.gpu_of("a") is None and scheduler.reason("a") is not None
    decided = scheduler.decide()
    [again] = decided.placed
    assert again.ask.job_id == "a" and again.placement.gpu_id != bad


def test_a_decision_taken_back_changes_nothing_else() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    scheduler.submit(ask("holder", 100, 100))
    scheduler.submit(ask("w", 100, 100, at=1))
    reason = scheduler.reason("w")
    scheduler.end("holder")
    [placed] = scheduler.decide().placed
    scheduler.take_back("w", placed.ask, reason)  # its record failed: as before the decision
    assert scheduler.fleet.gpu_of("w") is None and scheduler.reason("w") == reason
    assert not scheduler.wants_decide  # no spin on a failing record; the next change retries
    fresh = scheduler.submit(ask("fresh", 10, 10))
    assert isinstance(fresh, Placed)
    scheduler.take_back("fresh")
    assert scheduler.fleet.gpu_of("fresh") is None and "fresh" not in scheduler


def test_jobs_restored_after_a_restart_are_tried_at_the_next_decide() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    scheduler.restore(ask("back", 50, 50, at=1), "no GPU has 50% quota x 50% SM free")
    assert scheduler.wants_decide
    assert [p.ask.job_id for p in scheduler.decide().placed] == ["back"]


def test_skipped_jobs_are_not_tried_but_stay_due() -> None:
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("g0")))
    scheduler.submit(ask("holder", 100, 100))
    scheduler.submit(ask("ending", 100, 100, at=1))
    scheduler.end("holder")
    assert scheduler.decide(skip={"ending"}).placed == ()
    assert scheduler.wants_decide  # tried once it is no longer skipped
    assert [p.ask.job_id for p in scheduler.decide().placed] == ["ending"]


# ---- properties ----

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPES = [
    (sm, quota, mem) for sm in (20, 50, 100) for quota in (25, 50, 100) for mem in (4, 10, 30)
]

submits = st.tuples(
    st.just("submit"),
    st.sampled_from(SHAPES),
    st.integers(0, 2),  # priority
    st.sampled_from(["", "A", "B"]),  # model
    st.sampled_from(["mra", "binpack", "spread", "time-share"]),
)
events = scheduler_events(submits, gpus=2, max_size=60)


@FAST
@given(events=events)
def test_no_gpu_is_over_committed_and_no_waiting_job_fits_after_decide(events: list) -> None:
    # Two small GPUs: jobs wait often, and releases often let some of them in.
    fleet = fleet_of(gpu("g0", "A", 40), gpu("g1", "B", 80))
    run = SchedulerRun(Scheduler(ALL, "mra", fleet=fleet), fleet)
    scheduler, asks = run.scheduler, run.asks
    for n, event in enumerate(events):
        kind = event[0]
        if kind == "submit":
            (sm, quota, mem), priority, model, policy = event[1:]
            a = ask(f"j{n}", sm, quota, mem, at=n, priority=priority, gpu_model=model)
            run.submit(Ask(a.request, policy=policy, submitted_at=n))
        elif kind == "end" and asks:
            run.end(event[1])
        elif kind == "bind_failed" and (job_id := run.holding(event[1])):
            gpu_id = fleet.gpu_of(job_id)
            assert gpu_id is not None
            fleet.set_schedulable(gpu_id, False)  # as the service suspends it
            scheduler.bind_failed(asks[job_id], "binding failed")
        elif kind == "heartbeat":
            run.heartbeat(event[1])
        elif kind == "decide":
            # Completeness: no waiting job but the skipped ones would fit now.
            for a in run.decide(event[1]):
                policy = ALL[scheduler.policy_name(a)]
                answer = policy.place(a.request, fleet, NO_PROFILES)
                assert isinstance(answer, Unplaceable), (a.job_id, answer)
        fleet.verify()  # no overlap, no memory over-committed, indexes exact
        for job_id in asks:  # every job is either waiting or holding, never both
            assert (job_id in scheduler) != (fleet.gpu_of(job_id) is not None), job_id
