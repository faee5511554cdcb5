"""A running profiler wired to a running profile store (real gRPC, PostgreSQL, Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.services.profiler.settings import ProfilerSettings
from gpuloom.v1 import profiler_pb2, profiler_pb2_grpc
from tests.profile_store.conftest import store_app, stub  # noqa: F401  (fixtures)


@pytest.fixture
async def profiler_app(store_app: ProfileStoreApp) -> AsyncIterator[ProfilerApp]:  # noqa: F811
    settings = ProfilerSettings(port=0, profile_store_address=f"127.0.0.1:{store_app.port}")
    app = await ProfilerApp.start(settings, "127.0.0.1")
    yield app
    await app.stop(grace_s=0)


@pytest.fixture
async def profiler(profiler_app: ProfilerApp) -> AsyncIterator[profiler_pb2_grpc.ProfilerStub]:
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{profiler_app.port}",
        options=[("grpc.max_send_message_length", 64 << 20)],
    ) as channel:
        yield profiler_pb2_grpc.ProfilerStub(channel)


async def session_when_closed(
    client: profiler_pb2_grpc.ProfilerStub, session_id: str, timeout_s: float = 10.0
) -> profiler_pb2.Session:
    """The session once it is no longer open (or as it is when the timeout passes)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        request = profiler_pb2.GetSessionRequest(session_id=session_id)
        session = await client.GetSession(request)
        if session.state != profiler_pb2.SESSION_STATE_OPEN:
            return session
        if asyncio.get_running_loop().time() > deadline:
            return session
        await asyncio.sleep(0.05)
