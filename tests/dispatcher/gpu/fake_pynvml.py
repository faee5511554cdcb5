"""An in-memory stand-in for the pynvml module: exactly the functions and constants the NVML
backend uses, with NVML's behaviour where the backend depends on it (errors for unknown
handles, MIG placements checked like the driver does, NOT_SUPPORTED without MIG).

test_fake_pynvml.py checks every name here against the real pynvml, so the fake cannot drift
from the interface it imitates.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

# Return codes and constants: the real pynvml's values.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 4
NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 4
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0

CONSTANTS = {name: value for name, value in globals().items() if name.startswith("NVML_")}

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_IN_USE: "In use by another client",
    NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

_GI_SLICES = {
    NVML_GPU_INSTANCE_PROFILE_1_SLICE: 1,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE: 2,
    NVML_GPU_INSTANCE_PROFILE_3_SLICE: 3,
    NVML_GPU_INSTANCE_PROFILE_4_SLICE: 4,
    NVML_GPU_INSTANCE_PROFILE_7_SLICE: 7,
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


class NVMLLibraryMismatchError(Exception):
    pass


class c_nvmlGpuInstancePlacement_t:  # pynvml's name
    def __init__(self) -> None:
        self.start = 0
        self.size = 0


@dataclass(frozen=True)
class GiProfile:
    """A GPU instance profile: its NVML id, name, memory and legal placements (start, size)."""

    slices: int
    profile_id: int
    name: str
    memory_mib: int
    placements: tuple[tuple[int, int], ...]


@dataclass
class FakeGpu:
    name: str
    uuid: str
    memory_total: int
    memory_used: int = 0
    # None: nvmlDeviceGetAttributes answers NOT_SUPPORTED for the whole GPU (older drivers).
    sm_count: int | None = None
    utilization: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig_mode: int | None = None  # None: not MIG-capable
    profiles: tuple[GiProfile, ...] = ()
    max_mig_devices: int = 0


@dataclass
class _ComputeInstance:
    ci_id: int
    uuid: str


@dataclass
class _GpuInstance:
    gi_id: int
    profile: GiProfile
    start: int
    size: int
    computes: dict[int, _ComputeInstance] = field(default_factory=dict)


@dataclass(frozen=True)
class _Handle:
    """Opaque handle: a GPU, a GPU instance, a compute instance or a MIG device."""

    kind: str
    gpu: int
    gi: int = -1
    ci: int = -1


def _gpu(
    name: str, uuid: str, memory_mib: int, overrides: dict[str, object], **mig: object
) -> FakeGpu:
    """A FakeGpu of this model (with `mig`: MIG-capable, MIG mode off), with `overrides`."""
    defaults: dict[str, object] = {"name": name, "uuid": uuid, "memory_total": memory_mib << 20}
    if mig:
        defaults.update(mig_mode=NVML_DEVICE_MIG_DISABLE, **mig)
    return FakeGpu(**{**defaults, **overrides})  # type: ignore[arg-type]


def a100_80gb(index: int = 0, **kwargs: object) -> FakeGpu:
    seven = [(s, 1) for s in range(7)]
    profiles = (
        GiProfile(1, 19, "MIG 1g.10gb", 9728, tuple(seven)),
        GiProfile(2, 14, "MIG 2g.20gb", 19968, ((0, 2), (2, 2), (4, 2))),
        GiProfile(3, 9, "MIG 3g.40gb", 40192, ((0, 4), (4, 4))),
        GiProfile(4, 5, "MIG 4g.40gb", 40192, ((0, 4),)),
        GiProfile(7, 0, "MIG 7g.80gb", 80896, ((0, 8),)),
    )
    name, uuid = "NVIDIA A100-SXM4-80GB", f"GPU-a100-{index}"
    return _gpu(name, uuid, 81920, kwargs, profiles=profiles, max_mig_devices=7)


def a30(index: int = 0, **kwargs: object) -> FakeGpu:
    profiles = (
        GiProfile(1, 14, "MIG 1g.6gb", 5952, tuple((s, 1) for s in range(4))),
        GiProfile(2, 5, "MIG 2g.12gb", 11968, ((0, 2), (2, 2))),
        GiProfile(4, 0, "MIG 4g.24gb", 24064, ((0, 4),)),
    )
    name, uuid = "NVIDIA A30", f"GPU-a30-{index}"
    return _gpu(name, uuid, 24576, kwargs, profiles=profiles, max_mig_devices=4)


def t4(index: int = 0, **kwargs: object) -> FakeGpu:
    return _gpu("Tesla T4", f"GPU-t4-{index}", 15360, kwargs)


class FakeNvml:
    """Module-like: pass an instance where the backend expects the pynvml module.

    `failures` maps a function name to the NVML error code it raises on every call; `calls`
    records the functions called, in order.
    """

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    c_nvmlGpuInstancePlacement_t = c_nvmlGpuInstancePlacement_t

    def __init__(self, gpus: list[FakeGpu], *, activation_status: int = NVML_SUCCESS) -> None:
        for name, value in CONSTANTS.items():
            setattr(self, name, value)
        self.gpus = gpus
        self.failures: dict[str, int] = {}
        self.calls: list[str] = []
        self.initialized = False
        self.activation_status = activation_status  # what nvmlDeviceSetMigMode reports
        self.instances: list[dict[int, _GpuInstance]] = [{} for _ in gpus]
        self._ids = itertools.count(1)

    # Library.

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", initialized=False)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    # Devices.

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle("gpu", index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        if isinstance(handle, _Handle) and handle.kind == "mig":
            return self._compute(handle).uuid
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        free = gpu.memory_total - gpu.memory_used
        return SimpleNamespace(total=gpu.memory_total, used=gpu.memory_used, free=free)

    def nvmlDeviceGetAttributes(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetAttributes")
        if isinstance(handle, _Handle) and handle.kind == "mig":
            self._compute(handle)
            gi = self._gpu_instance(handle)
            return SimpleNamespace(
                multiprocessorCount=14 * gi.profile.slices,
                gpuInstanceSliceCount=gi.profile.slices,
                computeInstanceSliceCount=gi.profile.slices,
                memorySizeMB=gi.profile.memory_mib,
            )
        gpu = self._gpu(handle)
        if gpu.sm_count is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(multiprocessorCount=gpu.sm_count, memorySizeMB=0)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates")
        gpu = self._gpu(handle)
        if gpu.mig_mode == NVML_DEVICE_MIG_ENABLE:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # as the driver does with MIG on
        return SimpleNamespace(gpu=gpu.utilization, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        gpu = self._gpu(handle)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu.processes]

    # MIG.

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._mig_gpu(handle)
        assert gpu.mig_mode is not None
        return [gpu.mig_mode, gpu.mig_mode]

    def nvmlDeviceSetMigMode(self, handle: _Handle, mode: int) -> int:
        self._enter("nvmlDeviceSetMigMode")
        gpu = self._mig_gpu(handle)
        if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if mode == NVML_DEVICE_MIG_DISABLE and self.instances[handle.gpu]:
            raise NVMLError(NVML_ERROR_IN_USE)
        if self.activation_status == NVML_SUCCESS:
            gpu.mig_mode = mode
        return self.activation_status

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return self._mig_gpu(handle).max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._mig_gpu(handle)
        if not 0 <= index < gpu.max_mig_devices:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        devices = [
            _Handle("mig", handle.gpu, gi.gi_id, ci.ci_id)
            for gi in self.instances[handle.gpu].values()
            for ci in gi.computes.values()
        ]
        if index >= len(devices):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return devices[index]

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        return self._gpu_instance(self._mig_device(handle)).gi_id

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        return self._compute(self._mig_device(handle)).ci_id

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: _Handle, profile: int) -> SimpleNamespace:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfo")
        found = self._profile_for_slices(self._mig_gpu(handle), _GI_SLICES.get(profile))
        return SimpleNamespace(
            id=found.profile_id,
            sliceCount=found.slices,
            memorySizeMB=found.memory_mib,
            name=found.name.encode(),  # a char array in the C struct: bytes
        )

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, handle: _Handle, profile_id: int, placement: c_nvmlGpuInstancePlacement_t
    ) -> _Handle:
        self._enter("nvmlDeviceCreateGpuInstanceWithPlacement")
        gpu = self._mig_gpu(handle)
        if gpu.mig_mode != NVML_DEVICE_MIG_ENABLE:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        profile = next((p for p in gpu.profiles if p.profile_id == profile_id), None)
        wanted = (placement.start, placement.size)
        if profile is None or wanted not in profile.placements:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for gi in self.instances[handle.gpu].values():
            if placement.start < gi.start + gi.size and gi.start < placement.start + placement.size:
                raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = next(self._ids)
        self.instances[handle.gpu][gi_id] = _GpuInstance(gi_id, profile, *wanted)
        return _Handle("gi", handle.gpu, gi_id)

    def nvmlDeviceGetGpuInstanceById(self, handle: _Handle, gi_id: int) -> _Handle:
        self._enter("nvmlDeviceGetGpuInstanceById")
        self._mig_gpu(handle)
        if gi_id not in self.instances[handle.gpu]:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle("gi", handle.gpu, gi_id)

    def nvmlGpuInstanceGetInfo(self, handle: _Handle) -> SimpleNamespace:
        self._enter("nvmlGpuInstanceGetInfo")
        gi = self._gpu_instance(handle, kind="gi")
        return SimpleNamespace(
            id=gi.gi_id,
            profileId=gi.profile.profile_id,
            placement=SimpleNamespace(start=gi.start, size=gi.size),
        )

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, handle: _Handle, profile: int, engine_profile: int
    ) -> SimpleNamespace:
        self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        gi = self._gpu_instance(handle, kind="gi")
        slices = _GI_SLICES.get(profile)  # the compute profiles are numbered alike
        if slices is None or slices > gi.profile.slices:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(id=100 + profile, sliceCount=slices)

    def nvmlGpuInstanceCreateComputeInstance(self, handle: _Handle, profile_id: int) -> _Handle:
        self._enter("nvmlGpuInstanceCreateComputeInstance")
        gi = self._gpu_instance(handle, kind="gi")
        if profile_id - 100 not in _GI_SLICES:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        ci_id = len(gi.computes)
        uuid = f"MIG-{self.gpus[handle.gpu].uuid}-gi{gi.gi_id}-ci{ci_id}"
        gi.computes[ci_id] = _ComputeInstance(ci_id, uuid)
        return _Handle("ci", handle.gpu, gi.gi_id, ci_id)

    def nvmlGpuInstanceGetComputeInstanceById(self, handle: _Handle, ci_id: int) -> _Handle:
        self._enter("nvmlGpuInstanceGetComputeInstanceById")
        gi = self._gpu_instance(handle, kind="gi")
        if ci_id not in gi.computes:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle("ci", handle.gpu, gi.gi_id, ci_id)

    def nvmlComputeInstanceDestroy(self, handle: _Handle) -> int:
        self._enter("nvmlComputeInstanceDestroy")
        if handle.kind != "ci":
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._compute(handle)
        del self._gpu_instance(handle).computes[handle.ci]
        return NVML_SUCCESS

    def nvmlGpuInstanceDestroy(self, handle: _Handle) -> int:
        self._enter("nvmlGpuInstanceDestroy")
        gi = self._gpu_instance(handle, kind="gi")
        if gi.computes:
            raise NVMLError(NVML_ERROR_IN_USE)
        del self.instances[handle.gpu][gi.gi_id]
        return NVML_SUCCESS

    # Test helpers (not pynvml's).

    def add_compute_instance(self, gpu: int, gi_id: int) -> str:
        """A second compute instance in a GPU instance, as another tool could make."""
        handle = self.nvmlGpuInstanceCreateComputeInstance(_Handle("gi", gpu, gi_id), 100)
        return self.instances[gpu][gi_id].computes[handle.ci].uuid

    def _enter(self, function: str, *, initialized: bool = True) -> None:
        self.calls.append(function)
        if function in self.failures:
            raise NVMLError(self.failures[function])
        if initialized and not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: object) -> FakeGpu:
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle.gpu]

    def _mig_gpu(self, handle: object) -> FakeGpu:
        if not isinstance(handle, _Handle) or handle.kind != "gpu":
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu(handle)
        if gpu.mig_mode is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_device(self, handle: object) -> _Handle:
        if not isinstance(handle, _Handle) or handle.kind != "mig":
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def _gpu_instance(self, handle: object, kind: str | None = None) -> _GpuInstance:
        if not isinstance(handle, _Handle) or (kind is not None and handle.kind != kind):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(handle)
        gi = self.instances[handle.gpu].get(handle.gi)
        if gi is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # a stale or made-up handle
        return gi

    def _compute(self, handle: _Handle) -> _ComputeInstance:
        compute = self._gpu_instance(handle).computes.get(handle.ci)
        if compute is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return compute

    def _profile_for_slices(self, gpu: FakeGpu, slices: int | None) -> GiProfile:
        found = next((p for p in gpu.profiles if p.slices == slices), None)
        if found is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return found
