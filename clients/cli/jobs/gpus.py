"""`gpuloom gpus`: the registered GPUs, what is reserved on each and how busy it is."""

from __future__ import annotations

import json

import click

from gpuloom.clients.cli.addresses import placement_option
from gpuloom.clients.cli.jobs.common import (
    echo_json_or_nothing,
    json_option,
    memory_text,
    placement_client,
)
from gpuloom.clients.cli.table import echo_table
from gpuloom.convert import placement as convert
from gpuloom.domain.placement import GpuEntry


@click.command("gpus")
@click.option("--node", default="", help="Only the GPUs of this node.")
@placement_option
@json_option
def gpus(node: str, address: str, as_json: bool) -> None:
    """List the registered GPUs: what is reserved on each and how busy it is."""
    with placement_client(address) as client:
        found = list(client.gpus(node))
    if echo_json_or_nothing(found, _gpu_json, as_json, "no GPUs registered"):
        return
    headers = [
        "NODE",
        "UUID",
        "MODEL",
        "MEMORY",
        "STATUS",
        "JOBS",
        "DIRECT",
        "AREA %",
        "MEM RESERVED",
        "NODE CPU",
        "NODE MEM",
    ]
    rows = [
        (
            g.gpu.node,
            g.gpu.gpu_uuid,
            g.gpu.model,
            memory_text(g.gpu.memory_bytes),
            "lost" if g.lost else "schedulable" if g.schedulable else "unschedulable",
            g.jobs,
            g.direct_reservations,
            g.area_reserved_percent,
            memory_text(g.memory_reserved_bytes),
            f"{g.gpu.node_cpu_milli / 1000:g}" if g.gpu.node_cpu_milli else "-",
            memory_text(g.gpu.node_memory_bytes),
            g.utilization_percent,
        )
        for g in found
    ]
    echo_table([*headers, "UTIL %"], rows)


def _gpu_json(entry: GpuEntry) -> str:
    return json.dumps(convert.gpu_entry_json(entry))
