"""Placement reading profiles from a real profile store: FaST-GShare auto-scaling from a
throughput profile, and gap-aware pairing from kernel profiles."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner, Result

from gpuloom.clients.cli import cli
from gpuloom.domain import profiles as d
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.v1 import placement_pb2
from tests.placement.conftest import Live, mps_spec, register_all, start_placement, submit
from tests.placement.test_client_cli import SERVICE_LOG
from tests.profile_store.samples import throughput_profile

MODEL = "A100-80GB"


@pytest.fixture
async def placement(store: ProfileStoreApp, tmp_path: Path) -> AsyncIterator[Live]:
    settings = PlacementSettings(
        port=0,
        database_url=f"sqlite:///{tmp_path / 'placement.db'}",
        profile_store_address=f"127.0.0.1:{store.port}",
    )
    live = await start_placement(settings, tmp_path)
    yield live
    await live.stop()


def throughput(function: str) -> d.ThroughputProfile:
    # requests/s per (SM % x quota %): (12, 40) is the most efficient configuration.
    points = (
        d.ThroughputPoint(12, 40.0, 100.0, 8.0, 20.0),
        d.ThroughputPoint(24, 40.0, 180.0, 6.0, 15.0),
        d.ThroughputPoint(50, 60.0, 400.0, 3.0, 8.0),
    )
    return throughput_profile(function, MODEL, points)


def load(function: str, rps: float) -> placement_pb2.SetFunctionLoadRequest:
    template = mps_spec("resnet-replica", memory_gib=2, priority=1)
    template.gpu_model = MODEL
    return placement_pb2.SetFunctionLoadRequest(
        function=function, requests_per_s=rps, template=template
    )


async def test_function_load_scales_replicas_up_and_down_with_algorithm_1(
    placement: Live, store: ProfileStoreApp, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    await store.store.put(throughput("resnet"), None)
    up = await placement.stub.SetFunctionLoad(load("resnet", 350))
    # floor(350 / 100) = 3 replicas of the most efficient (12 %, 40 %), plus one minimal one
    # covering the last 50 requests/s: the same configuration.
    assert len(up.added) == 4 and not up.removed
    assert {
        (j.spec.resources.mps.sm_percent, j.spec.resources.mps.quota.request_percent)
        for j in up.added
    } == {(12, 40.0)}
    assert all(
        j.state == placement_pb2.JOB_STATE_ASSIGNED and j.function == "resnet" for j in up.added
    )
    assert up.capacity_requests_per_s == pytest.approx(400)
    assert up.most_efficient.sm_percent == 12
    replicas = await placement.stub.ListJobs(placement_pb2.ListJobsRequest(function="resnet"))
    assert len(replicas.jobs) == 4

    down = await placement.stub.SetFunctionLoad(load("resnet", 150))
    assert len(down.removed) == 2 and not down.added
    assert all(j.state == placement_pb2.JOB_STATE_CANCELLED for j in down.removed)
    assert down.capacity_requests_per_s == pytest.approx(200)
    live = await placement.stub.ListJobs(
        placement_pb2.ListJobsRequest(function="resnet", states=[placement_pb2.JOB_STATE_ASSIGNED])
    )
    assert len(live.jobs) == 2

    same = await placement.stub.SetFunctionLoad(load("resnet", 150))
    assert not same.added and not same.removed


async def test_scaling_a_function_without_a_profile_is_refused(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await placement.stub.SetFunctionLoad(load("unprofiled", 100))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no throughput profile" in (caught.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await placement.stub.SetFunctionLoad(load("resnet", -1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = load("resnet", 100)
    bad.template.priority.level = 12
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await placement.stub.SetFunctionLoad(bad)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("template.priority.level")
    bad = load("resnet", 100)
    bad.template.resources.memory_bytes = 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await placement.stub.SetFunctionLoad(bad)
    assert (caught.value.details() or "").startswith("template.resources.memory_bytes")


def kernels(key: str, duration_ns: float, gap_ns: float, n: int = 20) -> d.KernelProfile:
    return d.KernelProfile(
        key=key,
        gpu_model=MODEL,
        measured_runs=1,
        kernels=tuple(
            d.KernelStats(
                kernel_id=i + 1,
                name=f"{key}_kernel_{i}",
                grid=d.Dim3(1, 1, 1),
                block=d.Dim3(32, 1, 1),
                sample_count=1,
                mean_duration_ns=duration_ns,
                p50_duration_ns=duration_ns,
                p95_duration_ns=duration_ns,
                mean_gap_after_ns=gap_ns,
            )
            for i in range(n)
        ),
    )


async def test_gap_aware_puts_a_low_priority_job_beside_the_holder_with_the_most_idle_time(
    placement: Live, store: ProfileStoreApp, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    # Two high-priority holders: "busy" leaves no gaps, "gappy" idles 2 ms after each kernel.
    await store.store.put(kernels("busy", 1_000_000, 0), None)
    await store.store.put(kernels("gappy", 1_000_000, 2_000_000), None)
    await store.store.put(kernels("filler", 500_000, 0), None)
    holders = {}
    for key in ("busy", "gappy"):
        job = await submit(
            placement.stub, mps_spec(key, 50, 50, priority=0, task_key=key, policy="spread")
        )
        holders[key] = job.assignment.gpu.gpu_uuid
    assert holders["busy"] != holders["gappy"]
    filler = await submit(
        placement.stub,
        mps_spec("filler", 20, 20, priority=8, task_key="filler", policy="gap-aware"),
    )
    assert filler.state == placement_pb2.JOB_STATE_ASSIGNED
    assert filler.policy == "gap-aware"
    assert filler.assignment.gpu.gpu_uuid == holders["gappy"]


TEMPLATE = """\
name: resnet-replica
kind: inference
priority: 1
gpu_model: A100-80GB
resources: {memory_gib: 2}
"""


async def test_gpuloom_scale_sets_the_load_from_a_template_file(
    placement: Live, store: ProfileStoreApp, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    await store.store.put(throughput("resnet"), None)
    template = tmp_path / "replica.yaml"
    template.write_text(TEMPLATE)
    where = f"--placement=127.0.0.1:{placement.app.port}"

    def scale(*args: str) -> Result:
        return CliRunner().invoke(cli, ["scale", *args, where], prog_name="gpuloom")

    up = await asyncio.to_thread(scale, "resnet", "350", "--template", str(template))
    assert up.exit_code == 0, up.output
    lines = [line for line in up.stdout.splitlines() if not SERVICE_LOG.match(line)]
    assert lines[0] == (
        "function resnet: 4 replicas added, 0 removed; they serve 400 requests/s "
        "(most efficient: SM 12%, quota 40%, 100 requests/s each)"
    )
    assert len([line for line in lines if line.startswith("added    job j-")]) == 4
    replicas = await placement.stub.ListJobs(placement_pb2.ListJobsRequest(function="resnet"))
    assert len(replicas.jobs) == 4
    assert all(
        j.spec.priority.level == 1 and j.spec.name == "resnet-replica" for j in replicas.jobs
    )

    down = await asyncio.to_thread(scale, "resnet", "150", "--template", str(template), "--json")
    assert down.exit_code == 0, down.output
    printed = [line for line in down.stdout.splitlines() if not SERVICE_LOG.match(line)]
    answer = json.loads("\n".join(printed))
    assert len(answer["removed"]) == 2 and answer["added"] == []
    assert answer["capacity_requests_per_s"] == pytest.approx(200)
    assert answer["most_efficient"]["sm_percent"] == 12

    template.write_text(TEMPLATE.replace("priority: 1", "priority: high"))
    bad = await asyncio.to_thread(scale, "resnet", "150", "--template", str(template))
    assert bad.exit_code == 2 and "priority" in bad.stderr and len(bad.stderr.splitlines()) == 1
    template.write_text(TEMPLATE)
    unprofiled = await asyncio.to_thread(scale, "nobody", "10", "--template", str(template))
    assert unprofiled.exit_code == 1 and "no throughput profile" in unprofiled.stderr
