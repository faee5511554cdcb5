"""GPU backends of the dispatcher: what its GPU is, how busy it is, and its MIG layout.

`open_backend` picks one: `NvmlBackend` (the real driver, through pynvml) or
`SimulatedBackend` (GPUs described by a fleet spec such as "4xA100-80GB"). The models they
know are the catalogue of gpuloom.domain.gpus.
"""

from gpuloom.services.dispatcher.gpu.backend import GpuBackend, GpuProcess, GpuUsage
from gpuloom.services.dispatcher.gpu.nvml import NvmlBackend
from gpuloom.services.dispatcher.gpu.select import BACKEND_KINDS, open_backend
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend, parse_fleet_spec

__all__ = [
    "BACKEND_KINDS",
    "GpuBackend",
    "GpuProcess",
    "GpuUsage",
    "NvmlBackend",
    "SimulatedBackend",
    "open_backend",
    "parse_fleet_spec",
]
