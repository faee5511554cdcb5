"""The fake pynvml must keep to the real module's interface, or the NVML tests prove nothing."""

from __future__ import annotations

import inspect

import pynvml
import pytest

from .fake_pynvml import CONSTANTS, FakeNvml

FAKE_NAMES = sorted(name for name in vars(FakeNvml) if name.startswith(("nvml", "NVML", "c_nvml")))


def test_the_fake_covers_what_the_backend_needs() -> None:
    assert "nvmlDeviceCreateGpuInstanceWithPlacement" in FAKE_NAMES
    assert "NVMLError" in FAKE_NAMES
    assert len(CONSTANTS) > 20


@pytest.mark.parametrize("name", FAKE_NAMES)
def test_every_fake_name_exists_in_pynvml(name: str) -> None:
    assert hasattr(pynvml, name), f"pynvml has no {name}"


@pytest.mark.parametrize("name", [n for n in FAKE_NAMES if n.startswith("nvml")])
def test_functions_take_the_same_required_arguments(name: str) -> None:
    def required(function: object, skip: int) -> int:
        parameters = list(inspect.signature(function).parameters.values())[skip:]  # type: ignore[arg-type]
        return sum(p.default is inspect.Parameter.empty for p in parameters)

    assert required(getattr(FakeNvml, name), skip=1) == required(getattr(pynvml, name), skip=0)


@pytest.mark.parametrize(("name", "value"), sorted(CONSTANTS.items()))
def test_constants_have_pynvml_values(name: str, value: int) -> None:
    assert getattr(pynvml, name) == value


def test_placement_struct_has_the_fields_the_backend_sets() -> None:
    real = pynvml.c_nvmlGpuInstancePlacement_t()
    real.start, real.size = 4, 4
    assert {f[0] for f in pynvml.c_nvmlGpuInstancePlacement_t._fields_} == {"start", "size"}
    assert vars(FakeNvml.c_nvmlGpuInstancePlacement_t()) == {"start": 0, "size": 0}
