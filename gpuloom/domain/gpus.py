"""The GPU model catalogue: memory, SM count, MIG capability and MIG profiles of each model;
and a GPU as a dispatcher sees and registers it (GpuInfo, its MigInstances).

The dispatcher's simulated backend builds its GPUs from this table and its NVML backend uses
it to name what the driver reports ("NVIDIA A100-SXM4-80GB" is an A100-80GB); placement reads
it to plan MIG batches. MIG rules (legal placements, creation times) come from
gpuloom.domain.mig_geometry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypedDict

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.mig_geometry import MigGeometry, get_geometry

GIB = 1 << 30
MAX_NAME = 128
# Node resources a job may ask for, at most (far above any node: a typo, not a request).
MAX_CPU_MILLI = 1 << 32
MAX_HOST_MEMORY_BYTES = 1 << 50


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str  # "A100-80GB": family and nominal memory, what the fleet spec names
    family: str  # "A100": what the driver's name contains
    memory_gib: int
    sm_count: int
    # Name of the MIG geometry the model follows; None where the model has no MIG.
    mig_geometry: str | None = None
    # What one SM holds at once, from the compute capability's row of the CUDA C++ Programming
    # Guide's table "Technical Specifications per Compute Capability" ("Maximum number of
    # resident threads per SM", "... blocks per SM"): the profiler's SM usage
    # (gpuloom/policies/profiling/shape.py) divides a launch's blocks by what fits.
    max_threads_per_sm: int = field(kw_only=True)
    max_blocks_per_sm: int = field(kw_only=True)

    @property
    def memory_bytes(self) -> int:
        return self.memory_gib * GIB

    @property
    def mig_capable(self) -> bool:
        return self.mig_geometry is not None

    def geometry(self) -> MigGeometry:
        if self.mig_geometry is None:
            raise FailedPrecondition(f"{self.name} is not MIG-capable")
        return get_geometry(self.mig_geometry)


class _SmLimits(TypedDict):
    max_threads_per_sm: int
    max_blocks_per_sm: int


_SM_2048_32 = _SmLimits(max_threads_per_sm=2048, max_blocks_per_sm=32)
MODELS: Mapping[str, GpuModel] = MappingProxyType(
    {
        m.name: m
        for m in (
            # Compute capability 8.0 (A100, A30) and 9.0 (H100, H200): 2048 threads, 32 blocks.
            GpuModel("A100-40GB", "A100", 40, 108, "A100", **_SM_2048_32),
            GpuModel("A100-80GB", "A100", 80, 108, "A100", **_SM_2048_32),
            GpuModel("H100-80GB", "H100", 80, 132, "H100", **_SM_2048_32),
            # Same MIG rules as the H100 and no published reconfiguration times, so the
            # H100's geometry (with its Table 1 times) stands in.
            GpuModel("H200-141GB", "H200", 141, 132, "H100", **_SM_2048_32),
            GpuModel("A30-24GB", "A30", 24, 56, "A30", **_SM_2048_32),
            # 7.0 (V100): 2048 threads, 32 blocks; 7.5 (T4): 1024, 16; 8.9 (L4): 1536, 24.
            GpuModel("V100-32GB", "V100", 32, 80, **_SM_2048_32),
            GpuModel("T4-16GB", "T4", 16, 40, max_threads_per_sm=1024, max_blocks_per_sm=16),
            GpuModel("L4-24GB", "L4", 24, 58, max_threads_per_sm=1536, max_blocks_per_sm=24),
        )
    }
)


def find_model(name: str) -> GpuModel | None:
    """The model of that name, case-insensitive ("a100-80gb" works), or None."""
    wanted = name.strip().lower()
    return next((m for m in MODELS.values() if m.name.lower() == wanted), None)


# A driver's total can be a little under the nominal size (an H100 80GB reports 79.6 GiB),
# but a different memory size is a different product (H100 NVL has 94 GB): don't guess then.
_MEMORY_TOLERANCE = 0.1


def match_driver_name(driver_name: str, memory_bytes: int) -> GpuModel | None:
    """The known model a driver-reported name and memory size describe, or None."""
    candidates = [
        m
        for m in MODELS.values()
        # Whole words only: "L4" must not match "L40S", nor "H200" "GH200".
        if re.search(rf"\b{re.escape(m.family)}\b", driver_name, re.IGNORECASE)
        and abs(memory_bytes - m.memory_bytes) <= _MEMORY_TOLERANCE * m.memory_bytes
    ]
    return min(candidates, key=lambda m: abs(memory_bytes - m.memory_bytes), default=None)


# Memory slices an instance of each size gets, per geometry slice count: the 7-slice GPUs
# split memory in 8, the A30 in 4. It is also the placement size NVML expects (a 3-slice
# instance at slice 4 is NVML placement {start 4, size 4}).
_MEMORY_SLICES: Mapping[int, Mapping[int, int]] = MappingProxyType(
    {7: MappingProxyType({1: 1, 2: 2, 3: 4, 4: 4, 7: 8}), 4: MappingProxyType({1: 1, 2: 2, 4: 4})}
)


@dataclass(frozen=True, slots=True)
class MigProfile:
    slices: int
    memory_bytes: int
    name: str  # "3g.40gb"
    nvml_placement_size: int


def mig_profile(model: GpuModel, slices: int) -> MigProfile:
    """The MIG profile of `slices` compute slices on the model (InvalidArgument if none)."""
    geometry = model.geometry()
    if slices not in geometry.sizes:
        raise InvalidArgument(
            "slices",
            f"{model.name} has no {slices}-slice MIG instance; sizes: "
            + ", ".join(map(str, geometry.sizes)),
        )
    memory_slices = _MEMORY_SLICES[geometry.slice_count]
    share = memory_slices[slices] / max(memory_slices.values())
    # NVIDIA rounds half up in profile names: an H200's half is 70.5 GB, "3g.71gb".
    gigabytes = math.floor(model.memory_gib * share + 0.5)
    return MigProfile(
        slices=slices,
        memory_bytes=int(model.memory_bytes * share),
        name=f"{slices}g.{gigabytes}gb",
        nvml_placement_size=memory_slices[slices],
    )


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A MIG instance: `slices` compute slices from `first_slice` on. The driver tells its
    memory and profile name too ("3g.40gb"); a registration with placement carries neither
    (0 and "")."""

    slices: int
    first_slice: int
    uuid: str = ""
    memory_bytes: int = 0
    profile_name: str = ""


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A GPU as its dispatcher sees it and registers it with placement. A dispatcher's GPU
    backend describes the device (its driver index, UUID, model, memory, SMs, MIG mode; the
    node ""), and the dispatcher adds the rest when it registers: its node, MIG instances,
    MPS and the node's resources. `index` means nothing to placement (0 there)."""

    gpu_uuid: str
    node: str
    model: str
    memory_bytes: int
    sm_count: int = 0
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_instances: tuple[MigInstance, ...] = ()
    mps_enabled: bool = False
    # The node's CPU (milli) and memory for jobs, as the dispatcher read them; 0: not reported.
    node_cpu_milli: int = 0
    node_memory_bytes: int = 0
    index: int = 0  # the driver's index of the GPU on its node

    def validate(self) -> None:
        for name, value in (("gpu.ref.gpu_uuid", self.gpu_uuid), ("gpu.model", self.model)):
            if not 1 <= len(value) <= MAX_NAME or not value.isprintable():
                raise InvalidArgument(name, f"must be 1..{MAX_NAME} printable characters")
        if not 1 <= len(self.node) <= 253 or not self.node.isprintable():
            raise InvalidArgument("gpu.ref.node", "must be 1..253 printable characters")
        if self.memory_bytes <= 0:
            raise InvalidArgument("gpu.memory_bytes", "must be > 0")
        for name, value, most in (
            ("gpu.node_cpu_milli", self.node_cpu_milli, MAX_CPU_MILLI),
            ("gpu.node_memory_bytes", self.node_memory_bytes, MAX_HOST_MEMORY_BYTES),
        ):
            if not 0 <= value <= most:
                raise InvalidArgument(name, f"must be within 0..{most}, got {value}")
        for i, instance in enumerate(self.mig_instances):
            if instance.slices not in (1, 2, 3, 4, 7) or not 0 <= instance.first_slice < 8:
                raise InvalidArgument(
                    f"gpu.mig_instances[{i}]",
                    f"{instance.slices} slices at slice {instance.first_slice} is no MIG instance",
                )
