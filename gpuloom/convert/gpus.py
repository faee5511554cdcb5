"""A GPU's description, in the fields two messages share: placement's GpuInfo (a dispatcher's
registration) and the dispatcher's GpuDescription (GetGpuStatus, SetMigMode) both open with the
GPU's reference, model, memory, SMs and MIG mode. Each message's converter adds its own."""

from __future__ import annotations

from typing import Any

from gpuloom.domain.gpus import GpuInfo
from gpuloom.v1 import common_pb2, dispatcher_pb2, placement_pb2

GpuMessage = placement_pb2.GpuInfo | dispatcher_pb2.GpuDescription


def gpu_fields(gpu: GpuInfo) -> dict[str, Any]:
    """The shared fields of `gpu`: `Message(**gpu_fields(gpu), ...)`."""
    return {
        "ref": common_pb2.GpuRef(node=gpu.node, gpu_uuid=gpu.gpu_uuid),
        "model": gpu.model,
        "memory_bytes": gpu.memory_bytes,
        "sm_count": gpu.sm_count,
        "mig_capable": gpu.mig_capable,
        "mig_enabled": gpu.mig_enabled,
    }


def gpu_from_fields(msg: GpuMessage, **more: Any) -> GpuInfo:
    """The GPU a message describes, from the shared fields and the message's own (`more`)."""
    return GpuInfo(
        gpu_uuid=msg.ref.gpu_uuid,
        node=msg.ref.node,
        model=msg.model,
        memory_bytes=msg.memory_bytes,
        sm_count=msg.sm_count,
        mig_capable=msg.mig_capable,
        mig_enabled=msg.mig_enabled,
        **more,
    )
