"""Time-slice groups whose memory is taken in turns (`Fleet.slice_into(..., memory_in_turns=
True)`): the GPU's dispatcher moves a suspended member's memory to host memory, so the group
holds its largest member's memory, not the sum. Members whose memory sums above the GPU join;
the charge follows the largest live member as members leave, and a restart rebuilds it."""

from __future__ import annotations

import pytest

from gpuloom.policies.placement import Fleet, InvalidPlacementError, get_policy

from .helpers import GIB, fleet_of, gpu, job, placed

MRA = get_policy("mra")


def full_gpu(memory_gib: float = 40) -> Fleet:
    """g0 (40 GiB) held whole by training job "a", which runs with 30 GiB."""
    fleet = fleet_of(gpu("g0", "A", 40))
    placed(fleet.place(job("a", 100, 100, memory_gib * 0.75), MRA))
    return fleet


def used(fleet: Fleet) -> int:
    return fleet.slot("g0").memory_used


def test_two_jobs_whose_memory_sums_above_the_gpu_take_their_memory_in_turns() -> None:
    fleet = full_gpu()
    with pytest.raises(InvalidPlacementError, match="needs 30 GiB of memory, the GPU has 10"):
        fleet.slice_into(job("b", 100, 100, 30), "g0", "a")  # beside: does not fit
    member = fleet.slice_into(job("b", 100, 100, 30), "g0", "a", memory_in_turns=True)
    assert member.in_turns and member.runs_with_bytes == 30 * GIB
    assert member.memory_bytes == 0  # nothing beyond the group's 30 GiB
    assert used(fleet) == 30 * GIB
    bigger = fleet.slice_into(job("c", 100, 100, 36), "g0", "a", memory_in_turns=True)
    assert bigger.memory_bytes == 6 * GIB  # the group now holds its largest member's 36 GiB
    assert used(fleet) == 36 * GIB
    with pytest.raises(InvalidPlacementError, match="needs 5 GiB of memory beyond its group's"):
        fleet.slice_into(job("d", 100, 100, 41), "g0", "a", memory_in_turns=True)
    fleet.verify()


@pytest.mark.parametrize("leaving", [["a"], ["c"], ["b", "a"], ["a", "c"], ["c", "a", "b"]])
def test_the_charge_follows_the_largest_member_left(leaving: list[str]) -> None:
    sizes = {"a": 30, "b": 20, "c": 36}
    fleet = full_gpu()
    fleet.slice_into(job("b", 100, 100, 20), "g0", "a", memory_in_turns=True)
    fleet.slice_into(job("c", 100, 100, 36), "g0", "a", memory_in_turns=True)
    left = set(sizes)
    for name in leaving:
        fleet.release(name)
        left.discard(name)
        assert used(fleet) == max((sizes[n] for n in left), default=0) * GIB, name
        fleet.verify()
        restarted = Fleet.from_allocations(fleet.snapshot())
        restarted.verify()
        assert restarted.slot("g0").memory_used == used(fleet)


def test_a_job_placed_beside_a_group_in_turns_gets_only_what_the_largest_member_leaves() -> None:
    fleet = fleet_of(gpu("g0", "A", 40))
    placed(fleet.place(job("a", 50, 100, 10), MRA))
    fleet.slice_into(job("b", 50, 100, 25), "g0", "a", memory_in_turns=True)
    assert used(fleet) == 25 * GIB
    with pytest.raises(InvalidPlacementError):
        fleet.slice_into(job("x", 50, 100, 16), "g0", "a")  # beside: 25 + 16 > 40
    placed(fleet.place(job("y", 50, 100, 15), MRA))  # the other half, beside the group's 25
    fleet.release("b")  # the group holds "a"'s 10 GiB again
    assert used(fleet) == 25 * GIB
    fleet.verify()


def test_a_gang_takes_its_memory_in_turns_on_each_gpu() -> None:
    fleet = fleet_of(gpu("g0", "A", 40, node="n1"), gpu("g1", "A", 40, node="n1"))
    host = placed(fleet.place(job("a", 100, 100, 30, gpus=2), MRA))
    groups = [(host.gpu_id, "a"), (host.extra_gpu_ids[0], "a#1")]
    joined = fleet.slice_gang_into(job("b", 100, 100, 35, gpus=2), groups, memory_in_turns=True)
    assert [a.memory_bytes for a in joined] == [5 * GIB, 5 * GIB]
    assert all(fleet.slot(g).memory_used == 35 * GIB for g in ("g0", "g1"))
    fleet.release("a")
    assert all(fleet.slot(g).memory_used == 35 * GIB for g in ("g0", "g1"))
    fleet.verify()
