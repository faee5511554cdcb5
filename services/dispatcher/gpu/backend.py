"""The one interface the dispatcher uses to see and reconfigure its GPU, whatever drives it.

Two backends implement it: `SimulatedBackend` (described by config; CI and laptops have no GPU)
and `NvmlBackend` (the real driver through pynvml). Both raise the domain errors of
gpuloom/domain/errors.py, so callers never see a pynvml exception:

- NotFound: no GPU with that index, no MIG instance with that UUID;
- InvalidArgument: an instance size or first slice that cannot exist on that model;
- FailedPrecondition: MIG on a GPU that is not MIG-capable or has MIG mode off, a placement
  that is not legal for the model or overlaps an instance that exists;
- Unavailable: the driver or library cannot be reached.

Methods block (MIG creation takes what the hardware takes); call them off the event loop.
A GPU and its MIG instances are described by the domain's GpuInfo and MigInstance
(gpuloom/domain/gpus.py), the form the dispatcher registers them in with placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpuloom.domain.gpus import GpuInfo, MigInstance


@dataclass(frozen=True, slots=True)
class GpuUsage:
    # NaN when the driver cannot tell: NVML has no whole-GPU utilisation while MIG is on.
    utilization_percent: float
    memory_used_bytes: int


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int


@runtime_checkable
class GpuBackend(Protocol):
    name: str  # "simulated" or "nvml"

    def gpus(self) -> list[GpuInfo]:
        """Every GPU this backend sees, ordered by index."""

    def gpu(self, index: int) -> GpuInfo:
        """One GPU; NotFound for an index this backend does not have."""

    def usage(self, index: int) -> GpuUsage: ...

    def processes(self, index: int) -> list[GpuProcess]:
        """Compute processes on the GPU, ordered by pid."""

    def mig_instances(self, index: int) -> list[MigInstance]:
        """The MIG instances that exist, ordered by first slice; empty when MIG is off."""

    def set_mig_mode(self, index: int, enabled: bool) -> None: ...

    def create_mig_instance(self, index: int, slices: int, first_slice: int) -> MigInstance:
        """Create an instance of `slices` compute slices at `first_slice`; blocks for as long
        as the creation takes."""

    def destroy_mig_instance(self, index: int, uuid: str) -> None:
        """Destroy the instance; blocks for as long as the destruction takes."""

    def close(self) -> None: ...
