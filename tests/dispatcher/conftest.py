"""A live dispatcher in the test process: simulated GPU, real Unix socket, real gRPC server."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuloom.services.dispatcher.app import GpuDispatcher, start_gpu_dispatcher
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.v1 import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc

GIB = 1 << 30


@dataclass
class LiveDispatcher:
    dispatcher: GpuDispatcher
    stub: dispatcher_pb2_grpc.DispatcherStub
    data_dir: Path

    @property
    def socket_path(self) -> str:
        return self.dispatcher.core.socket_path

    async def reserve(self, **share: Any) -> dispatcher_pb2.Assignment:
        """Reserve(reserve_request(**share))."""
        return await self.stub.Reserve(reserve_request(**share))


def reserve_request(
    sm: int = 100,
    request: float = 50.0,
    limit: float | None = None,
    memory_gib: float = 1.0,
    mode: int = 0,
    assignment_id: str | None = None,
) -> dispatcher_pb2.ReserveRequest:
    return dispatcher_pb2.ReserveRequest(
        assignment_id=assignment_id or f"job-{uuid.uuid4().hex[:8]}",
        client_name="test job",
        priority=common_pb2.Priority(level=5),
        memory_cap_bytes=int(memory_gib * GIB),
        share=common_pb2.SpatioTemporalShare(
            sm_percent=sm,
            quota=common_pb2.TimeQuota(
                request_percent=request, limit_percent=request if limit is None else limit
            ),
        ),
        mode=mode,
    )


def dispatcher_settings(**overrides: object) -> DispatcherSettings:
    values: dict[str, object] = {
        "window_ms": 200.0,
        "policy_args": "tokens.lease_min_s=0.002,tokens.lease_initial_s=0.01,"
        "tokens.lease_max_s=0.02",
        "register_timeout_s": 1.0,
        # The token path's mechanics (leases over the socket and the desk) are what these tests
        # drive; the default policy (composed) is tested where it is named (tests/shim).
        "policy": "spatiotemporal",
        # Off unless a test turns it on with the fake driver's path: "libcuda.so.1" would be
        # whichever fake driver this test process loaded last.
        "suspend_release_memory": False,
    }
    values.update(overrides)
    return DispatcherSettings(**values)  # type: ignore[arg-type]


async def start_live(data_dir: Path, **overrides: object) -> tuple[GpuDispatcher, grpc.aio.Channel]:
    backend = SimulatedBackend("A100-80GB")
    dispatcher = await start_gpu_dispatcher(
        dispatcher_settings(**overrides), backend, backend.gpu(0), "127.0.0.1", 0, data_dir
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{dispatcher.port}")
    return dispatcher, channel


@pytest.fixture
async def live(short_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[LiveDispatcher]:
    async with running_live(short_dir, **getattr(request, "param", {})) as running:
        yield running


@contextlib.asynccontextmanager
async def running_live(data_dir: Path, **overrides: object) -> AsyncIterator[LiveDispatcher]:
    """A live dispatcher (start_live) and a stub of it, stopped on the way out."""
    dispatcher, channel = await start_live(data_dir, **overrides)
    try:
        yield LiveDispatcher(dispatcher, dispatcher_pb2_grpc.DispatcherStub(channel), data_dir)
    finally:
        await channel.close()
        await stop_live(dispatcher)


async def stop_live(dispatcher: GpuDispatcher) -> None:
    await dispatcher.server.stop(0)
    dispatcher.channel.stop()
    if dispatcher.kernel_tables is not None:
        await dispatcher.kernel_tables.close()
    dispatcher.engine.stop()
    if dispatcher.models is not None:
        await dispatcher.models.close()
    if dispatcher.mps is not None:
        dispatcher.mps.stop()
