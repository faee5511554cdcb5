"""The training schedulers as pure functions of a cluster view: FIFO's head-of-line order,
Gandiva's affinity, over-subscription, de-fragmentation, spreading, packing and its undo."""

from __future__ import annotations

import math
from dataclasses import replace
from types import MappingProxyType

import pytest

from gpuloom.policies.registry import UnknownPolicyError
from gpuloom.policies.training.fifo import FifoPolicy
from gpuloom.policies.training.gandiva import SLICE_AFTER_S, GandivaKnobs, GandivaPolicy
from gpuloom.policies.training.live import (
    OTHER_WORK,
    LiveGpu,
    LiveGroupState,
    LiveJob,
    LivePending,
    live_plan,
    live_view,
)
from gpuloom.policies.training.model import (
    Action,
    ClusterView,
    FreeMap,
    Group,
    Job,
    Pack,
    Place,
    Resize,
    Server,
    ServiceHistory,
    Slice,
    Suspend,
    Unpack,
    round_robin_turn,
)
from gpuloom.policies.training.registry import POLICIES, get_policy

EFFICIENCY = 60 / 61
GIB_ = 1 << 30


def view(
    servers: list[int],
    groups: list[Group],
    jobs: list[Job],
    waiting: list[int] = (),  # type: ignore[assignment]
    packable: set[tuple[str, str, str]] = frozenset(),  # type: ignore[assignment]
    now: float = 0.0,
    attained: dict[int, float] | None = None,
) -> ClusterView:
    return ClusterView(
        now_s=now,
        servers=tuple(Server("v100", n) for n in servers),
        jobs=MappingProxyType({j.id: j for j in jobs}),
        groups=tuple(groups),
        waiting=tuple(waiting),
        slice_efficiency=EFFICIENCY,
        packable=frozenset(packable),
        attained_s=MappingProxyType(attained or {}),
    )


def job(i: int, gpus: int = 1, kind: str = "A", util: float = 0.5) -> Job:
    return Job(i, kind, gpus, float(i), util)


def early(i: int, gpus: int = 1) -> Job:
    """A running job that arrived before every waiting one (no head of the queue preempts it)."""
    return Job(i, "A", gpus, -float(i), 0.5)


# The views of these tests hold no ended jobs: the patience rules are tested with the one
# that needs `bet_min_ended` of them off (test_gittins.py tests it).
NO_HISTORY = {"bet_min_ended": 0}


def eager(**options: int) -> GandivaPolicy:
    """Gandiva time-slicing at once, with any job (the paper's reactive mode): for the tests
    of the mechanisms; the patience rules have tests of their own."""
    return GandivaPolicy(
        slice_after_s=0.0, share_after_s=0.0, queue_ahead=0, bet_min_ended=0, **options
    )


def both_ways(a: str, b: str) -> set[tuple[str, str, str]]:
    return {("v100", a, b), ("v100", b, a)}


def test_the_registry_knows_fifo_and_gandiva() -> None:
    assert list(POLICIES) == ["fifo", "gandiva", "gandiva-gs"]
    assert get_policy("gandiva").name == "gandiva"
    assert get_policy("gandiva-gs").name == "gandiva-gs"
    assert get_policy("fifo") is not get_policy("fifo")  # one object per run
    with pytest.raises(
        UnknownPolicyError, match=r"known: fifo, gandiva, gandiva-gs \(gandiva:HEIGHT\)"
    ):
        get_policy("tiresias")
    assert get_policy("gandiva:2").name == "gandiva:2"
    for bad in ("gandiva:0", "gandiva:x", "gandiva:65", "fifo:2"):
        with pytest.raises(UnknownPolicyError, match=f"policy '{bad}'"):
            get_policy(bad)


def test_fifo_starts_in_arrival_order_and_the_head_blocks_the_rest() -> None:
    # One 4-GPU server, 2 GPUs in use: the 4-GPU head waits and the 1-GPU job behind it too.
    busy = Group(0, ((0, 0), (0, 1)), (9,))
    state = view([4], [busy], [job(9, 2), job(1, 4), job(2, 1)], waiting=[1, 2])
    assert FifoPolicy().decide(state) == []
    # Without the head, the 1-GPU job takes a GPU, best fit: the fuller of two servers.
    state = view([4, 4], [busy], [job(9, 2), job(2, 1), job(3, 1)], waiting=[2, 3])
    assert FifoPolicy().decide(state) == [Place(2, ((0, 2),)), Place(3, ((0, 3),))]


def test_fifo_gives_a_job_wider_than_a_server_whole_servers() -> None:
    state = view([4, 4, 4], [Group(0, ((1, 0),), (9,))], [job(9), job(1, 6)], waiting=[1])
    (place,) = FifoPolicy().decide(state)
    assert place == Place(1, ((0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1)))


def test_a_job_goes_only_to_gpu_types_it_runs_on() -> None:
    servers = (Server("k80", 4), Server("v100", 4))
    picky = Job(1, "A", 2, 0.0, 0.5, frozenset({"v100"}))
    state = ClusterView(
        0.0, servers, MappingProxyType({1: picky}), (), (1,), EFFICIENCY, frozenset()
    )
    assert FifoPolicy().decide(state) == [Place(1, ((1, 0), (1, 1)))]
    assert GandivaPolicy().decide(state) == [Place(1, ((1, 0), (1, 1)))]
    # With the V100 server taken by a 2-GPU job it time-slices there, never on the free k80s.
    busy = (Group(0, ((1, 0), (1, 1)), (7,)), Group(1, ((1, 2), (1, 3)), (8,)))
    jobs = MappingProxyType({1: picky, 7: job(7, 2), 8: job(8, 2)})
    state = ClusterView(0.0, servers, jobs, busy, (1,), EFFICIENCY, frozenset())
    assert FifoPolicy().decide(state) == []
    assert eager().decide(state) == [Slice(1, 0)]


def test_gandiva_takes_the_gpu_type_a_job_runs_fastest_on_where_it_is_known() -> None:
    # A small k80 server and a bigger V100 one, both empty: by best fit alone a 1-GPU job
    # would take the k80 server (FIFO does); where the job is known to run faster on V100s it
    # goes there, and with no speeds known best fit decides.
    servers = (Server("k80", 2), Server("v100", 4))
    fast_on_v100 = Job(1, "A", 1, 0.0, 0.5, fastest_on=("v100", "k80"))
    unknown = Job(1, "A", 1, 0.0, 0.5)
    for one, where in ((fast_on_v100, (1, 0)), (unknown, (0, 0))):
        state = ClusterView(
            0.0, servers, MappingProxyType({1: one}), (), (1,), EFFICIENCY, frozenset()
        )
        assert GandivaPolicy().decide(state) == [Place(1, (where,))]
        assert FifoPolicy().decide(state) == [Place(1, ((0, 0),))]
    assert fast_on_v100.speed_rank("k80") == 1 and unknown.speed_rank("k80") == 0


def test_gandiva_places_by_affinity_then_empty_server() -> None:
    # Server 0 runs a 2-GPU job, server 1 a 1-GPU job, server 2 is empty.
    groups = [Group(0, ((0, 0), (0, 1)), (7,)), Group(1, ((1, 0),), (8,))]
    jobs = [job(7, 2), job(8, 1), job(1, 2), job(2, 2), job(3, 4)]
    actions = GandivaPolicy().decide(view([4, 4, 4], groups, jobs, waiting=[1, 2, 3]))
    # The first 2-GPU job joins its kind on server 0; the next finds server 0 full and takes
    # the empty server 2 (not server 1 of the 1-GPU jobs); the 4-GPU job finds no server with
    # 4 free GPUs, 5 free in all: the 1-GPU job moves off server 1 (to server 2, the fullest
    # that holds it) and the 4-GPU job takes server 1.
    assert actions == [
        Place(1, ((0, 2), (0, 3))),
        Place(2, ((2, 0), (2, 1))),
        Place(8, ((2, 2),), reason="defrag"),
        Place(3, ((1, 0), (1, 1), (1, 2), (1, 3))),
    ]


def test_gandiva_takes_the_smallest_empty_server_and_keeps_the_big_ones_whole() -> None:
    # Servers of 4, 4 and 2 GPUs, all empty (a cluster such as `k80:10`): the 1-GPU job goes
    # to the 2-GPU server, as best fit would; then an 8-GPU job still finds two whole servers.
    jobs = [job(1, 1), job(2, 8)]
    actions = GandivaPolicy().decide(view([4, 4, 2], [], jobs, waiting=[1, 2]))
    assert actions == [
        Place(1, ((2, 0),)),
        Place(2, ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3))),
    ]


def test_gandiva_over_subscribes_the_least_high_group_up_to_the_cap() -> None:
    groups = [Group(0, ((0, 0),), (7, 8)), Group(1, ((0, 1),), (9,))]
    jobs = [job(7), job(8), job(9), job(1), job(2), job(3, 2)]
    actions = eager(max_height=2).decide(view([2], groups, jobs, waiting=[1, 2, 3], now=10))
    # Job 1 slices with the single job 9; then every group is at the cap: job 2 waits, and
    # the 2-GPU job 3 has no group of its size.
    assert actions == [Slice(1, 1)]


def test_gandiva_waits_an_hour_for_free_gpus_then_slices_with_the_job_served_longest() -> None:
    # One server of two GPUs: job 7 has run 10 min, job 8 two hours; job 1 arrived at 0.
    groups = [Group(0, ((0, 0),), (7,)), Group(1, ((0, 1),), (8,))]
    jobs = [job(7), job(8), Job(1, "A", 1, 0.0, 0.5)]
    served = {7: 600.0, 8: 7200.0}
    policy = GandivaPolicy(slice_after_s=3600.0, share_after_s=3600.0, queue_ahead=0, **NO_HISTORY)
    early = view([2], groups, jobs, waiting=[1], now=3599.0, attained=served)
    assert policy.decide(early) == []  # GPUs may free within the hour: it waits, as FIFO
    late = view([2], groups, jobs, waiting=[1], now=3600.0, attained=served)
    # Group 0 is as high and comes first, but its job has had 10 minutes of service only.
    assert policy.decide(late) == [Slice(1, 1)]
    fresh = view([2], groups, jobs, waiting=[1], now=3600.0, attained={7: 600.0, 8: 60.0})
    assert policy.decide(fresh) == []  # both jobs barely started: nobody to share with


def test_gandiva_lets_a_server_drain_for_a_gpu_count_no_group_has() -> None:
    # One server of four GPUs held by a 4-GPU job that has run for hours. A 1-GPU job (1)
    # waits: no free GPU, no group of its count. The 4-GPU job 2 behind it may not slice
    # onto that server: the round-robin would never drain and job 1 never run.
    groups = [Group(0, ((0, 0), (0, 1), (0, 2), (0, 3)), (7,))]
    jobs = [early(7, 4), Job(1, "A", 1, 0.0, 0.5), Job(2, "A", 4, 1.0, 0.5)]
    # (No least-attained-service rule here: group 0 below holds two jobs with hours each.)
    policy = GandivaPolicy(slice_after_s=3600.0, share_after_s=0.0, queue_ahead=0, **NO_HISTORY)
    state = view([4], groups, jobs, waiting=[1, 2], now=10_000.0, attained={7: 9000.0})
    assert policy.decide(state) == []
    alone = view([4], groups, jobs, waiting=[2], now=10_000.0, attained={7: 9000.0})
    assert policy.decide(alone) == [Slice(2, 0)]
    # On two servers it holds only the one with fewer jobs; job 2 slices on the other.
    groups = [
        Group(0, ((0, 0), (0, 1), (0, 2), (0, 3)), (7, 9)),
        Group(1, ((1, 0), (1, 1), (1, 2), (1, 3)), (8,)),
    ]
    jobs = [*(early(i, 4) for i in (7, 8, 9)), Job(1, "A", 1, 0.0, 0.5), Job(2, "A", 4, 1.0, 0.5)]
    served = {7: 9000.0, 8: 9000.0, 9: 9000.0}
    state = view([4, 4], groups, jobs, waiting=[1, 2], now=10_000.0, attained=served)
    assert policy.decide(state) == [Slice(2, 0)]  # not the lower group 1: held for job 1


def test_gandiva_slices_in_only_a_job_with_two_of_its_count_waiting_ahead() -> None:
    # One server of two GPUs, both jobs with hours of service; four one-GPU jobs have waited
    # over an hour. The first two would get GPUs of their own at the next two ends: they
    # wait, as FIFO; the third slices in with the least high group, the fourth with the other.
    groups = [Group(0, ((0, 0),), (7,)), Group(1, ((0, 1),), (8,))]
    jobs = [early(7), early(8), *(Job(i, "A", 1, float(i), 0.5) for i in (1, 2, 3, 4))]
    state = view(
        [2], groups, jobs, waiting=[1, 2, 3, 4], now=4000.0, attained={7: 9000.0, 8: 9000.0}
    )
    assert GandivaPolicy(**NO_HISTORY).decide(state) == [Slice(3, 0), Slice(4, 1)]
    assert GandivaPolicy(queue_ahead=0, **NO_HISTORY).decide(state) == [Slice(1, 0), Slice(2, 1)]


def test_gandiva_suspends_the_later_of_two_jobs_that_have_had_their_share() -> None:
    # Job 9 was sliced in with job 7 and has now had an hour of service too: sharing on would
    # finish both later than one after the other. Job 9 (the later arrival) goes back to the
    # queue ahead of job 10, is not sliced in again (it waits for GPUs of its own) and keeps
    # job 10, behind it, near the head of the queue.
    groups = [Group(0, ((0, 0),), (7, 9)), Group(1, ((0, 1),), (8,))]
    jobs = [job(7), job(8), job(9), job(10), job(11), job(12)]
    served = {7: 9000.0, 8: 9000.0, 9: 3600.0}
    state = view([2], groups, jobs, waiting=[10], now=9000.0, attained=served)
    assert GandivaPolicy(**NO_HISTORY).decide(state) == [Suspend(9)]
    # A job still short of its share stays; a third waiting job, two ahead, slices in.
    served[9] = 1800.0
    state = view([2], groups, jobs, waiting=[10, 11, 12], now=9000.0, attained=served)
    assert GandivaPolicy(**NO_HISTORY).decide(state) == [Slice(12, 1)]
    # Without the least-attained-service rule (the paper's round-robin) nobody is suspended.
    served[9] = 9000.0
    state = view([2], groups, jobs, waiting=[10], now=9000.0, attained=served)
    policy = GandivaPolicy(share_after_s=0.0, queue_ahead=0, **NO_HISTORY)
    assert policy.decide(state) == [Slice(10, 1)]


def lengths(hours: dict[int, float]) -> ServiceHistory:
    """Five ended jobs of each GPU count, all of the given length."""
    history = ServiceHistory()
    for gpus, h in hours.items():
        for _ in range(5):
            history.add(gpus, h * 3600.0)
    return history


def test_gandiva_preempts_for_the_head_of_the_queue_the_later_jobs_on_the_gpus_it_needs() -> None:
    # Three servers of four GPUs. Job 1 (8 GPUs) has waited an hour at the head of the queue;
    # the jobs behind it took GPUs it needs (backfilling). Server 0 holds job 20, which
    # arrived before it; server 1 job 21 (4 GPUs), server 2 job 22 (2 GPUs; 2 free), both
    # later and with an hour of service each. 8-GPU jobs have run 2 h, the others 100 h: the
    # head is the likelier to end soon. The two whole servers that cost the fewest GPUs are 1
    # and 2: their jobs go back to the queue, behind job 1.
    groups = [
        Group(0, tuple((0, i) for i in range(4)), (20,)),
        Group(1, tuple((1, i) for i in range(4)), (21,)),
        Group(2, ((2, 0), (2, 1)), (22,)),
    ]
    jobs = [early(20, 4), job(21, 4), job(22, 2), Job(1, "A", 8, 0.0, 0.5)]
    served = {20: 9000.0, 21: 3600.0, 22: 3600.0}
    state = view([4, 4, 4], groups, jobs, waiting=[1], now=3600.0, attained=served)
    state = replace(state, ended=lengths({8: 2, 4: 100, 2: 100}))
    wide = tuple((n, i) for n in (1, 2) for i in range(4))
    expected = [
        Suspend(22, reason="preempt"),
        Suspend(21, reason="preempt"),
        Place(1, wide, reason="preempt"),
    ]
    assert GandivaPolicy().decide(state) == expected
    _assert_consistent(state, expected)
    # Not before it has waited an hour; not a job short of its hour of service (it is as
    # likely as the head to end soon), nor one that arrived before it; not where the view
    # says no (live: a placed job stays placed), nor with the rule off.
    assert GandivaPolicy().decide(replace(state, now_s=3599.0)) == []
    assert GandivaPolicy().decide(replace(state, attained_s={**served, 21: 3599.0})) == []
    assert GandivaPolicy().decide(replace(state, preempt=False)) == []
    assert GandivaPolicy(preempt_after_s=math.inf).decide(state) == []
    # Not when the head is the likelier to run long (8-GPU jobs ran 100 h, the others 1.5 h:
    # an hour in, they are near their end), nor with fewer than five ended jobs of a count.
    assert GandivaPolicy().decide(replace(state, ended=lengths({8: 100, 4: 1.5, 2: 1.5}))) == []
    assert GandivaPolicy().decide(replace(state, ended=lengths({8: 2, 4: 100}))) == []
    # A job that fits one server: the later arrivals there go first, until it fits.
    groups = [
        Group(0, tuple((0, i) for i in range(4)), (20,)),
        Group(1, ((1, 0),), (23,)),
        Group(2, ((1, 1),), (24,)),
        Group(3, ((1, 2), (1, 3)), (25,)),
    ]
    jobs = [early(20, 4), job(23), job(24), job(25, 2), Job(1, "A", 3, 0.0, 0.5)]
    served = {n: 3600.0 for n in (20, 23, 24, 25)}
    state = view([4, 4], groups, jobs, waiting=[1], now=3600.0, attained=served)
    state = replace(state, ended=lengths({3: 2, 2: 100, 1: 100}))
    assert GandivaPolicy().decide(state) == [
        Suspend(25, reason="preempt"),
        Suspend(24, reason="preempt"),
        Place(1, ((1, 1), (1, 2), (1, 3)), reason="preempt"),
    ]
    # Only the head preempts: a job behind it waits its turn.
    head = Job(0, "A", 8, -1.0, 0.5)  # waits for more GPUs than the cluster frees
    behind = replace(state, jobs={**state.jobs, 0: head}, waiting=(0, 1))
    assert GandivaPolicy().decide(behind) == []


def test_gandiva_asks_to_be_called_when_a_rule_of_time_may_first_change_its_mind() -> None:
    policy = GandivaPolicy()  # an hour's wait, an hour's service
    groups = [Group(0, ((0, 0),), (7,)), Group(1, ((0, 1),), (8, 9))]
    jobs = [job(7), job(8), job(9), Job(1, "A", 1, 100.0, 0.5)]
    served = {7: 3000.0, 8: 9000.0, 9: 3000.0}
    state = view([2], groups, jobs, waiting=[1], now=1000.0, attained=served)
    # Job 7 alone reaches an hour of service first: 600 s (job 1 has waited an hour at
    # 3700 s; job 9, time-sliced two ways, has its hour at 1000 + 600 x 2 x 61/60).
    assert policy.review_at(state) == pytest.approx(1600.0)
    served[7] = 3599.0  # a second short: asked no sooner than a review step
    assert policy.review_at(state) == pytest.approx(1060.0)
    idle = view([2], [Group(0, ((0, 0),), (7,))], [job(7)], now=1000.0, attained=served)
    assert policy.review_at(idle) == float("inf")  # nobody waits, nothing time-sliced
    assert FifoPolicy().review_at(state) == float("inf")


def test_gandiva_defragments_a_server_for_a_job_that_fits_nowhere_whole() -> None:
    # Two 4-GPU servers, two 1-GPU jobs on each (2 + 2 free): a 4-GPU job needs one server.
    groups = [
        Group(0, ((0, 0),), (5,)),
        Group(1, ((0, 1),), (6,)),
        Group(2, ((1, 0),), (7,)),
        Group(3, ((1, 2),), (8,)),
    ]
    jobs = [job(5), job(6), job(7), job(8), job(1, 4)]
    actions = GandivaPolicy().decide(view([4, 4], groups, jobs, waiting=[1]))
    moves = [a for a in actions if isinstance(a, Place) and a.reason == "defrag"]
    assert len(moves) == 2
    emptied = {s for a in actions if a.job == 1 for s, _ in a.slots}  # type: ignore[union-attr]
    assert len(emptied) == 1 and actions[-1].job == 1  # type: ignore[union-attr]
    assert {s for m in moves for s, _ in m.slots}.isdisjoint(emptied)
    _assert_consistent(view([4, 4], groups, jobs, waiting=[1]), actions)


def test_gandiva_spreads_a_time_sliced_job_onto_a_free_gpu() -> None:
    state = view([2], [Group(0, ((0, 0),), (7, 8))], [job(7), job(8)])
    assert GandivaPolicy().decide(state) == [Place(8, ((0, 1),), reason="spread")]


def test_gandiva_packs_the_lowest_utilisation_job_onto_the_lowest_utilisation_gpu() -> None:
    # GPU 0 time-slices jobs 1 (util 0.2) and 2 (0.9); GPUs 1 and 2 run jobs 3 (0.6), 4 (0.3).
    groups = [
        Group(0, ((0, 0),), (1, 2)),
        Group(1, ((0, 1),), (3,)),
        Group(2, ((0, 2),), (4,)),
    ]
    jobs = [job(1, util=0.2), job(2, util=0.9), job(3, util=0.6), job(4, util=0.3)]
    actions = GandivaPolicy().decide(view([3], groups, jobs, packable=both_ways("A", "A")))
    assert actions == [Pack(1, 2)]  # job 1 onto job 4's GPU
    # A pair that does not fit one GPU's memory is never tried.
    assert GandivaPolicy().decide(view([3], groups, jobs)) == []


def test_gandiva_packs_a_time_sliced_pair_in_place() -> None:
    state = view(
        [1],
        [Group(0, ((0, 0),), (1, 2))],
        [job(1, kind="A", util=0.4), job(2, kind="B", util=0.3)],
        packable=both_ways("A", "B"),
    )
    assert GandivaPolicy().decide(state) == [Pack(2, 0)]


def test_gandiva_undoes_a_packing_worse_than_time_slicing_and_does_not_retry_it() -> None:
    jobs = [job(1, kind="A"), job(2, kind="B")]
    packable = both_ways("A", "B")
    policy = GandivaPolicy()
    good = Group(0, ((0, 0),), (1, 2), packed=True, packed_gain=1.3)
    assert policy.decide(view([1], [good], jobs, packable=packable)) == []
    bad = Group(0, ((0, 0),), (1, 2), packed=True, packed_gain=0.9)
    # 0.9 of the pair's solo throughput packed, time-slicing gives 60/61: undo.
    assert policy.decide(view([1], [bad], jobs, packable=packable)) == [Unpack(0)]
    sliced = Group(0, ((0, 0),), (1, 2))
    assert policy.decide(view([1], [sliced], jobs, packable=packable)) == []
    # A new policy (another run) has not learned it: it packs the pair.
    assert GandivaPolicy().decide(view([1], [sliced], jobs, packable=packable)) == [Pack(1, 0)]


def test_gandiva_waits_a_packing_out_until_its_trial_is_measured() -> None:
    trial = Group(0, ((0, 0),), (1, 2), packed=True, packed_gain=None)
    state = view([1], [trial], [job(1, kind="A"), job(2, kind="B")], packable=both_ways("A", "B"))
    assert GandivaPolicy().decide(state) == []


def _assert_consistent(state: ClusterView, actions: list[Action]) -> None:
    """Applying the actions (placements, suspensions) in order never puts two groups on one
    GPU."""
    free = FreeMap(state.servers, state.groups)
    where = {j: g.id for g in state.groups for j in g.jobs}
    members = {g.id: list(g.jobs) for g in state.groups}
    slots = {g.id: g.slots for g in state.groups}
    for action in actions:
        assert isinstance(action, Place | Suspend)
        old = where.pop(action.job, None)
        if old is not None:
            members[old].remove(action.job)
            if not members[old]:
                free.give(slots[old])
        if isinstance(action, Place):
            free.take_exact(action.slots)  # raises when a slot is not free


# ---- grow-shrink (gandiva-gs) ----


def elastic(i: int, gpus: int = 1, grow_to: tuple[int, ...] = (2, 4)) -> Job:
    return Job(i, "A", gpus, float(i), 0.5, None, grow_to)


def idle_view(
    groups: list[Group], jobs: list[Job], idle_since: dict, now: float, waiting: list[int] = ()
) -> ClusterView:
    base = view([4], groups, jobs, waiting)
    return ClusterView(
        now_s=now,
        servers=base.servers,
        jobs=base.jobs,
        groups=base.groups,
        waiting=base.waiting,
        slice_efficiency=EFFICIENCY,
        packable=base.packable,
        idle_since=MappingProxyType(idle_since),
        grow_idle_s=600.0,
    )


def test_gandiva_gs_grows_a_lone_job_onto_gpus_idle_long_enough_within_its_range() -> None:
    groups = [Group(0, ((0, 0),), (0,))]
    idle = {(0, 1): 0.0, (0, 2): 0.0, (0, 3): 500.0}
    policy = GandivaPolicy(grow_shrink=True)
    # At 700 s two GPUs have idled 600 s, the third only 200 s: 1 + 2 = 3 is not in its
    # range (2, 4), so it grows to 2.
    actions = policy.decide(idle_view(groups, [elastic(0)], idle, now=700.0))
    assert actions == [Resize(0, ((0, 0), (0, 1)), reason="grow")]
    # At 1,100 s all three have: it grows to 4.
    actions = policy.decide(idle_view(groups, [elastic(0)], idle, now=1_100.0))
    assert actions == [Resize(0, ((0, 0), (0, 1), (0, 2), (0, 3)), reason="grow")]
    # Too early, no range, or plain gandiva: nothing.
    assert policy.decide(idle_view(groups, [elastic(0)], idle, now=500.0)) == []
    assert policy.decide(idle_view(groups, [elastic(0, grow_to=())], idle, now=2e3)) == []
    assert GandivaPolicy().decide(idle_view(groups, [elastic(0)], idle, now=2e3)) == []


def test_gandiva_gs_shrinks_grown_jobs_at_once_when_a_job_waits() -> None:
    grown = [Group(0, ((0, 0), (0, 1), (0, 2), (0, 3)), (0,))]
    jobs = [elastic(0), job(1)]
    idle: dict = {}
    actions = GandivaPolicy(grow_shrink=True).decide(
        idle_view(grown, jobs, idle, now=5_000.0, waiting=[1])
    )
    assert actions[0] == Resize(0, ((0, 0),), reason="shrink")
    assert isinstance(actions[1], Place) and actions[1].job == 1
    assert actions[1].slots[0] in {(0, 1), (0, 2), (0, 3)}
    # Nothing grows back while the job waits or in the same call.
    assert not any(isinstance(a, Resize) and a.reason == "grow" for a in actions)


def test_a_waiting_job_finds_the_grown_jobs_shrunk_not_a_grown_round_robin() -> None:
    # Two GPUs, both held by a one-GPU job grown to 2. A two-GPU job arrives: the grown job
    # goes back to one GPU at once; the new job does not time-slice with it on the grown
    # job's two GPUs (it asked for one), and waits for two free GPUs.
    grown = [Group(0, ((0, 0), (0, 1)), (0,))]
    jobs = [elastic(0, grow_to=(2,)), job(1, gpus=2)]
    actions = GandivaPolicy(grow_shrink=True).decide(view([2], grown, jobs, [1]))
    assert actions == [Resize(0, ((0, 0),), reason="shrink")]


def test_the_round_robin_runs_only_the_highest_priority_present() -> None:
    jobs = [0, 1, 2, 3]
    priorities = {0: 5, 1: 2, 2: 2, 3: 9}
    assert [round_robin_turn(jobs, priorities, t) for t in range(4)] == [1, 2, 1, 2]
    assert [round_robin_turn([0, 3], priorities, t) for t in range(3)] == [0, 0, 0]


# ---- the live cluster as the policies see it (live.py) ----


def test_the_live_view_maps_nodes_gpus_and_jobs_and_the_plan_keeps_what_runs_live() -> None:
    gpus = [
        LiveGpu("g0", "n1", "A100", 80 * GIB_, False),
        LiveGpu("g1", "n1", "A100", 80 * GIB_, False),  # free
        LiveGpu("g2", "n1", "A100", 80 * GIB_, True),  # an inference job holds it
        LiveGpu("g3", "n2", "V100", 16 * GIB_, False),  # free, another server
    ]
    jobs = [
        LiveJob("j-hooked", "g0", "resnet", 8 * GIB_, 2.0, movable=True),
        LiveJob("j-plain", "g0", "resnet", 8 * GIB_, 1.0, movable=False),
    ]
    live = live_view(gpus, jobs, {}, 0.0, EFFICIENCY)
    v = live.view
    assert [(s.gpu_type, s.gpus) for s in v.servers] == [("A100", 3), ("V100", 1)]
    (shared, busy) = v.groups
    # The job that cannot move comes first, so the policy's spread takes the other.
    assert [live.job_ids[j] for j in shared.jobs] == ["j-plain", "j-hooked"]
    assert [v.jobs[j].job_type for j in busy.jobs] == [OTHER_WORK]
    assert live.gpu_of_group[busy.id] == "g2"
    assert ("A100", "resnet", "resnet") in v.packable
    plan = live_plan(live, GandivaPolicy())
    # Spread onto the free A100 (the policy prefers the server it knows); then the two
    # remaining jobs are alone: nothing to pack.
    assert plan.moves == (("j-hooked", "g1", "spread"),)
    assert plan.pack == () and plan.unpack == ()


def test_the_live_view_preempts_no_job() -> None:
    # A pending training job has waited hours for the GPU a later job took; the simulator's
    # gandiva would preempt that job, but live a job placement placed stays placed.
    gpus = [LiveGpu("g0", "n1", "A100", 80 * GIB_, False)]
    jobs = [LiveJob("j-late", "g0", "resnet", 8 * GIB_, 100.0, attained_s=9000.0)]
    pending = [LivePending("j-early", 1, 8 * GIB_, 0.0, sliceable=True)]
    ended = lengths({1: 2})  # 1-GPU jobs run 2 h: j-late, 2.5 h in, outlived them all
    live = live_view(gpus, jobs, {}, 10_000.0, EFFICIENCY, pending=pending, ended=ended)
    assert not live.view.preempt
    assert GandivaPolicy().decide(live.view) == []
    simulated = GandivaPolicy().decide(replace(live.view, preempt=True))
    assert simulated[0] == Suspend(0, reason="preempt")


def test_unmeasured_jobs_are_not_packed_and_measured_ones_pack_in_place() -> None:
    gpus = [LiveGpu("g0", "n1", "A100", 80 * GIB_, False)]
    unmeasured = [
        LiveJob("a", "g0", "t1", 8 * GIB_, 1.0, measured=False, movable=False),
        LiveJob("b", "g0", "t2", 8 * GIB_, 2.0, movable=False),
    ]
    live = live_view(gpus, unmeasured, {}, 0.0, EFFICIENCY)
    assert live_plan(live, GandivaPolicy()).pack == ()
    measured = [replace(j, measured=True) for j in unmeasured]
    live = live_view(gpus, measured, {}, 0.0, EFFICIENCY)
    assert live_plan(live, GandivaPolicy()).pack == ("g0",)
    # Packed with a gain below time-slicing's: undone.
    live = live_view(gpus, measured, {"g0": LiveGroupState(True, 0.5)}, 0.0, EFFICIENCY)
    assert live_plan(live, GandivaPolicy()).unpack == ("g0",)
    # Too big together for the GPU: never packed.
    big = [replace(j, memory_bytes=50 * GIB_) for j in measured]
    assert live_plan(live_view(gpus, big, {}, 0.0, EFFICIENCY), GandivaPolicy()).pack == ()


def test_gandivas_rules_of_time_are_its_arguments_from_the_registry() -> None:
    knobs = GandivaKnobs(
        slice_after_s=5.0, share_after_s=6.0, queue_ahead=1, bet_min_ended=0, preempt_after_s=7.0
    )
    for name, height, grows in (("gandiva:3", 3, False), ("gandiva-gs", 8, True)):
        policy = get_policy(name, knobs)
        assert isinstance(policy, GandivaPolicy)
        assert (policy.max_height, policy.grow_shrink) == (height, grows)
        got = (
            policy.slice_after_s,
            policy.share_after_s,
            policy.queue_ahead,
            policy.bet_min_ended,
            policy.preempt_after_s,
        )
        assert got == (5.0, 6.0, 1, 0, 7.0)
    default = get_policy("gandiva")
    assert isinstance(default, GandivaPolicy) and default.slice_after_s == SLICE_AFTER_S
    with pytest.raises(ValueError, match="queue_ahead must be an integer >= 0"):
        GandivaKnobs(queue_ahead=-1)
    with pytest.raises(ValueError, match="slice_after_s must be a number of seconds"):
        GandivaPolicy(slice_after_s=float("nan"))
