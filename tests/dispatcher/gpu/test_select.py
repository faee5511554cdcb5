"""open_backend: the configured backend, and "auto" falling back to the simulation."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from gpuloom.domain.errors import Unavailable
from gpuloom.services.dispatcher.gpu import NvmlBackend, SimulatedBackend, open_backend

from . import fake_pynvml as fake
from .fake_pynvml import FakeNvml
from .helpers import SleepRecorder


def chosen(logs: list[dict[str, object]]) -> dict[str, object]:
    [event] = [e for e in logs if e["event"] == "gpu_backend_chosen"]
    return event


def test_auto_picks_nvml_when_it_reports_gpus() -> None:
    nvml = FakeNvml([fake.a100_80gb(), fake.t4(1)])
    with capture_logs() as logs:
        backend = open_backend("auto", "4xL4-24GB", nvml=nvml)
    assert isinstance(backend, NvmlBackend)
    assert [g.model for g in backend.gpus()] == ["A100-80GB", "T4-16GB"]
    assert chosen(logs)["backend"] == "nvml"
    assert "reports 2 GPU(s)" in str(chosen(logs)["reason"])


@pytest.mark.parametrize(
    ("failing", "code", "reason"),
    [
        ("nvmlInit", fake.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML not available: nvmlInit"),
        ("nvmlInit", fake.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
        ("nvmlDeviceGetCount", fake.NVML_ERROR_UNKNOWN, "cannot list its GPUs"),
        ("nvmlDeviceGetName", fake.NVML_ERROR_GPU_IS_LOST, "GPU is lost"),
    ],
)
def test_auto_falls_back_when_nvml_fails(failing: str, code: int, reason: str) -> None:
    nvml = FakeNvml([fake.a100_80gb()])
    nvml.failures[failing] = code
    with capture_logs() as logs:
        backend = open_backend("auto", "2xA30-24GB", nvml=nvml)
    assert isinstance(backend, SimulatedBackend)
    assert [g.gpu_uuid for g in backend.gpus()] == ["SIM-A30-24GB-0", "SIM-A30-24GB-1"]
    assert chosen(logs)["backend"] == "simulated"
    assert reason in str(chosen(logs)["reason"])


def test_auto_falls_back_without_gpus_and_shuts_nvml_down() -> None:
    nvml = FakeNvml([])
    with capture_logs() as logs:
        backend = open_backend("auto", "T4-16GB", nvml=nvml)
    assert isinstance(backend, SimulatedBackend)
    assert "reports no GPUs" in str(chosen(logs)["reason"])
    assert nvml.calls[-1] == "nvmlShutdown" and not nvml.initialized


def test_nvml_when_asked_for() -> None:
    backend = open_backend("NVML", "", nvml=FakeNvml([fake.t4()]))  # no fleet spec needed
    assert isinstance(backend, NvmlBackend)


@pytest.mark.parametrize(
    ("nvml", "message"),
    [
        (FakeNvml([]), "reports no GPUs"),
        (FakeNvml([fake.t4()]), "NVML not available: nvmlInit"),
    ],
)
def test_nvml_when_asked_for_but_unusable(nvml: FakeNvml, message: str) -> None:
    if nvml.gpus:
        nvml.failures["nvmlInit"] = fake.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(Unavailable, match=message):
        open_backend("nvml", "T4-16GB", nvml=nvml)


def test_simulated_when_asked_for_never_touches_nvml(sleeps: SleepRecorder) -> None:
    nvml = FakeNvml([fake.a100_80gb()])
    with capture_logs() as logs:
        backend = open_backend(
            " Simulated ", "H100-80GB", mig_enabled=True, time_scale=2, sleep=sleeps, nvml=nvml
        )
    assert isinstance(backend, SimulatedBackend)
    assert nvml.calls == []
    assert chosen(logs) | {"reason": "configured", "backend": "simulated"} == chosen(logs)
    backend.create_mig_instance(0, 7, 0)  # the MIG settings reached the backend
    assert sleeps.calls == [pytest.approx(0.84)]


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown GPU backend 'cuda'; expected one of auto, nvml"):
        open_backend("cuda", "T4-16GB")


def test_auto_checks_the_fleet_spec_even_when_nvml_works() -> None:
    nvml = FakeNvml([fake.t4()])
    with pytest.raises(ValueError, match="unknown GPU model 'T5'"):
        open_backend("auto", "T5", nvml=nvml)
    assert nvml.calls == []
