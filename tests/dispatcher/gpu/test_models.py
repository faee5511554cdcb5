"""The model table: MIG profile names and recognising what the driver reports."""

from __future__ import annotations

import pytest

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.gpus import (
    GIB,
    MODELS,
    find_model,
    match_driver_name,
    mig_profile,
)

MIB = 1 << 20


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("A100-40GB", ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]),
        ("A100-80GB", ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
        ("H100-80GB", ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
        ("H200-141GB", ["1g.18gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]),
        ("A30-24GB", ["1g.6gb", "2g.12gb", "4g.24gb"]),
    ],
)
def test_profile_names_are_nvidias(model: str, expected: list[str]) -> None:
    gpu = MODELS[model]
    assert [mig_profile(gpu, size).name for size in gpu.geometry().sizes] == expected


def test_profile_memory_and_nvml_placement_size() -> None:
    a100 = MODELS["A100-80GB"]
    three = mig_profile(a100, 3)
    # A 3-slice instance gets half the memory and is a 4-wide placement to NVML.
    assert (three.memory_bytes, three.nvml_placement_size) == (40 * GIB, 4)
    assert mig_profile(a100, 7).nvml_placement_size == 8
    assert mig_profile(MODELS["A30-24GB"], 1).memory_bytes == 6 * GIB


def test_sizes_a_model_lacks() -> None:
    with pytest.raises(
        InvalidArgument, match="A30-24GB has no 3-slice MIG instance; sizes: 1, 2, 4"
    ):
        mig_profile(MODELS["A30-24GB"], 3)
    with pytest.raises(FailedPrecondition, match="T4-16GB is not MIG-capable"):
        mig_profile(MODELS["T4-16GB"], 1)


def test_find_model_ignores_case() -> None:
    assert find_model(" h100-80gb ") is MODELS["H100-80GB"]
    assert find_model("H100") is None


@pytest.mark.parametrize(
    ("driver_name", "memory_mib", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", 40960, "A100-40GB"),
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA A30", 24576, "A30-24GB"),
        ("Tesla V100-SXM2-32GB", 32768, "V100-32GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("NVIDIA L4", 23034, "L4-24GB"),
        ("NVIDIA H100 NVL", 95830, None),  # another memory size: another product
        ("NVIDIA L40S", 46068, None),  # not an L4
        ("NVIDIA GH200 480GB", 97871, None),  # not an H200
        ("NVIDIA B300", 294912, None),
    ],
)
def test_driver_names(driver_name: str, memory_mib: int, expected: str | None) -> None:
    model = match_driver_name(driver_name, memory_mib * MIB)
    assert (model.name if model else None) == expected
