"""Time-slice groups in the fleet (Gandiva's over-subscription): `Fleet.slice_into` puts a job in
the rectangle of an allocation already there, taking turns with it; the member holds memory and
node resources but no area, the box is freed when the group's last allocation leaves, and a
restart rebuilds the same state. `Fleet.slice_gang_into` does it for a job on several whole GPUs,
joining the group on each. Refusals change nothing. A hypothesis property mixes policy
placements (gangs too), slices, gang slices and releases."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.domain.shares import TimeQuota
from gpuloom.policies.placement import (
    GRID_AREA,
    Allocation,
    Fleet,
    GpuState,
    InvalidPlacementError,
    InvalidRequestError,
    InvalidStateError,
    JobRequest,
    Placement,
    get_policy,
)
from gpuloom.policies.placement.fleet_model import FleetModelPolicy
from gpuloom.policies.placement.maxrects import box_area, box_of

from .helpers import GIB, allocation_of, fleet_of, gpu, job, placed, rect

MRA = get_policy("mra")


def node_gpu(gpu_id: str, node: str = "n1", model: str = "A", memory_gib: float = 40, **kw):
    kw.setdefault("node_cpu_milli", 8000)
    kw.setdefault("node_memory_bytes", 64 * GIB)
    return gpu(gpu_id, model, memory_gib, node=node, **kw)


def one_full_gpu() -> Fleet:
    """g0 (model A, 40 GiB, node n1 of 8 CPUs and 64 GiB) full with training job "a" (10 GiB,
    1 CPU, 4 GiB of host memory); g1 (model B, same node) empty."""
    fleet = fleet_of(node_gpu("g0"), node_gpu("g1", model="B"))
    placed(
        fleet.place(
            job("a", 100, 100, 10, gpu_model="A", cpu_milli=1000, host_memory_bytes=4 * GIB),
            MRA,
        )
    )
    return fleet


def state(fleet: Fleet) -> tuple:
    """Everything a refusal must leave as it was."""
    nodes = {n: (s.cpu_used, s.memory_used) for n, s in fleet.nodes.items()}
    free = {g: (fleet.free_rects(g), fleet.slot(g).memory_free) for g in fleet.gpu_ids()}
    return fleet.snapshot(), nodes, free, fleet.slice_members("a")


# ---- joining ----


def test_a_member_sits_in_the_group_rectangle_and_holds_memory_and_node_resources() -> None:
    fleet = one_full_gpu()
    first = fleet.allocation("a")
    assert first is not None and first.slice_group == "a"
    free, area = fleet.free_rects("g0"), fleet.slot("g0").area_free
    member = fleet.slice_into(job("b", 50, 30, 12, cpu_milli=500, task_key="t"), "g0", "a")
    assert member == fleet.allocation("b")
    assert member.rect == first.rect and member.slice_of == "a" and member.slice_group == "a"
    assert (member.sm_percent, member.quota_request_percent, member.task_key) == (50, 30, "t")
    # No area: the free space is as it was; memory and node resources are held.
    assert fleet.free_rects("g0") == free and fleet.slot("g0").area_free == area == 0
    assert fleet.slot("g0").memory_used == 22 * GIB
    assert fleet.node("n1").cpu_used == 1500
    assert fleet.slice_members("a") == ("a", "b") and fleet.slice_members("b") == ()
    assert fleet.gpu_of("b") == "g0" and fleet.gpus_of("b") == ("g0",)
    fleet.verify()
    # A third joins the same group, on the same rectangle.
    fleet.slice_into(job("c", 100, 100, 1), "g0", "a")
    assert fleet.slice_members("a") == ("a", "b", "c")
    fleet.verify()


def test_a_group_may_be_a_partial_rectangle_and_other_jobs_still_fill_the_rest() -> None:
    fleet = fleet_of(node_gpu("g0"))
    p = placed(fleet.place(job("a", 40, 50, 1), MRA))
    fleet.slice_into(job("b", 40, 50, 1), "g0", "a")
    # The rest of the GPU is free for policies as before; nothing lands on the group's box.
    q = placed(fleet.place(job("c", 60, 100, 1), MRA))
    assert not p.rect.overlaps(q.rect)
    fleet.verify()


REFUSALS = [
    ("unknown GPU", lambda f: (job("b", 10, 10), "gx", "a"), "the GPU is unknown"),
    ("no group there", lambda f: (job("b", 10, 10), "g1", "a"), "holds no allocation of that"),
    ("no such group", lambda f: (job("b", 10, 10), "g0", "zz"), "holds no allocation of that"),
    ("other model", lambda f: (job("b", 10, 10, gpu_model="B"), "g0", "a"), "is a A, not a B"),
    ("too wide", lambda f: _narrow(f, job("b", 10, 60)), "does not fit in the group's"),
    ("too tall", lambda f: _narrow(f, job("b", 60, 10)), "does not fit in the group's"),
    ("memory", lambda f: (job("b", 10, 10, 31), "g0", "a"), "needs 31 GiB of memory"),
    ("cpu", lambda f: (job("b", 10, 10, cpu_milli=7001), "g0", "a"), "node n1 has not 7001"),
    (
        "host memory",
        lambda f: (job("b", 10, 10, host_memory_bytes=61 * GIB), "g0", "a"),
        "node n1 has not 61 GiB of host memory free",
    ),
    ("id held", lambda f: (job("a", 10, 10), "g0", "a"), "job a already holds"),
    ("id held elsewhere", lambda f: _elsewhere(f), "job e already holds"),
    ("whole GPUs", lambda f: (job("b", 100, 100, gpus=2), "g0", "a"), "asks for 2 whole GPUs"),
    ("replica", lambda f: (job("b", 10, 10, shared_model="m"), "g0", "a"), "replica of shared"),
    ("not a group key", lambda f: (job("b", 10, 10), "g0", ""), "holds no allocation of that"),
]


def _narrow(fleet: Fleet, job_: JobRequest) -> tuple[JobRequest, str, str]:
    """A second group of 50% quota x 50% SM on g1 to join."""
    placed(fleet.place(job("n", 50, 50, 1, gpu_model="B"), MRA))
    return job_, "g1", "n"


def _elsewhere(fleet: Fleet) -> tuple[JobRequest, str, str]:
    placed(fleet.place(job("e", 10, 10, 1, gpu_model="B"), MRA))
    return job("e", 10, 10), "g0", "a"


@pytest.mark.parametrize(("case", "make", "says"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_slice_names_the_problem_and_changes_nothing(case, make, says) -> None:
    fleet = one_full_gpu()
    job_, gpu_id, group = make(fleet)
    before = state(fleet)
    with pytest.raises(InvalidPlacementError, match="cannot join time-slice group") as error:
        fleet.slice_into(job_, gpu_id, group)
    assert says in str(error.value)
    assert state(fleet) == before
    fleet.verify()


def test_an_unschedulable_gpu_takes_no_member_and_a_bad_job_is_an_invalid_request() -> None:
    fleet = one_full_gpu()
    fleet.set_schedulable("g0", False)
    before = state(fleet)
    with pytest.raises(InvalidPlacementError, match="the GPU is not schedulable"):
        fleet.slice_into(job("b", 10, 10), "g0", "a")
    with pytest.raises(InvalidRequestError, match="sm_percent"):
        fleet.slice_into(job("b", 0, 10), "g0", "a")
    assert state(fleet) == before
    fleet.set_schedulable("g0", True)
    fleet.slice_into(job("b", 10, 10), "g0", "a")
    fleet.verify()


# ---- leaving ----


def test_the_box_stays_until_the_last_member_leaves_first_member_first() -> None:
    fleet = one_full_gpu()
    fleet.slice_into(job("b", 100, 100, 5, cpu_milli=500), "g0", "a")
    fleet.slice_into(job("c", 50, 50, 5), "g0", "a")
    released = fleet.release("a")
    assert released is not None and released.allocation_id == "a"
    slot = fleet.slot("g0")
    assert slot.area_free == 0 and fleet.free_rects("g0") == ()
    assert slot.memory_used == 10 * GIB and fleet.node("n1").cpu_used == 500
    assert fleet.slice_members("a") == ("b", "c")
    fleet.verify()
    # Its key names the live group: no new job takes it, a newcomer can still join.
    with pytest.raises(InvalidRequestError, match="key of a time-slice group still held on GPU"):
        fleet.place(job("a", 10, 10, 1), MRA)
    fleet.slice_into(job("d", 10, 10, 1), "g0", "a")
    assert fleet.release("b") is not None and fleet.release("d") is not None
    assert slot.area_free == 0
    fleet.verify()
    assert fleet.release("c") is not None
    assert slot.area_free == GRID_AREA and slot.memory_used == 0 and not slot.boxes
    assert fleet.node("n1").cpu_used == 0 and fleet.slice_members("a") == ()
    fleet.verify()
    # The group is gone: its key is free again, and the GPU takes a whole job.
    assert placed(fleet.place(job("a", 100, 100, 1, gpu_model="A"), MRA)).gpu_id == "g0"
    assert fleet.release("a") is not None and fleet.release("a") is None  # a retry is harmless
    fleet.verify()


def test_the_box_stays_until_the_last_member_leaves_last_member_first() -> None:
    fleet = one_full_gpu()
    fleet.slice_into(job("b", 100, 100, 5), "g0", "a")
    fleet.slice_into(job("c", 100, 100, 5), "g0", "a")
    for gone in ("c", "b"):
        assert fleet.release(gone) is not None
        assert fleet.slot("g0").area_free == 0
        fleet.verify()
    assert fleet.slice_members("a") == ("a",)
    assert fleet.release("a") is not None
    assert fleet.slot("g0").area_free == GRID_AREA
    assert fleet.free_rects("g0") == (rect(0, 0, 100, 100),)
    fleet.verify()


def test_removing_a_gpu_forgets_its_groups() -> None:
    fleet = one_full_gpu()
    fleet.slice_into(job("b", 100, 100, 5), "g0", "a")
    fleet.release("a")
    assert {a.allocation_id for a in fleet.remove_gpu("g0")} == {"b"}
    assert fleet.slice_members("a") == ()
    fleet.verify()
    placed(fleet.place(job("a", 10, 10, 1), MRA))  # the key is free again


# ---- rebuilding ----


def _group_fleet() -> Fleet:
    """g0: group "a" (its first released) with members b, c; group "x" with first and one
    member; a lone job "y"."""
    fleet = fleet_of(node_gpu("g0"))
    placed(fleet.place(job("a", 50, 50, 2, cpu_milli=100), MRA))
    placed(fleet.place(job("x", 50, 50, 2), MRA))
    placed(fleet.place(job("y", 20, 20, 2), MRA))
    fleet.slice_into(job("b", 50, 40, 3, cpu_milli=200), "g0", "a")
    fleet.slice_into(job("c", 30, 50, 3), "g0", "a")
    fleet.slice_into(job("z", 50, 50, 3), "g0", "x")
    fleet.release("a")
    fleet.verify()
    return fleet


@pytest.mark.parametrize("order", ["as stored", "reversed", "shuffled"])
def test_a_restart_rebuilds_groups_from_allocations_in_any_order(order: str) -> None:
    fleet = _group_fleet()
    (gpu_state,) = fleet.snapshot()
    allocations = list(gpu_state.allocations)
    if order == "reversed":
        allocations.reverse()
    elif order == "shuffled":
        random.Random(3).shuffle(allocations)
    rebuilt = Fleet.from_allocations([replace(gpu_state, allocations=tuple(allocations))])
    rebuilt.verify()
    mine, theirs = fleet.slot("g0"), rebuilt.slot("g0")
    assert theirs.allocations == mine.allocations and theirs.boxes == mine.boxes
    assert (theirs.area_free, theirs.memory_free) == (mine.area_free, mine.memory_free)
    assert sorted(theirs.free.maximal) == sorted(mine.free.maximal)
    assert rebuilt.node("n1").cpu_used == 200
    assert rebuilt.slice_members("a") == ("b", "c") and rebuilt.slice_members("x") == ("x", "z")
    # The rebuilt group lives on as before.
    rebuilt.release("b")
    rebuilt.release("c")
    assert rebuilt.slot("g0").area_free == mine.area_free + 50 * 50 * 100
    rebuilt.verify()


def test_members_without_a_rectangle_join_their_group() -> None:
    fleet = _group_fleet()
    (gpu_state,) = fleet.snapshot()
    # Old records: members stored without their rectangle take their group's, if the group
    # has one stored ("x"), else the group is placed once, first-fit, large enough for each
    # ("a": b asks 40% quota x 50% SM, c 50% x 30%).
    bare = tuple(replace(a, rect=None) if a.slice_of else a for a in gpu_state.allocations)
    rebuilt = Fleet.from_allocations([replace(gpu_state, allocations=bare)])
    rebuilt.verify()
    mine, theirs = fleet.slot("g0"), rebuilt.slot("g0")
    assert {k: v for k, v in theirs.allocations.items() if k != "b" and k != "c"} == {
        k: v for k, v in mine.allocations.items() if k != "b" and k != "c"
    }
    b, c = theirs.allocations["b"], theirs.allocations["c"]
    assert b.rect == c.rect and b.rect is not None
    assert (b.rect.w, b.rect.h) == (50 * 100, 50) and theirs.boxes["a"] == box_of(b.rect)
    assert rebuilt.slice_members("a") == ("b", "c")


def _stored(*allocations: Allocation, gpu_id: str = "g0") -> GpuState:
    return GpuState(gpu_id, "n1", "A", 40 * GIB, allocations=allocations)


R = rect(0, 0, 50, 50)
FIRST = allocation_of("a", 50, 50, 0, rect=R)


def _member(a_id: str, at: object = R, group: str = "a", gib: int = 0, shape: int = 10):
    return allocation_of(a_id, shape, shape, gib * GIB, rect=at, slice_of=group)  # type: ignore[arg-type]


BAD_STATES = {
    "member elsewhere": (
        [_stored(FIRST, _member("b", rect(0, 0, 10, 10)))],
        "of time-slice group a sits in",
    ),
    "members apart": (
        [_stored(_member("b"), _member("c", rect(50, 50, 50, 50)))],
        "of time-slice group a sits in",
    ),
    "member too big": (
        [
            _stored(
                allocation_of("a", 10, 10, 0, rect=rect(0, 0, 10, 10)), _member("b", None, shape=20)
            )
        ],
        "does not fit in its time-slice group a's",
    ),
    "group on two GPUs": (
        [_stored(FIRST), _stored(_member("b"), gpu_id="g1")],
        "time-slice group a has allocations on GPUs g0 and g1",
    ),
    "first on another GPU": (
        [_stored(_member("b")), _stored(FIRST, gpu_id="g1")],
        "time-slice group a has allocations on GPUs g0 and g1",
    ),
    "member's group": (
        [_stored(_member("b"), _member("a", rect(50, 50, 10, 10), group="q"))],
        "itself a member of group q",
    ),
    "memory": (
        [_stored(FIRST, _member("b", gib=20), _member("c", gib=21))],
        "allocations hold 41 GiB of 40 GiB",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_stored_groups_that_cannot_be_are_refused(case: str) -> None:
    gpus, says = BAD_STATES[case]
    with pytest.raises(InvalidStateError, match=says):
        Fleet.from_allocations(gpus)


def test_an_allocation_names_its_group_sensibly() -> None:
    for bad, says in [
        (allocation_of("a", 10, 10, 0, slice_of="a"), "names the allocation itself"),
        (allocation_of("a#1", 10, 10, 0, gang="a", slice_of="a#1"), "names the allocation itself"),
        (allocation_of("a", 10, 10, 0, slice_of=None), "slice_of must be a non-empty string"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(InvalidRequestError, match=says):
            bad.validate()
    allocation_of("a", 10, 10, 0, slice_of="b").validate()
    # A further GPU of a job joins the group on its GPU (a gang time-sliced into a gang).
    allocation_of("a#1", 10, 10, 0, gang="a", slice_of="b#1").validate()


# ---- a job on several whole GPUs joining a group on each ----


def gang_fleet() -> Fleet:
    """Node n1: g0, g1 (model A, 40 GiB) held whole by the 2-GPU job "h" (10 GiB on each, 1 CPU
    and 4 GiB of host memory), g3 (model B) empty; node n2: g2 (model A) empty."""
    fleet = fleet_of(
        node_gpu("g0"), node_gpu("g1"), node_gpu("g2", node="n2"), node_gpu("g3", model="B")
    )
    host = job("h", 100, 100, 10, gpu_model="A", gpus=2, cpu_milli=1000)
    p = placed(fleet.place(replace(host, host_memory_bytes=4 * GIB), MRA))
    assert p.gpu_ids == ("g0", "g1")
    return fleet


HOST_GROUPS = (("g0", "h"), ("g1", "h#1"))


def newcomer(job_id: str = "n", gib: float = 12, **kw) -> JobRequest:
    kw.setdefault("cpu_milli", 500)
    kw.setdefault("host_memory_bytes", 2 * GIB)
    return job(job_id, 100, 100, gib, gpus=2, task_key="t", **kw)


def gang_state(fleet: Fleet) -> tuple:
    """Everything a refusal must leave as it was (and a restart must rebuild), in any order."""
    gpus = {g.gpu_id: replace(g, allocations=()) for g in fleet.snapshot()}
    held = {g: sorted(fleet.allocations(g), key=lambda a: a.allocation_id) for g in gpus}
    nodes = {n: (s.cpu_used, s.memory_used) for n, s in fleet.nodes.items()}
    free = {g: (fleet.free_rects(g), fleet.slot(g).memory_free) for g in fleet.gpu_ids()}
    groups = {g: fleet.slice_members(g) for g in ("h", "h#1", "n", "n#1")}
    return gpus, held, nodes, free, groups, fleet.gpus_of("n")


def test_a_gang_joins_the_group_on_each_of_a_running_gangs_gpus() -> None:
    fleet = gang_fleet()
    first, second = fleet.slice_gang_into(newcomer(), HOST_GROUPS)
    assert (first, second) == (fleet.allocation("n"), fleet.allocation("n#1"))
    whole = rect(0, 0, 100, 100)
    assert (first.allocation_id, first.gang, first.slice_of) == ("n", "", "h")
    assert (second.allocation_id, second.gang, second.slice_of) == ("n#1", "n", "h#1")
    assert first.rect == second.rect == whole
    assert first.memory_bytes == second.memory_bytes == 12 * GIB
    # Node resources on the first GPU only, as a placed gang holds them.
    assert (first.cpu_milli, first.host_memory_bytes) == (500, 2 * GIB)
    assert (second.cpu_milli, second.host_memory_bytes) == (0, 0)
    assert (first.task_key, second.task_key) == ("t", "t")
    for g in ("g0", "g1"):
        assert fleet.slot(g).memory_used == 22 * GIB and fleet.slot(g).area_free == 0
        assert set(fleet.slot(g).boxes) == {"h" if g == "g0" else "h#1"}
    assert (fleet.node("n1").cpu_used, fleet.node("n1").memory_used) == (1500, 6 * GIB)
    assert fleet.gpus_of("n") == ("g0", "g1") and fleet.gpus_of("h") == ("g0", "g1")
    assert fleet.slice_members("h") == ("h", "n") and fleet.slice_members("h#1") == ("h#1", "n#1")
    fleet.verify()
    # The pairs' order picks the first GPU: it may be the host's second.
    fleet.release("n")
    fleet.verify()
    fleet.slice_gang_into(newcomer(), tuple(reversed(HOST_GROUPS)))
    assert fleet.gpus_of("n") == ("g1", "g0") and fleet.allocation("n#1").slice_of == "h"  # type: ignore[union-attr]
    assert fleet.allocation("n").cpu_milli == 500  # type: ignore[union-attr]
    fleet.verify()


def _other_node_group(fleet: Fleet) -> tuple[JobRequest, tuple]:
    placed(fleet.place(job("o", 100, 100, 1, gpu_model="A"), MRA))  # on g2, node n2
    assert fleet.gpu_of("o") == "g2"
    return newcomer(), (("g0", "h"), ("g2", "o"))


def _partial_group(fleet: Fleet) -> tuple[JobRequest, tuple]:
    placed(fleet.place(job("p", 50, 50, 1, gpu_model="B"), MRA))  # on g3, node n1
    return newcomer(), (("g0", "h"), ("g3", "p"))


def _second_gpu_short(fleet: Fleet) -> tuple[JobRequest, tuple]:
    fleet.slice_into(job("s", 100, 100, 10), "g1", "h#1")  # g1: 20 GiB free, g0: 30
    return newcomer(gib=25), HOST_GROUPS


def _member_id_held(fleet: Fleet) -> tuple[JobRequest, tuple]:
    placed(fleet.place(job("n#1", 10, 10, 1, gpu_model="B"), MRA))
    return newcomer(), HOST_GROUPS


def _unschedulable(fleet: Fleet) -> tuple[JobRequest, tuple]:
    fleet.set_schedulable("g1", False)
    return newcomer(), HOST_GROUPS


GANG_REFUSALS = [
    ("one GPU", lambda f: (job("n", 100, 100), HOST_GROUPS[:1]), "it asks for one GPU"),
    ("too few", lambda f: (newcomer(), HOST_GROUPS[:1]), "it asks for 2 GPUs, 1 are named"),
    ("too many", lambda f: (newcomer(), (*HOST_GROUPS, ("g3", "x"))), "3 are named"),
    ("twice", lambda f: (newcomer(), (("g0", "h"), ("g0", "h"))), "GPU g0 is named twice"),
    ("other node", _other_node_group, "GPU g2 is on node n2, GPU g0 on n1"),
    ("unknown", lambda f: (newcomer(), (("g0", "h"), ("gx", "h#1"))), "GPU gx: the GPU is unkn"),
    ("no group", lambda f: (newcomer(), (("g0", "h"), ("g1", "h"))), "GPU g1: the GPU holds no"),
    ("empty GPU", lambda f: (newcomer(), (("g0", "h"), ("g3", "h#1"))), "GPU g3: the GPU holds"),
    ("unschedulable", _unschedulable, "GPU g1: the GPU is not schedulable"),
    ("other model", lambda f: (newcomer(gpu_model="B"), HOST_GROUPS), "GPU g0: the GPU is a A"),
    ("part of a GPU", _partial_group, "GPU g3: its 100% quota x 100% SM does not fit"),
    ("memory", lambda f: (newcomer(gib=31), HOST_GROUPS), "GPU g0: it needs 31 GiB of memory"),
    ("memory there", _second_gpu_short, "GPU g1: it needs 25 GiB of memory, the GPU has 20"),
    ("cpu", lambda f: (newcomer(cpu_milli=7001), HOST_GROUPS), "node n1 has not 7001"),
    (
        "host memory",
        lambda f: (newcomer(host_memory_bytes=61 * GIB), HOST_GROUPS),
        "node n1 has not 500 milli CPU and 61 GiB of host memory free",
    ),
    ("id held", lambda f: (newcomer("h"), HOST_GROUPS), "job h already holds"),
    ("member id held", _member_id_held, "job n#1 already holds"),
]


@pytest.mark.parametrize(("case", "make", "says"), GANG_REFUSALS, ids=[r[0] for r in GANG_REFUSALS])
def test_a_refused_gang_slice_names_the_gpu_and_problem_and_changes_nothing(
    case, make, says
) -> None:
    fleet = gang_fleet()
    job_, groups = make(fleet)
    before = gang_state(fleet)
    with pytest.raises(InvalidPlacementError, match="cannot join time-slice groups") as error:
        fleet.slice_gang_into(job_, groups)
    assert says in str(error.value)
    assert gang_state(fleet) == before
    fleet.verify()


def test_a_gang_slice_with_bad_pairs_or_a_bad_job_is_an_invalid_request() -> None:
    fleet = gang_fleet()
    before = gang_state(fleet)
    for groups in [(("g0", "h"), ("g1",)), (("g0", "h"), ["g1", "h#1"]), (("g0", "h"), ("g1", 1))]:
        with pytest.raises(InvalidRequestError, match="groups must hold"):
            fleet.slice_gang_into(newcomer(), groups)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="takes them whole"):
        fleet.slice_gang_into(job("n", 50, 100, gpus=2), HOST_GROUPS)
    assert gang_state(fleet) == before


def test_the_host_gang_leaving_first_keeps_both_boxes_until_the_newcomer_leaves() -> None:
    fleet = gang_fleet()
    fleet.slice_gang_into(newcomer(), HOST_GROUPS)
    assert fleet.release("h") is not None
    for g in ("g0", "g1"):
        slot = fleet.slot(g)
        assert slot.area_free == 0 and fleet.free_rects(g) == ()
        assert slot.memory_used == 12 * GIB
    assert (fleet.node("n1").cpu_used, fleet.node("n1").memory_used) == (500, 2 * GIB)
    assert fleet.slice_members("h") == ("n",) and fleet.slice_members("h#1") == ("n#1",)
    assert fleet.gpus_of("h") == () and fleet.gpus_of("n") == ("g0", "g1")
    fleet.verify()
    # The boxes stay taken: no whole-GPU job gets g0 or g1, the live keys are not reusable.
    assert isinstance(fleet.place(job("w", 100, 100, 1, gpu_model="A"), MRA), Placement)  # g2
    assert fleet.gpu_of("w") == "g2"
    assert not isinstance(fleet.place(job("w2", 100, 100, 1, gpu_model="A"), MRA), Placement)
    assert not isinstance(fleet.place(job("w3", 100, 100, gpus=2), MRA), Placement)
    for taken in ("h", "h#1"):
        with pytest.raises(InvalidRequestError, match="key of a time-slice group still held"):
            fleet.place(job(taken, 10, 10, 1), MRA)
    fleet.verify()
    # The newcomer leaving frees both boxes and every resource it held.
    assert fleet.release("w") is not None
    assert fleet.release("n") is not None and fleet.release("n") is None
    for g in ("g0", "g1"):
        slot = fleet.slot(g)
        assert slot.area_free == GRID_AREA and slot.memory_used == 0 and not slot.boxes
    assert (fleet.node("n1").cpu_used, fleet.node("n1").memory_used) == (0, 0)
    assert fleet.slice_members("h") == () and fleet.slice_members("h#1") == ()
    fleet.verify()
    assert placed(fleet.place(job("h", 100, 100, gpus=2), MRA)).gpu_ids == ("g0", "g1")
    fleet.verify()


def test_the_newcomer_leaving_first_gives_back_its_memory_only() -> None:
    fleet = gang_fleet()
    fleet.slice_gang_into(newcomer(), HOST_GROUPS)
    assert fleet.release("n") is not None
    for g in ("g0", "g1"):
        assert fleet.slot(g).memory_used == 10 * GIB and fleet.slot(g).area_free == 0
    assert fleet.node("n1").cpu_used == 1000 and fleet.slice_members("h") == ("h",)
    fleet.verify()
    assert fleet.release("h") is not None
    assert all(fleet.slot(g).area_free == GRID_AREA for g in ("g0", "g1"))
    fleet.verify()


@pytest.mark.parametrize("host_released", [False, True])
@pytest.mark.parametrize("order", ["as stored", "shuffled"])
def test_a_restart_rebuilds_a_gang_in_groups(host_released: bool, order: str) -> None:
    fleet = gang_fleet()
    fleet.slice_gang_into(newcomer(), HOST_GROUPS)
    fleet.slice_into(job("s", 100, 100, 1), "g1", "h#1")  # a one-GPU member beside it
    if host_released:
        fleet.release("h")
    states = fleet.snapshot()
    if order == "shuffled":
        rng = random.Random(5)
        states = [
            replace(s, allocations=tuple(rng.sample(s.allocations, len(s.allocations))))
            for s in states
        ]
        rng.shuffle(states)
    rebuilt = Fleet.from_allocations(states)
    rebuilt.verify()
    assert gang_state(rebuilt) == gang_state(fleet)
    for g in fleet.gpu_ids():
        assert rebuilt.slot(g).boxes == fleet.slot(g).boxes
        assert sorted(rebuilt.slot(g).free.maximal) == sorted(fleet.slot(g).free.maximal)
    # The rebuilt gang leaves as one, and the groups' boxes go with their last allocation.
    rebuilt.release("n")
    rebuilt.release("s")
    assert rebuilt.slot("g0").area_free == (GRID_AREA if host_released else 0)
    assert rebuilt.slot("g1").area_free == (GRID_AREA if host_released else 0)
    rebuilt.verify()


def test_a_stored_gang_member_in_a_group_of_another_gpu_is_refused() -> None:
    fleet = gang_fleet()
    fleet.slice_gang_into(newcomer(), HOST_GROUPS)
    fleet.release("h")
    states = fleet.snapshot()
    # n#1 on g1 claiming g0's group "h": that group would span two GPUs.
    moved = [
        replace(
            s,
            allocations=tuple(
                replace(a, slice_of="h") if a.allocation_id == "n#1" else a for a in s.allocations
            ),
        )
        for s in states
    ]
    with pytest.raises(InvalidStateError, match="time-slice group h has allocations on GPUs"):
        Fleet.from_allocations(moved)


# ---- other readers ----


def test_gpu_clustering_reads_a_group_whose_first_is_gone() -> None:
    fleet = fleet_of(node_gpu("g0"), node_gpu("g1"))
    policy = FleetModelPolicy("gpuclustering")
    placed(fleet.place(job("a", 50, 50, 1), policy))
    group_gpu = fleet.gpu_of("a")
    assert group_gpu is not None
    fleet.slice_into(job("b", 50, 50, 1), group_gpu, "a")
    fleet.release("a")
    for n in range(4):
        assert isinstance(fleet.place(job(f"j{n}", 50, 50, 1), policy), Placement)
    fleet.verify()


def test_members_count_in_holder_groups_like_any_allocation() -> None:
    fleet = fleet_of(node_gpu("g0"))
    placed(fleet.place(job("a", 100, 100, 1, priority=2, task_key="t"), MRA))
    fleet.slice_into(job("b", 100, 100, 1, priority=5, task_key="u"), "g0", "a")
    assert fleet.holder_groups() == {("t", 2, 1): ["g0"]}
    fleet.release("a")  # the member holds the GPU now
    assert fleet.holder_groups() == {("u", 5, 0): ["g0"]}
    fleet.verify()


# ---- the property ----

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICY_NAMES = ("mra", "binpack", "gap-aware", "time-share", "gpuclustering", "fgd")


@st.composite
def sequences(draw: st.DrawFn):
    # Two nodes (the GPUs of one registered with the same node figures).
    nodes = [
        (
            draw(st.sampled_from((0, 4000, 8000, 16000))),
            draw(st.sampled_from((0, 32 * GIB, 64 * GIB))),
        )
        for _ in range(2)
    ]
    gpus = [
        node_gpu(
            f"g{i}",
            node=f"n{i % 2}",
            model=draw(st.sampled_from(("A", "B"))),
            memory_gib=draw(st.sampled_from((16, 40))),
            node_cpu_milli=nodes[i % 2][0],
            node_memory_bytes=nodes[i % 2][1],
        )
        for i in range(draw(st.integers(1, 4)))
    ]
    shape = st.tuples(st.integers(1, 100), st.sampled_from((5.0, 20.0, 33.33, 50.0, 100.0)))
    ask = st.tuples(
        shape,
        st.sampled_from((0, 1, 2, 4, 12)),  # GiB
        st.sampled_from((0, 0, 500, 3000)),  # milli CPU
        st.sampled_from((0, 0, 8 * GIB)),  # host memory
        st.sampled_from(("", "", "A", "B")),
    )
    place = st.tuples(st.just("place"), ask, st.sampled_from(POLICY_NAMES))
    join = st.tuples(st.just("slice"), ask, st.integers(0, 1000), st.integers(0, 1000))
    release = st.tuples(st.just("release"), st.integers(0, 1000))
    toggle = st.tuples(st.just("toggle"), st.integers(0, 3))
    # Jobs on two whole GPUs, placed or time-sliced into another such job's GPUs.
    gang = st.tuples(st.just("gang"), ask, st.sampled_from(POLICY_NAMES))
    gang_join = st.tuples(st.just("gang-slice"), ask, st.integers(0, 1000), st.integers(0, 1000))
    op = st.one_of(
        place,
        place,
        place,
        join,
        join,
        join,
        release,
        release,
        toggle,
        gang,
        gang,
        *[gang_join] * 3,
    )
    return gpus, draw(st.lists(op, min_size=5, max_size=50))


def check(fleet: Fleet) -> None:
    fleet.verify()
    for gpu_id in fleet.gpu_ids():
        slot = fleet.slot(gpu_id)
        allocations = list(slot.allocations.values())
        assert sum(a.memory_bytes for a in allocations) <= slot.memory_bytes
        # One box per group: the area used is that of the groups' rectangles, each once.
        groups = {a.slice_group: box_of(a.rect) for a in allocations}  # type: ignore[arg-type]
        assert groups == slot.boxes
        assert slot.area_used == sum(box_area(b) for b in groups.values())
    for node in fleet.nodes.values():
        assert node.cpu_used <= node.cpu_milli or node.cpu_used == 0
        assert node.memory_used <= node.memory_bytes or node.memory_used == 0


def _gang_slice(fleet: Fleet, j: JobRequest, live: list[str], pick: int, how: int) -> str | None:
    """Time-slice the 2-GPU job `j` into the groups of a live job on two GPUs, in either order,
    mostly; now and then into a GPU twice or into any group of any GPU (mostly refused)."""
    gangs = [a for a in live if len(fleet.gpus_of(a)) == 2]
    pairs: list[tuple[str, str]] = []
    if gangs:
        host = gangs[pick % len(gangs)]
        for a_id in (host, f"{host}#1"):
            allocation = fleet.allocation(a_id)
            gpu_id = fleet.gpu_of(a_id)
            assert allocation is not None and gpu_id is not None
            pairs.append((gpu_id, allocation.slice_group))
        if how % 2:
            pairs.reverse()
    if how % 5 == 0 or not pairs:
        gpu_ids = sorted(fleet.gpu_ids())
        gpu_id = gpu_ids[pick % len(gpu_ids)]
        keys = sorted(fleet.slot(gpu_id).boxes) or ["none"]
        pairs = [*pairs[:1], (gpu_id, keys[how % len(keys)])]
        if len(pairs) < 2:
            pairs.append(pairs[0] if how % 3 else (gpu_ids[(pick + 1) % len(gpu_ids)], "none"))
    before = fleet.snapshot()
    try:
        joined = fleet.slice_gang_into(j, pairs)
    except InvalidPlacementError:
        assert fleet.snapshot() == before
        return None
    assert [(fleet.gpu_of(a.allocation_id), a.slice_group) for a in joined] == pairs
    assert fleet.gpus_of(j.job_id) == tuple(g for g, _ in pairs)
    assert [a.gang for a in joined] == ["", j.job_id]
    return j.job_id


def run_sequence(gpus: list[GpuState], ops: list[tuple]) -> Fleet:
    fleet = Fleet.from_allocations(gpus)
    policies = {name: get_policy(name) for name in POLICY_NAMES}
    live: list[str] = []
    for n, op in enumerate(ops):
        if op[0] in ("gang", "gang-slice"):
            _, gib, cpu, host, model = op[1]
            j = job(f"j{n}", 100, 100, gib, gpus=2, cpu_milli=cpu, host_memory_bytes=host)
            if op[0] == "gang":
                j = replace(j, gpu_model=model)
                if isinstance(fleet.place(j, policies[op[2]]), Placement):
                    live.append(j.job_id)
            elif (member := _gang_slice(fleet, j, live, op[2], op[3])) is not None:
                live.append(member)
        elif op[0] in ("place", "slice"):
            (sm, quota), gib, cpu, host, model = op[1]
            j = job(f"j{n}", sm, quota, gib, gpu_model=model, cpu_milli=cpu)
            j = replace(j, host_memory_bytes=host, task_key=("t0", "t1", "")[n % 3])
            if op[0] == "place":
                if isinstance(fleet.place(j, policies[op[2]]), Placement):
                    live.append(j.job_id)
            else:
                # A group of a GPU holding some (its first maybe gone), mostly with a shape
                # that fits it; now and then a wrong GPU, model or shape.
                fit = op[3] % 4 != 0
                held = sorted(g for g in fleet.gpu_ids() if fleet.slot(g).boxes)
                open_ = [g for g in held if fleet.slot(g).schedulable]
                gpu_ids = (open_ if fit else []) or held or sorted(fleet.gpu_ids())
                gpu_id = gpu_ids[op[2] % len(gpu_ids)]
                boxes = fleet.slot(gpu_id).boxes
                group = sorted(boxes)[op[3] % len(boxes)] if boxes else "none"
                if boxes and fit:
                    x0, y0, x1, y1 = boxes[group]
                    quota = min(quota, (x1 - x0) / 100)
                    fitted = replace(
                        j.share, sm_percent=min(sm, y1 - y0), quota=TimeQuota(quota, quota)
                    )
                    j = replace(j, share=fitted)
                    j = replace(j, gpu_model="")
                if op[3] % 7 == 0:
                    gpu_id = sorted(fleet.gpu_ids())[(op[2] + 1) % len(gpus)]
                before = fleet.snapshot()
                try:
                    member = fleet.slice_into(j, gpu_id, group)
                except InvalidPlacementError:
                    assert fleet.snapshot() == before
                else:
                    assert member.slice_group == group and j.job_id in fleet.slice_members(group)
                    live.append(j.job_id)
        elif op[0] == "release" and live:
            assert fleet.release(live.pop(op[1] % len(live))) is not None
        elif op[0] == "toggle" and op[1] < len(gpus):
            gpu_id = gpus[op[1]].gpu_id
            fleet.set_schedulable(gpu_id, not fleet.slot(gpu_id).schedulable)
        check(fleet)
    return fleet


@FAST
@given(sequence=sequences(), seed=st.integers(0, 2**16))
def test_places_slices_and_releases_keep_every_invariant(sequence, seed: int) -> None:
    fleet = run_sequence(*sequence)
    snapshot = fleet.snapshot()
    # A restart, the allocations in any order, rebuilds the same state.
    shuffled = []
    for gpu_state in snapshot:
        allocations = list(gpu_state.allocations)
        random.Random(seed).shuffle(allocations)
        shuffled.append(replace(gpu_state, allocations=tuple(allocations)))
    random.Random(seed).shuffle(shuffled)
    for states in (snapshot, shuffled):
        rebuilt = Fleet.from_allocations(states)
        check(rebuilt)
        for gpu_id in fleet.gpu_ids():
            mine, theirs = fleet.slot(gpu_id), rebuilt.slot(gpu_id)
            assert theirs.allocations == mine.allocations
            assert theirs.boxes == mine.boxes
            assert sorted(theirs.free.maximal) == sorted(mine.free.maximal)
            assert (theirs.area_free, theirs.memory_free) == (mine.area_free, mine.memory_free)
        assert {n: (s.cpu_used, s.memory_used) for n, s in rebuilt.nodes.items()} == {
            n: (s.cpu_used, s.memory_used) for n, s in fleet.nodes.items()
        }


def test_a_long_run_of_slices_on_crowded_gpus() -> None:
    rng = random.Random(7)
    gpus = [node_gpu("g0", memory_gib=80), node_gpu("g1", memory_gib=80, node="n2")]
    ops: list[tuple] = []
    for _ in range(400):
        ask = ((rng.randint(5, 60), rng.choice((10.0, 25.0, 50.0))), rng.randint(0, 4), 0, 0, "")
        r = rng.random()
        if r < 0.35:
            ops.append(("place", ask, "mra"))
        elif r < 0.7:
            ops.append(("slice", ask, rng.randrange(1000), rng.randrange(1000)))
        else:
            ops.append(("release", rng.randrange(1000)))
    fleet = run_sequence(gpus, ops)
    assert any(a.slice_of for g in fleet.gpu_ids() for a in fleet.allocations(g))
    Fleet.from_allocations(fleet.snapshot()).verify()


def test_a_long_run_of_gang_slices() -> None:
    rng = random.Random(11)
    gpus = [node_gpu(f"g{i}", memory_gib=80, node=f"n{i % 2}") for i in range(4)]
    ops: list[tuple] = []
    joined = 0
    for _ in range(300):
        ask = ((100, 100.0), rng.randint(0, 8), rng.choice((0, 500)), 0, "")
        r = rng.random()
        if r < 0.25:
            ops.append(("gang", ask, rng.choice(("mra", "fgd"))))
        elif r < 0.6:
            ops.append(("gang-slice", ask, rng.randrange(1000), rng.randrange(1000)))
        elif r < 0.7:
            ops.append(("slice", ask, rng.randrange(1000), rng.randrange(1000)))
        else:
            ops.append(("release", rng.randrange(1000)))
    original = Fleet.slice_gang_into

    def counted(fleet: Fleet, j: JobRequest, groups):  # type: ignore[no-untyped-def]
        nonlocal joined
        result = original(fleet, j, groups)
        joined += 1
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Fleet, "slice_gang_into", counted)
        fleet = run_sequence(gpus, ops)
    assert joined >= 10
    Fleet.from_allocations(fleet.snapshot()).verify()
