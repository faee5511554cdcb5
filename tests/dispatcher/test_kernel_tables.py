"""The arbiter's kernel table from a kernel profile: which gap each kernel ID gets."""

import json

from gpuloom.policies.profiling import Runs, fit_predictor
from gpuloom.services.dispatcher.admission_engine import KernelTiming
from gpuloom.services.dispatcher.kernel_tables import table_from_profile
from gpuloom.v1 import profile_store_pb2

US = 1000


def profile(model_json: str) -> profile_store_pb2.KernelProfile:
    # Kernel 1 is followed by 10 us before kernel 2 and by 5 ms before kernel 3 (once per
    # request: the host's think time); kernel 2 by 20 us; kernel 3 ends the run.
    found = profile_store_pb2.KernelProfile(measured_runs=3)
    found.meta.key = "task"
    for kernel, duration, gap, samples in (
        (1, 50, 2505, 6),
        (2, 30, 20, 3),
        (3, 40, float("nan"), 3),
    ):
        found.kernels.add(
            kernel_id=kernel,
            mean_duration_ns=duration * US,
            mean_gap_after_ns=gap * US,
            sample_count=samples,
        )
    found.gap_predictor.kind = "position"
    found.gap_predictor.model_json = model_json
    return found


def position_model() -> str:
    runs = Runs.from_sequences([[1, 2, 1, 3]] * 3, [[10 * US, 20 * US, 5000 * US]] * 3)
    return json.dumps(fit_predictor("position", runs).to_dict())


def test_each_kernel_gets_its_mean_duration_and_mean_gap_whatever_the_gap_model() -> None:
    mean = {t.kernel_id: t for t in table_from_profile(profile(position_model()))}
    # Kernel 1's mean gap (2.5 ms) is what the arbiter counts on after it, though the
    # position model knows it is 10 us in one place and 5 ms in the other.
    assert mean == {
        1: KernelTiming(1, 50 * US, 2505 * US, samples=6),
        2: KernelTiming(2, 30 * US, 20 * US, samples=3),
        3: KernelTiming(3, 40 * US, None, samples=3),
    }
    for garbage in ("", "{", '{"format": 1, "predictor": "nope"}', "[1, 2]"):
        table = {t.kernel_id: t for t in table_from_profile(profile(garbage))}
        assert table == mean, garbage


def test_each_kernel_carries_its_sm_usage_and_bound_class_for_the_spatial_rule() -> None:
    found = profile(position_model())
    found.kernels[0].sm_usage = 40
    found.kernels[0].bound = profile_store_pb2.KERNEL_BOUND_COMPUTE
    found.kernels[1].sm_usage = 132
    found.kernels[1].bound = profile_store_pb2.KERNEL_BOUND_MEMORY
    found.kernels[2].bound = 7  # a class this dispatcher does not know: unknown
    table = {t.kernel_id: t for t in table_from_profile(found)}
    assert (table[1].sm_usage, table[1].bound) == (40, "compute")
    assert (table[2].sm_usage, table[2].bound) == (132, "memory")
    assert (table[3].sm_usage, table[3].bound) == (0, "unknown")
