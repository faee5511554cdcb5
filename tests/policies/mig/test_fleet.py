"""Batch collection and planning across a fleet of MIG GPUs (gpuloom/policies/mig/fleet.py)."""

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.domain.mig_geometry import A30, A100, H100
from gpuloom.policies.mig import InvalidTaskError, MigTask, area_lower_bound, verify_plan
from gpuloom.policies.mig.far import FarPlanner
from gpuloom.policies.mig.fleet import BatchCollector, FleetPlan, MigFleetPlanner, MigGpu

from .helpers import rodinia, task

INF = math.inf


def named(name: str, **times: float) -> MigTask:
    """A task from keyword times: named("x", s1=2.0, s7=0.5)."""
    return MigTask(name, {int(key[1:]): seconds for key, seconds in times.items()})


def check(result: FleetPlan, batch: list[MigTask], gpus: list[MigGpu]) -> None:
    """Every task of the batch runs exactly once, on a GPU that lists it, every GPU's plan
    passes verify_plan, and nothing of the batch starts before the moment of planning."""
    geometry = {gpu.gpu_id: gpu.geometry for gpu in gpus}
    seen: Counter[int] = Counter()
    for gpu_id, gpu_plan in result.plans.items():
        assert gpu_plan.gpu_id == gpu_id
        verify_plan(gpu_plan.plan, gpu_plan.tasks, geometry[gpu_id])
        new = gpu_plan.new_assignments
        assert sorted(a.task_index - gpu_plan.first_new for a in new) == list(
            range(len(gpu_plan.batch_indices))
        )
        horizon = max(gpu_plan.plan.makespan_s, 1.0)
        for a in new:
            index = gpu_plan.batch_indices[a.task_index - gpu_plan.first_new]
            assert a.task == batch[index].name
            assert a.start_s >= gpu_plan.now_s - 1e-9 * horizon
            assert result.task_gpu[index] == gpu_id
            seen[index] += 1
        assert gpu_plan.end_s <= result.makespan_s
    assert seen == Counter(range(len(batch)))
    assert result.makespan_s == pytest.approx(max(p.end_s for p in result.plans.values()))


# --- BatchCollector ---------------------------------------------------------------------


def test_a_batch_is_due_when_the_oldest_task_has_waited_the_window() -> None:
    collector = BatchCollector(window_s=2.0, max_tasks=10)
    assert collector.next_due_s(0.0) is None
    assert not collector.due(0.0)
    collector.add(named("a", s1=1.0), now=10.0)
    collector.add(named("b", s1=1.0), now=11.5)
    assert collector.waiting == 2
    assert collector.next_due_s(10.5) == pytest.approx(1.5)
    assert not collector.due(11.9)
    assert collector.take(11.9) == []
    assert collector.waiting == 2
    assert collector.due(12.0)
    assert collector.next_due_s(12.5) == 0.0
    assert [t.name for t in collector.take(12.0)] == ["a", "b"]
    assert collector.waiting == 0
    assert collector.next_due_s(12.0) is None
    assert not collector.due(100.0)


def test_the_window_restarts_from_the_next_oldest_task() -> None:
    collector = BatchCollector(window_s=5.0, max_tasks=2)
    for number, at in enumerate((0.0, 1.0, 3.0)):
        collector.add(named(f"t{number}", s1=1.0), now=at)
    # Three waiting with max_tasks 2: due at once; the batch is the two oldest.
    assert collector.due(3.0)
    assert [t.name for t in collector.take(3.0)] == ["t0", "t1"]
    assert collector.waiting == 1
    assert not collector.due(7.9)
    assert collector.next_due_s(4.0) == pytest.approx(4.0)
    assert [t.name for t in collector.take(8.0)] == ["t2"]


def test_a_batch_is_due_as_soon_as_max_tasks_wait() -> None:
    collector = BatchCollector(window_s=60.0, max_tasks=3)
    collector.add(named("a", s1=1.0), now=0.0)
    collector.add(named("b", s1=1.0), now=0.1)
    assert not collector.due(0.2)
    assert collector.next_due_s(0.2) == pytest.approx(59.8)
    collector.add(named("c", s1=1.0), now=0.2)
    assert collector.due(0.2)
    assert collector.next_due_s(0.2) == 0.0
    assert [t.name for t in collector.take(0.2)] == ["a", "b", "c"]


def test_task_names_are_unique_among_waiting_tasks() -> None:
    collector = BatchCollector(window_s=1.0, max_tasks=5)
    collector.add(named("a", s1=1.0), now=0.0)
    with pytest.raises(ValueError, match="'a' is already waiting"):
        collector.add(named("a", s7=1.0), now=0.5)
    assert collector.waiting == 1
    assert [t.name for t in collector.take(1.0)] == ["a"]
    # Once taken, the name is free again.
    collector.add(named("a", s1=1.0), now=2.0)
    assert collector.waiting == 1


def test_a_task_taken_out_never_joins_a_batch() -> None:
    collector = BatchCollector(window_s=5.0, max_tasks=2)
    collector.add(named("a", s1=1.0), now=0.0)
    collector.add(named("b", s1=1.0), now=1.0)
    assert collector.due(1.0)
    assert collector.remove("a") and not collector.remove("a") and not collector.remove("z")
    # One waits now, so the size threshold is no longer met; the window runs from b.
    assert not collector.due(1.0)
    assert collector.next_due_s(1.0) == pytest.approx(5.0)
    collector.add(named("a", s1=1.0), now=2.0)  # the name is free again
    assert [t.name for t in collector.take(2.0)] == ["b", "a"]


def test_a_task_put_back_keeps_its_place_by_arrival_time() -> None:
    collector = BatchCollector(window_s=10.0, max_tasks=2)
    collector.add(named("new", s1=1.0), now=8.0)
    collector.add(named("old", s1=1.0), now=1.0)  # waited since 1.0: it goes first
    collector.add(named("newer", s1=1.0), now=9.0)
    assert [t.name for t in collector.take(9.0)] == ["old", "new"]
    # The window of what is left runs from its own arrival.
    assert collector.next_due_s(9.0) == pytest.approx(10.0)


@pytest.mark.parametrize("window_s", [0.0, -1.0, INF, math.nan, True, "1"])
def test_window_must_be_finite_and_positive(window_s: object) -> None:
    with pytest.raises(ValueError, match="window_s"):
        BatchCollector(window_s=window_s, max_tasks=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_tasks", [0, -3, 1.5, True])
def test_max_tasks_must_be_a_positive_integer(max_tasks: object) -> None:
    with pytest.raises(ValueError, match="max_tasks"):
        BatchCollector(window_s=1.0, max_tasks=max_tasks)  # type: ignore[arg-type]


def test_times_must_be_finite() -> None:
    collector = BatchCollector(window_s=1.0, max_tasks=2)
    with pytest.raises(ValueError, match="now"):
        collector.add(named("a", s1=1.0), now=math.nan)
    with pytest.raises(ValueError, match="now"):
        collector.due(INF)


# --- MigFleetPlanner --------------------------------------------------------------------


def test_rodinia_on_a_mixed_fleet_runs_every_task_once() -> None:
    batch = rodinia(A100)
    gpus = [MigGpu("a100-0", A100), MigGpu("a100-1", A100), MigGpu("a30-0", A30)]
    result = MigFleetPlanner().plan(batch, gpus)
    check(result, batch, gpus)
    assert result.makespan_s >= result.lower_bound_s
    # The area bound over all 18 slices.
    least = sum(min(s * t.time(s) for s in A100.sizes) for t in batch)
    assert result.lower_bound_s == pytest.approx(least / 18)


def test_tasks_that_need_seven_slices_never_go_to_an_a30() -> None:
    seven_only = [named(f"big{i}", s7=1.0 + i) for i in range(4)]
    anywhere = [task(f"small{i}", A100, 4.0, 2.2, 1.6, 1.3, 1.0) for i in range(6)]
    batch = seven_only + anywhere
    # A30s listed first and idle; the A100 is busy: only the A100 can take the big ones.
    gpus = [MigGpu("a30-0", A30), MigGpu("a30-1", A30), MigGpu("a100", A100, busy_until_s=3.0)]
    result = MigFleetPlanner().plan(batch, gpus)
    check(result, batch, gpus)
    assert all(result.task_gpu[i] == "a100" for i in range(len(seven_only)))
    # The small tasks are better off on the idle A30s, and they can run there.
    assert {result.task_gpu[i] for i in range(len(seven_only), len(batch))} & {"a30-0", "a30-1"}
    # Tasks sent to an A30 carry only the A30's sizes.
    for gpu_id in ("a30-0", "a30-1"):
        if gpu_id in result.plans:
            for t in result.plans[gpu_id].tasks:
                assert set(t.times) <= set(A30.sizes)


def test_a_task_no_gpu_can_run_is_refused_by_name() -> None:
    batch = [named("fine", s1=1.0, s4=0.3), named("wide-only", s7=2.0, s3=3.0)]
    with pytest.raises(InvalidTaskError, match="wide-only"):
        MigFleetPlanner().plan(batch, [MigGpu("a30-0", A30), MigGpu("a30-1", A30)])


def test_only_on_keeps_a_task_on_the_gpus_listed_for_it() -> None:
    batch = [named(f"t{i}", s1=4.0, s7=1.0) for i in range(6)]
    gpus = [MigGpu("a", A100), MigGpu("b", A100), MigGpu("c", A100)]
    # t0 and t1 only on "c" (a busy one, which the split would otherwise avoid for them).
    gpus[2] = MigGpu("c", A100, busy_until_s=20.0)
    only_on = [{"c"}, {"c"}, None, None, None, None]
    result = MigFleetPlanner().plan(batch, gpus, only_on)
    check(result, batch, gpus)
    assert result.task_gpu[0] == result.task_gpu[1] == "c"
    assert "c" not in result.task_gpu[2:]
    with pytest.raises(InvalidTaskError, match=r"t0\) cannot run on any GPU of \['x'\]"):
        MigFleetPlanner().plan(batch, gpus, [{"x"}, *[None] * 5])
    with pytest.raises(ValueError, match="only_on has 1 entries for 6 tasks"):
        MigFleetPlanner().plan(batch, gpus, [None])


def test_bad_batches_and_fleets_are_refused() -> None:
    planner = MigFleetPlanner()
    one = [named("a", s1=1.0)]
    with pytest.raises(ValueError, match="empty"):
        planner.plan([], [MigGpu("g", A100)])
    with pytest.raises(ValueError, match="no GPUs"):
        planner.plan(one, [])
    with pytest.raises(ValueError, match="'g' is listed twice"):
        planner.plan(one, [MigGpu("g", A100), MigGpu("g", A30)])
    with pytest.raises(InvalidTaskError, match="bad"):
        planner.plan([named("bad", s1=math.nan, s2=1.0)], [MigGpu("g", A100)])
    with pytest.raises(InvalidTaskError, match="neg"):
        planner.plan([named("neg", s1=-1.0)], [MigGpu("g", A100)])
    with pytest.raises(ValueError, match="concat_mode"):
        MigFleetPlanner(concat_mode="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_until_s"):
        MigGpu("g", A100, busy_until_s=INF)
    with pytest.raises(ValueError, match="gpu_id"):
        MigGpu("", A100)


def test_two_gpus_take_well_under_the_time_of_one_on_rodinia() -> None:
    batch = rodinia(A100)
    makespans = {}
    for count in (1, 2, 4):
        gpus = [MigGpu(f"g{i}", A100) for i in range(count)]
        result = MigFleetPlanner().plan(batch, gpus)
        check(result, batch, gpus)
        assert result.makespan_s >= result.lower_bound_s
        makespans[count] = result.makespan_s
    # One GPU is FAR on its own; two measured 7.34 s against 11.32 s. Four cannot go much
    # lower: Gaussian alone needs 6.93 s on its fastest instance, plus its creation.
    assert makespans[1] == pytest.approx(FarPlanner().plan(batch, A100).makespan_s)
    assert makespans[2] < 0.7 * makespans[1]
    gaussian = next(t for t in batch if t.name == "Gaussian")
    assert makespans[4] >= gaussian.time(3) + A100.create_s(3) - 1e-9
    assert makespans[4] <= makespans[2]


def test_a_busy_gpu_gets_work_only_when_it_pays() -> None:
    batch = rodinia(A100)
    gpus = [MigGpu("busy", A100, busy_until_s=1000.0), MigGpu("free", A100)]
    result = MigFleetPlanner().plan(batch, gpus)
    check(result, batch, gpus)
    assert set(result.task_gpu) == {"free"}
    assert list(result.plans) == ["free"]
    # Slightly busy: it still takes a share, and its work starts after busy_until_s.
    gpus = [MigGpu("busy", A100, busy_until_s=1.0), MigGpu("free", A100)]
    result = MigFleetPlanner().plan(batch, gpus)
    check(result, batch, gpus)
    busy = result.plans["busy"]
    assert busy.now_s == pytest.approx(-1.0)
    assert min(a.start_s for a in busy.new_assignments) - busy.now_s >= 1.0


def test_rebalancing_moves_tasks_only_when_the_batch_ends_earlier() -> None:
    # By least work the split looks even, but the 7-slice tasks cannot overlap the long
    # one-slice task on its GPU: moving 7-slice tasks away shortens the batch.
    batch = [named("long", s1=10.0)] + [named(f"wide{i}", s7=1.5) for i in range(6)]
    gpus = [MigGpu("g0", A100), MigGpu("g1", A100)]
    plain = MigFleetPlanner(rebalance_rounds=0).plan(batch, gpus)
    balanced = MigFleetPlanner().plan(batch, gpus)
    check(plain, batch, gpus)
    check(balanced, batch, gpus)
    assert plain.moves == 0
    assert balanced.moves >= 1
    assert balanced.makespan_s < plain.makespan_s - 1.0
    # On Rodinia no single move helps: the split is kept as it was.
    rodinia_gpus = [MigGpu("g0", A100), MigGpu("g1", A100)]
    rodinia_plan = MigFleetPlanner().plan(rodinia(A100), rodinia_gpus)
    unbalanced = MigFleetPlanner(rebalance_rounds=0).plan(rodinia(A100), rodinia_gpus)
    assert rodinia_plan.makespan_s <= unbalanced.makespan_s


def renamed(tasks: list[MigTask], suffix: str) -> list[MigTask]:
    return [MigTask(t.name + suffix, t.times) for t in tasks]


@pytest.mark.parametrize("mode", ["reverse", "reverse+refine"])
def test_a_second_batch_concatenated_ends_no_later_than_after_the_first(mode: str) -> None:
    kernels = rodinia(A100)
    first, second = kernels[:8], renamed(kernels[8:], "-2")
    ends = {}
    for concat_mode in ("trivial", mode):
        planner = MigFleetPlanner(concat_mode=concat_mode)  # type: ignore[arg-type]
        earlier = planner.plan(first, [MigGpu("g", A100)])
        # Both batches planned at the start of the first: the GPU is busy for all of it.
        gpus = [MigGpu("g", A100, busy_until_s=earlier.makespan_s)]
        later = planner.plan(second, gpus)
        check(later, second, gpus)
        gpu_plan = later.plans["g"]
        assert gpu_plan.concatenated
        assert gpu_plan.first_new == len(first)
        assert planner.kept_batches("g") == 2
        # The first batch is replayed exactly as it was planned.
        before = Counter(earlier.plans["g"].plan.assignments)
        assert Counter(a for a in gpu_plan.plan.assignments if a.task_index < 8) == before
        ends[concat_mode] = later.makespan_s
    assert ends[mode] <= ends["trivial"]
    # Measured: reverse batches overlap the first one's idle slices by about 0.7 s.
    assert ends[mode] < ends["trivial"] - 0.5


def test_a_batch_that_would_start_before_now_is_planned_after_the_earlier_work() -> None:
    kernels = rodinia(A100)
    planner = MigFleetPlanner()
    earlier = planner.plan(kernels[:8], [MigGpu("g", A100)])
    # Planned near the end of the first batch: its idle slices are in the past.
    gpus = [MigGpu("g", A100, busy_until_s=0.1 * earlier.makespan_s)]
    second = renamed(kernels[8:], "-2")
    later = planner.plan(second, gpus)
    check(later, second, gpus)
    gpu_plan = later.plans["g"]
    assert not gpu_plan.concatenated
    assert gpu_plan.now_s == pytest.approx(-0.1 * earlier.makespan_s)
    assert planner.kept_batches("g") == 1


def test_planned_halfway_through_the_first_batch() -> None:
    kernels = rodinia(A100)
    second = renamed(kernels[8:], "-2")
    results = {}
    for mode in ("trivial", "reverse+refine"):
        planner = MigFleetPlanner(concat_mode=mode)  # type: ignore[arg-type]
        earlier = planner.plan(kernels[:8], [MigGpu("g", A100)]).plans["g"]
        busy = earlier.plan.makespan_s / 2
        gpus = [MigGpu("g", A100, busy_until_s=busy)]
        later = planner.plan(second, gpus)
        check(later, second, gpus)
        results[mode] = (later.plans["g"], earlier, busy)
    # Reversed, the batch fits into slices the first one frees after now (measured).
    joined, earlier, busy = results["reverse+refine"]
    assert joined.concatenated
    now = earlier.plan.makespan_s - busy
    assert joined.now_s == pytest.approx(now)
    assert min(a.start_s for a in joined.new_assignments) >= now
    assert joined.end_s == pytest.approx(max(a.end_s for a in joined.new_assignments) - now)
    # Trivially appended it would end later than a fresh plan started after busy_until_s,
    # so the fresh plan is taken.
    fresh, _, busy = results["trivial"]
    assert not fresh.concatenated
    assert fresh.end_s == pytest.approx(busy + FarPlanner().plan(second, A100).makespan_s)
    assert joined.end_s < fresh.end_s


def test_an_idle_gpu_and_a_forgotten_one_start_fresh_plans() -> None:
    kernels = rodinia(A100)
    planner = MigFleetPlanner()
    planner.plan(kernels[:5], [MigGpu("g", A100)])
    idle = planner.plan(renamed(kernels[5:10], "-2"), [MigGpu("g", A100, busy_until_s=0.0)])
    assert not idle.plans["g"].concatenated
    busy = MigGpu("g", A100, busy_until_s=idle.makespan_s)
    joined = planner.plan(renamed(kernels[10:], "-3"), [busy])
    assert joined.plans["g"].concatenated
    assert planner.kept_batches("g") == 2
    planner.forget("g")
    assert planner.kept_batches("g") == 0
    after = planner.plan(renamed(kernels[:4], "-4"), [busy])
    assert not after.plans["g"].concatenated
    assert after.plans["g"].now_s == pytest.approx(-busy.busy_until_s)
    planner.forget("never-seen")  # no error


def test_the_chain_of_kept_batches_is_bounded() -> None:
    kernels = rodinia(A100)
    planner = MigFleetPlanner(max_chain=2)
    busy = 0.0
    concatenated = []
    for number in range(4):
        batch = renamed(kernels[4 * number : 4 * number + 4], f"-{number}")
        gpus = [MigGpu("g", A100, busy_until_s=busy)]
        result = planner.plan(batch, gpus)
        check(result, batch, gpus)
        concatenated.append(result.plans["g"].concatenated)
        assert planner.kept_batches("g") <= 2
        busy = result.makespan_s
    # A full chain (2 batches) makes the next batch start a new plan.
    assert concatenated[0] is False
    assert concatenated[2] is False


def test_a_gpu_with_another_geometry_under_the_same_id_starts_fresh() -> None:
    kernels = rodinia(A100)
    quick = A100.with_reconfig_times(
        create_s=dict.fromkeys(A100.sizes, 0.01), destroy_s=dict.fromkeys(A100.sizes, 0.01)
    )
    second = renamed(kernels[8:], "-2")
    for geometry, joined in ((A100, True), (quick, False), (H100, False)):
        planner = MigFleetPlanner()
        first = planner.plan(kernels[:8], [MigGpu("g", A100)])
        gpus = [MigGpu("g", geometry, busy_until_s=first.makespan_s)]
        result = planner.plan(second, gpus)
        check(result, second, gpus)
        # The earlier batch was planned with other reconfiguration times: it cannot be
        # replayed on this geometry.
        assert result.plans["g"].concatenated is joined, geometry
        assert planner.kept_batches("g") == (2 if joined else 1)


# --- properties -------------------------------------------------------------------------

FLEET_SIZES = (1, 2, 3, 4, 7)  # every size of any GPU here
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw: st.DrawFn, prefix: str) -> list[MigTask]:
    count = draw(st.integers(2, 12))
    tasks = []
    for number in range(count):
        times = {size: draw(st.one_of(st.floats(0.01, 50.0), st.just(INF))) for size in FLEET_SIZES}
        if all(math.isinf(t) for t in times.values()):
            times[draw(st.sampled_from(FLEET_SIZES))] = draw(st.floats(0.01, 50.0))
        tasks.append(MigTask(f"{prefix}{number}", times))
    return tasks


fleets = st.lists(st.sampled_from([A100, A30]), min_size=1, max_size=3)


@FAST
@given(fleet=fleets, first=batches("a"), second=batches("b"), data=st.data())
def test_every_task_runs_once_and_every_plan_verifies(
    fleet: list, first: list[MigTask], second: list[MigTask], data: st.DataObject
) -> None:
    planner = MigFleetPlanner()
    gpus = [MigGpu(f"g{i}", geometry) for i, geometry in enumerate(fleet)]

    def runnable(t: MigTask) -> bool:
        return any(math.isfinite(t.time(s)) for g in fleet for s in g.sizes)

    if not all(runnable(t) for t in first):
        with pytest.raises(InvalidTaskError):
            planner.plan(first, gpus)
        return
    result = planner.plan(first, gpus)
    check(result, first, gpus)
    assert result.makespan_s >= result.lower_bound_s * (1 - 1e-9)
    if len(fleet) == 1:
        # One GPU: the area lower bound is the single-GPU one.
        restricted = [
            MigTask(t.name, {s: x for s, x in t.times.items() if s in fleet[0].sizes})
            for t in first
        ]
        assert result.lower_bound_s == pytest.approx(area_lower_bound(restricted, fleet[0]))

    # The next batch, planned while each GPU is somewhere in the first one.
    if not all(runnable(t) for t in second):
        return
    gpus = [
        MigGpu(
            gpu.gpu_id,
            gpu.geometry,
            busy_until_s=data.draw(st.sampled_from([0.0, 0.3, 1.0]))
            * (result.plans[gpu.gpu_id].end_s if gpu.gpu_id in result.plans else 0.0),
        )
        for gpu in gpus
    ]
    later = planner.plan(second, gpus)
    check(later, second, gpus)
    for gpu_plan in later.plans.values():
        if gpu_plan.concatenated:
            # The first batch comes out of the concatenation exactly as it was planned.
            kept = result.plans[gpu_plan.gpu_id].plan
            assert gpu_plan.first_new == len(result.plans[gpu_plan.gpu_id].tasks)
            old = [a for a in gpu_plan.plan.assignments if a.task_index < gpu_plan.first_new]
            assert Counter(old) == Counter(kept.assignments)
