"""scripts/lib/composed_pair.py's figures (the live pair of scripts/bench_fikit): busy shares
from the fake GPU's log and the harvest."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "lib"))
from composed_pair import busy_share, harvest


def test_busy_share_counts_overlapping_kernels_once_over_the_span() -> None:
    # 0-10 and 5-15 overlap (15 covered), 20-30 after a gap of 5; span 0-40 with 30-40 idle.
    assert busy_share([(20, 30), (0, 10), (5, 15), (39, 40)]) == pytest.approx(26 / 40)
    assert busy_share([(0, 10), (2, 4)]) == 1.0  # one inside another
    with pytest.raises(ValueError, match="no kernel"):
        busy_share([])


def test_harvest_is_the_kept_share_over_what_time_sharing_could_give() -> None:
    # The holder busy 20% of the time leaves 80%; a filler busy 90% alone could keep 0.8/0.9.
    assert harvest(0.4, 0.2, 0.9) == pytest.approx(0.4 / (0.8 / 0.9))
    # A light filler fits in the idle time: the limit is 1, the harvest its kept share.
    assert harvest(0.7, 0.2, 0.5) == pytest.approx(0.7)
    for high, low in ((1.0, 0.5), (0.2, 0.0), (0.2, 1.5), (-0.1, 0.5)):
        with pytest.raises(ValueError, match="busy shares"):
            harvest(0.5, high, low)
