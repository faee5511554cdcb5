"""The NVML backend against the fake pynvml: info, usage, processes, MIG, errors."""

from __future__ import annotations

import math
import sys

import pytest

from gpuloom.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from gpuloom.domain.gpus import GpuInfo, MigInstance
from gpuloom.services.dispatcher.gpu import GpuBackend, NvmlBackend
from gpuloom.services.dispatcher.gpu.backend import GpuProcess, GpuUsage
from gpuloom.services.dispatcher.gpu.nvml import import_pynvml

from . import fake_pynvml as fake
from .fake_pynvml import FakeGpu, FakeNvml, GiProfile

MIB = 1 << 20


def open_nvml(*gpus: FakeGpu, **kwargs: object) -> tuple[NvmlBackend, FakeNvml]:
    nvml = FakeNvml(list(gpus), **kwargs)  # type: ignore[arg-type]
    return NvmlBackend(nvml), nvml


def mig_a100(**kwargs: object) -> tuple[NvmlBackend, FakeNvml]:
    return open_nvml(fake.a100_80gb(mig_mode=fake.NVML_DEVICE_MIG_ENABLE, **kwargs))


# Info.


def test_info_falls_back_to_the_model_table_for_sm_count() -> None:
    backend, _ = open_nvml(fake.a100_80gb(sm_count=None), fake.t4(1, sm_count=40))
    assert isinstance(backend, GpuBackend)
    assert backend.name == "nvml"
    assert backend.gpus() == [
        GpuInfo("GPU-a100-0", "", "A100-80GB", 81920 * MIB, 108, True, False, index=0),
        GpuInfo("GPU-t4-1", "", "T4-16GB", 15360 * MIB, 40, False, False, index=1),
    ]


def test_reported_sm_count_wins_over_the_table() -> None:
    backend, _ = open_nvml(fake.a100_80gb(sm_count=98))
    assert backend.gpu(0).sm_count == 98


def test_unknown_model_keeps_the_drivers_name() -> None:
    gpu = fake.t4(name="NVIDIA B300", memory_total=294912 * MIB, sm_count=None)
    backend, _ = open_nvml(gpu)
    info = backend.gpu(0)
    assert (info.model, info.sm_count, info.mig_capable) == ("NVIDIA B300", 0, False)


def test_mig_mode_shows_in_info() -> None:
    backend, _ = mig_a100()
    assert backend.gpu(0).mig_enabled and backend.gpu(0).mig_capable


@pytest.mark.parametrize("index", [-1, 2])
def test_unknown_index_is_not_found(index: int) -> None:
    backend, nvml = open_nvml(fake.t4(), fake.t4(1))
    for call in (backend.gpu, backend.usage, backend.processes, backend.mig_instances):
        with pytest.raises(NotFound, match=f"no GPU with index {index}; NVML sees 2"):
            call(index)
    assert "nvmlDeviceGetHandleByIndex" not in nvml.calls


# Usage and processes.


def test_usage() -> None:
    backend, _ = open_nvml(fake.t4(utilization=37, memory_used=1234 * MIB))
    assert backend.usage(0) == GpuUsage(utilization_percent=37.0, memory_used_bytes=1234 * MIB)


def test_usage_with_mig_on_has_no_utilisation() -> None:
    backend, _ = mig_a100(memory_used=5 * MIB)
    usage = backend.usage(0)
    assert math.isnan(usage.utilization_percent)
    assert usage.memory_used_bytes == 5 * MIB


def test_processes_merged_per_pid_and_sorted() -> None:
    procs = [(300, 5 * MIB), (100, None), (300, MIB)]
    backend, _ = open_nvml(fake.t4(processes=procs))
    assert backend.processes(0) == [GpuProcess(100, 0), GpuProcess(300, 6 * MIB)]


# MIG.


def test_create_list_destroy() -> None:
    backend, nvml = mig_a100()
    made = backend.create_mig_instance(0, 3, 4)
    assert made == MigInstance(
        uuid=made.uuid,
        slices=3,
        first_slice=4,
        memory_bytes=40192 * MIB,
        profile_name="3g.40gb",
    )
    assert made.uuid.startswith("MIG-GPU-a100-0")
    # The fake accepts only the driver's placements: 3 slices at 4 is {start 4, size 4}.
    [gi] = nvml.instances[0].values()
    assert (gi.start, gi.size, gi.profile.profile_id) == (4, 4, 9)

    second = backend.create_mig_instance(0, 1, 0)
    seventh = backend.create_mig_instance(0, 1, 3)
    assert backend.mig_instances(0) == [second, seventh, made]
    assert second.profile_name == "1g.10gb"

    backend.destroy_mig_instance(0, made.uuid)
    assert backend.mig_instances(0) == [second, seventh]
    assert len(nvml.instances[0]) == 2  # the GPU instance went too


def test_whole_gpu_instance_is_8_wide_to_nvml() -> None:
    backend, nvml = mig_a100()
    made = backend.create_mig_instance(0, 7, 0)
    assert made.profile_name == "7g.80gb"
    [gi] = nvml.instances[0].values()
    assert (gi.start, gi.size) == (0, 8)


def test_a30() -> None:
    backend, _ = open_nvml(fake.a30(mig_mode=fake.NVML_DEVICE_MIG_ENABLE))
    assert backend.create_mig_instance(0, 2, 2).profile_name == "2g.12gb"
    with pytest.raises(InvalidArgument, match="A30-24GB has no 3-slice MIG instance"):
        backend.create_mig_instance(0, 3, 0)


def test_overlap_and_illegal_placements_are_refused_before_nvml() -> None:
    backend, nvml = mig_a100()
    backend.create_mig_instance(0, 3, 0)
    nvml.calls.clear()
    with pytest.raises(FailedPrecondition, match=r"overlap 3g\.40gb at slice 0"):
        backend.create_mig_instance(0, 1, 3)
    with pytest.raises(FailedPrecondition, match="legal first slices: 0, 2, 4"):
        backend.create_mig_instance(0, 2, 5)
    with pytest.raises(InvalidArgument):
        backend.create_mig_instance(0, 6, 0)
    assert "nvmlDeviceCreateGpuInstanceWithPlacement" not in nvml.calls
    assert len(nvml.instances[0]) == 1


def test_mig_mode_off_and_not_capable() -> None:
    backend, nvml = open_nvml(fake.a100_80gb(), fake.t4(1))
    with pytest.raises(FailedPrecondition, match="MIG mode is off on GPU 0"):
        backend.create_mig_instance(0, 1, 0)
    with pytest.raises(FailedPrecondition, match=r"GPU 1 \(T4-16GB\) is not MIG-capable"):
        backend.create_mig_instance(1, 1, 0)
    with pytest.raises(FailedPrecondition, match="is not MIG-capable"):
        backend.set_mig_mode(1, True)
    with pytest.raises(FailedPrecondition, match="MIG mode is off"):
        backend.destroy_mig_instance(0, "MIG-x")
    assert backend.mig_instances(0) == []
    assert backend.mig_instances(1) == []
    assert nvml.instances == [{}, {}]


def test_set_mig_mode() -> None:
    backend, nvml = open_nvml(fake.a100_80gb())
    backend.set_mig_mode(0, True)
    assert backend.gpu(0).mig_enabled
    nvml.calls.clear()
    backend.set_mig_mode(0, True)  # already on: nothing to do
    assert "nvmlDeviceSetMigMode" not in nvml.calls
    made = backend.create_mig_instance(0, 4, 0)
    with pytest.raises(FailedPrecondition, match="nvmlDeviceSetMigMode: In use"):
        backend.set_mig_mode(0, False)
    backend.destroy_mig_instance(0, made.uuid)
    backend.set_mig_mode(0, False)
    assert not backend.gpu(0).mig_enabled


def test_mig_mode_change_pending_a_reset() -> None:
    backend, _ = open_nvml(fake.a100_80gb(), activation_status=fake.NVML_ERROR_RESET_REQUIRED)
    with pytest.raises(FailedPrecondition, match="pending until the GPU is reset"):
        backend.set_mig_mode(0, True)
    assert not backend.gpu(0).mig_enabled


def test_destroy_unknown_instance() -> None:
    backend, nvml = mig_a100()
    backend.create_mig_instance(0, 1, 0)
    with pytest.raises(NotFound, match="GPU 0 has no MIG instance 'MIG-nope'"):
        backend.destroy_mig_instance(0, "MIG-nope")
    assert len(nvml.instances[0]) == 1


def test_shared_gpu_instance_outlives_one_of_its_compute_instances() -> None:
    backend, nvml = mig_a100()
    made = backend.create_mig_instance(0, 3, 4)
    [gi_id] = nvml.instances[0]
    other = nvml.add_compute_instance(0, gi_id)
    assert {i.uuid for i in backend.mig_instances(0)} == {made.uuid, other}
    backend.destroy_mig_instance(0, made.uuid)
    assert [i.uuid for i in backend.mig_instances(0)] == [other]
    assert gi_id in nvml.instances[0]
    backend.destroy_mig_instance(0, other)
    assert nvml.instances[0] == {}


def test_failed_compute_instance_leaves_no_gpu_instance_behind() -> None:
    backend, nvml = mig_a100()
    nvml.failures["nvmlGpuInstanceCreateComputeInstance"] = fake.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(FailedPrecondition, match="GPU 0: nvmlGpuInstanceCreateComputeInstance"):
        backend.create_mig_instance(0, 2, 0)
    assert nvml.instances[0] == {}
    assert "nvmlGpuInstanceDestroy" in nvml.calls


def test_driver_refusing_a_placement_is_a_failed_precondition() -> None:
    backend, nvml = mig_a100()
    nvml.failures["nvmlDeviceCreateGpuInstanceWithPlacement"] = (
        fake.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    with pytest.raises(FailedPrecondition, match="Insufficient resources"):
        backend.create_mig_instance(0, 1, 0)


def test_profile_name_falls_back_when_the_driver_gives_none() -> None:
    gpu = fake.a100_80gb(mig_mode=fake.NVML_DEVICE_MIG_ENABLE)
    gpu.profiles = tuple(
        GiProfile(p.slices, p.profile_id, "", p.memory_mib, p.placements) for p in gpu.profiles
    )
    backend, _ = open_nvml(gpu)
    assert backend.create_mig_instance(0, 2, 0).profile_name == "2g.20gb"


# Errors.


@pytest.mark.parametrize(
    ("code", "error", "text"),
    [
        (fake.NVML_ERROR_GPU_IS_LOST, Unavailable, "GPU 0: nvmlDeviceGetMemoryInfo: GPU is lost"),
        (fake.NVML_ERROR_DRIVER_NOT_LOADED, Unavailable, "NVML not available: GPU 0: "),
        (fake.NVML_ERROR_NO_PERMISSION, FailedPrecondition, "Insufficient Permissions"),
        (fake.NVML_ERROR_NOT_FOUND, NotFound, "GPU 0: nvmlDeviceGetMemoryInfo: Not Found"),
    ],
)
def test_nvml_errors_become_domain_errors(code: int, error: type[Exception], text: str) -> None:
    backend, nvml = open_nvml(fake.t4())
    nvml.failures["nvmlDeviceGetMemoryInfo"] = code
    with pytest.raises(error) as raised:
        backend.usage(0)
    assert text in str(raised.value)
    assert isinstance(raised.value.__cause__, fake.NVMLError)


def test_library_mismatch_is_unavailable() -> None:
    backend, nvml = open_nvml(fake.t4())

    def mismatched(handle: object) -> list[object]:
        raise fake.NVMLLibraryMismatchError("use a versioned function")

    nvml.nvmlDeviceGetComputeRunningProcesses = mismatched  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=r"NVML not available: .*use a versioned function"):
        backend.processes(0)


@pytest.mark.parametrize(
    "code", [fake.NVML_ERROR_LIBRARY_NOT_FOUND, fake.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_init_failure_is_unavailable(code: int) -> None:
    nvml = FakeNvml([fake.t4()])
    nvml.failures["nvmlInit"] = code
    with pytest.raises(Unavailable, match=r"^NVML not available: nvmlInit: "):
        NvmlBackend(nvml)


def test_missing_pynvml_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(Unavailable, match="NVML not available: cannot import pynvml"):
        import_pynvml()
    with pytest.raises(Unavailable, match="nvidia-ml-py"):
        NvmlBackend()


def test_close_shuts_nvml_down_once() -> None:
    backend, nvml = open_nvml(fake.t4())
    backend.close()
    backend.close()
    assert nvml.calls.count("nvmlShutdown") == 1
    assert not nvml.initialized
    with pytest.raises(Unavailable, match="NVML not available"):
        backend.gpu(0)
