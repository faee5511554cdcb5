"""The GPU backend over the real driver, through pynvml (PyPI package nvidia-ml-py).

The pynvml module is a constructor parameter so that tests can run this code against an
in-memory fake. Every NVML error becomes a domain error naming the GPU and the NVML call.

MIG instances are made the way `nvidia-smi mig -cgi ... -C` makes them: a GPU instance at an
explicit placement plus one compute instance spanning all of it. Listing reports one entry
per MIG device (compute instance); gpuloom never puts two compute instances in one GPU
instance, and destroying one made elsewhere keeps a GPU instance that others still use.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import structlog

from gpuloom.domain.errors import (
    DomainError,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from gpuloom.domain.gpus import (
    GpuInfo,
    GpuModel,
    MigInstance,
    match_driver_name,
    mig_profile,
)
from gpuloom.services.dispatcher.gpu.backend import GpuProcess, GpuUsage
from gpuloom.services.dispatcher.gpu.mig_checks import check_placement

log = structlog.get_logger("gpuloom.dispatcher.gpu")

_STANDARD_SLICES = (1, 2, 3, 4, 7)  # instance sizes with NVML_*_PROFILE_<n>_SLICE profiles


def import_pynvml() -> Any:
    """The real pynvml module; Unavailable when it is not installed."""
    try:
        import pynvml
    except ImportError as error:
        raise Unavailable(
            f"NVML not available: cannot import pynvml (package nvidia-ml-py): {error}"
        ) from error
    return pynvml


@dataclass(frozen=True, slots=True)
class _MigDevice:
    instance: MigInstance
    gpu_instance_id: int
    compute_instance_id: int


class NvmlBackend:
    """The GPUs the NVIDIA driver sees. Initialises NVML on construction (Unavailable if it
    cannot) and shuts it down on close()."""

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        """`nvml`: a module with pynvml's interface (default: import pynvml)."""
        self._nvml = nvml if nvml is not None else import_pynvml()
        # Besides NVMLError, pynvml raises this for unversioned calls the library lacks.
        mismatch = getattr(self._nvml, "NVMLLibraryMismatchError", None)
        self._errors: tuple[type[BaseException], ...] = (
            (self._nvml.NVMLError, mismatch) if mismatch else (self._nvml.NVMLError,)
        )
        try:
            self._nvml.nvmlInit()
        except self._errors as error:
            raise Unavailable(f"NVML not available: nvmlInit: {error}") from error
        self._closed = False
        # Serialises our MIG reconfigurations: a placement is checked against the layout the
        # driver reports, which must not change before the creation that relies on it.
        self._mig_lock = threading.Lock()

    def gpus(self) -> list[GpuInfo]:
        count = self._call(None, "nvmlDeviceGetCount")
        return [self.gpu(index) for index in range(count)]

    def gpu(self, index: int) -> GpuInfo:
        return self._describe(index, self._handle(index))[0]

    def usage(self, index: int) -> GpuUsage:
        handle = self._handle(index)
        memory = self._call(index, "nvmlDeviceGetMemoryInfo", handle)
        rates = self._call(
            index, "nvmlDeviceGetUtilizationRates", handle, tolerate=self._unsupported()
        )
        # With MIG on, NVML has no whole-GPU utilisation (only DCGM does): say "unknown".
        utilization = math.nan if rates is None else float(rates.gpu)
        return GpuUsage(utilization_percent=utilization, memory_used_bytes=int(memory.used))

    def processes(self, index: int) -> list[GpuProcess]:
        handle = self._handle(index)
        used: dict[int, int] = {}
        for proc in self._call(index, "nvmlDeviceGetComputeRunningProcesses", handle):
            # usedGpuMemory is None where the driver cannot tell (no permission, WDDM); a
            # process with contexts on several MIG devices is listed once per device.
            used[int(proc.pid)] = used.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
        return [GpuProcess(pid, memory) for pid, memory in sorted(used.items())]

    def mig_instances(self, index: int) -> list[MigInstance]:
        handle = self._handle(index)
        _capable, enabled = self._mig_mode(index, handle)
        if not enabled:
            return []
        model = self._describe(index, handle)[1]
        return [d.instance for d in self._mig_devices(index, handle, model)]

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        n = self._nvml
        with self._mig_lock:
            handle = self._handle(index)
            capable, current = self._mig_mode(index, handle)
            if not capable:
                raise FailedPrecondition(f"GPU {index} is not MIG-capable")
            if current == enabled:
                return
            mode = n.NVML_DEVICE_MIG_ENABLE if enabled else n.NVML_DEVICE_MIG_DISABLE
            status = self._call(index, "nvmlDeviceSetMigMode", handle, mode)
            if status != n.NVML_SUCCESS:
                # The driver accepted the change but applies it only after a GPU reset.
                raise FailedPrecondition(
                    f"GPU {index}: MIG mode {'on' if enabled else 'off'} is pending until the "
                    f"GPU is reset ({n.NVMLError(status)})"
                )
            log.info("mig_mode_set", backend=self.name, gpu=index, enabled=enabled)

    def create_mig_instance(self, index: int, slices: int, first_slice: int) -> MigInstance:
        n = self._nvml
        with self._mig_lock:
            handle = self._handle(index)
            model = self._require_mig(index, handle)
            existing = self._mig_devices(index, handle, model)
            check_placement(model, slices, first_slice, (d.instance for d in existing))
            profile_id = self._gpu_instance_profiles(index, handle).get(slices, (None, ""))[0]
            if profile_id is None:
                raise FailedPrecondition(
                    f"GPU {index}: the driver offers no {slices}-slice GPU instance profile"
                )
            placement = n.c_nvmlGpuInstancePlacement_t()
            placement.start = first_slice
            placement.size = mig_profile(model, slices).nvml_placement_size
            gpu_instance = self._call(
                index, "nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile_id, placement
            )
            try:
                ci_profile = self._call(
                    index,
                    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                    gpu_instance,
                    getattr(n, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE"),
                    n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
                self._call(
                    index, "nvmlGpuInstanceCreateComputeInstance", gpu_instance, ci_profile.id
                )
            except DomainError:
                # A GPU instance without a compute instance holds slices yet runs nothing.
                self._call(index, "nvmlGpuInstanceDestroy", gpu_instance, tolerate=None)
                raise
            gpu_instance_id = self._call(index, "nvmlGpuInstanceGetInfo", gpu_instance).id
            for device in self._mig_devices(index, handle, model):
                if device.gpu_instance_id == gpu_instance_id:
                    log.info(
                        "mig_instance_created",
                        backend=self.name,
                        gpu=index,
                        uuid=device.instance.uuid,
                        profile=device.instance.profile_name,
                        first_slice=first_slice,
                    )
                    return device.instance
            raise Unavailable(
                f"GPU {index}: created GPU instance {gpu_instance_id} but NVML lists no MIG "
                "device for it"
            )

    def destroy_mig_instance(self, index: int, uuid: str) -> None:
        with self._mig_lock:
            handle = self._handle(index)
            model = self._require_mig(index, handle)
            devices = self._mig_devices(index, handle, model)
            target = next((d for d in devices if d.instance.uuid == uuid), None)
            if target is None:
                raise NotFound(f"GPU {index} has no MIG instance {uuid!r}")
            gpu_instance = self._call(
                index, "nvmlDeviceGetGpuInstanceById", handle, target.gpu_instance_id
            )
            compute_instance = self._call(
                index,
                "nvmlGpuInstanceGetComputeInstanceById",
                gpu_instance,
                target.compute_instance_id,
            )
            self._call(index, "nvmlComputeInstanceDestroy", compute_instance)
            shared = any(
                d.gpu_instance_id == target.gpu_instance_id and d is not target for d in devices
            )
            if not shared:
                self._call(index, "nvmlGpuInstanceDestroy", gpu_instance)
        log.info("mig_instance_destroyed", backend=self.name, gpu=index, uuid=uuid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._errors as error:
            log.warning("nvml_shutdown_failed", error=str(error))

    # Helpers.

    def _call(
        self, index: int | None, function: str, *args: Any, tolerate: tuple[int, ...] | None = ()
    ) -> Any:
        """Call a pynvml function, turning its errors into domain errors. Returns None for an
        error code in `tolerate`; tolerate=None swallows (and logs) every NVML error."""
        try:
            return getattr(self._nvml, function)(*args)
        except self._errors as error:
            code = getattr(error, "value", None)
            if tolerate is None:
                log.warning("nvml_call_failed", gpu=index, function=function, error=str(error))
                return None
            if code in tolerate:
                return None
            raise self._domain_error(index, function, error) from error

    def _domain_error(self, index: int | None, function: str, error: BaseException) -> DomainError:
        n = self._nvml
        code = getattr(error, "value", None)
        where = f"GPU {index}: {function}" if index is not None else function
        message = f"{where}: {error}"
        if code in (
            n.NVML_ERROR_UNINITIALIZED,
            n.NVML_ERROR_LIBRARY_NOT_FOUND,
            n.NVML_ERROR_DRIVER_NOT_LOADED,
            n.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        ) or not isinstance(error, n.NVMLError):
            return Unavailable(f"NVML not available: {message}")
        if code in (n.NVML_ERROR_NOT_FOUND, n.NVML_ERROR_GPU_NOT_FOUND):
            return NotFound(message)
        if code in (
            n.NVML_ERROR_NOT_SUPPORTED,
            n.NVML_ERROR_FUNCTION_NOT_FOUND,
            n.NVML_ERROR_NO_PERMISSION,
            n.NVML_ERROR_IN_USE,
            n.NVML_ERROR_INSUFFICIENT_RESOURCES,
            n.NVML_ERROR_RESET_REQUIRED,
            n.NVML_ERROR_INVALID_STATE,
            # Our own arguments are checked before any call: what the driver still rejects
            # depends on the GPU's state (its MIG layout, its driver version).
            n.NVML_ERROR_INVALID_ARGUMENT,
        ):
            return FailedPrecondition(message)
        # Lost GPU, timeout, unknown: the GPU cannot be used right now.
        return Unavailable(message)

    def _unsupported(self) -> tuple[int, ...]:
        return (self._nvml.NVML_ERROR_NOT_SUPPORTED, self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _handle(self, index: int) -> Any:
        count = self._call(None, "nvmlDeviceGetCount")
        if not 0 <= index < count:
            raise NotFound(f"no GPU with index {index}; NVML sees {count}")
        return self._call(index, "nvmlDeviceGetHandleByIndex", index)

    def _describe(self, index: int, handle: Any) -> tuple[GpuInfo, GpuModel | None]:
        driver_name = _text(self._call(index, "nvmlDeviceGetName", handle))
        memory = int(self._call(index, "nvmlDeviceGetMemoryInfo", handle).total)
        model = match_driver_name(driver_name, memory)
        capable, enabled = self._mig_mode(index, handle)
        info = GpuInfo(
            index=index,
            gpu_uuid=_text(self._call(index, "nvmlDeviceGetUUID", handle)),
            node="",
            model=model.name if model else driver_name,
            memory_bytes=memory,
            sm_count=self._sm_count(index, handle, model),
            mig_capable=capable,
            mig_enabled=enabled,
        )
        return info, model

    def _sm_count(self, index: int, handle: Any, model: GpuModel | None) -> int:
        # NVML has no "SM count" call for a whole GPU. nvmlDeviceGetAttributes reports one
        # but is documented for MIG device handles only, and drivers differ on whether they
        # answer for a whole GPU; where they don't, the model table knows the number.
        attributes = self._call(
            index, "nvmlDeviceGetAttributes", handle, tolerate=self._unsupported()
        )
        if attributes is not None and attributes.multiprocessorCount > 0:
            return int(attributes.multiprocessorCount)
        if model is not None:
            return model.sm_count
        log.warning("gpu_sm_count_unknown", gpu=index)
        return 0

    def _mig_mode(self, index: int, handle: Any) -> tuple[bool, bool]:
        """(MIG-capable, MIG on now); a GPU without MIG answers NOT_SUPPORTED."""
        mode = self._call(
            index,
            "nvmlDeviceGetMigMode",
            handle,
            tolerate=(self._nvml.NVML_ERROR_NOT_SUPPORTED,),
        )
        if mode is None:
            return False, False
        current, _pending = mode
        return True, current == self._nvml.NVML_DEVICE_MIG_ENABLE

    def _require_mig(self, index: int, handle: Any) -> GpuModel:
        info, model = self._describe(index, handle)
        if not info.mig_capable:
            raise FailedPrecondition(f"GPU {index} ({info.model}) is not MIG-capable")
        if not info.mig_enabled:
            raise FailedPrecondition(f"MIG mode is off on GPU {index} ({info.model})")
        if model is None or not model.mig_capable:
            # Placements are checked against MIG geometry data, which this model lacks.
            raise FailedPrecondition(
                f"GPU {index} ({info.model}) has no known MIG geometry; gpuloom cannot place "
                "MIG instances on it"
            )
        return model

    def _gpu_instance_profiles(self, index: int, handle: Any) -> dict[int, tuple[int, str]]:
        """Instance size -> (GPU instance profile id, profile name) for the standard sizes
        the GPU offers."""
        profiles: dict[int, tuple[int, str]] = {}
        for slices in _STANDARD_SLICES:
            info = self._call(
                index,
                "nvmlDeviceGetGpuInstanceProfileInfo",
                handle,
                getattr(self._nvml, f"NVML_GPU_INSTANCE_PROFILE_{slices}_SLICE"),
                tolerate=(*self._unsupported(), self._nvml.NVML_ERROR_INVALID_ARGUMENT),
            )
            if info is not None:
                # Version 2 of the struct carries the name ("MIG 3g.40gb"); version 1 does not.
                name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
                profiles[int(info.sliceCount)] = (int(info.id), name)
        return profiles

    def _mig_devices(self, index: int, handle: Any, model: GpuModel | None) -> list[_MigDevice]:
        profile_names = {
            pid: name for pid, name in self._gpu_instance_profiles(index, handle).values()
        }
        devices = []
        for slot in range(self._call(index, "nvmlDeviceGetMaxMigDeviceCount", handle)):
            mig = self._call(
                index,
                "nvmlDeviceGetMigDeviceHandleByIndex",
                handle,
                slot,
                tolerate=(self._nvml.NVML_ERROR_NOT_FOUND,),
            )
            if mig is None:  # no MIG device in this slot
                continue
            attributes = self._call(index, "nvmlDeviceGetAttributes", mig)
            gpu_instance_id = int(self._call(index, "nvmlDeviceGetGpuInstanceId", mig))
            gpu_instance = self._call(
                index, "nvmlDeviceGetGpuInstanceById", handle, gpu_instance_id
            )
            gi_info = self._call(index, "nvmlGpuInstanceGetInfo", gpu_instance)
            slices = int(attributes.gpuInstanceSliceCount)
            name = profile_names.get(int(gi_info.profileId)) or _fallback_profile_name(
                model, slices, int(attributes.memorySizeMB)
            )
            instance = MigInstance(
                uuid=_text(self._call(index, "nvmlDeviceGetUUID", mig)),
                slices=slices,
                first_slice=int(gi_info.placement.start),
                memory_bytes=int(attributes.memorySizeMB) << 20,
                profile_name=name,
            )
            compute_instance_id = int(self._call(index, "nvmlDeviceGetComputeInstanceId", mig))
            devices.append(_MigDevice(instance, gpu_instance_id, compute_instance_id))
        return sorted(devices, key=lambda d: (d.instance.first_slice, d.instance.uuid))


def _fallback_profile_name(model: GpuModel | None, slices: int, memory_mib: int) -> str:
    """A profile name for a GPU instance whose profile the driver did not name."""
    if model is not None and model.mig_capable:
        try:
            return mig_profile(model, slices).name
        except DomainError:
            pass
    return f"{slices}g.{math.ceil(memory_mib / 1024)}gb"


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes where newer ones return str.
    return value.decode() if isinstance(value, bytes) else str(value)
