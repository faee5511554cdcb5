"""Replicas of a shared model through the services: real dispatchers (simulated GPUs, the model
store on the fake driver) report what their store holds to a real placement service, which
binds replicas where their model is resident with the reduced memory cap; the dispatcher's
book accepts them because the weights are charged once, to its store. A report that makes no
sense is refused naming the field, and changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from gpuloom.clients.models import save_weights
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import share_of
from gpuloom.services.dispatcher.app import (
    DispatcherApp,
    GpuDispatcher,
    _stop,
    start_gpu_dispatcher,
)
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc
from gpuloom.v1 import placement_pb2 as pb
from tests.dispatcher.conftest import dispatcher_settings
from tests.placement.conftest import (
    GIB,
    Live,
    gpu_info,
    mps_spec,
    start_placement,
    submit,
)
from tests.placement.harness import CoreHarness
from tests.shim.conftest import shim_build  # noqa: F401  (fixture: builds the fake driver)


@dataclass
class Plane:
    placement: Live
    dispatchers: list[GpuDispatcher]
    stubs: list[dispatcher_pb2_grpc.DispatcherStub]
    channels: list[grpc.aio.Channel]

    def uuid(self, index: int) -> str:
        return self.dispatchers[index].core.gpu.gpu_uuid

    async def entry(self, index: int) -> pb.GpuEntry:
        gpus = (await self.placement.stub.ListGpus(pb.ListGpusRequest())).gpus
        return next(g for g in gpus if g.gpu.ref.gpu_uuid == self.uuid(index))

    async def until(self, what: str, check, timeout_s: float = 15.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not await check():
                await asyncio.sleep(0.02)


@pytest.fixture
async def plane(
    short_dir: Path,
    shim_build: Path,  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Plane]:
    """Placement (SQLite) and two A100-80GB dispatchers linked to it, each with a model store
    that may load from `short_dir/models`."""
    models = short_dir / "models"
    models.mkdir()
    rng = np.random.default_rng(0)
    save_weights(models / "net.safetensors", {"w": rng.standard_normal((256, 64)).astype("f4")})
    monkeypatch.setenv("GPULOOM_FAKE_CUDA_DIR", str(short_dir / "fake"))
    settings = PlacementSettings(
        port=0,
        database_url=f"sqlite:///{short_dir / 'placement.db'}",
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=30,
    )
    live = await start_placement(settings, short_dir)
    backend = SimulatedBackend("2xA100-80GB")
    started: list[GpuDispatcher] = []
    channels: list[grpc.aio.Channel] = []
    try:
        for index in range(2):
            dispatcher = await start_gpu_dispatcher(
                dispatcher_settings(
                    placement_address=f"127.0.0.1:{live.app.port}",
                    node="n1",
                    models_dir=models,
                    cuda_library=str(shim_build / "fake" / "libcuda.so.1"),
                ),
                backend,
                backend.gpu(index),
                "127.0.0.1",
                0,
                short_dir / f"gpu{index}",
            )
            started.append(dispatcher)
            channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{dispatcher.port}"))
        plane = Plane(
            live, started, [dispatcher_pb2_grpc.DispatcherStub(c) for c in channels], channels
        )

        async def registered() -> bool:
            return len((await live.stub.ListGpus(pb.ListGpusRequest())).gpus) == 2

        await plane.until("both GPUs registered", registered)
        yield plane
    finally:
        for channel in channels:
            await channel.close()
        for dispatcher in started:
            await _stop(dispatcher, 0)
        await live.stop()


def replica(name: str, memory_bytes: int, model: str = "net") -> pb.JobSpec:
    spec = mps_spec(name, sm=10, quota=10)
    spec.resources.memory_bytes = memory_bytes
    spec.shared_model = model
    return spec


async def assigned(live: Live, job_id: str) -> pb.Job:
    async with asyncio.timeout(15):
        while True:
            job = await live.stub.GetJob(pb.GetJobRequest(job_id=job_id))
            if job.state == pb.JOB_STATE_ASSIGNED:
                return job
            assert job.state in (pb.JOB_STATE_PENDING, pb.JOB_STATE_BINDING), job
            await asyncio.sleep(0.02)


async def test_replicas_are_bound_beside_their_model_with_the_weights_charged_once(
    plane: Plane,
) -> None:
    # The model goes to the second GPU: left alone, MRA's tie-break would pick the first.
    loaded = await plane.stubs[1].LoadModel(
        dispatcher_pb2.LoadModelRequest(name="net", path="net.safetensors")
    )
    weights = loaded.model.bytes
    assert loaded.loaded and weights > 0

    async def reported() -> bool:  # the store's bytes are used memory of that GPU now
        return (await plane.entry(1)).memory_reserved_bytes == weights

    await plane.until("the store's model in placement's inventory", reported)

    # Two replicas of half the GPU and half the weights fill it beside one copy of the
    # weights: each is charged its footprint less the weights. Charged in full, the second
    # would not fit there.
    memory = plane.dispatchers[1].core.gpu.memory_bytes
    half = (memory + weights) // 2
    first = await assigned(
        plane.placement, (await submit(plane.placement.stub, replica("r1", half))).job_id
    )
    second = await assigned(
        plane.placement, (await submit(plane.placement.stub, replica("r2", half))).job_id
    )
    for job in (first, second):
        assert job.assignment.gpu.gpu_uuid == plane.uuid(1)
        assert job.assignment.memory_cap_bytes == half - weights
    full = weights + 2 * (half - weights)
    assert memory - weights < full <= memory
    status = await plane.stubs[1].GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert status.memory_reserved_bytes == full  # the book: the store + two reduced caps
    assert (await plane.entry(1)).memory_reserved_bytes == full  # placement agrees

    # No room beside the model any more: the third goes to the other GPU, charged in full.
    third = await assigned(
        plane.placement, (await submit(plane.placement.stub, replica("r3", half))).job_id
    )
    assert third.assignment.gpu.gpu_uuid == plane.uuid(0)
    assert third.assignment.memory_cap_bytes == half
    # A job that is no replica is charged in full as well.
    plain = await assigned(
        plane.placement,
        (await submit(plane.placement.stub, mps_spec("p", 10, 10, memory_gib=1))).job_id,
    )
    assert plain.assignment.memory_cap_bytes == 1 * GIB

    # Unloaded (forced: the replicas never attached a process here), the bytes are given back
    # in placement's inventory too, with the next heartbeat.
    await plane.stubs[1].UnloadModel(dispatcher_pb2.UnloadModelRequest(name="net", force=True))

    async def gone() -> bool:
        return (await plane.entry(1)).memory_reserved_bytes == full - weights

    await plane.until("the unloaded model gone from placement's inventory", gone)


async def test_a_job_file_names_the_shared_model_and_a_bad_name_is_refused(plane: Plane) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(plane.placement.stub, replica("bad", 4 * GIB, model="no spaces"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.shared_model" in caught.value.details()
    # A model no store holds: placed as any job, charged in full.
    job = await assigned(
        plane.placement,
        (await submit(plane.placement.stub, replica("r", 4 * GIB, model="absent"))).job_id,
    )
    assert job.assignment.memory_cap_bytes == 4 * GIB
    got = await plane.placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert got.spec.shared_model == "absent"


@pytest.mark.parametrize(
    ("models", "field", "words"),
    [
        ([pb.ResidentModel(name="", bytes=1)], "models[0].name", "1..128"),
        ([pb.ResidentModel(name="a b", bytes=1)], "models[0].name", "1..128"),
        ([pb.ResidentModel(name="m", bytes=0)], "models[0].bytes", "1..2**63-1"),
        (
            [pb.ResidentModel(name="m", bytes=1), pb.ResidentModel(name="m", bytes=2)],
            "models[1].name",
            "twice",
        ),
        ([pb.ResidentModel(name="m", bytes=81 * GIB)], "models", "more than the GPU"),
        ([pb.ResidentModel(name=f"m{i}", bytes=1) for i in range(257)], "models", "at most 256"),
    ],
)
async def test_a_store_report_that_makes_no_sense_is_refused_naming_the_field(
    placement: Live,
    dispatchers: DispatcherApp,
    models: list[pb.ResidentModel],
    field: str,
    words: str,
) -> None:
    info = gpu_info(dispatchers, 0)
    address = f"127.0.0.1:{dispatchers.dispatchers[0].port}"
    good = [pb.ResidentModel(name="net", bytes=2 * GIB)]
    await placement.stub.RegisterGpu(
        pb.RegisterGpuRequest(gpu=info, dispatcher_address=address, models=good)
    )
    before = (await placement.stub.ListGpus(pb.ListGpusRequest())).gpus[0]
    assert before.memory_reserved_bytes == 2 * GIB
    for call in (
        placement.stub.RegisterGpu(
            pb.RegisterGpuRequest(gpu=info, dispatcher_address=address, models=models)
        ),
        placement.stub.Heartbeat(pb.HeartbeatRequest(gpu_uuid=info.ref.gpu_uuid, models=models)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(field) and words in caught.value.details()
    after = (await placement.stub.ListGpus(pb.ListGpusRequest())).gpus[0]
    assert after == before  # nothing changed, not even the heartbeat's time


async def test_a_restart_keeps_the_reduced_charge_and_the_store_returns_with_a_heartbeat(
    tmp_path: Path,
) -> None:
    harness = CoreHarness(tmp_path)
    core = await harness.start()
    await core.register_gpu(
        GpuInfo("GPU-0", "node-0", "A100-80GB", 16 * GIB), "10.0.0.1:50060", (), (("net", 6 * GIB),)
    )
    spec = JobSpec(
        name="r",
        kind=JobKind.INFERENCE,
        share=share_of(10, 10, memory_bytes=8 * GIB),
        mps=True,
        shared_model="net",
    )
    job = await core.submit("req-1", spec)
    assert job.binding is not None and job.binding.share.memory_bytes == 2 * GIB
    async with asyncio.timeout(10):
        while (await core.get(job.job_id)).state is not JobState.ASSIGNED:
            await asyncio.sleep(0.01)
    assert harness.dispatchers.held["10.0.0.1:50060"][job.job_id].share.memory_bytes == 2 * GIB
    await harness.stop()

    core = await harness.start()  # the fleet from the stored bindings: the reduced charge
    fleet = core.inventory.fleet
    assert fleet.allocation(job.job_id).memory_bytes == 2 * GIB
    assert fleet.slot("GPU-0").memory_free == 14 * GIB  # the store is not stored
    await core.heartbeat("GPU-0", 0.0, 0, [job.job_id], (), (("net", 6 * GIB),))
    assert fleet.slot("GPU-0").memory_free == 8 * GIB and fleet.resident("net") == ["GPU-0"]
    fleet.verify()
    await harness.stop()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"shared_model": "net\n"}, "1..128 characters"),
        ({"shared_model": "x" * 129}, "1..128 characters"),
        (
            {
                "shared_model": "net",
                "share": share_of(memory_bytes=GIB),
                "mps": False,
                "mig_slices": 1,
                "kind": JobKind.BATCH,
                "task_key": "t",
                "command": ("true",),
            },
            "MIG batch task",
        ),
    ],
)
def test_a_shared_model_the_store_could_not_hold_or_on_a_mig_task_is_refused(
    changes: dict, words: str
) -> None:
    spec = JobSpec(
        name="r", kind=JobKind.INFERENCE, share=share_of(10, 10, memory_bytes=GIB), mps=True
    )
    spec.validate(["mra"])
    with pytest.raises(InvalidArgument) as caught:
        replace(spec, **changes).validate(["mra"])
    assert caught.value.field == "spec.shared_model" and words in caught.value.message
