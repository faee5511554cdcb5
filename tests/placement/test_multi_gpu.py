"""Jobs on several whole GPUs and node resources, through the placement core (in-memory
dispatchers) and the live service (real dispatchers on simulated GPUs): a 2-GPU job is reserved
on both dispatchers of its node, all or none; a failed Reserve on the second releases the first
and the job waits; CPU and host memory are checked against what the node registered; asks the
fleet can never meet are refused naming the field; fleet policies place live jobs; a restart
rebuilds it all."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli
from gpuloom.clients.placement import JobFileError, file_key_for, spec_from_document
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import share_of
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.dispatcher.node_resources import host_cpu_milli, parse_meminfo
from gpuloom.services.placement.core import PlacementCore
from gpuloom.services.placement.decisions import GPU_UUIDS_VARIABLE
from gpuloom.v1 import common_pb2, placement_pb2
from tests.placement.conftest import Live, gpu_info, mps_spec, submit
from tests.placement.harness import CoreHarness
from tests.placement.test_client_cli import stdout_of

GIB = 1 << 30


def gpu(i: int, node: str, model: str = "A100-80GB", cpu: int = 16000) -> GpuInfo:
    return GpuInfo(
        f"GPU-{i}", node, model, 80 * GIB, 108, node_cpu_milli=cpu, node_memory_bytes=64 * GIB
    )


def whole(name: str, gpus: int, **kw) -> JobSpec:
    return JobSpec(name=name, kind=JobKind.TRAINING, share=share_of(), whole_gpus=gpus, **kw)


def share(name: str, **kw) -> JobSpec:
    return JobSpec(
        name=name,
        kind=JobKind.INFERENCE,
        share=share_of(30, 30, memory_bytes=4 * GIB),
        mps=True,
        **kw,
    )


def mig_task(**kw) -> JobSpec:
    return JobSpec(
        name="mig",
        kind=JobKind.BATCH,
        share=share_of(),
        mig_slices=1,
        task_key="k",
        command=("true",),
        **kw,
    )


async def settled(core, job_id: str, state: JobState):
    for _ in range(300):
        job = await core.get(job_id)
        if job.state is state:
            return job
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id} is {job.state}, not {state}")


async def register(core: PlacementCore, *gpus: GpuInfo) -> None:
    """`gpus` registered in order, the first behind the dispatcher at 10.0.0.1:50060, the
    next at 10.0.0.2, and so on."""
    for n, info in enumerate(gpus, start=1):
        await core.register_gpu(info, f"10.0.0.{n}:50060")


async def test_a_two_gpu_job_is_reserved_on_both_dispatchers_and_released_from_both(
    harness: CoreHarness,
) -> None:
    core = harness.core
    await register(core, gpu(0, "n1"), gpu(1, "n1"), gpu(2, "n2"))
    job = await core.submit("r", whole("pair", 2, cpu_milli=2000))
    assert job.state is JobState.ASSIGNED and job.binding is not None
    assert set(job.binding.gpu_uuids) == {"GPU-0", "GPU-1"}  # one node, both GPUs
    held = harness.dispatchers.held
    assert job.job_id in held["10.0.0.1:50060"] and job.job_id in held["10.0.0.2:50060"]
    assert job.binding.environment[GPU_UUIDS_VARIABLE] == ",".join(job.binding.gpu_uuids)
    assert core.inventory.fleet.node("n1").cpu_used == 2000
    # Both GPUs are taken whole: a share goes to the other node.
    other = await core.submit("s", share("small"))
    assert other.binding is not None and other.binding.gpu_uuid == "GPU-2"
    await core.cancel(job.job_id)
    for _ in range(100):
        if not (held["10.0.0.1:50060"] or held["10.0.0.2:50060"]):
            break
        await asyncio.sleep(0.01)
    assert not held["10.0.0.1:50060"] and not held["10.0.0.2:50060"]
    assert core.inventory.fleet.node("n1").cpu_used == 0
    core.inventory.fleet.verify()


async def test_a_failed_reserve_of_the_second_gpu_releases_the_first_and_the_job_waits(
    harness: CoreHarness,
) -> None:
    core = harness.core
    await register(core, gpu(0, "n1"), gpu(1, "n1"))
    harness.dispatchers.down.add("10.0.0.2:50060")
    job = await core.submit("r", whole("pair", 2))
    assert job.state is JobState.PENDING
    assert "binding on GPU GPU-1 failed" in job.pending_reason
    await asyncio.sleep(0.05)  # the release of the first is sent in the background
    assert job.job_id not in harness.dispatchers.held["10.0.0.1:50060"]
    fleet = core.inventory.fleet
    assert fleet.gpus_of(job.job_id) == () and not fleet.slot("GPU-0").allocations
    # The failed GPU's next heartbeat brings it back: the job is placed on both and bound.
    harness.dispatchers.down.clear()
    await core.heartbeat("GPU-1", 0.0, 0, [])
    bound = await settled(core, job.job_id, JobState.ASSIGNED)
    assert bound.binding is not None and set(bound.binding.gpu_uuids) == {"GPU-0", "GPU-1"}
    assert all(
        job.job_id in harness.dispatchers.held[a] for a in ("10.0.0.1:50060", "10.0.0.2:50060")
    )


async def test_asks_the_fleet_can_never_meet_are_refused_naming_the_field(
    harness: CoreHarness,
) -> None:
    core = harness.core
    v100m16 = [gpu(0, "n1", "V100M16"), gpu(1, "n1", "V100M16")]
    await register(core, *v100m16, gpu(2, "n2", "V100M32", cpu=4000))
    cases = [
        (whole("three", 3), "spec.resources.whole_gpus", "the most: 2"),
        (whole("two", 2, gpu_model="V100M32"), "spec.resources.whole_gpus", "the most: 1"),
        (share("cpu", cpu_milli=20_000), "spec.cpu_milli", "the most: 16000"),
        (share("mem", host_memory_bytes=65 * GIB), "spec.host_memory_bytes", "the most"),
        (share("model", gpu_model="V100M16|H100"), "spec.gpu_model", "unknown GPU model 'H100'"),
        (share("empty", gpu_model="V100M16|"), "spec.gpu_model", "alternatives"),
        (mig_task(policy="fgd"), "spec.policy", "not MIG batch tasks"),
        (mig_task(cpu_milli=100), "spec.cpu_milli", "no node resources"),
    ]
    for spec_, field, text in cases:
        with pytest.raises(InvalidArgument) as caught:
            await core.submit(f"r-{spec_.name}", spec_)
        assert caught.value.field == field and text in caught.value.message, caught.value
    assert not core.jobs.live  # nothing was kept
    # Alternatives admit either model; a CPU ask goes to the node that has it.
    either = await core.submit("either", share("either", gpu_model="V100M32|V100M16"))
    assert either.state is JobState.ASSIGNED
    busy = await core.submit("busy", share("busy", cpu_milli=10_000))
    assert busy.binding is not None and busy.binding.node == "n1"
    waits = await core.submit("waits", share("waits", cpu_milli=10_000))
    assert waits.state is JobState.PENDING and "10000 milli CPU" in waits.pending_reason


async def test_a_job_restricted_to_nodes_waits_for_them_and_keeps_them_across_a_restart(
    tmp_path: Path,
) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    await register(core, gpu(0, "n1"), gpu(1, "n2"))
    hold = await core.submit("hold", whole("hold", 1, nodes=("n2",)))
    assert hold.binding is not None and hold.binding.node == "n2"
    waits = await core.submit("waits", share("waits", nodes=("n2", "n9")))
    assert waits.state is JobState.PENDING and "n2" in waits.pending_reason
    for spec_, field in (
        (share("twice", nodes=("n1", "n1")), "spec.nodes"),
        (share("empty", nodes=("n1", "")), "spec.nodes[1]"),
        (mig_task(nodes=("n1",)), "spec.nodes"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            await core.submit(f"r-{spec_.name}", spec_)
        assert caught.value.field == field, caught.value
    await h.stop()
    core = await h.start()  # the restriction is stored with the job
    await register(core, gpu(0, "n1"), gpu(1, "n2"))
    assert (await core.get(waits.job_id)).spec.nodes == ("n2", "n9")
    await core.cancel(hold.job_id)
    moved = await settled(core, waits.job_id, JobState.ASSIGNED)
    assert moved.binding is not None and moved.binding.node == "n2"
    await h.stop()


@pytest.mark.parametrize("policy", ["fgd", "best", "bestfit"])
async def test_fleet_policies_place_live_jobs_and_a_restart_rebuilds_gangs(
    tmp_path: Path, policy: str
) -> None:
    h = CoreHarness(tmp_path)
    core = await h.start()
    for i in range(4):
        await core.register_gpu(gpu(i, f"n{i // 2}"), f"10.0.0.{i}:50060")
    pair = await core.submit("pair", whole("pair", 2, policy=policy, cpu_milli=1000))
    small = await core.submit("small", share("small", policy=policy))
    assert pair.state is JobState.ASSIGNED and pair.policy == policy
    assert small.state is JobState.ASSIGNED and small.binding is not None
    assert small.binding.node != pair.binding.node  # the pair took its node whole
    await h.stop()
    core = await h.start()
    fleet = core.inventory.fleet
    fleet.verify()
    assert fleet.gpus_of(pair.job_id) == pair.binding.gpu_uuids
    assert fleet.node(pair.binding.node).cpu_used == 1000
    await h.stop()


# ---- the live service and `gpuloom run` ----


def test_the_dispatcher_reads_its_node_from_the_host() -> None:
    assert parse_meminfo("MemFree: 1 kB\nMemTotal:  16384 kB\n") == 16 << 20
    assert parse_meminfo("nothing here\n") == 0
    assert host_cpu_milli() == len(os.sched_getaffinity(0)) * 1000


async def register_with_node(live: Live, app: DispatcherApp, cpu: int) -> None:
    for index, dispatcher in enumerate(app.dispatchers):
        info = gpu_info(app, index)
        info.node_cpu_milli = cpu
        info.node_memory_bytes = 64 * GIB
        await live.stub.RegisterGpu(
            placement_pb2.RegisterGpuRequest(
                gpu=info, dispatcher_address=f"127.0.0.1:{dispatcher.port}"
            )
        )


async def test_a_two_gpu_job_binds_on_two_real_dispatchers(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_with_node(placement, dispatchers, 6000)
    spec = mps_spec("pair", memory_gib=1)
    spec.resources.whole_gpus = 2
    spec.cpu_milli = 4000
    job = await submit(placement.stub, spec)
    assert job.state == placement_pb2.JOB_STATE_ASSIGNED
    uuids = [job.assignment.gpu.gpu_uuid, *(g.gpu.gpu_uuid for g in job.assignment.extra_gpus)]
    assert len(set(uuids)) == 2 and job.spec.cpu_milli == 4000
    holders = {
        d.core.gpu.gpu_uuid: job.job_id in {r.assignment_id for r in d.core.book.all()}
        for d in dispatchers.dispatchers
    }
    assert {uuid for uuid, holds in holders.items() if holds} == set(uuids)
    assert job.assignment.environment[GPU_UUIDS_VARIABLE] == ",".join(uuids)
    # The node's CPU is held: a second such job waits, naming it.
    second = await submit(placement.stub, spec)
    assert second.state == placement_pb2.JOB_STATE_PENDING
    assert "4000 milli CPU" in second.pending_reason
    listed = await placement.stub.ListGpus(placement_pb2.ListGpusRequest())
    assert {g.gpu.node_cpu_milli for g in listed.gpus} == {6000}
    too_many = mps_spec("five")
    too_many.resources.CopyFrom(common_pb2.Resources(whole_gpus=5))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await submit(placement.stub, too_many)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("spec.resources.whole_gpus: 5 GPUs on one node")


PRINT_GPUS = "import os; print(os.environ['GPULOOM_GPU_UUIDS'])"


async def test_gpuloom_run_gets_every_gpu_of_its_job(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_with_node(placement, dispatchers, 8000)
    target = f"--placement=127.0.0.1:{placement.app.port}"
    args = ["run", target, "--no-shim", "--gpus", "2", "--cpu-milli", "1500"]
    args += ["--host-memory-gib", "2", "--gpu-spec", "A100-80GB"]
    result = await asyncio.to_thread(
        CliRunner().invoke, cli, [*args, "--", sys.executable, "-c", PRINT_GPUS]
    )
    assert result.exit_code == 0, result.output
    listed = await placement.stub.ListJobs(placement_pb2.ListJobsRequest())
    (job,) = listed.jobs
    uuids = [job.assignment.gpu.gpu_uuid, *(g.gpu.gpu_uuid for g in job.assignment.extra_gpus)]
    assert stdout_of(result).strip() == ",".join(uuids) and len(set(uuids)) == 2
    assert job.spec.resources.whole_gpus == 2 and job.spec.cpu_milli == 1500
    assert job.spec.host_memory_bytes == 2 * GIB and job.spec.gpu_model == "A100-80GB"
    assert f"on GPUs {', '.join(uuids)} on node n1: 2 GPUs" in result.stderr
    # `--gpus` is for whole GPUs: with a share it is a usage error (exit 2), nothing submitted.
    bad = await asyncio.to_thread(
        CliRunner().invoke, cli, ["run", target, "--gpus", "2", "--sm", "20", "--", "true"]
    )
    assert bad.exit_code == 2 and "--gpus excludes --sm" in bad.output
    # Asking for more GPUs than the node has is refused by placement, naming the option.
    many = await asyncio.to_thread(
        CliRunner().invoke, cli, ["run", target, "--no-shim", "--gpus", "8", "--", "true"]
    )
    assert many.exit_code == 1 and "--gpus: refused by placement" in many.output


def test_a_job_file_asks_for_gpus_cpu_host_memory_and_a_gpu_spec() -> None:
    document = {
        "name": "train",
        "kind": "training",
        "gpu_spec": "V100M16|V100M32",
        "resources": {"whole_gpus": 4, "cpu_milli": 16000, "host_memory_gib": 32},
    }
    spec = spec_from_document(document, "job.yaml")
    assert (spec.resources.whole_gpus, spec.cpu_milli) == (4, 16000)
    assert spec.host_memory_bytes == 32 * GIB and spec.gpu_model == "V100M16|V100M32"
    with pytest.raises(JobFileError, match="gpu_model or gpu_spec"):
        spec_from_document({**document, "gpu_model": "T4"}, "job.yaml")
    with pytest.raises(JobFileError, match=r"resources\.cpu_milli"):
        spec_from_document({**document, "resources": {"cpu_milli": "lots"}}, "job.yaml")
    assert file_key_for("spec.host_memory_bytes") == "resources.host_memory_gib"
