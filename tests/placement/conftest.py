"""A live placement service in the test process (SQLite or a fresh PostgreSQL schema) and real
dispatchers on simulated GPUs for it to bind on."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import prometheus_client
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.v1 import common_pb2, placement_pb2, placement_pb2_grpc
from tests.conftest import POSTGRES_URL
from tests.placement.harness import CoreHarness
from tests.polling import eventually  # noqa: F401 (the placement tests' import)

GIB = 1 << 30


class PostgresSchema:
    """A uniquely named, empty schema on the test PostgreSQL, dropped afterwards."""

    def __init__(self) -> None:
        self.name = f"gpuloom_placement_{uuid.uuid4().hex[:12]}"

    async def drop(self) -> None:
        admin = create_async_engine(POSTGRES_URL)
        async with admin.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE'))
        await admin.dispose()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ProfileStoreApp]:
    """A profile store on SQLite in tmp_path."""
    settings = ProfileStoreSettings(port=0, database_url=f"sqlite:///{tmp_path / 'profiles.db'}")
    app = await ProfileStoreApp.start(settings, "127.0.0.1", tmp_path)
    yield app
    await app.stop(0)


@pytest.fixture
def harness_class() -> type[CoreHarness]:
    """The harness `harness` starts; a test module overrides it for a subclass of its own."""
    return CoreHarness


@pytest.fixture
async def harness(tmp_path: Path, harness_class: type[CoreHarness]) -> AsyncIterator[CoreHarness]:
    """A started placement core (tests/placement/harness.py): SQLite, fake dispatchers."""
    async with harness_class(tmp_path) as h:
        yield h


@pytest.fixture(params=["sqlite", "postgres"])
async def placement_settings(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[PlacementSettings]:
    if request.param == "sqlite":
        yield PlacementSettings(port=0, database_url=f"sqlite:///{tmp_path / 'placement.db'}")
        return
    schema = PostgresSchema()
    yield PlacementSettings(port=0, database_url=POSTGRES_URL, database_schema=schema.name)
    await schema.drop()


@dataclass
class Live:
    app: PlacementApp
    stub: placement_pb2_grpc.PlacementStub
    channel: grpc.aio.Channel

    async def stop(self) -> None:
        await self.channel.close()
        await self.app.stop(0)


async def start_placement(settings: PlacementSettings, data_dir: Path) -> Live:
    app = await PlacementApp.start(settings, "127.0.0.1", data_dir)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    return Live(app, placement_pb2_grpc.PlacementStub(channel), channel)


@pytest.fixture
async def placement(placement_settings: PlacementSettings, tmp_path: Path) -> AsyncIterator[Live]:
    live = await start_placement(placement_settings, tmp_path)
    yield live
    await live.stop()


@pytest.fixture
async def dispatchers(short_dir: Path) -> AsyncIterator[DispatcherApp]:
    """Four simulated A100-80GB GPUs, each with its dispatcher on its own port."""
    settings = DispatcherSettings(port=0, backend="simulated", sim_gpus="4xA100-80GB", node="n1")
    app = await DispatcherApp.start(settings, "127.0.0.1", short_dir)
    yield app
    await app.stop(0)


def gpu_info(app: DispatcherApp, index: int) -> placement_pb2.GpuInfo:
    gpu = app.dispatchers[index].core.gpu
    return placement_pb2.GpuInfo(
        ref=common_pb2.GpuRef(node=app.dispatchers[index].core.node, gpu_uuid=gpu.gpu_uuid),
        model=gpu.model,
        memory_bytes=gpu.memory_bytes,
        sm_count=gpu.sm_count,
        mps_enabled=True,
    )


async def register_all(stub: placement_pb2_grpc.PlacementStub, app: DispatcherApp) -> None:
    for index, dispatcher in enumerate(app.dispatchers):
        await stub.RegisterGpu(
            placement_pb2.RegisterGpuRequest(
                gpu=gpu_info(app, index), dispatcher_address=f"127.0.0.1:{dispatcher.port}"
            )
        )


def mps_spec(
    name: str = "job",
    sm: int = 50,
    quota: float = 50.0,
    limit: float = 0.0,
    memory_gib: float = 4.0,
    priority: int = 5,
    policy: str = "",
    kind: int = placement_pb2.JOB_KIND_INFERENCE,
    task_key: str = "",
) -> placement_pb2.JobSpec:
    return placement_pb2.JobSpec(
        name=name,
        task_key=task_key,
        kind=kind,
        priority=common_pb2.Priority(level=priority),
        resources=common_pb2.Resources(
            memory_bytes=int(memory_gib * GIB),
            mps=common_pb2.SpatioTemporalShare(
                sm_percent=sm,
                quota=common_pb2.TimeQuota(request_percent=quota, limit_percent=limit),
            ),
        ),
        policy=policy,
    )


async def submit(
    stub: placement_pb2_grpc.PlacementStub, spec: placement_pb2.JobSpec, request_id: str = ""
) -> placement_pb2.Job:
    return await stub.SubmitJob(
        placement_pb2.SubmitJobRequest(request_id=request_id or uuid.uuid4().hex, spec=spec)
    )


def counter(name: str, **labels: str) -> float:
    """A placement metric's value in this process (0 before it was first counted)."""
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0
