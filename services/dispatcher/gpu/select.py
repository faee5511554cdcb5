"""Choosing the GPU backend at start-up: the real driver, the simulation, or whichever works."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from gpuloom.domain.errors import DomainError, Unavailable
from gpuloom.services.dispatcher.gpu.backend import GpuBackend
from gpuloom.services.dispatcher.gpu.nvml import NvmlBackend
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend, parse_fleet_spec

log = structlog.get_logger("gpuloom.dispatcher.gpu")

BACKEND_KINDS = ("auto", "nvml", "simulated")


def open_backend(
    kind: str,
    sim_gpus: str,
    *,
    mig_enabled: bool = False,
    time_scale: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    nvml: Any = None,
    fleet_id: str = "",
) -> GpuBackend:
    """Open the backend `kind` names: "nvml", "simulated" (the GPUs of the fleet spec
    `sim_gpus`), or "auto": NVML if it initialises and reports a GPU, else simulated.

    `mig_enabled`, `time_scale`, `sleep` and `fleet_id` configure the simulated backend;
    `nvml` replaces the pynvml module. ValueError for an unknown kind or a bad fleet spec
    (checked for "auto" even when NVML wins, so that a typo fails at start-up on every host);
    Unavailable when "nvml" is asked for and cannot be used.
    """
    chosen = kind.strip().lower()
    if chosen not in BACKEND_KINDS:
        raise ValueError(
            f"unknown GPU backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}"
        )
    if chosen == "nvml":
        backend = NvmlBackend(nvml)
        count = _count_gpus(backend)
        log.info("gpu_backend_chosen", backend="nvml", reason="configured", gpus=count)
        return backend
    fleet = parse_fleet_spec(sim_gpus)
    reason = "configured"
    if chosen == "auto":
        try:
            backend = NvmlBackend(nvml)
            count = _count_gpus(backend)
        except Unavailable as error:
            reason = f"auto: {error.message}"
        else:
            log.info(
                "gpu_backend_chosen",
                backend="nvml",
                reason=f"auto: NVML initialised and reports {count} GPU(s)",
                gpus=count,
            )
            return backend
    log.info("gpu_backend_chosen", backend="simulated", reason=reason, gpus=len(fleet))
    return SimulatedBackend(
        sim_gpus, mig_enabled=mig_enabled, time_scale=time_scale, sleep=sleep, fleet_id=fleet_id
    )


def _count_gpus(backend: NvmlBackend) -> int:
    """How many GPUs NVML reports; closes the backend and raises Unavailable if none."""
    try:
        count = len(backend.gpus())
    except DomainError as error:
        backend.close()
        raise Unavailable(f"NVML initialised but cannot list its GPUs: {error.message}") from error
    if count == 0:
        backend.close()
        raise Unavailable("NVML initialised but reports no GPUs")
    return count
