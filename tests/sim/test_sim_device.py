"""The simulator's GPU model (gpuloom.sim.device): co-running kernels under MPS and time
slices without it, and the scenario keys that configure it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.cli.sim import sim
from gpuloom.sim.device import Completion, Device, GpuConfig, Interference
from gpuloom.sim.scenario import ScenarioError, load_scenario

CLASSES = ("compute", "memory", "unknown")


def run_all(device: Device, submits: list[tuple[int, int, int, int, str]]) -> list[Completion]:
    """Submit (time, ctx, duration, demand, class) in time order and run to the end."""
    done: list[Completion] = []
    for tag, (at, ctx, duration, demand, cls) in enumerate(sorted(submits)):
        done.extend(device.advance(at))
        device.submit(at, ctx, tag, duration, demand, cls)
    while (t := device.next_time()) is not None:
        done.extend(device.advance(t))
    return done


kernels = st.lists(
    st.tuples(
        st.integers(0, 200_000),  # submitted at, ns
        st.integers(0, 2),  # context
        st.integers(1, 300_000),  # duration alone, ns
        st.integers(1, 80),  # SMs asked
        st.sampled_from(CLASSES),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(kernels, st.booleans())
def test_no_kernel_runs_faster_than_alone_and_all_work_is_done(submits, concurrent) -> None:
    config = GpuConfig(timeslice_ns=50_000, switch_ns=5_000)
    device = Device(config, 3, concurrent)
    done = run_all(device, submits)
    ordered = sorted(submits)
    assert sorted(c.tag for c in done) == list(range(len(submits)))  # each once
    for c in done:
        at, ctx, duration, _, _ = ordered[c.tag]
        assert c.ctx == ctx
        assert c.start >= at
        assert c.end - c.start >= duration  # never faster co-running than alone
        # What it is charged: its own time on the GPU, the whole span under MPS.
        assert c.ran == (c.end - c.start if concurrent else duration)
    # One stream runs its kernels in order, one at a time.
    for ctx in range(3):
        mine = sorted((c.tag, c.start, c.end) for c in done if c.ctx == ctx)
        for (_, _, end), (_, start, _) in itertools.pairwise(mine):
            assert start >= end
    if concurrent:
        # Work conserved: the SMs delivered cannot exceed the GPU's over the busy time.
        first = min(c.start for c in done)
        last = max(c.end for c in done)
        asked = sum(ordered[c.tag][2] * ordered[c.tag][3] for c in done)
        assert asked <= config.sms * (last - first) * (1 + 1e-9)
    else:
        # Time slices: one context at a time, and each kernel ran exactly its duration.
        segments = sorted(device.segments)
        for (_, end, _), (start, _, _) in itertools.pairwise(segments):
            assert start >= end
        assert sum(e - s for s, e, _ in segments) == sum(d for _, _, d, _, _ in submits)


def test_a_kernel_alone_runs_its_duration() -> None:
    for concurrent in (True, False):
        device = Device(GpuConfig(), 2, concurrent)
        done = run_all(device, [(100, 1, 7_000, 80, "compute")])
        assert done == [Completion(1, 0, 100, 7_100, 7_000)]


def test_interference_follows_the_profile_classes_and_the_sms() -> None:
    factors = Interference(same_profile=1.6, other_profile=1.1, unknown_profile=1.3)

    def pair(a: str, b: str, demand_a: int = 80, demand_b: int = 80) -> int:
        device = Device(GpuConfig(interference=factors), 2, True)
        done = run_all(device, [(0, 0, 100_000, demand_a, a), (0, 1, 100_000, demand_b, b)])
        return next(c.end for c in done if c.ctx == 0)

    same, other = pair("compute", "compute"), pair("compute", "memory")
    unknown = pair("compute", "unknown")
    assert same > 200_000  # both want every SM and the same pipe: slower than in turns
    # Both ask every SM: they share them, and other classes interfere less (no gain over
    # running in turns: the model does not credit overlap of whole-GPU kernels).
    assert 200_000 < other <= round(200_000 * (1 + 0.1 * 0.5))
    assert other < unknown < same
    # Room for both: only the profile interference slows them.
    small = pair("compute", "memory", 40, 40)
    assert 100_000 < small <= 100_000 * (1 + 0.1 * 0.5) + 1
    # A co-runner on few SMs barely touches a kernel.
    assert pair("compute", "compute", 70, 4) <= 100_000 * (1 + 0.6 * 4 / 80) + 1


def test_time_slices_bound_the_wait_and_cost_a_switch() -> None:
    config = GpuConfig(timeslice_ns=1_000_000, switch_ns=25_000)
    device = Device(config, 2, False)
    # Context 0 has 5 ms of work; context 1 asks for 10 us at 0.1 ms.
    done = run_all(device, [(0, 0, 5_000_000, 80, "compute"), (100_000, 1, 10_000, 80, "memory")])
    small = next(c for c in done if c.ctx == 1)
    assert small.start == 1_000_000 + 25_000  # after the holder's slice and one switch
    big = next(c for c in done if c.ctx == 0)
    assert big.end == 5_000_000 + 10_000 + 2 * 25_000  # preempted once, switched back
    assert device.preemptions == 1 and device.switches == 2


BASE = {
    "seed": 1,
    "duration_s": 0.05,
    "tasks": [
        {
            "name": "a",
            "priority": 0,
            "arrival": {"rate_per_s": 100},
            "kernels": [{"name": "k", "duration_us": 50, "sm_usage": 20, "profile": "memory"}],
        }
    ],
}


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"gpu": {"sms": 0}}, "$.gpu.sms"),
        ({"gpu": {"interference": {"same_profile": 0.9}}}, "$.gpu.interference.same_profile"),
        ({"gpu": {"interference": {"bogus": 2}}}, "$.gpu.interference.bogus"),
        ({"gpu": {"mps": "yes"}}, "$.gpu.mps"),
        ({"gpu": {"timeslice_us": 0}}, "$.gpu.timeslice_us"),
        ({"gpu": {"sms": 10}}, "$.tasks[0].kernels[0].sm_usage"),
        ({"kernel": {"profile": "io"}}, "$.tasks[0].kernels[0].profile"),
        ({"kernel": {"sm_usage": 81}}, "$.tasks[0].kernels[0].sm_usage"),
        ({"task": {"sm_percent": 101}}, "$.tasks[0].sm_percent"),
    ],
)
def test_bad_device_keys_exit_2_naming_the_key(tmp_path: Path, patch: dict, key: str) -> None:
    data = json.loads(json.dumps(BASE))
    if "gpu" in patch:
        data["gpu"] = patch["gpu"]
    data["tasks"][0]["kernels"][0].update(patch.get("kernel", {}))
    data["tasks"][0].update(patch.get("task", {}))
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScenarioError) as error:
        load_scenario(path)
    assert key in str(error.value) and "\n" not in str(error.value)
    result = CliRunner().invoke(sim, ["kernels", str(path)])
    assert result.exit_code == 2
    assert key in result.output and result.output.strip().count("\n") == 0
    assert "Traceback" not in result.output


def test_an_orion_list_with_an_unknown_profile_class_is_refused(tmp_path: Path) -> None:
    (tmp_path / "k.csv").write_text(
        "Name,Profile,Memory_footprint,SM_usage,Duration\nk,2,0,4,100\n"
    )
    data = json.loads(json.dumps(BASE))
    del data["tasks"][0]["kernels"]
    data["tasks"][0]["kernels_csv"] = "k.csv"
    (tmp_path / "s.json").write_text(json.dumps(data))
    with pytest.raises(ScenarioError, match=r"k\.csv: line 2, column 2: unknown profile class"):
        load_scenario(tmp_path / "s.json")


def test_the_orion_columns_reach_the_kernels(tmp_path: Path) -> None:
    data = json.loads(json.dumps(BASE))
    data["tasks"][0]["kernels"][0]["sm_usage"] = 12
    (tmp_path / "s.json").write_text(json.dumps(data))
    kernel = load_scenario(tmp_path / "s.json").tasks[0].kernels[0]
    assert (kernel.sm_usage, kernel.profile) == (12, "memory")
    assert load_scenario(tmp_path / "s.json").gpu == GpuConfig()


def test_a_kernel_held_to_a_partition_smaller_than_its_launch_shape_runs_slower_alone() -> None:
    device = Device(GpuConfig(sms=80), 2, concurrent=True)
    # Its blocks would fill every SM; its partition (20 SMs) gives it a quarter of them.
    device.submit(0, 0, "confined", 100_000, 20, "compute", want=80)
    # Its blocks fill 10 SMs, inside its partition: the partition costs it nothing.
    device.submit(0, 1, "fits", 100_000, 10, "memory", want=10)
    done = {c.tag: c for c in run_all(device, [])}
    # Beside each other (20 + 10 SMs fit): each slowed by the other's class factor on its SMs.
    assert done["fits"].end == pytest.approx(100_000 * (1 + 0.5 * 20 / 80), rel=1e-3)
    alone = Device(GpuConfig(sms=80), 1, concurrent=True)
    alone.submit(0, 0, "confined", 100_000, 20, "compute", want=80)
    assert run_all(alone, [])[0].end == pytest.approx(400_000, rel=1e-3)
    with pytest.raises(ValueError, match=r"want 10 outside 20\.\.80"):
        alone.submit(500_000, 0, "bad", 1, 20, "compute", want=10)
