"""What this dispatcher's node offers jobs besides GPUs, as placement is told at registration:
CPU in thousandths of a core and memory in bytes, read from the host unless the settings give
them (GPULOOM_DISPATCHER_NODE_CPU_MILLI, GPULOOM_DISPATCHER_NODE_MEMORY_BYTES)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True, slots=True)
class NodeResources:
    cpu_milli: int
    memory_bytes: int


def host_cpu_milli() -> int:
    """The CPUs this process may run on (its affinity, as a container's cpuset limits it)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 0
    return count * 1000


def parse_meminfo(text: str) -> int:
    """MemTotal of a /proc/meminfo text, in bytes; 0 when it has none."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemTotal":
            parts = rest.split()
            if parts and parts[0].isdigit():
                unit = parts[1].lower() if len(parts) > 1 else ""
                return int(parts[0]) * (1024 if unit == "kb" else 1)
    return 0


def host_memory_bytes(meminfo: Path = MEMINFO) -> int:
    try:
        return parse_meminfo(meminfo.read_text())
    except OSError:
        return 0


def node_resources(cpu_milli: int | None, memory_bytes: int | None) -> NodeResources:
    """The settings' figures where given, the host's otherwise."""
    return NodeResources(
        host_cpu_milli() if cpu_milli is None else cpu_milli,
        host_memory_bytes() if memory_bytes is None else memory_bytes,
    )


NONE_REPORTED = NodeResources(0, 0)  # a link told nothing of its node (tests)
