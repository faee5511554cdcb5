"""Replicas of a shared model (FaST-GShare's model sharing) in the pure placement core: they go
first to GPUs whose model store holds their model, charged their footprint less the weights
(the weights are charged once, to the store), so more of them fit; elsewhere they are charged
their whole footprint. Over random sequences of loads, unloads, arrivals and releases no GPU's
memory is over-committed counting the shared bytes once, and a replica that could sit beside
its model never lands elsewhere."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.policies.placement import (
    GRID_H,
    MIN_REPLICA_BYTES,
    NO_PROFILES,
    POLICIES,
    Fleet,
    GpuState,
    InvalidRequestError,
    InvalidStateError,
    JobRequest,
    Placement,
    Unplaceable,
    get_policy,
    replica_memory,
)
from gpuloom.policies.placement.scheduler import Ask, Placed, Scheduler, Waiting

from .helpers import GIB, fits_somewhere, fleet_of, gpu, job

ALL = {name: get_policy(name) for name in POLICIES}


def replica(job_id: str, memory_gib: float = 8, model: str = "bert", **kw) -> JobRequest:
    return job(job_id, kw.pop("sm", 10), kw.pop("quota", 10), memory_gib, shared_model=model, **kw)


def fill(fleet: Fleet, policy: str, count: int, **kw) -> list[Placement]:
    """Place `count` replicas one after the other; the placed ones."""
    placed = []
    for i in range(count):
        decision = fleet.place(replica(f"r{i}", **kw), get_policy(policy))
        if isinstance(decision, Placement):
            placed.append(decision)
    fleet.verify()
    return placed


def test_replicas_go_where_their_model_is_resident_charged_the_footprint_less_the_weights() -> None:
    fleet = fleet_of(*(gpu(f"g{i}", memory_gib=16) for i in range(4)))
    fleet.set_models("g2", [("bert", 6 * GIB)])
    assert fleet.slot("g2").memory_free == 10 * GIB  # the store's bytes are used memory
    placed = fill(fleet, "mra", 5)
    # 10 GiB beside the store, 2 GiB (8 - 6) per replica: five replicas, all on g2.
    assert [p.gpu_id for p in placed] == ["g2"] * 5
    assert [a.memory_bytes for a in fleet.allocations("g2")] == [2 * GIB] * 5
    assert fleet.slot("g2").memory_free == 0
    # The sixth does not fit beside the model: elsewhere, with its whole footprint.
    decision = fleet.place(replica("r5"), get_policy("mra"))
    assert isinstance(decision, Placement) and decision.gpu_id != "g2"
    assert fleet.allocation("r5").memory_bytes == 8 * GIB
    fleet.verify()


def test_more_replicas_fit_with_the_model_resident_than_without() -> None:
    def how_many(resident: bool) -> int:
        fleet = fleet_of(*(gpu(f"g{i}", memory_gib=16) for i in range(4)))
        if resident:
            for gpu_id in fleet.gpu_ids():
                fleet.set_models(gpu_id, [("bert", 6 * GIB)])
        return len(fill(fleet, "mra", 40))

    # Without sharing each 16 GiB GPU holds two 8 GiB replicas; with one 6 GiB copy of the
    # weights per GPU, five replicas of 2 GiB each beside it.
    assert how_many(resident=False) == 8
    assert how_many(resident=True) == 20


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_puts_a_replica_beside_its_model_before_anywhere_else(policy: str) -> None:
    # spread would pick the empty GPU, binpack the fuller one: the resident GPU wins anyway.
    fleet = fleet_of(gpu("a"), gpu("b"), gpu("c"))
    fleet.place(job("other", 50, 50, 10), get_policy("mra"))  # on a: a is the fullest
    fleet.set_models("b", [("bert", 4 * GIB)])
    decision = fleet.place(replica("r", memory_gib=5), get_policy(policy), NO_PROFILES)
    assert isinstance(decision, Placement) and decision.gpu_id == "b"
    assert fleet.allocation("r").memory_bytes == 1 * GIB
    # A job of another model, or none, is not drawn there.
    fleet.place(replica("x", memory_gib=5, model="gpt"), get_policy(policy))
    fleet.place(job("plain", 10, 10, 5), get_policy(policy))
    assert fleet.allocation("x").memory_bytes == fleet.allocation("plain").memory_bytes == 5 * GIB
    fleet.verify()


def test_a_gpu_model_constraint_still_holds_for_replicas() -> None:
    fleet = fleet_of(gpu("a", model="A100"), gpu("h", model="H100"))
    fleet.set_models("a", [("bert", 4 * GIB)])
    decision = fleet.place(replica("r", gpu_model="H100"), get_policy("mra"))
    assert isinstance(decision, Placement) and decision.gpu_id == "h"
    assert fleet.allocation("r").memory_bytes == 8 * GIB


def test_an_unschedulable_gpu_holding_the_model_takes_no_replica() -> None:
    fleet = fleet_of(gpu("a"), gpu("b"))
    fleet.set_models("a", [("bert", 4 * GIB)])
    fleet.set_schedulable("a", False)
    decision = fleet.place(replica("r"), get_policy("mra"))
    assert isinstance(decision, Placement) and decision.gpu_id == "b"


def test_the_charge_never_falls_below_the_floor_nor_exceeds_the_request() -> None:
    assert replica_memory(8 * GIB, 6 * GIB) == 2 * GIB
    assert replica_memory(4 * GIB, 6 * GIB) == MIN_REPLICA_BYTES  # asked less than the weights
    assert replica_memory(MIN_REPLICA_BYTES // 2, 6 * GIB) == MIN_REPLICA_BYTES // 2
    assert replica_memory(0, 6 * GIB) == 0  # a whole-GPU job without a cap stays without
    assert replica_memory(8 * GIB, 0) == 8 * GIB
    fleet = fleet_of(gpu("a", memory_gib=16))
    fleet.set_models("a", [("bert", 6 * GIB)])
    fleet.place(replica("r", memory_gib=4), get_policy("mra"))
    assert fleet.allocation("r").memory_bytes == MIN_REPLICA_BYTES


def test_copies_of_different_sizes_prefer_the_smaller_charge() -> None:
    fleet = fleet_of(gpu("a"), gpu("b"), gpu("c"))
    fleet.set_models("a", [("bert", 2 * GIB)])
    fleet.set_models("b", [("bert", 6 * GIB)])
    decision = fleet.place(replica("r"), get_policy("mra"))
    assert isinstance(decision, Placement) and decision.gpu_id == "b"
    assert fleet.allocation("r").memory_bytes == 2 * GIB


def test_store_contents_that_do_not_fit_or_make_no_sense_change_nothing() -> None:
    fleet = fleet_of(gpu("a", memory_gib=16))
    fleet.place(job("j", 10, 10, 12), get_policy("mra"))
    with pytest.raises(InvalidStateError, match="do not fit"):
        fleet.set_models("a", [("bert", 5 * GIB)])
    for bad in ([("", 1)], [("no spaces", 1)], [("x" * 129, 1)], [("m", 0)], [("m", -1)]):
        with pytest.raises(InvalidRequestError):
            fleet.set_models("a", bad)
    with pytest.raises(InvalidRequestError, match="twice"):
        fleet.set_models("a", [("m", 1), ("m", 2)])
    assert fleet.slot("a").models == {} and fleet.slot("a").memory_free == 4 * GIB
    assert fleet.resident("bert") == []
    with pytest.raises(InvalidRequestError, match="shared_model"):
        fleet.place(replica("r", model="bad name"), get_policy("mra"))
    fleet.verify()


def test_unloading_gives_the_store_bytes_back_and_placed_replicas_keep_their_charge() -> None:
    fleet = fleet_of(gpu("a", memory_gib=16))
    fleet.set_models("a", [("bert", 6 * GIB), ("gpt", 1 * GIB)])
    assert fleet.resident("bert") == ["a"] and fleet.slot("a").store_bytes == 7 * GIB
    fleet.place(replica("r"), get_policy("mra"))
    fleet.set_models("a", [("gpt", 1 * GIB)])
    assert fleet.resident("bert") == [] and fleet.slot("a").memory_free == 13 * GIB
    assert fleet.allocation("r").memory_bytes == 2 * GIB
    fleet.release("r")
    assert fleet.slot("a").memory_free == 15 * GIB
    fleet.verify()


def test_a_snapshot_keeps_the_store_and_the_reduced_charges() -> None:
    fleet = fleet_of(gpu("a", memory_gib=16), gpu("b", memory_gib=16))
    fleet.set_models("a", [("bert", 6 * GIB)])
    fill(fleet, "mra", 3)
    rebuilt = Fleet.from_allocations(fleet.snapshot())
    rebuilt.verify()
    assert rebuilt.slot("a").memory_free == fleet.slot("a").memory_free == 4 * GIB
    assert rebuilt.resident("bert") == ["a"]
    # A store that no longer fits beside the allocations is refused when loaded.
    state = fleet.gpu("a")
    too_big = GpuState(
        state.gpu_id,
        state.node,
        state.model,
        state.memory_bytes,
        0,
        True,
        state.allocations,
        (("bert", 11 * GIB),),
    )
    with pytest.raises(InvalidStateError, match="do not fit"):
        Fleet.from_allocations([too_big])


def test_a_release_beside_the_model_tries_the_replicas_that_now_fit_with_the_reduced_charge() -> (
    None
):
    scheduler = Scheduler(ALL, "mra", fleet=fleet_of(gpu("a", memory_gib=16)))
    scheduler.fleet.set_models("a", [("bert", 6 * GIB)])  # 10 GiB left
    assert isinstance(scheduler.submit(Ask(job("a1", 10, 10, 5))), Placed)
    assert isinstance(scheduler.submit(Ask(job("a2", 10, 10, 4))), Placed)  # 1 GiB left
    assert isinstance(scheduler.submit(Ask(replica("r0"))), Waiting)  # needs 2 GiB here
    # The same request without the model is another bucket: it is charged differently.
    assert isinstance(scheduler.submit(Ask(job("plain", 10, 10, 8))), Waiting)
    assert scheduler.buckets == 2 and not scheduler.wants_decide
    scheduler.end("a2")  # 5 GiB free: the replica's 2 fit, 8 whole would not
    assert scheduler.wants_decide
    decided = scheduler.decide()
    assert [p.ask.job_id for p in decided.placed] == ["r0"] and decided.tried == 1
    assert scheduler.fleet.allocation("r0").memory_bytes == 2 * GIB
    assert "plain" in scheduler
    scheduler.fleet.verify()


# ---- the property ----

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ("bert", "gpt", "vit")


@st.composite
def sequences(draw: st.DrawFn):
    gpus = [
        gpu(f"g{i}", memory_gib=draw(st.sampled_from((8, 16, 24))))
        for i in range(draw(st.integers(1, 4)))
    ]
    load = st.tuples(
        st.just("store"),
        st.integers(0, 3),
        st.lists(st.tuples(st.sampled_from(NAMES), st.integers(1, 12)), max_size=3),
    )
    arrive = st.tuples(
        st.just("arrive"),
        st.sampled_from(("", *NAMES)),
        st.integers(0, 14),  # GiB
        st.sampled_from((10, 25, 50, 100)),  # SM and quota percent
    )
    release = st.tuples(st.just("release"), st.integers(0, 1000))
    ops = draw(st.lists(st.one_of(load, arrive, arrive, arrive, release), min_size=5, max_size=50))
    return gpus, ops


def room(fleet: Fleet, gpu_id: str, request: JobRequest, h: int) -> bool:
    """Whether the GPU has the memory the request is charged there and a w x h rectangle."""
    slot = fleet.slot(gpu_id)
    taken = [a.rect for a in slot.allocations.values()]
    return (
        slot.schedulable
        and slot.memory_free >= slot.memory_need(request)
        and fits_somewhere(taken, request.w, h)
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
@FAST
@given(sequence=sequences())
def test_memory_is_never_over_committed_counting_the_shared_bytes_once(
    policy: str, sequence
) -> None:
    gpus, ops = sequence
    fleet = Fleet.from_allocations(gpus)
    live: list[str] = []
    for n, op in enumerate(ops):
        if op[0] == "store" and op[1] < len(gpus):
            gpu_id = gpus[op[1]].gpu_id
            models = {name: gib * GIB // 4 for name, gib in op[2]}  # quarter GiB steps
            before = fleet.gpu(gpu_id)
            try:
                fleet.set_models(gpu_id, models.items())
            except InvalidStateError:
                assert fleet.gpu(gpu_id) == before  # refused: nothing changed
        elif op[0] == "arrive":
            _, model, gib, share = op
            request = job(f"j{n}", share, share, gib, shared_model=model)
            h = GRID_H if policy == "time-share" else share  # time sharing takes every SM
            beside = [g for g in fleet.resident(model) if room(fleet, g, request, h)]
            decision = fleet.place(request, get_policy(policy))
            if isinstance(decision, Placement):
                live.append(request.job_id)
                slot = fleet.slot(decision.gpu_id)
                charged = fleet.allocation(request.job_id).memory_bytes
                shared = slot.models.get(model, 0)
                assert charged == replica_memory(request.memory_bytes, shared)
                if beside:  # it could sit beside its model: it does
                    assert decision.gpu_id in beside
            else:
                assert isinstance(decision, Unplaceable) and not beside
        elif op[0] == "release" and live:
            fleet.release(live.pop(op[1] % len(live)))
        fleet.verify()
        for gpu_id in fleet.gpu_ids():
            slot = fleet.slot(gpu_id)
            held = sum(a.memory_bytes for a in slot.allocations.values())
            assert held + sum(slot.models.values()) <= slot.memory_bytes
