"""A GPU backend described by config, for machines without GPUs (CI, laptops, demos).

The fleet comes from a spec string such as "4xA100-80GB" or "A100-80GB,2xA30-24GB". Nothing
here measures anything: usage and processes are what the dispatcher reports through
`report_usage` and `attach_process`, and MIG reconfiguration keeps the layout in memory,
taking the creation/destruction times of the FAR paper's Table 1 (scaled by `time_scale`).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from gpuloom.domain.gpus import (
    MODELS,
    GpuInfo,
    GpuModel,
    MigInstance,
    find_model,
    mig_profile,
)
from gpuloom.services.dispatcher.gpu.backend import GpuProcess, GpuUsage
from gpuloom.services.dispatcher.gpu.mig_checks import check_placement

log = structlog.get_logger("gpuloom.dispatcher.gpu")

MAX_GPUS = 64
_FLEET_ITEM = re.compile(r"(?:(\d+)\s*[xX]\s*)?([A-Za-z][A-Za-z0-9-]*)(\s*:\s*[mM][iI][gG])?")
_EXAMPLE = "expected [COUNTx]MODEL[:mig][,...], e.g. '4xA100-80GB' or 'A100-80GB:mig,2xA30-24GB'"


def parse_fleet(spec: str) -> list[tuple[GpuModel, bool]]:
    """The GPUs a fleet spec describes, in index order, each with whether it starts in MIG
    mode (`:mig` after the model). ValueError naming the bad part."""
    if not spec.strip():
        raise ValueError(f"empty GPU fleet spec; {_EXAMPLE}")
    fleet: list[tuple[GpuModel, bool]] = []
    for part in spec.split(","):
        item = part.strip()
        match = _FLEET_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"bad GPU fleet entry {part!r} in {spec!r}; {_EXAMPLE}")
        count = int(match[1]) if match[1] else 1
        if not 1 <= count <= MAX_GPUS:
            raise ValueError(f"bad GPU count {count} in {item!r}: must be 1..{MAX_GPUS}")
        model = find_model(match[2])
        if model is None:
            raise ValueError(
                f"unknown GPU model {match[2]!r} in {spec!r}; known: {', '.join(MODELS)}"
            )
        mig = match[3] is not None
        if mig and not model.mig_capable:
            raise ValueError(f"{model.name} in {item!r} is not MIG-capable; drop ':mig'")
        fleet.extend([(model, mig)] * count)
    if len(fleet) > MAX_GPUS:
        raise ValueError(f"GPU fleet spec {spec!r} has {len(fleet)} GPUs; at most {MAX_GPUS}")
    return fleet


def parse_fleet_spec(spec: str) -> list[GpuModel]:
    """The models of the GPUs a fleet spec describes, in index order (see `parse_fleet`)."""
    return [model for model, _ in parse_fleet(spec)]


FLEET_ID_FILE = "simulated-fleet-id"
_FLEET_ID = re.compile(r"[0-9a-f]{8}")


def simulated_uuid(model: GpuModel, index: int, fleet_id: str = "") -> str:
    """Derived from the spec and the fleet's id alone, so reservations persisted before a
    restart still match; the id tells apart the fleets of several dispatchers, which placement
    would otherwise take for one GPU (it keys GPUs by UUID)."""
    return f"SIM-{model.name}-{index}" + (f"-{fleet_id}" if fleet_id else "")


def fleet_id(folder: Path) -> str:
    """The id of the simulated fleet whose state lives in `folder`: made once (8 random hex
    digits in folder/simulated-fleet-id), then read back. ValueError for a damaged file."""
    path = folder / FLEET_ID_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        folder.mkdir(parents=True, exist_ok=True)
        draft = folder / f".{FLEET_ID_FILE}.{os.getpid()}"
        draft.write_text(secrets.token_hex(4) + "\n")
        try:
            os.link(draft, path)  # only the first of two starting dispatchers makes it
        except FileExistsError:
            pass
        finally:
            draft.unlink()
        text = path.read_text().strip()
    if not _FLEET_ID.fullmatch(text):
        raise ValueError(
            f"{path} must hold 8 lowercase hex digits, got {text[:40]!r}; remove it to make a "
            "new one (the simulated GPUs then get new UUIDs and lose their reservations)"
        )
    return text


@dataclass(slots=True)
class _Gpu:
    index: int
    model: GpuModel
    uuid: str
    mig_enabled: bool
    usage: GpuUsage = field(default_factory=lambda: GpuUsage(0.0, 0))
    processes: dict[int, int] = field(default_factory=dict)  # pid -> used memory bytes
    instances: dict[str, MigInstance] = field(default_factory=dict)

    def info(self) -> GpuInfo:
        return GpuInfo(
            index=self.index,
            gpu_uuid=self.uuid,
            node="",
            model=self.model.name,
            memory_bytes=self.model.memory_bytes,
            sm_count=self.model.sm_count,
            mig_capable=self.model.mig_capable,
            mig_enabled=self.mig_enabled,
        )


class SimulatedBackend:
    """GPUs described by a fleet spec (or a list of models); thread-safe."""

    name = "simulated"

    def __init__(
        self,
        fleet: str | Sequence[GpuModel],
        *,
        mig_enabled: bool = False,
        time_scale: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        fleet_id: str = "",
    ) -> None:
        """`mig_enabled` is the starting MIG mode of the MIG-capable GPUs (a fleet spec turns
        it on per GPU with `:mig`); `time_scale` multiplies the MIG reconfiguration times (0:
        instant); `fleet_id` goes into every UUID (`fleet_id()`)."""
        if not (time_scale >= 0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale}")
        gpus = parse_fleet(fleet) if isinstance(fleet, str) else [(m, False) for m in fleet]
        if not gpus:
            raise ValueError("a simulated fleet needs at least one GPU")
        self._gpus = [
            _Gpu(
                i,
                m,
                simulated_uuid(m, i, fleet_id),
                mig_enabled=(mig_enabled or mig) and m.mig_capable,
            )
            for i, (m, mig) in enumerate(gpus)
        ]
        self._time_scale = time_scale
        self._sleep = sleep
        self._lock = threading.Lock()  # guards the state of every GPU
        # Serialises MIG reconfiguration, as the driver does (Table 1 times are sequential),
        # without holding _lock while an operation takes its time.
        self._mig_lock = threading.Lock()

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            return [gpu.info() for gpu in self._gpus]

    def gpu(self, index: int) -> GpuInfo:
        with self._lock:
            return self._get(index).info()

    def usage(self, index: int) -> GpuUsage:
        with self._lock:
            return self._get(index).usage

    def processes(self, index: int) -> list[GpuProcess]:
        with self._lock:
            gpu = self._get(index)
            return [GpuProcess(pid, used) for pid, used in sorted(gpu.processes.items())]

    def mig_instances(self, index: int) -> list[MigInstance]:
        with self._lock:
            gpu = self._get(index)
            return sorted(gpu.instances.values(), key=lambda i: i.first_slice)

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        with self._mig_lock, self._lock:
            gpu = self._get(index)
            if not gpu.model.mig_capable:
                raise FailedPrecondition(f"GPU {index} ({gpu.model.name}) is not MIG-capable")
            if not enabled and gpu.instances:
                raise FailedPrecondition(
                    f"GPU {index} still has {len(gpu.instances)} MIG instance(s); "
                    "destroy them before turning MIG off"
                )
            if gpu.mig_enabled != enabled:
                gpu.mig_enabled = enabled
                log.info("mig_mode_set", backend=self.name, gpu=index, enabled=enabled)

    def create_mig_instance(self, index: int, slices: int, first_slice: int) -> MigInstance:
        with self._mig_lock:
            with self._lock:
                gpu = self._get(index)
                self._require_mig(gpu)
                check_placement(gpu.model, slices, first_slice, gpu.instances.values())
                profile = mig_profile(gpu.model, slices)
            self._take(gpu.model.geometry().create_s(slices))
            instance = MigInstance(
                uuid=f"MIG-{gpu.uuid}-s{first_slice}-{slices}g",
                slices=slices,
                first_slice=first_slice,
                memory_bytes=profile.memory_bytes,
                profile_name=profile.name,
            )
            with self._lock:
                gpu.instances[instance.uuid] = instance
        log.info(
            "mig_instance_created",
            backend=self.name,
            gpu=index,
            uuid=instance.uuid,
            profile=profile.name,
            first_slice=first_slice,
        )
        return instance

    def destroy_mig_instance(self, index: int, uuid: str) -> None:
        with self._mig_lock:
            with self._lock:
                gpu = self._get(index)
                self._require_mig(gpu)
                instance = gpu.instances.get(uuid)
                if instance is None:
                    raise NotFound(f"GPU {index} has no MIG instance {uuid!r}")
            self._take(gpu.model.geometry().destroy_s(instance.slices))
            with self._lock:
                del gpu.instances[uuid]
        log.info("mig_instance_destroyed", backend=self.name, gpu=index, uuid=uuid)

    def close(self) -> None:
        """Nothing to release; here so the simulated backend is a drop-in for NVML's."""

    # Extra methods of the simulated backend: the dispatcher feeds it what a driver would see.

    def report_usage(self, index: int, utilization_percent: float, memory_used_bytes: int) -> None:
        with self._lock:
            gpu = self._get(index)
            if not 0 <= utilization_percent <= 100:
                raise InvalidArgument(
                    "utilization_percent", f"must be 0..100, got {utilization_percent}"
                )
            if not 0 <= memory_used_bytes <= gpu.model.memory_bytes:
                raise InvalidArgument(
                    "memory_used_bytes",
                    f"must be 0..{gpu.model.memory_bytes} on GPU {index}, got {memory_used_bytes}",
                )
            gpu.usage = GpuUsage(float(utilization_percent), memory_used_bytes)

    def attach_process(self, index: int, pid: int, used_memory_bytes: int) -> None:
        """Register a process on the GPU; attaching a pid again updates its memory."""
        if pid <= 0:
            raise InvalidArgument("pid", f"must be > 0, got {pid}")
        if used_memory_bytes < 0:
            raise InvalidArgument("used_memory_bytes", f"must be >= 0, got {used_memory_bytes}")
        with self._lock:
            self._get(index).processes[pid] = used_memory_bytes

    def detach_process(self, index: int, pid: int) -> None:
        with self._lock:
            if self._get(index).processes.pop(pid, None) is None:
                raise NotFound(f"process {pid} is not attached to GPU {index}")

    def _get(self, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            raise NotFound(
                f"no GPU with index {index}; the simulated fleet has {len(self._gpus)} "
                f"(0..{len(self._gpus) - 1})"
            )
        return self._gpus[index]

    def _require_mig(self, gpu: _Gpu) -> None:
        if not gpu.model.mig_capable:
            raise FailedPrecondition(f"GPU {gpu.index} ({gpu.model.name}) is not MIG-capable")
        if not gpu.mig_enabled:
            raise FailedPrecondition(f"MIG mode is off on GPU {gpu.index} ({gpu.model.name})")

    def _take(self, seconds: float) -> None:
        scaled = seconds * self._time_scale
        if scaled > 0:
            self._sleep(scaled)
