"""The dispatcher's harvest gauge (services/dispatcher/harvest_gauge.py): launch counts per
job from the shims' sequence words, windows, and the Prometheus samples it exports or takes
back."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from gpuloom.policies.fikit.harvest_gauge import LaunchProfile
from gpuloom.services.dispatcher.admission_engine import KernelTiming
from gpuloom.services.dispatcher.harvest_gauge import HarvestGauge, launch_profile_of
from gpuloom.services.dispatcher.settings import DispatcherSettings

S = 10**9
US = 1000
INFER = LaunchProfile(200 * US, 1000 * US)  # busy 0.2 alone
TRAIN = LaunchProfile(100 * US, 125 * US)  # busy 0.8 alone


def _sample(name: str, gpu: str, job: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"gpu": gpu, "job": job})


def test_a_table_gives_its_launch_profile() -> None:
    table = [KernelTiming(1, 100 * US, 20 * US, samples=3), KernelTiming(2, 300 * US, 0, samples=1)]
    assert launch_profile_of(table) == LaunchProfile(150 * US, 165 * US)
    assert launch_profile_of([KernelTiming(1, 100 * US, None)]) is None


def test_windows_count_each_jobs_launches_and_export_only_what_is_known() -> None:
    gauge = HarvestGauge("g-test", window_s=1.0)
    gauge.add("i1", "infer", 1, 0, 0)
    gauge.add("t1", "train", 8, 100, 0)
    gauge.add("t2", "train", 8, 0, 0)  # a second process of the same job
    gauge.add("u1", "unprofiled", 8, 0, 0)
    gauge.set_profile("infer", INFER)
    gauge.set_profile("train", TRAIN)
    gauge.observe("i1", 1000, S // 2)  # 1,000 launches of 200 us: busy 0.2 over the window
    gauge.observe("t1", 100 + 2000, S // 2)
    gauge.observe("u1", 50, S // 2)
    assert gauge.roll(S // 2) is None  # not a whole window yet
    gauge.observe("t2", 2000, S)
    gauge.remove("t1", 100 + 2000 + 400, S)  # its last launches read as it leaves
    estimates = gauge.roll(S)
    assert estimates is not None and set(estimates) == {"train"}
    # 4,400 launches of 125 us alone: kept 0.55; limit (1 - 0.2) / 0.8 = 1.
    assert estimates["train"].kept == pytest.approx(0.55)
    assert estimates["train"].harvest == pytest.approx(0.55)
    assert _sample("gpuloom_dispatcher_harvest_ratio", "g-test", "train") == pytest.approx(0.55)
    assert _sample("gpuloom_dispatcher_harvest_kept_ratio", "g-test", "train") == pytest.approx(
        0.55
    )
    assert _sample("gpuloom_dispatcher_harvest_ratio", "g-test", "unprofiled") is None
    assert _sample("gpuloom_dispatcher_harvest_ratio", "g-test", "infer") is None
    # The holder leaves: the window it left in still has it (idle since), the next one has
    # nobody above the training, so nothing is estimated and the sample is taken back, not
    # left at its last value nor set to 0.
    gauge.remove("i1", None, S + S // 4)
    gauge.observe("t2", 3000, 2 * S)
    assert set(gauge.roll(2 * S) or {}) == {"train"}
    gauge.observe("t2", 4000, 3 * S)
    assert gauge.roll(3 * S) == {}
    assert _sample("gpuloom_dispatcher_harvest_ratio", "g-test", "train") is None
    assert _sample("gpuloom_dispatcher_harvest_kept_ratio", "g-test", "train") is None
    assert [w.end_ns for w in gauge.recent] == [S, 2 * S, 3 * S]


def test_an_implausible_count_is_dropped() -> None:
    gauge = HarvestGauge("g-test2", window_s=1.0, export=lambda estimates: None)
    gauge.add("i1", "infer", 1, 0, 0)
    gauge.add("t1", "train", 8, 0, 0)
    gauge.set_profile("infer", INFER)
    gauge.set_profile("train", TRAIN)
    gauge.observe("t1", 2**32 - 1, S // 2)  # the word written backwards
    gauge.observe("t1", 2**32 - 1 + 0, S)  # (unchanged since)
    estimates = gauge.roll(S)
    assert gauge.rejected == 1
    assert estimates is not None and estimates["train"].kept == 0.0


def test_the_window_setting_is_validated() -> None:
    assert DispatcherSettings().harvest_window_s == 10.0
    assert DispatcherSettings(harvest_window_s=1).harvest_window_s == 1.0
    for bad in (0.5, 0, -1, 3601):
        with pytest.raises(ValidationError, match="harvest_window_s"):
            DispatcherSettings(harvest_window_s=bad)
    with pytest.raises(ValueError):
        HarvestGauge("g", window_s=0)
