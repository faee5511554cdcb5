"""The arbiter's kernel table from a kernel profile: which gap each kernel ID gets."""

import json

from gpuloom.policies.profiling import Runs, fit_predictor
from gpuloom.services.dispatcher.arbiter import KernelTiming
from gpuloom.services.dispatcher.kernel_tables import table_from_profile
from gpuloom.v1 import profile_store_pb2

US = 1000


def profile(model_json: str) -> profile_store_pb2.KernelProfile:
    # Kernel 1 is followed by 10 us before kernel 2 and by 5 ms before kernel 3 (once per
    # request: the host's think time); kernel 2 by 20 us; kernel 3 ends the run.
    found = profile_store_pb2.KernelProfile(measured_runs=3)
    found.meta.key = "task"
    for kernel, duration, gap in ((1, 50, 2505), (2, 30, 20), (3, 40, float("nan"))):
        found.kernels.add(
            kernel_id=kernel, mean_duration_ns=duration * US, mean_gap_after_ns=gap * US
        )
    found.gap_predictor.kind = "position"
    found.gap_predictor.model_json = model_json
    return found


def position_model() -> str:
    runs = Runs.from_sequences([[1, 2, 1, 3]] * 3, [[10 * US, 20 * US, 5000 * US]] * 3)
    return json.dumps(fit_predictor("position", runs).to_dict())


def test_with_least_a_kernel_gets_the_least_gap_its_profile_predicts_after_it() -> None:
    table = {t.kernel_id: t for t in table_from_profile(profile(position_model()), "least")}
    # Kernel 1's mean gap (2.5 ms) would open a window after every launch of it; the arbiter,
    # which sees IDs and not positions, counts on 10 us only: no window.
    assert table[1] == KernelTiming(1, 50 * US, 10 * US)
    assert table[2] == KernelTiming(2, 30 * US, 20 * US)
    assert table[3].gap_after_ns is None


def test_mean_gaps_by_default_and_when_the_model_is_unusable() -> None:
    mean = {t.kernel_id: t.gap_after_ns for t in table_from_profile(profile(position_model()))}
    assert mean == {1: 2505 * US, 2: 20 * US, 3: None}
    for garbage in ("", "{", '{"format": 1, "predictor": "nope"}', "[1, 2]"):
        table = {t.kernel_id: t.gap_after_ns for t in table_from_profile(profile(garbage), "least")}
        assert table == mean, garbage
