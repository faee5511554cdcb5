"""Constraints every policy keeps (model, memory, schedulable), the reasons it gives when a
job fits nowhere, loading stored allocations, and argument checks."""

import pytest

from gpuloom.domain.shares import share_of
from gpuloom.policies.placement import (
    POLICIES,
    Fleet,
    GpuState,
    InvalidPlacementError,
    InvalidRequestError,
    InvalidStateError,
    JobRequest,
    Placement,
    PlacementContext,
    Unplaceable,
    get_policy,
)

from .helpers import GIB, allocation_of, fleet_of, gpu, job, placed, rect

ALL = sorted(POLICIES)


def reason(decision) -> str:
    assert isinstance(decision, Unplaceable), decision
    return decision.reason


@pytest.mark.parametrize("policy", ALL)
def test_model_constraint(policy: str) -> None:
    fleet = fleet_of(gpu("a0", "A100-80GB"), gpu("h0", "H100-80GB"))
    p = placed(fleet.place(job("j", 50, 50, gpu_model="H100-80GB"), get_policy(policy)))
    assert p.gpu_id == "h0"
    missing = fleet.place(job("k", 50, 50, gpu_model="B200"), get_policy(policy))
    assert reason(missing) == "no GPU of model B200 (models: A100-80GB, H100-80GB)"


@pytest.mark.parametrize("policy", ALL)
def test_memory_larger_than_any_gpu(policy: str) -> None:
    fleet = fleet_of(gpu("a", memory_gib=40), gpu("b", memory_gib=80))
    decision = fleet.place(job("j", 10, 10, memory_gib=90), get_policy(policy))
    assert reason(decision) == "needs 90 GiB, the largest GPU has 80 GiB"
    of_model = fleet.place(job("k", 10, 10, 90, gpu_model="H100-80GB"), get_policy(policy))
    assert reason(of_model) == "needs 90 GiB, the largest GPU of model H100-80GB has 80 GiB"


@pytest.mark.parametrize("policy", ALL)
def test_memory_is_never_overcommitted(policy: str) -> None:
    fleet = fleet_of(gpu("a", memory_gib=16))
    pol = get_policy(policy)
    placed(fleet.place(job("j", 10, 10, memory_gib=10), pol))
    decision = fleet.place(job("k", 10, 10, memory_gib=10), pol)
    sm = "100% SM (time sharing takes all SMs)" if policy == "time-share" else "10% SM"
    assert reason(decision) == f"no GPU has 10% quota x {sm} free together with 10 GiB of memory"


def test_shape_reason_names_quota_and_sm() -> None:
    fleet = fleet_of(
        gpu("a", allocations=(allocation_of("x", 50, 100, 0, rect=rect(0, 0, 100, 50)),))
    )
    assert reason(fleet.place(job("j", 60, 40), get_policy("mra"))) == (
        "no GPU has 40% quota x 60% SM free"
    )
    assert reason(fleet.place(job("k", 10, 40), get_policy("time-share"))) == (
        "no GPU has 40% quota x 100% SM (time sharing takes all SMs) free"
    )


@pytest.mark.parametrize("policy", ALL)
def test_unschedulable_gpus_are_skipped(policy: str) -> None:
    fleet = fleet_of(gpu("a"), gpu("b"))
    pol = get_policy(policy)
    fleet.set_schedulable("a", False)
    assert placed(fleet.place(job("j", 50, 50), pol)).gpu_id == "b"
    fleet.set_schedulable("b", False)
    assert reason(fleet.place(job("k", 50, 50), pol)) == "no schedulable GPU"
    # Allocations on an unschedulable GPU can still be released.
    assert fleet.release("j") is not None
    fleet.set_schedulable("a", True)
    assert placed(fleet.place(job("m", 50, 50), pol)).gpu_id == "a"
    fleet.verify()


def test_remove_gpu_returns_its_allocations() -> None:
    fleet = fleet_of(gpu("a"), gpu("b"))
    mra = get_policy("mra")
    placed(fleet.place(job("j", 50, 50), mra))
    gone = fleet.remove_gpu("a")
    assert [a.allocation_id for a in gone] == ["j"]
    assert fleet.allocation("j") is None and fleet.release("j") is None
    assert placed(fleet.place(job("k", 50, 50), mra)).gpu_id == "b"
    fleet.remove_gpu("b")
    assert reason(fleet.place(job("m", 1, 1), mra)) == "no GPU (models: none registered)"
    fleet.verify()


def test_from_allocations_restores_positions_and_places_old_records() -> None:
    stored = (
        allocation_of("p", 50, 50, GIB, 1, "t", rect(50, 50, 50, 50)),
        allocation_of("legacy", 50, 50, GIB),  # no rectangle stored: first fit
    )
    fleet = Fleet.from_allocations([gpu("g", allocations=stored)])
    assert fleet.allocation("p").rect == rect(50, 50, 50, 50)
    assert fleet.allocation("legacy").rect == rect(0, 0, 50, 50)
    assert fleet.slot("g").memory_used == 2 * GIB
    fleet.verify()


@pytest.mark.parametrize(
    ("allocations", "message"),
    [
        (
            (
                allocation_of("x", 50, 50, 0, rect=rect(0, 0, 50, 50)),
                allocation_of("y", 50, 50, 0, rect=rect(25, 25, 50, 50)),
            ),
            "allocations x and y overlap",
        ),
        (
            (allocation_of("x", 10, 10, 50 * GIB), allocation_of("y", 10, 10, 50 * GIB)),
            "hold 100 GiB",
        ),
        ((allocation_of("x", 10, 10, 0), allocation_of("x", 10, 10, 0)), "x appears twice"),
        (
            (allocation_of("x", 100, 60, 0), allocation_of("y", 100, 60, 0)),
            "no room left for allocation y",
        ),
    ],
)
def test_from_allocations_rejects_impossible_state(allocations, message: str) -> None:
    with pytest.raises(InvalidStateError, match=message):
        Fleet.from_allocations([gpu("g", allocations=allocations)])


def test_an_allocation_id_is_unique_across_the_fleet() -> None:
    fleet = fleet_of(gpu("a", allocations=(allocation_of("x", 10, 10, 0),)))
    with pytest.raises(InvalidStateError, match="x appears twice"):
        fleet.add_gpu(gpu("b", allocations=(allocation_of("x", 10, 10, 0),)))
    with pytest.raises(InvalidRequestError, match="already holds an allocation on GPU a"):
        fleet.place(job("x", 10, 10), get_policy("mra"))
    with pytest.raises(InvalidStateError, match="already registered"):
        fleet.add_gpu(gpu("a"))


def test_a_policy_cannot_commit_taken_space() -> None:
    class Squatter:
        name = "squatter"

        def place(self, job: JobRequest, fleet: Fleet, context: PlacementContext) -> Placement:
            return Placement(job.job_id, "a", "n", rect(0, 0, 50, 50), self.name)

    fleet = fleet_of(gpu("a"))
    fleet.place(job("j", 50, 50), Squatter())
    with pytest.raises(InvalidPlacementError, match="taken space"):
        fleet.place(job("k", 50, 50), Squatter())
    with pytest.raises(InvalidPlacementError, match="smaller rectangle"):
        fleet.place(job("m", 60, 50), Squatter())
    assert [a.allocation_id for a in fleet.allocations("a")] == ["j"]


def test_unknown_policy_names_the_known_ones() -> None:
    known = "known: best, bestfit, binpack, dotprod, fgd, fgd-fates, fgd-pack"
    with pytest.raises(ValueError, match=known):
        get_policy("bestest")
    assert get_policy(" mra ").name == "mra"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sm_percent": 0}, "sm_percent"),
        ({"sm_percent": 101}, "sm_percent"),
        ({"quota_request_percent": 0.0}, "quota_request_percent"),
        ({"quota_request_percent": 100.5}, "quota_request_percent"),
        ({"memory_bytes": -1}, "memory_bytes"),
        ({"priority": 10}, "priority"),
        ({"job_id": ""}, "job_id"),
    ],
)
def test_job_fields_are_checked(kwargs: dict, field: str) -> None:
    asked = {"sm_percent": 10, "quota_request_percent": 20.0, "memory_bytes": 0} | kwargs
    request = JobRequest(asked.pop("job_id", "j"), share_of(**asked))
    with pytest.raises(InvalidRequestError, match=field):
        fleet_of(gpu("a")).place(request, get_policy("mra"))


def test_fractional_quota_is_rounded_up_to_the_grid() -> None:
    fleet = fleet_of(gpu("a"))
    p = placed(fleet.place(job("j", 10, 33.33), get_policy("mra")))
    assert p.rect.w == 3333 and p.rect.quota_percent == 33.33
    q = placed(fleet.place(job("k", 10, 12.345), get_policy("mra")))
    assert q.rect.w == 1235  # never smaller than asked
    assert GpuState("g", "n", "m", 1).allocations == ()
