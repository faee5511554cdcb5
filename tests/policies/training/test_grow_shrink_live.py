"""Grow-shrink on the live cluster (gpuloom/policies/training/live.py with `gandiva-gs`): an
elastic job is a group of its own over all its GPUs, grows onto GPUs of its node idle for the
policy's period within its range, and shrinks back when, and only when, a pending job needs
the GPUs it grew onto."""

from __future__ import annotations

from dataclasses import replace

from gpuloom.policies.training.gandiva import GandivaPolicy
from gpuloom.policies.training.live import (
    LiveGpu,
    LiveJob,
    LivePending,
    LivePlan,
    live_plan,
    live_view,
)

GIB = 1 << 30
EFFICIENCY = 60 / 61
IDLE_S = 600.0


def node(
    n: int, name: str = "n1", model: str = "A100", busy: tuple[int, ...] = ()
) -> list[LiveGpu]:
    return [LiveGpu(f"{name}-g{i}", name, model, 80 * GIB, i in busy) for i in range(n)]


def elastic(
    first: str = "n1-g0", extra: tuple[str, ...] = (), low: int = 1, high: int = 2
) -> LiveJob:
    return LiveJob("j-elastic", first, "resnet", 0, 1.0, extra_gpus=extra, gpus=low, max_gpus=high)


def plan(
    gpus: list[LiveGpu],
    jobs: list[LiveJob],
    now: float,
    idle_since: dict[str, float] | None = None,
    pending: list[LivePending] = [],  # noqa: B006  (never changed)
) -> LivePlan:
    live = live_view(
        gpus,
        jobs,
        {},
        now,
        EFFICIENCY,
        idle_since=idle_since or {},
        grow_idle_s=IDLE_S,
        pending=pending,
    )
    return live_plan(live, GandivaPolicy(grow_shrink=True))


def test_an_elastic_job_grows_onto_gpus_idle_for_the_period_within_its_range() -> None:
    gpus = node(4)
    idle = {"n1-g1": 0.0, "n1-g2": 0.0, "n1-g3": 500.0}
    # Not idle long enough yet: nothing.
    assert plan(gpus, [elastic(high=4)], 599.0, idle).resizes == ()
    # Two GPUs idle for 600 s: it grows onto both (3 of 1..4); the third is idle too short.
    assert plan(gpus, [elastic(high=4)], 600.0, idle).resizes == (
        ("j-elastic", ("n1-g0", "n1-g1", "n1-g2"), "grow"),
    )
    # Its range caps it: 1..2 takes one of the three idle GPUs.
    assert plan(gpus, [elastic(high=2)], 2000.0, idle).resizes == (
        ("j-elastic", ("n1-g0", "n1-g1"), "grow"),
    )
    # A job that is not elastic, and GPUs of another node, are never grown onto.
    assert plan(gpus, [replace(elastic(), max_gpus=0)], 2000.0, idle).resizes == ()
    other = node(2, "n2")
    assert plan([*node(1), *other], [elastic()], 2000.0, {"n2-g0": 0.0, "n2-g1": 0.0}) == LivePlan()


def test_an_elastic_job_is_never_a_packing_target() -> None:
    gpus = node(2)
    # Two measured jobs of its type time-slice on g1; the elastic job alone on g0 (its group
    # not marked full, so that it may grow) is no packing target: its type packs with nothing,
    # and the policy packs the pair in place instead (were it a target, the policy would move
    # one onto g0's job, which is not taken live, and nothing would be packed).
    pair = [
        LiveJob(f"j-{i}", "n1-g1", "resnet", 8 * GIB, float(i), utilisation=0.1, movable=False)
        for i in range(2)
    ]
    elastic_resnet = replace(elastic(), memory_bytes=8 * GIB, utilisation=0.0)
    assert plan(gpus, [elastic_resnet, *pair], 5000.0).pack == ("n1-g1",)


def test_a_grown_job_shrinks_when_a_pending_job_needs_its_gpus_and_only_then() -> None:
    gpus = node(2)
    grown = elastic(extra=("n1-g1",))
    needs = LivePending("j-new", 1, 8 * GIB, 10.0)
    assert plan(gpus, [grown], 5000.0, pending=[needs]).resizes == (
        ("j-elastic", ("n1-g0",), "shrink"),
    )
    # Without a pending job it stays grown (no GPU left to grow onto either).
    assert plan(gpus, [grown], 5000.0).resizes == ()
    # Pending jobs a shrink would not help: another model, more memory than a GPU has, more
    # GPUs than the node would have free, a node without its CPU free.
    for useless in (
        replace(needs, gpu_model="V100"),
        replace(needs, memory_bytes=81 * GIB),
        replace(needs, gpus=2),
        replace(needs, nodes=frozenset({"n2"})),
    ):
        assert plan(gpus, [grown], 5000.0, pending=[useless]).resizes == (), useless
    # Alternatives of which one is the node's model: it helps.
    assert plan(gpus, [grown], 5000.0, pending=[replace(needs, gpu_model="V100|A100")]).resizes


def test_a_job_grown_beyond_its_first_gpus_shrinks_to_the_count_it_asked_for() -> None:
    gpus = node(4)
    grown = elastic(extra=("n1-g1", "n1-g2", "n1-g3"), low=2, high=4)
    needs = LivePending("j-new", 2, 0, 10.0)
    assert plan(gpus, [grown], 5000.0, pending=[needs]).resizes == (
        ("j-elastic", ("n1-g0", "n1-g1"), "shrink"),
    )


def test_a_gpu_busy_with_other_work_is_neither_grown_onto_nor_counted_free() -> None:
    gpus = node(3, busy=(1,))
    idle = {"n1-g2": 0.0}
    assert plan(gpus, [elastic(high=3)], 5000.0, idle).resizes == (
        ("j-elastic", ("n1-g0", "n1-g2"), "grow"),
    )
    # Grown onto g2 with g1 busy: a pending two-GPU job would still not fit after a shrink.
    grown = elastic(extra=("n1-g2",), high=3)
    two = LivePending("j-two", 2, 0, 10.0)
    assert plan(gpus, [grown], 5000.0, pending=[two]).resizes == ()
