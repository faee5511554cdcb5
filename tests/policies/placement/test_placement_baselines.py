"""The choices of the bin-packing, spreading and time-sharing baselines."""

from gpuloom.policies.placement import get_policy

from .helpers import allocation_of, fleet_of, gpu, job, placed, rect


def fleet_with_three_fill_levels():
    # a: 70 % of the area used, b: 30 %, c: 0 %; a's 30 % quota x 100 % SM is free.
    return fleet_of(
        gpu("a", allocations=(allocation_of("x", 100, 70, 0, rect=rect(0, 0, 70, 100)),)),
        gpu("b", allocations=(allocation_of("y", 100, 30, 0, rect=rect(0, 0, 30, 100)),)),
        gpu("c"),
    )


def test_binpack_takes_the_fullest_gpu_that_fits() -> None:
    fleet = fleet_with_three_fill_levels()
    p = placed(fleet.place(job("j", 50, 20), get_policy("binpack")))
    assert (p.gpu_id, p.rect) == ("a", rect(70, 0, 20, 50))  # bottom-left of the free space
    # 40 % quota does not fit a's 30 %; b is the next fullest.
    assert placed(fleet.place(job("k", 10, 40), get_policy("binpack"))).gpu_id == "b"


def test_spread_takes_the_emptiest_gpu_then_the_lowest_id() -> None:
    fleet = fleet_with_three_fill_levels()
    spread = get_policy("spread")
    assert placed(fleet.place(job("j", 100, 20), spread)).gpu_id == "c"  # c: 80 % free
    assert placed(fleet.place(job("k", 100, 10), spread)).gpu_id == "c"  # c: 70 % free
    assert placed(fleet.place(job("m", 100, 10), spread)).gpu_id == "b"  # a tie: lowest id
    assert placed(fleet.place(job("n", 100, 10), spread)).gpu_id == "c"


def test_time_share_takes_all_sms_first_fit_by_gpu_id() -> None:
    fleet = fleet_of(gpu("a"), gpu("b"))
    ts = get_policy("time-share")
    first = placed(fleet.place(job("j", 12, 40), ts))
    assert (first.gpu_id, first.rect) == ("a", rect(0, 0, 40, 100))
    assert fleet.allocation("j").sm_percent == 12  # the job still runs with its 12 %
    assert placed(fleet.place(job("k", 12, 40), ts)).rect == rect(40, 0, 40, 100)
    assert placed(fleet.place(job("m", 12, 40), ts)).gpu_id == "b"  # a has 20 % quota left
    assert placed(fleet.place(job("n", 12, 20), ts)).gpu_id == "a"  # first fit
