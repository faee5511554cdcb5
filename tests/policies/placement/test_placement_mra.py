"""MRA specifics: the best-match choice, Subdivide and redundant-rectangle removal on a
hand-worked example, keep-restructure on release, and the rebuild threshold."""

from gpuloom.policies.placement import MraPolicy, get_policy
from gpuloom.policies.placement.maxrects import FULL, FreeRects, maximal_boxes, subtract

from .helpers import STEPS, allocation_of, fleet_of, gpu, job, placed, rect


def box(quota_at: float, sm_at: int, quota_to: float, sm_to: int):
    """A box (x0, y0, x1, y1) in percent of quota and SM."""
    return (round(quota_at * STEPS), sm_at, round(quota_to * STEPS), sm_to)


def test_subdivide_keeps_the_maximal_parts_on_each_side() -> None:
    # A cut strictly inside the GPU leaves four maximal rectangles: left, right, below, above.
    assert sorted(subtract([FULL], box(20, 30, 40, 50))) == sorted(
        [box(0, 0, 20, 100), box(40, 0, 100, 100), box(0, 0, 100, 30), box(0, 50, 100, 100)]
    )


def test_split_and_redundant_removal_hand_worked() -> None:
    free = FreeRects()
    # ResNet 1 at the bottom-left: right of it and above it.
    free.occupy(box(0, 0, 40, 12))
    assert sorted(free.maximal) == sorted([box(40, 0, 100, 100), box(0, 12, 100, 100)])
    # ResNet 2 next to it cuts only the right one, into [80,100]x[0,100] and [40,100]x[12,100];
    # the latter lies inside [0,100]x[12,100] and is dropped.
    free.occupy(box(40, 0, 80, 12))
    assert sorted(free.maximal) == sorted([box(80, 0, 100, 100), box(0, 12, 100, 100)])
    # A cut across both: each splits, and the parts inside others go.
    free.occupy(box(70, 10, 90, 20))
    assert sorted(free.maximal) == sorted(
        [
            box(90, 0, 100, 100),  # right of the cut, inside the strip [80,100]
            box(0, 20, 100, 100),  # above the cut
            box(0, 12, 70, 100),  # left of the cut, from the upper rectangle
            box(80, 0, 100, 10),  # below the cut, from the strip
        ]
    )
    assert sorted(free.maximal) == sorted(
        maximal_boxes([box(0, 0, 40, 12), box(40, 0, 80, 12), box(70, 10, 90, 20)])
    )


def test_best_match_takes_the_least_area_difference_over_all_gpus() -> None:
    fleet = fleet_of(
        # a: 40 % quota x 100 % SM free (4000 %^2), b: 50 % x 100 % free, c: empty.
        gpu("a", allocations=(allocation_of("x", 100, 60, 0, rect=rect(0, 0, 60, 100)),)),
        gpu("b", allocations=(allocation_of("y", 100, 50, 0, rect=rect(0, 0, 50, 100)),)),
        gpu("c"),
    )
    p = placed(fleet.place(job("j", 50, 30), MraPolicy()))
    assert (p.gpu_id, p.rect) == ("a", rect(60, 0, 30, 50))
    # 45 % quota does not fit a's 40 %: b's 50 % x 100 % is the least area that does.
    assert placed(fleet.place(job("k", 10, 45), MraPolicy())).gpu_id == "b"
    # Shape decides before area: a 100 % SM job fits neither a's nor b's leftovers.
    assert placed(fleet.place(job("m", 100, 10), MraPolicy())).gpu_id == "a"
    assert placed(fleet.place(job("n", 100, 15), MraPolicy())).gpu_id == "c"


def test_inside_one_gpu_the_smallest_fitting_rectangle_wins() -> None:
    # Free: a 20 % quota x 100 % SM strip (area 2000 %^2) and a 100 % x 30 % band (3000);
    # a job that fits both goes to the strip.
    fleet = fleet_of(
        gpu("g", allocations=(allocation_of("x", 70, 80, 0, rect=rect(0, 30, 80, 70)),))
    )
    assert sorted(fleet.free_rects("g")) == sorted([rect(80, 0, 20, 100), rect(0, 0, 100, 30)])
    assert placed(fleet.place(job("j", 30, 20), MraPolicy())).rect == rect(80, 0, 20, 30)


def test_release_then_same_shape_reuses_the_freed_rectangle() -> None:
    fleet = fleet_of(gpu("g"), gpu("h"))
    mra = get_policy("mra")
    first = [placed(fleet.place(job(f"j{i}", 30, 25), mra)) for i in range(6)]
    freed = first[2]
    fleet.release(freed.allocation_id)
    assert freed.rect in fleet.free_rects(freed.gpu_id)  # kept
    again = placed(fleet.place(job("again", 30, 25), mra))
    assert (again.gpu_id, again.rect) == (freed.gpu_id, freed.rect)
    fleet.verify()


def test_release_restructures_so_merged_space_is_found() -> None:
    # Four quarters; freeing the two on the left makes a 50 % x 100 % column that no kept
    # rectangle alone would offer.
    fleet = fleet_of(gpu("g"))
    mra = get_policy("mra")
    quarters = [placed(fleet.place(job(f"q{i}", 50, 50), mra)) for i in range(4)]
    left = [q for q in quarters if q.rect.x == 0]
    for q in left:
        fleet.release(q.allocation_id)
    column = placed(fleet.place(job("column", 100, 50), mra))
    assert (column.gpu_id, column.rect) == ("g", rect(0, 0, 50, 100))
    fleet.verify()


def test_the_list_is_rebuilt_past_the_threshold() -> None:
    allocations = (
        allocation_of("wall", 100, 20, 0, rect=rect(0, 0, 20, 100)),
        allocation_of("step", 50, 20, 0, rect=rect(20, 0, 20, 50)),
    )
    # Releasing "step" leaves one maximal rectangle and the kept one: 2 > 1 * 1 + 0.
    strict = fleet_of(gpu("g", allocations=allocations), rebuild_factor=1, rebuild_slack=0)
    strict.release("step")
    assert strict.rebuilds == 1
    assert strict.free_rects("g") == (rect(20, 0, 80, 100),)
    # The default threshold (4 x 1 + 8) keeps the freed rectangle.
    loose = fleet_of(gpu("g", allocations=allocations))
    loose.release("step")
    assert loose.rebuilds == 0
    assert loose.free_rects("g") == (rect(20, 0, 80, 100), rect(20, 0, 20, 50))
    for fleet in (strict, loose):
        fleet.verify()


def test_kept_rectangles_never_grow_the_list_without_bound() -> None:
    fleet = fleet_of(gpu("g"))
    mra = get_policy("mra")
    for i in range(200):
        placed(fleet.place(job(f"j{i}", 10 + (i * 7) % 40, 5 + (i * 3) % 30), mra))
        if i >= 3:
            fleet.release(f"j{i - 3}")
        slot = fleet.slot("g")
        assert len(slot.free) <= 4 * len(slot.allocations) + 8 or not slot.free.kept
    fleet.verify()
