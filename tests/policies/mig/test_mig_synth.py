import numpy as np
import pytest

from gpuloom.domain.mig_geometry import A30, A100, MigGeometry
from gpuloom.policies.mig import synth
from gpuloom.policies.mig.lower_bound import min_work


def test_counts_floor_then_top_up_the_size_furthest_below_its_share() -> None:
    poor = {1: 0.5, 2: 0.5, 3: 0, 4: 0, 7: 0}
    assert list(synth.task_counts(10, poor).values()) == [5, 5, 0, 0, 0]
    # 7 x 20% = 1.4 each: floor gives 5 tasks; the two missing go to the first sizes.
    mixed = dict.fromkeys((1, 2, 3, 4, 7), 0.2)
    assert list(synth.task_counts(7, mixed).values()) == [2, 2, 1, 1, 1]
    assert synth.task_counts(3, {1: 0.1, 2: 0.9}) == {1: 0, 2: 3}


@pytest.mark.parametrize("gpu", [A30, A100])
@pytest.mark.parametrize("name", synth.WORKLOADS)
@pytest.mark.parametrize("memory_bound", [0.0, 0.5, 1.0])
def test_times_never_grow_with_more_slices(gpu: MigGeometry, name: str, memory_bound: float):
    spec = synth.workload(gpu, name, "wide", memory_bound_share=memory_bound)
    tasks = synth.generate(40, gpu, spec, np.random.default_rng(1))
    assert len(tasks) == 40
    assert len({t.name for t in tasks}) == 40
    for t in tasks:
        times = [t.time(s) for s in gpu.sizes]
        assert times == sorted(times, reverse=True)
        assert 1.0 <= times[0] <= 100.0


def test_without_memory_bound_tasks_least_work_is_one_slice() -> None:
    # Near-linear and sub-linear steps never lower the work (slices x time).
    spec = synth.workload(A100, "good", "narrow")
    for t in synth.generate(60, A100, spec, np.random.default_rng(2)):
        assert min_work(t, A100) == pytest.approx(t.time(1))
        assert 90.0 <= t.time(1) <= 100.0


def test_memory_bound_tasks_scale_super_linearly_from_one_to_two_slices() -> None:
    spec = synth.workload(A100, "good", memory_bound_share=1.0)
    for t in synth.generate(30, A100, spec, np.random.default_rng(3)):
        assert t.time(2) <= t.time(1) / 2 + 1e-12


def test_poor_scaling_gains_little_beyond_two_slices() -> None:
    # Every step past a task's size is sub-linear: r >= 0.5, so t(s+1) >= (s+0.5)/(s+1) t(s).
    spec = synth.workload(A100, "poor")
    for t in synth.generate(30, A100, spec, np.random.default_rng(4)):
        assert t.time(7) >= t.time(2) * (2.5 / 3) * (3.5 / 4) * (4.5 / 5) * (5.5 / 6) * (6.5 / 7)


def test_same_seed_same_tasks() -> None:
    spec = synth.workload(A100, "mixed")
    first = synth.generate(15, A100, spec, np.random.default_rng(9))
    again = synth.generate(15, A100, spec, np.random.default_rng(9))
    assert first == again


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scaling": {1: 0.5}}, "add up to 1"),
        ({"scaling": {1: 1.5, 2: -0.5}}, ">= 0"),
        ({"scaling": {1: 1.0}, "memory_bound_share": 2}, r"\[0, 1\]"),
        ({"scaling": {1: 1.0}, "t_min": 5, "t_max": 1}, "t_min <= t_max"),
    ],
)
def test_bad_specs_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        synth.SynthSpec(**kwargs)


def test_unknown_workload_or_range() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        synth.workload(A100, "great")
    with pytest.raises(ValueError, match="unknown time range"):
        synth.workload(A100, "good", "short")
